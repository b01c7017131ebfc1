#!/usr/bin/env bash
# GPU check of the multi-LoRA kernels, for a machine with a GPU, PyTorch (CUDA build), cmake,
# ninja and an nvcc whose major version matches the wheel's CUDA, and none of twinkle's other
# dependencies. Builds kernels/ standalone with CUDA, runs the tests (the CUDA half must run,
# not skip) and the benchmark. Prints each phase's time; the last line is the benchmark's
# `BENCH {json}`. Budget: well under 6 minutes on 16 cores.
#
#   kernels/run_gpu_check.sh [build-dir]       (default /tmp/twinkle-kernels-build)
# Env: PYTHON (default python3), CUDA_ARCHS (default 90 = H100/H200), JOBS (default nproc).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
build="${1:-/tmp/twinkle-kernels-build}"
python="${PYTHON:-python3}"
jobs="${JOBS:-$(nproc)}"
start_all=$(date +%s%N)

seconds_since() {  # seconds since a `date +%s%N` stamp, one decimal (no bc on minimal images)
  local ms=$((($(date +%s%N) - $1) / 1000000))
  printf '%d.%d' $((ms / 1000)) $((ms % 1000 / 100))
}

# phase NAME LIMIT_S CMD...: runs CMD (a program, or a function exported with export -f) under
# a time limit, reports how long it took, and stops the script if it failed.
phase() {
  local name="$1" limit="$2"
  shift 2
  echo "=== ${name}"
  local t0 rc=0
  t0=$(date +%s%N)
  timeout "${limit}" "$@" || rc=$?
  printf 'PHASE %-10s %6s s (rc %d)\n' "${name}" "$(seconds_since "${t0}")" "${rc}"
  if [[ ${rc} -ne 0 ]]; then
    [[ ${rc} -eq 124 ]] && echo "phase ${name} ran past ${limit} s"
    exit "${rc}"
  fi
}

if ! command -v nvcc > /dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc
fi
probe() {
  "${PYTHON:-python3}" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"available", torch.cuda.is_available(),
torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
  "${CUDACXX:-nvcc}" --version | tail -n 2
  cmake --version | head -n 1
  ninja --version
  nvidia-smi -L || true
}
bench() {
  set -o pipefail
  "$1/bin/lora_ops_bench" | tee "$1/bench.txt"
}
export -f probe bench
export PYTHON="${python}"

phase probe 30 bash -c probe
# Located without importing torch (as cmake/TorchDir.cmake does).
torch_dir="$("${python}" -c 'import importlib.util as u; print(u.find_spec("torch").submodule_search_locations[0])')"

phase configure 60 cmake -S "${here}" -B "${build}" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DTWINKLE_WITH_CUDA=ON -DTWINKLE_TORCH_DIR="${torch_dir}" \
  -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90}"
phase build 210 ninja -C "${build}" -j "${jobs}"
phase test 30 "${build}/bin/lora_ops_test" --require-cuda
phase emulation 30 "${build}/bin/sgmv_emulation_test"
phase bench 30 bash -c 'bench "$0"' "${build}"
printf 'PHASE %-10s %6s s\n' total "$(seconds_since "${start_all}")"
# The benchmark's JSON once more as the very last line, for whoever parses this output.
grep '^BENCH ' "${build}/bench.txt" | tail -n 1
