"""Comparison helpers that print the largest difference they saw."""

from __future__ import annotations

import torch


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float, absolute: bool = False) -> float:
    """Per tensor: |got - ref| <= atol + rtol*|ref| with rtol = tol, atol = tol*max|ref|
    (or atol = tol when absolute). Returns and prints the largest absolute difference."""
    got = got.detach().to(torch.float64)
    ref = ref.detach().to(torch.float64)
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    diff = (got - ref).abs()
    largest = float(diff.max()) if diff.numel() else 0.0
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    atol = tol if absolute else tol * scale
    rtol = 0.0 if absolute else tol
    print(f"{name}: max|diff| = {largest:.3e} (max|ref| = {scale:.3e}, tol {tol:g}{' abs' if absolute else ''})")
    bad = diff > atol + rtol * ref.abs()
    assert not bool(bad.any()), f"{name}: {int(bad.sum())} elements off, max|diff| {largest:.3e} > tol"
    return largest


def relative_norm_error(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    got = got.detach().to(torch.float64)
    ref = ref.detach().to(torch.float64)
    err = float((got - ref).norm() / ref.norm().clamp_min(1e-300))
    print(f"{name}: ||diff||/||ref|| = {err:.3e} (tol {tol:g})")
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:g}"
    return err
