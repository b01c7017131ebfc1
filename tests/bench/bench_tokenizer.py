#!/usr/bin/env python3
"""Prints the C++ tokenizer's encode speed next to HF tokenizers', per family (tokenizers
trained locally as tests/tokenizer does). Figures only, never assertions.

    .venv/bin/python tests/bench/bench_tokenizer.py [--strings N] [--repeats N]

Measured: Encode alone inside build/bin/twinkle-tokenize (one thread, the per-word cache warm
after the first repeat), HF `Tokenizer.encode` one string at a time on one thread, and HF
`encode_batch` (its own thread pool); plus one 100,000-letter word without a space (the
merge queue's worst case)."""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "tokenizer"))

import corpus  # noqa: E402
import families  # noqa: E402
from tool import TokenizeTool  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strings", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    binary = ROOT / "build" / "bin" / "twinkle-tokenize"
    if not binary.is_file():
        print(f"{binary} is not built: cmake --build build --target twinkle-tokenize", file=sys.stderr)
        return 1
    out = Path(tempfile.mkdtemp(prefix="bench-tokenizer-"))
    print(f"{'family':10} {'chars':>9} {'tokens':>8} {'C++ Mtok/s':>11} {'HF 1-thread':>12} {'HF batch':>9} {'100k word C++ s':>16} {'HF s':>6}")
    for family in families.FAMILIES:
        path = families.build(family, out)
        hf = families.load(path)
        specials = [c for c, _ in family.added]
        texts = corpus.make_strings(seed=1, count=args.strings, specials=specials)
        chars = sum(len(t) for t in texts)
        tool = TokenizeTool(binary, path)
        ours = tool.run([{"bench_encode": texts, "repeats": args.repeats}])[0]
        cpp_rate = ours["tokens"] / ours["seconds"] / 1e6
        tokens = ours["tokens"] // args.repeats
        start = time.perf_counter()
        for _ in range(args.repeats):
            for t in texts:
                hf.encode(t, add_special_tokens=False)
        hf_single = tokens * args.repeats / (time.perf_counter() - start) / 1e6
        start = time.perf_counter()
        for _ in range(args.repeats):
            hf.encode_batch(texts, add_special_tokens=False)
        hf_batch = tokens * args.repeats / (time.perf_counter() - start) / 1e6
        word = "".join(random.Random(3).choice("abcdefghijklmnopqrstuvwxyz") for _ in range(100_000))
        long_ours = tool.run([{"bench_encode": [word], "repeats": 1}])[0]["seconds"]
        start = time.perf_counter()
        hf.encode(word, add_special_tokens=False)
        long_hf = time.perf_counter() - start
        print(f"{family.name:10} {chars:9d} {tokens:8d} {cpp_rate:11.2f} {hf_single:12.2f} {hf_batch:9.2f} "
              f"{long_ours:16.3f} {long_hf:6.3f}")
    print(f"(cores: {os.cpu_count()}; Mtok/s = million tokens per second)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
