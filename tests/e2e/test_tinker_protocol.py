"""The rest of the Tinker protocol of the pinned SDK (0.38.0), through the real SDK:
gspo and stable_reinforce (record_stability_info, sequence_id, provenance), soft-target
cross_entropy ([N, K] targets), target_prompt_logprobs, prompt_alt_tokens_k, top-k up to 64,
stop semantics (None / [] / strings / ids), the default LoRA rank limit and run user_metadata.

Numbers are checked against the server's own training forward (the same weights, the same
formula written out here in numpy) or, for the losses, against the formulas of docs/losses.md
computed from the log-probs the call returns. The losses themselves are checked against
PyTorch at 1e-10 in tests/engine.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "1")

import tinker  # noqa: E402
from tinker import types  # noqa: E402

from e2e_support.server import LaunchServer, ServerProcess  # noqa: E402
from e2e_support.training import KEYS, auth_overrides  # noqa: E402
from test_tinker_sdk import MODEL_NAME, SEQ, datum, logprobs_of, lora_client, resolved, service  # noqa: E402

EOS = 2  # models/tiny-qwen3/generation_config.json


@pytest.fixture
def tinker_server(launch_server: LaunchServer, tmp_path: Path) -> ServerProcess:
    return launch_server(auth_overrides(storage={"data_dir": str(tmp_path / "data")}))


def forward_lp(training: Any, inputs: list[int], targets: list[int]) -> np.ndarray:
    d = types.Datum(model_input=types.ModelInput.from_ints(inputs),
                    loss_fn_inputs={"target_tokens": targets, "weights": [1.0] * len(targets)})
    return logprobs_of(training.forward([d], "cross_entropy").result())[0]


# ---- limits and run metadata ---------------------------------------------------------------------

def test_rank_128_and_user_metadata(launch_server: LaunchServer, tmp_path: Path) -> None:
    # The test config pins max_lora_rank: 64; 128 is the documented default (print-config's
    # check in test_config_cli.py), set here as the default is.
    server = launch_server(auth_overrides(storage={"data_dir": str(tmp_path / "data")},
                                          limits={"max_lora_rank": 128}))
    svc = service(server, KEYS["alice"])
    metadata = {"renderer_name": "qwen3", "recipe": "on_policy_distillation"}
    training = resolved(svc.create_lora_training_client(base_model=MODEL_NAME, rank=128, user_metadata=metadata))
    assert training.get_info().lora_rank == 128
    run_id = training.get_info().model_id
    rest = svc.create_rest_client()
    run = rest.get_training_run(run_id).result()
    assert run.user_metadata == metadata
    listed = [r for r in rest.list_training_runs().result().training_runs if r.training_run_id == run_id]
    assert listed[0].user_metadata == metadata
    # A run without metadata reports none; too-large metadata (limit + 1 byte) is refused.
    plain = lora_client(svc, rank=4)
    assert rest.get_training_run(plain.get_info().model_id).result().user_metadata is None
    with pytest.raises(tinker.BadRequestError, match="user_metadata"):
        # {"k": "<v>"} serialises to 8 + len(v) bytes.
        resolved(svc.create_lora_training_client(base_model=MODEL_NAME, rank=4,
                                                 user_metadata={"k": "x" * (16 * 1024 - 8 + 1)}))
    with pytest.raises(tinker.BadRequestError, match="rank"):
        resolved(svc.create_lora_training_client(base_model=MODEL_NAME, rank=129))


# ---- stop semantics --------------------------------------------------------------------------------

def test_stop_none_keeps_eos_and_empty_list_disables_it(tinker_server: ServerProcess) -> None:
    svc = service(tinker_server, KEYS["alice"])
    training = lora_client(svc, rank=8)
    prompt = SEQ[:4]
    # Teach the adapter to answer the prompt with EOS, so that sampling meets it at once.
    teach = [datum(prompt + [EOS], [0.0] * (len(prompt) - 1) + [1.0])]
    for _ in range(20):
        training.forward_backward(teach, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampler = resolved(training.save_weights_and_get_sampling_client())
    model_input = types.ModelInput.from_ints(prompt)

    def sample(stop: Any) -> Any:
        params = types.SamplingParams(max_tokens=6, temperature=0.0, seed=1, stop=stop)
        return sampler.sample(model_input, num_samples=1, sampling_params=params).result().sequences[0]

    default = sample(None)
    assert default.tokens == [EOS] and default.stop_reason == "stop"
    unstopped = sample([])
    assert len(unstopped.tokens) == 6 and unstopped.stop_reason == "length"
    assert unstopped.tokens[0] == EOS  # EOS was generated and did not stop it
    # A non-empty token list adds to EOS (EOS still stops) ...
    with_ids = sample([unstopped.tokens[1]] if unstopped.tokens[1] != EOS else [7])
    assert with_ids.tokens == [EOS] and with_ids.stop_reason == "stop"
    # ... and so does a list of strings.
    with_strings = sample(["zzzz-never"])
    assert with_strings.tokens == [EOS] and with_strings.stop_reason == "stop"


# ---- gspo ---------------------------------------------------------------------------------------

def test_gspo_matches_the_documented_formula(tinker_server: ServerProcess) -> None:
    svc = service(tinker_server, KEYS["alice"])
    training = lora_client(svc, rank=8)
    n = len(SEQ) - 1
    lp = forward_lp(training, SEQ[:-1], SEQ[1:])
    rng = np.random.default_rng(0)
    adv = rng.normal(size=n).astype(np.float32)
    ratio_mask = np.asarray([0, 0, 1, 1, 1, 1, 1, 1, 1], dtype=np.float32)
    for shift, config in ((0.0005, None), (-0.3, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
                          (0.05, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})):
        q = (lp + shift).astype(np.float32)  # the sampler's log-probs, shifted
        d = types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]),
                        loss_fn_inputs={"target_tokens": SEQ[1:], "logprobs": q, "advantages": adv,
                                        "sequence_ratio_mask": ratio_mask})
        out = training.forward_backward([d], "gspo", config).result()
        got_lp = logprobs_of(out)[0]
        lo, hi = (config or {}).get("clip_low_threshold", 1 - 3e-4), (config or {}).get("clip_high_threshold", 1 + 4e-4)
        s = np.exp(np.mean((got_lp - q)[ratio_mask != 0]))
        expected = -np.sum(np.minimum(s * adv, np.clip(s, lo, hi) * adv))
        print(f"gspo shift {shift}: s = {s:.6f}, loss:sum {out.metrics['loss:sum']:.6f} vs {expected:.6f}")
        assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()


# ---- stable_reinforce ---------------------------------------------------------------------------

def provenance_datum(prompt: list[int], seq: Any, advantage: float) -> types.Datum:
    """The cookbook's RL datum (prompt + completion, shifted by one) with its provenance."""
    tokens = list(seq.tokens)
    full = prompt + tokens
    n_prompt = len(prompt) - 1
    d = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:],
                                    "advantages": [0.0] * n_prompt + [advantage] * len(tokens)})
    return d.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=0, length=len(prompt)),
                     types.SampledProvenanceSpan(sequence_id=seq.sequence_id, offset=0, length=len(tokens) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=n_prompt),
                        types.SampledProvenanceSpan(sequence_id=seq.sequence_id, offset=0, length=len(tokens))])


def test_stable_reinforce_protocol_end_to_end(tinker_server: ServerProcess) -> None:
    svc = service(tinker_server, KEYS["alice"])
    training = lora_client(svc, rank=8)
    prompt = SEQ[:4]
    losses = []
    for step in range(3):
        sampler = resolved(training.save_weights_and_get_sampling_client(record_stability_info=True))
        result = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=4,
                                sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0, seed=10 + step,
                                                                     stop=[])).result()
        ids = [s.sequence_id for s in result.sequences]
        assert len(set(ids)) == 4 and all(ids)
        advantages = [1.0, -1.0, 0.5, -0.5]
        data = [provenance_datum(prompt, s, a) for s, a in zip(result.sequences, advantages)]
        kl_coeff, cap = 0.1, 2.0
        out = training.forward_backward(data, "stable_reinforce", {"kl_coeff": kl_coeff}).result()
        for key in ("loss:sum", "kl_sampler:mean", "truncated_fraction:mean", "num_tokens:sum"):
            assert key in out.metrics, key
        # The documented formula on the returned log-probs and the recorded sampler log-probs.
        expected = 0.0
        for seq, adv, lp in zip(result.sequences, advantages, logprobs_of(out)):
            sampled_lp = lp[len(prompt) - 1:]
            q = np.asarray(seq.logprobs, dtype=np.float64)
            # On-policy (the snapshot is the current weights): the ratios are 1.
            np.testing.assert_allclose(sampled_lp, q, atol=1e-4, rtol=0)
            r = np.exp(sampled_lp - q)
            diff = q - sampled_lp
            expected += float(np.sum(-np.minimum(r, cap) * adv * sampled_lp
                                     + kl_coeff * (np.exp(diff) - diff - 1)))
        print(f"metrics {out.metrics}, expected loss {expected}")
        assert out.metrics["num_tokens:sum"] == sum(len(s.tokens) for s in result.sequences)
        assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4)
        losses.append(out.metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    print(f"stable_reinforce loss:sum per step {losses}")

    # Bad provenance fails the op (a user error naming the problem); the model goes on.
    seq = result.sequences[0]
    good = provenance_datum(prompt, seq, 1.0)
    targets = list(good.loss_fn_inputs["target_tokens"].data)
    targets[-1] = (targets[-1] + 1) % 256
    tampered = types.Datum(model_input=good.model_input,
                           loss_fn_inputs={**good.loss_fn_inputs, "target_tokens": targets},
                           model_input_spans=good.model_input_spans, loss_fn_input_spans=good.loss_fn_input_spans)
    cases = [
        (tampered, "the recorded sequence has"),
        (types.Datum(model_input=good.model_input, loss_fn_inputs=good.loss_fn_inputs), "provenance"),
    ]
    for bad, needle in cases:
        with pytest.raises(tinker.RequestFailedError, match=needle) as err:
            training.forward_backward([bad], "stable_reinforce").result()
        assert err.value.category == types.RequestErrorCategory.User
    # Another tenant cannot name alice's sequences.
    bob = lora_client(service(tinker_server, KEYS["bob"]), rank=4)
    with pytest.raises(tinker.RequestFailedError, match="unknown or expired"):
        bob.forward_backward([good], "stable_reinforce").result()
    # Without record_stability_info nothing is recorded.
    plain = resolved(training.save_weights_and_get_sampling_client())
    unrecorded = plain.sample(types.ModelInput.from_ints(prompt), num_samples=1,
                              sampling_params=types.SamplingParams(max_tokens=3, seed=5, stop=[])).result()
    with pytest.raises(tinker.RequestFailedError, match="unknown or expired"):
        training.forward_backward([provenance_datum(prompt, unrecorded.sequences[0], 1.0)],
                                  "stable_reinforce").result()
    assert training.forward_backward([good], "stable_reinforce").result().metrics["loss:sum"] is not None


# ---- soft targets -------------------------------------------------------------------------------

def test_soft_target_cross_entropy_through_the_sdk(tinker_server: ServerProcess) -> None:
    """The cookbook's top-k distillation datum: target_tokens and weights [N, K] as torch
    tensors (the SDK sends them sparse CSR), zero rows where nothing is distilled."""
    svc = service(tinker_server, KEYS["alice"])
    training = lora_client(svc, rank=8)
    n, k = len(SEQ) - 1, 5
    g = torch.Generator().manual_seed(0)
    targets = torch.randint(0, 256, (n, k), generator=g)
    weights = torch.softmax(torch.randn(n, k, generator=g), -1)
    weights[:3] = 0  # prompt positions: nothing to distil
    d = types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]),
                    loss_fn_inputs={"target_tokens": targets, "weights": weights})
    assert d.loss_fn_inputs["target_tokens"].shape == [n, k]
    out = training.forward_backward([d], "cross_entropy").result()
    lp = out.loss_fn_outputs[0]["logprobs"].to_numpy().reshape(n, k)
    # Each column equals the training forward of that column as ordinary [N] targets.
    for j in range(k):
        np.testing.assert_allclose(lp[:, j], forward_lp(training, SEQ[:-1], targets[:, j].tolist()), atol=1e-6, rtol=0)
    expected = -float(np.sum(weights.numpy() * lp))
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    assert out.metrics["num_tokens:sum"] == n - 3
    # The gradient is the sum of the K columns' weighted gradients: one [N, K] step equals K
    # accumulated [N] steps from the same start.
    twin = resolved(svc.create_lora_training_client(base_model=MODEL_NAME, rank=8, seed=11))
    soft = resolved(svc.create_lora_training_client(base_model=MODEL_NAME, rank=8, seed=11))
    before = forward_lp(soft, SEQ[:-1], SEQ[1:])
    soft.forward_backward([d], "cross_entropy").result()
    for j in range(k):
        col = types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]),
                          loss_fn_inputs={"target_tokens": targets[:, j].tolist(), "weights": weights[:, j].tolist()})
        twin.forward_backward([col], "cross_entropy").result()
    # eps = 1 makes Adam's first step about lr * g (continuous in g, not sign(g)), so the two
    # gradients' rounding differences stay rounding-sized in the weights.
    for client in (soft, twin):
        client.optim_step(types.AdamParams(learning_rate=0.1, eps=1.0)).result()
    after_soft, after_twin = forward_lp(soft, SEQ[:-1], SEQ[1:]), forward_lp(twin, SEQ[:-1], SEQ[1:])
    assert np.max(np.abs(after_soft - before)) > 1e-4  # it moved
    np.testing.assert_allclose(after_soft, after_twin, atol=1e-5, rtol=0)
    # Other losses refuse 2-D targets; K above the limit is refused.
    with pytest.raises(tinker.RequestFailedError, match="only accepted by cross_entropy"):
        adv = types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": targets,
                                                                     "logprobs": torch.zeros(n, k),
                                                                     "advantages": torch.ones(n, k)})
        training.forward_backward([adv], "importance_sampling").result()
    wide = types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": torch.zeros(n, 65, dtype=torch.long),
                                                                  "weights": torch.ones(n, 65)})
    with pytest.raises((tinker.BadRequestError, tinker.RequestFailedError), match="65"):
        training.forward_backward([wide], "cross_entropy").result()


# ---- sampling options -----------------------------------------------------------------------------

def test_target_prompt_logprobs_alt_tokens_and_topk_64(tinker_server: ServerProcess) -> None:
    svc = service(tinker_server, KEYS["alice"])
    training = lora_client(svc, rank=8)
    training.forward_backward([datum(SEQ)], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = resolved(training.save_weights_and_get_sampling_client())
    prompt = SEQ[:8]
    rows, k = len(prompt) - 1, 3
    ids = np.asarray([[(7 * i + 13 * j) % 256 for j in range(k)] for i in range(rows)], dtype=np.int64)
    ids[1, 2] = -1  # asks nothing
    one = types.SamplingParams(max_tokens=1, temperature=0.7, seed=3)
    out = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=one,
                         target_prompt_logprobs=types.TensorData.from_numpy(ids), prompt_alt_tokens_k=4).result()
    got = np.asarray(out.target_prompt_logprobs.data, dtype=np.float64).reshape(rows, k)
    assert out.target_prompt_logprobs.shape == [rows, k]
    # Row i is scored at prompt position i + 1: the training forward of the prompt with column j as targets.
    for j in range(k):
        ref = forward_lp(training, prompt[:-1], [int(max(t, 0)) for t in ids[:, j]])
        asked = ids[:, j] >= 0
        np.testing.assert_allclose(got[asked, j], ref[asked], atol=1e-5, rtol=0)
        assert np.all(got[~asked, j] == 0.0)
    # prompt_alt_tokens: [P - 1, 4] draws, their logprobs the forward's, reproducible by seed.
    alt = out.prompt_alt_tokens
    alt_ids = np.asarray(alt.tokens.data, dtype=np.int64).reshape(rows, 4)
    alt_lps = np.asarray(alt.logprobs.data, dtype=np.float64).reshape(rows, 4)
    for j in range(4):
        np.testing.assert_allclose(alt_lps[:, j], forward_lp(training, prompt[:-1], alt_ids[:, j].tolist()),
                                   atol=1e-5, rtol=0)
    again = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=one,
                           prompt_alt_tokens_k=4).result()
    assert np.array_equal(np.asarray(again.prompt_alt_tokens.tokens.data).reshape(rows, 4), alt_ids)
    other = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1,
                           sampling_params=types.SamplingParams(max_tokens=1, temperature=0.7, seed=4),
                           prompt_alt_tokens_k=4).result()
    assert not np.array_equal(np.asarray(other.prompt_alt_tokens.tokens.data).reshape(rows, 4), alt_ids)
    # At temperature 0 every draw is the most likely token (top-1 of topk_prompt_logprobs).
    greedy = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1,
                            sampling_params=types.SamplingParams(max_tokens=1, temperature=0.0),
                            prompt_alt_tokens_k=2, topk_prompt_logprobs=64).result()
    top = greedy.topk_prompt_logprobs
    assert all(len(top[i]) == 64 for i in range(1, len(prompt)))
    g_ids = np.asarray(greedy.prompt_alt_tokens.tokens.data).reshape(rows, 2)
    assert [int(g_ids[i, 0]) for i in range(rows)] == [top[i + 1][0][0] for i in range(rows)]
    assert np.all(g_ids[:, 0] == g_ids[:, 1])
    # Sparse (CSR) requests come back in the same layout.
    dense = torch.full((rows, k), -1, dtype=torch.long)
    dense[2, 0], dense[5, 2] = 11, 42
    sparse = types.TensorData.from_torch_sparse(dense, pad_value=-1)
    out = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=one,
                         target_prompt_logprobs=sparse).result()
    tp = out.target_prompt_logprobs
    if tp.sparse_crow_indices is not None:
        assert tp.sparse_crow_indices == sparse.sparse_crow_indices and tp.sparse_col_indices == sparse.sparse_col_indices
    lp11 = forward_lp(training, prompt[:-1], [11] * rows)[2]
    lp42 = forward_lp(training, prompt[:-1], [42] * rows)[5]
    values = np.asarray(tp.data, dtype=np.float64)
    picked = values if tp.sparse_crow_indices is not None else values.reshape(rows, k)[[2, 5], [0, 2]]
    np.testing.assert_allclose(picked, [lp11, lp42], atol=1e-5, rtol=0)
    # Limits: K and k above 64 are refused naming the field.
    for kwargs, field in (({"prompt_alt_tokens_k": 65}, "prompt_alt_tokens_k"), ({"topk_sample_logprobs": 65},
                                                                                    "topk_sample_logprobs")):
        with pytest.raises(tinker.BadRequestError, match=field):
            sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=one, **kwargs).result()
