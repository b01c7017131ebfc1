#!/usr/bin/env bash
# Sanitizer runs (issue 15, item 8), each in a build tree of its own next to build/:
#   asan   build-asan: ASan + UBSan. The coordinator and every torch-free unit test, run
#          clean; then an e2e subset (tests/e2e/test_hardening.py and test_tinker_http.py)
#          against the instrumented twinkle-server. The engine worker stays build/'s Release
#          binary: the LibTorch wheel is not instrumented, and the worker is not what these
#          suites attack.
#   tsan   build-tsan: ThreadSanitizer on the scheduler, futures, supervisor and registry
#          unit tests. Debian's libabsl is not built with -fsanitize=thread (TSan would not
#          see absl::Mutex acquire/release and reports false races), so abseil itself is
#          built instrumented first: Debian's source tarball (SHA-256 pinned below, cached
#          under ${TWINKLE_CACHE:-~/.cache/twinkle}/), Debian's ABI options plus upstream's
#          TSan-annotation fix, the same compiler, static, into build-tsan/absl/install, which
#          build-tsan's find_package(absl) takes (absl_DIR). Each test binary is checked to
#          hold only that abseil (no libabsl .so, no Debian-namespace absl symbol).
#          scripts/tsan.supp covers uninstrumented libraries only (each line justified there).
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
TSAN_TESTS=(scheduler_test future_store_test supervisor_test registry_test)

configure() {  # dir sanitize [cmake args...]
  mkdir -p "$1"
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTWINKLE_SANITIZE="$2" "${@:3}" \
    -DTWINKLE_TORCH_DIR="$TORCH_DIR" -DPython3_EXECUTABLE="$PY" \
    -DTWINKLE_TEST_ENGINE_BINARY="$ROOT/build/bin/twinkle-engine" > "$1/configure.log" 2>&1 \
    || { cat "$1/configure.log"; exit 1; }
}

run_tests() {  # dir test...
  local dir="$1" t; shift
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

# Abseil for build-tsan, instrumented. Debian's source (the orig tarball of the libabsl the
# normal build links); the SHA-256 is the one in Debian's abseil_20220623.1-1+deb12u2.dsc.
ABSL_VERSION=20220623.1
ABSL_SHA256=abfe2897f3a30edaa74bc34365afe3c2a3cd012091a97dc7e008f7016adcd5fe
ABSL_URL="http://deb.debian.org/debian/pool/main/a/abseil/abseil_${ABSL_VERSION}.orig.tar.gz"
ABSL_PREFIX="$ROOT/build-tsan/absl/install"
TSAN_FLAGS="-fsanitize=thread -fno-omit-frame-pointer -g"

ABSL_TSAN_PATCH='--- a/absl/synchronization/mutex.cc
+++ b/absl/synchronization/mutex.cc
@@ -562,10 +562,15 @@
 void Mutex::IncrementSynchSem(Mutex *mu, PerThreadSynch *w) {
   if (mu) {
     ABSL_TSAN_MUTEX_PRE_DIVERT(mu, 0);
-  }
-  PerThreadSem::Post(w->thread_identity());
-  if (mu) {
+    // We miss synchronization around passing PerThreadSynch between threads
+    // since it happens inside of the Mutex code, so we need to ignore all
+    // accesses to the object.
+    ABSL_ANNOTATE_IGNORE_READS_AND_WRITES_BEGIN();
+    PerThreadSem::Post(w->thread_identity());
+    ABSL_ANNOTATE_IGNORE_READS_AND_WRITES_END();
     ABSL_TSAN_MUTEX_POST_DIVERT(mu, 0);
+  } else {
+    PerThreadSem::Post(w->thread_identity());
   }
 }
 
'

build_tsan_absl() {  # compiler: builds abseil into $ABSL_PREFIX unless that build is current
  local cxx="$1" cache="${TWINKLE_CACHE:-$HOME/.cache/twinkle}" dir="$ROOT/build-tsan/absl"
  local tarball="$cache/abseil_${ABSL_VERSION}.orig.tar.gz"
  local stamp="$ABSL_SHA256 $(sha256sum <<< "$ABSL_TSAN_PATCH" | cut -c1-16) $cxx $("$cxx" --version | head -1) $TSAN_FLAGS"
  if [ -f "$ABSL_PREFIX/.twinkle-stamp" ] && [ "$(cat "$ABSL_PREFIX/.twinkle-stamp")" = "$stamp" ]; then
    echo "   abseil $ABSL_VERSION (TSan) current in build-tsan/absl/install"; return
  fi
  mkdir -p "$cache"
  if [ ! -f "$tarball" ]; then
    echo "   downloading $ABSL_URL"
    curl -fsSL --retry 2 -o "$tarball.part" "$ABSL_URL" || { echo "download failed: $ABSL_URL"; exit 1; }
    mv "$tarball.part" "$tarball"
  fi
  local got; got="$(sha256sum "$tarball" | cut -d' ' -f1)"
  if [ "$got" != "$ABSL_SHA256" ]; then
    echo "SHA-256 mismatch for $tarball:"
    echo "   expected $ABSL_SHA256"
    echo "   got      $got"
    echo "Not building from it. Delete the file to download it again."
    exit 1
  fi
  echo "   building abseil $ABSL_VERSION with $TSAN_FLAGS ($cxx)"
  rm -rf "$dir"; mkdir -p "$dir"
  tar -xzf "$tarball" -C "$dir" && mv "$dir/abseil-$ABSL_VERSION" "$dir/src"
  # Debian's ABI options (debian/patches/configure.diff): absl::any/optional/string_view/
  # variant are abseil's own types, hardened mode on. The inline namespace stays upstream's
  # lts_20220623 (Debian's is debian3), so a Debian abseil symbol in a binary is visible.
  local opts="$dir/src/absl/base/options.h"
  sed -i -E -e 's/^(#define ABSL_OPTION_USE_STD_(ANY|OPTIONAL|STRING_VIEW|VARIANT)) 2$/\1 0/' \
            -e 's/^(#define ABSL_OPTION_HARDENED) 0$/\1 1/' "$opts"
  [ "$(grep -cE '^#define ABSL_OPTION_(USE_STD_[A-Z_]+ 0|HARDENED 1)$' "$opts")" = 5 ] \
    || { echo "patching $opts failed"; exit 1; }
  # Upstream's fix of a false report (abseil commit bb7be494, "absl: fix Mutex TSan
  # annotations", Nov 2022, first in 20230125): TSan ignores the synchronization inside the
  # Mutex code, so it misses how a waiter's PerThreadSynch reaches the waking thread and
  # reports Waiter::Post against the mmap that allocated that thread's identity. The fix
  # is abseil's own code, not a suppression; the hunk is upstream's, verbatim.
  patch -s -p1 -d "$dir/src" <<< "$ABSL_TSAN_PATCH" || { echo "patching abseil (bb7be494) failed"; exit 1; }
  # Static: each test binary carries the instrumented copy, so no loader search path can
  # swap in Debian's libabsl_*.so.20220623 (the same file names and SONAMEs), and ldd
  # proves it. C++20 like the project; the flags are TWINKLE_SANITIZE=thread's.
  cmake -S "$dir/src" -B "$dir/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER="$cxx" \
    -DCMAKE_CXX_COMPILER_LAUNCHER="$(command -v ccache || true)" -DCMAKE_CXX_STANDARD=20 \
    -DABSL_PROPAGATE_CXX_STD=ON -DCMAKE_POSITION_INDEPENDENT_CODE=ON -DBUILD_SHARED_LIBS=OFF \
    -DBUILD_TESTING=OFF -DCMAKE_CXX_FLAGS="$TSAN_FLAGS" -DCMAKE_INSTALL_PREFIX="$ABSL_PREFIX" \
    > "$dir/configure.log" 2>&1 || { cat "$dir/configure.log"; exit 1; }
  cmake --build "$dir/build" -j "${TWINKLE_JOBS:-2}" > "$dir/build.log" 2>&1 \
    && cmake --install "$dir/build" > "$dir/install.log" 2>&1 || { tail -40 "$dir/build.log"; exit 1; }
  echo "$stamp" > "$ABSL_PREFIX/.twinkle-stamp"
}

check_tsan_absl() {  # binary: fails unless the only abseil in it is the instrumented one
  local bin="$1" libs syms  # (captured, not piped into grep -q: SIGPIPE under pipefail)
  libs="$(ldd "$bin")"; syms="$(nm -C "$bin")"
  if grep -q 'libabsl' <<< "$libs"; then
    grep libabsl <<< "$libs"; echo "FAILED: $bin loads a shared (uninstrumented) abseil"; exit 1
  fi
  if grep -q 'absl::debian3::' <<< "$syms"; then
    echo "FAILED: $bin holds abseil code compiled from Debian's headers (absl::debian3)"; exit 1
  fi
  grep -qE ' T absl::lts_20220623::Mutex::Lock\(\)' <<< "$syms" \
    || { echo "FAILED: $bin does not define the instrumented absl::Mutex::Lock"; exit 1; }
}

if [ "$MODE" = tsan ] || [ "$MODE" = all ]; then
  t=$(date +%s)
  echo "== sanitize: TSan (build-tsan)"
  CXX_BIN="$(command -v "${CXX:-c++}")"
  mkdir -p build-tsan
  build_tsan_absl "$CXX_BIN"
  [ "$(nm "$ABSL_PREFIX/lib/libabsl_synchronization.a" | grep -c __tsan_)" -gt 0 ] \
    || { echo "FAILED: $ABSL_PREFIX/lib/libabsl_synchronization.a is not instrumented"; exit 1; }
  configure build-tsan thread -DCMAKE_CXX_COMPILER="$CXX_BIN" -Dabsl_DIR:PATH="$ABSL_PREFIX/lib/cmake/absl"
  grep -qxE "absl_DIR:[A-Z]+=$ABSL_PREFIX/lib/cmake/absl" build-tsan/CMakeCache.txt \
    || { echo "FAILED: build-tsan did not take abseil from $ABSL_PREFIX"; exit 1; }
  cmake --build build-tsan -j "${TWINKLE_JOBS:-2}" --target "${TSAN_TESTS[@]}" > build-tsan/build.log 2>&1 \
    || { tail -40 build-tsan/build.log; exit 1; }
  for b in "${TSAN_TESTS[@]}"; do check_tsan_absl "build-tsan/bin/$b"; done
  echo "   ${#TSAN_TESTS[@]} test binaries link only the instrumented abseil (ldd, nm)"
  export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:print_suppressions=1:suppressions=$ROOT/scripts/tsan.supp"
  run_tests build-tsan "${TSAN_TESTS[@]}"
  echo "== sanitize: TSan clean in $(( $(date +%s) - t )) s"
fi
