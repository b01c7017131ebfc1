"""Independent reference facts about a model directory, read with the safetensors library."""

from __future__ import annotations

import json
import math
from pathlib import Path

from safetensors import safe_open


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files: the shards listed in model.safetensors.index.json, or model.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    return [model_dir / "model.safetensors"]


def parameter_count(model_dir: Path) -> int:
    """Total elements over every tensor stored in the model's safetensors (headers only).

    A tied lm_head is not stored, so it is counted once, as the embedding.
    """
    total = 0
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="numpy") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not iterable
                total += math.prod(handle.get_slice(key).get_shape())
    return total


def architecture(model_dir: Path) -> str:
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    return str(config["architectures"][0])
