"""Checkpoints through the real server: PEFT loads what we save, tenants cannot reach each
other's checkpoints, resume after kill -9 equals an uninterrupted run, injected I/O faults
and crashes during saves never leave a broken checkpoint, names cannot escape the tenant."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import requests
import torch
from twinkle_client._proto.twinkle.v1 import training_pb2 as tpb
from twinkle_client._proto.twinkle.v1 import utility_pb2 as upb

from e2e_support import prom
from e2e_support.server import ServerProcess
from e2e_support.training import KEYS, Client, auth_overrides, batch, state_dict

LaunchServer = Callable[..., ServerProcess]
CRASH_ROUNDS = int(os.environ.get("TWINKLE_CRASH_ROUNDS", "50"))


def vocab(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def add(client: Client, name: str, rank: int = 4, seed: int = 7) -> tpb.AddAdapterResponse:
    return client.call("AddAdapter", tpb.AddAdapterRequest(
        adapter_name=name, config=tpb.LoraConfig(r=rank, lora_alpha=32, seed=seed)))


def train_step(client: Client, name: str, data: list[tpb.InputFeature]) -> float:
    loss = client.call("ForwardBackward", tpb.ForwardRequest(adapter_name=name, inputs=data)).result.loss
    client.call("ClipGradAndStep", tpb.ClipGradNormRequest(adapter_name=name, max_grad_norm=1.0))
    return loss


def save(client: Client, name: str, checkpoint: str, optimizer: bool = True) -> tpb.SaveResponse:
    return client.call("Save", tpb.SaveRequest(adapter_name=name, name=checkpoint, save_optimizer=optimizer))


def expect_code(code: grpc.StatusCode, fn: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert info.value.code() == code, f"{info.value.code()}: {info.value.details()}"
    return info.value


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def kill_server(server: ServerProcess) -> None:
    """kill -9 of the whole server: coordinator and engine workers."""
    workers = server.engine_workers()
    server.send_signal(signal.SIGKILL)
    for w in workers:
        try:
            w.kill()
        except Exception:  # noqa: BLE001 - already gone
            pass
    server.wait_exit(30)
    server.kill_leftovers()


def data_for(step: int, n_vocab: int) -> list[tpb.InputFeature]:
    return batch(1000 + step, n_vocab)


# ---- PEFT compatibility ------------------------------------------------------------------------

def test_peft_loads_our_checkpoint_and_matches_our_logprobs(launch_server: LaunchServer, tiny_model: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    server = launch_server()
    c = Client(server.grpc_address, None)
    n_vocab = vocab(tiny_model)
    c.call("AddAdapter", tpb.AddAdapterRequest(adapter_name="p", config=tpb.LoraConfig(
        r=8, lora_alpha=16, seed=3, target_modules=["all-linear", "lm_head"])))
    c.call("SetOptimizer", tpb.SetOptimizerRequest(adapter_name="p", optimizer_cls="AdamW", config={"lr": 5e-2}))
    for step in range(4):
        train_step(c, "p", data_for(step, n_vocab))
    saved = save(c, "p", "peft-check")
    assert saved.twinkle_path.endswith("/weights/peft-check")
    ckpt = Path(saved.checkpoint_dir)
    assert {"adapter_model.safetensors", "adapter_config.json", "trainer_state.json", "optimizer.safetensors",
            "optimizer.json", "checkpoint_metadata.json"} <= {p.name for p in ckpt.iterdir()}
    probe = batch(77, n_vocab, sequences=3)
    ours = c.call("ForwardOnly", tpb.ForwardRequest(adapter_name="p", inputs=probe)).result
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model), torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(ckpt)).eval()
    worst = 0.0
    for f, seq in zip(probe, ours.sequences):
        ids = torch.tensor([list(f.input_ids)])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
        targets = torch.tensor(list(f.labels[1:]))
        targets = torch.where(targets == -100, ids[0, 1:], targets)
        ref = logp[:-1].gather(1, targets[:, None])[:, 0].numpy()
        got = np.asarray(seq.logps[:-1], dtype=np.float64)
        worst = max(worst, float(np.max(np.abs(got - ref))))
    print(f"PEFT-loaded checkpoint vs our log-probs: max |diff| = {worst:.3e}")
    assert worst <= 1e-4
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and "lm_head" in config["target_modules"]


# ---- isolation ---------------------------------------------------------------------------------

def test_another_tenants_checkpoint_is_not_found(launch_server: LaunchServer, tmp_path: Path,
                                                 tiny_model: Path) -> None:
    data_dir = tmp_path / "data"
    server = launch_server(auth_overrides(storage={"data_dir": str(data_dir)}))
    alice, bob = Client(server.grpc_address, KEYS["alice"]), Client(server.grpc_address, KEYS["bob"])
    run = add(alice, "a").run_id
    train_step(alice, "a", data_for(0, vocab(tiny_model)))
    path = save(alice, "a", "secret").twinkle_path
    add(bob, "b")
    before = tree_digest(data_dir / "tenants" / "alice")
    for label, call in [
        ("load", lambda: bob.call("Load", tpb.LoadRequest(adapter_name="b", name=path))),
        ("resume", lambda: bob.call("ResumeFromCheckpoint", tpb.LoadRequest(adapter_name="b", name=path))),
        ("list", lambda: bob.utility.ListCheckpoints(upb.ListCheckpointsRequest(run_id=run), metadata=bob.metadata,
                                                      timeout=10)),
        ("delete", lambda: bob.utility.DeleteCheckpoint(upb.DeleteCheckpointRequest(
            run_id=run, checkpoint_id="weights/secret"), metadata=bob.metadata, timeout=10)),
        ("get run", lambda: bob.utility.GetTrainingRun(upb.GetTrainingRunRequest(run_id=run), metadata=bob.metadata,
                                                        timeout=10)),
    ]:
        error = expect_code(grpc.StatusCode.NOT_FOUND, call)
        print(f"bob {label} of alice's checkpoint: NOT_FOUND ({error.details()})")
    assert tree_digest(data_dir / "tenants" / "alice") == before
    assert not (data_dir / "tenants" / "bob" / "runs" / run).exists()
    # Alice still can.
    alice.call("Load", tpb.LoadRequest(adapter_name="a", name=path))
    listed = alice.utility.ListCheckpoints(upb.ListCheckpointsRequest(run_id=run), metadata=alice.metadata, timeout=10)
    assert [c.checkpoint_id for c in listed.checkpoints] == ["weights/secret"]


# ---- resume after kill -9 ------------------------------------------------------------------------

def test_resume_after_kill_equals_uninterrupted_training(launch_server: LaunchServer, tmp_path: Path,
                                                         tiny_model: Path) -> None:
    overrides = {"storage": {"data_dir": str(tmp_path / "data")}}
    n_vocab = vocab(tiny_model)

    def setup(c: Client, name: str) -> None:
        c.call("AddAdapter", tpb.AddAdapterRequest(adapter_name=name, config=tpb.LoraConfig(
            r=4, lora_alpha=32, seed=5, lora_dropout=0.1)))
        c.call("SetOptimizer", tpb.SetOptimizerRequest(adapter_name=name, optimizer_cls="AdamW", config={"lr": 1e-2}))
        c.call("SetLrScheduler", tpb.SetLrSchedulerRequest(
            adapter_name=name, scheduler_cls="CosineWarmupScheduler",
            config={"num_warmup_steps": 2, "num_training_steps": 10}))

    server = launch_server(overrides)
    c = Client(server.grpc_address, None)
    setup(c, "straight")
    straight = [train_step(c, "straight", data_for(s, n_vocab)) for s in range(10)]
    want = state_dict(c, "straight")

    setup(c, "crashy")
    losses = [train_step(c, "crashy", data_for(s, n_vocab)) for s in range(5)]
    path = c.call("Save", tpb.SaveRequest(adapter_name="crashy", name="step5", save_optimizer=True,
                                          consumed_train_samples=10)).twinkle_path
    for s in range(5, 8):
        train_step(c, "crashy", data_for(s, n_vocab))
    kill_server(server)

    server = launch_server(overrides)
    c = Client(server.grpc_address, None)
    for mode, only_model in (("full", False), ("weights-only", True)):
        name = f"resumed-{mode}"
        setup(c, name)
        r = c.call("ResumeFromCheckpoint", tpb.LoadRequest(adapter_name=name, name=path, resume_only_model=only_model))
        if not only_model:
            assert (r.cur_step, r.consumed_train_samples, r.gradient_accumulation_steps) == (5, 10, 1)
        resumed = [train_step(c, name, data_for(s, n_vocab)) for s in range(5, 10)]
        got = state_dict(c, name)
        worst = max(float(np.max(np.abs(got[k] - want[k]))) for k in want)
        loss_diff = max(abs(a - b) for a, b in zip(losses + resumed, straight))
        print(f"resume ({mode}) vs uninterrupted: max |Δw| = {worst:.3e}, max |Δloss| = {loss_diff:.3e}")
        if only_model:
            assert worst > 1e-4, "a weights-only resume should differ (fresh optimizer and schedule)"
        else:
            assert worst <= 1e-6 and loss_diff <= 1e-6


def retry_while_restarting(fn: Callable[[], Any], seconds: float = 60) -> Any:
    """Calls fn until the engine worker is back: UNAVAILABLE is the retryable restart error."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return fn()
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_engine_crash_restores_every_tenants_adapters(launch_server: LaunchServer, tiny_model: Path) -> None:
    """kill -9 of the engine worker while two tenants train: each adapter comes back at its last
    optimizer step (training then equals an uninterrupted run), and gradients accumulated
    since that step are reported lost at the next step instead of being dropped silently."""
    server = launch_server(auth_overrides(engine={"restart_backoff_initial_ms": 200}))
    alice, bob = Client(server.grpc_address, KEYS["alice"]), Client(server.grpc_address, KEYS["bob"])
    n_vocab = vocab(tiny_model)
    # The uninterrupted references, trained first on the same server.
    add(alice, "a-ref", seed=7)
    add(bob, "b-ref", seed=11)
    ref_losses = [train_step(alice, "a-ref", data_for(s, n_vocab)) for s in range(6)]
    for s in range(3):
        train_step(bob, "b-ref", data_for(100 + s, n_vocab))
    want_a, want_b = state_dict(alice, "a-ref"), state_dict(bob, "b-ref")
    alice.call("RemoveAdapter", tpb.AdapterRequest(adapter_name="a-ref"))
    bob.call("RemoveAdapter", tpb.AdapterRequest(adapter_name="b-ref"))

    add(alice, "a", seed=7)
    add(bob, "b", seed=11)
    losses = [train_step(alice, "a", data_for(s, n_vocab)) for s in range(3)]
    for s in range(2):
        train_step(bob, "b", data_for(100 + s, n_vocab))
    # Bob's third step is half done: its forward_backward ran, its optimizer step has not.
    bob.call("ForwardBackward", tpb.ForwardRequest(adapter_name="b", inputs=data_for(102, n_vocab)))

    server.engine_workers()[0].kill()
    losses += [retry_while_restarting(lambda s=s: train_step(alice, "a", data_for(s, n_vocab))) for s in range(3, 6)]
    got_a = state_dict(alice, "a")
    worst_a = max(float(np.max(np.abs(got_a[k] - want_a[k]))) for k in want_a)
    loss_diff = max(abs(x - y) for x, y in zip(losses, ref_losses))
    print(f"alice after the restart vs uninterrupted: max |dw| = {worst_a:.3e}, max |dloss| = {loss_diff:.3e}")
    assert worst_a <= 1e-6 and loss_diff <= 1e-6

    lost = expect_code(grpc.StatusCode.ABORTED, lambda: retry_while_restarting(
        lambda: bob.call("ClipGradAndStep", tpb.ClipGradNormRequest(adapter_name="b", max_grad_norm=1.0))))
    print(f"bob's step after the restart: {lost.details()}")
    assert "gradients of 1 forward_backward call(s) since optimizer step 2 were lost" in lost.details()
    train_step(bob, "b", data_for(102, n_vocab))  # the step again, whole
    got_b = state_dict(bob, "b")
    worst_b = max(float(np.max(np.abs(got_b[k] - want_b[k]))) for k in want_b)
    print(f"bob after redoing the step vs uninterrupted: max |dw| = {worst_b:.3e}")
    assert worst_b <= 1e-6

    samples = prom.parse(requests.get(server.http_url("/metrics"), timeout=10).text)
    assert prom.value(samples, "twinkle_adapter_events_total", event="restore") == 2
    assert prom.value(samples, "twinkle_worker_restarts_total", pool="training", rank="0") == 1


def test_engine_crash_without_restore_points_reports_lost_state_then_resume_works(
        launch_server: LaunchServer, tiny_model: Path) -> None:
    server = launch_server({"engine": {"adapter_restore_points": False}})
    c = Client(server.grpc_address, None)
    n_vocab = vocab(tiny_model)
    add(c, "w")
    for s in range(3):
        train_step(c, "w", data_for(s, n_vocab))
    path = save(c, "w", "before-crash").twinkle_path
    train_step(c, "w", data_for(3, n_vocab))
    worker = server.engine_workers()[0]
    worker.kill()
    deadline = time.monotonic() + 60
    error = None
    while time.monotonic() < deadline:
        try:
            c.call("ForwardBackward", tpb.ForwardRequest(adapter_name="w", inputs=data_for(4, n_vocab)))
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:  # the worker is still restarting
                time.sleep(0.2)
                continue
            error = e
            break
        pytest.fail("training continued after the engine lost the adapter's state")
    assert error is not None and error.code() == grpc.StatusCode.ABORTED, error
    print(f"after kill -9 of the engine: {error.details()}")
    assert "adapter state lost since step 4" in error.details() and "resume from checkpoint" in error.details()
    r = c.call("ResumeFromCheckpoint", tpb.LoadRequest(adapter_name="w", name=path))
    assert r.cur_step == 3
    train_step(c, "w", data_for(3, n_vocab))


# ---- futures across restarts -------------------------------------------------------------------

def test_futures_survive_a_restart(launch_server: LaunchServer, tmp_path: Path, tiny_model: Path) -> None:
    overrides = {"storage": {"data_dir": str(tmp_path / "data")}, "testing": {"hooks": True}}
    server = launch_server(overrides)
    c = Client(server.grpc_address, None)
    add(c, "f")
    later = tpb.RequestOptions(return_future=True)
    done_id = c.call("ForwardOnly", tpb.ForwardRequest(adapter_name="f", inputs=data_for(0, vocab(tiny_model)),
                                                       options=later)).future_id
    before = c.call("WaitFuture", tpb.WaitFutureRequest(future_id=done_id, timeout_ms=30000))
    assert before.done
    c.call("PauseScheduler", tpb.Empty())
    stuck_id = c.call("Step", tpb.AdapterRequest(adapter_name="f", options=later)).future_id
    time.sleep(1.0)  # the journal writes in the background
    kill_server(server)
    server = launch_server(overrides)
    c = Client(server.grpc_address, None)
    after = c.call("WaitFuture", tpb.WaitFutureRequest(future_id=done_id))
    assert after.done and [list(s.logps) for s in after.forward.result.sequences] == \
        [list(s.logps) for s in before.forward.result.sequences]
    error = expect_code(grpc.StatusCode.ABORTED, lambda: c.call("WaitFuture", tpb.WaitFutureRequest(future_id=stuck_id)))
    print(f"a future in flight at the crash: {error.details()}")
    assert "interrupted by a restart" in error.details()


# ---- I/O faults ----------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["open", "write", "fsync", "rename"])
@pytest.mark.parametrize("errno_name", ["ENOSPC", "EIO"])
def test_injected_write_failure_keeps_the_old_checkpoint(launch_server: LaunchServer, tmp_path: Path,
                                                          tiny_model: Path, op: str, errno_name: str) -> None:
    data_dir = tmp_path / "data"
    server = launch_server(auth_overrides(storage={"data_dir": str(data_dir)}, testing={"hooks": True}))
    alice, bob = Client(server.grpc_address, KEYS["alice"]), Client(server.grpc_address, KEYS["bob"])
    n_vocab = vocab(tiny_model)
    add(alice, "a")
    add(bob, "b")
    train_step(alice, "a", data_for(0, n_vocab))
    good = save(alice, "a", "ckpt")
    before = tree_digest(Path(good.checkpoint_dir))
    train_step(alice, "a", data_for(1, n_vocab))
    alice.call("InjectFault", tpb.InjectFaultRequest(op=op, error=errno_name, nth=1))
    stop = threading.Event()
    bob_steps: list[float] = []

    def bob_trains() -> None:
        while not stop.is_set():
            bob_steps.append(train_step(bob, "b", data_for(len(bob_steps), n_vocab)))

    t = threading.Thread(target=bob_trains)
    t.start()
    try:
        error = expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED if errno_name == "ENOSPC" else grpc.StatusCode.INTERNAL,
                            lambda: save(alice, "a", "ckpt"))
    finally:
        time.sleep(0.3)
        stop.set()
        t.join()
    print(f"{op}/{errno_name}: {error.details()}")
    assert op in error.details() and ("No space left" in error.details() or "Input/output error" in error.details())
    assert tree_digest(Path(good.checkpoint_dir)) == before
    assert not [p for p in data_dir.rglob(".tmp-*")] and not [p for p in data_dir.rglob(".old-*")]
    assert len(bob_steps) > 0 and all(np.isfinite(bob_steps))
    alice.call("Load", tpb.LoadRequest(adapter_name="a", name=good.twinkle_path, load_optimizer=True))
    # The adapter is not stuck: the next save works.
    assert save(alice, "a", "ckpt").twinkle_path == good.twinkle_path


# ---- names -------------------------------------------------------------------------------------

def test_bad_checkpoint_names_are_refused_and_nothing_escapes(launch_server: LaunchServer, tmp_path: Path,
                                                              tiny_model: Path) -> None:
    data_dir = tmp_path / "data"
    server = launch_server({"storage": {"data_dir": str(data_dir)}})
    c = Client(server.grpc_address, None)
    add(c, "n")
    outside_before = {p for p in tmp_path.rglob("*") if not p.is_relative_to(data_dir)}
    for bad in ["../x", "a/b", "/abs", "x\0y", "x" * 300, "..", ".", ".hidden", "tab\tname", "new\nline"]:
        error = expect_code(grpc.StatusCode.INVALID_ARGUMENT, lambda: save(c, "n", bad))
        assert "name" in error.details()
        for path in [f"twinkle://{bad}/weights/x", f"twinkle://r/weights/{bad}", "twinkle://r/../x", "file:///etc/passwd"]:
            expect_code(grpc.StatusCode.INVALID_ARGUMENT, lambda: c.call("Load", tpb.LoadRequest(adapter_name="n", name=path)))
    print("refused: ../x, a/b, /abs, x\\0y, 300 chars, .., ., .hidden, control characters")
    outside_after = {p for p in tmp_path.rglob("*") if not p.is_relative_to(data_dir)}
    assert outside_after == outside_before
    tenant_root = data_dir / "tenants" / "default"
    for p in data_dir.rglob("*"):
        # Besides the tenant's files: the registry and the download URL signing key (docs/config.md).
        assert p.name == "registry.sqlite" or p.name.startswith("registry.sqlite-") or p == data_dir / "tenants" \
            or p == data_dir / "url_signing.key" or p.is_relative_to(tenant_root), p


# ---- crashes during saves ----------------------------------------------------------------------

def test_kill_during_saves_never_leaves_a_broken_checkpoint(launch_server: LaunchServer, tmp_path: Path,
                                                            tiny_model: Path) -> None:
    """Kill -9 of the engine or of the whole server at random moments while a client saves in a
    loop: every listed checkpoint loads and verifies, the last checkpoint known complete before
    the kill is intact, and no temp dir survives a restart. TWINKLE_CRASH_ROUNDS raises the count."""
    data_dir = tmp_path / "data"
    overrides = {"storage": {"data_dir": str(data_dir)}}
    n_vocab = vocab(tiny_model)
    rng = random.Random(1234)
    server = launch_server(overrides)
    known_good: list[str] = []
    kinds = {"engine": 0, "server": 0}
    for round_ in range(CRASH_ROUNDS):
        c = Client(server.grpc_address, None)
        name = f"k{round_}"
        add(c, name, rank=16)
        train_step(c, name, data_for(round_, n_vocab))
        known_good.append(save(c, name, "safe").twinkle_path)
        stop = threading.Event()

        def save_loop() -> None:
            i = 0
            while not stop.is_set():
                try:
                    save(c, name, f"s{i % 3}")
                except grpc.RpcError:
                    return  # the kill
                i += 1

        t = threading.Thread(target=save_loop)
        t.start()
        time.sleep(rng.uniform(0.0, 0.15))
        whole = round_ % 2 == 1
        if whole:
            kill_server(server)
        else:
            server.engine_workers()[0].kill()
        kinds["server" if whole else "engine"] += 1
        stop.set()
        t.join(timeout=60)
        if whole:
            server = launch_server(overrides)
        else:
            # The supervisor notices within milliseconds and restarts after its back-off.
            server.wait_health("NOT_SERVING", 30, interval_s=0.01)
            server.wait_health("SERVING", 60)
        assert not list(data_dir.rglob(".tmp-*")) or not whole, "a temp dir survived the restart"
        # Every listed checkpoint of every run verifies, and the known-good ones are listed.
        c = Client(server.grpc_address, None)
        checker = f"check{round_}"
        add(c, checker, rank=16)
        runs = c.utility.ListTrainingRuns(upb.ListTrainingRunsRequest(limit=1000), timeout=30)
        listed = []
        for run in runs.training_runs:
            for ck in c.utility.ListCheckpoints(upb.ListCheckpointsRequest(run_id=run.training_run_id),
                                                timeout=30).checkpoints:
                listed.append(ck.twinkle_path)
        for path in set(listed) | set(known_good):
            assert path in listed, f"{path} is not listed after the crash"
        for path in rng.sample(sorted(set(listed)), min(4, len(listed))) + known_good[-1:]:
            c.call("Load", tpb.LoadRequest(adapter_name=checker, name=path, load_optimizer=False))
        c.call("RemoveAdapter", tpb.AdapterRequest(adapter_name=checker))
    assert not list(data_dir.rglob(".tmp-*"))
    print(f"{CRASH_ROUNDS} crash rounds ({kinds['engine']} engine kills, {kinds['server']} server kills): "
          f"{len(known_good)} known-good checkpoints all listed and loadable")


# ---- merged export -------------------------------------------------------------------------------

def test_merged_export_loads_in_transformers_and_matches(launch_server: LaunchServer, tmp_path: Path,
                                                         tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    server = launch_server(auth_overrides(storage={"data_dir": str(tmp_path / "data")}))
    alice, bob = Client(server.grpc_address, KEYS["alice"]), Client(server.grpc_address, KEYS["bob"])
    n_vocab = vocab(tiny_model)
    alice.call("AddAdapter", tpb.AddAdapterRequest(adapter_name="m", config=tpb.LoraConfig(
        r=8, lora_alpha=16, seed=4, target_modules=["all-linear", "lm_head"])))
    alice.call("SetOptimizer", tpb.SetOptimizerRequest(adapter_name="m", optimizer_cls="AdamW", config={"lr": 5e-2}))
    for step in range(3):
        train_step(alice, "m", data_for(step, n_vocab))
    path = save(alice, "m", "to-export").twinkle_path
    error = expect_code(grpc.StatusCode.NOT_FOUND, lambda: bob.utility.ExportMergedModel(
        upb.ExportMergedModelRequest(checkpoint_path=path, name="stolen"), metadata=bob.metadata, timeout=120))
    print(f"bob exporting alice's checkpoint: NOT_FOUND ({error.details()})")
    exported = alice.utility.ExportMergedModel(upb.ExportMergedModelRequest(checkpoint_path=path, name="merged"),
                                               metadata=alice.metadata, timeout=300)
    out = Path(exported.path)
    assert out.is_relative_to(tmp_path / "data" / "tenants" / "alice")
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    probe = batch(91, n_vocab, sequences=3)
    ours = alice.call("ForwardOnly", tpb.ForwardRequest(adapter_name="m", inputs=probe)).result
    model = AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    worst = 0.0
    for f, seq in zip(probe, ours.sequences):
        ids = torch.tensor([list(f.input_ids)])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
        targets = torch.tensor(list(f.labels[1:]))
        targets = torch.where(targets == -100, ids[0, 1:], targets)
        ref = logp[:-1].gather(1, targets[:, None])[:, 0].numpy()
        worst = max(worst, float(np.max(np.abs(np.asarray(seq.logps[:-1], dtype=np.float64) - ref))))
    print(f"merged export ({exported.size_bytes} bytes) in transformers vs our adapter: max |Δ log p| = {worst:.3e}")
    assert worst <= 1e-4


@pytest.mark.parametrize("variant", ["qwen3_moe", "qwen3_5_moe"])
def test_peft_loads_our_moe_checkpoint(launch_server: LaunchServer, tmp_path: Path, variant: str) -> None:
    """An MoE adapter saved through the server loads in PEFT 0.21 and gives our log-probs:
    Qwen3-MoE's experts and router as target_parameters with the gate_up rank/alpha patterns
    PEFT writes; Qwen3.5-MoE's all-linear as the explicit list (shared expert, its gate,
    DeltaNet). Resuming from it in the server gives the same log-probs again."""
    import sys
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import make_reference_models

    model = make_reference_models.make(variant, tmp_path / "models")
    server = launch_server({"model": {"path": str(model)}, "storage": {"data_dir": str(tmp_path / "data")}})
    c = Client(server.grpc_address, None)
    n_vocab = vocab(model)
    for name in ("p", "q"):
        c.call("AddAdapter", tpb.AddAdapterRequest(adapter_name=name, config=tpb.LoraConfig(
            r=4, lora_alpha=16, seed=3, target_modules=["all-linear", "lm_head"])))
    c.call("SetOptimizer", tpb.SetOptimizerRequest(adapter_name="p", optimizer_cls="AdamW", config={"lr": 5e-2}))
    for step in range(3):
        train_step(c, "p", data_for(step, n_vocab))
    saved = save(c, "p", "moe-peft")
    config = json.loads((Path(saved.checkpoint_dir) / "adapter_config.json").read_text())
    print(f"{variant}: target_modules={config['target_modules']} target_parameters={config['target_parameters']} "
          f"rank_pattern={config['rank_pattern']} alpha_pattern={config['alpha_pattern']}")
    if variant == "qwen3_moe":
        assert sorted(config["target_modules"]) == ["k_proj", "lm_head", "o_proj", "q_proj", "v_proj"]
        assert config["target_parameters"] == ["gate_up_proj", "down_proj", "gate.weight"]
        assert config["rank_pattern"] == {r".*\.gate_up_proj": 8} and config["alpha_pattern"] == {r".*\.gate_up_proj": 32}
    else:
        assert {"in_proj_qkv", "gate_proj", "shared_expert_gate", "lm_head"} <= set(config["target_modules"])
        assert config["target_parameters"] is None
    probe = batch(77, n_vocab, sequences=3)
    ours = c.call("ForwardOnly", tpb.ForwardRequest(adapter_name="p", inputs=probe)).result
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32),
                                     saved.checkpoint_dir).eval()
    c.call("ResumeFromCheckpoint", tpb.LoadRequest(adapter_name="q", name=saved.twinkle_path))
    resumed = c.call("ForwardOnly", tpb.ForwardRequest(adapter_name="q", inputs=probe)).result
    worst = 0.0
    for f, seq, again in zip(probe, ours.sequences, resumed.sequences):
        ids = torch.tensor([list(f.input_ids)])
        with torch.no_grad():
            logp = torch.log_softmax(peft(ids).logits[0].double(), dim=-1)
        targets = torch.tensor(list(f.labels[1:]))
        targets = torch.where(targets == -100, ids[0, 1:], targets)
        ref = logp[:-1].gather(1, targets[:, None])[:, 0].numpy()
        got = np.asarray(seq.logps[:-1], dtype=np.float64)
        worst = max(worst, float(np.max(np.abs(got - ref))))
        assert np.array_equal(np.asarray(again.logps), np.asarray(seq.logps))
    print(f"{variant}: PEFT-loaded checkpoint vs our log-probs: max |diff| = {worst:.3e}")
    assert worst <= 1e-4
