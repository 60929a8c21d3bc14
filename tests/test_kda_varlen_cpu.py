"""The public chunk_kda on CPU tensors (the torch reference path) with packed documents: a varlen call
with an initial state per document, empty and one-token documents and documents ending on a chunk
boundary equals one call per document (outputs, final states and every gradient: q, k, v, g, beta,
initial_state, A_log, dt_bias), and an empty document passes its initial state (and its gradient)
through untouched."""

from __future__ import annotations

import pytest
import torch

from helpers import rel_rms
from kernel_fun.kda import chunk_kda

CU = [0, 0, 1, 65, 65, 130, 200]  # empty, 1 token, 64 (one whole chunk), empty, 65, 70
TOL = {torch.float64: 1e-12, torch.float32: 2e-5}
# A_log / dt_bias are float32 leaves (as fla takes them): their gradients are summed over the
# documents in float32 by autograd, in another order per document than packed
PARAM_TOL = 1e-6

CONFIGS = {
    "precomputed": dict(),
    "unbounded-l2norm-sigmoid": dict(gate="unbounded", use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True),
    "bounded-gva-state-v-first": dict(gate="bounded", H=1, HV=2, state_v_first=True, use_qk_l2norm_in_kernel=True,
                                      use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
}


def _case(dtype, gate="precomputed", H=2, HV=None, K=16, V=8, state_v_first=False, **flags):
    HV = HV or H
    gen = torch.Generator().manual_seed(3)
    T, N = CU[-1], len(CU) - 1
    rnd = lambda *s, dt=dtype: torch.randn(*s, generator=gen, dtype=torch.float64).to(dt)  # noqa: E731
    q, k, v = rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, HV, V)
    if not flags.get("use_qk_l2norm_in_kernel"):  # the delta rule needs unit keys
        q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    beta = rnd(1, T, HV) if flags.get("use_beta_sigmoid_in_kernel") else torch.rand(1, T, HV, generator=gen).to(dtype)
    kw = dict(flags, scale=0.3, state_v_first=state_v_first, output_final_state=True)
    if gate == "precomputed":
        g = torch.nn.functional.logsigmoid(rnd(1, T, HV, K) + 2)
    else:
        g = rnd(1, T, HV, K)
        kw.update(use_gate_in_kernel=True, A_log=torch.rand(HV, generator=gen) * 2,
                  dt_bias=0.5 * torch.randn(HV * K, generator=gen))
        if gate == "bounded":
            kw.update(lower_bound=-4.0, safe_gate=True)
    h0 = torch.randn(N, HV, *((V, K) if state_v_first else (K, V)), generator=gen)  # float32, as fla asserts
    return [q, k, v, g, beta, h0], kw


def _grads(inputs, kw, per_document: bool):
    """(outputs, gradients) of loss = <o, do> + <ht, dht>, from one varlen call or one call per
    document on slices of the same leaves (the per-document losses summed)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    params = {n: kw[n].detach().clone().requires_grad_(True) for n in ("A_log", "dt_bias") if n in kw}
    call = dict(kw, **params)
    q, k, v, g, beta, h0 = leaves
    gen = torch.Generator().manual_seed(9)
    do = torch.randn(v.shape, generator=gen, dtype=torch.float64).to(v.dtype)
    dht = torch.randn(h0.shape, generator=gen, dtype=torch.float64)
    if per_document:
        os, hts = [], []
        for n, (s, e) in enumerate(zip(CU[:-1], CU[1:])):
            o_n, ht_n = chunk_kda(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
                                  initial_state=h0[n:n + 1], **call)
            os.append(o_n)
            hts.append(ht_n)
        o, ht = torch.cat(os, dim=1), torch.cat(hts)
    else:
        o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=torch.tensor(CU), **call)
    loss = (o.double() * do.double()).sum() + (ht.double() * dht).sum()
    wrt = leaves + list(params.values())
    grads = torch.autograd.grad(loss, wrt)
    names = ["dq", "dk", "dv", "dg", "dbeta", "dh0"] + ["d" + n for n in params]
    return {"o": o, "ht": ht, **dict(zip(names, grads))}, dht


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_varlen_equals_one_call_per_document(config, dtype):
    inputs, kw = _case(dtype, **CONFIGS[config])
    packed, dht = _grads(inputs, kw, per_document=False)
    apart, _ = _grads(inputs, kw, per_document=True)
    assert packed["o"].dtype == dtype and packed["o"].shape == inputs[2].shape
    errs = {}
    for name, r in apart.items():
        got = packed[name]
        assert got.shape == r.shape and torch.isfinite(got).all(), name
        errs[name] = rel_rms(r, got)
    tol = {n: max(TOL[dtype], PARAM_TOL) if n in ("dA_log", "ddt_bias") else TOL[dtype] for n in errs}
    assert all(errs[n] <= tol[n] for n in errs), errs
    # empty documents (0 and 3): the final state is the initial state, and its gradient is dht's
    h0 = inputs[5]
    for n in (0, 3):
        assert torch.equal(packed["ht"][n].float(), h0[n]), n
        assert torch.equal(packed["dh0"][n], dht[n].to(packed["dh0"].dtype)), n
    # and each document reads its own state: a different h0 of document 2 (tokens 1..64) changes its
    # output (the first token at least: strong decays wash it out below rounding later) and no other
    inputs2 = list(inputs)
    inputs2[5] = h0.clone()
    inputs2[5][2] += 1.0
    moved, _ = _grads(inputs2, kw, per_document=False)
    changed = (moved["o"] != packed["o"]).flatten(2).any(-1)[0]  # [T] per token
    assert changed[1] and not changed[:1].any() and not changed[65:].any()
