"""TrainingService and UtilityService beyond isolation: sessions and adapter expiry, the
Twinkle step/accumulation semantics, training runs, tokenizer files, rate limits."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from twinkle_client._proto.twinkle.v1 import training_pb2 as tpb
from twinkle_client._proto.twinkle.v1 import utility_pb2 as upb

from e2e_support.server import ServerProcess
from e2e_support.training import KEYS, Client, auth_overrides, batch

LaunchServer = Callable[..., ServerProcess]


def add(client: Client, name: str, **kw: Any) -> tpb.AddAdapterResponse:
    return client.call("AddAdapter", tpb.AddAdapterRequest(adapter_name=name, config=tpb.LoraConfig(r=4, seed=3), **kw))


def wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def exists(client: Client, name: str) -> bool:
    try:
        client.call("GetTrainConfigs", tpb.AdapterRequest(adapter_name=name), timeout=10)
        return True
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.NOT_FOUND, e.details()
        return False


def test_adapter_of_a_silent_session_is_released(launch_server: LaunchServer) -> None:
    server = launch_server({"sessions": {"adapter_timeout_s": 2}})
    c = Client(server.grpc_address, None)
    live = c.call("CreateSession", tpb.CreateSessionRequest()).session_id
    silent = c.call("CreateSession", tpb.CreateSessionRequest()).session_id
    add(c, "kept", session_id=live)
    add(c, "dropped", session_id=silent)
    add(c, "sessionless")
    start = time.monotonic()
    while time.monotonic() - start < 4.5:
        c.call("SessionHeartbeat", tpb.SessionHeartbeatRequest(session_id=live))
        time.sleep(0.5)
    assert exists(c, "kept") and exists(c, "sessionless")
    assert not exists(c, "dropped")
    with pytest.raises(grpc.RpcError) as info:
        c.call("SessionHeartbeat", tpb.SessionHeartbeatRequest(session_id=silent))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    capacity = c.utility.GetCapacity(upb.GetCapacityRequest(), timeout=10)
    assert capacity.used_adapters == 2


def test_gradient_accumulation_gates_the_optimizer(launch_server: LaunchServer, tiny_model: Path) -> None:
    """gradient_accumulation_steps=3: step/clip/zero/lr_step act only after every 3rd backward."""
    server = launch_server()
    c = Client(server.grpc_address, None)
    add(c, "acc", gradient_accumulation_steps=3)
    vocab = int(json.loads((tiny_model / "config.json").read_text())["vocab_size"])
    acted = []
    for i in range(6):
        c.call("ForwardBackward", tpb.ForwardRequest(adapter_name="acc", inputs=batch(i, vocab)))
        r = c.call("ClipGradAndStep", tpb.ClipGradNormRequest(adapter_name="acc"))
        acted.append(not r.skipped)
        if not r.skipped:
            assert r.value > 0  # the pre-clip gradient norm
    assert acted == [False, False, True, False, False, True]
    configs = json.loads(c.call("GetTrainConfigs", tpb.AdapterRequest(adapter_name="acc")).result)
    assert configs["optimizer_steps"] == 2 and configs["cur_step"] == 6
    metric = c.call("CalculateMetric", tpb.CalculateMetricRequest(adapter_name="acc", is_training=True)).result
    assert float(metric["loss"]) > 0 and metric["iters"] == "2"


def test_forward_then_backward_equals_forward_backward(launch_server: LaunchServer, tiny_model: Path) -> None:
    """Twinkle's split forward / calculate_loss / backward gives the same loss and update as
    forward_backward (the server recomputes the graph for backward)."""
    server = launch_server()
    c = Client(server.grpc_address, None)
    vocab = int(json.loads((tiny_model / "config.json").read_text())["vocab_size"])
    data = batch(7, vocab)
    for name in ("split", "joint"):
        add(c, name)
        c.call("SetOptimizer", tpb.SetOptimizerRequest(adapter_name=name, optimizer_cls="AdamW", config={"lr": 1e-2}))
    fwd = c.call("Forward", tpb.ForwardRequest(adapter_name="split", inputs=data)).result
    loss = c.call("CalculateLoss", tpb.AdapterRequest(adapter_name="split")).value
    c.call("Backward", tpb.AdapterRequest(adapter_name="split"))
    joint = c.call("ForwardBackward", tpb.ForwardRequest(adapter_name="joint", inputs=data)).result
    assert loss == pytest.approx(joint.loss, rel=1e-6) and fwd.loss == pytest.approx(joint.loss, rel=1e-6)
    for name in ("split", "joint"):
        c.call("Step", tpb.AdapterRequest(adapter_name=name))
    a = c.call("GetStateDict", tpb.AdapterRequest(adapter_name="split"))
    b = c.call("GetStateDict", tpb.AdapterRequest(adapter_name="joint"))
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    assert all(list(x.values) == list(y.values) for x, y in zip(a.tensors, b.tensors))


def test_training_runs_are_per_tenant(launch_server: LaunchServer) -> None:
    server = launch_server(auth_overrides())
    alice, bob = Client(server.grpc_address, KEYS["alice"]), Client(server.grpc_address, KEYS["bob"])
    session = alice.call("CreateSession", tpb.CreateSessionRequest()).session_id
    run_id = add(alice, "r1", session_id=session).run_id
    assert run_id == f"{session}-r1"
    add(alice, "r2")
    runs = alice.utility.ListTrainingRuns(upb.ListTrainingRunsRequest(limit=1), metadata=alice.metadata, timeout=10)
    assert runs.cursor.total_count == 2 and len(runs.training_runs) == 1
    assert runs.training_runs[0].adapter_name == "r2"  # newest first
    got = alice.utility.GetTrainingRun(upb.GetTrainingRunRequest(run_id=run_id), metadata=alice.metadata, timeout=10)
    assert got.model_owner == "alice" and got.lora_rank == 4 and got.is_lora
    assert bob.utility.ListTrainingRuns(upb.ListTrainingRunsRequest(), metadata=bob.metadata, timeout=10).cursor.total_count == 0
    for call in (lambda: bob.utility.GetTrainingRun(upb.GetTrainingRunRequest(run_id=run_id), metadata=bob.metadata, timeout=10),
                 lambda: bob.utility.ListCheckpoints(upb.ListCheckpointsRequest(run_id=run_id), metadata=bob.metadata, timeout=10)):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert len(alice.utility.ListCheckpoints(upb.ListCheckpointsRequest(run_id=run_id), metadata=alice.metadata,
                                             timeout=10).checkpoints) == 0


def test_tokenizer_files_build_the_same_tokenizer(launch_server: LaunchServer, tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    server = launch_server()
    c = Client(server.grpc_address, None)
    files = c.utility.GetTokenizerFiles(upb.GetTokenizerFilesRequest(), timeout=10).files
    names = {f.name for f in files}
    assert "tokenizer.json" in names and "model.safetensors" not in names and "config.json" not in names
    with tempfile.TemporaryDirectory() as d:
        for f in files:
            (Path(d) / f.name).write_bytes(f.content)
        remote = AutoTokenizer.from_pretrained(d)
    local = AutoTokenizer.from_pretrained(str(tiny_model))
    text = "hello tiny world 123"
    assert remote(text)["input_ids"] == local(text)["input_ids"]


def test_token_rate_limit_answers_resource_exhausted_with_retry_after(launch_server: LaunchServer,
                                                                      tiny_model: Path) -> None:
    server = launch_server({"limits": {"tokens_per_s": 10, "burst_tokens": 40}})
    c = Client(server.grpc_address, None)
    add(c, "rl")
    inputs = [tpb.InputFeature(input_ids=[1] * 30)]
    c.call("ForwardOnly", tpb.ForwardRequest(adapter_name="rl", inputs=inputs))
    with pytest.raises(grpc.RpcError) as info:
        c.call("ForwardOnly", tpb.ForwardRequest(adapter_name="rl", inputs=inputs))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailing = dict(info.value.trailing_metadata() or ())
    print(f"rate limited: {info.value.details()}; retry-after {trailing.get('retry-after')}")
    assert int(trailing["retry-after"]) >= 1


def test_activation_memory_budget_refuses_a_request_estimated_above_it(launch_server: LaunchServer,
                                                                       tiny_model: Path) -> None:
    """engine.activation_memory_mib end to end: the engine's estimate reaches the coordinator
    through the load reply. A budget of 64 MiB (the estimate's fixed term alone) refuses
    every forward_backward and forward when submitted, naming both figures; a large budget
    trains as usual."""
    vocab = int(json.loads((tiny_model / "config.json").read_text())["vocab_size"])
    server = launch_server({"engine": {"activation_memory_mib": 64}})
    c = Client(server.grpc_address, None)
    add(c, "tight")
    for method in ("ForwardBackward", "Forward"):
        with pytest.raises(grpc.RpcError) as info:
            c.call(method, tpb.ForwardRequest(adapter_name="tight", inputs=batch(1, vocab)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert "MiB of activation memory, above the 64 MiB a step may use (engine.activation_memory_mib)" \
            in info.value.details()
    server.stop()
    roomy = launch_server({"engine": {"activation_memory_mib": 100000}})
    c = Client(roomy.grpc_address, None)
    add(c, "roomy")
    assert c.call("ForwardBackward", tpb.ForwardRequest(adapter_name="roomy", inputs=batch(1, vocab))).result.loss > 0
