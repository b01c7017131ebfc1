#!/usr/bin/env bash
# Benchmarks that print figures (never timed assertions).
# Usage: scripts/bench.sh engine | sampler | scheduler | openai [options of the bench]
#   engine     tests/bench/bench_engine.py: the engine process over its IPC
#   sampler    tests/bench/bench_sampler.py: generation (multi-adapter decode, vs
#              transformers+PEFT generate, continuous batching under Poisson arrivals)
#   scheduler  tests/bench/bench_scheduler.py: scheduler policy (build/bin/scheduler_bench),
#              fused vs unfused through the full server (8 tenants), no-op RPC latency
#              (build/bin/noop_latency). Binaries from $TWINKLE_BUILD_DIR (default build/).
#   memory     tests/bench/bench_memory.py: peak RSS of one training step vs sequence length
#              (1K..32K tokens), with and without activation checkpointing
#   openai     tests/bench/bench_openai.py: /v1/completions through the full server with the
#              openai SDK, 16 concurrent clients: time to first token and tokens/s, streaming
#              vs not
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
what="${1:-engine}"; shift || true
[ -x build/bin/twinkle-engine ] || ./scripts/setup.sh
case "$what" in
  engine) exec .venv/bin/python tests/bench/bench_engine.py "$@" ;;
  memory) exec .venv/bin/python tests/bench/bench_memory.py "$@" ;;
  sampler) exec .venv/bin/python tests/bench/bench_sampler.py "$@" ;;
  scheduler)
    bin="${TWINKLE_BUILD_DIR:-build}/bin"
    need=(twinkle-server twinkle-engine scheduler_bench noop_latency)
    missing() { for b in "${need[@]}"; do [ -x "$bin/$b" ] || return 0; done; return 1; }
    if missing && [ -z "${TWINKLE_BUILD_DIR:-}" ]; then ./scripts/setup.sh; fi
    for b in "${need[@]}"; do
      [ -x "$bin/$b" ] || { echo "$bin/$b is not built: run ./scripts/setup.sh" >&2; exit 1; }
    done
    exec .venv/bin/python tests/bench/bench_scheduler.py "$@" ;;
  openai)
    bin="${TWINKLE_BUILD_DIR:-build}/bin"
    for b in twinkle-server twinkle-engine; do
      [ -x "$bin/$b" ] || { echo "$bin/$b is not built: run ./scripts/setup.sh" >&2; exit 1; }
    done
    exec .venv/bin/python tests/bench/bench_openai.py "$@" ;;
  *) echo "usage: scripts/bench.sh engine [--layers N] [--repeats N] [--family qwen3|qwen3_5|qwen3_moe|qwen3_5_moe] [--ranks N]" >&2
     echo "       scripts/bench.sh memory [--lengths 1024,...] [--settings plain,checkpointed,whole] [--vocab N] [--hidden N] [--layers N] [--engine-bin PATH]" >&2
     echo "       scripts/bench.sh sampler [--layers N] [--steps N] [--max-tokens N] [--repeats N] [--seconds S] [--load X] [--threads N]" >&2
     echo "       scripts/bench.sh scheduler [--seconds S] [--rounds N] [--tenants N] [--tokens N] [--noop-calls N]" >&2
     echo "       scripts/bench.sh openai [--clients N] [--requests N] [--max-tokens N] [--prompt-tokens N] [--rounds N]" >&2
     exit 2 ;;
esac
