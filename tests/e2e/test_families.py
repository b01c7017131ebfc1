"""The model families beyond the dense decoders, served whole: Qwen3.5 (hybrid Gated DeltaNet,
as a CausalLM checkpoint and as the ConditionalGeneration checkpoint Qwen publishes),
Qwen3-MoE and Qwen3.5-MoE.

Each family is a tiny random model from scripts/make_reference_models.py (the same shapes the
engine's numerical tests hold against transformers and PEFT), made with the tiny tokenizer's
vocabulary and special tokens and served by its own server through the same HF-directory
loader as a real checkpoint. On each:
- the tinker SDK quickstart (tinker-docs "quickstart": capabilities, create_lora_training_client
  with the SDK's defaults, get_tokenizer, the pig-latin datums, forward_backward + optim_step,
  save_weights_and_get_sampling_client, greedy sample with a stop string), with two checks of
  our own: the weighted loss falls, and the sampler's log-probs of a sampled sequence equal the
  training forward's on the same tokens;
- on Qwen3.5 (the usage guide's model), the guide's SFT and GRPO client scripts from examples/,
  with only the URL, model id and dataset (and GRPO's step count) changed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "1")

from e2e_support import configs, paths  # noqa: E402
from e2e_support.server import ServerProcess, launch, stop_all  # noqa: E402
from e2e_support.training import KEYS, auth_overrides, resolved  # noqa: E402
from e2e_support.waiting import scaled, wait_until  # noqa: E402

sys.path.insert(0, str(paths.REPO_ROOT / "scripts"))
import make_reference_models  # noqa: E402

# The families and the folder (= served model name) each is made in.
FAMILIES = {"qwen3_5": "tiny-qwen3_5", "qwen3_5-vl": "tiny-qwen3_5-vl",
            "qwen3_moe": "tiny-qwen3_moe", "qwen3_5_moe": "tiny-qwen3_5_moe"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
STARTUP_TIMEOUT_S = 120.0
EXAMPLES = paths.REPO_ROOT / "examples"

# The quickstart's data (tinker-docs quickstart), unchanged.
PIG_LATIN = [
    {"input": "banana split", "output": "anana-bay plit-say"},
    {"input": "quantum physics", "output": "uantum-qay ysics-phay"},
    {"input": "donut shop", "output": "onut-day op-shay"},
    {"input": "pickle jar", "output": "ickle-pay ar-jay"},
    {"input": "space exploration", "output": "ace-spay exploration-way"},
    {"input": "rubber duck", "output": "ubber-ray uck-day"},
    {"input": "coding wizard", "output": "oding-cay izard-way"},
]


def make_family_model(variant: str, out: Path, tokenizer_source: Path) -> Path:
    """make_reference_models' model of `variant`, with the tiny tokenizer's vocabulary and
    special token ids, room for the examples' 512-token rows, and the tokenizer files."""
    import json

    source_config = json.loads((tokenizer_source / "config.json").read_text())
    overrides = {key: source_config[key] for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    overrides["max_position_embeddings"] = 512
    made = make_reference_models.make(variant, out, text_overrides=overrides)
    target = out / FAMILIES[variant]
    made.rename(target)
    for name in TOKENIZER_FILES:
        if (tokenizer_source / name).is_file():
            shutil.copy2(tokenizer_source / name, target / name)
    return target


class FamilyServers:
    """One server per family, started on first use, all stopped at the end of the module."""

    def __init__(self, server_bin: Path, tiny_model: Path, root: Path) -> None:
        self.server_bin, self.tiny_model, self.root = server_bin, tiny_model, root
        self.servers: dict[str, ServerProcess] = {}
        self.models: dict[str, Path] = {}

    def model(self, variant: str) -> Path:
        if variant not in self.models:
            self.models[variant] = make_family_model(variant, self.root / "models", self.tiny_model)
        return self.models[variant]

    def server(self, variant: str) -> ServerProcess:
        if variant not in self.servers:
            workdir = self.root / f"server-{variant}"
            config = configs.merged(configs.base_config(self.model(variant)),
                                    auth_overrides(storage={"data_dir": str(workdir / "data")}))
            server = launch(self.server_bin, configs.write_config(workdir / "twinkle.yaml", config), config, workdir)
            self.servers[variant] = server
            server.wait_ports(scaled(STARTUP_TIMEOUT_S))
            server.wait_health("SERVING", scaled(STARTUP_TIMEOUT_S))
        return self.servers[variant]


@pytest.fixture(scope="module")
def families(server_bin: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FamilyServers]:
    pool = FamilyServers(server_bin, tiny_model, tmp_path_factory.mktemp("families"))
    (pool.root / "models").mkdir()
    try:
        yield pool
    finally:
        stop_all(list(pool.servers.values()))


# ---- the tinker SDK quickstart ------------------------------------------------------------------


def process_example(example: dict[str, str], tokenizer):
    """The quickstart's process_example: prompt tokens weighted 0, completion tokens 1, shifted."""
    from tinker import types

    prompt = f"English: {example['input']}\nPig Latin:"
    prompt_tokens = tokenizer.encode(prompt, add_special_tokens=True)
    completion_tokens = tokenizer.encode(f" {example['output']}\n\n", add_special_tokens=False)
    tokens = prompt_tokens + completion_tokens
    weights = [0] * len(prompt_tokens) + [1] * len(completion_tokens)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens=tokens[:-1]),
                       loss_fn_inputs={"weights": weights[1:], "target_tokens": tokens[1:]})


@pytest.mark.parametrize("variant", sorted(FAMILIES))
def test_tinker_quickstart_runs_on_each_family(families: FamilyServers, variant: str) -> None:
    import tinker
    from tinker import types

    server = families.server(variant)
    name = FAMILIES[variant]
    service_client = tinker.ServiceClient(base_url=f"http://{server.host}:{server.http_port}", api_key=KEYS["alice"])
    models = [m.model_name for m in service_client.get_server_capabilities().supported_models]
    assert name in models, models
    made = service_client.create_lora_training_client(base_model=name)
    training_client = resolved(made)
    tokenizer = training_client.get_tokenizer()
    processed = [process_example(ex, tokenizer) for ex in PIG_LATIN]

    losses = []
    for _ in range(6):
        fwdbwd = training_client.forward_backward(processed, "cross_entropy")
        optim = training_client.optim_step(types.AdamParams(learning_rate=1e-4))
        result, _ = fwdbwd.result(), optim.result()
        logprobs = np.concatenate([out["logprobs"].tolist() for out in result.loss_fn_outputs])
        weights = np.concatenate([ex.loss_fn_inputs["weights"].tolist() for ex in processed])
        losses.append(float(-np.dot(logprobs, weights) / weights.sum()))
    print(f"{variant}: loss per token {' '.join(f'{x:.4f}' for x in losses)}")
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses

    made = training_client.save_weights_and_get_sampling_client(name="pig-latin-model")
    sampling_client = resolved(made)
    prompt = types.ModelInput.from_ints(tokenizer.encode("English: coffee break\nPig Latin:"))
    params = types.SamplingParams(max_tokens=20, temperature=0.0, stop=["\n"])
    result = sampling_client.sample(prompt=prompt, sampling_params=params, num_samples=8).result()
    assert len(result.sequences) == 8
    first = result.sequences[0]
    assert all(s.tokens == first.tokens for s in result.sequences), "greedy samples differ"
    assert 1 <= len(first.tokens) <= 20 and first.stop_reason in ("stop", "length")
    if first.stop_reason == "stop":
        assert "\n" in tokenizer.decode(first.tokens)

    # The sampler's numbers are the training forward's: the sampled tokens' log-probs, and the
    # prompt's, equal a forward of the trained adapter on the same sequence.
    sequence = prompt.to_ints() + list(first.tokens)
    datum = types.Datum(model_input=types.ModelInput.from_ints(sequence[:-1]),
                        loss_fn_inputs={"target_tokens": sequence[1:], "weights": [1.0] * (len(sequence) - 1)})
    forward = np.asarray(training_client.forward([datum], "cross_entropy").result()
                         .loss_fn_outputs[0]["logprobs"].tolist(), dtype=np.float64)
    sampled = np.asarray(first.logprobs, dtype=np.float64)
    np.testing.assert_allclose(sampled, forward[-len(sampled):], atol=1e-5, rtol=0)
    scored = sampling_client.compute_logprobs(types.ModelInput.from_ints(sequence)).result()
    np.testing.assert_allclose(np.asarray(scored[1:], dtype=np.float64), forward, atol=1e-5, rtol=0)
    print(f"{variant}: sampled {len(first.tokens)} tokens ({first.stop_reason}); "
          f"largest |sampler - forward| log-prob {np.max(np.abs(sampled - forward[-len(sampled):])):.2e}")


# ---- the usage guide's scripts on Qwen3.5 -----------------------------------------------------

_SFT_STEP = re.compile(r"Current is step (\d+), loss: \{'loss': ([-+0-9.eE]+|nan|inf)")
_SFT_SAVED = re.compile(r"Saved checkpoint: (twinkle://\S+)")
_GRPO_STEP = re.compile(r"Step (\d+): (\{.*\}|All advantages are zero, skipping training)")


def run_example(server: ServerProcess, script: str, tmp_path: Path, timeout_s: float, **env_extra: str) -> str:
    """The example as a user runs it: server URL, key, model id and data from the environment."""
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": os.pathsep.join([str(paths.CLIENT_DIR), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "TWINKLE_SERVER_URL": f"http://{server.host}:{server.http_port}",
        "TWINKLE_SERVER_TOKEN": KEYS["alice"],
        "TWINKLE_CLIENT_CACHE": str(tmp_path / "client-cache"),
        "PYTHONUNBUFFERED": "1",
        **env_extra,
    })
    done = subprocess.run([sys.executable, str(EXAMPLES / script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=scaled(timeout_s), check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{script} failed ({done.returncode}):\n{output[-6000:]}"
    return output


def test_usage_guide_sft_script_trains_qwen3_5(families: FamilyServers, tmp_path: Path) -> None:
    """examples/twinkle_sft_self_cognition.py (3 epochs of 500 rows, LoRA all-linear: the
    DeltaNet and attention linears and the MLP) on the Qwen3.5 server: every logged loss is
    finite, the loss falls, and each epoch's checkpoint is saved."""
    output = run_example(families.server("qwen3_5"), "twinkle_sft_self_cognition.py", tmp_path, 1800,
                         TWINKLE_MODEL_ID=FAMILIES["qwen3_5"])
    losses = [float(m.group(2)) for m in _SFT_STEP.finditer(output)]
    saved = _SFT_SAVED.findall(output)
    assert len(losses) >= 90 and all(np.isfinite(losses)), output[-3000:]
    first, last = float(np.mean(losses[:6])), float(np.mean(losses[-6:]))
    print(f"qwen3_5 SFT example: {len(losses)} logged losses, {first:.4f} -> {last:.4f}")
    assert last < 0.95 * first  # the tiny random model at the guide's lr 1e-4: 6.74 -> 6.27 measured
    assert len(saved) == 3 and all(p.endswith(f"/weights/twinkle-epoch-{e}") for e, p in enumerate(saved)), saved


def test_usage_guide_grpo_script_runs_on_qwen3_5(families: FamilyServers, tmp_path: Path) -> None:
    """examples/twinkle_grpo_countdown.py on the Qwen3.5 server, 3 steps: each step saves the
    adapter, samples 4 completions per prompt from it (the hybrid model's recurrent state slots
    in the sampler), scores them and trains or skips as the guide's loop does; then the sampler
    holds no request's state (the utility service's sampler load is idle)."""
    server = families.server("qwen3_5")
    output = run_example(server, "twinkle_grpo_countdown.py", tmp_path, 900,
                         TWINKLE_MODEL_ID=FAMILIES["qwen3_5"], TWINKLE_MAX_STEPS="3", TWINKLE_MAX_NEW_TOKENS="32")
    steps = [int(m.group(1)) for m in _GRPO_STEP.finditer(output)]
    assert steps == [0, 1, 2], output[-4000:]
    assert re.search(r"Saved final checkpoint: twinkle://\S+/weights/grpo-countdown-final", output)


# ---- Qwen3.5 adapters to and from PEFT ------------------------------------------------------------

DELTANET = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
TEXT_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", *DELTANET]
SEQ = [11, 42, 7, 99, 123, 5, 64, 300, 17, 250, 3, 77]


def hf_model(model_dir: Path, variant: str):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    cls = Qwen3_5ForConditionalGeneration if variant == "qwen3_5-vl" else AutoModelForCausalLM
    return cls.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_logprobs(model, seq: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([seq[:-1]])).logits[0].double(), dim=-1)
    return logp.gather(1, torch.tensor(seq[1:])[:, None])[:, 0].numpy()


def forward_logprobs(training_client, seq: list[int]) -> np.ndarray:
    from tinker import types

    datum = types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)})
    out = training_client.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    return np.asarray(out.tolist(), dtype=np.float64)


@pytest.mark.parametrize("variant", ["qwen3_5", "qwen3_5-vl"])
def test_qwen3_5_adapters_round_trip_with_peft(families: FamilyServers, variant: str, tmp_path: Path) -> None:
    """A PEFT adapter on every text linear (DeltaNet, attention, MLP) imports and computes what
    PEFT computes; trained further and saved, PEFT loads our checkpoint (its adapter_config
    names the DeltaNet linears) and reproduces our log-probs; and the server reloads it."""
    import base64
    import json

    import requests
    import tinker
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from tinker import types

    server, model_dir = families.server(variant), families.model(variant)
    torch.manual_seed(0)
    peft_model = get_peft_model(hf_model(model_dir, variant), LoraConfig(
        r=4, lora_alpha=16, target_modules=TEXT_LINEAR, lora_dropout=0.0, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    peft_model.save_pretrained(str(tmp_path / "peft"))
    theirs = hf_logprobs(peft_model.eval(), SEQ)

    body = {"name": f"imp-{variant}", "adapter_config": json.loads((tmp_path / "peft" / "adapter_config.json").read_text()),
            "adapter_model": base64.b64encode((tmp_path / "peft" / "adapter_model.safetensors").read_bytes()).decode()}
    r = requests.post(server.http_url("/api/v1/twinkle/import_adapter"), headers={"X-API-Key": KEYS["alice"]},
                      json=body, timeout=60)
    assert r.status_code == 200, r.text
    service = tinker.ServiceClient(base_url=f"http://{server.host}:{server.http_port}", api_key=KEYS["alice"])
    made = service.create_training_client_from_state(r.json()["tinker_path"])
    clone = resolved(made)
    ours = forward_logprobs(clone, SEQ)
    print(f"{variant}: imported PEFT adapter, max |ours - PEFT| log-prob {np.max(np.abs(ours - theirs)):.2e}")
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)

    for _ in range(2):
        clone.forward_backward([types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]),
                                            loss_fn_inputs={"target_tokens": SEQ[1:]})], "cross_entropy").result()
        clone.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    trained = forward_logprobs(clone, SEQ)
    assert np.max(np.abs(trained - ours)) > 1e-3, "training changed nothing"
    path = clone.save_state(f"trained-{variant}").result().path
    data_dir = families.root / f"server-{variant}" / "data"
    saved = list(data_dir.glob(f"tenants/alice/runs/*/weights/trained-{variant}"))
    assert len(saved) == 1, saved
    config = json.loads((saved[0] / "adapter_config.json").read_text())
    assert set(config["target_modules"]) == set(TEXT_LINEAR), config["target_modules"]
    reloaded_peft = PeftModel.from_pretrained(hf_model(model_dir, variant), str(saved[0])).eval()
    from_peft = hf_logprobs(reloaded_peft, SEQ)
    print(f"{variant}: our saved checkpoint in PEFT, max |ours - PEFT| log-prob {np.max(np.abs(trained - from_peft)):.2e}")
    np.testing.assert_allclose(trained, from_peft, atol=1e-4, rtol=0)

    made = service.create_training_client_from_state(path)
    again = resolved(made)
    np.testing.assert_array_equal(forward_logprobs(again, SEQ), trained)


# ---- recurrent state slots in the sampler's capacity -------------------------------------------------


def test_qwen3_5_state_slots_are_counted_in_capacity(families: FamilyServers, server_bin: Path, tmp_path: Path) -> None:
    """sampler.state_slots: 4. Capacity and /metrics report 4 slots and 0 in use; 5 samples in
    one request (limit + 1) are refused naming both numbers; three concurrent requests of 2
    samples (6 sequences for 4 slots) all complete, one waiting for room; then every slot is
    free again. A dense model reports 0 slots."""
    import concurrent.futures

    import requests
    import tinker
    from tinker import types
    from twinkle_client._proto.twinkle.v1 import utility_pb2 as upb

    from e2e_support import prom
    from e2e_support.training import Client

    slots = 4
    config = configs.merged(configs.base_config(families.model("qwen3_5")),
                            auth_overrides(sampler={"state_slots": slots}))
    server = launch(server_bin, configs.write_config(tmp_path / "twinkle.yaml", config), config, tmp_path)
    try:
        server.wait_ports(scaled(STARTUP_TIMEOUT_S))
        server.wait_health("SERVING", scaled(STARTUP_TIMEOUT_S))
        client = Client(server.grpc_address, KEYS["alice"])

        def capacity():
            return client.utility.GetCapacity(upb.GetCapacityRequest(), metadata=client.metadata, timeout=10)

        def gauges() -> tuple[float, float]:
            samples = prom.parse(requests.get(server.http_url("/metrics"), timeout=10).text)
            return (prom.value(samples, "twinkle_sampler_state_slots", state="in_use"),
                    prom.value(samples, "twinkle_sampler_state_slots", state="total"))

        service = tinker.ServiceClient(base_url=f"http://{server.host}:{server.http_port}", api_key=KEYS["alice"])
        made = service.create_sampling_client(base_model=FAMILIES["qwen3_5"])
        sampler = resolved(made)
        prompt = types.ModelInput.from_ints(SEQ[:6])
        params = types.SamplingParams(max_tokens=24, temperature=1.0, seed=3)
        sampler.sample(prompt, num_samples=1, sampling_params=params).result()  # the lane has answered once
        assert (capacity().sampler_state_slots_total, capacity().sampler_state_slots_in_use) == (slots, 0)
        assert [(w.state_slots_total, w.state_slots_in_use) for w in capacity().sampler_workers] == [(slots, 0)]

        with pytest.raises(tinker.BadRequestError) as refused:
            sampler.sample(prompt, num_samples=slots + 1, sampling_params=params).result()
        assert "num_samples: 5 exceeds the 4 recurrent state slots" in str(refused.value)

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(lambda s: sampler.sample(prompt, num_samples=2, sampling_params=types.SamplingParams(
                max_tokens=24, temperature=1.0, seed=s)).result(), seed) for seed in range(3)]
            results = [f.result(timeout=scaled(120)) for f in futures]
        assert [len(r.sequences) for r in results] == [2, 2, 2]
        assert capacity().sampler_state_slots_in_use == 0
        wait_until(lambda: gauges() == (0.0, float(slots)), scaled(10), "the state-slot gauges at idle")  # sampled each second
    finally:
        stop_all([server])

    dense = families.server("qwen3_moe")  # no DeltaNet layers: no slots
    dense_client = Client(dense.grpc_address, KEYS["alice"])
    dense_capacity = dense_client.utility.GetCapacity(upb.GetCapacityRequest(), metadata=dense_client.metadata, timeout=10)
    assert dense_capacity.sampler_state_slots_total == 0 and dense_capacity.sampler_state_slots_in_use == 0
