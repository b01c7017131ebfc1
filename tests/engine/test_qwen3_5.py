"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) against transformers and PEFT (fp32, CPU).

Tiny random models from scripts/make_reference_models.py: "qwen3_5" (a Qwen3_5ForCausalLM
checkpoint) and "qwen3_5-vl" (a Qwen3_5ForConditionalGeneration checkpoint: vision tower,
model.language_model.* weights, tied embeddings). Sequence lengths cross the delta rule's
64-token chunks, and several sequences share one packed engine batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_harness import Engine, EngineError
from numerics import assert_close
from sampling_checks import assert_greedy_matches_generate, assert_samples_match_training_forward
from test_fused import HYPER
from test_model import engine_forward, hf_logits, peft_model, random_lora_state, sequences
from test_sampler_pool import GAP, drain, engine, load, make_adapter, one_thread, row, step  # noqa: F401 (fixtures)
from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

DELTANET = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
LENGTHS = [1, 3, 63, 64, 65, 150]  # around and across chunk boundaries


def reference(model_dir: Path, variant: str) -> torch.nn.Module:
    if variant == "qwen3_5-vl":
        return Qwen3_5ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("variant", ["qwen3_5", "qwen3_5-vl"])
def test_packed_logits_match_transformers(engine: Engine, reference_models: Path, variant: str) -> None:
    model_dir = reference_models / variant
    info = load(engine, model_dir)
    hf = reference(model_dir, variant)
    text = hf.model.language_model if variant == "qwen3_5-vl" else hf.model
    # The engine holds the language model only (vision skipped); lm_head is tied in -vl.
    expected = sum(p.numel() for p in text.parameters())
    if not hf.config.tie_word_embeddings:
        expected += hf.lm_head.weight.numel()
    assert info["parameter_count"] == expected
    seqs = sequences(256, LENGTHS, seed=11)
    got = engine_forward(engine, seqs)
    # The same sequences in another order and fused with a second op: nothing crosses.
    reply = engine.call("forward", {"ops": [{"adapter_id": "", "datums": [{"input_tokens": s} for s in seqs[::-1]]},
                                            {"adapter_id": "", "datums": [{"input_tokens": seqs[2]}]}],
                                    "return_logits": True})
    with torch.no_grad():
        for i, s in enumerate(seqs):
            ref = hf_logits(hf, s)
            assert_close(f"{variant} len{len(s)} logits", got[i], ref, 1e-4, absolute=True)
            assert_close(f"{variant} len{len(s)} reordered", reply["ops"][0]["logits"][len(seqs) - 1 - i], ref,
                         1e-4, absolute=True)
        assert_close(f"{variant} second op", reply["ops"][1]["logits"][0], hf_logits(hf, seqs[2]), 1e-4,
                     absolute=True)


def test_lora_logits_and_gradients_match_peft(engine: Engine, reference_models: Path) -> None:
    """Every linear PEFT can wrap in a Qwen3.5 text model (DeltaNet in/out projections,
    gated attention, MLP) plus lm_head: logits, logprobs and loss vs PEFT (fp32), and each
    LoRA gradient vs PEFT in float64.

    Gradients: ||engine - peft64|| / ||peft64|| <= max(1e-5, 2 x the same error of PEFT's own
    fp32 gradient). The flat 1e-5 holds for every tensor but the DeltaNet decay input
    (in_proj_a) of a deep layer, where fp32 itself is not that exact: exp(A_log) up to 16
    multiplies softplus(a + dt_bias), and the decays' exponentials cancel. There (layer 2)
    PEFT in fp32 is 2.4e-5 / 5.0e-5 off float64 and the engine 1.4e-5 / 1.9e-5 (A / B); both
    are printed."""
    model_dir = reference_models / "qwen3_5"
    load(engine, model_dir)
    targets = DELTANET + ATTENTION + MLP + ["lm_head"]
    rank, alpha = 4, 8.0
    engine.call("create_adapter", {"adapter_id": "t", "rank": rank, "alpha": alpha, "seed": 3, "targets": targets})
    weights = random_lora_state(engine, "t", seed=4)
    engine.call("set_adapter_state", {"adapter_id": "t", "weights": weights})
    seqs = sequences(256, [9, 30, 70], seed=5)
    targets_ = sequences(256, [9, 30, 70], seed=6)
    g = torch.Generator().manual_seed(7)
    loss_weights = [torch.rand(len(s), generator=g) * 2 - 0.5 for s in seqs]
    got_logits = engine_forward(engine, seqs, "t")
    datums = [{"input_tokens": s, "target_tokens": t, "inputs": {"weights": w}}
              for s, t, w in zip(seqs, targets_, loss_weights)]
    reply = engine.call("forward_backward", {"ops": [{"adapter_id": "t", "datums": datums,
                                                      "loss": {"name": "cross_entropy"}}]})
    grads = engine.call("get_adapter_state", {"adapter_id": "t"})["grads"]

    ref_grads: dict[torch.dtype, dict[str, torch.Tensor]] = {}
    for dtype in (torch.float32, torch.float64):
        peft = peft_model(model_dir, rank, alpha, weights, targets).to(dtype)
        total = torch.zeros((), dtype=torch.float64)
        for i, (s, t, w) in enumerate(zip(seqs, targets_, loss_weights)):
            logits = hf_logits(peft, s)
            lp = torch.log_softmax(logits, -1).gather(1, t.unsqueeze(1)).squeeze(1)
            if dtype == torch.float32:
                assert_close(f"qwen3_5 lora seq{i} logits", got_logits[i], logits, 1e-5)
                assert_close(f"qwen3_5 lora seq{i} logprobs", reply["ops"][0]["logprobs"][i], lp, 1e-5)
            total = total + (-(w.to(dtype) * lp)).sum()
        total.backward()
        if dtype == torch.float32:
            loss = reply["ops"][0]["metrics"]["loss:sum"]
            print(f"loss: engine {loss:.8f} peft {float(total):.8f}")
            assert abs(loss - float(total)) <= 1e-5 * abs(float(total))
        ref_grads[dtype] = {k.replace(".default", ""): p.grad.double() for k, p in peft.named_parameters()
                            if p.grad is not None}
    assert set(ref_grads[torch.float64]) == set(grads), set(ref_grads[torch.float64]) ^ set(grads)
    worst = 0.0
    for name, ref in ref_grads[torch.float64].items():
        err = float((grads[name].double() - ref).norm() / ref.norm())
        peft_err = float((ref_grads[torch.float32][name] - ref).norm() / ref.norm())
        tol = max(1e-5, 2 * peft_err)
        print(f"grad {name}: ||engine - peft64||/||peft64|| = {err:.3e}, peft fp32 {peft_err:.3e} (tol {tol:.3e})")
        assert err <= tol, name
        worst = max(worst, err)
    print(f"{len(grads)} LoRA gradients, largest relative error vs float64 {worst:.3e}")
    keys = engine.call("get_adapter_state", {"adapter_id": "t"})["weights"]
    # PEFT's names: DeltaNet linears only in linear-attention layers, q/k/v/o only in full ones.
    assert "base_model.model.model.layers.0.linear_attn.in_proj_qkv.lora_A.weight" in keys
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in keys
    assert not any("layers.0.self_attn" in k or "layers.1.linear_attn" in k for k in keys)


def test_all_linear_covers_both_layer_kinds(engine: Engine, reference_models: Path) -> None:
    load(engine, reference_models / "qwen3_5")
    engine.call("create_adapter", {"adapter_id": "all", "rank": 2, "targets": ["all-linear"]})
    state = engine.call("get_adapter_state", {"adapter_id": "all"})
    assert sorted(state["config"]["targets"]) == sorted(ATTENTION + MLP + DELTANET)
    # A dense model's all-linear is unchanged; a DeltaNet-only list on it is refused, as PEFT does.
    load(engine, reference_models / "qwen3")
    engine.call("create_adapter", {"adapter_id": "dense", "rank": 2, "targets": ["all-linear"]})
    state = engine.call("get_adapter_state", {"adapter_id": "dense"})
    assert sorted(state["config"]["targets"]) == sorted(ATTENTION + MLP)
    with pytest.raises(EngineError, match="none of the LoRA target modules"):
        engine.call("create_adapter", {"adapter_id": "bad", "rank": 2, "targets": ["in_proj_qkv"]})


ADAPTERS = {"a": 2, "b": 4, "c": 8}


def data(adapter: str, round_: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(ord(adapter) * 1000 + round_)
    out = []
    for n in (5 + ord(adapter) % 3, 70):  # the second crosses a chunk boundary
        tokens = torch.randint(0, 256, (n,), generator=g)
        out.append({"input_tokens": tokens, "target_tokens": torch.roll(tokens, -1),
                    "inputs": {"weights": torch.rand(n, generator=g)}})
    return out


def op(adapter: str, round_: int) -> dict[str, object]:
    return {"adapter_id": adapter, "datums": data(adapter, round_), "loss": {"name": "cross_entropy"}}


def create(engine: Engine, adapter: str) -> None:
    engine.call("create_adapter", {"adapter_id": adapter, "rank": ADAPTERS[adapter], "alpha": 16.0,
                                   "seed": ord(adapter), "targets": ["all-linear"]})


def test_fused_training_equals_solo_training(reference_models: Path) -> None:
    """Three adapters fused for 20 forward_backward + optim_step rounds end where each ends alone."""
    model_dir = reference_models / "qwen3_5"
    rounds = 20
    with Engine() as fused:
        load(fused, model_dir)
        for a in ADAPTERS:
            create(fused, a)
        for r in range(rounds):
            fused.call("forward_backward", {"ops": [op(a, r) for a in ADAPTERS]})
            for a in ADAPTERS:
                fused.call("optim_step", {"adapter_id": a, "hyper": HYPER})
        fused_state = {a: fused.call("get_adapter_state", {"adapter_id": a}) for a in ADAPTERS}
    for a in ADAPTERS:
        with Engine() as solo:
            load(solo, model_dir)
            create(solo, a)
            for r in range(rounds):
                solo.call("forward_backward", {"ops": [op(a, r)]})
                solo.call("optim_step", {"adapter_id": a, "hyper": HYPER})
            solo_state = solo.call("get_adapter_state", {"adapter_id": a})
        assert all(float(w.abs().max()) > 0 for n, w in solo_state["weights"].items() if "lora_B" in n)
        worst = 0.0
        for name, w in solo_state["weights"].items():
            got = fused_state[a]["weights"][name]
            worst = max(worst, float((got - w).abs().max()))
            assert float((got - w).abs().max()) <= 1e-6, f"{a} {name}"
        print(f"adapter {a}: {len(solo_state['weights'])} tensors, max|fused - solo| = {worst:.3e}")


def test_config_errors_name_the_key(engine: Engine, reference_models: Path, tmp_path: Path) -> None:
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(reference_models / "qwen3_5", bad)
    config = json.loads((bad / "config.json").read_text())
    config["layer_types"][1] = "sliding_attention"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineError, match="layer_types.*sliding_attention"):
        load(engine, bad)


# Sampling: four adapters over both layer kinds (d also on lm_head).
SAMPLE_ADAPTERS = {
    "a": (4, DELTANET + ATTENTION + MLP),
    "b": (8, DELTANET),
    "c": (2, ["q_proj", "v_proj", "in_proj_qkv", "out_proj", "down_proj"]),
    "d": (6, ["in_proj_z", "in_proj_b", "in_proj_a", "k_proj", "o_proj", "gate_proj", "up_proj", "lm_head"]),
}


def sample_adapters(engine: Engine, model_dir: Path | None) -> dict[str, torch.nn.Module | None]:
    refs: dict[str, torch.nn.Module | None] = {}
    if model_dir is not None:
        refs[""] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for i, (name, (rank, targets)) in enumerate(SAMPLE_ADAPTERS.items()):
        refs[name] = make_adapter(engine, model_dir, name, rank, targets, seed=11 + i)
    return refs


def test_greedy_16_prompts_x_32_tokens_x_4_adapters_match_transformers_generate(
        engine: Engine, reference_models: Path) -> None:
    """64 greedy sequences decoding in one batch (recurrent states beside the paged KV cache),
    each against transformers generate (its cache: chunked prefill, recurrent decode) on the
    PEFT model, compared up to the first position where the reference's top-2 gap < GAP."""
    model_dir = reference_models / "qwen3_5"
    load(engine, model_dir)
    refs = sample_adapters(engine, model_dir)
    prompts = sequences(256, [1 + (7 * i) % 29 for i in range(15)] + [70], seed=21)
    cases = [(a, p) for p in prompts for a in SAMPLE_ADAPTERS]
    assert_greedy_matches_generate(engine, refs, cases, max_tokens=32, gap=GAP, label="qwen3_5")


@pytest.mark.parametrize("block_size", [16, 3])
def test_sampler_logprobs_match_training_forward(engine: Engine, reference_models: Path, block_size: int) -> None:
    """Through sample_step, 3 samples a request (the prompt's states copied to each):
    sampled-token and prompt logprobs equal the training forward over prompt + tokens."""
    model_dir = reference_models / "qwen3_5"
    load(engine, model_dir, kv_block_size=block_size)
    sample_adapters(engine, None)
    prompts = sequences(256, [6, 13, 2, 20, 70], seed=31)
    adapters = ["a", "d", "", "c", "b"]
    rows = [row(a, p, temperature=1.0, top_k=40, top_p=0.9, seed=7 + i, num_samples=3, max_tokens=10,
                want_prompt_logprobs=True) for i, (a, p) in enumerate(zip(adapters, prompts))]
    results: dict[int, Any] = {}
    drain(engine, step(engine, list(enumerate(rows)), steps=3), results)
    worst = assert_samples_match_training_forward(engine, results, adapters, prompts, max_tokens=10)
    print(f"block size {block_size}: largest logprob difference {worst:.3e}")


def test_200_mixed_requests_free_their_states(engine: Engine, reference_models: Path) -> None:
    """Mixed requests (samples, stops, cancels, max_tokens 0) through a small cache: blocks go
    back to 0 and, afterwards, one request with as many samples as there are state slots is
    admitted at once, so no recurrent state slot was left behind."""
    import random

    model_dir = reference_models / "qwen3_5"
    slots = 64  # load_model's default (kv_cache.h kDefaultStateSlots)
    assert load(engine, model_dir, kv_cache_blocks=96, kv_block_size=4)["state_slots"] == slots
    sample_adapters(engine, None)
    rng = random.Random(3)
    rows = {i: row(rng.choice(["", "a", "b", "c", "d"]), sequences(256, [rng.randint(1, 40)], seed=i)[0],
                   max_tokens=rng.randint(0, 16), temperature=rng.choice([0.0, 1.0]), seed=i,
                   num_samples=rng.randint(1, 4), stop_token_ids=rng.sample(range(256), rng.choice([0, 10])))
            for i in range(200)}
    queue, running, done, cancelled = list(rows), set(), {}, set()
    while queue or running:
        admit = queue[:rng.randint(0, 12)]
        cancel = [i for i in sorted(running) if rng.random() < 0.03]
        reply = step(engine, [(i, rows[i]) for i in admit], cancel=cancel, steps=rng.randint(0, 6))
        assert not reply["rejected"], reply["rejected"]
        assert 0 <= reply["states_in_use"] <= reply["states_total"] == slots
        running -= set(cancel)
        cancelled |= set(cancel)
        queue = reply["deferred"] + queue[len(admit):]
        running |= set(admit) - set(reply["deferred"])
        for f in reply["finished"]:
            running.discard(f["request_id"])
            done[f["request_id"]] = f["result"]
    assert set(done) | cancelled == set(rows)
    final = step(engine, steps=0)
    assert final["blocks_in_use"] == 0 and final["running"] == 0 and final["states_in_use"] == 0
    # Prompt 4 = one shared block, + one block a sample: 65 of the 96 blocks.
    reply = step(engine, [(1000, row("a", sequences(256, [4], seed=5)[0], max_tokens=2, num_samples=slots,
                                     temperature=1.0, seed=1))], steps=4)
    assert reply["deferred"] == [] and not reply["rejected"]
    drain(engine, reply, done)
    assert len(done[1000]["samples"]) == slots
    with pytest.raises(EngineError, match="recurrent state slots"):
        engine.call("sample", {"rows": [row("", sequences(256, [3], seed=5)[0], max_tokens=1,
                                            num_samples=slots + 1)]})
    print(f"{len(done) - 1} finished, {len(cancelled)} cancelled; {slots} state slots all free afterwards")


def test_state_slots_are_sized_by_load_model(engine: Engine, reference_models: Path) -> None:
    """load_model's state_slots sizes the pool (the config's sampler.state_slots); a request
    with one sample more than the slots is refused naming both numbers; a dense model has none."""
    info = load(engine, reference_models / "qwen3_5", kv_cache_blocks=32, kv_block_size=4, state_slots=3)
    assert info["state_slots"] == 3
    reply = step(engine, [(1, row("", sequences(256, [4], seed=1)[0], max_tokens=2, num_samples=4, seed=1))], steps=0)
    assert [r["request_id"] for r in reply["rejected"]] == [1]
    assert "num_samples (4) exceeds the 3 recurrent state slots" in reply["rejected"][0]["error"]
    reply = step(engine, [(2, row("", sequences(256, [4], seed=1)[0], max_tokens=8, num_samples=3, seed=1))], steps=1)
    assert not reply["rejected"] and reply["states_in_use"] == 3 and reply["states_total"] == 3
    with Engine() as dense:
        assert load(dense, reference_models / "qwen3", state_slots=3)["state_slots"] == 0
