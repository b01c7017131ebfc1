"""init_tinker_client (settings only) and input_feature_to_datum with the real tinker SDK."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types

from twinkle import init_tinker_client
from twinkle.data_format import Message, Trajectory
from twinkle.server.common import input_feature_to_datum
from twinkle.template import Qwen3_5Template


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("TINKER_BASE_URL", "TINKER_API_KEY", "TWINKLE_SERVER_URL", "TWINKLE_SERVER_TOKEN", "TWINKLE_API_KEY"):
        monkeypatch.setenv(name, "placeholder")  # recorded, so the test's own settings are undone
        monkeypatch.delenv(name)
    return monkeypatch


def test_init_tinker_client_sets_only_the_environment(clean_env):
    import os

    import tinker

    before = {k: getattr(tinker.ServiceClient, k) for k in vars(tinker.ServiceClient)}
    init_tinker_client()
    assert "TINKER_BASE_URL" not in os.environ
    clean_env.setenv("TWINKLE_SERVER_URL", "http://127.0.0.1:9000")
    clean_env.setenv("TWINKLE_SERVER_TOKEN", "tml-from-twinkle")
    init_tinker_client()
    assert os.environ["TINKER_BASE_URL"] == "http://127.0.0.1:9000"
    assert os.environ["TINKER_API_KEY"] == "tml-from-twinkle"
    shown = init_tinker_client(base_url="http://localhost:8000", api_key="tml-explicit-key")
    assert os.environ["TINKER_BASE_URL"] == "http://localhost:8000"
    assert os.environ["TINKER_API_KEY"] == "tml-explicit-key"
    assert shown == {"TINKER_BASE_URL": "http://localhost:8000", "TINKER_API_KEY": "tml-..."}
    after = {k: getattr(tinker.ServiceClient, k) for k in vars(tinker.ServiceClient)}
    assert before == after  # nothing patched


def test_input_feature_to_datum_uses_shifted_labels_as_targets(tokenizer_dir):
    template = Qwen3_5Template(str(tokenizer_dir))
    traj = Trajectory(messages=[Message(role="user", content="Hello!"), Message(role="assistant", content="Hi there.")])
    feature = template.batch_encode([traj])[0]
    datum = input_feature_to_datum(feature)
    assert isinstance(datum, types.Datum)
    ids = feature["input_ids"].tolist()
    assert datum.model_input.to_ints() == ids
    targets = datum.loss_fn_inputs["target_tokens"].to_numpy()
    weights = datum.loss_fn_inputs["weights"].to_numpy()
    labels = feature["labels"]
    np.testing.assert_array_equal(weights, (labels != -100).astype(np.float32))
    for i in np.flatnonzero(weights):
        assert targets[i] == ids[i + 1]  # position i predicts the next token
    assert weights.sum() > 0 and weights[-1] == 0
    plain = input_feature_to_datum({"input_ids": [5, 6, 7], "labels": [6, 7, -100]})
    assert plain.loss_fn_inputs["target_tokens"].to_numpy().tolist() == [6, 7, 0]
