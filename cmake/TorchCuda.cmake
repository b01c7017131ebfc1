# TWINKLE_WITH_CUDA: adds LibTorch's CUDA libraries (torch_cuda, c10_cuda) on top of
# TorchCpu.cmake and enables nvcc for kernels/. The wheel's CUDA major version must equal
# nvcc's, or kernels built here would not run against the wheel's CUDA runtime.
# The reference GPU is an H100/H200 (sm_90); CMake would otherwise pick the toolkit's default.
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
  set(CMAKE_CUDA_ARCHITECTURES 90 CACHE STRING "CUDA architectures to build for")
endif()
enable_language(CUDA)
file(STRINGS "${TWINKLE_TORCH_DIR}/version.py" _torch_cuda_line REGEX "^cuda")
string(REGEX MATCH "'([0-9]+)\\.([0-9]+)'" _m "${_torch_cuda_line}")
if(NOT _m)
  message(FATAL_ERROR "TWINKLE_WITH_CUDA: the torch wheel at ${TWINKLE_TORCH_DIR} is not a CUDA "
                      "build (version.py: ${_torch_cuda_line})")
endif()
set(TWINKLE_TORCH_CUDA_MAJOR "${CMAKE_MATCH_1}")
set(_torch_cuda "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}")
string(REGEX MATCH "^[0-9]+" _nvcc_major "${CMAKE_CUDA_COMPILER_VERSION}")
if(NOT _nvcc_major STREQUAL TWINKLE_TORCH_CUDA_MAJOR)
  message(FATAL_ERROR "TWINKLE_WITH_CUDA: nvcc is CUDA ${CMAKE_CUDA_COMPILER_VERSION} but the torch "
                      "wheel was built for CUDA ${_torch_cuda}; install a matching "
                      "toolkit or a matching torch wheel")
endif()
message(STATUS "CUDA: nvcc ${CMAKE_CUDA_COMPILER_VERSION} matches the torch wheel (CUDA ${_torch_cuda})")
twinkle_import_torch_libs(cuda torch_cuda c10_cuda)
target_link_libraries(twinkle_torch_cuda_all INTERFACE twinkle::torch_cpu)
target_compile_definitions(twinkle_torch_cuda_all INTERFACE TWINKLE_WITH_CUDA=1)
