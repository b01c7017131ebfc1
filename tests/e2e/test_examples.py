"""The examples/ scripts (the usage guide's client scripts, adapted only in model id, base_url,
key source and local dataset path) run as users run them, against real servers.

SFT (examples/twinkle_sft_self_cognition.py): 3 epochs on a local self-cognition jsonl, on a
model made here with hidden 256 (random weights, the tiny tokenizer). The same loop runs
in-process with transformers + PEFT as the reference: the same LoRA config and initial LoRA
weights (the server's seed-0 draw, copied in), AdamW + LinearLR, clipping at 1.0 every second
micro-batch, the same batches in the same order, the same loss (mean token cross-entropy over
the assistant tokens of each micro-batch). PEFT must halve its loss; ours must halve too and end
within 10 % of PEFT's. Then: save -> load gives identical weights, and resuming from the
epoch-1 checkpoint with the dataloader skipping the consumed samples replays epoch 2 exactly.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from e2e_support import configs, paths
from e2e_support.server import ServerProcess, launch, stop_all
from e2e_support.training import KEYS, auth_overrides
from e2e_support.waiting import scaled

EXAMPLES = paths.REPO_ROOT / "examples"
SFT_SCRIPT = EXAMPLES / "twinkle_sft_self_cognition.py"
SELF_COGNITION = EXAMPLES / "data" / "self_cognition.jsonl"
STARTUP_TIMEOUT_S = 120.0
SFT_TIMEOUT_S = 1800.0

# The SFT check's model: hidden 256 (the acceptance's floor), 2 layers, the tiny tokenizer,
# random weights with larger scales than transformers' default (std 0.02): linears 0.05, the
# (tied) embeddings 0.1. With the default scales a random model's logits hardly respond to a
# LoRA trained at the guide's lr 1e-4 for 3 epochs (PEFT: 6.7 -> 4.9); with these PEFT goes
# from 7.7 to about 2.6 (uniform over the vocabulary would be 6.7), so halving means learning.
SFT_MODEL = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "initializer_range": 0.05,
    "tie_word_embeddings": True,
}
EMBEDDING_SCALE = 2.0  # the embeddings drawn with initializer_range, then doubled
SFT_MODEL_NAME = "sft-check-qwen3-h256"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

# The guide's SFT hyperparameters (what the example uses).
LR = 1e-4
BATCH_SIZE = 4
GRAD_ACCUM = 2
EPOCHS = 3
SAMPLES_PER_EPOCH = 500  # DatasetMeta(..., data_slice=range(500)) wraps the 48 rows
MODEL_NAME, MODEL_AUTHOR = "twinkle model", "ModelScope Community"


# ---- fixtures --------------------------------------------------------------------------------


def make_model(target: Path, tokenizer_source: Path) -> Path:
    """A random Qwen3ForCausalLM with SFT_MODEL's shape and scales, seeded, with the tiny model's tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_source))
    config = Qwen3Config(
        vocab_size=len(tokenizer), max_position_embeddings=512, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        architectures=["Qwen3ForCausalLM"], dtype="float32", **SFT_MODEL)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(EMBEDDING_SCALE)
    target.mkdir(parents=True)
    model.save_pretrained(str(target))
    for name in TOKENIZER_FILES:
        if (tokenizer_source / name).is_file():
            shutil.copy2(tokenizer_source / name, target / name)
    return target


@pytest.fixture(scope="module")
def sft_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("models") / SFT_MODEL_NAME, tiny_model)


@pytest.fixture(scope="module")
def sft_server(server_bin: Path, sft_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server on the SFT model, auth on (tenants alice and bob)."""
    workdir = tmp_path_factory.mktemp("sft-server")
    config = configs.merged(configs.base_config(sft_model), auth_overrides(storage={"data_dir": str(workdir / "data")}))
    server = launch(server_bin, configs.write_config(workdir / "twinkle.yaml", config), config, workdir)
    try:
        server.wait_ports(scaled(STARTUP_TIMEOUT_S))
        server.wait_health("SERVING", scaled(STARTUP_TIMEOUT_S))
        yield server
    finally:
        stop_all([server])


def example_env(server: ServerProcess, tmp_path: Path, key: str, **extra: str) -> dict[str, str]:
    """The environment a user would set: where the server is, the key, the model, the data.
    The checkout's client package goes first on PYTHONPATH (as conftest does for the tests)."""
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": os.pathsep.join([str(paths.CLIENT_DIR), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "TWINKLE_SERVER_URL": f"http://{server.host}:{server.http_port}",
        "TWINKLE_SERVER_TOKEN": key,
        "TWINKLE_CLIENT_CACHE": str(tmp_path / "client-cache"),
        "PYTHONUNBUFFERED": "1",
        **extra,
    })
    return env


# ---- the example's run, parsed ------------------------------------------------------------------


@dataclass
class SftRun:
    """What the example logged: the loss of every logged micro-batch as (epoch, step, loss)
    (the guide logs every second batch of an epoch) and the saved twinkle:// paths."""

    logged: list[tuple[int, int, float]] = field(default_factory=list)
    saved: list[str] = field(default_factory=list)


_STEP = re.compile(r"Current is step (\d+), loss: \{'loss': ([-+0-9.eE]+|nan|inf)")
_EPOCH = re.compile(r"Starting epoch (\d+)")
_SAVED = re.compile(r"Saved checkpoint: (twinkle://\S+)")


def parse_sft_output(text: str) -> SftRun:
    run, epoch = SftRun(), -1
    for line in text.splitlines():
        if m := _EPOCH.search(line):
            epoch = int(m.group(1))
        elif m := _STEP.search(line):
            run.logged.append((epoch, int(m.group(1)) * 2, float(m.group(2))))
        elif m := _SAVED.search(line):
            run.saved.append(m.group(1))
    return run


# ---- the reference: the same loop with transformers + PEFT --------------------------------------


def encoded_dataset(model_id: str):
    """The example's dataset pipeline (model_id: a local directory here, the same tokenizer
    files the server hands out)."""
    from twinkle.dataset import DatasetMeta
    from twinkle_client.dataset import Dataset

    dataset = Dataset(dataset_meta=DatasetMeta(str(SELF_COGNITION), data_slice=range(SAMPLES_PER_EPOCH)))
    dataset.set_template("Qwen3_5Template", model_id=model_id, max_length=512)
    dataset.map("SelfCognitionProcessor", init_args={"model_name": MODEL_NAME, "model_author": MODEL_AUTHOR})
    dataset.encode(batched=True)
    return dataset


def peft_reference(model_dir: Path, initial: dict[str, np.ndarray], dataset) -> list[tuple[int, int, float]]:
    """The example's loop in transformers + PEFT; returns (epoch, step, loss) of every micro-batch."""
    import torch
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM
    from twinkle_client.dataloader import DataLoader

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(target_modules="all-linear"))
    result = set_peft_model_state_dict(model, {k: torch.from_numpy(v.copy()) for k, v in initial.items()})
    assert not result.unexpected_keys, result.unexpected_keys
    missing = [k for k in result.missing_keys if "lora_" in k]
    assert not missing, f"LoRA weights the server did not return: {missing[:4]}"
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(params) == len(initial)
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.01)  # Twinkle's AdamW defaults
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer)          # torch's defaults, as 'LinearLR'
    model.train()

    def token_ce(batch) -> tuple[torch.Tensor, int]:
        """(Σ −log p(label) over the assistant tokens of the micro-batch, their count)."""
        total, count = torch.zeros((), dtype=torch.float32), 0
        for row in batch:
            ids = torch.as_tensor(np.asarray(row["input_ids"]), dtype=torch.long)[None]
            labels = torch.as_tensor(np.asarray(row["labels"]), dtype=torch.long)  # shifted: labels[i] follows i
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
            mask = labels != -100
            total = total - logprobs[mask, labels[mask]].sum()
            count += int(mask.sum())
        return total, count

    losses, backward_count, window_tokens = [], 0, 0
    dataloader = DataLoader(dataset=dataset, batch_size=BATCH_SIZE)
    for epoch in range(EPOCHS):
        for step, batch in enumerate(dataloader):
            total, count = token_ce(batch)
            total.backward()  # the window's mean is taken below, over all its tokens
            losses.append((epoch, step, (total / max(count, 1)).item()))
            window_tokens += count
            backward_count += 1
            if backward_count % GRAD_ACCUM == 0:  # clip / step / zero_grad / lr_step act every 2nd
                for p in params:  # the accumulation window's mean: ÷ its tokens (as Twinkle's clip)
                    p.grad /= max(window_tokens, 1)
                window_tokens = 0
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
    return losses


def first_last(losses: list[float], window: int) -> tuple[float, float]:
    return float(np.mean(losses[:window])), float(np.mean(losses[-window:]))


def print_curves(ours: list[tuple[int, int, float]], reference: dict[tuple[int, int], float]) -> None:
    print("\nepoch step   twinkle-server   transformers+PEFT")
    for epoch, step, loss in ours:
        if step % 10 == 0:
            print(f"{epoch:5d} {step:4d}   {loss:14.4f}   {reference[(epoch, step)]:17.4f}")


# ---- the test ----------------------------------------------------------------------------------


def test_sft_example_halves_loss_like_peft_and_round_trips(
    sft_server: ServerProcess, sft_model: Path, tmp_path: Path
) -> None:
    from twinkle_client import _context, init_twinkle_client
    from twinkle_client.dataloader import DataLoader
    from twinkle_client.model import MultiLoraTransformersModel
    from peft import LoraConfig

    # 1. The example, as a user runs it (its key, model id and data from the environment).
    env = example_env(sft_server, tmp_path, KEYS["alice"], TWINKLE_MODEL_ID=SFT_MODEL_NAME,
                      TWINKLE_DATASET=str(SELF_COGNITION))
    done = subprocess.run([sys.executable, str(SFT_SCRIPT)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=scaled(SFT_TIMEOUT_S), check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"the example failed ({done.returncode}):\n{output[-6000:]}"
    run = parse_sft_output(output)
    per_epoch = (SAMPLES_PER_EPOCH + BATCH_SIZE - 1) // BATCH_SIZE
    assert [e for e, _, _ in run.logged] == [e for e in range(EPOCHS) for s in range(per_epoch) if s % 2 == 0]
    assert len(run.saved) == EPOCHS and all(p.endswith(f"/weights/twinkle-epoch-{e}") for e, p in enumerate(run.saved))

    # 2. The reference, from the same initial LoRA weights (adapters are drawn with seed 0).
    client = init_twinkle_client(base_url=f"grpc://{sft_server.grpc_address}", api_key=KEYS["alice"])
    try:
        def adapter() -> MultiLoraTransformersModel:
            model = MultiLoraTransformersModel(model_id=SFT_MODEL_NAME)
            model.add_adapter_to_model("default", LoraConfig(target_modules="all-linear"),
                                       gradient_accumulation_steps=GRAD_ACCUM)
            return model

        initial = adapter().get_state_dict()
        dataset = encoded_dataset(str(sft_model))
        reference_all = peft_reference(sft_model, initial, dataset)
        reference = {(e, s): loss for e, s, loss in reference_all}
        ours = [loss for _, _, loss in run.logged]
        theirs = [reference[(e, s)] for e, s, _ in run.logged]
        print_curves(run.logged, reference)

        # The first and last six logged batches are the same 24 rows (48 rows, 500 per epoch).
        window = 6
        ours_first, ours_last = first_last(ours, window)
        peft_first, peft_last = first_last(theirs, window)
        print(f"twinkle-server: {ours_first:.4f} -> {ours_last:.4f} ({ours_last / ours_first:.3f}); "
              f"transformers+PEFT: {peft_first:.4f} -> {peft_last:.4f} ({peft_last / peft_first:.3f})")
        worst = max(abs(a - b) / b for a, b in zip(ours, theirs))
        print(f"largest relative difference over the {len(ours)} logged micro-batches: {worst:.2e}")
        assert ours[0] == pytest.approx(theirs[0], rel=1e-4), "the untrained model's loss differs from transformers'"
        assert peft_last <= 0.5 * peft_first, "the reference does not halve its loss: the check would be vacuous"
        assert ours_last <= 0.5 * ours_first
        assert abs(ours_last - peft_last) <= 0.10 * peft_last

        # 3. save -> load gives identical weights: the example's final checkpoint, loaded into a
        # new adapter, saved again and loaded into a third one.
        loaded = adapter()
        loaded.load(run.saved[-1], load_optimizer=True)
        weights = loaded.get_state_dict()
        again_path = loaded.save(name="round-trip", save_optimizer=True)
        again = adapter()
        again.load(again_path)
        again_weights = again.get_state_dict()
        assert sorted(weights) == sorted(initial) == sorted(again_weights)
        for name in weights:
            np.testing.assert_array_equal(weights[name], again_weights[name], err_msg=name)
        assert any(not np.array_equal(weights[n], initial[n]) for n in weights), "training changed nothing"

        # 4. Resume: the example's epoch-1 checkpoint, then a mid-epoch one of our own. Each time
        # the dataloader skips exactly the consumed samples, so the replayed micro-batches are the
        # example's epoch-2 batches and give its logged losses (every epoch serves the same 500
        # rows, so only a mid-epoch resume tells a right skip from a wrong one).
        served_dataset = encoded_dataset(SFT_MODEL_NAME)  # the server's tokenizer, as the example
        logged_last_epoch = {s: loss for e, s, loss in run.logged if e == EPOCHS - 1}
        replay = 10  # micro-batches per leg (even: a leg ends on an optimizer step)

        def resume_and_replay(path: str, expected_consumed: int, first_step: int) -> tuple[MultiLoraTransformersModel, int]:
            model = adapter()
            model.set_template("Qwen3_5Template")
            model.set_processor("InputProcessor", padding_side="right")
            model.set_loss("CrossEntropyLoss")
            model.set_optimizer("AdamW", lr=LR)
            model.set_lr_scheduler("LinearLR")
            progress = model.resume_from_checkpoint(path)
            assert progress["consumed_train_samples"] == expected_consumed
            assert progress["cur_step"] == expected_consumed // BATCH_SIZE  # backward calls so far
            dataloader = DataLoader(dataset=served_dataset, batch_size=BATCH_SIZE)
            dataloader.resume_from_checkpoint(progress["consumed_train_samples"])
            offset = expected_consumed % SAMPLES_PER_EPOCH
            for i, batch in enumerate(dataloader):
                step = first_step + i
                if i == 0:
                    expected_rows = [served_dataset[offset + k]["input_ids"].tolist() for k in range(BATCH_SIZE)]
                    assert [row["input_ids"].tolist() for row in batch] == expected_rows
                output = model.forward_backward(inputs=batch)
                if step % 2 == 0:
                    print(f"resumed epoch 2 step {step}: {output['loss']:.6f} (example: {logged_last_epoch[step]:.6f})")
                    assert output["loss"] == pytest.approx(logged_last_epoch[step], rel=1e-5, abs=1e-6), step
                model.clip_grad_norm(1.0)
                model.step()
                model.zero_grad()
                model.lr_step()
                if i + 1 == replay:
                    break
            consumed = dataloader.get_state()["consumed_train_samples"]
            assert consumed == expected_consumed + replay * BATCH_SIZE
            return model, consumed

        epoch_end = 2 * SAMPLES_PER_EPOCH
        first, consumed = resume_and_replay(run.saved[1], epoch_end, 0)
        mid_path = first.save(name="mid-epoch-2", save_optimizer=True, consumed_train_samples=consumed)
        resume_and_replay(mid_path, epoch_end + replay * BATCH_SIZE, replay)
    finally:
        client.close()
        _context.set_current(None)


# ---- GRPO ------------------------------------------------------------------------------------

GRPO_SCRIPT = EXAMPLES / "twinkle_grpo_countdown.py"
GRPO_STEPS = 5
_GRPO_SAVED = re.compile(r"Step (\d+): Saved weights to (twinkle://\S+)")
_GRPO_STEP = re.compile(r"Step (\d+): (\{.*\}|All advantages are zero, skipping training)")


def test_grpo_example_runs_five_steps(launch_server, tmp_path: Path) -> None:
    """The GRPO example as a user runs it (only --max-steps set): each step saves the adapter,
    samples 4 completions per prompt from it, scores them and trains (or, with the random
    model's all-zero rewards, skips as the guide's loop does); a final checkpoint is saved."""
    server = launch_server(auth_overrides())
    env = example_env(server, tmp_path, KEYS["bob"], TWINKLE_MAX_STEPS=str(GRPO_STEPS))
    done = subprocess.run([sys.executable, str(GRPO_SCRIPT)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=scaled(900), check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"the example failed ({done.returncode}):\n{output[-6000:]}"
    saved = [(int(m.group(1)), m.group(2)) for m in _GRPO_SAVED.finditer(output)]
    assert [s for s, _ in saved] == list(range(GRPO_STEPS))
    assert all(p.endswith(f"/weights/grpo-sampler-step-{s}") for s, p in saved)
    steps = [int(m.group(1)) for m in _GRPO_STEP.finditer(output)]
    assert steps == list(range(GRPO_STEPS)), output[-4000:]
    assert re.search(r"Saved final checkpoint: twinkle://\S+/weights/grpo-countdown-final", output)


def load_example(path: Path, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_example_training_branch(launch_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same script's train(), imported, with one change: a reward that varies between a
    prompt's completions (shorter is better), so every step reaches the GRPO training branch
    (advantages, the sampler's old log-probs, forward_backward, clip, step, metrics)."""
    from twinkle.reward.base import last_assistant_text
    from twinkle_client import _context

    server = launch_server(auth_overrides())
    steps = 2  # gradient_accumulation_steps is 4: these reach forward_backward; the gated step is a no-op
    for key, value in example_env(server, tmp_path, KEYS["alice"], TWINKLE_MAX_STEPS=str(steps),
                                  TWINKLE_MAX_NEW_TOKENS="32").items():
        monkeypatch.setenv(key, value)
    module = load_example(GRPO_SCRIPT, "twinkle_grpo_countdown_example")
    original = module.compute_rewards
    logged: list[dict] = []

    def compute_rewards(trajectories):
        total, fmt, acc = original(trajectories)
        lengths = [len(last_assistant_text(t)) for t in trajectories]
        shaped = [a - n / 1000.0 for a, n in zip(total, lengths)]
        return shaped, fmt, acc

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if m := re.match(r"Step (\d+): (\{.*\})$", message):
                logged.append({"step": int(m.group(1)), "text": m.group(2)})

    monkeypatch.setattr(module, "compute_rewards", compute_rewards)
    handler = Capture()
    module.logger.addHandler(handler)
    try:
        module.train()
    finally:
        module.logger.removeHandler(handler)
        if _context._current is not None:
            _context._current.close()
        _context.set_current(None)
    assert [r["step"] for r in logged] == list(range(steps))
    for record in logged:
        assert "train/total_reward" in record["text"] and "train/completion_length" in record["text"]
        assert "loss" in record["text"], record["text"]


# ---- Tinker ----------------------------------------------------------------------------------

TINKER_SCRIPT = EXAMPLES / "tinker_sft.py"
_TINKER_SAVED = re.compile(r"Saved checkpoint to (tinker://\S+|twinkle://\S+)")
_TINKER_METRICS = re.compile(r"Training Metrics: .*'learning_rate:mean': ([-+0-9.eE]+)")


def test_tinker_example_trains_through_init_tinker_client(launch_server, tmp_path: Path) -> None:
    """The guide's Tinker-client SFT script through the official tinker SDK: init_tinker_client
    (pointed at the server by TINKER_BASE_URL / TINKER_API_KEY, as a user sets them), 3 epochs
    of forward_backward + optim_step, a save_state per epoch."""
    pytest.importorskip("tinker", reason="the tinker SDK is not installed (pip install './client/python[tinker]')")
    server = launch_server(auth_overrides())
    env = example_env(server, tmp_path, KEYS["alice"], TWINKLE_MODEL_ID=paths.TINY_MODEL_DIRNAME,
                      TINKER_BASE_URL=f"http://{server.host}:{server.http_port}", TINKER_API_KEY=KEYS["alice"])
    env.pop("TWINKLE_SERVER_URL")
    env.pop("TWINKLE_SERVER_TOKEN")
    done = subprocess.run([sys.executable, str(TINKER_SCRIPT)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=scaled(1800), check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"the example failed ({done.returncode}):\n{output[-6000:]}"
    saved = _TINKER_SAVED.findall(output)
    assert len(saved) == 3 and all(p.endswith(f"twinkle-lora-{e}") for e, p in enumerate(saved)), saved
    rates = [float(r) for r in _TINKER_METRICS.findall(output)]
    assert len(rates) == 3 * ((SAMPLES_PER_EPOCH + 7) // 8) and all(r == pytest.approx(1e-4) for r in rates)


# ---- two tenants -------------------------------------------------------------------------------

DEMO_SCRIPT = EXAMPLES / "two_tenant_demo.py"
_DEMO_CURVE = re.compile(r"tenant ([AB]): ([-+0-9.]+) -> ([-+0-9.]+) ")


def test_two_tenant_demo_trains_both_adapters_at_once(launch_server, tmp_path: Path) -> None:
    """Two tenants (alice and bob, each with its own key) train at the same time; both curves
    are printed and both fall."""
    server = launch_server(auth_overrides())
    env = example_env(server, tmp_path, "", TWINKLE_KEY_A=KEYS["alice"], TWINKLE_KEY_B=KEYS["bob"],
                      TWINKLE_EPOCHS="2", TWINKLE_SAMPLES="16")
    done = subprocess.run([sys.executable, str(DEMO_SCRIPT)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=scaled(900), check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"the demo failed ({done.returncode}):\n{output[-6000:]}"
    curves = {m.group(1): (float(m.group(2)), float(m.group(3))) for m in _DEMO_CURVE.finditer(output)}
    assert sorted(curves) == ["A", "B"], output[-3000:]
    assert all(last < first for first, last in curves.values()), curves
    rows = re.findall(r"^\s*(\d+)\s+([-+0-9.]+)\s+([-+0-9.]+)$", output, flags=re.MULTILINE)
    assert len(rows) == 2 * 16 // 4  # every micro-batch of both tenants, side by side
