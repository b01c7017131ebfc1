"""The hosted-service surface for keys, roles, usage, audit and session metadata (issue 19,
items 4-7 and `tinker run list/info`), driven by the real tinker SDK, its `tinker` CLI and
the `twinkle-server admin` CLI against a real server with auth on: two member tenants
(alice, bob), an admin (ops) and a read-only key (viewer).

Covered (each asserting its effect):
  RestClient: get_session, list_sessions, search_sessions, assign_session_project,
    export_session_trace, list_training_runs, get_training_run
  AdminClient: get_audit_log, get_billing_usage, get_current_checkpoint_storage_usage
  CLI: tinker run list, tinker run info, tinker auth login, tinker billing usage /
    checkpoint-storage, tinker session export-trace; twinkle-server admin create-tenant / create-key /
    list-keys / rotate-key / revoke-key / set-role
  HTTP: GET/DELETE /api/v1/auth/apikey/me, the role refusals, limits at limit+1
  gRPC: AdminService refused to members, read-only refused AddAdapter
  Persistence: keys, revocations and usage survive a SIGTERM restart (usage written at
    shutdown); a revoked key's queued work still runs and is metered.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "1")

import tinker  # noqa: E402
from tinker import types  # noqa: E402

from e2e_support import configs, prom  # noqa: E402
from e2e_support.server import LaunchServer, ServerProcess, launch, stop_all  # noqa: E402
from e2e_support.training import KEYS, Client, sha256_hex  # noqa: E402
from e2e_support.waiting import scaled, wait_until  # noqa: E402
from twinkle_client._proto.twinkle.v1 import training_pb2 as tpb  # noqa: E402
import grpc  # noqa: E402

MODEL_NAME = "tiny-qwen3"
ADMIN_KEY = "tml-ops-admin-00112233445566778899aabbccddeeff"
VIEWER_KEY = "tml-viewer-ffeeddccbbaa99887766554433221100"
ALL_CONFIG_KEYS = [KEYS["alice"], KEYS["bob"], ADMIN_KEY, VIEWER_KEY]
SEQS = [[11, 42, 7, 99, 123, 5, 64], [300, 17, 250, 8, 9]]
STARTUP_TIMEOUT_S = 120.0


def _overrides(data_dir: Path) -> dict[str, Any]:
    tenants = [
        {"id": "alice", "key_sha256": [sha256_hex(KEYS["alice"])]},
        {"id": "bob", "key_sha256": [sha256_hex(KEYS["bob"])]},
        {"id": "ops", "key_sha256": [sha256_hex(ADMIN_KEY)], "role": "admin"},
        {"id": "viewer", "key_sha256": [sha256_hex(VIEWER_KEY)], "role": "read-only"},
    ]
    return {
        "auth": {"enabled": True, "tenants": tenants, "usage_flush_interval_s": 1},
        "server": {"metrics_tenant_labels": True},
        "storage": {"data_dir": str(data_dir)},
        "testing": {"hooks": True},
    }


@pytest.fixture(scope="module")
def admin_server(server_bin: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("admin-server")
    config = configs.merged(configs.base_config(tiny_model), _overrides(workdir / "data"))
    config_path = configs.write_config(workdir / "twinkle.yaml", config)
    server = launch(server_bin, config_path, config, workdir)
    try:
        server.wait_ports(scaled(STARTUP_TIMEOUT_S))
        server.wait_health("SERVING", scaled(STARTUP_TIMEOUT_S))
        yield server
    finally:
        stop_all([server])


def base_url(server: ServerProcess) -> str:
    return f"http://{server.host}:{server.http_port}"


def http(server: ServerProcess, method: str, path: str, key: str | None, **kwargs: Any) -> requests.Response:
    headers = {"X-API-Key": key} if key else {}
    return requests.request(method, f"{base_url(server)}/api/v1{path}", headers=headers, timeout=60, **kwargs)


def admin_cli(server_bin: Path, server: ServerProcess, key: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TWINKLE_API_KEY=key)
    return subprocess.run([str(server_bin), "admin", "--address", server.grpc_address, *args], env=env,
                          capture_output=True, text=True, timeout=scaled(60), check=False)


def admin_json(server_bin: Path, server: ServerProcess, *args: str) -> dict[str, Any]:
    r = admin_cli(server_bin, server, ADMIN_KEY, *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def service(server: ServerProcess, key: str, **kwargs: Any) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=base_url(server), api_key=key, **kwargs)


def rest(server: ServerProcess, key: str) -> tinker.RestClient:
    return tinker.RestClient(base_url=base_url(server), api_key=key)


def admin_client(server: ServerProcess) -> tinker.AdminClient:
    return tinker.AdminClient(base_url=base_url(server), api_key=ADMIN_KEY)


def datum(seq: list[int]) -> types.Datum:
    n = len(seq) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                       loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * n})


def window() -> tuple[str, str]:
    hour = dt.datetime.now(dt.timezone.utc).replace(minute=0, second=0, microsecond=0)
    return ((hour - dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ"),
            (hour + dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ"))


def usage_rows(server: ServerProcess) -> list[dict[str, Any]]:
    start, end = window()
    r = http(server, "GET", "/billing/usage/events", ADMIN_KEY, params={"starting_on": start, "ending_before": end})
    assert r.status_code == 200, r.text
    return r.json()["twinkle_usage"]


def usage_of(rows: list[dict[str, Any]], key_id: int, kind: str) -> int:
    return sum(r["amount"] for r in rows if r["key_id"] == key_id and r["kind"] == kind)


def key_id_of(server: ServerProcess, key: str) -> int:
    r = http(server, "GET", "/auth/apikey/me", key)
    assert r.status_code == 200, r.text
    return int(r.json()["key_id"])


def secrets_absent(server: ServerProcess, data_dir: Path, keys: list[str]) -> None:
    """No key text anywhere in the registry files or the server's logs."""
    blobs = [p.read_bytes() for p in data_dir.glob("registry.sqlite*")]
    assert blobs, "no registry file"
    logs = server.logs()
    for key in keys:
        assert key.encode() not in b"".join(blobs), "a key is stored in the registry"
        assert key not in logs, "a key is in the server's logs"


# ---- keys, roles, audit ---------------------------------------------------------------------


def test_whoami_and_roles(admin_server: ServerProcess) -> None:
    me = http(admin_server, "GET", "/auth/apikey/me", KEYS["alice"]).json()
    assert me["tenant"] == "alice" and me["role"] == "member" and isinstance(me["key_id"], int)
    assert me["details"]["org_details"]["name"] == "alice"
    assert KEYS["alice"] not in json.dumps(me) and sha256_hex(KEYS["alice"]) not in json.dumps(me)
    assert http(admin_server, "GET", "/auth/apikey/me", ADMIN_KEY).json()["role"] == "admin"
    assert http(admin_server, "GET", "/auth/apikey/me", "tml-nobody").status_code == 401

    # A member on the admin routes: 403 naming the roles.
    for path in ("/audit", "/billing/usage/events", "/billing/usage/checkpoints/current"):
        r = http(admin_server, "GET", path, KEYS["bob"])
        assert r.status_code == 403, (path, r.text)
        assert "needs role admin" in r.json()["detail"] and "member" in r.json()["detail"]
    with pytest.raises(tinker.PermissionDeniedError):
        tinker.AdminClient(base_url=base_url(admin_server), api_key=KEYS["bob"]).get_audit_log().result()

    # read-only: lists, gets, samples; never trains, saves or deletes.
    assert http(admin_server, "GET", "/training_runs", VIEWER_KEY).status_code == 200
    assert http(admin_server, "POST", "/create_session", VIEWER_KEY,
                json={"tags": [], "user_metadata": {}, "sdk_version": "x", "type": "create_session"}).status_code == 200
    for method, path in (("POST", "/create_model"), ("POST", "/forward_backward"), ("POST", "/optim_step"),
                         ("POST", "/save_weights"), ("DELETE", "/training_runs/r/checkpoints/weights/x"),
                         ("PUT", "/sessions/s1/project")):
        r = http(admin_server, method, path, VIEWER_KEY, json={})
        assert r.status_code == 403, (method, path, r.text)
        assert "read-only" in r.json()["detail"], r.text
    viewer = service(admin_server, VIEWER_KEY)
    with pytest.raises(tinker.PermissionDeniedError, match="read-only"):
        viewer.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()


def test_read_only_key_downloads_and_samples_but_never_writes(admin_server: ServerProcess, server_bin: Path,
                                                               tmp_path: Path) -> None:
    """A read-only key downloads what it can read (its tenant's checkpoints, others' published
    ones) and samples (also through the OpenAI routes); it never trains, exports or copies."""
    import hashlib
    import urllib.request

    ro = admin_json(server_bin, admin_server, "create-key", "--tenant", "alice", "--role", "read-only")["key"]
    alice = service(admin_server, KEYS["alice"]).create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    alice.forward_backward([datum(SEQS[0])], "cross_entropy").result()
    export = alice.save_weights_external("ro-export").result().path
    state = alice.save_state("ro-state").result().path
    bob = service(admin_server, KEYS["bob"]).create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    published = bob.save_weights_external("ro-published").result().path
    private = bob.save_weights_external("ro-private").result().path
    rest(admin_server, KEYS["bob"]).publish_checkpoint_from_tinker_path(published).result()

    def download(url: str) -> bytes:
        with urllib.request.urlopen(url, timeout=60) as r:
            body = r.read()
            assert r.headers["X-Checksum-SHA256"] == hashlib.sha256(body).hexdigest()
            return body

    viewer = rest(admin_server, ro)
    for path in (export, published):
        signed = viewer.get_external_weights_urls(path).result()
        assert set(signed.urls) == {"adapter_model.safetensors", "adapter_config.json"}
        assert all(download(url) for url in signed.urls.values())
    with pytest.raises(tinker.NotFoundError):
        viewer.get_external_weights_urls(private).result()
    model_id = alice.get_info().model_id
    archive = http(admin_server, "GET", f"/training_runs/{model_id}/checkpoints/weights/ro-state/archive", ro)
    assert archive.status_code == 200, archive.text
    assert download(archive.json()["url"])[257:262] == b"ustar"
    # The real CLI, with the read-only key, downloads an export (GETs only).
    env = dict(os.environ, TINKER_BASE_URL=base_url(admin_server), TINKER_API_KEY=ro)
    cli = subprocess.run([sys.executable, "-m", "tinker.cli", "checkpoint", "download", export, "--output",
                          str(tmp_path)], env=env, capture_output=True, text=True, timeout=scaled(300))
    assert cli.returncode == 0, cli.stdout + cli.stderr
    got = tmp_path / export.replace("tinker://", "").replace("/", "_")
    assert {p.name for p in got.iterdir()} == {"adapter_model.safetensors", "adapter_config.json"}

    # Sampling is reading: the OpenAI completions routes, under /v1 and under /api/v1.
    headers = {"X-API-Key": ro, "Authorization": f"Bearer {ro}"}
    for path in ("/v1/completions", "/api/v1/completions"):
        r = requests.post(f"{base_url(admin_server)}{path}", headers=headers, timeout=120,
                          json={"model": MODEL_NAME, "prompt": SEQS[0], "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, (path, r.text)
        assert len(r.json()["choices"]) == 1
    # Writing is refused, before the body is read: training, exporting, copying, saving.
    for path, body in (("/forward_backward", {}), ("/optim_step", {}), ("/create_model", {}),
                       ("/save_weights_external", {"model_id": model_id, "path": "x"}),
                       ("/copy_weights", {"source_path": export}), ("/save_weights_for_sampler", {})):
        r = http(admin_server, "POST", path, ro, json=body)
        assert r.status_code == 403, (path, r.text)
        assert "read-only" in r.json()["detail"], r.text


def test_optimizer_steps_and_storage_on_metrics(launch_server: LaunchServer, tmp_path: Path) -> None:
    """/metrics serves the metered optimizer steps and storage byte-seconds per tenant: the
    same integers the billing routes persist, and the steps equal the optim_steps sent."""
    overrides = _overrides(tmp_path / "data")
    overrides["auth"]["usage_flush_interval_s"] = 3600  # only billing reads flush (no race with a scrape)
    server = launch_server(overrides)

    def scrape(name: str, tenant: str) -> float:
        samples = prom.select(prom.parse(requests.get(f"{base_url(server)}/metrics", timeout=10).text), name,
                              tenant=tenant)
        assert len(samples) <= 1, samples
        return samples[0].value if samples else 0.0

    def billed(kind: str, tenant: str) -> int:
        return sum(r["amount"] for r in usage_rows(server) if r["kind"] == kind and r["tenant"] == tenant)

    training = service(server, KEYS["alice"]).create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    steps = 3
    for _ in range(steps):
        training.forward_backward([datum(SEQS[0])], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    training.save_state("metered").result()
    assert scrape("twinkle_tenant_optimizer_steps_total", "alice") == steps
    assert billed("optim_steps", "alice") == steps
    assert scrape("twinkle_tenant_optimizer_steps_total", "bob") == 0

    # Storage accrues from the first flush on; let whole seconds pass between two billing reads.
    wait_until(lambda: billed("storage_byte_seconds", "alice") > 0, scaled(30), "storage byte-seconds accrued")
    total = billed("storage_byte_seconds", "alice")  # flushes: nothing accrues until the next read
    assert scrape("twinkle_tenant_storage_byte_seconds_total", "alice") == total
    # The bytes held, independently: the checkpoint's listed files on disk. Every accrual adds
    # bytes x whole seconds, so the total is a multiple of them.
    held = 0
    for meta in (tmp_path / "data").rglob("checkpoint_metadata.json"):
        if "/tenants/alice/" in str(meta):
            listed = json.loads(meta.read_text())["files"]
            held += sum((meta.parent / name).stat().st_size for name in listed)
    assert held > 0 and total > 0 and total % held == 0, (total, held)
    # Per tenant only: no key, session or run labels on these series.
    text = requests.get(f"{base_url(server)}/metrics", timeout=10).text
    for name in ("twinkle_tenant_optimizer_steps_total", "twinkle_tenant_storage_byte_seconds_total"):
        assert all(set(s.labels) == {"tenant"} for s in prom.select(prom.parse(text), name))


def test_tinker_auth_login_verifies_the_key(admin_server: ServerProcess, tmp_path: Path) -> None:
    """`tinker auth login` (the real CLI) checks a pasted key with GET /auth/apikey/me."""
    env = dict(os.environ, HOME=str(tmp_path), TINKER_BASE_URL=base_url(admin_server))
    cli = [sys.executable, "-m", "tinker.cli", "auth", "login"]
    ok = subprocess.run(cli, env=env, input=KEYS["alice"] + "\n", capture_output=True, text=True, timeout=scaled(120))
    assert ok.returncode == 0, ok.stderr
    assert "(alice)" in ok.stdout
    stored = json.loads((tmp_path / ".tinker" / "credentials.json").read_text())
    assert str(key_id_of(admin_server, KEYS["alice"])) in json.dumps(stored)
    bad_home = tmp_path / "other"
    bad = subprocess.run(cli, env=dict(env, HOME=str(bad_home)), input="tml-not-a-key\n", capture_output=True,
                         text=True, timeout=scaled(120))
    assert bad.returncode != 0 and "401" in bad.stdout + bad.stderr


def test_key_lifecycle_audit_and_no_secrets(admin_server: ServerProcess, server_bin: Path) -> None:
    data_dir = Path(admin_server.config["storage"]["data_dir"])
    # A member cannot use the admin service.
    refused = admin_cli(server_bin, admin_server, KEYS["alice"], "list-keys")
    assert refused.returncode == 1 and "needs role admin" in refused.stderr and "member" in refused.stderr

    assert admin_json(server_bin, admin_server, "create-tenant", "carol") == {"tenant": "carol"}
    created = admin_json(server_bin, admin_server, "create-key", "--tenant", "carol", "--role", "member",
                         "--name", "carol laptop")
    carol_key, carol_id = created["key"], created["key_id"]
    assert carol_key.startswith("tml-") and created["tenant"] == "carol" and created["role"] == "member"
    # Works at once, without a restart.
    assert http(admin_server, "GET", "/auth/apikey/me", carol_key).json()["tenant"] == "carol"
    assert http(admin_server, "GET", "/training_runs", carol_key).status_code == 200
    # Listed without the key or its digest.
    listed = admin_json(server_bin, admin_server, "list-keys", "--tenant", "carol")
    assert [k["key_id"] for k in listed["keys"]] == [carol_id]
    assert carol_key not in json.dumps(listed) and sha256_hex(carol_key) not in json.dumps(listed)
    # create-key for an unknown tenant, a bad role, an over-long name (limit 128, +1).
    missing = admin_cli(server_bin, admin_server, ADMIN_KEY, "create-key", "--tenant", "nobody", "--role", "member")
    assert missing.returncode == 1 and "tenant 'nobody' not found" in missing.stderr
    long_name = admin_cli(server_bin, admin_server, ADMIN_KEY, "create-key", "--tenant", "carol", "--role", "member",
                          "--name", "n" * 129)
    assert long_name.returncode == 1 and "129 bytes" in long_name.stderr
    assert admin_cli(server_bin, admin_server, ADMIN_KEY, "create-key", "--tenant", "carol", "--role", "member",
                     "--name", "n" * 128).returncode == 0

    # Rotation, raced by a client still using the old key: every call that starts after the
    # rotation returned is refused.
    calls: list[tuple[float, int]] = []
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            started = time.monotonic()
            calls.append((started, http(admin_server, "GET", "/training_runs", carol_key).status_code))

    racer = threading.Thread(target=hammer)
    racer.start()
    wait_until(lambda: len(calls) >= 3, scaled(30), "the racing client's first calls")
    rotated = admin_json(server_bin, admin_server, "rotate-key", str(carol_id))
    rotated_at = time.monotonic()
    wait_until(lambda: any(t > rotated_at for t, _ in calls), scaled(30), "a call after the rotation")
    stop.set()
    racer.join()
    assert {code for t, code in calls if t > rotated_at} == {401}
    assert {code for t, code in calls} <= {200, 401}
    new_key, new_id = rotated["key"], rotated["key_id"]
    assert new_id != carol_id and new_key != carol_key and rotated["name"] == "carol laptop"
    assert http(admin_server, "GET", "/training_runs", carol_key).status_code == 401
    assert http(admin_server, "GET", "/training_runs", new_key).status_code == 200
    again = admin_cli(server_bin, admin_server, ADMIN_KEY, "rotate-key", str(carol_id))
    assert again.returncode == 1 and "revoked" in again.stderr

    # Role change takes effect at once.
    assert admin_json(server_bin, admin_server, "set-role", str(new_id), "read-only")["role"] == "read-only"
    r = http(admin_server, "POST", "/create_model", new_key, json={})
    assert r.status_code == 403 and "read-only" in r.json()["detail"]

    # Revoke: 401 on the next call, over HTTP and gRPC.
    assert admin_json(server_bin, admin_server, "revoke-key", str(new_id))["revoked_unix_us"] > 0
    assert http(admin_server, "GET", "/auth/apikey/me", new_key).status_code == 401
    with pytest.raises(tinker.AuthenticationError):
        rest(admin_server, new_key).list_training_runs().result()
    revoked = Client(admin_server.grpc_address, new_key)
    try:
        with pytest.raises(grpc.RpcError) as refused:
            revoked.call("CreateSession", tpb.CreateSessionRequest())
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value
    finally:
        revoked.close()

    # DELETE /auth/apikey/me revokes the calling key only.
    self_key = admin_json(server_bin, admin_server, "create-key", "--tenant", "carol", "--role", "member")["key"]
    assert http(admin_server, "DELETE", "/auth/apikey/me", self_key).status_code == 200
    assert http(admin_server, "GET", "/auth/apikey/me", self_key).status_code == 401
    assert http(admin_server, "GET", "/auth/apikey/me", KEYS["alice"]).status_code == 200

    # An audit row for every admin action, by the admin's key id, holding no key.
    admin_id = key_id_of(admin_server, ADMIN_KEY)
    log = admin_client(admin_server).get_audit_log(event_type="organizations").result()
    events = [(e.event, e.event_details.get("object")) for e in log.entries]
    for expected in [("tenant_create", "tenant:carol"), ("key_create", f"key:{carol_id}"),
                     ("key_rotate", f"key:{carol_id}"), ("key_role_set", f"key:{new_id}"),
                     ("key_revoke", f"key:{new_id}")]:
        assert expected in events, (expected, events)
    by_admin = [e for e in log.entries if e.event in ("tenant_create", "key_create", "key_rotate", "key_role_set")]
    assert by_admin and all(e.event_details["key_id"] == admin_id for e in by_admin)
    assert all(e.event_details.get("peer") for e in log.entries)
    self_revokes = [e for e in log.entries if e.event == "key_revoke" and e.event_details.get("self")]
    assert len(self_revokes) == 1
    text = log.model_dump_json()
    for key in ALL_CONFIG_KEYS + [carol_key, new_key, self_key]:
        assert key not in text and sha256_hex(key) not in text
    # Another day's log is empty; a bad event_type is refused.
    assert admin_client(admin_server).get_audit_log(day=dt.date(2001, 1, 1)).result().entries == []
    assert http(admin_server, "GET", "/audit", ADMIN_KEY, params={"event_type": "nope"}).status_code == 400
    secrets_absent(admin_server, data_dir, ALL_CONFIG_KEYS + [carol_key, new_key, self_key])


def test_revoked_key_in_flight_work_finishes_and_grpc_roles(admin_server: ServerProcess, server_bin: Path) -> None:
    made = admin_json(server_bin, admin_server, "create-key", "--tenant", "alice", "--role", "member", "--name", "ci")
    key, key_id = made["key"], made["key_id"]
    training = service(admin_server, key).create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    hooks = Client(admin_server.grpc_address, KEYS["alice"])
    try:
        hooks.call("PauseScheduler", tpb.Empty())
        future = training.forward_backward([datum(s) for s in SEQS], "cross_entropy")
        # Accepted and queued: in flight when the key is revoked.
        wait_until(lambda: prom.value(prom.parse(requests.get(f"{base_url(admin_server)}/metrics", timeout=10).text),
                                      "twinkle_queue_depth", tenant="alice") >= 1,
                   scaled(30), "the forward_backward to be queued")
        admin_json(server_bin, admin_server, "revoke-key", str(key_id))
        assert http(admin_server, "GET", "/auth/apikey/me", key).status_code == 401
    finally:
        hooks.call("ResumeScheduler", tpb.Empty())
        hooks.close()
    del future  # its key is revoked: the SDK can no longer fetch the result, but the work ran
    sent = sum(len(s) - 1 for s in SEQS)
    wait_until(lambda: usage_of(usage_rows(admin_server), key_id, "training") == sent, scaled(60),
               "the revoked key's queued forward_backward to finish and be metered")

    # gRPC: read-only may sample-side calls, never train; members never reach AdminService.
    viewer = Client(admin_server.grpc_address, VIEWER_KEY)
    try:
        assert viewer.call("CreateSession", tpb.CreateSessionRequest()).session_id
        with pytest.raises(grpc.RpcError) as refused:
            viewer.call("AddAdapter", tpb.AddAdapterRequest())
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "read-only" in (refused.value.details() or "")
    finally:
        viewer.close()


# ---- usage ----------------------------------------------------------------------------------


def test_usage_counts_equal_what_was_sent(admin_server: ServerProcess) -> None:
    alice_id = key_id_of(admin_server, KEYS["alice"])
    before = usage_rows(admin_server)
    svc = service(admin_server, KEYS["alice"])
    training = svc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    sent = sum(len(s) - 1 for s in SEQS)
    training.forward_backward([datum(s) for s in SEQS], "cross_entropy").result()
    training.forward_backward([datum(SEQS[0])], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    training.forward([datum(SEQS[1])], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = [11, 42, 7, 99]
    sample = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=3,
                            sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0, seed=7)).result()
    generated = sum(len(s.tokens) for s in sample.sequences)
    run_id = training.get_info().model_id
    training.save_state("usage-ckpt").result()
    after = usage_rows(admin_server)

    def delta(kind: str) -> int:
        return usage_of(after, alice_id, kind) - usage_of(before, alice_id, kind)

    assert delta("training") == sent + len(SEQS[0]) - 1
    assert delta("forward") == len(SEQS[1]) - 1
    assert delta("optim_steps") == 2
    assert delta("prefill") == len(prompt)
    assert delta("sampled") == generated
    # Per run and session: the training rows name this run's session.
    session = run_id.split(":train:")[0]
    assert any(r["session_id"] == session and r["kind"] == "training" and r["key_id"] == alice_id for r in after)
    # Bob's key was not charged.
    bob_id = key_id_of(admin_server, KEYS["bob"])
    assert usage_of(after, bob_id, "training") == usage_of(before, bob_id, "training")

    # The SDK's typed view: training events carry the same totals.
    start, end = window()
    billing = admin_client(admin_server).get_billing_usage(start, end).result()
    mine = [e for e in billing.data if e.user_id == f"tenant:alice/key:{alice_id}"]
    trained = sum(e.event_info.token_count for e in mine if isinstance(e.event_info, types.TrainingBillingEvent))
    assert trained == usage_of(after, alice_id, "training") + usage_of(after, alice_id, "forward")
    sampled = sum(e.event_info.token_count for e in mine if isinstance(e.event_info, types.SamplingSampleBillingEvent))
    assert sampled == usage_of(after, alice_id, "sampled")
    # No price list (docs/api.md): every cost and rate is null, which the SDK's types take as
    # "no applicable rate".
    assert billing.cost_data_through is None
    assert all(e.estimated_cost_usd is None and e.effective_rate_usd_per_million_tokens is None
               and e.effective_rate_usd_per_gigabyte_month is None for e in billing.data)
    # /metrics: the same counter family, by tenant and kind.
    metrics = prom.parse(requests.get(f"{base_url(admin_server)}/metrics", timeout=10).text)
    assert prom.value(metrics, "twinkle_tenant_tokens_total", tenant="alice", kind="sampled") >= generated
    assert prom.value(metrics, "twinkle_tenant_tokens_total", tenant="alice", kind="prefill") >= len(prompt)
    # Checkpoint storage now.
    storage = admin_client(admin_server).get_current_checkpoint_storage_usage().result()
    alice_storage = [d for d in storage.data if d.org_user_urn == "tenant:alice"]
    assert alice_storage and alice_storage[0].checkpoint_count >= 1 and alice_storage[0].size_bytes > 0
    assert storage.effective_rate_usd_per_gigabyte_month is None
    assert all(d.estimated_monthly_cost_usd is None for d in storage.data)

    # The same through the real `tinker billing` CLI (admin key), and refused to a member.
    env = dict(os.environ, TINKER_BASE_URL=base_url(admin_server), TINKER_API_KEY=ADMIN_KEY)
    cli = [sys.executable, "-m", "tinker.cli", "--format", "json", "billing"]
    usage_cli = subprocess.run([*cli, "usage", start, end], env=env, capture_output=True, text=True,
                               timeout=scaled(120))
    assert usage_cli.returncode == 0, usage_cli.stderr
    assert f"tenant:alice/key:{alice_id}" in usage_cli.stdout
    storage_cli = subprocess.run([*cli, "checkpoint-storage"], env=env, capture_output=True, text=True,
                                 timeout=scaled(120))
    assert storage_cli.returncode == 0, storage_cli.stderr
    assert "tenant:alice" in storage_cli.stdout
    member = subprocess.run([*cli, "usage", start, end], env=dict(env, TINKER_API_KEY=KEYS["alice"]),
                            capture_output=True, text=True, timeout=scaled(120))
    assert member.returncode != 0 and "needs role admin" in member.stdout + member.stderr

    # The billing window's bounds.
    for params in ({"starting_on": start}, {"starting_on": start, "ending_before": start},
                   {"starting_on": "2026-01-01T00:30:00Z", "ending_before": "2026-01-01T01:00:00Z"},
                   {"starting_on": "2026-01-01T00:00:00Z", "ending_before": "2026-01-15T01:00:00Z"}):
        r = http(admin_server, "GET", "/billing/usage/events", ADMIN_KEY, params=params)
        assert r.status_code == 400, (params, r.text)


# ---- sessions and runs ----------------------------------------------------------------------


def test_session_metadata_search_project_trace_and_cli(admin_server: ServerProcess, tmp_path: Path) -> None:
    meta = {"team": "rl", "exp": "e1"}
    svc = service(admin_server, KEYS["alice"], user_metadata=meta, project_id="proj-a", display_name="nightly sweep")
    training = svc.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    training.forward_backward([datum(SEQS[0])], "cross_entropy").result()
    sampler = training.save_weights_and_get_sampling_client().result()
    sampler.sample(types.ModelInput.from_ints([1, 2, 3]), num_samples=1,
                   sampling_params=types.SamplingParams(max_tokens=2, seed=1)).result()
    model_id = training.get_info().model_id
    session = model_id.split(":train:")[0]
    rc = rest(admin_server, KEYS["alice"])

    got = rc.get_session(session).result()
    assert got.user_metadata == meta and got.display_name == "nightly sweep"
    assert model_id in got.training_run_ids and len(got.sampler_ids) >= 1
    assert session in rc.list_sessions(limit=100).result().sessions
    # Another tenant's session is 404, and never listed.
    with pytest.raises(tinker.NotFoundError):
        rest(admin_server, KEYS["bob"]).get_session(session).result()
    assert session not in rest(admin_server, KEYS["bob"]).list_sessions(limit=100).result().sessions

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hits = rc.search_sessions(types.SessionSearchRequest(user_metadata={"team": "rl"})).result()
        assert [s.session_id for s in hits.sessions] == [session]
        assert hits.sessions[0].project_id == "proj-a" and hits.sessions[0].user_metadata == meta
        named = rc.search_sessions(types.SessionSearchRequest(display_name="SWEEP nightly")).result()
        assert session in [s.session_id for s in named.sessions]
        assert rest(admin_server, KEYS["bob"]).search_sessions(
            types.SessionSearchRequest(session_id=session)).result().sessions == []
        # Paging: one at a time through every alice session, newest first, each once.
        total = rc.list_sessions(limit=1000).result().sessions
        seen: list[str] = []
        request = types.SessionSearchRequest(limit=1)
        while True:
            page = rc.search_sessions(request).result()
            seen += [s.session_id for s in page.sessions]
            if page.next_cursor is None:
                break
            request = request.model_copy(update={"cursor": page.next_cursor})
        assert seen == total

    for limit in (0, 201):
        r = http(admin_server, "POST", "/sessions/search", KEYS["alice"], json={"limit": limit})
        assert r.status_code == 400 and "limit" in r.json()["detail"]
    assert http(admin_server, "POST", "/sessions/search", KEYS["alice"], json={"limit": 200}).status_code == 200

    # Project assignment, audited.
    rc.assign_session_project(session, "proj-b").result()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        moved = rc.search_sessions(types.SessionSearchRequest(project_ids=["proj-b"])).result()
    assert [s.session_id for s in moved.sessions] == [session]
    with pytest.raises(tinker.NotFoundError):
        rest(admin_server, KEYS["bob"]).assign_session_project(session, "proj-x").result()
    projects = admin_client(admin_server).get_audit_log(event_type="projects").result().entries
    assert any(e.event == "session_project_set" and e.event_details["object"] == f"session:{session}" and
               e.event_details["project_id"] == "proj-b" for e in projects)

    # The trace: requests with timings and sizes, never tokens.
    url = rc.export_session_trace(session).result()
    assert url.startswith("data:application/json;base64,")
    trace = json.loads(base64.b64decode(url.split(",", 1)[1]))
    routes = [e["name"] for e in trace["traceEvents"]]
    assert "POST /api/v1/forward_backward" in routes and "POST /api/v1/create_model" in routes
    assert all(e["dur"] >= 0 and e["args"]["request_bytes"] >= 0 for e in trace["traceEvents"])
    assert "target_tokens" not in json.dumps(trace) and KEYS["alice"] not in json.dumps(trace)
    with pytest.raises(tinker.NotFoundError):
        rest(admin_server, KEYS["bob"]).export_session_trace(session).result()

    # Malformed and oversized metadata: limit + 1.
    def create(body: dict[str, Any]) -> requests.Response:
        full = {"tags": [], "user_metadata": {}, "sdk_version": "x", "type": "create_session", **body}
        return http(admin_server, "POST", "/create_session", KEYS["alice"], json=full)

    big = {"k": "v" * (16 * 1024 - len('{"k":""}'))}
    assert create({"user_metadata": big}).status_code == 200
    r = create({"user_metadata": {"k": big["k"] + "v"}})
    assert r.status_code == 400 and "16384" in r.json()["detail"]
    assert create({"user_metadata": {"n": 1}}).status_code == 400
    assert create({"user_metadata": [1]}).status_code == 400
    assert create({"tags": ["t"] * 64}).status_code == 200
    assert create({"tags": ["t"] * 65}).status_code == 400
    assert create({"tags": ["x" * 129]}).status_code == 400
    assert create({"project_id": "bad project"}).status_code == 400
    assert create({"display_name": "d" * 257}).status_code == 400

    # tinker run list / run info, the real CLI, unmodified.
    env = dict(os.environ, TINKER_BASE_URL=base_url(admin_server), TINKER_API_KEY=KEYS["alice"])
    cli = [sys.executable, "-m", "tinker.cli", "--format", "json"]
    listed = subprocess.run([*cli, "run", "list"], env=env, capture_output=True, text=True, timeout=scaled(120))
    assert listed.returncode == 0, listed.stderr
    assert model_id in listed.stdout
    info = subprocess.run([*cli, "run", "info", model_id], env=env, capture_output=True, text=True,
                          timeout=scaled(120))
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["training_run_id"] == model_id
    trace_file = tmp_path / "trace.pftrace"
    exported = subprocess.run([sys.executable, "-m", "tinker.cli", "session", "export-trace", session, "-o",
                               str(trace_file)], env=env, capture_output=True, text=True, timeout=scaled(120))
    assert exported.returncode == 0, exported.stderr
    assert "POST /api/v1/forward_backward" in [e["name"] for e in json.loads(trace_file.read_text())["traceEvents"]]
    bob_env = dict(env, TINKER_API_KEY=KEYS["bob"])
    denied = subprocess.run([*cli, "run", "info", model_id], env=bob_env, capture_output=True, text=True,
                            timeout=scaled(120))
    assert denied.returncode != 0


def test_keys_and_usage_survive_a_restart(launch_server: LaunchServer, server_bin: Path, tmp_path: Path) -> None:
    overrides = _overrides(tmp_path / "data")
    overrides["auth"]["usage_flush_interval_s"] = 3600  # only the shutdown writes the counters
    first = launch_server(overrides)
    alice_id = key_id_of(first, KEYS["alice"])
    made = admin_json(server_bin, first, "create-key", "--tenant", "bob", "--role", "read-only")
    training = service(first, KEYS["alice"]).create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    training.forward_backward([datum(s) for s in SEQS], "cross_entropy").result()
    revoked = admin_json(server_bin, first, "create-key", "--tenant", "bob", "--role", "member")
    admin_json(server_bin, first, "revoke-key", str(revoked["key_id"]))
    first.stop()  # SIGTERM: the last usage counters are written on the way out

    second = launch_server(overrides)
    # The bootstrap is idempotent: config keys keep their ids; runtime keys and revocations persist.
    assert key_id_of(second, KEYS["alice"]) == alice_id
    assert http(second, "GET", "/auth/apikey/me", made["key"]).json()["role"] == "read-only"
    assert http(second, "GET", "/auth/apikey/me", revoked["key"]).status_code == 401
    assert usage_of(usage_rows(second), alice_id, "training") == sum(len(s) - 1 for s in SEQS)
