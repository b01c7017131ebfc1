"""Multi-tenancy through the real server: API keys on every RPC, tenant isolation, fused
training that equals training alone, queue limits and deadlines, input validation."""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import requests
from google.protobuf import descriptor_pool, message_factory
from twinkle_client._proto.twinkle.v1 import training_pb2 as tpb
from twinkle_client._proto.twinkle.v1 import utility_pb2 as upb

from e2e_support import prom
from e2e_support.server import ServerProcess
from e2e_support.training import KEYS, Client, auth_overrides, batch, engine_datum, state_dict

LaunchServer = Callable[..., ServerProcess]
INT32_MAX = 2**31 - 1


def vocab_size(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def expect_code(code: grpc.StatusCode, fn: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert info.value.code() == code, f"{info.value.code()}: {info.value.details()}"
    return info.value


def add_adapter(client: Client, name: str, rank: int = 4, seed: int = 1, **extra: Any) -> tpb.AddAdapterResponse:
    return client.call("AddAdapter", tpb.AddAdapterRequest(
        adapter_name=name, config=tpb.LoraConfig(r=rank, lora_alpha=32, seed=seed), **extra))


def checksum(client: Client, adapter: str) -> str:
    weights = state_dict(client, adapter)
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].tobytes())
    return h.hexdigest()


# ---- authentication ---------------------------------------------------------------------------

def all_rpcs() -> list[tuple[str, Any]]:
    """(full method path, request class) for every RPC of every twinkle.v1 service."""
    out = []
    for file in (tpb.DESCRIPTOR, upb.DESCRIPTOR):
        for service in file.services_by_name.values():
            for method in service.methods:
                request_cls = message_factory.GetMessageClass(method.input_type)
                out.append((f"/{service.full_name}/{method.name}", request_cls))
    return out


def test_every_rpc_needs_a_key_and_keys_never_leak(launch_server: LaunchServer) -> None:
    server = launch_server(auth_overrides(testing={"hooks": True}))
    channel = grpc.insecure_channel(server.grpc_address)
    rpcs = all_rpcs()
    assert len(rpcs) >= 30, [r for r, _ in rpcs]
    wrong = "tml-not-a-real-key-00000000000000000000"
    for path, request_cls in rpcs:
        call = channel.unary_unary(path, request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=lambda b: b)
        for metadata in ([], [("authorization", f"Bearer {wrong}")], [("x-api-key", wrong)]):
            error = expect_code(grpc.StatusCode.UNAUTHENTICATED,
                                lambda: call(request_cls(), metadata=metadata, timeout=10))
            assert wrong not in (error.details() or "")
    # Health answers without a key.
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    # A right key works, by either header.
    alice = Client(server.grpc_address, KEYS["alice"])
    add_adapter(alice, "probe")
    bob_by_x_api_key = channel.unary_unary("/twinkle.v1.TrainingService/CreateSession",
                                           request_serializer=lambda m: m.SerializeToString(),
                                           response_deserializer=tpb.CreateSessionResponse.FromString)
    assert bob_by_x_api_key(tpb.CreateSessionRequest(), metadata=[("x-api-key", KEYS["bob"])], timeout=10).session_id
    metrics = requests.get(server.http_url("/metrics"), timeout=10).text
    failures = prom.value(prom.parse(metrics), "twinkle_auth_failures_total")
    print(f"RPCs checked: {len(rpcs)}, auth failures counted: {failures}")
    assert failures == 3 * len(rpcs)
    # No key text anywhere: logs and metrics.
    texts = server.stdout_path.read_text(errors="replace") + server.stderr_text() + metrics
    for key in (*KEYS.values(), wrong):
        assert key not in texts
    alice.close()
    channel.close()


# ---- isolation --------------------------------------------------------------------------------

ADAPTER_CALLS: list[tuple[str, Callable[[str], Any]]] = [
    ("RemoveAdapter", lambda n: tpb.AdapterRequest(adapter_name=n)),
    ("SetLoss", lambda n: tpb.SetLossRequest(adapter_name=n, loss_cls="CrossEntropyLoss")),
    ("SetOptimizer", lambda n: tpb.SetOptimizerRequest(adapter_name=n, optimizer_cls="SGD")),
    ("SetLrScheduler", lambda n: tpb.SetLrSchedulerRequest(adapter_name=n, scheduler_cls="constant")),
    ("Forward", lambda n: tpb.ForwardRequest(adapter_name=n, inputs=batch(1, 100))),
    ("ForwardOnly", lambda n: tpb.ForwardRequest(adapter_name=n, inputs=batch(1, 100))),
    ("ForwardBackward", lambda n: tpb.ForwardRequest(adapter_name=n, inputs=batch(1, 100))),
    ("CalculateLoss", lambda n: tpb.AdapterRequest(adapter_name=n)),
    ("Backward", lambda n: tpb.AdapterRequest(adapter_name=n)),
    ("ClipGradNorm", lambda n: tpb.ClipGradNormRequest(adapter_name=n)),
    ("Step", lambda n: tpb.AdapterRequest(adapter_name=n)),
    ("ZeroGrad", lambda n: tpb.AdapterRequest(adapter_name=n)),
    ("LrStep", lambda n: tpb.AdapterRequest(adapter_name=n)),
    ("ClipGradAndStep", lambda n: tpb.ClipGradNormRequest(adapter_name=n)),
    ("CalculateMetric", lambda n: tpb.CalculateMetricRequest(adapter_name=n)),
    ("GetTrainConfigs", lambda n: tpb.AdapterRequest(adapter_name=n)),
    ("GetStateDict", lambda n: tpb.AdapterRequest(adapter_name=n)),
]


def test_another_tenants_adapter_is_not_found(launch_server: LaunchServer) -> None:
    server = launch_server(auth_overrides())
    alice, bob = Client(server.grpc_address, KEYS["alice"]), Client(server.grpc_address, KEYS["bob"])
    add_adapter(alice, "mine")
    alice.call("ForwardBackward", tpb.ForwardRequest(adapter_name="mine", inputs=batch(3, 100)))
    before = checksum(alice, "mine")
    for method, make in ADAPTER_CALLS:
        error = expect_code(grpc.StatusCode.NOT_FOUND, lambda: bob.call(method, make("mine")))
        assert "mine" in error.details()
        # Exactly what an unknown name gets.
        unknown = expect_code(grpc.StatusCode.NOT_FOUND, lambda: bob.call(method, make("nonexistent")))
        assert error.details().replace("mine", "X") == unknown.details().replace("nonexistent", "X")
    assert checksum(alice, "mine") == before
    # Bob's future ids do not reach Alice's futures either.
    fut = alice.call("ForwardOnly", tpb.ForwardRequest(adapter_name="mine", inputs=batch(4, 100),
                                                       options=tpb.RequestOptions(return_future=True))).future_id
    expect_code(grpc.StatusCode.NOT_FOUND, lambda: bob.call("WaitFuture", tpb.WaitFutureRequest(future_id=fut)))
    expect_code(grpc.StatusCode.NOT_FOUND, lambda: bob.call("CancelFuture", tpb.CancelFutureRequest(future_id=fut)))
    assert alice.call("WaitFuture", tpb.WaitFutureRequest(future_id=fut)).done
    # Names are per tenant: Bob may use the same one.
    add_adapter(bob, "mine", seed=9)
    assert checksum(alice, "mine") == before
    print(f"isolation: {len(ADAPTER_CALLS)} adapter RPCs NOT_FOUND for the other tenant; checksum {before[:16]} unchanged")


# ---- fused training equals training alone ----------------------------------------------------

PLAN = {("alice", "a1"): (2, 11), ("alice", "a2"): (4, 12), ("bob", "b1"): (8, 13), ("bob", "b2"): (4, 14)}
ROUNDS = 20
LR = 1e-3


def round_inputs(adapter: str, r: int, vocab: int) -> list[tpb.InputFeature]:
    return batch(zlib.crc32(f"{adapter}/{r}".encode()), vocab, sequences=2)


def solo_reference(model: Path, adapter: str, rank: int, seed: int, vocab: int) -> dict[str, np.ndarray]:
    """The same adapter trained alone on a bare engine, by the ops the server should run."""
    harness = __import__("e2e_support.training", fromlist=["engine_harness"]).engine_harness()
    with harness.Engine() as engine:
        engine.call("load_model", {"model_dir": str(model), "dtype": "float32", "device": "cpu"})
        engine.call("create_adapter", {"adapter_id": adapter, "rank": rank, "alpha": 32.0, "seed": seed})
        for r in range(ROUNDS):
            datums = [engine_datum(f) for f in round_inputs(adapter, r, vocab)]
            engine.call("forward_backward", {"ops": [{"adapter_id": adapter, "datums": datums,
                                                      "loss": {"name": "twinkle:cross_entropy"}}]})
            engine.call("clip_grad_norm", {"adapter_id": adapter, "max_norm": 1.0, "norm_type": 2.0})
            engine.call("optim_step", {"adapter_id": adapter, "zero_grad": True,
                                       "hyper": {"learning_rate": LR, "weight_decay": 0.01}})
        state = engine.call("get_adapter_state", {"adapter_id": adapter})
        return {k: harness.as_numpy(v) for k, v in state["weights"].items()}


def setup_adapters(server: ServerProcess) -> dict[str, Client]:
    clients = {t: Client(server.grpc_address, KEYS[t]) for t in KEYS}
    for (tenant, name), (rank, seed) in PLAN.items():
        add_adapter(clients[tenant], name, rank=rank, seed=seed)
        clients[tenant].call("SetOptimizer", tpb.SetOptimizerRequest(adapter_name=name, optimizer_cls="AdamW",
                                                                     config={"lr": LR}))
    return clients


def compare_with_solo(clients: dict[str, Client], tiny_model: Path, vocab: int) -> float:
    worst = 0.0
    for (tenant, name), (rank, seed) in PLAN.items():
        got = state_dict(clients[tenant], name)
        want = solo_reference(tiny_model, name, rank, seed, vocab)
        assert got.keys() == want.keys()
        for key in want:
            worst = max(worst, float(np.max(np.abs(got[key] - want[key]))))
        moved = max(float(np.max(np.abs(got[k]))) for k in got if "lora_B" in k)
        assert moved > 0, "training did not change lora_B"
    return worst


def fused_histogram(server: ServerProcess) -> tuple[float, float]:
    """(steps, steps with one adapter) of forward_backward engine steps."""
    samples = prom.parse(requests.get(server.http_url("/metrics"), timeout=10).text)
    count = prom.value(samples, "twinkle_fused_step_adapters_count", kind="forward_backward")
    single = prom.value(samples, "twinkle_fused_step_adapters_bucket", kind="forward_backward", le="1")
    return count, single


def test_two_tenants_fused_in_lockstep_equal_solo_training(launch_server: LaunchServer, tiny_model: Path) -> None:
    """Each round all four adapters' forward_backward ops are queued while the scheduler is
    paused, so they fuse into one engine step; weights must still equal solo training."""
    server = launch_server(auth_overrides(testing={"hooks": True}))
    vocab = vocab_size(tiny_model)
    clients = setup_adapters(server)
    admin = clients["alice"]
    later = tpb.RequestOptions(return_future=True)
    for r in range(ROUNDS):
        admin.call("PauseScheduler", tpb.Empty())
        futures = []
        for (tenant, name) in PLAN:
            c = clients[tenant]
            futures.append((c, c.call("ForwardBackward", tpb.ForwardRequest(
                adapter_name=name, inputs=round_inputs(name, r, vocab), options=later)).future_id))
            futures.append((c, c.call("ClipGradAndStep", tpb.ClipGradNormRequest(
                adapter_name=name, max_grad_norm=1.0, options=later)).future_id))
        admin.call("ResumeScheduler", tpb.Empty())
        for c, fid in futures:
            reply = c.call("WaitFuture", tpb.WaitFutureRequest(future_id=fid, timeout_ms=60000))
            assert reply.done
    steps, single = fused_histogram(server)
    print(f"forward_backward engine steps: {steps:.0f} for {ROUNDS * len(PLAN)} ops; single-adapter steps: {single:.0f}")
    assert steps == ROUNDS, "each round's four forward_backward ops should be one fused step"
    assert single == 0
    worst = compare_with_solo(clients, tiny_model, vocab)
    print(f"fused (4 adapters, 2 tenants, {ROUNDS} rounds) vs solo: max |Δw| = {worst:.3e}")
    assert worst <= 1e-6


@pytest.mark.parametrize("max_loras", [16, 2], ids=["all-resident", "offloading"])
def test_two_tenants_training_concurrently_equal_solo_training(launch_server: LaunchServer, tiny_model: Path,
                                                               max_loras: int) -> None:
    """Free-running clients, one thread per adapter, blocking calls: whatever the scheduler
    fuses, each adapter ends where it would alone. With max_loras=2 the four adapters take
    turns on the device: offloaded to host memory and reloaded, bit for bit."""
    server = launch_server(auth_overrides(scheduler={"max_loras": max_loras}))
    vocab = vocab_size(tiny_model)
    clients = setup_adapters(server)
    errors: list[BaseException] = []

    def train(tenant: str, name: str) -> None:
        try:
            c = Client(server.grpc_address, KEYS[tenant])
            for r in range(ROUNDS):
                c.call("ForwardBackward", tpb.ForwardRequest(adapter_name=name, inputs=round_inputs(name, r, vocab)))
                c.call("ClipGradAndStep", tpb.ClipGradNormRequest(adapter_name=name, max_grad_norm=1.0))
            c.close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=train, args=key) for key in PLAN]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    steps, single = fused_histogram(server)
    print(f"concurrent: {steps:.0f} forward_backward engine steps for {ROUNDS * len(PLAN)} ops "
          f"({steps - single:.0f} fused several adapters)")
    assert steps <= ROUNDS * len(PLAN)
    samples = prom.parse(requests.get(server.http_url("/metrics"), timeout=10).text)
    offloads = prom.value(samples, "twinkle_adapter_events_total", event="offload")
    print(f"max_loras {max_loras}: {offloads:.0f} offloads")
    assert (offloads > 0) == (max_loras < len(PLAN))
    worst = compare_with_solo(clients, tiny_model, vocab)
    print(f"concurrent (4 adapters, 2 tenants, {ROUNDS} rounds) vs solo: max |Δw| = {worst:.3e}")
    assert worst <= 1e-6


# ---- queue limits and deadlines ---------------------------------------------------------------

QUEUE_CAP = 8


def test_full_queue_and_deadlines(launch_server: LaunchServer, tiny_model: Path) -> None:
    server = launch_server(auth_overrides(testing={"hooks": True}, scheduler={"queue_cap": QUEUE_CAP}))
    alice, bob = Client(server.grpc_address, KEYS["alice"]), Client(server.grpc_address, KEYS["bob"])
    add_adapter(alice, "q")
    add_adapter(bob, "other")
    vocab = vocab_size(tiny_model)
    later = tpb.RequestOptions(return_future=True)
    alice.call("PauseScheduler", tpb.Empty())
    accepted, refused = [], 0
    for i in range(QUEUE_CAP + 5):
        try:
            accepted.append(alice.call("ForwardOnly", tpb.ForwardRequest(
                adapter_name="q", inputs=batch(i, vocab), options=later)).future_id)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
            assert "queue" in e.details()
            refused += 1
    print(f"queue_cap {QUEUE_CAP}: {len(accepted)} queued, {refused} RESOURCE_EXHAUSTED")
    assert refused == 5 and len(accepted) == QUEUE_CAP
    # Another tenant's queue is its own.
    bob_future = bob.call("ForwardOnly", tpb.ForwardRequest(adapter_name="other", inputs=batch(99, vocab),
                                                            options=later)).future_id
    for fid in accepted:
        alice.call("CancelFuture", tpb.CancelFutureRequest(future_id=fid))
    expect_code(grpc.StatusCode.CANCELLED,
                lambda: alice.call("WaitFuture", tpb.WaitFutureRequest(future_id=accepted[0])))

    # A blocking call with a 100 ms deadline while paused: DEADLINE_EXCEEDED, never runs.
    expect_code(grpc.StatusCode.DEADLINE_EXCEEDED,
                lambda: alice.call("Step", tpb.AdapterRequest(adapter_name="q"), timeout=0.1))
    # The same through a future: the op carries the deadline and expires in the queue.
    fid = alice.call("Step", tpb.AdapterRequest(adapter_name="q", options=later), timeout=0.1).future_id
    time.sleep(0.3)
    expect_code(grpc.StatusCode.DEADLINE_EXCEEDED,
                lambda: alice.call("WaitFuture", tpb.WaitFutureRequest(future_id=fid)))
    alice.call("ResumeScheduler", tpb.Empty())
    assert bob.call("WaitFuture", tpb.WaitFutureRequest(future_id=bob_future, timeout_ms=60000)).done
    configs = json.loads(alice.call("GetTrainConfigs", tpb.AdapterRequest(adapter_name="q")).result)
    print(f"after the expired steps: optimizer_steps = {configs['optimizer_steps']}")
    assert configs["optimizer_steps"] == 0


# ---- bad input --------------------------------------------------------------------------------

def test_bad_inputs_are_refused_and_others_unaffected(launch_server: LaunchServer, tiny_model: Path) -> None:
    server = launch_server(auth_overrides(limits={"max_tokens_per_request": 64, "max_lora_rank": 16}))
    alice, bob = Client(server.grpc_address, KEYS["alice"]), Client(server.grpc_address, KEYS["bob"])
    vocab = vocab_size(tiny_model)
    add_adapter(alice, "a")
    add_adapter(bob, "b")
    good = batch(5, vocab)

    def fb(client: Client, name: str, **kw: Any) -> Callable[[], Any]:
        return lambda: client.call("ForwardBackward", tpb.ForwardRequest(adapter_name=name, **kw))

    nan_list = tpb.FloatList(values=[0.0])
    cases: list[tuple[str, Callable[[], Any], str]] = [
        ("token -1", fb(alice, "a", inputs=[tpb.InputFeature(input_ids=[1, -1, 2])]), "inputs[0].input_ids[1]"),
        ("token = vocab", fb(alice, "a", inputs=[tpb.InputFeature(input_ids=[1, vocab])]), "inputs[0].input_ids[1]"),
        ("token INT32_MAX", fb(alice, "a", inputs=[good[0], tpb.InputFeature(input_ids=[INT32_MAX])]),
         "inputs[1].input_ids[0]"),
        ("label out of range", fb(alice, "a", inputs=[tpb.InputFeature(input_ids=[1, 2], labels=[-100, vocab])]),
         "inputs[0].labels[1]"),
        ("labels length", fb(alice, "a", inputs=[tpb.InputFeature(input_ids=[1, 2, 3], labels=[1, 2])]),
         "inputs[0].labels"),
        ("NaN advantage", fb(alice, "a", inputs=good, advantages=[0.5, math.nan]), "advantages[1]"),
        ("Inf advantage", fb(alice, "a", inputs=good, advantages=[math.inf, 0.5]), "advantages[0]"),
        ("advantages count", fb(alice, "a", inputs=good, advantages=[1.0]), "advantages"),
        ("old_logps count", fb(alice, "a", inputs=good[:1], old_logps=[nan_list]), "old_logps[0]"),
        ("empty batch", fb(alice, "a", inputs=[]), "inputs"),
        ("empty sequence", fb(alice, "a", inputs=[tpb.InputFeature()]), "inputs[0].input_ids"),
        ("over the size limit", fb(alice, "a", inputs=[tpb.InputFeature(input_ids=[1] * 65)]),
         "max_tokens_per_request"),
        ("rank above the limit", lambda: add_adapter(alice, "big", rank=32), "config.r"),
        ("bad adapter name", lambda: add_adapter(alice, "no spaces allowed"), "adapter_name"),
        ("unknown loss", lambda: alice.call("SetLoss", tpb.SetLossRequest(adapter_name="a", loss_cls="NoSuchLoss")),
         "loss_cls"),
        ("unknown optimizer", lambda: alice.call("SetOptimizer", tpb.SetOptimizerRequest(
            adapter_name="a", optimizer_cls="Adagrad")), "optimizer_cls"),
        ("unknown optimizer argument", lambda: alice.call("SetOptimizer", tpb.SetOptimizerRequest(
            adapter_name="a", optimizer_cls="AdamW", config={"lrr": 1.0})), "config.lrr"),
        ("unknown scheduler", lambda: alice.call("SetLrScheduler", tpb.SetLrSchedulerRequest(
            adapter_name="a", scheduler_cls="Nope")), "scheduler_cls"),
    ]
    before = checksum(alice, "a")
    for label, call, field in cases:
        error = expect_code(grpc.StatusCode.INVALID_ARGUMENT, call)
        print(f"{label:28s} → INVALID_ARGUMENT: {error.details()}")
        assert field in error.details(), (label, error.details())
        # The other tenant is not disturbed.
        out = bob.call("ForwardBackward", tpb.ForwardRequest(adapter_name="b", inputs=good))
        assert len(out.result.sequences) == 2 and math.isfinite(out.result.loss)
    assert checksum(alice, "a") == before


def test_tenant_quotas(launch_server: LaunchServer) -> None:
    overrides = auth_overrides()
    overrides["auth"]["tenants"][0]["quotas"] = {"max_adapters": 2, "max_lora_rank": 8, "max_tokens_per_request": 16}
    server = launch_server(overrides)
    alice, bob = Client(server.grpc_address, KEYS["alice"]), Client(server.grpc_address, KEYS["bob"])
    error = expect_code(grpc.StatusCode.FAILED_PRECONDITION, lambda: add_adapter(alice, "r16", rank=16))
    assert "max_lora_rank" in error.details()
    add_adapter(alice, "one")
    add_adapter(alice, "two")
    error = expect_code(grpc.StatusCode.FAILED_PRECONDITION, lambda: add_adapter(alice, "three"))
    assert "max_adapters" in error.details()
    error = expect_code(grpc.StatusCode.FAILED_PRECONDITION, lambda: alice.call(
        "ForwardOnly", tpb.ForwardRequest(adapter_name="one", inputs=[tpb.InputFeature(input_ids=[1] * 17)])))
    assert "max_tokens_per_request" in error.details()
    add_adapter(bob, "r16", rank=16)  # Bob has the server's limits
    capacity = alice.utility.GetCapacity(upb.GetCapacityRequest(), metadata=alice.metadata, timeout=10)
    assert capacity.used_adapters == 3
