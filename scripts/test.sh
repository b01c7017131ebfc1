#!/usr/bin/env bash
# Runs every test: setup (idempotent, quick when nothing changed), the Python SDK's
# clean-venv install (scripts/check_client_install.sh, offline from setup's wheelhouse), then
# ctest (GoogleTest units and the link-isolation check), the CUDA build of the engine side
# (scripts/cuda_build.sh; skipped with a message where there is no nvcc), a short run of every fuzz target
# (scripts/fuzz.sh; TWINKLE_FUZZ_SECONDS each, default 20), then pytest (end-to-end against
# the real binaries, and tests/deploy: manifests, Prometheus rules and dashboard, logs).
# Exits non-zero on any failure.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

start=$(date +%s)
"$ROOT/scripts/setup.sh"
echo "== test: setup took $(( $(date +%s) - start )) s"

t=$(date +%s)
echo "== test: client install (client/python into a clean venv without torch, offline from .wheelhouse)"
TWINKLE_WHEELHOUSE="$ROOT/.wheelhouse" PYTHON="$ROOT/.venv/bin/python" "$ROOT/scripts/check_client_install.sh"
echo "== test: client install took $(( $(date +%s) - t )) s"

t=$(date +%s)
echo "== test: ctest"
ctest --test-dir build --output-on-failure -j 2
echo "== test: ctest took $(( $(date +%s) - t )) s"

t=$(date +%s)
echo "== test: CUDA build (build-cuda/: the engine and kernels with nvcc; kernel CPU tests; the CUDA-built engine's numerics on CPU)"
cuda_rc=0; "$ROOT/scripts/cuda_build.sh" || cuda_rc=$?
if [ "$cuda_rc" = 3 ]; then
  echo "== test: CUDA build SKIPPED: no nvcc on this machine (scripts/cuda_build.sh said why)"
elif [ "$cuda_rc" != 0 ]; then
  exit "$cuda_rc"
fi
echo "== test: CUDA build took $(( $(date +%s) - t )) s"

t=$(date +%s)
echo "== test: fuzz (each libFuzzer target ${TWINKLE_FUZZ_SECONDS:-20} s on its seed corpus, ASan+UBSan; long runs: scripts/fuzz.sh)"
"$ROOT/scripts/fuzz.sh" all "${TWINKLE_FUZZ_SECONDS:-20}"
echo "== test: fuzz took $(( $(date +%s) - t )) s"

t=$(date +%s)
echo "== test: pytest tests/client (the Python SDK's client-side components)"
"$ROOT/.venv/bin/python" -m pytest tests/client -q "$@"
echo "== test: pytest tests/client took $(( $(date +%s) - t )) s"

t=$(date +%s)
echo "== test: pytest tests/e2e (the server as a whole)"
"$ROOT/.venv/bin/python" -m pytest tests/e2e -q "$@"
echo "== test: pytest tests/e2e took $(( $(date +%s) - t )) s"

t=$(date +%s)
echo "== test: pytest tests/deploy (k8s manifests, dashboard + alert rules on a real Prometheus, JSON logs, image plan; building and running the image: TWINKLE_IMAGE_TEST=1)"
"$ROOT/.venv/bin/python" -m pytest tests/deploy -q "$@"
echo "== test: pytest tests/deploy took $(( $(date +%s) - t )) s"

t=$(date +%s)
echo "== test: pytest tests/tokenizer (the C++ tokenizer and chat renderers vs HF tokenizers / transformers)"
"$ROOT/.venv/bin/python" -m pytest tests/tokenizer -q "$@"
echo "== test: pytest tests/tokenizer took $(( $(date +%s) - t )) s"

t=$(date +%s)
echo "== test: pytest tests/engine (numerics vs transformers, PEFT, torch.optim)"
"$ROOT/.venv/bin/python" -m pytest tests/engine -q "$@"
echo "== test: pytest tests/engine took $(( $(date +%s) - t )) s"
echo "== test: all passed in $(( $(date +%s) - start )) s"
