#!/usr/bin/env bash
# The CUDA build of the engine side, compiled where there is no GPU: configures
# build-cuda/ with -DTWINKLE_WITH_CUDA=ON (libtorch_cuda, the SGMV .cu kernels through nvcc,
# ProcessGroupNCCL against the toolkit's nccl.h) and builds the engine worker and the kernel
# tests. The coordinator has no torch, so the CPU build's binaries are the same for it.
# Then runs what needs no GPU: the kernels' CPU tests and the CUDA-built engine's numerics on
# CPU (an engine linked with libtorch_cuda must still work where no GPU is).
#
# Usage: scripts/cuda_build.sh [--compile-only]
# Needs scripts/setup.sh to have run (the venv's CUDA torch wheel, ccache) and nvcc whose CUDA
# major equals the wheel's (cmake/TorchCuda.cmake checks). Without nvcc it says so and exits 3,
# so a caller can tell "could not try" from "failed" (exit 1).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

compile_only=0
case "${1:-}" in
  --compile-only) compile_only=1 ;;
  "") ;;
  *) echo "usage: scripts/cuda_build.sh [--compile-only]" >&2; exit 2 ;;
esac

NVCC="$(command -v nvcc || true)"
[ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc
if [ -z "$NVCC" ]; then
  echo "cuda_build: nvcc not found (PATH, /usr/local/cuda/bin): cannot build the CUDA engine here" >&2
  exit 3
fi
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || { echo "cuda_build: $PY missing: run scripts/setup.sh first" >&2; exit 1; }
TORCH_DIR="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torch"

export CCACHE_BASEDIR="$ROOT"
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/twinkle/ccache}"
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"
mkdir -p build-cuda
cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DTWINKLE_WITH_CUDA=ON \
  -DCMAKE_CUDA_COMPILER="$NVCC" -DTWINKLE_TORCH_DIR="$TORCH_DIR" -DPython3_EXECUTABLE="$PY" \
  > build-cuda/cmake-configure.log 2>&1 || { cat build-cuda/cmake-configure.log; exit 1; }
grep -E "^-- (CUDA|kernels/)" build-cuda/cmake-configure.log || true
cmake --build build-cuda -j "${TWINKLE_JOBS:-2}" \
  --target twinkle-engine lora_ops_test sgmv_emulation_test paged_attention_test

# Proof that the objects are the CUDA ones, not a CPU build under another name.
if ! ldd build-cuda/bin/twinkle-engine | grep -q libtorch_cuda; then
  echo "cuda_build: build-cuda/bin/twinkle-engine does not link libtorch_cuda" >&2
  exit 1
fi
echo "cuda_build: twinkle-engine links libtorch_cuda; kernels: $(nm -C build-cuda/bin/lora_ops_test | grep -c 'sgmv.*cuda\|Cuda' || true) CUDA symbols in lora_ops_test"
[ "$compile_only" = 1 ] && exit 0

build-cuda/bin/lora_ops_test
build-cuda/bin/sgmv_emulation_test
build-cuda/bin/paged_attention_test
# The CUDA-built engine on CPU: logits and LoRA gradients of every family vs transformers + PEFT.
TWINKLE_ENGINE_BIN="$ROOT/build-cuda/bin/twinkle-engine" "$PY" -m pytest -q -p no:cacheprovider \
  tests/engine/test_model.py tests/engine/test_qwen3_5.py tests/engine/test_qwen3_moe.py -k "logits"
