"""Twinkle model inputs -> twinkle.v1 ForwardRequest fields, and replies back.

Inputs are InputFeatures (input_ids + Twinkle's shifted labels) or Trajectories (encoded here
with the model's template: the server takes token ids only). The server wants HF-style labels
(labels[i] is token i, the server shifts), so shifted labels are shifted back. A packed row
(position_ids restarting at 0) is split into its sequences, which the server batches anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from twinkle.utils import to_int_list

IGNORE = -100


@dataclass
class Encoded:
    """Per-sequence fields of a request, and which row each sequence came from."""

    input_ids: list[list[int]] = field(default_factory=list)
    labels: list[list[int]] = field(default_factory=list)       # HF convention, [] = train all
    trained: list[list[int]] = field(default_factory=list)      # positions (shifted) whose label trains
    row_of: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)


def as_rows(inputs: Any) -> list[Mapping[str, Any]]:
    if isinstance(inputs, Mapping):
        return [inputs]
    rows = list(inputs)
    for row in rows:
        if not isinstance(row, Mapping):
            raise TypeError(f"inputs must be InputFeature / Trajectory dicts, got {type(row).__name__}")
    return rows


def encode_rows(rows: Sequence[Mapping[str, Any]], template: Callable[[], Any]) -> list[Mapping[str, Any]]:
    """Trajectories (rows with messages and no input_ids) encoded with template()."""
    out: list[Mapping[str, Any]] = []
    for row in rows:
        if "input_ids" in row:
            out.append(row)
        elif "messages" in row:
            features = template().batch_encode([row])
            if len(features) != 1:
                raise ValueError(f"a trajectory encoded to {len(features)} sequences; inputs must map to one each")
            out.append(features[0])
        else:
            raise ValueError("each input needs input_ids (an InputFeature) or messages (a Trajectory)")
    return out


def split_rows(rows: Sequence[Mapping[str, Any]]) -> Encoded:
    encoded = Encoded()
    for index, row in enumerate(rows):
        ids = to_int_list(row["input_ids"])
        shifted = to_int_list(row["labels"]) if row.get("labels") is not None else None
        if shifted is not None and len(shifted) != len(ids):
            raise ValueError(f"input {index}: labels ({len(shifted)}) and input_ids ({len(ids)}) differ in length")
        bounds = _segments(row.get("position_ids"), len(ids))
        for start, end in bounds:
            encoded.input_ids.append(ids[start:end])
            encoded.row_of.append(index)
            encoded.lengths.append(end - start)
            if shifted is None:
                encoded.labels.append([])
                encoded.trained.append(list(range(end - start - 1)))
            else:
                piece = shifted[start:end]
                encoded.labels.append([IGNORE] + piece[:-1])
                encoded.trained.append([i for i, v in enumerate(piece[:-1]) if v != IGNORE])
    return encoded


def _segments(position_ids: Any, n: int) -> list[tuple[int, int]]:
    if position_ids is None:
        return [(0, n)]
    positions = to_int_list(position_ids)
    if len(positions) != n:
        raise ValueError(f"position_ids ({len(positions)}) and input_ids ({n}) differ in length")
    starts = [0] + [i for i in range(1, n) if positions[i] == 0]
    return list(zip(starts, starts[1:] + [n]))


def per_sequence(values: Any, name: str, encoded: Encoded) -> list[Any] | None:
    """values given per input row, checked against the rows (packed rows cannot take them)."""
    if values is None:
        return None
    if hasattr(values, "tolist"):
        values = values.tolist()
    values = list(values)
    rows = (max(encoded.row_of) + 1) if encoded.row_of else 0
    if len(values) != rows:
        raise ValueError(f"{name}: {len(values)} values for {rows} inputs")
    if len(encoded.row_of) != rows:
        raise ValueError(f"{name} cannot be given for packed inputs (rows holding several sequences)")
    return values


def advantages_list(values: Any, encoded: Encoded) -> list[float]:
    out = []
    for i, v in enumerate(per_sequence(values, "advantages", encoded) or []):
        if isinstance(v, (list, tuple)):
            if len(set(v)) > 1:
                raise ValueError(f"advantages[{i}]: one advantage per sequence is supported, got per-token values")
            v = v[0] if v else 0.0
        out.append(float(v))
    return out


def logprob_lists(values: Any, name: str, encoded: Encoded) -> list[list[float]]:
    """Per sequence, one log-prob per trained token, from any of Twinkle's shapes:
    completion-only lists (one per trained token), full-length lists aligned with the shifted
    labels, and the sampler's [[(token_id, logprob)], ...] per-position top-k lists."""
    out = []
    for i, row in enumerate(per_sequence(values, name, encoded) or []):
        floats = [_logprob(entry) for entry in (row.tolist() if hasattr(row, "tolist") else row)]
        trained = encoded.trained[i]
        if len(floats) == len(trained):
            out.append(floats)
        elif len(floats) == encoded.lengths[i]:
            out.append([floats[p] for p in trained])
        else:
            raise ValueError(f"{name}[{i}]: {len(floats)} log-probs, but the sequence trains {len(trained)} tokens "
                             f"(length {encoded.lengths[i]})")
    return out


def _logprob(entry: Any) -> float:
    if isinstance(entry, (list, tuple)):
        if not entry:
            return 0.0
        first = entry[0]
        if isinstance(first, (list, tuple)):  # [(token_id, logprob), ...] top-k at one position
            return float(first[1])
        if len(entry) == 2 and isinstance(first, int):  # (token_id, logprob)
            return float(entry[1])
    return float(entry)


def model_output(result: Any, encoded: Encoded) -> dict[str, Any]:
    """The reply as Twinkle's ModelOutput: loss, per-row logps aligned with shifted labels.

    The server's logps[i] is already log p(input_ids[i + 1] | input_ids[:i + 1]) (0 at the last
    position), i.e. aligned with Twinkle's shifted labels; packed rows are joined again."""
    per_row: dict[int, list[np.ndarray]] = {}
    for seq, row in zip(result.sequences, encoded.row_of):
        per_row.setdefault(row, []).append(np.asarray(seq.logps, dtype=np.float32))
    logps = [np.concatenate(parts) for _, parts in sorted(per_row.items())]
    return {"loss": float(result.loss), "logps": logps, "metrics": dict(result.metrics)}
