"""The Tinker API driven by the real tinker SDK (the pinned release from PyPI, unmodified).

The SDK talks to the server's HTTP port exactly as it would to the hosted service
(tinker-protocol.md §16): client config, sessions and heartbeats, protobuf forward_backward,
long-polled futures, checkpoints, REST listings. Numbers are checked against the SDK's own
results (a forward after a load equals the forward after the save; loss:sum equals the
formula on the returned log-probs), never against a re-implementation in the test.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "1")

import tinker  # noqa: E402
from tinker import types  # noqa: E402

from e2e_support.server import LaunchServer, ServerProcess  # noqa: E402
from e2e_support.training import KEYS, auth_overrides, resolved  # noqa: E402

MODEL_NAME = "tiny-qwen3"
SEQ = [11, 42, 7, 99, 123, 5, 64, 300, 17, 250]


def service(server: ServerProcess, key: str) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=f"http://{server.host}:{server.http_port}", api_key=key)


def datum(seq: list[int], weights: list[float] | None = None, **inputs: Any) -> types.Datum:
    n = len(seq) - 1
    loss_inputs: dict[str, Any] = {"target_tokens": seq[1:]}
    loss_inputs["weights"] = weights if weights is not None else [1.0] * n
    loss_inputs.update(inputs)
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=loss_inputs)


def rl_datum(seq: list[int], logprobs: list[float], advantages: list[float]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "logprobs": logprobs, "advantages": advantages},
    )


def lora_client(svc: tinker.ServiceClient, rank: int = 8) -> Any:
    """create_lora_training_client, awaited."""
    return resolved(svc.create_lora_training_client(base_model=MODEL_NAME, rank=rank))


def logprobs_of(result: Any) -> list[np.ndarray]:
    return [np.asarray(out["logprobs"].to_numpy(), dtype=np.float64) for out in result.loss_fn_outputs]


@pytest.fixture
def tinker_server(launch_server: LaunchServer, tmp_path: Path) -> ServerProcess:
    return launch_server(auth_overrides(storage={"data_dir": str(tmp_path / "data")}))


def test_training_losses_forward_save_load(tinker_server: ServerProcess) -> None:
    svc = service(tinker_server, KEYS["alice"])
    caps = svc.get_server_capabilities()
    assert MODEL_NAME in [m.model_name for m in caps.supported_models]

    training = lora_client(svc, rank=8)
    info = training.get_info()
    assert info.model_id and "/" not in info.model_id and ":train:" in info.model_id
    assert info.lora_rank == 8

    weights = [1.0, 0.5, 0.0, 2.0, 1.0, 1.0, 0.25, 1.0, 1.0]
    sft = [datum(SEQ, weights)]
    out = training.forward_backward(sft, "cross_entropy").result()
    (lp,) = logprobs_of(out)
    assert lp.shape == (len(SEQ) - 1,)
    assert np.all(lp <= 0)
    expected = -float(np.dot(np.asarray(weights), lp))
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-5)

    # The forward-only pass on the same data gives the same log-probs.
    fwd = training.forward(sft, "cross_entropy").result()
    np.testing.assert_allclose(logprobs_of(fwd)[0], lp, atol=1e-5, rtol=0)

    # Each of the other four losses, with their configs.
    adv = [0.5, -1.0, 1.0, 0.0, 2.0, -0.5, 1.0, 1.0, -1.0]
    rl = [rl_datum(SEQ, [float(v) for v in lp], adv)]
    is_out = training.forward_backward(rl, "importance_sampling").result()
    # On-policy: every ratio is 1, so the loss is -sum(advantages).
    assert is_out.metrics["loss:sum"] == pytest.approx(-sum(adv), abs=1e-3)
    for loss, config in (("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}), ("cispo", None),
                         ("dro", {"beta": 0.05})):
        res = training.forward_backward(rl, loss, config).result()
        assert len(logprobs_of(res)[0]) == len(SEQ) - 1
        assert math.isfinite(res.metrics["loss:sum"])

    step = training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert isinstance(step.metrics, dict)

    saved = training.save_state("step1").result()
    assert saved.path == f"tinker://{info.model_id}/weights/step1"
    after_save = logprobs_of(training.forward(sft, "cross_entropy").result())[0]

    training.forward_backward(sft, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    moved = logprobs_of(training.forward(sft, "cross_entropy").result())[0]
    assert np.max(np.abs(moved - after_save)) > 1e-4

    def step_from_here() -> np.ndarray:
        training.forward_backward(sft, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        return logprobs_of(training.forward(sft, "cross_entropy").result())[0]

    # With the optimizer: the Adam moments come back too, so the next step repeats `moved`.
    training.load_state_with_optimizer(saved.path).result()
    restored = logprobs_of(training.forward(sft, "cross_entropy").result())[0]
    np.testing.assert_array_equal(restored, after_save)
    np.testing.assert_array_equal(step_from_here(), moved)

    # Weights only: the optimizer starts fresh (step 0, no moments), so the next step is
    # Adam's first step from the saved weights, not `moved`.
    training.load_state(saved.path).result()
    restored = logprobs_of(training.forward(sft, "cross_entropy").result())[0]
    np.testing.assert_array_equal(restored, after_save)
    fresh_step = step_from_here()
    assert np.max(np.abs(fresh_step - moved)) > 1e-6
    training.load_state(saved.path).result()

    # A new model restored from the checkpoint (weights_info → create_model → load_weights).
    made = svc.create_training_client_from_state(saved.path)
    restored_client = resolved(made)
    assert restored_client.get_info().lora_rank == 8
    from_state = logprobs_of(restored_client.forward(sft, "cross_entropy").result())[0]
    np.testing.assert_array_equal(from_state, after_save)
    # A new model's optimizer is fresh too: its first step equals load_state's.
    restored_client.forward_backward(sft, "cross_entropy").result()
    restored_client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    np.testing.assert_array_equal(logprobs_of(restored_client.forward(sft, "cross_entropy").result())[0],
                                  fresh_step)
    # ... and one created with the optimizer (what the SDK now recommends over load_state*)
    # takes the saved run's own next step.
    with_optimizer = resolved(svc.create_training_client_from_state_with_optimizer(saved.path))
    with_optimizer.forward_backward(sft, "cross_entropy").result()
    with_optimizer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    np.testing.assert_array_equal(logprobs_of(with_optimizer.forward(sft, "cross_entropy").result())[0], moved)


def test_unknown_loss_fails_the_future_as_a_user_error(tinker_server: ServerProcess) -> None:
    svc = service(tinker_server, KEYS["alice"])
    training = lora_client(svc, rank=4)
    with pytest.raises(tinker.RequestFailedError) as err:
        training.forward_backward([datum(SEQ)], "not_a_loss").result()  # type: ignore[arg-type]
    assert err.value.category == types.RequestErrorCategory.User
    # The model keeps working after a failed op (its seq_id was consumed).
    assert training.forward_backward([datum(SEQ)], "cross_entropy").result().metrics["loss:sum"] > 0


# ---- sampling ------------------------------------------------------------------------------------

def test_sampling_snapshot_seed_stop_and_compute_logprobs(tinker_server: ServerProcess) -> None:
    svc = service(tinker_server, KEYS["alice"])
    training = lora_client(svc, rank=8)
    training.forward_backward([datum(SEQ)], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()

    sampler = resolved(training.save_weights_and_get_sampling_client())
    prompt = types.ModelInput.from_ints(SEQ[:4])
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    first = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    assert len(first.sequences) == 3
    for seq in first.sequences:
        assert 1 <= len(seq.tokens) <= 6
        assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
        assert all(lp <= 0 for lp in seq.logprobs)
        assert seq.stop_reason in ("stop", "length")
        if len(seq.tokens) < 6:
            assert seq.stop_reason == "stop"
    again = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in first.sequences]

    # A stop token ends the sequence and is its last token.
    stop_token = first.sequences[0].tokens[0]
    stopped = sampler.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(
        max_tokens=6, temperature=1.0, seed=7, stop=[stop_token])).result()
    assert stopped.sequences[0].tokens == [stop_token]
    assert stopped.sequences[0].stop_reason == "stop"

    # compute_logprobs equals the training forward on the same tokens.
    tokens = SEQ[:6]
    prompt_lp = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert len(prompt_lp) == len(tokens) and prompt_lp[0] is None
    fwd = logprobs_of(training.forward([datum(tokens)], "cross_entropy").result())[0]
    np.testing.assert_allclose(np.asarray(prompt_lp[1:], dtype=np.float64), fwd, atol=1e-5, rtol=0)

    # A named sampler checkpoint, sampled through create_sampling_client(model_path=...).
    path = training.save_weights_for_sampler("s1").result().path
    assert path.endswith("/sampler_weights/s1")
    by_path = svc.create_sampling_client(model_path=path)
    by_path = resolved(by_path)
    lp_by_path = by_path.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    np.testing.assert_allclose(np.asarray(lp_by_path[1:], dtype=np.float64), fwd, atol=1e-5, rtol=0)


def test_rl_loop_importance_sampling(tinker_server: ServerProcess) -> None:
    svc = service(tinker_server, KEYS["alice"])
    training = lora_client(svc, rank=8)
    prompt = SEQ[:4]
    for iteration in range(3):
        sampler = resolved(training.save_weights_and_get_sampling_client())
        result = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=4,
                                sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0,
                                                                     seed=100 + iteration)).result()
        rewards = np.asarray([float(sum(t % 2 == 0 for t in s.tokens)) for s in result.sequences])
        if np.all(rewards == rewards[0]):
            advantages = np.asarray([1.0, -1.0, 0.5, -0.5])
        else:
            advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-8)
        data = []
        for seq, adv in zip(result.sequences, advantages):
            full = prompt + list(seq.tokens)
            n_prompt = len(prompt) - 1
            lps = [0.0] * n_prompt + list(seq.logprobs)
            advs = [0.0] * n_prompt + [float(adv)] * len(seq.tokens)
            data.append(rl_datum(full, lps, advs))
        out = training.forward_backward(data, "importance_sampling").result()
        for d, seq, lp in zip(data, result.sequences, logprobs_of(out)):
            sampled = np.asarray(seq.logprobs)
            # On-policy: the trainer's log-probs of the sampled tokens are the sampler's.
            np.testing.assert_allclose(lp[len(prompt) - 1:], sampled, atol=1e-4, rtol=0)
        total_adv = sum(float(a) * len(s.tokens) for s, a in zip(result.sequences, advantages))
        assert out.metrics["loss:sum"] == pytest.approx(-total_adv, abs=1e-3)
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()


# ---- tenants, REST, errors -----------------------------------------------------------------------

def test_two_tenants_see_only_their_own_runs(tinker_server: ServerProcess) -> None:
    alice_svc, bob_svc = service(tinker_server, KEYS["alice"]), service(tinker_server, KEYS["bob"])
    alice, bob = lora_client(alice_svc, rank=4), lora_client(bob_svc, rank=4)
    # Interleaved: both tenants' ops are queued before either result is read.
    futures = [alice.forward_backward([datum(SEQ)], "cross_entropy"),
               bob.forward_backward([datum(SEQ[::-1])], "cross_entropy")]
    for f in futures:
        assert f.result().metrics["loss:sum"] > 0
    futures = [alice.optim_step(types.AdamParams(learning_rate=1e-3)),
               bob.optim_step(types.AdamParams(learning_rate=1e-3))]
    for f in futures:
        f.result()
    alice_path = alice.save_state("a1").result().path
    bob.save_state("b1").result()
    alice_id, bob_id = alice.get_info().model_id, bob.get_info().model_id

    alice_rest, bob_rest = alice_svc.create_rest_client(), bob_svc.create_rest_client()
    alice_runs = [r.training_run_id for r in alice_rest.list_training_runs().result().training_runs]
    bob_runs = [r.training_run_id for r in bob_rest.list_training_runs().result().training_runs]
    assert alice_id in alice_runs and bob_id not in alice_runs
    assert bob_id in bob_runs and alice_id not in bob_runs
    checkpoints = alice_rest.list_checkpoints(alice_id).result().checkpoints
    assert [c.checkpoint_id for c in checkpoints] == ["weights/a1"]
    assert checkpoints[0].tinker_path == alice_path
    assert checkpoints[0].checkpoint_type == "training"
    assert alice_rest.get_training_run(alice_id).result().lora_rank == 4

    with pytest.raises(tinker.NotFoundError):
        bob_rest.list_checkpoints(alice_id).result()
    with pytest.raises(tinker.NotFoundError):
        bob_rest.get_training_run(alice_id).result()
    # Bob cannot load Alice's checkpoint: it is not found in his tenant.
    with pytest.raises((tinker.NotFoundError, tinker.RequestFailedError)):
        bob.load_state(alice_path).result()

    # Deleting through the SDK (the checkpoint id holds a slash).
    alice_rest.delete_checkpoint_from_tinker_path(alice_path).result()
    assert alice_rest.list_checkpoints(alice_id).result().checkpoints == []


def test_error_paths(tinker_server: ServerProcess) -> None:
    bad = service(tinker_server, "tml-not-a-valid-key-000000000000")
    with pytest.raises(tinker.AuthenticationError):
        lora_client(bad, rank=4)

    svc = service(tinker_server, KEYS["alice"])
    with pytest.raises(tinker.BadRequestError):
        made = svc.create_lora_training_client(base_model="no-such-model", rank=4)
        resolved(made)
    with pytest.raises(tinker.BadRequestError):
        made = svc.create_lora_training_client(base_model=MODEL_NAME, rank=4096)
        resolved(made)

    training = lora_client(svc, rank=4)
    with pytest.raises(tinker.RequestFailedError) as err:
        training.forward_backward([datum([1, 2, 10**7, 3])], "cross_entropy").result()
    assert err.value.category == types.RequestErrorCategory.User
    assert "token id" in str(err.value)


# ---- the wire schema ---------------------------------------------------------------------------

def _our_descriptor(repo_root: Path) -> Any:
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc
    import importlib.resources
    out = repo_root / "build-descriptor.tmp"
    include = str(importlib.resources.files("grpc_tools") / "_proto")
    rc = protoc.main(["protoc", f"-I{repo_root / 'proto'}", f"-I{include}", f"--descriptor_set_out={out}",
                      "tinker/v1/tinker_public.proto"])
    assert rc == 0
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    out.unlink()
    return fds.file[0]


def _shape(file: Any) -> dict[str, Any]:
    """Every message, field and enum of a FileDescriptorProto, package names stripped."""
    package = "." + file.package + "."

    def strip(type_name: str) -> str:
        assert type_name.startswith(package), type_name
        return type_name[len(package):]

    def message(m: Any, prefix: str, out: dict[str, Any]) -> None:
        name = prefix + m.name
        oneofs = [o.name for o in m.oneof_decl]
        out[name] = sorted(
            (f.number, f.name, f.type, f.label, strip(f.type_name) if f.type_name else "", f.proto3_optional,
             oneofs[f.oneof_index] if f.HasField("oneof_index") else "")
            for f in m.field) + [("map_entry", m.options.map_entry)]
        for n in m.nested_type:
            message(n, name + ".", out)
        for e in m.enum_type:
            out[name + "." + e.name] = sorted((v.number, v.name) for v in e.value)

    out: dict[str, Any] = {}
    for m in file.message_type:
        message(m, "", out)
    for e in file.enum_type:
        out[e.name] = sorted((v.number, v.name) for v in e.value)
    return out


def test_wire_schema_matches_the_pinned_sdk(repo_root: Path) -> None:
    from google.protobuf import descriptor_pb2
    from tinker.proto import tinker_public_pb2
    sdk = descriptor_pb2.FileDescriptorProto()
    tinker_public_pb2.DESCRIPTOR.CopyToProto(sdk)
    ours, theirs = _shape(_our_descriptor(repo_root)), _shape(sdk)
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert ours[name] == theirs[name], name


# ---- gRPC: tinker.v1.TinkerService through generated stubs --------------------------------------

def grpc_result(stub: Any, md: list[tuple[str, str]], request_id: str) -> Any:
    """TinkerService/RetrieveFuture until the future is done: its result (an error fails the test)."""
    from twinkle_client._proto.tinker.v1 import tinker_service_pb2 as ts
    while True:
        r = stub.RetrieveFuture(ts.RetrieveFutureRequest(request_id=request_id), metadata=md, timeout=60)
        kind = r.WhichOneof("result")
        if kind != "try_again":
            assert kind != "error", r.error
            return getattr(r, kind)


def test_grpc_tinker_service_training_sequence(tinker_server: ServerProcess) -> None:
    import grpc
    from twinkle_client._proto.tinker.v1 import tinker_public_pb2 as tp
    from twinkle_client._proto.tinker.v1 import tinker_service_pb2 as ts
    from twinkle_client._proto.tinker.v1 import tinker_service_pb2_grpc as tsg

    channel = grpc.insecure_channel(tinker_server.grpc_address)
    stub = tsg.TinkerServiceStub(channel)
    md = [("x-api-key", KEYS["alice"])]

    def wait(request_id: str) -> Any:
        return grpc_result(stub, md, request_id)

    session = stub.CreateSession(ts.CreateSessionRequest(), metadata=md).session_id
    promise = stub.CreateModel(ts.CreateModelRequest(session_id=session, model_seq_id=0, base_model=MODEL_NAME,
                                                     lora_config=ts.LoraConfig(rank=8)), metadata=md)
    model_id = wait(promise.request_id).model_id
    assert stub.GetInfo(ts.ModelRequest(model_id=model_id), metadata=md).lora_rank == 8

    seq_id = 0

    def fwdbwd(loss: str, forward_only: bool = False, config: dict[str, float] | None = None,
               extra: dict[str, list[float]] | None = None) -> tuple[np.ndarray, dict[str, float]]:
        nonlocal seq_id
        seq_id += 1
        inputs = {"target_tokens": tp.Tensor(dense=np.asarray(SEQ[1:], np.int64).tobytes(), dtype=tp.DTYPE_INT64,
                                             shape=[len(SEQ) - 1])}
        for name, values in (extra or {}).items():
            inputs[name] = tp.Tensor(dense=np.asarray(values, np.float32).tobytes(), dtype=tp.DTYPE_FLOAT32,
                                     shape=[len(values)])
        d = tp.Datum(model_input=[tp.Chunk(encoded_text=tp.EncodedTextChunk(
            tokens=np.asarray(SEQ[:-1], np.int32).tobytes()))], loss_fn_inputs=inputs)
        req = tp.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, data=[d], loss_fn=loss,
                                        loss_fn_config=config or {}, forward_only=forward_only)
        out = wait(stub.ForwardBackward(req, metadata=md).request_id)
        record = out.loss_fn_outputs[0]
        assert record.num_datums == 1
        lp = np.frombuffer(record.fields["logprobs"].data, dtype=np.float32).astype(np.float64)
        return lp, dict(out.metrics)

    def optim(lr: float) -> None:
        nonlocal seq_id
        seq_id += 1
        wait(stub.OptimStep(ts.OptimStepRequest(model_id=model_id, seq_id=seq_id,
                                                adam_params=ts.AdamParams(learning_rate=lr)), metadata=md).request_id)

    lp, metrics = fwdbwd("cross_entropy")
    assert metrics["loss:sum"] == pytest.approx(-lp.sum(), rel=1e-4)
    fwd, _ = fwdbwd("cross_entropy", forward_only=True)
    np.testing.assert_allclose(fwd, lp, atol=1e-5, rtol=0)
    rl = {"logprobs": [float(v) for v in lp], "advantages": [1.0] * len(lp)}
    for loss, config in (("importance_sampling", None), ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
                         ("cispo", None), ("dro", {"beta": 0.05})):
        _, m = fwdbwd(loss, config=config, extra=rl)
        assert math.isfinite(m["loss:sum"])
    optim(1e-3)
    seq_id += 1
    saved = wait(stub.SaveWeights(ts.SaveWeightsRequest(model_id=model_id, seq_id=seq_id, path="g1"),
                                  metadata=md).request_id).path
    assert saved == f"tinker://{model_id}/weights/g1"
    after_save, _ = fwdbwd("cross_entropy", forward_only=True)
    fwdbwd("cross_entropy")
    optim(1e-2)
    moved, _ = fwdbwd("cross_entropy", forward_only=True)
    assert np.max(np.abs(moved - after_save)) > 1e-4
    seq_id += 1
    wait(stub.LoadWeights(ts.LoadWeightsRequest(model_id=model_id, seq_id=seq_id, path=saved), metadata=md).request_id)
    restored, _ = fwdbwd("cross_entropy", forward_only=True)
    np.testing.assert_array_equal(restored, after_save)

    runs = stub.ListTrainingRuns(ts.ListTrainingRunsRequest(), metadata=md).training_runs
    assert model_id in [r.training_run_id for r in runs]
    with pytest.raises(grpc.RpcError) as err:
        stub.GetInfo(ts.ModelRequest(model_id=model_id), metadata=[("x-api-key", KEYS["bob"])])
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_grpc_tinker_service_answers_as_the_http_api(tinker_server: ServerProcess) -> None:
    """The TinkerService calls the training sequence above does not reach, each compared with
    what the SDK reads over HTTP for the same object: capabilities, heartbeats, weights info,
    the run and checkpoint listings, sampler saves (named, and a snapshot sampled with a seed
    over both transports), checkpoint deletion and unload; and bad requests are
    INVALID_ARGUMENT naming the field."""
    import json
    import urllib.request
    from datetime import datetime

    import grpc
    from twinkle_client._proto.tinker.v1 import tinker_public_pb2 as tp
    from twinkle_client._proto.tinker.v1 import tinker_service_pb2 as ts
    from twinkle_client._proto.tinker.v1 import tinker_service_pb2_grpc as tsg

    stub = tsg.TinkerServiceStub(grpc.insecure_channel(tinker_server.grpc_address))
    md = [("x-api-key", KEYS["alice"])]
    svc = service(tinker_server, KEYS["alice"])
    rest = svc.create_rest_client()

    def wait(request_id: str) -> Any:
        return grpc_result(stub, md, request_id)

    def invalid(call: Any, request: Any, field: str) -> None:
        with pytest.raises(grpc.RpcError) as err:
            call(request, metadata=md)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert err.value.details().startswith(f"{field}:"), err.value.details()

    def when(text: str) -> datetime:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))

    # Capabilities.
    caps = stub.GetServerCapabilities(ts.GetServerCapabilitiesRequest(), metadata=md).supported_models
    sdk_caps = rest.get_server_capabilities().result().supported_models
    assert [(m.model_name, m.trainable, m.sampleable) for m in caps] == \
        [(m.model_name, m.trainable, m.sampleable) for m in sdk_caps]
    assert [m.max_context_length for m in caps] == [m.max_context_length or 0 for m in sdk_caps]

    # A model trained through the SDK, with one switch off so that weights info says something.
    training = resolved(svc.create_lora_training_client(base_model=MODEL_NAME, rank=4, train_unembed=False))
    training.forward_backward([datum(SEQ)], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    path = training.save_state("w1").result().path
    model_id = training.get_info().model_id

    info = stub.WeightsInfo(ts.WeightsInfoRequest(tinker_path=path), metadata=md)
    sdk_info = rest.get_weights_info_by_tinker_path(path).result()
    assert (info.base_model, info.is_lora, info.lora_rank, info.train_unembed, info.train_mlp, info.train_attn) == \
        (sdk_info.base_model, sdk_info.is_lora, sdk_info.lora_rank, sdk_info.train_unembed, sdk_info.train_mlp,
         sdk_info.train_attn) == (MODEL_NAME, True, 4, False, True, True)

    # A sampler checkpoint saved over gRPC (seq_id 0: outside the SDK's order), its op result
    # read over gRPC.
    saved = wait(stub.SaveWeightsForSampler(ts.SaveWeightsForSamplerRequest(model_id=model_id, seq_id=0, path="s1"),
                                            metadata=md).request_id)
    assert saved.path == f"tinker://{model_id}/sampler_weights/s1"

    listed = stub.ListTrainingRuns(ts.ListTrainingRunsRequest(), metadata=md).training_runs
    runs = {r.training_run_id: r for r in listed}
    sdk_run = rest.get_training_run(model_id).result()
    run = runs[model_id]
    assert (run.base_model, run.model_owner, run.is_lora, run.lora_rank) == \
        (sdk_run.base_model, sdk_run.model_owner, sdk_run.is_lora, sdk_run.lora_rank)
    assert (run.base_model, run.is_lora, run.lora_rank) == (MODEL_NAME, True, 4)
    assert when(run.last_request_time) == sdk_run.last_request_time

    checkpoints = stub.ListCheckpoints(ts.ListCheckpointsRequest(training_run_id=model_id), metadata=md).checkpoints
    sdk_checkpoints = rest.list_checkpoints(model_id).result().checkpoints
    assert [(c.checkpoint_id, c.checkpoint_type, c.tinker_path, c.size_bytes) for c in checkpoints] == \
        [(c.checkpoint_id, c.checkpoint_type, c.tinker_path, c.size_bytes) for c in sdk_checkpoints]
    assert [when(c.time) for c in checkpoints] == [c.time for c in sdk_checkpoints]
    assert {c.checkpoint_id: c.checkpoint_type for c in checkpoints} == \
        {"weights/w1": "training", "sampler_weights/s1": "sampler"}
    assert all(c.size_bytes > 0 for c in checkpoints)

    stub.DeleteCheckpoint(ts.DeleteCheckpointRequest(training_run_id=model_id, checkpoint_id="weights/w1"), metadata=md)
    assert [c.checkpoint_id for c in rest.list_checkpoints(model_id).result().checkpoints] == ["sampler_weights/s1"]

    # An unnamed sampler save (a snapshot and a sampling session on it) and a seeded Sample on
    # it over gRPC; the same request over the HTTP API samples the same tokens.
    snapshot = wait(stub.SaveWeightsForSampler(ts.SaveWeightsForSamplerRequest(model_id=model_id, seq_id=0),
                                               metadata=md).request_id).sampling_session_id
    assert snapshot
    prompt = SEQ[:4]
    grpc_sample = wait(stub.Sample(ts.SampleRequest(
        sampling_session_id=snapshot, seq_id=1, prompt=prompt, num_samples=2,
        sampling_params=tp.SamplingParams(max_tokens=5, seed=7, temperature=1.0)), metadata=md).request_id)
    grpc_tokens = [np.frombuffer(q.tokens, dtype=np.int32).tolist() for q in grpc_sample.sequences]
    assert len(grpc_tokens) == 2 and all(1 <= len(t) <= 5 for t in grpc_tokens)

    def http(route: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(f"http://{tinker_server.host}:{tinker_server.http_port}/api/v1/{route}",
                                         data=json.dumps(body).encode(), method="POST",
                                         headers={"x-api-key": KEYS["alice"], "content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.loads(answer.read())

    promise = http("asample", {"sampling_session_id": snapshot, "seq_id": 2, "num_samples": 2,
                               "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
                               "sampling_params": {"max_tokens": 5, "seed": 7, "temperature": 1.0}})
    while (answer := http("retrieve_future", {"request_id": promise["request_id"]})).get("type") == "try_again":
        pass
    assert [q["tokens"] for q in answer["sequences"]] == grpc_tokens

    # Sessions: a gRPC session heartbeats; an unknown one is NOT_FOUND.
    session = stub.CreateSession(ts.CreateSessionRequest(tags=["grpc"]), metadata=md).session_id
    stub.SessionHeartbeat(ts.SessionHeartbeatRequest(session_id=session), metadata=md)
    with pytest.raises(grpc.RpcError) as err:
        stub.SessionHeartbeat(ts.SessionHeartbeatRequest(session_id="no-such-session"), metadata=md)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND

    # Bad requests name the field, as the HTTP API does.
    invalid(stub.SessionHeartbeat, ts.SessionHeartbeatRequest(), "session_id")
    invalid(stub.CreateModel, ts.CreateModelRequest(session_id=session, base_model="no-such-model"), "base_model")
    invalid(stub.CreateModel, ts.CreateModelRequest(session_id=session, base_model=MODEL_NAME,
                                                    lora_config=ts.LoraConfig(rank=4096)), "lora_config.rank")
    invalid(stub.SaveWeights, ts.SaveWeightsRequest(model_id=model_id, seq_id=0), "path")
    invalid(stub.WeightsInfo, ts.WeightsInfoRequest(), "tinker_path")
    invalid(stub.OptimStep, ts.OptimStepRequest(model_id=model_id, seq_id=0,
                                                adam_params=ts.AdamParams(learning_rate=float("nan"))), "learning_rate")

    # Unload: the op result names the model, which is then gone.
    unloaded = wait(stub.UnloadModel(ts.ModelRequest(model_id=model_id), metadata=md).request_id)
    assert unloaded.model_id == model_id
    with pytest.raises(grpc.RpcError) as err:
        stub.GetInfo(ts.ModelRequest(model_id=model_id), metadata=md)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
