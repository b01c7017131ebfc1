"""Top-k log-probs through the Tinker API: `topk_prompt_logprobs` and `topk_sample_logprobs`
in /api/v1/asample, driven by the real tinker SDK (pinned, unmodified) and by
tinker.v1.TinkerService, against torch.topk of log_softmax of transformers + PEFT logits on
the same sampler checkpoint."""

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
from test_tinker_sdk import MODEL_NAME, SEQ, datum, lora_client, resolved, service  # noqa: E402

TOL = 1e-5
MASK_LOGPROB = -99999.0  # the SDK's empty cell


def check_rows(name: str, rows: list[list[tuple[int, float]]], ref_lsm: torch.Tensor, k: int) -> float:
    """Per position k (token_id, logprob) pairs against torch.topk of the reference rows:
    logprobs position by position, each id's own reference logprob, ids equal except where
    neighbouring reference logprobs are within TOL."""
    assert len(rows) == ref_lsm.shape[0], name
    worst = 0.0
    for pos, row in enumerate(rows):
        assert row is not None and len(row) == k, (name, pos, row)
        ids = [t for t, _ in row]
        lps = np.asarray([lp for _, lp in row], dtype=np.float64)
        ref_values, ref_ids = torch.topk(ref_lsm[pos].double(), k + 1)
        worst = max(worst, float(np.max(np.abs(lps - ref_values[:k].numpy()))),
                    float(np.max(np.abs(lps - ref_lsm[pos].double()[ids].numpy()))))
        for j in range(k):
            if ids[j] != int(ref_ids[j]):
                assert any(abs(float(ref_values[j] - ref_values[n])) < TOL for n in (j - 1, j + 1) if 0 <= n <= k), \
                    f"{name} position {pos}: ids {ids} vs {ref_ids[:k].tolist()}"
    assert worst <= TOL, f"{name}: off by {worst:.2e}"
    return worst


@pytest.fixture
def tinker_server(launch_server: LaunchServer, tmp_path: Path) -> ServerProcess:
    return launch_server(auth_overrides(storage={"data_dir": str(tmp_path / "data")}))


def test_topk_prompt_and_sample_logprobs_match_transformers(tinker_server: ServerProcess, tiny_model: Path,
                                                            tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    svc = service(tinker_server, KEYS["alice"])
    training = lora_client(svc, rank=8)
    training.forward_backward([datum(SEQ)], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = training.save_weights_for_sampler("topk").result().path
    sampler = svc.create_sampling_client(model_path=path)
    sampler = resolved(sampler)
    (checkpoint,) = (tmp_path / "data").rglob("sampler_weights/topk/adapter_config.json")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(checkpoint.parent)).eval()

    def reference(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)

    prompt = SEQ[:7]
    out = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=2,
                         sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0, seed=3),
                         include_prompt_logprobs=True, topk_prompt_logprobs=4, topk_sample_logprobs=3).result()
    lsm = reference(prompt)
    top = out.topk_prompt_logprobs
    assert len(top) == len(prompt) and top[0] is None and out.prompt_logprobs[0] is None
    worst = check_rows("prompt", top[1:], lsm[:-1], 4)
    # The prompt token's own logprob is its top-k entry whenever it is there.
    for i in range(1, len(prompt)):
        for t, lp in top[i]:
            if t == prompt[i]:
                assert lp == pytest.approx(out.prompt_logprobs[i], abs=0)
    for seq in out.sequences:
        full = reference(prompt + list(seq.tokens))
        worst = max(worst, check_rows("sampled", seq.topk_logprobs, full[len(prompt) - 1:-1], 3))
        for token, lp, row in zip(seq.tokens, seq.logprobs, seq.topk_logprobs):
            for t, top_lp in row:
                if t == token:
                    assert top_lp == pytest.approx(lp, abs=0)

    # topk alone (no include_prompt_logprobs): the same rows; asking nothing gives nothing.
    alone = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1,
                           sampling_params=types.SamplingParams(max_tokens=1), topk_prompt_logprobs=2).result()
    assert alone.prompt_logprobs is None and alone.topk_prompt_logprobs[0] is None
    assert [r[:2] for r in top[1:]] == alone.topk_prompt_logprobs[1:]
    plain = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1,
                           sampling_params=types.SamplingParams(max_tokens=1)).result()
    assert plain.topk_prompt_logprobs is None and plain.sequences[0].topk_logprobs is None

    # prompt_logprobs_last_n: only the last n positions are scored, with the same numbers.
    last = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1,
                          sampling_params=types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                          topk_prompt_logprobs=4, prompt_logprobs_last_n=2).result()
    cut = len(prompt) - 2
    assert last.prompt_logprobs[:cut] == [None] * cut and last.prompt_logprobs[cut:] == out.prompt_logprobs[cut:]
    assert last.topk_prompt_logprobs[:cut] == [None] * cut
    assert last.topk_prompt_logprobs[cut:] == top[cut:]

    # Too wide or out of range: a user error naming the field, never ignored.
    one = types.SamplingParams(max_tokens=1)
    refused: list[tuple[dict[str, Any], str]] = [
        ({"topk_prompt_logprobs": 65}, "topk_prompt_logprobs"),
        ({"include_prompt_logprobs": True, "prompt_logprobs_last_n": len(prompt)}, "prompt_logprobs_last_n"),
        ({"prompt_alt_tokens_k": 65}, "prompt_alt_tokens_k"),
        ({"target_prompt_logprobs": types.TensorData(data=[1] * len(prompt), dtype="int64",
                                                      shape=[len(prompt), 1])}, "target_prompt_logprobs"),
    ]
    for kwargs, field in refused:
        with pytest.raises(tinker.BadRequestError, match=field):
            sampler.sample(types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=one, **kwargs).result()
    print(f"tinker SDK top-k vs transformers+PEFT: largest logprob difference {worst:.2e}")


def test_grpc_tinker_service_topk_prompt_logprobs(tinker_server: ServerProcess, tiny_model: Path) -> None:
    """tinker.v1.TinkerService/Sample with topk_prompt_logprobs: the protobuf TopkLogprobs as
    the protocol describes it (row-major length x k, row 0 all (0, -99999.0))."""
    import grpc
    from transformers import AutoModelForCausalLM
    from twinkle_client._proto.tinker.v1 import tinker_public_pb2 as tp
    from twinkle_client._proto.tinker.v1 import tinker_service_pb2 as ts
    from twinkle_client._proto.tinker.v1 import tinker_service_pb2_grpc as tsg

    stub = tsg.TinkerServiceStub(grpc.insecure_channel(tinker_server.grpc_address))
    md = [("x-api-key", KEYS["alice"])]
    session = stub.CreateSession(ts.CreateSessionRequest(), metadata=md).session_id
    sampler = stub.CreateSamplingSession(ts.CreateSamplingSessionRequest(
        session_id=session, sampling_session_seq_id=0, base_model=MODEL_NAME), metadata=md).sampling_session_id
    prompt = SEQ[:6]
    promise = stub.Sample(ts.SampleRequest(sampling_session_id=sampler, seq_id=0, prompt=prompt, num_samples=1,
                                           sampling_params=tp.SamplingParams(max_tokens=2, temperature=0.0),
                                           topk_prompt_logprobs=5), metadata=md)
    while True:
        r = stub.RetrieveFuture(ts.RetrieveFutureRequest(request_id=promise.request_id), metadata=md, timeout=60)
        if r.WhichOneof("result") != "try_again":
            break
    assert r.WhichOneof("result") == "sample", r
    topk = r.sample.topk_prompt_logprobs
    assert topk.k == 5 and topk.length == len(prompt)
    ids = np.frombuffer(topk.token_ids, dtype=np.int32).reshape(len(prompt), 5)
    lps = np.frombuffer(topk.logprobs, dtype=np.float32).reshape(len(prompt), 5)
    assert (ids[0] == 0).all() and (lps[0] == MASK_LOGPROB).all()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    with torch.no_grad():
        lsm = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    rows: list[Any] = [list(zip(ids[i].tolist(), lps[i].tolist())) for i in range(1, len(prompt))]
    check_rows("grpc prompt", rows, lsm[:-1], 5)
    assert not r.sample.sequences[0].HasField("topk_sampled_logprobs")
