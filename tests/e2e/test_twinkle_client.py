"""The Python SDK against a real server: a Twinkle-client script's flow (dataset from a local
file, template on the server's tokenizer, MultiLoraTransformersModel training, checkpoints,
resume, run management), log-probs checked against transformers on the same tiny model, and
the server's errors arriving as typed exceptions."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from e2e_support.server import ServerProcess
from e2e_support.training import KEYS, auth_overrides
from twinkle import get_logger
from twinkle.dataset import DatasetMeta
from twinkle_client import _context, init_twinkle_client
from twinkle_client.dataloader import DataLoader
from twinkle_client.dataset import Dataset
from twinkle_client.errors import InvalidArgumentError, NotFoundError, UnauthenticatedError
from twinkle_client.model import MultiLoraTransformersModel

MODEL_ID = "ms://Qwen/Qwen3.5-4B"  # as the guide's scripts say; the server's tokenizer is used
logger = get_logger()

ROWS = [
    {"query": "Who are you?", "response": "I am {{NAME}}, a model trained by {{AUTHOR}}."},
    {"query": "What is your name?", "response": "My name is {{NAME}}."},
    {"query": "Who made you?", "response": "{{AUTHOR}} made me."},
    {"query": "Hello!", "response": "Hello! I am {{NAME}}. How can I help?"},
]


@pytest.fixture
def server(launch_server, tmp_path, monkeypatch) -> Iterator[ServerProcess]:
    monkeypatch.setenv("TWINKLE_CLIENT_CACHE", str(tmp_path / "client-cache"))
    yield launch_server(auth_overrides())
    _context.set_current(None)


def self_cognition_file(tmp_path: Path) -> Path:
    path = tmp_path / "self-cognition.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    return path


def test_guide_script_trains_saves_resumes_and_lists(server: ServerProcess, tmp_path: Path) -> None:
    client = init_twinkle_client(base_url=f"grpc://{server.grpc_address}", api_key=KEYS["alice"])
    dataset = Dataset(dataset_meta=DatasetMeta(str(self_cognition_file(tmp_path)), data_slice=range(8)))
    dataset.set_template("Qwen3_5Template", model_id=MODEL_ID, max_length=256)
    dataset.map("SelfCognitionProcessor", init_args={"model_name": "twinkle model", "model_author": "ModelScope"})
    dataset.encode(batched=True)
    dataloader = DataLoader(dataset=dataset, batch_size=4)

    model = MultiLoraTransformersModel(model_id=MODEL_ID)
    model.add_adapter_to_model("default", LoraConfig(target_modules="all-linear", r=8, lora_alpha=16),
                               gradient_accumulation_steps=2)
    model.set_template("Qwen3_5Template")
    model.set_processor("InputProcessor", padding_side="right")
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("AdamW", lr=5e-3)
    model.set_lr_scheduler("LinearLR")
    logger.info(model.get_train_configs())

    losses = []
    for _epoch in range(4):
        for batch in dataloader:
            output = model.forward_backward(inputs=batch)
            losses.append(output["loss"])
            assert len(output["logps"]) == len(batch)
            model.clip_grad_norm(1.0)
            model.step()
            model.zero_grad()
            model.lr_step()
    assert all(np.isfinite(losses)) and np.mean(losses[-2:]) < np.mean(losses[:2])
    metric = model.calculate_metric(is_training=True)
    assert metric and all(isinstance(v, str) for v in metric.values())

    consumed = dataloader.get_state()["consumed_train_samples"]
    path = model.save(name="twinkle-epoch-3", save_optimizer=True, consumed_train_samples=consumed)
    assert path.startswith("twinkle://") and path.endswith("/weights/twinkle-epoch-3")

    run_id = model.run_ids["default"]
    runs = client.list_training_runs()
    assert run_id in [r.training_run_id for r in runs]
    run = client.get_training_run(run_id)
    assert json.loads(run.model_dump_json(indent=2))["lora_rank"] == 8
    checkpoints = client.list_checkpoints(run_id)
    assert path in [c.twinkle_path for c in checkpoints]
    capacity = client.get_capacity_info()
    assert capacity["used_loras"] >= 1 and capacity["max_loras"] == capacity["used_loras"] + capacity["free_loras"]

    # Resume in a second adapter (as a new script would): weights, optimizer, counters.
    resumed = MultiLoraTransformersModel(model_id=MODEL_ID)
    resumed.add_adapter_to_model("default", LoraConfig(target_modules="all-linear", r=8, lora_alpha=16),
                                 gradient_accumulation_steps=2)
    progress = resumed.resume_from_checkpoint(path)
    assert progress["consumed_train_samples"] == consumed
    fresh_loader = DataLoader(dataset=dataset, batch_size=4)
    fresh_loader.resume_from_checkpoint(progress["consumed_train_samples"])
    assert fresh_loader.get_state() == dataloader.get_state()
    batch = next(iter(DataLoader(dataset=dataset, batch_size=4)))
    before = model.forward_only(inputs=batch)["logps"]
    after = resumed.forward_only(inputs=batch)["logps"]
    for a, b in zip(before, after):
        np.testing.assert_allclose(a, b, atol=1e-5)

    other = client.list_checkpoints(run_id)[0]
    assert client.delete_checkpoint(run_id, other.checkpoint_id)["success"]
    with pytest.raises(NotFoundError):
        resumed.load(other.twinkle_path)


def test_logps_match_transformers_and_labels_line_up(server: ServerProcess, tiny_model: Path) -> None:
    init_twinkle_client(f"grpc://{server.grpc_address}", KEYS["bob"])
    model = MultiLoraTransformersModel(model_id=MODEL_ID)
    model.add_adapter_to_model("ref", {"r": 4, "lora_alpha": 8})
    model.set_template("Qwen3_5Template")
    trajectory = {"messages": [{"role": "user", "content": "What is the capital of France?"},
                               {"role": "assistant", "content": "The capital of France is Paris."}]}
    out = model.forward_only(inputs=[trajectory], disable_lora=True)
    feature = model._template_instance().batch_encode([trajectory])[0]
    ids = torch.tensor([feature["input_ids"].tolist()])
    reference_model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    with torch.no_grad():
        logits = reference_model(ids).logits[0]
    reference = torch.log_softmax(logits, dim=-1)[torch.arange(ids.shape[1] - 1), ids[0, 1:]].numpy()
    trained = np.flatnonzero(feature["labels"] != -100)
    assert len(trained) > 0
    got = out["logps"][0]
    np.testing.assert_allclose(got[trained], reference[trained], atol=2e-4)


def test_server_errors_arrive_typed(server: ServerProcess) -> None:
    init_twinkle_client(f"grpc://{server.grpc_address}", KEYS["alice"])
    model = MultiLoraTransformersModel(model_id=MODEL_ID)
    with pytest.raises(InvalidArgumentError) as info:
        model.add_adapter_to_model("huge", {"r": 100000})
    assert info.value.code == "INVALID_ARGUMENT" and "config.r" in info.value.message
    model.add_adapter_to_model("default", {"r": 4})
    with pytest.raises(InvalidArgumentError, match="loss"):
        model.set_loss("NoSuchLoss")
    with pytest.raises(UnauthenticatedError):
        init_twinkle_client(f"grpc://{server.grpc_address}", "tml-not-a-key")


def test_grpo_step_with_the_models_own_logps(server: ServerProcess) -> None:
    """old_logps in the full-length shape forward_only returns: the SDK sends one per trained
    token, the server accepts them, and with old == current the GRPO loss is -mean(A) = 0."""
    init_twinkle_client(f"grpc://{server.grpc_address}", KEYS["alice"])
    model = MultiLoraTransformersModel(model_id=MODEL_ID)
    model.add_adapter_to_model("grpo", {"r": 4, "lora_alpha": 8})
    model.set_loss("GRPOLoss", epsilon=0.2, beta=0.0)
    model.set_optimizer("AdamW", lr=1e-3)
    template = model._template_instance()
    prompts = [{"messages": [{"role": "user", "content": f"Count to {n}."}]} for n in (3, 4)]
    rows = []
    for prompt in prompts:
        feature = template.batch_encode([prompt], add_generation_prompt=True)[0]
        completion = template.tokenizer.encode("one two three", add_special_tokens=False)
        rows.append(template.concat_input_feature({**prompt, **feature}, completion))
    old = model.forward_only(inputs=rows)["logps"]
    out = model.forward_backward(inputs=rows, advantages=[1.0, -1.0], old_logps=old)
    assert out["loss"] == pytest.approx(0.0, abs=1e-5)
    assert model.clip_grad_and_step() is not None
    # Completion-only lists work too, and the update moved the adapter.
    trained = [np.flatnonzero(r["labels"] != -100) for r in rows]
    old_completion = [o[t].tolist() for o, t in zip(old, trained)]
    again = model.forward_backward(inputs=rows, advantages=[1.0, -1.0], old_logps=old_completion)
    assert np.isfinite(again["loss"]) and again["loss"] != pytest.approx(0.0, abs=1e-7)
