"""Pathological single inputs: long runs without a break must neither crash nor go quadratic
(the BPE merges through a priority queue; PCRE2 runs without recursion limits being hit), and
the answer still equals HF's. Times are printed, not asserted."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

import families

LENGTH = 100_000


def _inputs() -> dict[str, str]:
    rng = random.Random(7)
    return {
        "letters_no_space": "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(LENGTH)),
        "one_letter": "a" * LENGTH,
        "spaces": " " * LENGTH,
        "newlines": "\n" * LENGTH,
        "spaces_then_letter": " " * LENGTH + "x",
        "tabs_spaces": " \t" * (LENGTH // 2),
        "digits": "".join(rng.choice("0123456789") for _ in range(LENGTH)),
        "cjk": "".join(chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(LENGTH)),
        "emoji": "\U0001F468\u200d\U0001F469\u200d\U0001F467" * (LENGTH // 5),
        "punct": "!?" * (LENGTH // 2),
        "contractions": "'s" * (LENGTH // 2),
        "special_prefixes": "<|im_" * (LENGTH // 5),
        "specials": "<|im_start|>" * (LENGTH // 12),
        "combining": "e" + "\u0301" * LENGTH,
    }


@pytest.mark.parametrize("name", ["qwen3", "llama3", "bytelevel"])
def test_long_runs_equal_hf(name: str, family_paths: dict[str, Path], tools) -> None:
    hf = families.load(family_paths[name])
    inputs = _inputs()
    texts = list(inputs.values())
    theirs = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    start = time.monotonic()
    ours = tools[name].encode(texts)
    elapsed = time.monotonic() - start
    for label, a, b in zip(inputs, ours, theirs):
        assert a == b, f"{name}/{label}: {len(a)} ids vs HF's {len(b)}"
    print(f"\n{name}: {len(texts)} inputs of ~{LENGTH} characters encoded in {elapsed:.2f} s (process included)")
