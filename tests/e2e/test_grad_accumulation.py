"""Twinkle gradient accumulation divides by the whole window's tokens (real server, gRPC
TrainingService, auth on): CrossEntropyLoss with gradient_accumulation_steps 4 over four
calls of different sizes updates the weights as one call with the four batches together,
and both as transformers + PEFT does on the concatenated batch (mean over all its trained
tokens). SGD, whose update is proportional to the gradient, so a wrong division shows up
(Adam's first step would hide it); the per-call-mean update is computed too and must differ.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from twinkle_client._proto.twinkle.v1 import training_pb2 as tpb

from e2e_support.server import LaunchServer
from e2e_support.training import KEYS, Client, auth_overrides, batch, state_dict

LR = 0.5
SIZES = [1, 2, 3, 2]  # sequences per call: the calls have different token counts


def sgd(c: Client, name: str) -> None:
    c.call("SetOptimizer", tpb.SetOptimizerRequest(adapter_name=name, optimizer_cls="SGD",
                                                   config={"lr": LR, "weight_decay": 0.0}))


def peft_after_step(model_dir: Path, initial: dict[str, np.ndarray], calls: list[list[tpb.InputFeature]],
                    per_call_mean: bool) -> dict[str, np.ndarray]:
    """transformers + PEFT from the same LoRA weights: one SGD step on Σ −log p(label) over
    every trained token of the calls / their count (or, per_call_mean, Σ over calls of each
    call's own mean: what dividing by each call's tokens would give)."""
    import torch
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=32, target_modules="all-linear"))
    loaded = set_peft_model_state_dict(model, {k: torch.from_numpy(v.copy()) for k, v in initial.items()})
    assert not loaded.unexpected_keys, loaded.unexpected_keys
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert len(params) == len(initial)
    model.train()

    def call_sum(features: list[tpb.InputFeature]) -> tuple[torch.Tensor, int]:
        total, count = torch.zeros((), dtype=torch.float32), 0
        for f in features:
            ids = torch.as_tensor(list(f.input_ids), dtype=torch.long)[None]
            labels = torch.as_tensor(list(f.labels), dtype=torch.long)
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
            nxt = labels[1:]
            mask = nxt != -100
            total = total - logprobs[:-1][mask, nxt[mask]].sum()
            count += int(mask.sum())
        return total, count

    sums = [call_sum(f) for f in calls]
    if per_call_mean:
        loss = sum(total / count for total, count in sums)
    else:
        loss = sum(total for total, _ in sums) / sum(count for _, count in sums)
    loss.backward()
    optimizer = torch.optim.SGD(list(params.values()), lr=LR)
    optimizer.step()
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items() if "lora_" in k}
    # PEFT's state_dict keys carry the adapter name; the server's are PEFT's saved keys.
    return {k.replace(".default", ""): v for k, v in state.items()}


def test_accumulation_window_divides_by_the_window_tokens(launch_server: LaunchServer, tiny_model: Path,
                                                          tmp_path: Path) -> None:
    server = launch_server(auth_overrides(storage={"data_dir": str(tmp_path / "data")}))
    vocab = int(json.loads((tiny_model / "config.json").read_text())["vocab_size"])
    calls = [batch(100 + i, vocab, sequences=n) for i, n in enumerate(SIZES)]
    c = Client(server.grpc_address, KEYS["alice"])
    try:
        for name, steps in (("window", 4), ("whole", 1)):
            c.call("AddAdapter", tpb.AddAdapterRequest(adapter_name=name, config=tpb.LoraConfig(r=4, seed=3),
                                                       gradient_accumulation_steps=steps))
            sgd(c, name)
        initial = state_dict(c, "window")
        assert all(np.array_equal(initial[k], v) for k, v in state_dict(c, "whole").items())

        losses = []
        for i, features in enumerate(calls):
            out = c.call("ForwardBackward", tpb.ForwardRequest(adapter_name="window", inputs=features)).result
            losses.append(out.loss)
            step = c.call("Step", tpb.AdapterRequest(adapter_name="window"))
            assert step.skipped == (i < 3)
        whole_inputs = [f for features in calls for f in features]
        c.call("ForwardBackward", tpb.ForwardRequest(adapter_name="whole", inputs=whole_inputs))
        c.call("Step", tpb.AdapterRequest(adapter_name="whole"))
        window, whole = state_dict(c, "window"), state_dict(c, "whole")
    finally:
        c.close()

    # Each call still reports its own mean loss (as without a window): the first call's equals
    # a lone call's on the untrained weights, which the reference gives too.
    assert all(loss > 0 for loss in losses)
    reference = peft_after_step(tiny_model, initial, calls, per_call_mean=False)
    per_call = peft_after_step(tiny_model, initial, calls, per_call_mean=True)
    assert sorted(window) == sorted(whole) == sorted(reference), (sorted(window)[:3], sorted(reference)[:3])
    moved = max(float(np.abs(window[k] - initial[k]).max()) for k in window)
    assert moved > 1e-3, "the step changed nothing: the comparison would be vacuous"
    window_vs_whole = max(float(np.abs(window[k] - whole[k]).max()) for k in window)
    window_vs_peft = max(float(np.abs(window[k] - reference[k]).max()) for k in window)
    peft_gap = max(float(np.abs(per_call[k] - reference[k]).max()) for k in window)
    print(f"max |Δw|: 4-call window vs one 4x call {window_vs_whole:.2e}, vs PEFT {window_vs_peft:.2e}; "
          f"per-call-mean division would differ by {peft_gap:.2e} (the step moved weights up to {moved:.2e})")
    assert window_vs_whole <= 1e-6
    assert window_vs_peft <= 1e-6
    assert peft_gap > 1e-4, "the per-call and window divisions agree: the test could not fail"
