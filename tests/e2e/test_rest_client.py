"""The pinned tinker SDK's RestClient methods that the other suites do not reach, each with its
effect asserted, against a real server (auth on; tenants alice and bob, and an admin):
get_server_capabilities, get_training_run_by_tinker_path, delete_checkpoint(run, id),
get_sampler, and the deprecated RestClient forms of the AdminClient calls (get_audit_log,
get_billing_usage, get_current_checkpoint_storage_usage), whose answers must equal the
AdminClient's. Checkpoint storage is checked exactly: the bytes reported for a tenant equal the
sum of its checkpoints' sizes.

RestClient.whoami is in test_jwt_auth.py (it reads the claims of the SDK's auth-exchange token).
"""

from __future__ import annotations

import datetime as dt
import os
import warnings
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker  # noqa: E402
from tinker import types  # noqa: E402

from e2e_support.server import LaunchServer, ServerProcess  # noqa: E402
from e2e_support.training import KEYS, resolved, sha256_hex  # noqa: E402

MODEL_NAME = "tiny-qwen3"
ADMIN_KEY = "tml-ops-admin-feedfacecafebeef0123456789abcdef"
SEQ = [11, 42, 7, 99, 123, 5, 64, 300, 17, 250]


def base_url(server: ServerProcess) -> str:
    return f"http://{server.host}:{server.http_port}"


@pytest.fixture
def server(launch_server: LaunchServer, tmp_path: Path) -> ServerProcess:
    tenants = [{"id": t, "key_sha256": [sha256_hex(k)]} for t, k in KEYS.items()]
    tenants.append({"id": "ops", "key_sha256": [sha256_hex(ADMIN_KEY)], "role": "admin"})
    return launch_server({"auth": {"enabled": True, "tenants": tenants, "usage_flush_interval_s": 1},
                          "storage": {"data_dir": str(tmp_path / "data")}})


def test_rest_client_methods_and_the_deprecated_admin_forms(server: ServerProcess) -> None:
    url = base_url(server)
    svc = tinker.ServiceClient(base_url=url, api_key=KEYS["alice"])
    alice = tinker.RestClient(base_url=url, api_key=KEYS["alice"])
    bob = tinker.RestClient(base_url=url, api_key=KEYS["bob"])

    # get_server_capabilities: the served model, sampleable.
    capabilities = alice.get_server_capabilities().result()
    [model] = [m for m in capabilities.supported_models if m.model_name == MODEL_NAME]
    assert model.model_name == MODEL_NAME

    training = resolved(svc.create_lora_training_client(base_model=MODEL_NAME, rank=4))
    training.forward_backward([types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]),
                                           loss_fn_inputs={"target_tokens": SEQ[1:]})], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    model_id = training.get_info().model_id
    kept = training.save_state("kept").result().path
    training.save_state("doomed").result()
    sampler_path = training.save_weights_for_sampler("s").result().path

    # get_training_run_by_tinker_path: the run the path names; bob: not found.
    run = alice.get_training_run_by_tinker_path(kept).result()
    assert run.training_run_id == model_id and run.lora_rank == 4 and run.base_model == MODEL_NAME
    with pytest.raises(tinker.NotFoundError):
        bob.get_training_run_by_tinker_path(kept).result()

    # get_sampler: what a sampling client samples (a checkpoint path, or the base model).
    by_path = resolved(svc.create_sampling_client(model_path=sampler_path))
    info = alice.get_sampler(by_path._sampling_session_id).result()
    assert info.sampler_id == by_path._sampling_session_id
    assert info.base_model == MODEL_NAME and info.model_path == sampler_path
    base = resolved(svc.create_sampling_client(base_model=MODEL_NAME))
    assert alice.get_sampler(base._sampling_session_id).result().model_path is None
    with pytest.raises(tinker.NotFoundError):
        bob.get_sampler(by_path._sampling_session_id).result()

    # delete_checkpoint(run, checkpoint_id): bob cannot; alice's goes, the other stays.
    with pytest.raises(tinker.NotFoundError):
        bob.delete_checkpoint(model_id, "weights/doomed").result()
    alice.delete_checkpoint(model_id, "weights/doomed").result()
    ids = sorted(c.checkpoint_id for c in alice.list_checkpoints(model_id).result().checkpoints)
    assert ids == ["sampler_weights/s", "weights/kept"]
    with pytest.raises(tinker.NotFoundError):
        alice.delete_checkpoint(model_id, "weights/doomed").result()

    # The deprecated RestClient forms of the admin calls answer what AdminClient answers.
    admin_rest = tinker.RestClient(base_url=url, api_key=ADMIN_KEY)
    admin = tinker.AdminClient(base_url=url, api_key=ADMIN_KEY)
    hour = dt.datetime.now(dt.timezone.utc).replace(minute=0, second=0, microsecond=0)
    start = (hour - dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    end = (hour + dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        audit = admin_rest.get_audit_log().result()
        billing = admin_rest.get_billing_usage(start, end).result()
        storage = admin_rest.get_current_checkpoint_storage_usage().result()
    assert audit == admin.get_audit_log().result()
    assert any(e.event == "checkpoint_delete" for e in audit.entries), audit.entries
    assert billing == admin.get_billing_usage(start, end).result()
    assert any(e.user_id.startswith("tenant:alice/") for e in billing.data)
    assert storage == admin.get_current_checkpoint_storage_usage().result()
    # Exact: alice's bytes are the sum of her checkpoints' sizes, her count their number.
    mine = alice.list_user_checkpoints().result().checkpoints
    [row] = [d for d in storage.data if d.org_user_urn == "tenant:alice"]
    assert row.checkpoint_count == len(mine) == 2
    assert row.size_bytes == sum(c.size_bytes for c in mine) > 0
    assert not [d for d in storage.data if d.org_user_urn == "tenant:bob"]
    with pytest.raises(tinker.PermissionDeniedError):  # a member is not an admin
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            alice.get_audit_log().result()
