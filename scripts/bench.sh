#!/usr/bin/env bash
# Benchmarks that print figures (never timed assertions). Usage: scripts/bench.sh engine
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
what="${1:-engine}"; shift || true
[ -x build/bin/twinkle-engine ] || ./scripts/setup.sh
case "$what" in
  engine) exec .venv/bin/python tests/bench/bench_engine.py "$@" ;;
  *) echo "usage: scripts/bench.sh engine [--layers N] [--repeats N]" >&2; exit 2 ;;
esac
