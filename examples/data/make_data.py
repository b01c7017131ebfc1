#!/usr/bin/env python3
"""Writes the examples' small local datasets (deterministic; no download):

- countdown.jsonl: Countdown tasks in the columns of zouxuhong/Countdown-Tasks-3to4 (`nums`,
  `target`), 3 or 4 numbers each, every target reachable with + - * and each number once.
- self_cognition.jsonl is committed as it is (written by hand in swift/self-cognition's
  columns: `query`, `response` with {{NAME}} / {{AUTHOR}} placeholders, `tag`).

Usage: python examples/data/make_data.py   (rewrites countdown.jsonl next to this file)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
COUNT = 64
SEED = 7


def countdown_task(rng: random.Random) -> dict:
    size = rng.choice([3, 4])
    nums = [rng.randint(1, 99) for _ in range(size)]
    # Build a target by combining the numbers in a random order with random operators.
    order = nums[:]
    rng.shuffle(order)
    value = order[0]
    for n in order[1:]:
        op = rng.choice("+-*" if value * n < 1000 else "+-")
        value = value + n if op == "+" else value - n if op == "-" else value * n
    if value <= 0:
        return countdown_task(rng)
    return {"nums": nums, "target": value}


def main() -> None:
    rng = random.Random(SEED)
    rows = [countdown_task(rng) for _ in range(COUNT)]
    path = HERE / "countdown.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
