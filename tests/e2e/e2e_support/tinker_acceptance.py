"""The Tinker acceptance sequence, run by whichever tinker SDK is first on sys.path (the
test runs it in a subprocess with PYTHONPATH set to one release's unpacked wheel).

create model, forward_backward with each loss the release can send, optim_step, save_state,
load_state, save_weights_and_get_sampling_client, sample, REST listing. Prints one JSON line
with what it measured; any failure raises (exit status 1).

Usage: python tinker_acceptance.py BASE_URL API_KEY MODEL_NAME
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "1")

import pydantic  # noqa: E402
import tinker  # noqa: E402
from tinker import types  # noqa: E402

SEQ = [11, 42, 7, 99, 123, 5, 64, 300, 17, 250]


def resolved(made: Any) -> Any:
    """Newer SDKs return futures from create_* calls; older ones the client itself."""
    result = getattr(made, "result", None)
    return result() if callable(result) and not hasattr(made, "forward_backward") else made


def main(base_url: str, key: str, model: str) -> None:
    svc = tinker.ServiceClient(base_url=base_url, api_key=key)
    training = resolved(svc.create_lora_training_client(base_model=model, rank=8))
    n = len(SEQ) - 1
    ce = types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]),
                     loss_fn_inputs={"target_tokens": SEQ[1:], "weights": [1.0] * n})
    out = training.forward_backward([ce], "cross_entropy").result()
    lp = [float(v) for v in out.loss_fn_outputs[0]["logprobs"].tolist()]
    assert len(lp) == n and all(v <= 0 for v in lp)
    assert math.isclose(out.metrics["loss:sum"], -sum(lp), rel_tol=1e-4, abs_tol=1e-4)
    losses = {"cross_entropy": out.metrics["loss:sum"]}
    skipped: list[str] = []
    adv = [0.5, -1.0, 1.0, 0.0, 2.0, -0.5, 1.0, 1.0, -1.0]
    rl = types.Datum(model_input=types.ModelInput.from_ints(SEQ[:-1]),
                     loss_fn_inputs={"target_tokens": SEQ[1:], "logprobs": lp, "advantages": adv})
    for loss, config in (("importance_sampling", None), ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
                         ("cispo", None), ("dro", {"beta": 0.05}),
                         ("gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})):
        try:
            res = training.forward_backward([rl], loss, config).result()  # type: ignore[arg-type]
        except pydantic.ValidationError:
            # Releases with the JSON forward_backward (0.16.x) check loss_fn against their own
            # LossFnType before sending; gspo came later.
            assert loss == "gspo", loss
            skipped.append(loss)
            continue
        losses[loss] = res.metrics["loss:sum"]
        assert math.isfinite(losses[loss]), loss
    # On-policy, unclipped: importance_sampling, ppo and gspo all give -sum(advantages).
    for loss in ("importance_sampling", "ppo", "gspo"):
        if loss in skipped:
            continue
        assert math.isclose(losses[loss], -sum(adv), abs_tol=1e-3), (loss, losses[loss])
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    saved = training.save_state("accept").result()
    after_save = training.forward([ce], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    training.forward_backward([ce], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    training.load_state(saved.path).result()
    restored = training.forward([ce], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert restored == after_save, "load_state did not restore the saved weights"
    sampler = resolved(training.save_weights_and_get_sampling_client("accept-sampler"))
    sample = sampler.sample(types.ModelInput.from_ints(SEQ[:4]), num_samples=2,
                            sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)).result()
    assert len(sample.sequences) == 2 and all(1 <= len(s.tokens) <= 4 for s in sample.sequences)
    rest = svc.create_rest_client()
    runs = rest.list_training_runs().result().training_runs
    model_id = training.get_info().model_id
    assert model_id in [r.training_run_id for r in runs]
    checkpoints = rest.list_checkpoints(model_id).result().checkpoints
    assert any(c.checkpoint_id.endswith("accept") for c in checkpoints), [c.checkpoint_id for c in checkpoints]
    print(json.dumps({"sdk": tinker.__version__, "losses": losses, "skipped": skipped,
                      "sampled": [list(s.tokens) for s in sample.sequences], "checkpoints": len(checkpoints)}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
