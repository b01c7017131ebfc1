# Standalone kernels/ only: sets TWINKLE_TORCH_DIR (site-packages/torch of a PyTorch wheel),
# which ../cmake/TorchCpu.cmake imports LibTorch from. In order of preference:
#   -DTWINKLE_TORCH_DIR=...            as the main project takes it;
#   -DTorch_DIR=<torch>/share/cmake/Torch, the usual LibTorch hint (only the path is used:
#                                      TorchConfig.cmake would demand a matching toolkit);
#   the torch `python3` would import, located without importing it (importing is slow).
if(NOT TWINKLE_TORCH_DIR AND Torch_DIR)
  get_filename_component(TWINKLE_TORCH_DIR "${Torch_DIR}/../../.." ABSOLUTE)
endif()
if(NOT TWINKLE_TORCH_DIR)
  find_package(Python3 COMPONENTS Interpreter)
  if(Python3_Interpreter_FOUND)
    execute_process(
      COMMAND "${Python3_EXECUTABLE}" -c
              "import importlib.util as u; s = u.find_spec('torch'); print(s.submodule_search_locations[0] if s else '')"
      OUTPUT_VARIABLE TWINKLE_TORCH_DIR OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  endif()
endif()
if(NOT TWINKLE_TORCH_DIR OR NOT EXISTS "${TWINKLE_TORCH_DIR}/version.py")
  message(FATAL_ERROR "kernels/: no PyTorch wheel found (TWINKLE_TORCH_DIR='${TWINKLE_TORCH_DIR}'); "
                      "pass -DTWINKLE_TORCH_DIR=<site-packages/torch> or -DTorch_DIR=...")
endif()
set(TWINKLE_TORCH_DIR "${TWINKLE_TORCH_DIR}" CACHE PATH "site-packages/torch of the PyTorch wheel")
message(STATUS "kernels/: LibTorch from ${TWINKLE_TORCH_DIR}")
