"""twinkle.v1.SamplerService through a real server: sampling sessions on checkpoints and live
snapshots, against transformers + PEFT and against the server's own training forward."""

from __future__ import annotations

import json
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
from twinkle_client._proto.twinkle.v1 import sampler_pb2 as spb
from twinkle_client._proto.twinkle.v1 import sampler_pb2_grpc as sgrpc
from twinkle_client._proto.twinkle.v1 import training_pb2 as tpb

from e2e_support import prom
from e2e_support.training import KEYS, Client, auth_overrides, batch, state_dict

LaunchServer = Callable[..., Any]


class Sampler:
    """SamplerService stub sending one tenant's key."""

    def __init__(self, client: Client) -> None:
        self.stub = sgrpc.SamplerServiceStub(client.channel)
        self.metadata = client.metadata

    def call(self, method: str, request: Any, timeout: float = 120.0) -> Any:
        return getattr(self.stub, method)(request, metadata=self.metadata, timeout=timeout)

    def sample(self, session: str, prompts: list[list[int]], **params: Any) -> spb.SampleResponse:
        return self.call("Sample", spb.SampleRequest(sampling_session_id=session,
                                                     prompts=[spb.Prompt(tokens=p) for p in prompts],
                                                     params=spb.SamplingParams(**params)))


def vocab(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def max_positions(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["max_position_embeddings"])


def prompts_for(seed: int, n_vocab: int, count: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n_vocab, int(rng.integers(3, 9))).tolist() for _ in range(count)]


def trained_adapter(c: Client, name: str, n_vocab: int, steps: int = 3, lr: float = 5e-2) -> None:
    c.call("AddAdapter", tpb.AddAdapterRequest(adapter_name=name, config=tpb.LoraConfig(
        r=8, lora_alpha=16, seed=11, target_modules=["all-linear"])))
    c.call("SetOptimizer", tpb.SetOptimizerRequest(adapter_name=name, optimizer_cls="AdamW", config={"lr": lr}))
    train(c, name, n_vocab, range(steps))


def train(c: Client, name: str, n_vocab: int, steps: Any) -> None:
    for step in steps:
        c.call("ForwardBackward", tpb.ForwardRequest(adapter_name=name, inputs=batch(100 + step, n_vocab, 3)))
        c.call("ClipGradAndStep", tpb.ClipGradNormRequest(adapter_name=name, max_grad_norm=1.0))


def forward_logps(c: Client, name: str, tokens: list[int]) -> np.ndarray:
    """log p(tokens[i + 1] | tokens[:i + 1]) from the server's training forward."""
    out = c.call("ForwardOnly", tpb.ForwardRequest(adapter_name=name, inputs=[
        tpb.InputFeature(input_ids=tokens, labels=tokens)])).result
    return np.asarray(out.sequences[0].logps[:-1], dtype=np.float64)


def expect_code(code: grpc.StatusCode, fn: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert info.value.code() == code, f"{info.value.code()}: {info.value.details()}"
    return info.value


def greedy_reference(model: Any, prompt: list[int], max_new: int, **generate_kw: Any) -> tuple[list[int], list[float]]:
    """transformers generate, greedy (stopping at the model's EOS, as the server does), with
    the top-2 gap of the (processed) scores at each step."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        # An explicit mask: otherwise generate masks prompt tokens equal to the pad id (0 here).
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, **generate_kw)
    tokens = out.sequences[0, len(prompt):].tolist()
    gaps = []
    for scores in out.scores:
        top2 = torch.topk(scores[0].double(), 2).values
        gaps.append(float(top2[0] - top2[1]))
    return tokens, gaps


def compare_greedy(ours: list[int], ref: list[int], gaps: list[float]) -> bool:
    """Tokens must agree until the reference's top-2 gap drops below 1e-4 (a tie, where float
    order may pick either). Returns whether the whole length was compared."""
    for i, b in enumerate(ref):
        if gaps[i] < 1e-4:
            return False
        assert i < len(ours) and ours[i] == b, \
            f"token {i} of {ref}: ours {ours[i:i + 1]}, transformers {b} (gap {gaps[i]:.3e})"
    assert len(ours) == len(ref), f"ours {ours}, transformers {ref}"
    return True


# ---- numbers against references -------------------------------------------------------------

def test_sampler_weights_checkpoint_matches_peft_generate_and_training_logprobs(
        launch_server: LaunchServer, tiny_model: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    server = launch_server()
    c = Client(server.grpc_address, None)
    s = Sampler(c)
    n_vocab = vocab(tiny_model)
    trained_adapter(c, "rl", n_vocab)
    saved = c.call("Save", tpb.SaveRequest(adapter_name="rl", name="for-sampler", is_sampler=True))
    assert saved.twinkle_path.endswith("/sampler_weights/for-sampler")
    session = s.call("CreateSamplingSession", spb.CreateSamplingSessionRequest(model_path=saved.twinkle_path))
    assert session.model_path == saved.twinkle_path
    prompts = prompts_for(5, n_vocab, 8)
    reply = s.sample(session.sampling_session_id, prompts, max_tokens=10, temperature=0.0, prompt_logprobs=True)
    assert len(reply.results) == len(prompts)

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model), torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, saved.checkpoint_dir).eval()
    full, worst_lp, worst_prompt = 0, 0.0, 0.0
    for prompt, result in zip(prompts, reply.results):
        seq = result.sequences[0]
        assert seq.stop_reason == ("length" if len(seq.tokens) == 10 else "stop")
        ref, gaps = greedy_reference(model, prompt, 10)
        full += compare_greedy(list(seq.tokens), ref, gaps)
        # Sampled-token and prompt log-probs equal the server's own training forward.
        logps = forward_logps(c, "rl", prompt + list(seq.tokens))
        got = np.asarray(seq.logprobs, dtype=np.float64)
        worst_lp = max(worst_lp, float(np.max(np.abs(got - logps[len(prompt) - 1:]))))
        plp = np.asarray(result.prompt_logprobs, dtype=np.float64)
        assert len(plp) == len(prompt) and np.isnan(plp[0])
        worst_prompt = max(worst_prompt, float(np.max(np.abs(plp[1:] - logps[:len(prompt) - 1]))))
    print(f"greedy vs transformers+PEFT: {full}/{len(prompts)} compared to full length; "
          f"sampled logprobs vs forward {worst_lp:.2e}, prompt logprobs vs forward {worst_prompt:.2e}")
    assert full >= 0.9 * len(prompts)
    assert worst_lp <= 1e-5 and worst_prompt <= 1e-5


def test_repetition_penalty_matches_transformers_generate(launch_server: LaunchServer, tiny_model: Path) -> None:
    """SamplingParams.repetition_penalty (Twinkle's field) through SamplerService: greedy equals
    transformers generate(repetition_penalty=...) on the base model; 0 means off; a negative
    one is INVALID_ARGUMENT naming the field."""
    from transformers import AutoModelForCausalLM

    server = launch_server()
    s = Sampler(Client(server.grpc_address, None))
    session = s.call("CreateSamplingSession", spb.CreateSamplingSessionRequest()).sampling_session_id
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    prompts = prompts_for(7, vocab(tiny_model), 6)
    full = changed = 0
    for penalty in (1.5, 0.7):
        reply = s.sample(session, prompts, max_tokens=12, temperature=0.0, repetition_penalty=penalty)
        plain = s.sample(session, prompts, max_tokens=12, temperature=0.0, repetition_penalty=0.0)
        for prompt, got, off in zip(prompts, reply.results, plain.results):
            ref, gaps = greedy_reference(model, prompt, 12, repetition_penalty=penalty)
            full += compare_greedy(list(got.sequences[0].tokens), ref, gaps)
            changed += list(got.sequences[0].tokens) != list(off.sequences[0].tokens)
    print(f"repetition_penalty vs transformers generate: {full}/{2 * len(prompts)} compared to full length, "
          f"{changed} changed by the penalty")
    assert full >= len(prompts) and changed >= len(prompts) // 2
    err = expect_code(grpc.StatusCode.INVALID_ARGUMENT,
                      lambda: s.sample(session, prompts[:1], max_tokens=2, repetition_penalty=-1.0))
    assert "repetition_penalty" in err.details()


def check_top_k(name: str, tops: Any, ref_lsm: torch.Tensor, k: int, tol: float = 1e-5) -> float:
    """Top-k entries (one TopLogprobs-like per position: token_ids, logprobs) against torch.topk
    of the reference's log_softmax rows: logprobs position by position, each reported id's own
    reference logprob, ids equal except where neighbouring reference logprobs are within tol."""
    worst = 0.0
    assert len(tops) == ref_lsm.shape[0], name
    for pos, top in enumerate(tops):
        ids, lps = list(top.token_ids), np.asarray(top.logprobs, dtype=np.float64)
        assert len(ids) == k and len(lps) == k, (name, pos)
        ref_values, ref_ids = torch.topk(ref_lsm[pos].double(), k + 1)
        worst = max(worst, float(np.max(np.abs(lps - ref_values[:k].numpy()))),
                    float(np.max(np.abs(lps - ref_lsm[pos].double()[ids].numpy()))))
        for j in range(k):
            if ids[j] != int(ref_ids[j]):
                near = [abs(float(ref_values[j] - ref_values[n])) < tol for n in (j - 1, j + 1) if 0 <= n <= k]
                assert any(near), f"{name} position {pos}: ids {ids} vs {ref_ids[:k].tolist()}"
    assert worst <= tol, f"{name}: top-k logprobs off by {worst:.2e}"
    return worst


def test_top_logprobs_match_transformers_topk(launch_server: LaunchServer, tiny_model: Path) -> None:
    """Top-k at generated and prompt positions, through SamplerService and through the SDK's
    vLLMSampler (Twinkle's `logprobs: k`, `prompt_logprobs: k`), equal torch.topk of
    log_softmax of transformers + PEFT logits on the same sampler_weights checkpoint."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from twinkle_client import _context, init_twinkle_client
    from twinkle_client.sampler import vLLMSampler

    server = launch_server()
    c = Client(server.grpc_address, None)
    s = Sampler(c)
    n_vocab = vocab(tiny_model)
    trained_adapter(c, "topk", n_vocab)
    saved = c.call("Save", tpb.SaveRequest(adapter_name="topk", name="topk", is_sampler=True))
    session = s.call("CreateSamplingSession", spb.CreateSamplingSessionRequest(model_path=saved.twinkle_path))
    prompts = prompts_for(9, n_vocab, 4)
    reply = s.sample(session.sampling_session_id, prompts, max_tokens=6, temperature=1.0, seed=5, num_samples=2,
                     prompt_logprobs=True, top_logprobs=5, prompt_top_logprobs=3, ignore_eos=True)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, saved.checkpoint_dir).eval()

    def reference(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)

    worst = 0.0
    for prompt, result in zip(prompts, reply.results):
        # Aligned like prompt_logprobs: [i] predicts prompt[i]; [0] is empty.
        assert len(result.prompt_top_logprobs) == len(prompt) and not result.prompt_top_logprobs[0].token_ids
        for seq in result.sequences:
            lsm = reference(prompt + list(seq.tokens))
            worst = max(worst, check_top_k("generated", seq.top_logprobs, lsm[len(prompt) - 1:-1], 5))
            for token, lp, top in zip(seq.tokens, seq.logprobs, seq.top_logprobs):
                if token in top.token_ids:
                    assert top.logprobs[list(top.token_ids).index(token)] == lp
        worst = max(worst, check_top_k("prompt", result.prompt_top_logprobs[1:], lsm[:len(prompt) - 1], 3))
    # Without asking: nothing.
    plain = s.sample(session.sampling_session_id, prompts[:1], max_tokens=2)
    assert not plain.results[0].prompt_top_logprobs and not plain.results[0].sequences[0].top_logprobs

    # The SDK: Twinkle's shapes.
    init_twinkle_client(f"grpc://{server.grpc_address}", "tml-any")
    try:
        sampler = vLLMSampler(model_id="ms://Qwen/Qwen3.5-4B")
        out = sampler.sample([{"input_ids": p} for p in prompts],
                             {"max_tokens": 5, "temperature": 0.7, "seed": 1, "logprobs": 4, "prompt_logprobs": 2},
                             adapter_uri=saved.twinkle_path)
        for prompt, response in zip(prompts, out):
            assert response.topk_prompt_logprobs[0] is None and response.prompt_logprobs[0] is None
            assert len(response.topk_prompt_logprobs) == len(prompt)
            seq = response.sequences[0]
            lsm = reference(prompt + seq.tokens)
            tops = [spb.TopLogprobs(token_ids=[t for t, _ in pos], logprobs=[lp for _, lp in pos])
                    for pos in seq.logprobs]
            worst = max(worst, check_top_k("SDK generated", tops, lsm[len(prompt) - 1:-1], 4))
            tops = [spb.TopLogprobs(token_ids=[t for t, _ in pos], logprobs=[lp for _, lp in pos])
                    for pos in response.topk_prompt_logprobs[1:]]
            worst = max(worst, check_top_k("SDK prompt", tops, lsm[:len(prompt) - 1], 2))
        # logprobs = 1: the sampled token's own, as before.
        one = sampler.sample([{"input_ids": prompts[0]}], {"max_tokens": 3, "logprobs": 1, "seed": 2},
                             adapter_uri=saved.twinkle_path)[0]
        assert [[t] for t in one.sequences[0].tokens] == [[pos[0][0]] for pos in one.sequences[0].logprobs]
        assert one.topk_prompt_logprobs is None
        with pytest.raises(ValueError, match="sampling_params.logprobs"):
            sampler.sample([{"input_ids": prompts[0]}], {"max_tokens": 3, "logprobs": 21})
        sampler.close()
    finally:
        _context.set_current(None)
    print(f"top-k vs transformers+PEFT: largest logprob difference {worst:.2e}")


def test_live_snapshot_keeps_the_weights_of_its_moment(launch_server: LaunchServer, tiny_model: Path) -> None:
    server = launch_server()
    c = Client(server.grpc_address, None)
    s = Sampler(c)
    n_vocab = vocab(tiny_model)
    trained_adapter(c, "live", n_vocab, steps=2)
    prompt = prompts_for(9, n_vocab, 1)[0]
    before = forward_logps(c, "live", prompt + prompt)
    snap = s.call("SnapshotAdapter", spb.SnapshotAdapterRequest(adapter_name="live")).sampling_session_id
    first = s.sample(snap, [prompt + prompt[:1]], max_tokens=6, temperature=0.0, prompt_logprobs=True).results[0]
    train(c, "live", n_vocab, range(2, 6))  # the adapter moves on
    after = forward_logps(c, "live", prompt + prompt)
    assert np.max(np.abs(after - before)) > 1e-3, "training did not change the adapter"
    again = s.sample(snap, [prompt + prompt[:1]], max_tokens=6, temperature=0.0, prompt_logprobs=True).results[0]
    assert list(again.sequences[0].tokens) == list(first.sequences[0].tokens)
    assert list(again.sequences[0].logprobs) == list(first.sequences[0].logprobs)
    snap_plp = np.asarray(again.prompt_logprobs[1:len(prompt) + 1], dtype=np.float64)
    print(f"snapshot vs adapter at snapshot time: {np.max(np.abs(snap_plp - before[:len(prompt)])):.2e}; "
          f"vs the adapter now: {np.max(np.abs(snap_plp - after[:len(prompt)])):.2e}")
    assert np.max(np.abs(snap_plp - before[:len(prompt)])) <= 1e-5
    # A new snapshot sees the new weights.
    fresh = s.call("SnapshotAdapter", spb.SnapshotAdapterRequest(adapter_name="live")).sampling_session_id
    now = s.sample(fresh, [prompt + prompt[:1]], max_tokens=1, prompt_logprobs=True).results[0]
    assert np.max(np.abs(np.asarray(now.prompt_logprobs[1:len(prompt) + 1]) - after[:len(prompt)])) <= 1e-5


def test_seeds_samples_and_stops(launch_server: LaunchServer, tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    server = launch_server()
    s = Sampler(Client(server.grpc_address, None))
    n_vocab = vocab(tiny_model)
    base = s.call("CreateSamplingSession", spb.CreateSamplingSessionRequest()).sampling_session_id
    prompts = prompts_for(3, n_vocab, 2)
    one = s.sample(base, prompts, max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, num_samples=4)
    two = s.sample(base, prompts, max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, num_samples=4)
    other = s.sample(base, prompts, max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=99, num_samples=4)
    tokens = lambda r: [[list(q.tokens) for q in p.sequences] for p in r.results]  # noqa: E731
    assert all(len(p.sequences) == 4 for p in one.results)
    assert tokens(one) == tokens(two), "same seed, different tokens"
    assert tokens(one) != tokens(other), "different seeds, same tokens everywhere"
    assert len({tuple(t) for t in tokens(one)[0]}) > 1, "4 samples of one prompt are all equal"

    # Stop token: the third greedy token ends the sequence and is its last token.
    greedy = s.sample(base, prompts[:1], max_tokens=8, temperature=0.0).results[0].sequences[0]
    stop_id = greedy.tokens[2]
    first = list(greedy.tokens).index(stop_id)
    stopped = s.sample(base, prompts[:1], max_tokens=8, temperature=0.0, stop_token_ids=[stop_id]).results[0]
    assert list(stopped.sequences[0].tokens) == list(greedy.tokens[:first + 1])
    assert stopped.sequences[0].stop_reason == "stop"

    # Stop string: text spanning the 2nd and 3rd tokens; generation ends at the token completing it.
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    pieces = [tok.decode([t]) for t in greedy.tokens]
    text = "".join(pieces)
    start = len(pieces[0])
    stop = text[start + max(0, len(pieces[1]) - 1): start + len(pieces[1]) + 1]
    assert stop, pieces
    by_string = s.sample(base, prompts[:1], max_tokens=8, temperature=0.0, stop=[stop]).results[0].sequences[0]
    ends = next(i for i in range(1, len(pieces) + 1) if stop in "".join(pieces[:i]))
    print(f"stop string {stop!r} in {pieces}: {len(by_string.tokens)} tokens (expected {ends})")
    assert list(by_string.tokens) == list(greedy.tokens[:ends]) and by_string.stop_reason == "stop"
    assert len(by_string.logprobs) == len(by_string.tokens)

    # The match ends decoding early: the engine stops each sample within one decode chunk
    # (sampler.max_decode_steps_per_call = 8) of it, rather than running on to max_tokens.
    before = prom.value(metrics(server), "twinkle_sampler_tokens_total")
    long = s.sample(base, prompts[:1], max_tokens=300, temperature=0.0, stop=[stop], ignore_eos=True,
                    num_samples=2).results[0]
    decoded = prom.value(metrics(server), "twinkle_sampler_tokens_total") - before
    print(f"stop string with max_tokens 300: {decoded:.0f} tokens decoded for 2 samples of {ends}")
    for seq in long.sequences:
        assert list(seq.tokens) == list(greedy.tokens[:ends]) and seq.stop_reason == "stop"
    assert 2 * ends <= decoded <= 2 * (ends + 8)


# ---- tenancy, bad input, and what is freed ----------------------------------------------------

def test_sessions_are_private_and_bad_input_names_the_field(launch_server: LaunchServer, tiny_model: Path) -> None:
    server = launch_server(auth_overrides())
    alice, bob = Client(server.grpc_address, KEYS["alice"]), Client(server.grpc_address, KEYS["bob"])
    sa, sb = Sampler(alice), Sampler(bob)
    n_vocab, n_pos = vocab(tiny_model), max_positions(tiny_model)
    trained_adapter(alice, "mine", n_vocab, steps=1)
    path = alice.call("Save", tpb.SaveRequest(adapter_name="mine", name="s", is_sampler=True)).twinkle_path
    session = sa.call("CreateSamplingSession", spb.CreateSamplingSessionRequest(model_path=path)).sampling_session_id
    for label, call in [
        ("sample", lambda: sb.sample(session, [[1, 2]], max_tokens=2)),
        ("get", lambda: sb.call("GetSamplingSession", spb.SamplingSessionRequest(sampling_session_id=session))),
        ("close", lambda: sb.call("CloseSamplingSession", spb.SamplingSessionRequest(sampling_session_id=session))),
        ("session on alice's path", lambda: sb.call("CreateSamplingSession",
                                                    spb.CreateSamplingSessionRequest(model_path=path))),
        ("snapshot of alice's adapter", lambda: sb.call("SnapshotAdapter",
                                                        spb.SnapshotAdapterRequest(adapter_name="mine"))),
    ]:
        error = expect_code(grpc.StatusCode.NOT_FOUND, call)
        print(f"bob {label}: NOT_FOUND ({error.details()})")
    expect_code(grpc.StatusCode.UNAUTHENTICATED, lambda: Sampler(Client(server.grpc_address, "tml-wrong")).sample(
        session, [[1]], max_tokens=1))

    cases: list[tuple[str, dict[str, Any], list[list[int]]]] = [
        ("tokens[1]", {"max_tokens": 2}, [[1, -1]]),
        ("tokens[0]", {"max_tokens": 2}, [[n_vocab]]),
        ("tokens[0]", {"max_tokens": 2}, [[2**31 - 1]]),
        ("max_position_embeddings", {"max_tokens": n_pos}, [[1, 2]]),
        ("temperature", {"max_tokens": 2, "temperature": -1.0}, [[1]]),
        ("top_p", {"max_tokens": 2, "top_p": 1.5}, [[1]]),
        ("num_samples", {"max_tokens": 2, "num_samples": 100000}, [[1]]),
        ("prompts", {"max_tokens": 2}, []),
        ("prompts[0]", {"max_tokens": 2}, [[]]),
        ("stop_token_ids[0]", {"max_tokens": 2, "stop_token_ids": [n_vocab]}, [[1]]),
        ("top_logprobs", {"max_tokens": 2, "top_logprobs": 65}, [[1]]),
        ("prompt_top_logprobs", {"max_tokens": 2, "prompt_top_logprobs": -1}, [[1]]),
    ]
    for field, params, prompts in cases:
        error = expect_code(grpc.StatusCode.INVALID_ARGUMENT, lambda: sa.sample(session, prompts, **params))
        assert field in error.details(), (field, error.details())
        print(f"{field}: INVALID_ARGUMENT ({error.details()})")
        # Nobody is disturbed: bob's next request is served.
        bob_base = sb.call("CreateSamplingSession", spb.CreateSamplingSessionRequest()).sampling_session_id
        assert len(sb.sample(bob_base, [[1, 2, 3]], max_tokens=2, ignore_eos=True).results[0].sequences[0].tokens) == 2
        sb.call("CloseSamplingSession", spb.SamplingSessionRequest(sampling_session_id=bob_base))
    expect_code(grpc.StatusCode.NOT_FOUND, lambda: sa.sample("sampler-999", [[1]], max_tokens=1))
    assert len(sa.sample(session, [[1, 2, 3]], max_tokens=3, ignore_eos=True).results[0].sequences[0].tokens) == 3


def metrics(server: Any) -> list[prom.Sample]:
    return prom.parse(requests.get(server.http_url("/metrics"), timeout=10).text)


def test_many_mixed_requests_free_every_kv_block_and_snapshot(launch_server: LaunchServer, tiny_model: Path) -> None:
    server = launch_server()
    c = Client(server.grpc_address, None)
    s = Sampler(c)
    n_vocab = vocab(tiny_model)
    trained_adapter(c, "a", n_vocab, steps=1)
    sessions = [s.call("CreateSamplingSession", spb.CreateSamplingSessionRequest()).sampling_session_id,
                s.call("SnapshotAdapter", spb.SnapshotAdapterRequest(adapter_name="a")).sampling_session_id,
                s.call("SnapshotAdapter", spb.SnapshotAdapterRequest(adapter_name="a")).sampling_session_id]
    rng = np.random.default_rng(0)
    futures = []
    for i in range(120):
        session = sessions[i % 3]
        params = spb.SamplingParams(max_tokens=int(rng.integers(1, 12)), temperature=float(rng.choice([0.0, 1.0])),
                                    num_samples=int(rng.integers(1, 4)), seed=i,
                                    stop_token_ids=[int(rng.integers(0, n_vocab))] if i % 4 == 0 else [])
        request = spb.SampleRequest(sampling_session_id=session, prompts=[spb.Prompt(tokens=p) for p in
                                    prompts_for(i, n_vocab, int(rng.integers(1, 4)))],
                                    params=params, options=tpb.RequestOptions(return_future=True))
        futures.append(s.call("Sample", request).future_id)
    generated = 0
    for f in futures:
        while True:
            r = s.call("WaitSample", tpb.WaitFutureRequest(future_id=f, timeout_ms=10000))
            if r.done:
                break
        generated += sum(len(q.tokens) for p in r.results for q in p.sequences)
    samples = metrics(server)
    assert prom.value(samples, "twinkle_sampler_kv_blocks", state="in_use") == 0
    assert prom.value(samples, "twinkle_sampler_kv_blocks", state="total") > 0
    assert prom.value(samples, "twinkle_sampler_snapshots") == 2
    assert prom.value(samples, "twinkle_sampler_tokens_total") == generated
    for session in sessions:
        s.call("CloseSamplingSession", spb.SamplingSessionRequest(sampling_session_id=session))
    deadline = time.time() + 10
    while prom.value(metrics(server), "twinkle_sampler_snapshots") != 0 and time.time() < deadline:
        time.sleep(0.1)
    samples = metrics(server)
    print(f"120 requests, {generated} tokens: KV blocks in use "
          f"{prom.value(samples, 'twinkle_sampler_kv_blocks', state='in_use'):.0f}, snapshots "
          f"{prom.value(samples, 'twinkle_sampler_snapshots'):.0f}, sessions "
          f"{prom.value(samples, 'twinkle_sampler_sessions'):.0f}")
    assert prom.value(samples, "twinkle_sampler_snapshots") == 0
    assert prom.value(samples, "twinkle_sampler_sessions") == 0


def test_request_larger_than_the_kv_cache_is_refused_clearly(launch_server: LaunchServer, tiny_model: Path) -> None:
    server = launch_server({"sampler": {"kv_cache_blocks": 4, "kv_block_size": 4}})
    s = Sampler(Client(server.grpc_address, None))
    base = s.call("CreateSamplingSession", spb.CreateSamplingSessionRequest()).sampling_session_id
    error = expect_code(grpc.StatusCode.INVALID_ARGUMENT,
                        lambda: s.sample(base, [[1, 2, 3, 4]], max_tokens=20, num_samples=2))
    print(f"too large for the cache: {error.details()}")
    assert "KV" in error.details() or "cache" in error.details()
    # The server is fine: a request that fits runs (to max_tokens: an unseeded draw may
    # otherwise meet the model's EOS first).
    assert len(s.sample(base, [[1, 2, 3]], max_tokens=5, ignore_eos=True).results[0].sequences[0].tokens) == 5


def test_sampling_alongside_training_leaves_training_exact(launch_server: LaunchServer, tiny_model: Path) -> None:
    n_vocab = vocab(tiny_model)

    def run(with_sampling: bool) -> dict[str, np.ndarray]:
        server = launch_server(auth_overrides())
        alice = Client(server.grpc_address, KEYS["alice"])
        stop = threading.Event()
        counts = [0]

        def sample_forever() -> None:
            bob = Sampler(Client(server.grpc_address, KEYS["bob"]))
            base = bob.call("CreateSamplingSession", spb.CreateSamplingSessionRequest()).sampling_session_id
            while not stop.is_set():
                bob.sample(base, prompts_for(counts[0], n_vocab, 2), max_tokens=16, temperature=1.0, seed=counts[0])
                counts[0] += 1

        thread = threading.Thread(target=sample_forever)
        if with_sampling:
            thread.start()
        trained_adapter(alice, "t", n_vocab, steps=6)
        stop.set()
        if with_sampling:
            thread.join()
            print(f"bob sampled {counts[0]} requests while alice trained")
        weights = state_dict(alice, "t")
        server.stop()
        return weights

    alone, shared = run(False), run(True)
    worst = max(float(np.max(np.abs(alone[k] - shared[k]))) for k in alone)
    print(f"training with sampling alongside vs alone: max |dw| = {worst:.3e}")
    assert worst == 0.0
