"""Request ids outlive a restart: every API's futures live in one store journaled in the
registry. Real server (auth on, tenants alice and bob), real HTTP and the real tinker SDK.

- A request that finished before SIGTERM is retrieved after the relaunch with its answer,
  read by the SDK's own future code (protobuf forward_backward, JSON optim_step), equal to
  what it answered before; the other tenant cannot read it (404, as for an unknown id).
- A request still in flight at SIGTERM answers 410 "interrupted by a restart": the SDK's
  future, which kept polling across the restart, raises its RetryableException (the signal
  its callers resubmit on), never a 404 and never a hang.
- A sampling client outlives the restart (and so does the SDK's session, resumed by its next
  heartbeat): its sampling session (on a checkpoint path or the base
  model) is reopened under the same id on first use, so the SDK's own retry of a sample the
  restart interrupted returns what the same greedy request returned before; a client on an
  unnamed snapshot (save_weights_and_get_sampling_client) gets a clear 403 "lost in a
  server restart" instead, and the other tenant cannot use alice's session id.
- Retained results are bounded per tenant (sessions.max_retained_results): over the bound
  the oldest is dropped, and fetching it answers 403 naming the key, while the other
  tenant's results are untouched.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from twinkle_client._proto.twinkle.v1 import training_pb2 as tpb

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker  # noqa: E402
from tinker import types  # noqa: E402
from tinker.lib.api_future_impl import _APIFuture  # noqa: E402
from tinker.lib.retryable_exception import RetryableException  # noqa: E402

from e2e_support import prom  # noqa: E402
from e2e_support.server import LaunchServer, ServerProcess  # noqa: E402
from e2e_support.training import KEYS, Client, auth_overrides  # noqa: E402
from e2e_support.waiting import scaled, wait_until  # noqa: E402
from test_tinker_http import Api, fwdbwd_body  # noqa: E402
from test_tinker_sdk import MODEL_NAME, SEQ, datum, lora_client, resolved, service  # noqa: E402

PROTO = {"Content-Type": "application/x-protobuf"}
ADAM = {"learning_rate": 1e-2}


def sdk_result(svc: tinker.ServiceClient, model_cls: Any, request_id: str, request_type: str) -> Any:
    """What the SDK's own future code makes of retrieve_future for `request_id`."""
    holder = svc._get_session_holder()  # the holder every SDK future polls through
    future = _APIFuture(model_cls, holder, types.UntypedAPIFuture(request_id=request_id),
                        request_start_time=time.time(), request_type=request_type)
    return future.result(timeout=scaled(120))


def retrieve(api: Api, request_id: str) -> requests.Response:
    return api.post("/retrieve_future", {"request_id": request_id})


def relaunch(launch_server: LaunchServer, overrides: dict[str, Any], old: ServerProcess) -> ServerProcess:
    """The same config on the same ports and data_dir, after `old` stopped on SIGTERM."""
    same_ports = {**overrides, "server": {"host": "127.0.0.1", "grpc_port": old.grpc_port,
                                          "http_port": old.http_port, "drain_timeout_s": 5}}
    return launch_server(same_ports)


def queued_ops(server: ServerProcess) -> float:
    samples = prom.parse(requests.get(server.http_url("/metrics"), timeout=10).text)
    return sum(s.value for s in prom.select(samples, "twinkle_queue_depth"))


def test_request_ids_outlive_a_restart(launch_server: LaunchServer, tmp_path: Path) -> None:
    overrides = auth_overrides(storage={"data_dir": str(tmp_path / "data")}, testing={"hooks": True})
    server = launch_server(overrides)
    alice, bob = Api(server, KEYS["alice"]), Api(server, KEYS["bob"])
    a_model, b_model = alice.create_model(), bob.create_model()
    svc = service(server, KEYS["alice"])

    # Finished before the restart, read through the SDK: a forward_backward (protobuf) and an
    # optim_step (JSON) of alice, a forward_backward of bob.
    fb_id = alice.post("/forward_backward", data=fwdbwd_body(a_model, 1), headers=PROTO).json()["request_id"]
    step_id = alice.post("/optim_step", {"model_id": a_model, "seq_id": 2, "adam_params": ADAM}).json()["request_id"]
    bob_id = bob.post("/forward_backward", data=fwdbwd_body(b_model, 1), headers=PROTO).json()["request_id"]
    fb_before = sdk_result(svc, types.ForwardBackwardOutput, fb_id, "ForwardBackward")
    step_before = sdk_result(svc, types.OptimStepResponse, step_id, "OptimStep")
    bob_before = bob.result(bob_id).json()
    assert fb_before.metrics["loss:sum"] > 0
    assert retrieve(alice, bob_id).status_code == 404  # another tenant's id: as unknown

    # In flight: the SDK's own forward_backward, queued behind a paused scheduler, its future
    # polling when the server stops.
    training = lora_client(svc, rank=4)
    admin = Client(server.grpc_address, KEYS["alice"])
    admin.call("PauseScheduler", tpb.Empty())
    admin.close()
    in_flight = training.forward_backward([datum([11, 42, 7, 99, 123])], "cross_entropy")
    wait_until(lambda: queued_ops(server) >= 1, scaled(30), "the SDK's forward_backward is queued")
    outcome: dict[str, BaseException | Any] = {}

    def wait_in_flight() -> None:
        try:
            outcome["result"] = in_flight.result(timeout=scaled(300))
        except BaseException as e:  # noqa: BLE001 - the exception is what the test checks
            outcome["error"] = e

    waiter = threading.Thread(target=wait_in_flight)
    waiter.start()

    server.send_signal(signal.SIGTERM)
    assert server.wait_exit(scaled(60)) == 0, server.logs()
    server = relaunch(launch_server, overrides, server)
    alice, bob = Api(server, KEYS["alice"]), Api(server, KEYS["bob"])

    # The in-flight one: 410 for the SDK's poll, which raises its RetryableException.
    waiter.join(scaled(300))
    assert not waiter.is_alive(), "the SDK's future still waits after the restart"
    error = outcome.get("error")
    assert isinstance(error, RetryableException), outcome
    assert "interrupted by a restart" in str(error.__cause__), repr(error.__cause__)

    # Finished ones: the same answers after the restart, decoded by the SDK.
    fb_after = sdk_result(svc, types.ForwardBackwardOutput, fb_id, "ForwardBackward")
    assert fb_after.metrics == fb_before.metrics
    assert [o["logprobs"].tolist() for o in fb_after.loss_fn_outputs] == \
        [o["logprobs"].tolist() for o in fb_before.loss_fn_outputs]
    # The raw answer first: a failure here would otherwise surface as the SDK's own
    # AttributeError (its _APIFuture starts polling before it sets _queue_state_observer).
    raw_step = retrieve(alice, step_id)
    assert raw_step.status_code == 200 and "error" not in raw_step.json(), (raw_step.status_code, raw_step.text)
    assert sdk_result(svc, types.OptimStepResponse, step_id, "OptimStep").metrics == step_before.metrics
    assert bob.result(bob_id).json() == bob_before
    # Another tenant's id of the earlier boot never gives alice its answer (the journal answers
    # as for an id of that boot it holds nothing for); ids never issued are 404.
    r = retrieve(alice, bob_id)
    assert r.status_code in (404, 410) and "metrics" not in r.text, r.text
    for request_id in ("tk-999999999999999", "tk-x"):
        r = retrieve(alice, request_id)
        assert r.status_code == 404, r.text
    # The server serves both tenants after the restart.
    fresh = alice.create_model()
    r = alice.post("/forward_backward", data=fwdbwd_body(fresh, 1), headers=PROTO)
    assert r.status_code == 200, r.text
    assert alice.result(r.json()["request_id"]).json()["metrics"]["loss:sum"] > 0


def test_sampling_clients_outlive_a_restart_and_the_sdk_retry_recovers(launch_server: LaunchServer,
                                                                         tmp_path: Path) -> None:
    overrides = auth_overrides(storage={"data_dir": str(tmp_path / "data")}, testing={"hooks": True})
    server = launch_server(overrides)
    svc, bob_svc = service(server, KEYS["alice"]), service(server, KEYS["bob"])
    training = lora_client(svc, rank=4)
    training.forward_backward([datum(SEQ)], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = training.save_weights_for_sampler("before-restart").result().path
    by_path = resolved(svc.create_sampling_client(model_path=path))
    base = resolved(svc.create_sampling_client(base_model=MODEL_NAME))
    live = resolved(training.save_weights_and_get_sampling_client())
    bobs = resolved(bob_svc.create_sampling_client(base_model=MODEL_NAME))
    prompt = types.ModelInput.from_ints(SEQ[:4])
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)

    def tokens(client: Any) -> list[int]:
        return list(client.sample(prompt, num_samples=1, sampling_params=greedy).result(timeout=scaled(120))
                    .sequences[0].tokens)

    want_path, want_base, want_bob = tokens(by_path), tokens(base), tokens(bobs)
    assert tokens(live) == want_path  # the same weights, saved and live

    # In flight at SIGTERM: the SDK's sample on the checkpoint's session, queued behind a
    # paused scheduler.
    admin = Client(server.grpc_address, KEYS["alice"])
    admin.call("PauseScheduler", tpb.Empty())
    admin.close()
    in_flight = by_path.sample(prompt, num_samples=1, sampling_params=greedy)
    wait_until(lambda: queued_ops(server) >= 1, scaled(30), "the SDK's sample is queued")
    server.send_signal(signal.SIGTERM)
    assert server.wait_exit(scaled(60)) == 0, server.logs()
    server = relaunch(launch_server, overrides, server)

    # The SDK's retry (its RetryableException on 410, then the same request again) lands on the
    # reopened session: the same greedy tokens as before the restart.
    assert list(in_flight.result(timeout=scaled(300)).sequences[0].tokens) == want_path
    assert tokens(base) == want_base
    assert tokens(bobs) == want_bob
    assert "reopened after a restart" in server.logs()

    # The live snapshot was in memory only: a clear 403, not a retry loop or a 404.
    with pytest.raises(Exception) as lost:
        tokens(live)
    assert "lost in a server restart" in str(lost.value), repr(lost.value)
    # Bob naming alice's session: as any unknown id of the earlier run (nothing about hers).
    bob_api = Api(server, KEYS["bob"])
    r = bob_api.post("/asample", {"sampling_session_id": by_path._sampling_session_id, "seq_id": 99,
                                  "num_samples": 1, "sampling_params": {"max_tokens": 2},
                                  "prompt": {"chunks": [{"type": "encoded_text", "tokens": SEQ[:4]}]}})
    assert r.status_code == 403 and "lost in a server restart" in r.json()["detail"], r.text
    assert tokens(by_path) == want_path  # and alice's session is still hers

    # The SDK's session (the ServiceClient's) resumes with its next heartbeat: 200 again, and
    # new training clients can be made in it; bob cannot resume it.
    session_id = svc._get_session_holder()._session_id
    assert bob_api.post("/session_heartbeat", {"session_id": session_id}).status_code == 404
    alice_api = Api(server, KEYS["alice"])
    r = alice_api.post("/session_heartbeat", {"session_id": session_id})
    assert r.status_code == 200, r.text
    assert "resumed after a restart" in server.logs()
    fresh = lora_client(svc, rank=4)
    fresh.forward_backward([datum(SEQ)], "cross_entropy").result(timeout=scaled(120))


def test_a_resuming_session_counts_against_max_sessions(launch_server: LaunchServer, tmp_path: Path) -> None:
    """A session of the earlier run resumes only within the tenant's limits.max_sessions: with
    the limit taken by a session of the new run, create_model in the old one is 403 naming
    max_sessions (not 404 "no session"), and it resumes once the new one has finished."""
    overrides = auth_overrides(storage={"data_dir": str(tmp_path / "data")}, limits={"max_sessions": 1})
    server = launch_server(overrides)
    old = Api(server, KEYS["alice"]).post("/create_session", {"tags": [], "sdk_version": "test"}).json()["session_id"]
    server.send_signal(signal.SIGTERM)
    assert server.wait_exit(scaled(60)) == 0, server.logs()
    server = relaunch(launch_server, overrides, server)
    alice = Api(server, KEYS["alice"])
    new = alice.post("/create_session", {"tags": [], "sdk_version": "test"}).json()["session_id"]
    body = {"session_id": old, "model_seq_id": 0, "base_model": MODEL_NAME, "lora_config": {"rank": 4}}
    r = alice.post("/create_model", body)
    assert r.status_code == 403 and "max_sessions" in r.json()["detail"], r.text
    assert alice.post(f"/sessions/{new}/finish", {}).status_code == 200
    r = alice.post("/create_model", body)
    assert r.status_code == 200, r.text
    assert "model_id" in alice.result(r.json()["request_id"]).json()


def test_retained_results_are_bounded_per_tenant(launch_server: LaunchServer, tmp_path: Path) -> None:
    bound = 4
    server = launch_server(auth_overrides(storage={"data_dir": str(tmp_path / "data")},
                                          sessions={"max_retained_results": bound}))
    alice, bob = Api(server, KEYS["alice"]), Api(server, KEYS["bob"])
    a_model, b_model = alice.create_model(), bob.create_model()  # create_model is a result too
    bob_first = bob.post("/forward_backward", data=fwdbwd_body(b_model, 1), headers=PROTO).json()["request_id"]
    bob_answer = bob.result(bob_first).json()
    ids = []
    for seq in range(1, bound + 1):
        r = alice.post("/forward_backward", data=fwdbwd_body(a_model, seq), headers=PROTO)
        assert r.status_code == 200, r.text
        ids.append(r.json()["request_id"])
        assert "metrics" in alice.result(ids[-1]).json()
    # alice held create_model's result and 4 forward_backwards' (5 > 4: create_model's went);
    # one more pushes the first forward_backward's out.
    r = alice.post("/forward_backward", data=fwdbwd_body(a_model, bound + 1), headers=PROTO)
    ids.append(r.json()["request_id"])
    alice.result(ids[-1])
    r = retrieve(alice, ids[0])
    assert r.status_code == 200, r.text
    dropped = r.json()
    assert "error" in dropped and "sessions.max_retained_results" in dropped["error"], dropped
    assert dropped["category"] == "user"
    for request_id in ids[1:]:
        assert "metrics" in alice.result(request_id).json()
    # Bob's results are his own budget.
    assert bob.result(bob_first).json() == bob_answer
