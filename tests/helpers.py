"""Metrics and tolerances shared by every test (fla's own, from tests/ops/test_kda.py and
tests/modules/test_conv.py; see ../shared/spec/fla-contract.md)."""

from __future__ import annotations

import torch

# rel-RMS tolerances against the fp64 reference.
KDA_TOL = {"o": 0.005, "ht": 0.005, "dq": 0.008, "dk": 0.008, "dv": 0.008, "dh0": 0.008,
           "dg": 0.02, "dbeta": 0.02, "dbias": 0.008, "dA": 0.003}
KDA_VARLEN_TOL = {"o": 0.005, "ht": 0.005, "dq": 0.007, "dk": 0.008, "dv": 0.007,
                  "dg": 0.015, "dbeta": 0.015, "dh0": 0.007}
CCONV_TOL = 1e-3


def rel_rms(ref: torch.Tensor, got: torch.Tensor) -> float:
    """fla's metric: RMS(ref - got) / RMS(ref), computed in fp64. NaN/Inf anywhere -> inf."""
    ref = ref.detach().double().cpu()
    got = got.detach().double().cpu()
    assert ref.shape == got.shape, f"shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    if not torch.isfinite(got).all():
        return float("inf")
    diff = ref - got
    if diff.abs().max().item() <= 1e-6:
        return 0.0
    denom = ref.pow(2).mean().sqrt().item()
    return diff.pow(2).mean().sqrt().item() / max(denom, 1e-30)


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, tol: float) -> None:
    err = rel_rms(ref, got)
    assert err <= tol, f"{name}: rel-RMS {err:.3e} > {tol:.1e}"


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer poisoned with NaN, to catch elements a kernel never writes."""
    return torch.full_like(t, float("nan"))
