"""Metrics and tolerances shared by every test (fla's own, from tests/ops/test_kda.py and
tests/modules/test_conv.py)."""

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
    # No absolute escape (fla's assert_close passes whenever max|diff| <= 1e-6): tensors whose
    # values are all tiny (exp2 of -1000 gates, gradients through decayed states) must be compared
    # relative to their own scale, or any answer of the right tiny magnitude would pass.
    num = (ref - got).pow(2).mean().sqrt().item()
    denom = ref.pow(2).mean().sqrt().item()
    if denom == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / denom


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, tol: float) -> None:
    err = rel_rms(ref, got)
    assert err <= tol, f"{name}: rel-RMS {err:.3e} > {tol:.1e}"


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer poisoned with NaN, to catch elements a kernel never writes."""
    return torch.full_like(t, float("nan"))


def as_stored_fp32(ref: torch.Tensor) -> torch.Tensor:
    """An fp64 reference as a kernel that stores fp32 and flushes subnormals (--use_fast_math)
    can represent it: values below 2^-126 in magnitude become 0. For quantities such as exp2 of a
    chunk's gate sum, which underflow for strong decays: fp64 keeps 1e-270, fp32 cannot."""
    ref = ref.detach().double()
    return torch.where(ref.abs() < 2.0 ** -126, torch.zeros_like(ref), ref.float().double())

