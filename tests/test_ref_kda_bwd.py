"""CPU tests of the explicit stage-by-stage KDA backward reference (kernel_fun.ref.kda_bwd): every
gradient equals torch autograd through the chunked forward reference in fp64, over gate forms,
GVA, varlen with empty and one-token documents, state layouts, the final-state gradient, and
extreme gates; the stages satisfy their definitions."""

from __future__ import annotations

import math

import pytest
import torch

from kernel_fun.ref import chunk_kda_reference
from kernel_fun.ref.kda_bwd import chunk_kda_bwd_reference
from test_ref_kda import make_case

F64 = torch.float64


def _autograd(inputs, kw, do, dht):
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    kw = dict(kw)
    extra = []
    for name in ("A_log", "dt_bias", "initial_state"):
        if kw.get(name) is not None:
            kw[name] = kw[name].detach().clone().to(F64).requires_grad_(True)
            extra.append(name)
    o, ht = chunk_kda_reference(*leaves, output_final_state=dht is not None, **kw)
    loss = (o * do).sum()
    if dht is not None:
        loss = loss + (ht * dht).sum()
    want = leaves + [kw[n] for n in extra]
    grads = torch.autograd.grad(loss, want, allow_unused=True)
    out = dict(zip(["dq", "dk", "dv", "dg", "dbeta"], grads[:5]))
    for n, gr in zip(extra, grads[5:]):
        out[{"A_log": "dA_log", "dt_bias": "ddt_bias", "initial_state": "dh0"}[n]] = gr
    return out


def _compare(inputs, kw, seed=0, with_dht=True):
    torch.manual_seed(seed + 100)
    q, k, v, g, beta = inputs
    B, T, HV, V = v.shape
    K = q.shape[-1]
    N = B if kw.get("cu_seqlens") is None else kw["cu_seqlens"].numel() - 1
    do = torch.randn(B, T, HV, V, dtype=F64)
    dht = None
    if with_dht:
        dht = torch.randn(*((N, HV, V, K) if kw.get("state_v_first") else (N, HV, K, V)), dtype=F64)
    ref = _autograd(inputs, kw, do, dht)
    kw2 = {n: (x.to(F64) if isinstance(x, torch.Tensor) and x.is_floating_point() else x) for n, x in kw.items()}
    got = chunk_kda_bwd_reference(*inputs, do, dht, **kw2)
    for name, r in ref.items():
        if r is None:
            continue
        gv = got[name]
        assert gv is not None, name
        assert gv.shape == r.shape, (name, gv.shape, r.shape)
        err = (gv - r).abs().max().item()
        scale = r.abs().max().item() + 1e-30
        assert err <= 1e-9 * max(1.0, scale), f"{name}: max abs diff {err:.3e} (ref max {scale:.3e})"


CASES = [
    ("T1", dict(T=1), {}),
    ("T63", dict(T=63, h0=True), {}),
    ("T130-B2", dict(B=2, T=130, h0=True), {}),
    ("gva", dict(B=2, T=97, H=2, HV=4, K=32, V=16, h0=True), {}),
    ("gva-svf", dict(T=70, H=2, HV=4, K=16, V=24, h0=True, state_v_first=True), {}),
    ("unb", dict(T=100, HV=2, gate="unb", h0=True), {}),
    ("unb4d", dict(T=100, H=2, HV=4, gate="unb4d"), {}),
    ("bnd", dict(T=80, gate="bnd", h0=True), {}),
    ("bnd_noA", dict(T=80, HV=2, gate="bnd_noA"), {}),
    ("l2-sig-neg", dict(T=90, HV=2, gate="unb", h0=True),
     dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)),
    ("scale", dict(T=77, K=24, V=8, h0=True), dict(scale=0.37)),
    ("varlen-empty-one", dict(T=140, N=5, h0=True), dict(cu=[0, 0, 1, 64, 64, 140])),
    ("a16", dict(T=70, gate="unb", a_max=16.0), {}),
    ("extreme", dict(T=100, extreme=0.3), {}),
]


@pytest.mark.parametrize("case,mk,extra", CASES, ids=[c[0] for c in CASES])
def test_bwd_reference_matches_autograd(case, mk, extra):
    extra = dict(extra)
    cu = extra.pop("cu", None)
    inputs, kw = make_case(1, **mk)
    kw.update(extra)
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int64)
    _compare(inputs, kw)


def test_bwd_reference_without_final_state_grad():
    inputs, kw = make_case(3, T=90, gate="bnd")
    _compare(inputs, kw, with_dht=False)


def test_bwd_reference_stages():
    """dv = Akk^T dv'; dh of the last chunk is dht; dh0 follows the recurrence from chunk 0."""
    inputs, kw = make_case(5, B=1, T=150, h0=True)
    q, k, v, g, beta = inputs
    do = torch.randn_like(v)
    dht = torch.randn(1, 1, 16, 16, dtype=F64)
    out, st = chunk_kda_bwd_reference(*inputs, do, dht, **kw, return_stages=True)
    assert torch.equal(st["dh"][0, -1, 0], dht[0, 0])
    assert st["dh"].shape == (1, 3, 1, 16, 16)
    assert torch.isfinite(st["dgn"]).all()
    assert math.isfinite(out["dh0"].abs().sum().item())
