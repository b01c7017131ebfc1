"""Checks shared by the sampler tests of every family."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from engine_harness import Engine
from numerics import assert_close


def assert_samples_match_training_forward(engine: Engine, results: Mapping[int, Any] | Sequence[Any],
                                          adapters: Sequence[str], prompts: Sequence[torch.Tensor],
                                          max_tokens: int, tol: float = 1e-5) -> float:
    """Every sample of row i (results[i], for adapter adapters[i] on prompts[i]) ran to
    `max_tokens`, and its token log-probs and the row's prompt log-probs equal what the
    training forward gives for the same sequence (absolute `tol`). Returns the largest
    difference."""
    worst = 0.0
    for i, (a, p) in enumerate(zip(adapters, prompts)):
        result = results[i]
        for s, got in enumerate(result["samples"]):
            assert got["stop_reason"] == "length" and len(got["tokens"]) == max_tokens
            seq = torch.cat([p, got["tokens"]])
            datum = {"input_tokens": seq[:-1], "target_tokens": seq[1:]}
            fwd = engine.call("forward", {"ops": [{"adapter_id": a, "datums": [datum]}]})["ops"][0]["logprobs"][0]
            worst = max(worst, assert_close(f"row{i} sample{s} token logprobs", got["logprobs"],
                                            fwd[len(p) - 1:], tol, absolute=True))
            worst = max(worst, assert_close(f"row{i} prompt logprobs", result["prompt_logprobs"],
                                            fwd[:len(p) - 1], tol, absolute=True))
    return worst


def assert_greedy_matches_generate(engine: Engine, refs: Mapping[str, torch.nn.Module],
                                   cases: Sequence[tuple[str, torch.Tensor]], max_tokens: int, gap: float,
                                   label: str) -> None:
    """All (adapter, prompt) cases decode greedily in one sample call; each equals `refs[adapter]`'s
    transformers generate up to the first position where the reference's top-2 logit gap is
    below `gap` (there a float rounding may pick the other token; that position and the rest
    are not compared). At least 90 % of the cases must compare over all `max_tokens`."""
    from test_sampler_pool import row  # the sample-row builder the sampler tests share

    reply = engine.call("sample", {"rows": [row(a, p, max_tokens=max_tokens) for a, p in cases]})
    full = 0
    for i, (a, p) in enumerate(cases):
        got = reply["rows"][i]["samples"][0]
        assert got["stop_reason"] == "length" and len(got["tokens"]) == max_tokens
        with torch.no_grad():
            out = refs[a].generate(p.unsqueeze(0), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                   do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                   eos_token_id=None, pad_token_id=0, output_logits=True,
                                   return_dict_in_generate=True)
        ref_tokens = out.sequences[0, len(p):].tolist()
        compared = max_tokens
        for t, logits in enumerate(out.logits):
            top2 = logits[0].topk(2).values
            if float(top2[0] - top2[1]) < gap:
                compared = t + 1
                break
        n_exact = compared if compared == max_tokens else compared - 1
        assert got["tokens"][:n_exact].tolist() == ref_tokens[:n_exact], (i, a, got["tokens"], ref_tokens)
        full += compared == max_tokens
    adapters = len({a for a, _ in cases})
    print(f"{label}: {len(cases)} sequences ({adapters} adapters, the base counted as one), {full} compared over "
          f"all {max_tokens} tokens")
    assert full >= 0.9 * len(cases)
