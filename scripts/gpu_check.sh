#!/usr/bin/env bash
# The GPU check (issue 17, docs/device_pool.md): on a machine with the pinned torch wheel
# (.venv, from scripts/setup.sh), a CUDA toolkit matching it, cmake and ninja, builds the
# CUDA engine and kernels and runs, on the GPUs:
#   kernels   the SGMV / LoRA kernels against their CPU twins (lora_ops_test --require-cuda),
#             the emulation and paged-attention tests
#   parity    fp32 parity (tests/engine/test_model.py) and bf16/fp16 parity
#             (tests/engine/test_precision.py) with the engine on cuda:0
#   nccl      with 2+ GPUs: two engines in one NCCL group vs one engine
#             (tests/engine/test_data_parallel.py, on cuda:0 and cuda:1)
#   bench     scripts/bench.sh engine (prints BENCH lines)
# Each step prints "GPU_CHECK <step> ok|FAIL|SKIP <seconds>s"; the exit status is 1 if any failed.
# Usage: scripts/gpu_check.sh [--build-dir DIR] [--skip-build] [--skip-bench] [--gpus N] [--dry-run]
#   --gpus N    take N GPUs as present instead of asking nvidia-smi (0 .. 64)
#   --dry-run   print each step's command and run nothing (needs no GPU)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

usage() {
  echo "usage: scripts/gpu_check.sh [--build-dir DIR] [--skip-build] [--skip-bench] [--gpus N] [--dry-run]" >&2
  exit 2
}

build_dir="build-cuda"
skip_build=0
skip_bench=0
dry_run=0
gpus=""
while (($#)); do
  case "$1" in
    --build-dir) [ $# -ge 2 ] && [ -n "$2" ] || usage; build_dir="$2"; shift 2 ;;
    --skip-build) skip_build=1; shift ;;
    --skip-bench) skip_bench=1; shift ;;
    --gpus)
      [ $# -ge 2 ] || usage
      [[ "$2" =~ ^[0-9]+$ ]] && [ "$2" -le 64 ] || { echo "--gpus: '$2' is not a count from 0 to 64" >&2; exit 2; }
      gpus="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage ;;
    *) echo "unknown argument '$1'" >&2; usage ;;
  esac
done

if [ -z "$gpus" ]; then
  if [ "$dry_run" = 1 ]; then
    gpus=0
  elif command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
  else
    gpus=0
  fi
fi
if [ "$gpus" -lt 1 ] && [ "$dry_run" = 0 ]; then
  echo "gpu_check: no GPU found (nvidia-smi lists none); use --dry-run to see the steps" >&2
  exit 1
fi

py="$ROOT/.venv/bin/python"
engine="$ROOT/$build_dir/bin/twinkle-engine"
declare -a names=() commands=()
step() { names+=("$1"); commands+=("$2"); }

if [ "$skip_build" = 0 ]; then
  step build "cmake -S . -B $build_dir -G Ninja -DCMAKE_BUILD_TYPE=Release -DTWINKLE_WITH_CUDA=ON && cmake --build $build_dir -j \$(nproc)"
fi
step kernels "$build_dir/bin/lora_ops_test --require-cuda && $build_dir/bin/sgmv_emulation_test && $build_dir/bin/paged_attention_test"
step parity "TWINKLE_ENGINE_BIN=$engine TWINKLE_TEST_DEVICE=cuda:0 $py -m pytest tests/engine/test_model.py tests/engine/test_precision.py -q"
if [ "$gpus" -ge 2 ]; then
  step nccl "TWINKLE_ENGINE_BIN=$engine TWINKLE_TEST_DEVICE=cuda:0 TWINKLE_TEST_DEVICES=cuda:0,cuda:1 $py -m pytest tests/engine/test_data_parallel.py -q"
else
  names+=("nccl"); commands+=("")  # SKIP: needs 2 GPUs
fi
if [ "$skip_bench" = 0 ]; then
  step bench "TWINKLE_ENGINE_BIN=$engine scripts/bench.sh engine --layers 4 --repeats 2"
fi

failed=0
for i in "${!names[@]}"; do
  name="${names[$i]}"; cmd="${commands[$i]}"
  if [ -z "$cmd" ]; then
    echo "GPU_CHECK $name SKIP 0s (needs 2 GPUs, found $gpus)"
    continue
  fi
  if [ "$dry_run" = 1 ]; then
    echo "STEP $name: $cmd"
    continue
  fi
  start=$(date +%s)
  if bash -c "$cmd"; then
    echo "GPU_CHECK $name ok $(( $(date +%s) - start ))s"
  else
    echo "GPU_CHECK $name FAIL $(( $(date +%s) - start ))s"
    failed=1
    [ "$name" = build ] && break  # nothing else can run
  fi
done
exit "$failed"
