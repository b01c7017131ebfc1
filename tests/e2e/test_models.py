"""Several base models in one deployment (config `models:`, docs/config.md).

One server serves two tiny models made here, never downloaded: the session's tiny Qwen3
(Qwen3ForCausalLM) and a tiny Llama (LlamaForCausalLM, scripts/make_reference_models.py) with
the same tokenizer. Different architectures and weights, so an answer proves which model ran:
every API's log-probs are compared with transformers' on the model the request named.

- the tinker SDK: capabilities list both; a training client on each base model trains and its
  forward equals that model's (and not the other's); its sampling client reports its model;
  an unknown base model is refused naming the served ones;
- capacity per model: models[1].max_adapters is 1, so its second adapter is refused (limit+1)
  while the first model still takes its own two, and its third is refused in turn;
- the Twinkle client (twinkle_client) and the raw gRPC API: AddAdapter.base_model, per-model
  GetCapacity, ServerInfo.models;
- the OpenAI routes: /v1/models lists both, `model` picks the one that samples, an unknown one
  is 404 naming the served ones.
The single-`model:` form is what every other test file runs.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import requests

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "1")

import tinker  # noqa: E402
from tinker import types  # noqa: E402

from e2e_support import configs, paths  # noqa: E402
from e2e_support.server import ServerProcess, launch, stop_all  # noqa: E402
from e2e_support.training import resolved  # noqa: E402
from e2e_support.waiting import scaled, wait_until  # noqa: E402

sys.path.insert(0, str(paths.REPO_ROOT / "scripts"))
import make_reference_models  # noqa: E402

QWEN, LLAMA = "tiny-qwen3", "tiny-llama"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
STARTUP_TIMEOUT_S = 120.0
# Capacity per model: the Qwen model holds 2 adapters, the Llama model 1.
CAPACITY = {QWEN: 2, LLAMA: 1}
SEQ = [5, 17, 42, 9, 77, 31, 8, 64]
API_KEY = "tml-local-dev"  # auth is off: any key, tenant "default"


def make_llama(out: Path, tokenizer_source: Path) -> Path:
    """A tiny random Llama with the tiny Qwen3's vocabulary, special ids and tokenizer files."""
    source = json.loads((tokenizer_source / "config.json").read_text())
    overrides = {key: source[key] for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")}
    overrides["max_position_embeddings"] = 512
    made = make_reference_models.make("llama-tied-linear-rope", out, seed=7, text_overrides=overrides)
    target = out / LLAMA
    made.rename(target)
    for name in TOKENIZER_FILES:
        if (tokenizer_source / name).is_file():
            shutil.copy2(tokenizer_source / name, target / name)
    return target


def two_model_config(qwen: Path, llama: Path, workdir: Path) -> dict[str, Any]:
    config = configs.base_config(qwen)
    del config["model"]
    del config["engine"]["devices"]  # with models:, each model lists its own
    config["models"] = [
        {"path": str(qwen), "name": QWEN, "devices": ["cpu"], "max_adapters": CAPACITY[QWEN]},
        {"path": str(llama), "name": LLAMA, "devices": ["cpu"], "max_adapters": CAPACITY[LLAMA]},
    ]
    config["storage"] = {"data_dir": str(workdir / "data")}
    return config


class Deployment:
    def __init__(self, server: ServerProcess, models: dict[str, Path]) -> None:
        self.server, self.models = server, models


@pytest.fixture(scope="module")
def deployment(server_bin: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("models")
    llama = make_llama(root, tiny_model)
    workdir = root / "server"
    config = two_model_config(tiny_model, llama, workdir)
    server = launch(server_bin, configs.write_config(workdir / "twinkle.yaml", config), config, workdir)
    try:
        server.wait_ports(scaled(STARTUP_TIMEOUT_S))
        server.wait_health("SERVING", scaled(STARTUP_TIMEOUT_S))
        yield Deployment(server, {QWEN: tiny_model, LLAMA: llama})
    finally:
        stop_all([server])


_REFERENCE: dict[Path, np.ndarray] = {}


def reference_logprobs(model_dir: Path, seq: list[int]) -> np.ndarray:
    """transformers' log-prob of each next token of `seq` on the model in model_dir."""
    if model_dir not in _REFERENCE:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0].double()
        logp = torch.log_softmax(logits, dim=-1)
        _REFERENCE[model_dir] = np.array([logp[i, seq[i + 1]].item() for i in range(len(seq) - 1)])
    return _REFERENCE[model_dir]


def service(d: Deployment) -> tinker.ServiceClient:
    """A tinker ServiceClient; use it in a with block: closing it finishes its session, which
    unloads its models, so each test starts with both models empty."""
    return tinker.ServiceClient(base_url=f"http://{d.server.host}:{d.server.http_port}", api_key=API_KEY)


def used_adapters(d: Deployment, name: str) -> int:
    from twinkle_client._proto.twinkle.v1 import utility_pb2 as upb
    from twinkle_client._proto.twinkle.v1 import utility_pb2_grpc as ugrpc

    with grpc.insecure_channel(d.server.grpc_address) as channel:
        return ugrpc.UtilityServiceStub(channel).GetCapacity(upb.GetCapacityRequest(base_model=name),
                                                             timeout=30).used_adapters


def wait_empty(d: Deployment) -> None:
    """Until the sessions earlier tests finished have released their models' adapters."""
    wait_until(lambda: all(used_adapters(d, name) == 0 for name in (QWEN, LLAMA)), scaled(30.0),
               "both models without adapters", interval_s=0.2)


def datum(seq: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                       loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)})


def forward_logprobs(training: Any, seq: list[int]) -> np.ndarray:
    out = training.forward([datum(seq)], "cross_entropy").result()
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].data, dtype=np.float64)


# ---- the tinker SDK ----------------------------------------------------------------------------


def test_tinker_routes_each_call_to_the_model_it_names(deployment: Deployment) -> None:
    with service(deployment) as svc:
        tinker_routes(deployment, svc)


def tinker_routes(deployment: Deployment, svc: tinker.ServiceClient) -> None:
    names = [m.model_name for m in svc.get_server_capabilities().supported_models]
    assert names == [QWEN, LLAMA]  # every served model, the default first

    qwen_ref = reference_logprobs(deployment.models[QWEN], SEQ)
    llama_ref = reference_logprobs(deployment.models[LLAMA], SEQ)
    assert np.max(np.abs(qwen_ref - llama_ref)) > 0.05  # the two models tell themselves apart

    clients = {}
    for name, arch, ref, other in ((QWEN, "Qwen3ForCausalLM", qwen_ref, llama_ref),
                                   (LLAMA, "LlamaForCausalLM", llama_ref, qwen_ref)):
        training = resolved(svc.create_lora_training_client(base_model=name, rank=4))
        clients[name] = training
        info = training.get_info()
        assert info.model_data.model_name == name
        assert info.model_data.arch == arch
        # A fresh adapter leaves the base model's outputs: this model's, not the other's.
        lp = forward_logprobs(training, SEQ)
        np.testing.assert_allclose(lp, ref, atol=1e-4, rtol=0)
        assert np.max(np.abs(lp - other)) > 0.05
        # It trains on its model: the loss falls.
        before = -float(lp.sum())
        for _ in range(3):
            training.forward_backward([datum(SEQ)], "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert -float(forward_logprobs(training, SEQ).sum()) < before

    # Sampling clients sample on their training client's model.
    for name, training in clients.items():
        sampler = training.save_weights_and_get_sampling_client()
        assert sampler.get_base_model() == name
        out = sampler.sample(types.ModelInput.from_ints(SEQ[:3]), num_samples=1,
                             sampling_params=types.SamplingParams(max_tokens=4, temperature=0.0)).result()
        assert len(out.sequences[0].tokens) == 4
        # The base model named directly: its prompt log-probs are that model's.
        base = svc.create_sampling_client(base_model=name)
        scored = base.sample(types.ModelInput.from_ints(SEQ), num_samples=1, include_prompt_logprobs=True,
                             sampling_params=types.SamplingParams(max_tokens=1, temperature=0.0)).result()
        ref = qwen_ref if name == QWEN else llama_ref
        np.testing.assert_allclose(np.asarray(scored.prompt_logprobs[1:], dtype=np.float64), ref, atol=1e-4, rtol=0)


def test_tinker_unknown_base_model_names_the_served_ones(deployment: Deployment) -> None:
    with service(deployment) as svc, pytest.raises(Exception) as refused:
        resolved(svc.create_lora_training_client(base_model="no-such-model", rank=4))
    message = str(refused.value)
    assert "base_model: 'no-such-model' is not served here (served: 'tiny-qwen3', 'tiny-llama')" in message
    reply = requests.post(deployment.server.http_url("/api/v1/create_sampling_session"),
                          headers={"x-api-key": API_KEY},
                          json={"session_id": "", "sampling_session_seq_id": 0, "base_model": "no-such-model",
                                "type": "create_sampling_session"}, timeout=30)
    assert reply.status_code == 400, reply.text
    assert "served: 'tiny-qwen3', 'tiny-llama'" in reply.text


def test_capacity_is_per_model_at_the_limit_plus_one(deployment: Deployment) -> None:
    wait_empty(deployment)
    with service(deployment) as svc:
        llama_one = resolved(svc.create_lora_training_client(base_model=LLAMA, rank=4))
        with pytest.raises(Exception) as full:  # limit + 1 on the Llama model
            resolved(svc.create_lora_training_client(base_model=LLAMA, rank=4))
        assert "base model 'tiny-llama' holds its maximum of 1 adapters (models[1].max_adapters)" in str(full.value)
        # The Llama model being full takes nothing from the Qwen model: it holds its own two.
        qwen = [resolved(svc.create_lora_training_client(base_model=QWEN, rank=4)) for _ in range(CAPACITY[QWEN])]
        with pytest.raises(Exception) as qwen_full:  # limit + 1 on the Qwen model
            resolved(svc.create_lora_training_client(base_model=QWEN, rank=4))
        assert "base model 'tiny-qwen3' holds its maximum of 2 adapters (models[0].max_adapters)" in str(qwen_full.value)
        assert used_adapters(deployment, QWEN) == 2 and used_adapters(deployment, LLAMA) == 1
        # Every adapter that was admitted still works, on its own model.
        np.testing.assert_allclose(forward_logprobs(llama_one, SEQ),
                                   reference_logprobs(deployment.models[LLAMA], SEQ), atol=1e-4, rtol=0)
        for training in qwen:
            np.testing.assert_allclose(forward_logprobs(training, SEQ),
                                       reference_logprobs(deployment.models[QWEN], SEQ), atol=1e-4, rtol=0)
    wait_empty(deployment)  # finishing the session released all three


# ---- the Twinkle API ---------------------------------------------------------------------------


def test_twinkle_grpc_adds_adapters_on_the_named_model(deployment: Deployment) -> None:
    from twinkle_client._proto.twinkle.v1 import training_pb2 as tpb
    from twinkle_client._proto.twinkle.v1 import training_pb2_grpc as tgrpc
    from twinkle_client._proto.twinkle.v1 import utility_pb2 as upb
    from twinkle_client._proto.twinkle.v1 import utility_pb2_grpc as ugrpc

    channel = grpc.insecure_channel(deployment.server.grpc_address)
    training, utility = tgrpc.TrainingServiceStub(channel), ugrpc.UtilityServiceStub(channel)
    try:
        info = utility.GetServerInfo(upb.GetServerInfoRequest(), timeout=30)
        assert [m.name for m in info.models] == [QWEN, LLAMA]
        assert [m.max_adapters for m in info.models] == [CAPACITY[QWEN], CAPACITY[LLAMA]]
        assert info.base_model_id == QWEN  # the default model
        assert {d.model for d in info.devices} == {QWEN, LLAMA}
        llama_info = utility.GetServerInfo(upb.GetServerInfoRequest(base_model=LLAMA), timeout=30)
        assert llama_info.architecture == "LlamaForCausalLM"

        used = {name: utility.GetCapacity(upb.GetCapacityRequest(base_model=name), timeout=30).used_adapters
                for name in (QWEN, LLAMA)}
        session = training.CreateSession(tpb.CreateSessionRequest(), timeout=30).session_id
        training.AddAdapter(tpb.AddAdapterRequest(adapter_name="grpc-llama", config=tpb.LoraConfig(r=4),
                                                  session_id=session, base_model=LLAMA), timeout=60)
        after = {name: utility.GetCapacity(upb.GetCapacityRequest(base_model=name), timeout=30) for name in (QWEN, LLAMA)}
        assert after[LLAMA].used_adapters == used[LLAMA] + 1 and after[LLAMA].base_model == LLAMA
        assert after[QWEN].used_adapters == used[QWEN]
        # The same name on the other model would make later calls ambiguous: refused.
        with pytest.raises(grpc.RpcError) as dup:
            training.AddAdapter(tpb.AddAdapterRequest(adapter_name="grpc-llama", config=tpb.LoraConfig(r=4),
                                                      base_model=QWEN), timeout=60)
        assert dup.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "on base model 'tiny-llama'" in dup.value.details()
        with pytest.raises(grpc.RpcError) as unknown:
            training.AddAdapter(tpb.AddAdapterRequest(adapter_name="x", config=tpb.LoraConfig(r=4),
                                                      base_model="no-such-model"), timeout=60)
        assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "served: 'tiny-qwen3', 'tiny-llama'" in unknown.value.details()
        with pytest.raises(grpc.RpcError) as bad_capacity:
            utility.GetCapacity(upb.GetCapacityRequest(base_model="no-such-model"), timeout=30)
        assert bad_capacity.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Later calls name only the adapter and reach its model.
        training.RemoveAdapter(tpb.AdapterRequest(adapter_name="grpc-llama"), timeout=60)
        assert utility.GetCapacity(upb.GetCapacityRequest(base_model=LLAMA), timeout=30).used_adapters == used[LLAMA]
    finally:
        channel.close()


def test_twinkle_client_model_id_picks_the_model(deployment: Deployment) -> None:
    from twinkle_client import init_twinkle_client
    from twinkle_client.model import MultiLoraTransformersModel

    client = init_twinkle_client(base_url=f"grpc://{deployment.server.grpc_address}", api_key=API_KEY)
    caps = client.get_server_capabilities()
    assert [m["model_name"] for m in caps["supported_models"]] == [QWEN, LLAMA]
    model = MultiLoraTransformersModel(model_id=f"ms://someone/{LLAMA}", client=client)
    added = model.add_adapter_to_model("demo", {"r": 4, "target_modules": "all-linear"})
    runs = {r.training_run_id: r for r in client.list_training_runs()}
    assert runs[added["run_id"]].base_model == LLAMA
    model.remove_adapter()


# ---- the OpenAI routes -------------------------------------------------------------------------


def test_openai_model_field_picks_the_model(deployment: Deployment) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    listed = requests.get(deployment.server.http_url("/v1/models"), headers=headers, timeout=30).json()
    assert [m["id"] for m in listed["data"][:2]] == [QWEN, LLAMA]
    for name in (QWEN, LLAMA):
        reply = requests.post(deployment.server.http_url("/v1/completions"), headers=headers, timeout=60,
                              json={"model": name, "prompt": SEQ, "max_tokens": 1, "temperature": 0,
                                    "echo": True, "logprobs": 0})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["model"] == name
        echoed = np.asarray(body["choices"][0]["logprobs"]["token_logprobs"][1:len(SEQ)], dtype=np.float64)
        np.testing.assert_allclose(echoed, reference_logprobs(deployment.models[name], SEQ), atol=1e-4, rtol=0)
    missing = requests.post(deployment.server.http_url("/v1/completions"), headers=headers, timeout=30,
                            json={"model": "no-such-model", "prompt": SEQ, "max_tokens": 1})
    assert missing.status_code == 404
    assert "base models served: 'tiny-qwen3', 'tiny-llama'" in missing.text


# ---- config at launch ----------------------------------------------------------------------------


def test_launch_names_the_model_whose_folder_is_missing(launch_config_file: Any, tiny_model: Path,
                                                        tmp_path: Path) -> None:
    config = two_model_config(tiny_model, tmp_path / "no-such-folder", tmp_path)
    server = launch_config_file(configs.write_config(tmp_path / "two.yaml", config))
    assert server.wait_exit(scaled(60.0)) == 1, server.logs()
    assert f"models[1].path: model directory {tmp_path / 'no-such-folder'} does not exist" in server.stderr_text()


def test_launch_refuses_a_gpu_shared_by_two_models(launch_config_file: Any, tiny_model: Path, tmp_path: Path) -> None:
    config = two_model_config(tiny_model, tiny_model, tmp_path)
    config["models"][0]["devices"] = ["cuda:0"]
    config["models"][1]["devices"] = ["cuda:0"]
    server = launch_config_file(configs.write_config(tmp_path / "two.yaml", config))
    assert server.wait_exit(scaled(60.0)) == 2, server.logs()
    assert ("models[1].devices: 'cuda:0' is already used by models[0] ('tiny-qwen3'); a device serves one model"
            in server.stderr_text())
