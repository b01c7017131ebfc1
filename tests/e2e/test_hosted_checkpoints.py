"""The hosted-service checkpoint surface (issue 19, items 1-3 and the checkpoint CLI), driven
by the real tinker SDK and its `tinker` CLI against a real server with auth on and two
tenants: retention (ttl_seconds, expires_at, PUT .../ttl, the reaper), per-tenant storage
quotas, export (save_weights_external, signed download URLs, the archive loaded by PEFT),
copy_weights, and publish/unpublish with read-only sharing.

Expiry is reached without sleeping: the server runs with testing.hooks, whose
POST /api/v1/twinkle/testing/advance_clock moves the retention clock forward and runs the
reaper at once (docs/api.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "1")

import tinker  # noqa: E402
from tinker import types  # noqa: E402
from twinkle_client._proto.twinkle.v1 import utility_pb2 as upb  # noqa: E402

from e2e_support import prom  # noqa: E402
from e2e_support.server import LaunchServer, ServerProcess  # noqa: E402
from e2e_support.training import Client, KEYS, auth_overrides, resolved  # noqa: E402

MODEL_NAME = "tiny-qwen3"
SEQ = [11, 42, 7, 99, 123, 5, 64, 300, 17, 250]
HOUR = 3600


def service(server: ServerProcess, key: str) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=f"http://{server.host}:{server.http_port}", api_key=key)


def lora_client(svc: tinker.ServiceClient, rank: int = 4) -> Any:
    return resolved(svc.create_lora_training_client(base_model=MODEL_NAME, rank=rank))


def datum(seq: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                       loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)})


def train(training: Any, steps: int = 2) -> None:
    for _ in range(steps):
        training.forward_backward([datum(SEQ)], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()


def overrides(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    base = auth_overrides(storage={"data_dir": str(tmp_path / "data")}, testing={"hooks": True},
                          server={"metrics_tenant_labels": True})
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return base


def advance_clock(server: ServerProcess, seconds: float, key: str = KEYS["alice"]) -> dict[str, Any]:
    r = requests.post(server.http_url("/api/v1/twinkle/testing/advance_clock"), json={"seconds": seconds},
                      headers={"X-API-Key": key}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def api(server: ServerProcess, method: str, path: str, key: str, **kw: Any) -> requests.Response:
    return requests.request(method, server.http_url(f"/api/v1{path}"), headers={"X-API-Key": key},
                            timeout=30, **kw)


def checkpoint(rest: Any, model_id: str, checkpoint_id: str) -> Any:
    matches = [c for c in rest.list_checkpoints(model_id).result().checkpoints if c.checkpoint_id == checkpoint_id]
    assert len(matches) == 1, [c.checkpoint_id for c in rest.list_checkpoints(model_id).result().checkpoints]
    return matches[0]


def fetch(url: str) -> tuple[int, bytes, dict[str, str]]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def capacity(server: ServerProcess, key: str) -> upb.Capacity:
    c = Client(server.grpc_address, key)
    try:
        return c.utility.GetCapacity(upb.GetCapacityRequest(), metadata=c.metadata, timeout=30)
    finally:
        c.close()


@pytest.fixture
def hosted(launch_server: LaunchServer, tmp_path: Path) -> ServerProcess:
    return launch_server(overrides(tmp_path))


# ---- retention --------------------------------------------------------------------------------

def test_ttl_on_saves_put_ttl_and_the_reaper_on_the_test_clock(hosted: ServerProcess, tmp_path: Path) -> None:
    svc = service(hosted, KEYS["alice"])
    rest = svc.create_rest_client()
    training = lora_client(svc)
    model_id = training.get_info().model_id
    keep = training.save_state("keep").result().path
    short = training.save_state("short", ttl_seconds=HOUR).result().path
    sampler = training.save_weights_for_sampler("samp", ttl_seconds=2 * HOUR).result().path

    assert checkpoint(rest, model_id, "weights/keep").expires_at is None
    short_ck = checkpoint(rest, model_id, "weights/short")
    samp_ck = checkpoint(rest, model_id, "sampler_weights/samp")
    assert short_ck.expires_at is not None and samp_ck.expires_at is not None
    assert round((short_ck.expires_at - short_ck.time).total_seconds()) == HOUR
    assert round((samp_ck.expires_at - samp_ck.time).total_seconds()) == 2 * HOUR
    # list_user_checkpoints and get_training_run report it too.
    users = {c.checkpoint_id: c for c in rest.list_user_checkpoints().result().checkpoints}
    assert users["weights/short"].expires_at == short_ck.expires_at
    run = rest.get_training_run(model_id).result()
    assert run.last_sampler_checkpoint is not None and run.last_sampler_checkpoint.expires_at is not None

    # PUT .../ttl sets, then clears, the expiry of "keep".
    rest.set_checkpoint_ttl_from_tinker_path(keep, 3 * HOUR).result()
    assert checkpoint(rest, model_id, "weights/keep").expires_at is not None
    rest.set_checkpoint_ttl_from_tinker_path(keep, None).result()
    assert checkpoint(rest, model_id, "weights/keep").expires_at is None
    # Out of range: negative, zero, past ten years, not an integer; nothing changes.
    for bad in (-5, 0, 10**12, 2**70):
        with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
            rest.set_checkpoint_ttl_from_tinker_path(keep, bad).result()
    r = api(hosted, "PUT", f"/training_runs/{model_id}/checkpoints/weights/keep/ttl", KEYS["alice"],
            json={"ttl_seconds": "soon"})
    assert r.status_code == 400 and "ttl_seconds" in r.json()["detail"]
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        training.save_state("bad-ttl", ttl_seconds=-1).result()
    assert checkpoint(rest, model_id, "weights/keep").expires_at is None
    # Bob cannot touch Alice's TTL: 404, like an unknown checkpoint.
    with pytest.raises(tinker.NotFoundError):
        service(hosted, KEYS["bob"]).create_rest_client().set_checkpoint_ttl_from_tinker_path(keep, HOUR).result()

    short_dir = next((tmp_path / "data").rglob("weights/short"))
    assert short_dir.is_dir()
    # To a minute before the expiry (by the server's own clock): nothing is due; then past it.
    now = datetime.fromisoformat(advance_clock(hosted, 0)["now"])
    assert advance_clock(hosted, (short_ck.expires_at - now).total_seconds() - 60)["deleted"] == []
    deleted = advance_clock(hosted, 61)["deleted"]
    assert len(deleted) == 1 and deleted[0].endswith("/weights/short"), deleted
    ids = {c.checkpoint_id for c in rest.list_checkpoints(model_id).result().checkpoints}
    assert ids == {"weights/keep", "sampler_weights/samp"}
    assert not short_dir.exists()
    with pytest.raises((tinker.NotFoundError, tinker.RequestFailedError)):
        training.load_state(short).result()
    reaped = advance_clock(hosted, HOUR)["deleted"]
    assert len(reaped) == 1 and reaped[0].endswith("/sampler_weights/samp")
    assert {c.checkpoint_id for c in rest.list_checkpoints(model_id).result().checkpoints} == {"weights/keep"}
    with pytest.raises(Exception, match="no checkpoint"):
        resolved(svc.create_sampling_client(model_path=sampler)).sample(
            types.ModelInput.from_ints(SEQ[:3]), 1, types.SamplingParams(max_tokens=1)).result()


def test_reaper_deletion_is_finished_after_a_restart(launch_server: LaunchServer, tmp_path: Path) -> None:
    """A deletion cut short after the directory went (the registry row still there) is
    finished at the next start: the row is dropped and the checkpoint never comes back."""
    server = launch_server(overrides(tmp_path))
    svc = service(server, KEYS["alice"])
    rest = svc.create_rest_client()
    training = lora_client(svc)
    model_id = training.get_info().model_id
    training.save_state("gone", ttl_seconds=HOUR).result()
    training.save_state("stays").result()
    directory = next((tmp_path / "data").rglob("weights/gone"))
    server.stop()
    # What the reaper's first, durable step leaves: the directory renamed away.
    directory.rename(directory.parent / ".tmp-deleted-gone-crash")
    server = launch_server(overrides(tmp_path))
    rest = service(server, KEYS["alice"]).create_rest_client()
    assert {c.checkpoint_id for c in rest.list_checkpoints(model_id).result().checkpoints} == {"weights/stays"}
    assert not (directory.parent / ".tmp-deleted-gone-crash").exists()


# ---- quota ------------------------------------------------------------------------------------

def sampler_size(launch_server: LaunchServer, tmp_path: Path) -> int:
    server = launch_server(overrides(tmp_path / "probe"))
    svc = service(server, KEYS["alice"])
    training = lora_client(svc)
    training.save_weights_for_sampler("probe").result()
    size = checkpoint(svc.create_rest_client(), training.get_info().model_id, "sampler_weights/probe").size_bytes
    server.stop()
    assert size and size > 0
    return int(size)


def test_storage_quota_refuses_at_limit_plus_one(launch_server: LaunchServer, tmp_path: Path) -> None:
    size = sampler_size(launch_server, tmp_path)
    config = overrides(tmp_path)
    for tenant in config["auth"]["tenants"]:
        # Alice may hold exactly two checkpoints; Bob's quota is one byte short of two.
        tenant["quotas"] = {"storage_quota_bytes": 2 * size if tenant["id"] == "alice" else 2 * size - 1}
    server = launch_server(config)

    alice = lora_client(service(server, KEYS["alice"]))
    alice.save_weights_for_sampler("a1").result()
    alice.save_weights_for_sampler("a2").result()  # usage == quota: accepted

    bob_svc = service(server, KEYS["bob"])
    bob = lora_client(bob_svc)
    bob.save_weights_for_sampler("b1").result()
    with pytest.raises(Exception) as refused:
        bob.save_weights_for_sampler("b2").result()  # usage + size == quota + 1
    message = str(refused.value)
    assert "storage quota" in message, message
    assert f"quota of {2 * size - 1} bytes" in message and f"uses {size} bytes" in message, message
    # Nothing was written for the refused save.
    bob_id = bob.get_info().model_id
    assert [c.checkpoint_id for c in bob_svc.create_rest_client().list_checkpoints(bob_id).result().checkpoints] == [
        "sampler_weights/b1"]
    assert not list((tmp_path / "data").rglob("b2")) and not list((tmp_path / "data").rglob(".tmp-b2*"))

    # Copies count too: a direct route answers 403 naming the quota (nothing written). Not 429:
    # a full quota does not clear by itself, and the SDK retries a 429 for minutes.
    r = api(server, "POST", "/copy_weights", KEYS["bob"],
            json={"source_path": f"tinker://{bob_id}/sampler_weights/b1", "destination_project_id": "p"})
    assert r.status_code == 403 and "storage quota" in r.json()["detail"], r.text
    assert r.headers["x-should-retry"] == "false"
    assert [r.training_run_id for r in bob_svc.create_rest_client().list_training_runs().result().training_runs] == [
        bob_id]  # no run was left for the refused copy

    cap = capacity(server, KEYS["bob"])
    assert cap.storage_bytes_used == size and cap.storage_quota_bytes == 2 * size - 1
    assert capacity(server, KEYS["alice"]).storage_bytes_used == 2 * size
    samples = prom.parse(requests.get(server.http_url("/metrics"), timeout=10).text)
    assert prom.value(samples, "twinkle_storage_bytes", tenant="bob") == size
    assert prom.value(samples, "twinkle_storage_bytes", tenant="alice") == 2 * size

    # Expiry frees the space: Bob's b1 expires, then b2 fits.
    bob_rest = bob_svc.create_rest_client()
    bob_rest.set_checkpoint_ttl_from_tinker_path(f"tinker://{bob_id}/sampler_weights/b1", HOUR).result()
    advance_clock(server, HOUR, KEYS["bob"])
    bob.save_weights_for_sampler("b2").result()
    assert capacity(server, KEYS["bob"]).storage_bytes_used == size


# ---- export -----------------------------------------------------------------------------------

def peft_logprobs(model_dir: Path, adapter_dir: Path, seq: list[int]) -> np.ndarray:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    ids = torch.tensor([seq[:-1]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
    return logp.gather(1, torch.tensor(seq[1:])[:, None])[:, 0].numpy()


def test_export_signed_urls_download_and_peft_logprobs(hosted: ServerProcess, tiny_model: Path,
                                                       tmp_path: Path) -> None:
    svc = service(hosted, KEYS["alice"])
    rest = svc.create_rest_client()
    training = lora_client(svc, rank=8)
    train(training, 3)
    ours = np.asarray(training.forward([datum(SEQ)], "cross_entropy").result()
                      .loss_fn_outputs[0]["logprobs"].to_numpy(), dtype=np.float64)
    path = training.save_weights_external("exp", ttl_seconds=HOUR).result().path
    model_id = training.get_info().model_id
    assert path == f"tinker://{model_id}/external_weights/exp"
    listed = checkpoint(rest, model_id, "external_weights/exp")
    assert listed.checkpoint_type == "external" and listed.expires_at is not None

    signed = rest.get_external_weights_urls(path).result()
    # The generated signing key is kept beside the registry, readable by the server's user only.
    assert (tmp_path / "data" / "url_signing.key").stat().st_mode & 0o077 == 0
    assert set(signed.urls) == {"adapter_model.safetensors", "adapter_config.json"}
    raw = api(hosted, "GET", f"/training_runs/{model_id}/checkpoints/external_weights/exp/external_weights_urls",
              KEYS["alice"]).json()
    out = tmp_path / "adapter"
    out.mkdir()
    for name, url in signed.urls.items():
        status, body, headers = fetch(url)
        assert status == 200
        digest = hashlib.sha256(body).hexdigest()
        assert headers["X-Checksum-SHA256"] == digest == raw["sha256"][name]
        (out / name).write_bytes(body)
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 8
    theirs = peft_logprobs(tiny_model, out, SEQ)
    worst = float(np.max(np.abs(theirs - ours)))
    print(f"downloaded export loaded in PEFT vs our log-probs: max |diff| = {worst:.3e}")
    assert worst <= 1e-4

    url = signed.urls["adapter_config.json"]
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query))
    base = f"{parts.scheme}://{parts.netloc}"
    # Tampered signature, another tenant in the path, a later expiry: 403.
    flipped = query["sig"][:-1] + ("0" if query["sig"][-1] != "0" else "1")
    assert fetch(f"{base}{parts.path}?expires={query['expires']}&sig={flipped}")[0] == 403
    assert fetch(f"{base}{parts.path.replace('/alice/', '/bob/')}?{parts.query}")[0] == 403
    assert fetch(f"{base}{parts.path}?expires={int(query['expires']) + 1}&sig={query['sig']}")[0] == 403
    assert fetch(f"{base}{parts.path}?expires={query['expires']}")[0] == 403
    # Path traversal in any component: refused before anything is read.
    for evil in ("/twinkle/weights/alice/..%2F..%2Fetc/weights/exp/adapter_config.json",
                 f"/twinkle/weights/alice/{model_id}/external_weights/exp/..%2F..%2F..%2Fregistry.sqlite",
                 f"/twinkle/weights/alice/{model_id}/external_weights/exp/sub/adapter_config.json"):
        status, body, _ = fetch(f"{base}{evil}?{parts.query}")
        assert status in (400, 403, 404) and b"registry" not in body[:16], (evil, status)
    # Bob, with his own key, cannot get URLs for Alice's unpublished checkpoint.
    bob_rest = service(hosted, KEYS["bob"]).create_rest_client()
    with pytest.raises(tinker.NotFoundError):
        bob_rest.get_external_weights_urls(path).result()
    # The URL expires with the retention clock (no sleeping).
    advance_clock(hosted, HOUR + 1)
    status, body, _ = fetch(url)
    assert status == 403 and b"expired" in body


def test_copy_weights(hosted: ServerProcess) -> None:
    alice_svc, bob_svc = service(hosted, KEYS["alice"]), service(hosted, KEYS["bob"])
    alice_rest, bob_rest = alice_svc.create_rest_client(), bob_svc.create_rest_client()
    training = lora_client(alice_svc)
    train(training, 1)
    source = training.save_state("src").result().path
    copy = alice_rest.copy_weights(source, "archive", ttl_seconds=2 * HOUR).result()
    assert copy != source and copy.endswith("/weights/src")
    copy_run = copy.split("/")[2]
    listed = checkpoint(alice_rest, copy_run, "weights/src")
    assert listed.expires_at is not None and listed.size_bytes == checkpoint(
        alice_rest, training.get_info().model_id, "weights/src").size_bytes
    # The copy loads like the source.
    clone = resolved(alice_svc.create_training_client_from_state(copy))
    a = training.forward([datum(SEQ)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    b = clone.forward([datum(SEQ)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    # Bob cannot copy what Alice has not published.
    with pytest.raises(tinker.NotFoundError):
        bob_rest.copy_weights(source, "mine").result()
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        alice_rest.copy_weights(source, "archive", ttl_seconds=-1).result()


def test_copy_weights_honours_the_idempotency_key(hosted: ServerProcess, tmp_path: Path) -> None:
    """The SDK sends one X-Idempotency-Key across its HTTP retries of a call: a replay answers
    the first copy and copies nothing; the key with another body is refused; a new key copies."""
    svc = service(hosted, KEYS["alice"])
    rest = svc.create_rest_client()
    training = lora_client(svc)
    source = training.save_state("idem").result().path

    def copies() -> list[str]:
        return sorted(c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints
                      if c.tinker_path.endswith("/weights/idem") and c.tinker_path != source)

    def copy(key: str, body: dict[str, Any]) -> requests.Response:
        return requests.post(hosted.http_url("/api/v1/copy_weights"), json=body, timeout=30,
                             headers={"X-API-Key": KEYS["alice"], "X-Idempotency-Key": key})

    body = {"source_path": source, "destination_project_id": "p", "ttl_seconds": HOUR}
    first = copy("stainless-python-retry-1", body)
    assert first.status_code == 200, first.text
    assert copies() == [first.json()["tinker_path"]]
    directories = sorted(str(p) for p in (tmp_path / "data").rglob("weights/idem"))
    for _ in range(3):
        again = copy("stainless-python-retry-1", body)
        assert again.status_code == 200 and again.json() == first.json(), again.text
    assert copies() == [first.json()["tinker_path"]]
    assert sorted(str(p) for p in (tmp_path / "data").rglob("weights/idem")) == directories  # nothing written
    conflict = copy("stainless-python-retry-1", {**body, "ttl_seconds": 2 * HOUR})
    assert conflict.status_code == 400 and "X-Idempotency-Key" in conflict.json()["detail"], conflict.text
    other = copy("stainless-python-retry-2", body)
    assert other.status_code == 200 and other.json() != first.json()
    assert len(copies()) == 2
    # A failed copy keeps nothing: its replay is tried again (and fails again, the same way).
    for _ in range(2):
        bad = copy("stainless-python-retry-3", {**body, "source_path": source + "-missing"})
        assert bad.status_code == 404, bad.text
    assert copy("x" * 257, body).status_code == 400  # the key's length, at limit + 1
    assert copy("x" * 256, body).status_code == 200
    # Without a key, each call copies (the SDK always sends one).
    requests.post(hosted.http_url("/api/v1/copy_weights"), json=body, headers={"X-API-Key": KEYS["alice"]},
                  timeout=30).raise_for_status()
    assert len(copies()) == 4
    # Another tenant's replay of the same key is its own call (keys are per tenant).
    bob = requests.post(hosted.http_url("/api/v1/copy_weights"), json=body, timeout=30,
                        headers={"X-API-Key": KEYS["bob"], "X-Idempotency-Key": "stainless-python-retry-1"})
    assert bob.status_code == 404, bob.text


def test_a_ttl_survives_re_registration_after_a_restart(launch_server: LaunchServer, tmp_path: Path) -> None:
    """A checkpoint registered again from its directory at startup (its registry row lost,
    e.g. a registry restored from an older backup) keeps its expiry, also one set after the
    save, and the reaper still deletes it when it is due."""
    import sqlite3

    server = launch_server(overrides(tmp_path))
    svc = service(server, KEYS["alice"])
    rest = svc.create_rest_client()
    training = lora_client(svc)
    model_id = training.get_info().model_id
    training.save_state("saved-ttl", ttl_seconds=HOUR).result()
    later = training.save_state("later-ttl").result().path
    rest.set_checkpoint_ttl_from_tinker_path(later, 3 * HOUR).result()
    cleared = training.save_weights_for_sampler("cleared", ttl_seconds=HOUR).result().path
    rest.set_checkpoint_ttl_from_tinker_path(cleared, None).result()
    training.save_state("forever").result()
    before = {c.checkpoint_id: (c.expires_at, c.time) for c in rest.list_checkpoints(model_id).result().checkpoints}
    assert before["weights/saved-ttl"][0] is not None and before["weights/later-ttl"][0] is not None
    assert before["sampler_weights/cleared"][0] is None and before["weights/forever"][0] is None
    server.stop()  # SIGTERM
    with sqlite3.connect(tmp_path / "data" / "registry.sqlite") as db:
        assert db.execute("DELETE FROM checkpoints").rowcount == len(before)
    server = launch_server(overrides(tmp_path))
    assert "registered (complete on disk, missing from the registry)" in server.logs()
    rest = service(server, KEYS["alice"]).create_rest_client()
    after = {c.checkpoint_id: (c.expires_at, c.time) for c in rest.list_checkpoints(model_id).result().checkpoints}
    assert after == before
    advance_clock(server, HOUR + 1)
    assert {c.checkpoint_id for c in rest.list_checkpoints(model_id).result().checkpoints} == {
        "weights/later-ttl", "sampler_weights/cleared", "weights/forever"}


# ---- publish and share -------------------------------------------------------------------------

def test_publish_share_read_only_and_unpublish_revokes(hosted: ServerProcess) -> None:
    alice_svc, bob_svc = service(hosted, KEYS["alice"]), service(hosted, KEYS["bob"])
    alice_rest, bob_rest = alice_svc.create_rest_client(), bob_svc.create_rest_client()
    training = lora_client(alice_svc)
    train(training, 2)
    model_id = training.get_info().model_id
    state = training.save_state("st").result().path
    sampler = training.save_weights_for_sampler("sp").result().path
    export = training.save_weights_external("ex").result().path

    # Unpublished: Bob gets 404 everywhere.
    with pytest.raises(tinker.NotFoundError):
        bob_rest.get_weights_info_by_tinker_path(state).result()
    with pytest.raises(tinker.NotFoundError):
        bob_rest.get_training_run(model_id, access_scope="accessible").result()
    with pytest.raises(Exception, match="no checkpoint"):
        resolved(bob_svc.create_training_client_from_state(state))
    assert model_id not in [r.training_run_id for r in
                            bob_rest.list_training_runs(access_scope="accessible").result().training_runs]

    for path in (state, sampler, export):
        alice_rest.publish_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.BadRequestError, match="already published"):
        alice_rest.publish_checkpoint_from_tinker_path(state).result()
    assert checkpoint(alice_rest, model_id, "weights/st").public is True

    # Bob reads: listings with access_scope, weights info, load, sample, download.
    runs = bob_rest.list_training_runs(access_scope="accessible").result().training_runs
    shared_run = next(r for r in runs if r.training_run_id == model_id)
    assert shared_run.model_owner == "alice"
    assert model_id not in [r.training_run_id for r in bob_rest.list_training_runs().result().training_runs]
    assert bob_rest.get_training_run(model_id, access_scope="accessible").result().model_owner == "alice"
    listed = api(hosted, "GET", "/checkpoints?access_scope=accessible", KEYS["bob"]).json()["checkpoints"]
    assert {c["tinker_path"] for c in listed} == {state, sampler, export}
    assert all(c["public"] for c in listed)
    assert bob_rest.get_weights_info_by_tinker_path(state).result().lora_rank == 4
    clone = resolved(bob_svc.create_training_client_from_state(state))
    ref = training.forward([datum(SEQ)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    got = clone.forward([datum(SEQ)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(got, ref, atol=1e-6, rtol=0)
    prompt = types.ModelInput.from_ints(SEQ[:4])
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    mine = resolved(alice_svc.create_sampling_client(model_path=sampler)).sample(prompt, 2, params).result()
    theirs = resolved(bob_svc.create_sampling_client(model_path=sampler)).sample(prompt, 2, params).result()
    assert [s.tokens for s in theirs.sequences] == [s.tokens for s in mine.sequences]
    # The OpenAI routes list it as a model for Bob, and sample it.
    v1 = {"Authorization": f"Bearer {KEYS['bob']}"}
    models = requests.get(hosted.http_url("/v1/models"), headers=v1, timeout=30).json()["data"]
    assert {"id": sampler, "owned_by": "published"}.items() <= next(m for m in models if m["id"] == sampler).items()
    done = requests.post(hosted.http_url("/v1/completions"), headers=v1, timeout=60,
                         json={"model": sampler, "prompt": SEQ[:4], "max_tokens": 3, "temperature": 0})
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3, done.text
    urls = bob_rest.get_external_weights_urls(export).result().urls
    assert "/bob/" in urls["adapter_config.json"]
    assert fetch(urls["adapter_config.json"])[0] == 200

    # Read-only: Bob can neither delete, set a TTL, republish nor unpublish it (404).
    with pytest.raises(tinker.NotFoundError):
        bob_rest.delete_checkpoint_from_tinker_path(state).result()
    with pytest.raises(tinker.NotFoundError):
        bob_rest.set_checkpoint_ttl_from_tinker_path(state, HOUR).result()
    with pytest.raises(tinker.NotFoundError):
        bob_rest.publish_checkpoint_from_tinker_path(state).result()
    with pytest.raises(tinker.NotFoundError):
        bob_rest.unpublish_checkpoint_from_tinker_path(state).result()
    assert checkpoint(alice_rest, model_id, "weights/st").public is True

    # Unpublish revokes at once: Bob's URL, listings and loads.
    for path in (state, sampler, export):
        alice_rest.unpublish_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.BadRequestError, match="already private"):
        alice_rest.unpublish_checkpoint_from_tinker_path(state).result()
    assert fetch(urls["adapter_config.json"])[0] == 404
    assert api(hosted, "GET", "/checkpoints?access_scope=accessible", KEYS["bob"]).json()["checkpoints"] == []
    with pytest.raises(tinker.NotFoundError):
        bob_rest.get_weights_info_by_tinker_path(state).result()
    with pytest.raises(Exception, match="no checkpoint"):
        resolved(bob_svc.create_sampling_client(model_path=sampler)).sample(prompt, 1, params).result()
    models = requests.get(hosted.http_url("/v1/models"), headers=v1, timeout=30).json()["data"]
    assert sampler not in [m["id"] for m in models]
    r = api(hosted, "GET", "/training_runs?access_scope=everything", KEYS["bob"])
    assert r.status_code == 400 and "access_scope" in r.json()["detail"]


# ---- the tinker CLI ----------------------------------------------------------------------------

def tinker_cli(server: ServerProcess, key: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TINKER_BASE_URL": f"http://{server.host}:{server.http_port}", "TINKER_API_KEY": key}
    cli = Path(sys.executable).parent / "tinker"
    return subprocess.run([str(cli), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                          check=False)


def test_tinker_checkpoint_cli(hosted: ServerProcess, tiny_model: Path, tmp_path: Path) -> None:
    svc = service(hosted, KEYS["alice"])
    rest = svc.create_rest_client()
    training = lora_client(svc, rank=8)
    train(training, 2)
    model_id = training.get_info().model_id
    state = training.save_state("cli").result().path
    export = training.save_weights_external("cli-ex").result().path

    def ok(*args: str) -> str:
        result = tinker_cli(hosted, KEYS["alice"], *args, cwd=tmp_path)
        assert result.returncode == 0, f"tinker {' '.join(args)}: {result.stdout}\n{result.stderr}"
        return result.stdout

    listed = json.loads(ok("--format", "json", "checkpoint", "list", "--run-id", model_id))
    assert {c["checkpoint_id"] for c in listed["checkpoints"]} == {"weights/cli", "external_weights/cli-ex"}
    everything = json.loads(ok("--format", "json", "checkpoint", "list"))
    assert {state, export} <= {c["tinker_path"] for c in everything["checkpoints"]}
    assert "2 checkpoints" in ok("checkpoint", "list", "--run-id", model_id)  # the table form
    info = json.loads(ok("--format", "json", "checkpoint", "info", state))
    record = checkpoint(rest, model_id, "weights/cli")
    assert info["checkpoint_id"] == "weights/cli" and info["tinker_path"] == state
    assert info["checkpoint_type"] == "training" and info["size_bytes"] == record.size_bytes > 0
    assert info["lora_rank"] == 8 and info["is_lora"] is True
    ok("checkpoint", "set-ttl", state, "--ttl", str(2 * HOUR))
    assert checkpoint(rest, model_id, "weights/cli").expires_at is not None
    ok("checkpoint", "set-ttl", state, "--remove")
    assert checkpoint(rest, model_id, "weights/cli").expires_at is None
    ok("checkpoint", "publish", state)
    assert checkpoint(rest, model_id, "weights/cli").public is True
    ok("checkpoint", "unpublish", state)
    assert checkpoint(rest, model_id, "weights/cli").public is False

    # download: an external export as is, and a training checkpoint through a temporary export.
    ok("checkpoint", "download", export, "--output", str(tmp_path / "dl"))
    got = tmp_path / "dl" / export.replace("tinker://", "").replace("/", "_")
    assert {p.name for p in got.iterdir()} == {"adapter_model.safetensors", "adapter_config.json"}
    ok("checkpoint", "download", state, "--output", str(tmp_path / "dl"))
    got_state = tmp_path / "dl" / state.replace("tinker://", "").replace("/", "_")
    assert (got_state / "adapter_model.safetensors").read_bytes() == (got / "adapter_model.safetensors").read_bytes()
    ours = np.asarray(training.forward([datum(SEQ)], "cross_entropy").result()
                      .loss_fn_outputs[0]["logprobs"].to_numpy(), dtype=np.float64)
    assert float(np.max(np.abs(peft_logprobs(tiny_model, got_state, SEQ) - ours))) <= 1e-4

    ok("checkpoint", "delete", state, "--yes")
    assert {c.checkpoint_id for c in rest.list_checkpoints(model_id).result().checkpoints} == {
        "external_weights/cli-ex"}
    # Bob's CLI cannot delete Alice's export.
    result = tinker_cli(hosted, KEYS["bob"], "checkpoint", "delete", export, "--yes", cwd=tmp_path)
    assert {c.checkpoint_id for c in rest.list_checkpoints(model_id).result().checkpoints} == {
        "external_weights/cli-ex"}, result.stdout + result.stderr


# ---- import ------------------------------------------------------------------------------------

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_adapter(model_dir: Path, out: Path, r: int = 4, alpha: float = 16, targets: list[str] | None = None) -> Path:
    """A LoRA adapter made and "trained" by PEFT itself (random B, so it is not a no-op)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or ALL_LINEAR,
                                            lora_dropout=0.0, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(str(out))
    return out


def import_body(adapter: Path, name: str, tensors: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    import base64

    from safetensors.torch import save

    weights = (adapter / "adapter_model.safetensors").read_bytes() if tensors is None else save(tensors)
    return {"name": name, "adapter_config": json.loads((adapter / "adapter_config.json").read_text()),
            "adapter_model": base64.b64encode(weights).decode(), **extra}


def test_import_a_peft_adapter_trained_elsewhere(launch_server: LaunchServer, tiny_model: Path,
                                                 tmp_path: Path) -> None:
    from safetensors.torch import load_file

    limit = 200_000
    server = launch_server(overrides(tmp_path, storage={"data_dir": str(tmp_path / "data"),
                                                        "max_import_bytes": limit}))
    adapter = peft_adapter(tiny_model, tmp_path / "peft")
    r = api(server, "POST", "/twinkle/import_adapter", KEYS["alice"], json=import_body(adapter, "imp", ttl_seconds=HOUR))
    assert r.status_code == 200, r.text
    path, model_id = r.json()["tinker_path"], r.json()["model_id"]
    assert path == f"tinker://{model_id}/weights/imp"
    svc = service(server, KEYS["alice"])
    rest = svc.create_rest_client()
    assert checkpoint(rest, model_id, "weights/imp").expires_at is not None
    assert rest.get_weights_info_by_tinker_path(path).result().lora_rank == 4
    # Loaded as a training client, it computes what PEFT computes (alpha 16 rescaled to ours).
    clone = resolved(svc.create_training_client_from_state(path))
    ours = np.asarray(clone.forward([datum(SEQ)], "cross_entropy").result()
                      .loss_fn_outputs[0]["logprobs"].to_numpy(), dtype=np.float64)
    theirs = peft_logprobs(tiny_model, adapter, SEQ)
    worst = float(np.max(np.abs(ours - theirs)))
    print(f"imported PEFT adapter: our log-probs vs PEFT's: max |diff| = {worst:.3e}")
    assert worst <= 1e-4
    # Another tenant does not see it.
    with pytest.raises(tinker.NotFoundError):
        service(server, KEYS["bob"]).create_rest_client().get_weights_info_by_tinker_path(path).result()

    def refused(body: dict[str, Any], *needles: str) -> None:
        r = api(server, "POST", "/twinkle/import_adapter", KEYS["alice"], json=body)
        assert r.status_code == 400, r.text
        for needle in needles:
            assert needle in r.json()["detail"], r.json()["detail"]

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert q_a in tensors
    # Wrong shape, wrong module name, a layer the base model lacks, a missing module.
    refused(import_body(adapter, "x", {**tensors, q_a: tensors[q_a][:, :-1].contiguous()}), q_a, "expected [4, 64]")
    bad_name = {("base_model.model.model.layers.0.self_attn.qq_proj.lora_A.weight" if k == q_a else k): v
                for k, v in tensors.items()}
    refused(import_body(adapter, "x", bad_name), "qq_proj")
    extra_layer = {**tensors, q_a.replace("layers.0", "layers.9"): tensors[q_a].clone()}
    refused(import_body(adapter, "x", extra_layer), "layers.9")
    missing = {k: v for k, v in tensors.items() if ".layers.1.mlp.down_proj." not in k}
    refused(import_body(adapter, "x", missing), "layers.1.mlp.down_proj", "missing")
    refused(import_body(adapter, "x", {k: v.double() for k, v in tensors.items()}), "F64", "F32")
    # Partial attention (q and v only): Tinker's switches train whole groups.
    partial = peft_adapter(tiny_model, tmp_path / "partial", targets=["q_proj", "v_proj"])
    refused(import_body(partial, "x"), "k_proj", "missing")
    # Bad config, not base64, a name that escapes, a bad TTL.
    body = import_body(adapter, "x")
    refused({**body, "adapter_config": {**body["adapter_config"], "use_dora": True}}, "use_dora")
    refused({**body, "adapter_config": {**body["adapter_config"], "r": 9999}}, "adapter_config.r")
    refused({**body, "adapter_model": "%%% not base64 %%%"}, "base64")
    refused({**body, "name": "../escape"}, "name")
    refused({**body, "ttl_seconds": -3}, "ttl_seconds")
    # Oversized: refused from the Content-Length, before the body is read.
    r = requests.post(server.http_url("/api/v1/twinkle/import_adapter"), data=b"x" * (limit + 1),
                      headers={"X-API-Key": KEYS["alice"], "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "max_import_bytes" in r.json()["detail"], r.text
    # Without a valid key the same request is 401, and says nothing of the limit.
    r = requests.post(server.http_url("/api/v1/twinkle/import_adapter"), data=b"x" * (limit + 1),
                      headers={"X-API-Key": "tml-not-a-key-000000000000", "Content-Type": "application/json"},
                      timeout=30)
    assert r.status_code == 401 and "max_import_bytes" not in r.text, r.text
    # Nothing of the refused imports was written.
    assert [c.checkpoint_id for c in rest.list_user_checkpoints().result().checkpoints] == ["weights/imp"]


# ---- the archive of older SDKs -----------------------------------------------------------------

def test_archive_download_with_the_0_30_cli(hosted: ServerProcess, tiny_model: Path, tmp_path: Path) -> None:
    """SDKs <= 0.30 download a checkpoint as one tar (get_checkpoint_archive_url): their own
    `tinker checkpoint download`, run unmodified from its wheel, extracts a PEFT directory."""
    import tarfile

    from e2e_support import paths

    sdk = paths.REPO_ROOT / ".tinker-sdks" / "0.30.4"
    assert (sdk / "tinker" / "cli" / "__main__.py").is_file(), f"{sdk}: run scripts/setup.sh"
    svc = service(hosted, KEYS["alice"])
    training = lora_client(svc, rank=8)
    train(training, 2)
    state = training.save_state("arch").result().path
    model_id = training.get_info().model_id
    env = {**os.environ, "PYTHONPATH": str(sdk), "TINKER_BASE_URL": f"http://{hosted.host}:{hosted.http_port}",
           "TINKER_API_KEY": KEYS["alice"]}
    result = subprocess.run([sys.executable, "-m", "tinker.cli", "checkpoint", "download", state, "--output",
                             str(tmp_path / "dl")], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    got = tmp_path / "dl" / state.replace("tinker://", "").replace("/", "_")
    assert {p.name for p in got.iterdir()} == {"adapter_model.safetensors", "adapter_config.json",
                                               "checkpoint_complete"}
    ours = np.asarray(training.forward([datum(SEQ)], "cross_entropy").result()
                      .loss_fn_outputs[0]["logprobs"].to_numpy(), dtype=np.float64)
    assert float(np.max(np.abs(peft_logprobs(tiny_model, got, SEQ) - ours))) <= 1e-4

    # The archive URL itself: a tar with its checksum; another tenant gets 404 for the URL.
    answer = api(hosted, "GET", f"/training_runs/{model_id}/checkpoints/weights/arch/archive", KEYS["alice"])
    assert answer.status_code == 200, answer.text
    status, body, headers = fetch(answer.json()["url"])
    assert status == 200 and headers["X-Checksum-SHA256"] == hashlib.sha256(body).hexdigest()
    (tmp_path / "a.tar").write_bytes(body)
    with tarfile.open(tmp_path / "a.tar") as tar:
        assert [m.name for m in tar.getmembers()] == ["adapter_model.safetensors", "adapter_config.json",
                                                      "checkpoint_complete"]
        assert all(m.isfile() for m in tar.getmembers())
    assert api(hosted, "GET", f"/training_runs/{model_id}/checkpoints/weights/arch/archive",
               KEYS["bob"]).status_code == 404


def test_twinkle_native_save_takes_a_ttl(hosted: ServerProcess) -> None:
    import grpc
    from twinkle_client._proto.twinkle.v1 import training_pb2 as tpb

    c = Client(hosted.grpc_address, KEYS["alice"])
    try:
        c.call("AddAdapter", tpb.AddAdapterRequest(adapter_name="n", config=tpb.LoraConfig(r=4, lora_alpha=32, seed=1)))
        saved = c.call("Save", tpb.SaveRequest(adapter_name="n", name="tw", ttl_seconds=HOUR))
        plain = c.call("Save", tpb.SaveRequest(adapter_name="n", name="forever"))
        with pytest.raises(grpc.RpcError) as bad:
            c.call("Save", tpb.SaveRequest(adapter_name="n", name="bad", ttl_seconds=0))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ttl_seconds" in bad.value.details()
    finally:
        c.close()
    run = saved.twinkle_path.split("/")[2]
    assert plain.twinkle_path.split("/")[2] == run
    rest = service(hosted, KEYS["alice"]).create_rest_client()
    assert checkpoint(rest, run, "weights/tw").expires_at is not None
    assert checkpoint(rest, run, "weights/forever").expires_at is None
    deleted = advance_clock(hosted, HOUR + 60)["deleted"]
    assert deleted == [f"{run}/weights/tw"]


# ---- audit ------------------------------------------------------------------------------------

AUDIT_ADMIN_KEY = "tml-ops-audit-00112233445566778899aabbccddeeff"


def test_every_checkpoint_change_gets_an_audit_row(launch_server: LaunchServer, tmp_path: Path) -> None:
    """export, publish, TTL, unpublish, copy and delete each leave one row naming the path, the
    caller's key id and its peer; no row holds a key."""
    config = overrides(tmp_path)
    config["auth"]["tenants"].append({"id": "ops", "key_sha256": [hashlib.sha256(AUDIT_ADMIN_KEY.encode()).hexdigest()],
                                      "role": "admin"})
    server = launch_server(config)
    alice_svc = service(server, KEYS["alice"])
    rest = alice_svc.create_rest_client()
    training = lora_client(alice_svc)
    train(training, 1)
    state = training.save_state("st").result().path
    export = training.save_weights_external("ex").result().path
    rest.publish_checkpoint_from_tinker_path(state).result()
    rest.set_checkpoint_ttl_from_tinker_path(state, HOUR).result()
    rest.unpublish_checkpoint_from_tinker_path(state).result()
    # The SDK's retries of one copy_weights (one X-Idempotency-Key, the same body): one copy,
    # one audit row; a replay is no new action.
    idem = {"X-API-Key": KEYS["alice"], "X-Idempotency-Key": "audit-copy-1"}
    copy = requests.post(server.http_url("/api/v1/copy_weights"), json={"source_path": state}, headers=idem,
                         timeout=30)
    assert copy.status_code == 200, copy.text
    for _ in range(2):
        replay = requests.post(server.http_url("/api/v1/copy_weights"), json={"source_path": state}, headers=idem,
                               timeout=30)
        assert replay.status_code == 200 and replay.json() == copy.json(), replay.text
    rest.delete_checkpoint_from_tinker_path(state).result()
    # A refused change (bob may not delete alice's checkpoint) leaves no row.
    with pytest.raises(tinker.NotFoundError):
        service(server, KEYS["bob"]).create_rest_client().delete_checkpoint_from_tinker_path(export).result()

    me = api(server, "GET", "/auth/apikey/me", KEYS["alice"]).json()
    log = tinker.AdminClient(base_url=f"http://{server.host}:{server.http_port}",
                             api_key=AUDIT_ADMIN_KEY).get_audit_log(event_type="checkpoints").result()
    rows = [(e.event, e.event_details.get("object")) for e in log.entries]
    for expected in [("checkpoint_export", export), ("checkpoint_publish", state), ("checkpoint_ttl_set", state),
                     ("checkpoint_unpublish", state), ("checkpoint_copy", copy.json()["tinker_path"]),
                     ("checkpoint_delete", state)]:
        assert rows.count(expected) == 1, (expected, rows)
    assert len(rows) == 6, rows
    assert all(e.event_details["key_id"] == me["key_id"] and e.event_details.get("peer") for e in log.entries)
    text = log.model_dump_json()
    for key in (*KEYS.values(), AUDIT_ADMIN_KEY):
        assert key not in text and hashlib.sha256(key.encode()).hexdigest() not in text
