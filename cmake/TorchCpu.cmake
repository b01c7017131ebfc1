# Imports LibTorch's CPU libraries (torch_cpu, c10) from the pinned PyPI torch wheel.
#
# Why not find_package(Torch): the PyPI wheel is a CUDA build and its TorchConfig.cmake
# insists on finding a CUDA toolkit that matches the wheel. The CPU engine needs neither, so
# we import only the CPU shared libraries and the headers. TWINKLE_WITH_CUDA (see the top
# level) adds torch_cuda/c10_cuda on top of this and checks the toolkit version.
if(NOT TWINKLE_TORCH_DIR)
  message(FATAL_ERROR "TWINKLE_TORCH_DIR is not set: point it at site-packages/torch of the "
                      "venv (scripts/setup.sh does this)")
endif()
set(_torch_lib "${TWINKLE_TORCH_DIR}/lib")

# twinkle_import_torch_libs(NAME lib...): imports each lib<lib>.so of the wheel and bundles
# them as the INTERFACE target twinkle_torch_NAME_all, aliased twinkle::torch_NAME.
function(twinkle_import_torch_libs name)
  foreach(_lib IN LISTS ARGN)
    if(NOT EXISTS "${_torch_lib}/lib${_lib}.so")
      message(FATAL_ERROR "LibTorch library lib${_lib}.so not found in ${_torch_lib}")
    endif()
    add_library(twinkle_torch_${_lib} SHARED IMPORTED GLOBAL)
    set_target_properties(twinkle_torch_${_lib} PROPERTIES IMPORTED_LOCATION "${_torch_lib}/lib${_lib}.so")
    list(APPEND _targets twinkle_torch_${_lib})
  endforeach()
  add_library(twinkle_torch_${name}_all INTERFACE)
  add_library(twinkle::torch_${name} ALIAS twinkle_torch_${name}_all)
  target_link_libraries(twinkle_torch_${name}_all INTERFACE ${_targets})
endfunction()

twinkle_import_torch_libs(cpu torch_cpu c10)
# The torch headers are third-party: include them as SYSTEM so our warnings stay ours.
target_include_directories(twinkle_torch_cpu_all SYSTEM INTERFACE
  "${TWINKLE_TORCH_DIR}/include"
  "${TWINKLE_TORCH_DIR}/include/torch/csrc/api/include")
# The wheel is built with the C++11 ABI; a mismatch gives link errors on std::string symbols.
target_compile_definitions(twinkle_torch_cpu_all INTERFACE _GLIBCXX_USE_CXX11_ABI=1)
set(TWINKLE_TORCH_LIB_DIR "${_torch_lib}" CACHE INTERNAL "")
