"""A forward_backward above its activation-memory budget (max_pass_bytes, the coordinator's
engine.activation_memory_mib) runs as several passes, each within the budget, its
gradients accumulating across them (core/ipc/forward_split.h): the same numbers as one
pass, a pass that fails leaves the gradients as they were, and the step's peak memory is
one pass's, not the whole request's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, load
from engine_harness import Engine, EngineError
from numerics import assert_close, relative_norm_error
from test_memory import random_qwen3
from test_memory_estimate import MIB, estimate_bytes

VOCAB = 256


def datums(seed: int, lengths: list[int], vocab: int = VOCAB) -> list[dict[str, object]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        tokens = torch.randint(0, vocab, (n,), generator=g)
        out.append({"input_tokens": tokens, "target_tokens": torch.roll(tokens, -1),
                    "inputs": {"weights": torch.rand(n, generator=g)}})
    return out


def fused_ops(round_: int) -> list[dict[str, object]]:
    """Adapter a: cross_entropy over 4 sequences (cut between them); adapter b: Twinkle's
    token-mean cross-entropy over 2 (one unit: its mean is over both); base-only rows."""
    b = datums(100 + round_, [9, 14])
    for d in b:
        d["inputs"] = {"mask": torch.ones(len(d["input_tokens"]))}
    return [{"adapter_id": "a", "loss": {"name": "cross_entropy"}, "datums": datums(round_, [12, 7, 15, 10])},
            {"adapter_id": "b", "loss": {"name": "twinkle:cross_entropy"}, "datums": b},
            {"adapter_id": "", "datums": datums(200 + round_, [6])}]


def create(engine: Engine) -> None:
    for i, adapter in enumerate(("a", "b")):
        engine.call("create_adapter", {"adapter_id": adapter, "rank": 4, "alpha": 16.0, "seed": 1 + i})


def test_passes_give_the_numbers_of_one_pass(reference_models: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """3 rounds of (forward_backward, forward_backward, optim_step) on two adapters, once in
    one pass and once with a budget that holds about two of adapter a's sequences: per-datum
    log-probs, losses and metrics agree within float32 summation order (1e-6); the weights
    after 3 AdamW steps within 1e-5 (Adam divides by sqrt(v), so the order's ~1e-7 in a
    near-zero gradient grows: as in docs/device_pool.md), and the next step's gradients
    within 1e-5 of their norm. The engine's debug log names the passes."""
    states, replies = [], []
    for budgeted in (False, True):
        with Engine(extra_args=["--log-level", "debug"]) as engine:
            info = load(engine, reference_models / "qwen3")
            create(engine)
            budget = estimate_bytes(info, [15, 14]) if budgeted else 0
            got = []
            for r in range(3):
                for micro in range(2):
                    got.append(engine.call("forward_backward",
                                           {"ops": fused_ops(2 * r + micro), "max_pass_bytes": budget}))
                for adapter in ("a", "b"):
                    engine.call("optim_step", {"adapter_id": adapter, "hyper": {"learning_rate": 1e-2}})
            engine.call("forward_backward", {"ops": fused_ops(9), "max_pass_bytes": budget})
            states.append({a: engine.call("get_adapter_state", {"adapter_id": a}) for a in ("a", "b")})
            replies.append(got)
    log = capfd.readouterr().err
    assert "forward_backward in 3 passes" in log, log[-2000:]  # a: 12+7 | 15+10 | b (9+14) + base (6)
    for one, split in zip(*replies):
        for o, (op1, op2) in enumerate(zip(one["ops"], split["ops"])):
            assert len(op1["logprobs"]) == len(op2["logprobs"])
            for d, (x, y) in enumerate(zip(op1["logprobs"], op2["logprobs"])):
                assert_close(f"op {o} datum {d} logprobs", y, x, 1e-6, absolute=True)
            for d, (x, y) in enumerate(zip(op1.get("elementwise", []), op2.get("elementwise", []))):
                assert_close(f"op {o} datum {d} loss", y, x, 1e-6, absolute=True)
            for key, value in op1["metrics"].items():
                assert op2["metrics"][key] == pytest.approx(value, rel=1e-6, abs=1e-7), (o, key)
    for adapter in ("a", "b"):
        one, split = states[0][adapter], states[1][adapter]
        assert one["step"] == split["step"] == 3
        assert one["micro_batches_since_step"] == split["micro_batches_since_step"] == 1
        for name, w in one["weights"].items():
            assert_close(f"{adapter} {name}", split["weights"][name], w, 1e-5, absolute=True)
        assert set(one["grads"]) == set(split["grads"])
        for name, g in one["grads"].items():
            relative_norm_error(f"{adapter} grad {name}", split["grads"][name], g, 1e-5)


def test_a_failing_pass_keeps_the_gradients_as_they_were(reference_models: Path) -> None:
    """The second pass holds a token outside the vocabulary: the request fails naming the
    pass, and the gradients are those of the micro-batch before it, bit for bit (the first
    pass's contribution is dropped). The adapter then trains on."""
    with Engine() as engine:
        info = load(engine, reference_models / "qwen3")
        create(engine)
        ops = fused_ops(0)
        engine.call("forward_backward", {"ops": ops})
        before = engine.call("get_adapter_state", {"adapter_id": "a"})
        bad = fused_ops(1)
        bad[0]["datums"][2]["input_tokens"][3] = VOCAB + 5  # in the second pass
        with pytest.raises(EngineError) as info_:
            engine.call("forward_backward", {"ops": bad, "max_pass_bytes": estimate_bytes(info, [15, 14])})
        assert "pass 2 of 3" in info_.value.message and "token id outside" in info_.value.message
        after = engine.call("get_adapter_state", {"adapter_id": "a"})
        assert after["micro_batches_since_step"] == before["micro_batches_since_step"] == 1
        for name, g in before["grads"].items():
            assert torch.equal(after["grads"][name], g), name
        engine.call("forward_backward", {"ops": fused_ops(1), "max_pass_bytes": estimate_bytes(info, [15, 14])})
        assert engine.call("get_adapter_state", {"adapter_id": "a"})["micro_batches_since_step"] == 2


@pytest.mark.skipif(DEVICE != "cpu", reason="measures host RSS: CPU workers only")
def test_passes_bound_the_step_peak_memory(tmp_path: Path) -> None:
    """4 sequences of 2048 tokens on a Qwen3 with a 16000 vocabulary. With a budget of one
    sequence's estimate the step's peak RSS stays under that estimate (the estimate bounds a
    pass's peak: test_memory_estimate), where the same request in one pass peaks above it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_memory import proc_kib

    model_dir = random_qwen3(tmp_path / "model", 16000, hidden=128, layers=4)
    peaks, one_sequence = [], 0
    for budgeted in (False, True):
        with Engine() as engine:
            info = load(engine, model_dir)
            engine.call("create_adapter", {"adapter_id": "a", "rank": 8, "alpha": 16.0, "seed": 1,
                                           "targets": ["all-linear"]})
            one_sequence = estimate_bytes(info, [2048])
            loaded = proc_kib(engine.proc.pid, "VmRSS")
            engine.call("forward_backward", {
                "ops": [{"adapter_id": "a", "loss": {"name": "cross_entropy"},
                         "datums": datums(7, [2048] * 4, vocab=16000)}],
                "max_pass_bytes": one_sequence if budgeted else 0})
            peaks.append((proc_kib(engine.proc.pid, "VmHWM") - loaded) / 1024)
    print(f"4 x 2048 tokens: one pass peaks {peaks[0]:.0f} MiB, 4 passes {peaks[1]:.0f} MiB; "
          f"one sequence's estimate {one_sequence / MIB:.0f} MiB, the whole request's "
          f"{estimate_bytes(info, [2048] * 4) / MIB:.0f} MiB")
    assert peaks[1] <= one_sequence / MIB < peaks[0]


def test_dropout_draws_fresh_masks_in_each_pass(reference_models: Path) -> None:
    """With LoRA dropout, two passes over the same sequence twice draw different masks: the
    gradient is not twice that of one pass over it once (which it would be, bit for bit, if
    each pass reused the masks of pass 0)."""
    grads = []
    for sequences, budgeted in ((1, False), (2, True)):
        with Engine() as engine:
            info = load(engine, reference_models / "qwen3")
            engine.call("create_adapter", {"adapter_id": "d", "rank": 4, "alpha": 16.0, "seed": 3, "dropout": 0.5})
            datum = datums(5, [12])[0]
            engine.call("forward_backward", {
                "ops": [{"adapter_id": "d", "loss": {"name": "cross_entropy"}, "datums": [datum] * sequences}],
                "max_pass_bytes": estimate_bytes(info, [12]) if budgeted else 0})
            grads.append(engine.call("get_adapter_state", {"adapter_id": "d"})["grads"])
    name = next(n for n in grads[0] if "lora_B" in n)  # (lora_A's are 0 while B is 0)
    assert float(grads[0][name].abs().max()) > 0
    assert not torch.allclose(grads[1][name], 2 * grads[0][name], rtol=1e-3, atol=0)
