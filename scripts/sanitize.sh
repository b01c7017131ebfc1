#!/usr/bin/env bash
# Sanitizer runs (issue 15, item 8), each in a build tree of its own next to build/:
#   asan   build-asan: ASan + UBSan. The coordinator and every torch-free unit test, run
#          clean; then an e2e subset (tests/e2e/test_hardening.py and test_tinker_http.py)
#          against the instrumented twinkle-server. The engine worker stays build/'s Release
#          binary: the LibTorch wheel is not instrumented, and the worker is not what these
#          suites attack.
#   tsan   build-tsan: ThreadSanitizer on the scheduler, futures and supervisor unit tests.
# Usage: scripts/sanitize.sh [asan|tsan|all]   (default all; needs scripts/setup.sh first)
# Any sanitizer report fails the run (halt_on_error, -fno-sanitize-recover).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MODE="${1:-all}"
PY="$ROOT/.venv/bin/python"
TORCH_DIR="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torch"
export CCACHE_BASEDIR="$ROOT" CCACHE_DIR="${CCACHE_DIR:-${TWINKLE_CACHE:-$HOME/.cache/twinkle}/ccache}"
[ -x build/bin/twinkle-engine ] || { echo "build/bin/twinkle-engine missing: run scripts/setup.sh"; exit 1; }

# Torch-free unit tests (tests/unit without tests/unit/engine and the kernels' tests).
UNIT_TESTS=(config_test auth_test request_guard_test log_test ipc_test future_store_test scheduler_test
            tenancy_test lr_scheduler_test training_inputs_test future_journal_test registry_test
            storage_checkpoint_dir_test storage_filesystem_test storage_names_test
            storage_safetensors_writer_test supervisor_test)
TSAN_TESTS=(scheduler_test future_store_test supervisor_test)

configure() {  # dir sanitize
  mkdir -p "$1"
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTWINKLE_SANITIZE="$2" \
    -DTWINKLE_TORCH_DIR="$TORCH_DIR" -DPython3_EXECUTABLE="$PY" \
    -DTWINKLE_TEST_ENGINE_BINARY="$ROOT/build/bin/twinkle-engine" > "$1/configure.log" 2>&1 \
    || { cat "$1/configure.log"; exit 1; }
}

run_tests() {  # dir test...
  local dir="$1"; shift
  for t in "$@"; do
    echo "   $t"
    "$dir/bin/$t" --gtest_brief=1 > "$dir/$t.log" 2>&1 || { tail -60 "$dir/$t.log"; echo "FAILED: $t ($dir)"; exit 1; }
  done
}

if [ "$MODE" = asan ] || [ "$MODE" = all ]; then
  t=$(date +%s)
  echo "== sanitize: ASan + UBSan (build-asan)"
  configure build-asan "address,undefined"
  cmake --build build-asan -j "${TWINKLE_JOBS:-2}" --target twinkle-server "${UNIT_TESTS[@]}" > build-asan/build.log 2>&1 \
    || { tail -40 build-asan/build.log; exit 1; }
  # The e2e helpers start the engine found beside the server binary.
  ln -sfn "$ROOT/build/bin/twinkle-engine" build-asan/bin/twinkle-engine
  export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:abort_on_error=0"
  export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
  run_tests build-asan "${UNIT_TESTS[@]}"
  echo "   e2e subset against build-asan/bin/twinkle-server"
  TWINKLE_SERVER_BIN="$ROOT/build-asan/bin/twinkle-server" "$PY" -m pytest -q -p no:cacheprovider \
    tests/e2e/test_hardening.py tests/e2e/test_tinker_http.py
  echo "== sanitize: ASan + UBSan clean in $(( $(date +%s) - t )) s"
fi

if [ "$MODE" = tsan ] || [ "$MODE" = all ]; then
  t=$(date +%s)
  echo "== sanitize: TSan (build-tsan)"
  configure build-tsan thread
  cmake --build build-tsan -j "${TWINKLE_JOBS:-2}" --target "${TSAN_TESTS[@]}" > build-tsan/build.log 2>&1 \
    || { tail -40 build-tsan/build.log; exit 1; }
  export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1"
  run_tests build-tsan "${TSAN_TESTS[@]}"
  echo "== sanitize: TSan clean in $(( $(date +%s) - t )) s"
fi
