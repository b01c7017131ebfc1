"""The engine's optimizers and LR schedulers (core/engine/optim) against torch.optim, through
optim_probe.

The C++ engine runs AdamW / Adam / SGD over several parameters of different shapes with random
per-step gradients and per-step hyperparameters; the same inputs go through torch.optim (the
single-tensor CPU path, which the engine mirrors), torch.nn.utils.clip_grad_norm_ and torch's /
transformers' schedulers. Parameters, optimizer state, reported grad norms and learning rates
must agree to 1e-6 absolute.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from engine_harness import Engine, EngineError
from numerics import assert_close
from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

INVALID_ARGUMENT = 3
FAILED_PRECONDITION = 9
TOL = 1e-6
SHAPES = [(4, 8), (8,), (3, 5, 2), (1,)]


@pytest.fixture(scope="module")
def optim_engine() -> Iterator[Engine]:
    # optim_probe needs no model, so one worker serves the whole module.
    with Engine() as e:
        yield e


def make_params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def make_grads(seed: int, steps: int, scales: list[float] | None = None) -> list[list[torch.Tensor]]:
    """Random gradients; `scales` varies their size per step so clipping is on for some steps
    and off for others."""
    g = torch.Generator().manual_seed(seed)
    scales = scales or [1.0] * steps
    return [[torch.randn(s, generator=g) * scales[i] for s in SHAPES] for i in range(steps)]


def run_torch(kind: str, params0: list[torch.Tensor], grads: list[list[torch.Tensor | None]],
              hypers: list[dict[str, Any]], lrs: list[float] | None = None) -> dict[str, Any]:
    """torch.optim over the same steps. A missing gradient is a zero gradient (the engine's
    documented semantics; torch would skip the parameter)."""
    params = [p.clone().requires_grad_(True) for p in params0]
    # foreach=False: the single-tensor path, which torch also picks for CPU tensors by default.
    if kind == "sgd":
        opt = torch.optim.SGD(params, foreach=False)
    else:
        cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
        opt = cls(params, foreach=False)
    results = []
    for i, (step_grads, h) in enumerate(zip(grads, hypers)):
        group = opt.param_groups[0]
        group["lr"] = lrs[i] if lrs is not None else h["learning_rate"]
        group["weight_decay"] = h.get("weight_decay", 0.0)
        if kind == "sgd":
            group.update(momentum=h.get("momentum", 0.0), dampening=h.get("dampening", 0.0),
                         nesterov=h.get("nesterov", False))
        else:
            group.update(betas=(h.get("beta1", 0.9), h.get("beta2", 0.999)), eps=h.get("eps", 1e-8))
        for j, p in enumerate(params):
            g = step_grads[j] if j < len(step_grads) else None
            p.grad = g.clone() if g is not None else torch.zeros_like(p)
        clip = h.get("grad_clip_norm", 0.0)
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        opt.step()
        opt.zero_grad()
        results.append({"grad_norm": float(norm), "learning_rate": group["lr"], "step": i + 1})
    state: dict[str, torch.Tensor] = {}
    for j, p in enumerate(params):
        for name, value in opt.state[p].items():
            if name != "step":
                state[f"{name}.{j}"] = value
    return {"params": [p.detach() for p in params], "state": state, "results": results}


def run_engine(engine: Engine, kind: str, params0: list[torch.Tensor], grads: list[list[Any]],
               hypers: list[dict[str, Any]], scheduler: dict[str, Any] | None = None,
               base_lr: float = 0.0) -> dict[str, Any]:
    body: dict[str, Any] = {"optimizer": kind, "params": params0, "grads": grads, "hyper": hypers,
                            "base_lr": base_lr}
    if scheduler is not None:
        body["scheduler"] = scheduler
    return engine.call("optim_probe", body)


def compare(label: str, got: dict[str, Any], ref: dict[str, Any]) -> float:
    largest = 0.0
    for j, (a, b) in enumerate(zip(got["params"], ref["params"], strict=True)):
        largest = max(largest, assert_close(f"{label} param {j}", a, b, TOL, absolute=True))
    assert set(got["state"]) == set(ref["state"]) | {"step"}, sorted(got["state"])
    for name, value in sorted(ref["state"].items()):
        largest = max(largest, assert_close(f"{label} {name}", got["state"][name], value, TOL, absolute=True))
    assert int(got["state"]["step"]) == len(ref["results"])
    assert got["state"]["step"].dtype == torch.int64
    for i, (a, b) in enumerate(zip(got["results"], ref["results"], strict=True)):
        assert a["step"] == b["step"]
        assert abs(a["grad_norm"] - b["grad_norm"]) <= TOL, (label, i, a, b)
        assert abs(a["learning_rate"] - b["learning_rate"]) <= 1e-12, (label, i, a, b)
    print(f"{label}: largest |diff| over params and state = {largest:.3e}")
    return largest


def hypers_for(steps: int, **fixed: Any) -> list[dict[str, Any]]:
    # The learning rate changes per call, as a Tinker client's schedule sends it.
    return [{"learning_rate": 1e-2 * (1 + 0.1 * i), **fixed} for i in range(steps)]


@pytest.mark.parametrize("clip", [0.0, 8.0])
def test_adamw_matches_torch(optim_engine: Engine, clip: float) -> None:
    steps = 10
    params = make_params(1)
    # Norms from ~4.5 to ~18: with clip 8 some steps are clipped and some are not.
    grads = make_grads(2, steps, scales=[0.5 + 0.2 * i for i in range(steps)])
    hypers = hypers_for(steps, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=clip)
    got = run_engine(optim_engine, "adamw", params, grads, hypers)
    ref = run_torch("adamw", params, grads, hypers)
    compare(f"adamw clip={clip}", got, ref)
    norms = [r["grad_norm"] for r in ref["results"]]
    if clip:
        assert min(norms) < clip < max(norms), norms  # both regimes exercised


def test_adamw_tiny_gradients_eps_regime(optim_engine: Engine) -> None:
    """Gradients ~1e-8, where sqrt(v̂) ~ eps: a misplaced eps (e.g. inside the bias
    correction) would move the parameters by ~lr, far above the tolerance."""
    steps = 6
    params = make_params(11)
    grads = make_grads(12, steps, scales=[1e-8] * steps)
    hypers = hypers_for(steps, eps=1e-8, weight_decay=0.0)
    compare("adamw tiny gradients", run_engine(optim_engine, "adamw", params, grads, hypers),
            run_torch("adamw", params, grads, hypers))


def test_adam_matches_torch(optim_engine: Engine) -> None:
    steps = 10
    params = make_params(3)
    grads = make_grads(4, steps)
    hypers = hypers_for(steps, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.05, grad_clip_norm=3.0)
    compare("adam", run_engine(optim_engine, "Adam", params, grads, hypers),
            run_torch("adam", params, grads, hypers))


@pytest.mark.parametrize("momentum,dampening,nesterov,weight_decay", [
    (0.0, 0.0, False, 0.01),
    (0.9, 0.1, False, 0.0),
    (0.9, 0.0, True, 0.01),
])
def test_sgd_matches_torch(optim_engine: Engine, momentum: float, dampening: float, nesterov: bool,
                           weight_decay: float) -> None:
    steps = 10
    params = make_params(5)
    grads = make_grads(6, steps)
    hypers = hypers_for(steps, momentum=momentum, dampening=dampening, nesterov=nesterov,
                        weight_decay=weight_decay)
    compare(f"sgd m={momentum} d={dampening} nesterov={nesterov}",
            run_engine(optim_engine, "SGD", params, grads, hypers), run_torch("sgd", params, grads, hypers))


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd"])
def test_steps_without_gradients_are_zero_gradient_steps(optim_engine: Engine, kind: str) -> None:
    params = make_params(7)
    full = make_grads(8, 3)
    # A normal step, a step with no gradient at all, a step where some params have none.
    grads = [full[0], [], [None, full[1][1], None, full[1][3]], full[2]]
    hypers = hypers_for(4, weight_decay=0.1, momentum=0.9 if kind == "sgd" else 0.0)
    got = run_engine(optim_engine, kind, params, grads, hypers)
    ref = run_torch(kind, params, grads, hypers)
    compare(f"{kind} with missing gradients", got, ref)
    assert got["results"][1]["grad_norm"] == 0.0
    if kind == "adamw":  # decoupled weight decay still shrinks the weights on the empty step
        only_decay = run_engine(optim_engine, kind, params, [[]], hypers[:1])
        for p0, p1 in zip(params, only_decay["params"]):
            torch.testing.assert_close(p1, p0 * (1 - hypers[0]["learning_rate"] * 0.1), rtol=0, atol=1e-7)


def torch_schedule(spec: dict[str, Any], base_lr: float, steps: int) -> list[float]:
    """lr of each optimizer step: get_last_lr() after i scheduler.step() calls."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base_lr)
    c = spec.get("config", {})
    name = spec["name"]
    if name == "constant":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    elif name == "linear":
        sched = torch.optim.lr_scheduler.LinearLR(opt, **c)
    elif name == "cosine":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, **c)
    elif name in ("cosine_warmup", "CosineWarmupScheduler"):
        sched = get_cosine_schedule_with_warmup(opt, **c)
    else:
        sched = get_linear_schedule_with_warmup(opt, **c)
    lrs = []
    for _ in range(steps):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return lrs


SCHEDULES = [
    {"name": "constant"},
    {"name": "linear"},
    {"name": "linear", "config": {"start_factor": 0.1, "end_factor": 0.5, "total_iters": 20}},
    {"name": "cosine", "config": {"T_max": 10}},
    {"name": "cosine", "config": {"T_max": 25, "eta_min": 1e-4}},
    {"name": "cosine_warmup", "config": {"num_warmup_steps": 5, "num_training_steps": 30}},
    {"name": "CosineWarmupScheduler",
     "config": {"num_warmup_steps": 3, "num_training_steps": 20, "num_cycles": 1.5}},
    {"name": "linear_warmup", "config": {"num_warmup_steps": 4, "num_training_steps": 25}},
]


@pytest.mark.parametrize("spec", SCHEDULES, ids=lambda s: f"{s['name']}-{s.get('config', {})}")
def test_scheduler_matches_reference(optim_engine: Engine, spec: dict[str, Any]) -> None:
    steps, base_lr = 30, 3e-3
    got = run_engine(optim_engine, "sgd", [torch.zeros(2)], [[]] * steps, [{}] * steps,
                     scheduler={"name": spec["name"], "config": spec.get("config", {})}, base_lr=base_lr)
    ref = torch_schedule(spec, base_lr, steps)
    diffs = [abs(r["learning_rate"] - want) for r, want in zip(got["results"], ref, strict=True)]
    print(f"{spec['name']} {spec.get('config', {})}: max|lr diff| = {max(diffs):.3e}")
    assert max(diffs) <= TOL * base_lr, list(zip([r["learning_rate"] for r in got["results"]], ref))


def test_scheduled_adamw_matches_torch(optim_engine: Engine) -> None:
    """The scheduler's rate reaches the update: AdamW + cosine warmup vs torch + transformers."""
    steps, base_lr = 12, 5e-2
    params = make_params(9)
    grads = make_grads(10, steps)
    hypers = [{"weight_decay": 0.01, "grad_clip_norm": 1.0}] * steps
    spec = {"name": "cosine_warmup", "config": {"num_warmup_steps": 3, "num_training_steps": steps}}
    got = run_engine(optim_engine, "adamw", params, grads, hypers, scheduler=spec, base_lr=base_lr)
    ref = run_torch("adamw", params, grads, hypers, lrs=torch_schedule(spec, base_lr, steps))
    compare("adamw + cosine_warmup", got, ref)


def probe_error(engine: Engine, **overrides: Any) -> EngineError:
    body: dict[str, Any] = {"optimizer": "adamw", "params": [torch.ones(3)], "grads": [[torch.ones(3)]],
                            "hyper": [{}], "base_lr": 0.0}
    body.update(overrides)
    with pytest.raises(EngineError) as info:
        engine.call("optim_probe", body)
    print(info.value)
    return info.value


def test_errors(optim_engine: Engine) -> None:
    e = probe_error(optim_engine, grads=[[torch.tensor([1.0, float("nan"), 0.0])]])
    assert e.code == FAILED_PRECONDITION and "gradient norm is nan" in e.message
    e = probe_error(optim_engine, grads=[[torch.tensor([1.0, float("inf"), 0.0])]])
    assert e.code == FAILED_PRECONDITION and "gradient norm is inf" in e.message
    e = probe_error(optim_engine, hyper=[{"learning_rate": -1.0}])
    assert e.code == INVALID_ARGUMENT and "learning_rate must be finite and >= 0" in e.message
    e = probe_error(optim_engine, hyper=[{"beta2": 1.0}])
    assert e.code == INVALID_ARGUMENT and "beta2" in e.message
    e = probe_error(optim_engine, hyper=[{"eps": 0.0}])
    assert e.code == INVALID_ARGUMENT and "eps must be finite and > 0" in e.message
    e = probe_error(optim_engine, optimizer="lamb")
    assert e.code == INVALID_ARGUMENT and "accepted: adamw, adam, sgd" in e.message
    e = probe_error(optim_engine, scheduler={"name": "step", "config": {}})
    assert e.code == INVALID_ARGUMENT and "cosine_warmup (CosineWarmupScheduler)" in e.message
    e = probe_error(optim_engine, scheduler={"name": "cosine", "config": {"Tmax": 3.0}})
    assert e.code == INVALID_ARGUMENT and "accepted: T_max, eta_min" in e.message
    e = probe_error(optim_engine, grads=[[torch.ones(4)]])
    assert e.code == INVALID_ARGUMENT and "expected float32[3]" in e.message
