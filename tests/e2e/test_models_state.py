"""Several base models: what is kept beyond one request names its model (issue 17).

The two-model deployment of test_models.py (the tiny Qwen3 first, the default; a tiny Llama
with the same tokenizer and the same weight shapes, so only the numbers tell which model ran),
with auth on (tenants alice, bob and carol, an admin), and four things that outlive a call:

- an imported PEFT adapter (import_adapter's `base_model`): checked against and recorded on
  the model it names; loaded, it computes what PEFT computes on that model;
- another tenant's published checkpoint: sampled on the model its owner trained it on;
- usage: every count names the model it was used on (billing events' `base_model`), exactly,
  and so do the adapter and sampler series on /metrics (label `model`);
- a sampling session on the second model, after a server restart: reopened on that model.
Each would silently run on the default model otherwise; the log-probs say which model ran.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "1")

import tinker  # noqa: E402
from tinker import types  # noqa: E402

from e2e_support import configs  # noqa: E402
from e2e_support.server import ServerProcess, launch, stop_all  # noqa: E402
from e2e_support.training import KEYS, resolved, sha256_hex  # noqa: E402
from e2e_support.waiting import scaled, wait_until  # noqa: E402
from test_hosted_checkpoints import import_body, peft_adapter, peft_logprobs  # noqa: E402
from test_models import (  # noqa: E402
    LLAMA, QWEN, SEQ, datum, forward_logprobs, make_llama, reference_logprobs, two_model_config)

ADMIN_KEY = "tml-ops-admin-models-00112233445566778899aabb"
# Carol's usage is counted by one test only: no other test's late-flushed counts can reach it.
CAROL_KEY = "tml-carol-models-0123456789abcdef01234567"
STARTUP_TIMEOUT_S = 120.0


class Deployment:
    def __init__(self, server_bin: Path, server: ServerProcess, config: dict[str, Any], models: dict[str, Path],
                 workdir: Path) -> None:
        self.server_bin, self.server, self.config, self.models, self.workdir = server_bin, server, config, models, workdir
        self.started = [server]

    def restart(self) -> None:
        """SIGTERM, then the same config on the same ports and data_dir."""
        old = self.server
        old.send_signal(signal.SIGTERM)
        assert old.wait_exit(scaled(60)) == 0, old.logs()
        config = {**self.config, "server": {**self.config["server"], "grpc_port": old.grpc_port,
                                            "http_port": old.http_port}}
        workdir = self.workdir / f"run-{len(self.started)}"
        self.server = launch(self.server_bin, configs.write_config(workdir / "twinkle.yaml", config), config, workdir)
        self.started.append(self.server)
        self.server.wait_ports(scaled(STARTUP_TIMEOUT_S))
        self.server.wait_health("SERVING", scaled(STARTUP_TIMEOUT_S))


@pytest.fixture(scope="module")
def deployment(server_bin: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("models-state")
    llama = make_llama(root, tiny_model)
    workdir = root / "server"
    config = two_model_config(tiny_model, llama, workdir)
    for entry in config["models"]:
        entry["max_adapters"] = 8
    tenants = [{"id": t, "key_sha256": [sha256_hex(k)]} for t, k in KEYS.items()]
    tenants.append({"id": "ops", "key_sha256": [sha256_hex(ADMIN_KEY)], "role": "admin"})
    tenants.append({"id": "carol", "key_sha256": [sha256_hex(CAROL_KEY)]})
    config["auth"] = {"enabled": True, "tenants": tenants, "usage_flush_interval_s": 1}
    server = launch(server_bin, configs.write_config(workdir / "twinkle.yaml", config), config, workdir)
    d = Deployment(server_bin, server, config, {QWEN: tiny_model, LLAMA: llama}, workdir)
    try:
        server.wait_ports(scaled(STARTUP_TIMEOUT_S))
        server.wait_health("SERVING", scaled(STARTUP_TIMEOUT_S))
        yield d
    finally:
        stop_all(d.started)


def service(d: Deployment, key: str) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=f"http://{d.server.host}:{d.server.http_port}", api_key=key)


def api(d: Deployment, method: str, path: str, key: str, **kw: Any) -> requests.Response:
    return requests.request(method, d.server.http_url(f"/api/v1{path}"), headers={"X-API-Key": key},
                            timeout=60, **kw)


def prompt_logprobs(sampler: Any, seq: list[int]) -> np.ndarray:
    out = sampler.sample(types.ModelInput.from_ints(seq), num_samples=1, include_prompt_logprobs=True,
                         sampling_params=types.SamplingParams(max_tokens=1, temperature=0.0)).result()
    return np.asarray(out.prompt_logprobs[1:], dtype=np.float64)


def test_import_adapter_checks_and_records_the_named_model(deployment: Deployment, tmp_path: Path) -> None:
    llama = deployment.models[LLAMA]
    adapter = peft_adapter(llama, tmp_path / "peft")
    r = api(deployment, "POST", "/twinkle/import_adapter", KEYS["alice"],
            json=import_body(adapter, "on-llama", base_model=LLAMA))
    assert r.status_code == 200, r.text
    path, model_id = r.json()["tinker_path"], r.json()["model_id"]
    svc = service(deployment, KEYS["alice"])
    assert svc.create_rest_client().get_training_run(model_id).result().base_model == LLAMA
    clone = resolved(svc.create_training_client_from_state(path))
    assert clone.get_info().model_data.model_name == LLAMA
    ours = forward_logprobs(clone, SEQ)
    theirs = peft_logprobs(llama, adapter, SEQ)
    on_qwen = peft_logprobs(deployment.models[QWEN], adapter, SEQ)
    worst = float(np.max(np.abs(ours - theirs)))
    print(f"PEFT adapter imported on {LLAMA}: log-probs vs PEFT on {LLAMA}: max |diff| = {worst:.3e}; "
          f"vs PEFT on {QWEN}: {float(np.max(np.abs(ours - on_qwen))):.3e}")
    assert worst <= 1e-4
    assert float(np.max(np.abs(ours - on_qwen))) > 0.05
    # Without base_model: the default model's.
    r = api(deployment, "POST", "/twinkle/import_adapter", KEYS["alice"], json=import_body(adapter, "on-default"))
    assert r.status_code == 200, r.text
    assert svc.create_rest_client().get_training_run(r.json()["model_id"]).result().base_model == QWEN
    # An unknown model, or not a string: refused before anything is written.
    for bad, needle in (("no-such-model", "served: 'tiny-qwen3', 'tiny-llama'"), (7, "base_model: expected a string")):
        r = api(deployment, "POST", "/twinkle/import_adapter", KEYS["alice"],
                json=import_body(adapter, "refused", base_model=bad))
        assert r.status_code == 400 and needle in r.json()["detail"], r.text
    runs = svc.create_rest_client().list_training_runs().result().training_runs
    assert sum(1 for run in runs if run.training_run_id.startswith("import-")) == 2


def test_published_checkpoint_samples_on_its_owners_model(deployment: Deployment) -> None:
    alice, bob = service(deployment, KEYS["alice"]), service(deployment, KEYS["bob"])
    training = resolved(alice.create_lora_training_client(base_model=LLAMA, rank=4))
    for _ in range(2):
        training.forward_backward([datum(SEQ)], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = training.save_weights_for_sampler("shared").result().path
    alice.create_rest_client().publish_checkpoint_from_tinker_path(path).result()
    mine = resolved(alice.create_sampling_client(model_path=path))
    theirs = resolved(bob.create_sampling_client(model_path=path))
    assert theirs.get_base_model() == LLAMA
    want = prompt_logprobs(mine, SEQ)
    np.testing.assert_allclose(prompt_logprobs(theirs, SEQ), want, atol=1e-6, rtol=0)
    np.testing.assert_allclose(forward_logprobs(training, SEQ), want, atol=1e-4, rtol=0)
    # The OpenAI route, as Bob: the same model.
    done = requests.post(deployment.server.http_url("/v1/completions"), timeout=60,
                         headers={"Authorization": f"Bearer {KEYS['bob']}"},
                         json={"model": path, "prompt": SEQ, "max_tokens": 1, "temperature": 0, "echo": True,
                               "logprobs": 0})
    assert done.status_code == 200, done.text
    echoed = np.asarray(done.json()["choices"][0]["logprobs"]["token_logprobs"][1:len(SEQ)], dtype=np.float64)
    np.testing.assert_allclose(echoed, want, atol=1e-4, rtol=0)


def usage_totals(d: Deployment) -> Counter[tuple[str, str, str]]:
    """(tenant, base_model, kind) -> amount, over the billing window around now."""
    import time

    hour = int(time.time()) // 3600 * 3600
    iso = lambda t: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))  # noqa: E731
    r = requests.get(d.server.http_url("/api/v1/billing/usage/events"), headers={"X-API-Key": ADMIN_KEY},
                     params={"starting_on": iso(hour - 3600), "ending_before": iso(hour + 7200)}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    models = {e["base_model"] for e in body["data"]}
    assert models <= {QWEN, LLAMA}, models
    totals: Counter[tuple[str, str, str]] = Counter()
    for row in body["twinkle_usage"]:
        totals[(row["tenant"], row["base_model"], row["kind"])] += row["amount"]
    return totals


def model_gauges(d: Deployment) -> dict[tuple[str, str], float]:
    """(metric, model) -> value of the per-model adapter and sampler series on /metrics."""
    from e2e_support import prom

    samples = prom.parse(requests.get(d.server.http_url("/metrics"), timeout=30).text)
    out = {}
    for model in (QWEN, LLAMA):
        out[("adapters", model)] = prom.value(samples, "twinkle_adapters", model=model, state="all")
        out[("sampled", model)] = prom.value(samples, "twinkle_sampler_tokens_total", model=model)
    return out


def test_usage_and_metrics_name_the_model_they_were_used_on(deployment: Deployment) -> None:
    before = usage_totals(deployment)
    gauges_before = model_gauges(deployment)
    carol = service(deployment, CAROL_KEY)
    on_qwen = resolved(carol.create_lora_training_client(base_model=QWEN, rank=4))
    on_llama = resolved(carol.create_lora_training_client(base_model=LLAMA, rank=4))
    on_qwen.forward_backward([datum(SEQ)], "cross_entropy").result()
    for _ in range(2):
        on_llama.forward_backward([datum(SEQ)], "cross_entropy").result()
    on_llama.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = resolved(carol.create_sampling_client(base_model=LLAMA))
    sampler.sample(types.ModelInput.from_ints(SEQ[:4]), num_samples=1,
                   sampling_params=types.SamplingParams(max_tokens=3, temperature=0.0)).result()
    tokens = len(SEQ) - 1
    want = {("carol", QWEN, "training"): tokens, ("carol", LLAMA, "training"): 2 * tokens,
            ("carol", LLAMA, "optim_steps"): 1, ("carol", LLAMA, "prefill"): 4, ("carol", LLAMA, "sampled"): 3}

    def grown() -> dict[tuple[str, str, str], int] | None:
        after = usage_totals(deployment)
        diff = {k: after[k] - before[k] for k in after if k[0] == "carol" and after[k] != before[k]}
        return diff if all(diff.get(k, 0) >= v for k, v in want.items()) else None

    diff = wait_until(grown, scaled(30), "carol's usage counted")
    print(f"carol's usage by (tenant, base model, kind): {diff}")
    assert diff == want
    # /metrics: one adapter more on each model; the 3 sampled tokens on the Llama model's sampler.
    gauges = model_gauges(deployment)
    moved = {k: gauges[k] - gauges_before[k] for k in gauges}
    print(f"per-model series, after - before: {moved}")
    assert moved == {("adapters", QWEN): 1, ("adapters", LLAMA): 1, ("sampled", QWEN): 0, ("sampled", LLAMA): 3}


def test_sampling_session_reopens_on_its_model_after_a_restart(deployment: Deployment) -> None:
    svc = service(deployment, KEYS["alice"])
    sampler = resolved(svc.create_sampling_client(base_model=LLAMA))
    want = reference_logprobs(deployment.models[LLAMA], SEQ)
    np.testing.assert_allclose(prompt_logprobs(sampler, SEQ), want, atol=1e-4, rtol=0)
    deployment.restart()
    # The same client (same ports): its session is reopened on the Llama model, not the default.
    np.testing.assert_allclose(prompt_logprobs(sampler, SEQ), want, atol=1e-4, rtol=0)
    assert sampler.get_base_model() == LLAMA
    assert "reopened after a restart" in deployment.server.logs()
