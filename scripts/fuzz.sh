#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz, a CMake project of its own: clang, ASan+UBSan,
# ccache) into build-fuzz/ when needed, then runs them.
#   scripts/fuzz.sh TARGET MINUTES      one target for MINUTES (decimals allowed: 0.5)
#   scripts/fuzz.sh all SECONDS_EACH    every target in turn, SECONDS_EACH seconds each
#   scripts/fuzz.sh list                the target names
# Each run starts from a copy of tests/fuzz/corpus/TARGET (the committed seeds are never
# written to) in build-fuzz/runs/TARGET/corpus, which it keeps growing across runs; a crash's
# input is saved as build-fuzz/runs/TARGET/crash-*. Prints per target the executions, exec/s,
# coverage (cov/ft), corpus size and crashes; exits non-zero when any target crashed.
# Environment: FUZZ_JOBS (build jobs, 2), FUZZ_NICE (niceness, 10), FUZZ_RSS_MB (2048).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
TARGETS=(tinker_json_fuzz tinker_proto_fuzz safetensors_fuzz config_yaml_fuzz ipc_envelope_fuzz http_request_fuzz tokenizer_fuzz)
BUILD="$ROOT/build-fuzz"
NICE="nice -n ${FUZZ_NICE:-10}"

usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 1 ] || usage
if [ "$1" = list ]; then printf '%s\n' "${TARGETS[@]}"; exit 0; fi
[ $# -eq 2 ] || usage

build() {
  command -v clang++ >/dev/null || { echo "fuzz: clang++ is missing (scripts/setup.sh installs it)" >&2; exit 1; }
  # Relative paths and no working directory in the cache key, so a fresh clone anywhere hits
  # the cache (with -g, ccache would otherwise hash the build directory into every entry).
  export CCACHE_BASEDIR="$ROOT" CCACHE_NOHASHDIR=1 CCACHE_DIR="${CCACHE_DIR:-${TWINKLE_CACHE:-$HOME/.cache/twinkle}/ccache}"
  if [ ! -f "$BUILD/build.ninja" ]; then
    $NICE cmake -S tests/fuzz -B "$BUILD" -G Ninja -DCMAKE_CXX_COMPILER=clang++ > "$ROOT/build-fuzz.configure.log" 2>&1 \
      || { cat "$ROOT/build-fuzz.configure.log"; exit 1; }
    mv "$ROOT/build-fuzz.configure.log" "$BUILD/configure.log"
  fi
  $NICE cmake --build "$BUILD" -j "${FUZZ_JOBS:-2}" > "$BUILD/build.log" 2>&1 || { tail -50 "$BUILD/build.log"; exit 1; }
}

# run TARGET SECONDS: one libFuzzer run; prints a summary line; returns 1 on a crash.
run() {
  local target=$1 seconds=$2
  local dir="$BUILD/runs/$target"
  mkdir -p "$dir/corpus"
  cp -n "tests/fuzz/corpus/$target/"* "$dir/corpus/" 2>/dev/null || true
  local log="$dir/last.log" rc=0
  local t0; t0=$(date +%s)
  touch "$dir/.started"  # artifacts newer than this are this run's
  # -timeout: one input taking 10 s is a hang; -rss_limit_mb: an input making the target use
  # more memory is a bug (malloc_limit defaults to it, so one huge allocation is caught too).
  (cd "$dir" && $NICE "$BUILD/$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb="${FUZZ_RSS_MB:-2048}" \
      -max_len=65536 -print_final_stats=1 -artifact_prefix="$dir/" corpus) > "$log" 2>&1 || rc=$?
  local took=$(( $(date +%s) - t0 ))
  local runs execs cov ft corp crashes
  runs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$' || echo 0)
  execs=$(grep -oE 'stat::average_exec_per_sec: *[0-9]+' "$log" | grep -oE '[0-9]+$' || echo 0)
  local last; last=$(grep -E '^#[0-9]+' "$log" | grep -E 'cov:' | tail -1 || true)
  cov=$(grep -oE 'cov: [0-9]+' <<<"$last" | grep -oE '[0-9]+' || echo ?)
  ft=$(grep -oE 'ft: [0-9]+' <<<"$last" | grep -oE '[0-9]+' || echo ?)
  corp=$(ls "$dir/corpus" | wc -l)
  crashes=$(find "$dir" -maxdepth 1 -newer "$dir/.started" \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' \
    -o -name 'oom-*' \) | wc -l)
  printf 'fuzz: %-18s %5ss  runs %-10s exec/s %-7s cov %-6s ft %-6s corpus %-6s crashes %s\n' \
    "$target" "$took" "$runs" "$execs" "$cov" "$ft" "$corp" "$crashes"
  if [ "$rc" -ne 0 ] || [ "$crashes" -ne 0 ]; then
    echo "fuzz: $target FAILED (exit $rc); the report:" >&2
    grep -E -A25 '==ERROR|runtime error|deadly signal|Test unit written|out-of-memory|timeout' "$log" | head -60 >&2 || tail -40 "$log" >&2
    return 1
  fi
}

# In a function, so that bash has read the whole script before it runs a long fuzz job: a
# checkout that changes this file meanwhile cannot derail the rest of the run.
main() {
  if [ "$1" != all ] && [[ " ${TARGETS[*]} " != *" $1 "* ]]; then
    echo "fuzz: unknown target '$1' (scripts/fuzz.sh list)" >&2
    exit 2
  fi
  build
  local failed=0
  if [ "$1" = all ]; then
    for t in "${TARGETS[@]}"; do run "$t" "$2" || failed=1; done
  else
    run "$1" "$(awk -v m="$2" 'BEGIN { printf "%d", m * 60 }')" || failed=1
  fi
  exit $failed
}
main "$@"
