"""CPU tests of the explicit stage-by-stage KDA backward reference (kernel_fun.ref.kda_bwd): every
gradient equals torch autograd through the chunked forward reference in fp64 (to 1e-9 of its own
magnitude, however small), over gate forms, GVA, varlen with empty and one-token documents, state
layouts, the final-state gradient, tiny gradients and extreme gates; the stages the kernels are
tested against satisfy their definitions, computed here from the forward reference's stages: the
states h_c, v', the state gradients dh_{c+1} (dht for the last chunk, the recurrence between
chunks, dh0 after chunk 0), dv', dv and dAqk. (dL, dq^, dk^ and dgn are checked only through the
gradients they produce.)"""

from __future__ import annotations

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


def _compare(inputs, kw, seed=0, with_dht=True, grad_scale=1.0):
    """Every gradient of the explicit reference against autograd: max |diff| <= 1e-9 max |autograd|,
    per gradient (no absolute floor: gradients of any magnitude are compared at their own scale). A
    gradient autograd finds zero up to roundoff (dg of one token without an initial state) must be
    zero up to the same roundoff: 1e-13 of the largest gradient of the case."""
    torch.manual_seed(seed + 100)
    q, k, v, g, beta = inputs
    B, T, HV, V = v.shape
    K = q.shape[-1]
    N = B if kw.get("cu_seqlens") is None else kw["cu_seqlens"].numel() - 1
    do = grad_scale * torch.randn(B, T, HV, V, dtype=F64)
    dht = None
    if with_dht:
        dht = grad_scale * torch.randn(*((N, HV, V, K) if kw.get("state_v_first") else (N, HV, K, V)), dtype=F64)
    ref = _autograd(inputs, kw, do, dht)
    kw2 = {n: (x.to(F64) if isinstance(x, torch.Tensor) and x.is_floating_point() else x) for n, x in kw.items()}
    got = chunk_kda_bwd_reference(*inputs, do, dht, **kw2)
    case_scale = max(r.abs().max().item() for r in ref.values() if r is not None and r.numel())
    for name, r in ref.items():
        if r is None:
            continue
        gv = got[name]
        assert gv is not None, name
        assert gv.shape == r.shape, (name, gv.shape, r.shape)
        err = (gv - r).abs().max().item()
        scale = r.abs().max().item()
        tol = 1e-9 * scale if scale > 1e-13 * case_scale else 1e-13 * case_scale
        assert err <= tol, f"{name}: max abs diff {err:.3e} > {tol:.1e} (autograd's max {scale:.3e})"


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


def test_bwd_reference_tiny_gradients():
    """Output gradients of 1e-12: every gradient is ~1e-12 and still equal to autograd's to 1e-9 of
    itself (an absolute tolerance would pass anything here)."""
    inputs, kw = make_case(4, B=2, T=100, HV=2, gate="unb", h0=True)
    _compare(inputs, kw, grad_scale=1e-12)


def test_bwd_reference_l2norm_of_tiny_q_k():
    """q and k whose sum of squares is near the l2norm's epsilon (1e-6): the explicit l2norm backward
    (its own rsqrt and epsilon) against autograd through the forward's."""
    inputs, kw = make_case(6, T=70, HV=2, gate="unb", h0=True)
    inputs[0], inputs[1] = 1e-4 * inputs[0], 3e-4 * inputs[1]
    kw.update(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    _compare(inputs, kw)


@pytest.mark.parametrize("mk,extra", [(dict(B=1, T=150, H=1, HV=2, h0=True), {}),
                                      (dict(T=140, N=5, h0=True, gate="unb"), dict(cu=[0, 0, 1, 64, 64, 140]))],
                         ids=["dense-gva", "varlen-empty-one"])
def test_bwd_reference_stages(mk, extra):
    """The scan stages of the backward reference against their definitions, built from the forward
    reference's stages (h, v', Aqk, Akk, w, qg, kg, g2) per sequence and chunk c (rows t0..t1):
        h_c and v'_c: the forward's;  dh_{c+1} of the last chunk: dht;
        dv'_c = Aqk_c^T do_c + kg_c dh_{c+1};  dv_c = Akk_c^T dv'_c;  dAqk_c = do_c v'_c^T (i >= j);
        dh_c = exp2(G_c) dh_{c+1} + scale qg_c^T do_c - w_c^T dv'_c  (the recurrence; dh0 after chunk 0)."""
    torch.manual_seed(7)
    inputs, kw = make_case(5, **mk)
    extra = dict(extra)
    cu = extra.pop("cu", None)
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu)
    q, k, v, g, beta = inputs
    B, T, HV, V = v.shape
    K = q.shape[-1]
    N = B if cu is None else len(cu) - 1
    do = torch.randn_like(v)
    dht = torch.randn(N, HV, K, V, dtype=F64)
    out, st = chunk_kda_bwd_reference(*inputs, do, dht, **kw, return_stages=True)
    _, _, fs = chunk_kda_reference(*inputs, output_final_state=True, return_stages=True, **kw)
    scale = K ** -0.5

    def close(name, want, got):
        err = (got - want).abs().max().item()
        assert err <= 1e-10 * max(want.abs().max().item(), 1e-300), f"{name}: max abs diff {err:.3e}"

    close("h", fs["h"], st["h"])
    close("v'", fs["v_new"], st["v_new"])
    segs = [(b, 0, T) for b in range(B)] if cu is None else [(0, s, e) for s, e in zip(cu[:-1], cu[1:])]
    c_glob = 0  # chunk index in the states' [B, NT] layout (with cu_seqlens: all sequences in order)
    for n, (b, s0, s1) in enumerate(segs):
        nck = -(-(s1 - s0) // 64)
        cs = [(c_glob + c, s0 + 64 * c, min(s0 + 64 * c + 64, s1)) for c in range(nck)]
        c_glob += nck
        if cu is None:  # the dense states are [B, NT]: index the row b
            cs = [(c - n * nck, t0, t1) for c, t0, t1 in cs]
        row = b
        for hv in range(HV):
            dh = dht[n, hv]  # dh_{c+1} of the last chunk
            for c, t0, t1 in reversed(cs):
                m = t1 - t0
                close(f"dh_(c+1) seq {n} chunk {c}", dh, st["dh"][row, c, hv])
                do_c, vn_c = do[row, t0:t1, hv], fs["v_new"][row, t0:t1, hv]
                Aqk, Akk = fs["Aqk"][row, t0:t1, hv, :m], fs["Akk"][row, t0:t1, hv, :m]
                dvn = Aqk.T @ do_c + fs["kg"][row, t0:t1, hv] @ dh
                close(f"dv' seq {n} chunk {c}", dvn, st["dv_new"][row, t0:t1, hv])
                close(f"dv seq {n} chunk {c}", Akk.T @ dvn, st["dv"][row, t0:t1, hv])
                close(f"dAqk seq {n} chunk {c}", torch.tril(do_c @ vn_c.T), st["dAqk"][row, t0:t1, hv, :m])
                G = fs["g2"][row, t1 - 1, hv]
                dh = (torch.exp2(G)[:, None] * dh + scale * fs["qg"][row, t0:t1, hv].T @ do_c
                      - fs["w"][row, t0:t1, hv].T @ dvn)
            close(f"dh0 seq {n}", dh, out["dh0"][n, hv])  # empty sequences: dht itself
