"""InputFeature -> tinker.types.Datum, for training through the tinker SDK.

Twinkle's labels are already shifted (labels[i] is what position i predicts), which is the
tinker SDK's target_tokens convention: target_tokens = labels with -100 as 0, weights = 1 where
labels != -100, model_input = input_ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from twinkle.utils import to_int_list


def input_feature_to_datum(input_feature: Mapping[str, Any]) -> Any:
    """A tinker.types.Datum for one InputFeature (input_ids, labels)."""
    try:
        from tinker import types
    except ImportError as exc:
        raise ImportError("input_feature_to_datum needs the tinker SDK: pip install tinker") from exc
    tokens = to_int_list(input_feature["input_ids"])
    loss_fn_inputs: dict[str, Any] = {}
    labels_raw = input_feature.get("labels")
    if labels_raw is not None:
        labels = np.asarray(to_int_list(labels_raw), dtype=np.int64)[: len(tokens)]
        if len(labels) < len(tokens):
            labels = np.concatenate([labels, np.full(len(tokens) - len(labels), -100, dtype=np.int64)])
        loss_fn_inputs["target_tokens"] = types.TensorData.from_numpy(np.where(labels == -100, 0, labels))
        loss_fn_inputs["weights"] = types.TensorData.from_numpy((labels != -100).astype(np.float32))
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=loss_fn_inputs)
