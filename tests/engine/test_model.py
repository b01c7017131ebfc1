"""The engine's decoder and LoRA against transformers and PEFT (fp32, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import VARIANTS, load
from engine_harness import Engine
from numerics import assert_close, relative_norm_error
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from transformers import AutoModelForCausalLM

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def sequences(vocab: int, lengths: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def hf_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens.unsqueeze(0)).logits[0]


def engine_forward(engine: Engine, seqs: list[torch.Tensor], adapter_id: str = "") -> list[torch.Tensor]:
    datums = [{"input_tokens": s, "target_tokens": s} for s in seqs]
    reply = engine.call("forward", {"ops": [{"adapter_id": adapter_id, "datums": datums}], "return_logits": True})
    return reply["ops"][0]["logits"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(engine: Engine, reference_models: Path, variant: str) -> None:
    model_dir = reference_models / variant
    info = load(engine, model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert info["parameter_count"] == sum(p.numel() for p in hf.parameters())
    # Several sequences packed in one engine batch; each compared with its own HF forward.
    seqs = sequences(hf.config.vocab_size, [1, 7, 40, 64], seed=1)
    got = engine_forward(engine, seqs)
    with torch.no_grad():
        for i, s in enumerate(seqs):
            ref = hf_logits(hf, s)
            assert_close(f"{variant} seq{i} logits", got[i], ref, 1e-4, absolute=True)


def random_lora_state(engine: Engine, adapter_id: str, seed: int) -> dict[str, torch.Tensor]:
    """Non-zero A and B (PEFT starts B at zero, which would hide half the math)."""
    state = engine.call("get_adapter_state", {"adapter_id": adapter_id})["weights"]
    g = torch.Generator().manual_seed(seed)
    return {k: 0.1 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def peft_model(model_dir: Path, rank: int, alpha: float, weights: dict[str, torch.Tensor],
               targets: list[str] = ALL_LINEAR) -> torch.nn.Module:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets)
    model = get_peft_model(base, config)
    result = set_peft_model_state_dict(model, weights)
    assert not result.unexpected_keys, result.unexpected_keys
    return model


def check_lora_against_peft(engine: Engine, model_dir: Path, label: str, targets: list[str]) -> None:
    """Logits, logprobs, loss and every LoRA gradient of an adapter with random A and B vs PEFT."""
    rank, alpha = 4, 8.0
    engine.call("create_adapter", {"adapter_id": "t", "rank": rank, "alpha": alpha, "seed": 3, "targets": targets})
    weights = random_lora_state(engine, "t", seed=4)
    engine.call("set_adapter_state", {"adapter_id": "t", "weights": weights})
    peft = peft_model(model_dir, rank, alpha, weights, targets)

    seqs = sequences(256, [9, 30], seed=5)
    targets_ = sequences(256, [9, 30], seed=6)
    g = torch.Generator().manual_seed(7)
    loss_weights = [torch.rand(len(s), generator=g) * 2 - 0.5 for s in seqs]  # includes negatives

    got_logits = engine_forward(engine, seqs, "t")
    datums = [{"input_tokens": s, "target_tokens": t, "inputs": {"weights": w}}
              for s, t, w in zip(seqs, targets_, loss_weights)]
    reply = engine.call("forward_backward", {"ops": [{"adapter_id": "t", "datums": datums,
                                                      "loss": {"name": "cross_entropy"}}]})
    grads = engine.call("get_adapter_state", {"adapter_id": "t"})["grads"]

    total = torch.zeros((), dtype=torch.float64)
    for i, (s, t, w) in enumerate(zip(seqs, targets_, loss_weights)):
        logits = hf_logits(peft, s)
        assert_close(f"{label} lora seq{i} logits", got_logits[i], logits, 1e-5)
        lp = torch.log_softmax(logits, -1).gather(1, t.unsqueeze(1)).squeeze(1)
        assert_close(f"{label} lora seq{i} logprobs", reply["ops"][0]["logprobs"][i], lp, 1e-5)
        total = total + (-(w * lp)).sum()
    total.backward()
    ref_grads = {k.replace(".default", ""): p.grad for k, p in peft.named_parameters() if p.grad is not None}
    assert set(ref_grads) == set(grads), set(ref_grads) ^ set(grads)
    for name, ref in ref_grads.items():
        relative_norm_error(f"grad {name}", grads[name], ref, 1e-5)
    assert abs(reply["ops"][0]["metrics"]["loss:sum"] - float(total)) <= 1e-5 * abs(float(total))


@pytest.mark.parametrize("variant", ["qwen3", "llama-llama3-rope", "qwen2"])
def test_lora_logits_and_gradients_match_peft(engine: Engine, reference_models: Path, variant: str) -> None:
    model_dir = reference_models / variant
    load(engine, model_dir)
    check_lora_against_peft(engine, model_dir, variant, ALL_LINEAR)


@pytest.mark.parametrize("variant", ["qwen3", "qwen3-tied"])
def test_lm_head_lora_matches_peft(engine: Engine, reference_models: Path, variant: str) -> None:
    """LoRA on the output projection ("train_unembed"), untied and tied: PEFT wraps lm_head in
    both cases and leaves the (shared) embedding alone, and so must the engine."""
    model_dir = reference_models / variant
    load(engine, model_dir)
    check_lora_against_peft(engine, model_dir, f"{variant}+lm_head", ALL_LINEAR + ["lm_head"])
    keys = engine.call("get_adapter_state", {"adapter_id": "t"})["weights"]
    assert {k for k in keys if "lm_head" in k} == {"base_model.model.lm_head.lora_A.weight",
                                                   "base_model.model.lm_head.lora_B.weight"}
    # all-linear leaves lm_head out, as in PEFT.
    engine.call("create_adapter", {"adapter_id": "plain", "rank": 4, "targets": ["all-linear"]})
    plain = engine.call("get_adapter_state", {"adapter_id": "plain"})
    assert not any("lm_head" in k for k in plain["weights"])
    assert "lm_head" not in plain["config"]["targets"]

    # Fused with base-only rows: the lm_head term stays on its own op's rows.
    seqs = sequences(256, [12], seed=8)
    reply = engine.call("forward", {"ops": [{"adapter_id": "t", "datums": [{"input_tokens": seqs[0]}]},
                                            {"adapter_id": "", "datums": [{"input_tokens": seqs[0]}]}],
                                    "return_logits": True})
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        assert_close(f"{variant} fused base-only rows", reply["ops"][1]["logits"][0], hf_logits(base, seqs[0]), 1e-5)
    solo = engine_forward(engine, seqs, "t")[0]
    assert_close(f"{variant} fused lm_head rows vs solo", reply["ops"][0]["logits"][0], solo, 1e-5)
