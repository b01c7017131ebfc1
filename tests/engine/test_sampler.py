"""The engine's `sample` method (KV-cache generation) against transformers generate and the
engine's own training forward pass (fp32, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import load
from engine_harness import Engine
from numerics import assert_close
from sampling_checks import assert_samples_match_training_forward
from test_model import ALL_LINEAR, peft_model, random_lora_state, sequences
from transformers import AutoModelForCausalLM

GAP = 1e-4  # greedy tokens are compared up to the first near-tie of the reference


def make_adapter(engine: Engine, model_dir: Path, adapter_id: str, rank: int, targets: list[str], seed: int):
    engine.call("create_adapter", {"adapter_id": adapter_id, "rank": rank, "alpha": 2.0 * rank,
                                   "seed": seed, "targets": targets})
    weights = random_lora_state(engine, adapter_id, seed=seed + 100)
    engine.call("set_adapter_state", {"adapter_id": adapter_id, "weights": weights})
    return peft_model(model_dir, rank, 2.0 * rank, weights, targets).merge_and_unload().eval()


def setup(engine: Engine, model_dir: Path, lm_head: bool) -> dict[str, torch.nn.Module]:
    load(engine, model_dir)
    refs = {"": AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()}
    refs["a"] = make_adapter(engine, model_dir, "a", 4, ALL_LINEAR, seed=11)
    refs["b"] = make_adapter(engine, model_dir, "b", 8, ALL_LINEAR + (["lm_head"] if lm_head else []), seed=12)
    refs["c"] = make_adapter(engine, model_dir, "c", 2, ["q_proj", "v_proj", "down_proj"], seed=13)
    return refs


def row(adapter: str, prompt: torch.Tensor, **kw) -> dict:
    r = {"adapter_id": adapter, "prompt_tokens": prompt, "max_tokens": 12, "temperature": 0.0}
    r.update(kw)
    return r


@pytest.mark.parametrize("variant,lm_head", [("qwen3", True), ("llama-llama3-rope", False), ("qwen2", False)])
def test_greedy_matches_transformers_generate(engine: Engine, reference_models: Path, variant: str,
                                              lm_head: bool) -> None:
    model_dir = reference_models / variant
    refs = setup(engine, model_dir, lm_head)
    prompts = sequences(256, [5, 11, 1, 8, 17, 3], seed=21)
    adapters = ["a", "b", "", "c", "a", "b"]
    max_tokens = 12
    reply = engine.call("sample", {"rows": [row(a, p, max_tokens=max_tokens) for a, p in zip(adapters, prompts)]})
    full = 0
    for i, (a, p) in enumerate(zip(adapters, prompts)):
        got = reply["rows"][i]["samples"][0]
        assert got["stop_reason"] == "length"
        assert len(got["tokens"]) == max_tokens
        with torch.no_grad():
            out = refs[a].generate(p.unsqueeze(0), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                   do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                   eos_token_id=None, pad_token_id=0, output_logits=True,
                                   return_dict_in_generate=True)
        ref_tokens = out.sequences[0, len(p):]
        assert len(ref_tokens) == max_tokens
        compared = max_tokens
        for t, logits in enumerate(out.logits):
            top2 = logits[0].topk(2).values
            if float(top2[0] - top2[1]) < GAP:
                compared = t + 1  # the near-tie position itself may go either way
                break
        n_exact = compared if compared == max_tokens else compared - 1
        assert got["tokens"][:n_exact].tolist() == ref_tokens[:n_exact].tolist(), (i, a, got["tokens"], ref_tokens)
        full += compared == max_tokens
    print(f"{variant}: {full}/{len(prompts)} rows compared over all {max_tokens} tokens")


@pytest.mark.parametrize("variant,lm_head", [("qwen3", True), ("llama-llama3-rope", False)])
def test_logprobs_match_training_forward(engine: Engine, reference_models: Path, variant: str,
                                         lm_head: bool) -> None:
    """Sampled-token and prompt logprobs equal a forward pass over prompt + generated tokens."""
    model_dir = reference_models / variant
    setup(engine, model_dir, lm_head)
    prompts = sequences(256, [6, 13, 1, 9], seed=31)
    adapters = ["a", "b", "", "c"]
    rows = [row(a, p, temperature=1.0, top_k=40, top_p=0.9, seed=7 + i, num_samples=2, max_tokens=10,
                want_prompt_logprobs=True) for i, (a, p) in enumerate(zip(adapters, prompts))]
    reply = engine.call("sample", {"rows": rows})
    for i, p in enumerate(prompts):
        result = reply["rows"][i]
        assert len(result["samples"]) == 2
        assert result["prompt_logprobs"].shape == (len(p) - 1,)
    worst = assert_samples_match_training_forward(engine, reply["rows"], adapters, prompts, max_tokens=10)
    print(f"{variant}: largest logprob difference {worst:.3e}")


def test_seed_batch_independence_and_stops(engine: Engine, reference_models: Path) -> None:
    model_dir = reference_models / "qwen3"
    setup(engine, model_dir, True)
    prompts = sequences(256, [7, 4, 12], seed=41)
    sampled = [row("a", prompts[0], temperature=0.8, top_k=20, seed=5, num_samples=3, max_tokens=15),
               row("b", prompts[1], temperature=1.3, top_p=0.7, seed=6, max_tokens=9),
               row("", prompts[2], temperature=1.0, seed=7, max_tokens=11)]
    first = engine.call("sample", {"rows": sampled})
    again = engine.call("sample", {"rows": sampled})
    for i in range(len(sampled)):
        for s, (x, y) in enumerate(zip(first["rows"][i]["samples"], again["rows"][i]["samples"])):
            assert torch.equal(x["tokens"], y["tokens"]), (i, s)
    # Samples of one row draw from different generators.
    tokens0 = [s["tokens"].tolist() for s in first["rows"][0]["samples"]]
    assert len({tuple(t) for t in tokens0}) > 1
    # A row alone equals the same row inside the batch.
    for i in range(len(sampled)):
        alone = engine.call("sample", {"rows": [sampled[i]]})["rows"][0]["samples"]
        for s, (x, y) in enumerate(zip(alone, first["rows"][i]["samples"])):
            assert torch.equal(x["tokens"], y["tokens"]), (i, s)
            assert_close(f"row{i} sample{s} alone vs batch", x["logprobs"], y["logprobs"], 1e-5, absolute=True)
    # Stop tokens end a sequence (the stop token is the last one returned); others run to length.
    greedy = engine.call("sample", {"rows": [row("a", prompts[0], max_tokens=8)]})["rows"][0]["samples"][0]
    stop = int(greedy["tokens"][3])
    cut = greedy["tokens"].tolist().index(stop) + 1
    stopped = engine.call("sample", {"rows": [row("a", prompts[0], max_tokens=8, stop_token_ids=[stop]),
                                              row("b", prompts[1], max_tokens=0)]})
    got = stopped["rows"][0]["samples"][0]
    assert got["stop_reason"] == "stop" and got["tokens"].tolist() == greedy["tokens"][:cut].tolist()
    assert stopped["rows"][1]["samples"][0]["stop_reason"] == "length"
    assert len(stopped["rows"][1]["samples"][0]["tokens"]) == 0


def test_sample_rejects_bad_requests(engine: Engine, reference_models: Path) -> None:
    load(engine, reference_models / "qwen3")
    from engine_harness import EngineError
    p = torch.tensor([1, 2, 3])
    for bad in [row("nope", p), row("", torch.tensor([300])), row("", p, top_p=0.0), row("", p, temperature=-1.0),
                row("", p, num_samples=0)]:
        with pytest.raises(EngineError):
            engine.call("sample", {"rows": [bad]})
