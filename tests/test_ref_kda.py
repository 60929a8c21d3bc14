"""CPU tests of the pure-torch KDA references (kernel_fun.ref.kda): chunked == naive in fp64, the
naive recurrence against an independent scalar loop, every stage against its definition, extreme
gates, and gradients (autograd flow, chunked-vs-naive agreement, gradcheck)."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F

from helpers import rel_rms
from kernel_fun.ref import chunk_kda_reference, kda_gate, naive_recurrent_kda, prepare_inputs

F64 = torch.float64


def make_case(seed, *, B=1, T=64, H=1, HV=None, K=16, V=16, gate="pre", h0=False, N=None,
              state_v_first=False, dtype=F64, lower_bound=None, extreme=0.0, a_max=None):
    """Random inputs plus the matching kwargs. gate: 'pre' (precomputed log gate), 'unb' (in-kernel,
    A_log [HV]), 'unb4d' (A_log [1,1,HV,1]), 'bnd' (lower_bound -5, A_log [HV]), 'bnd_noA'."""
    torch.manual_seed(seed)
    HV = HV or H
    N = N or B
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = torch.randn(B, T, H, K, dtype=dtype)
    v = torch.randn(B, T, HV, V, dtype=dtype)
    beta = torch.rand(B, T, HV, dtype=dtype)
    kw = {}
    if gate == "pre":
        g = F.logsigmoid(torch.randn(B, T, HV, K, dtype=dtype))
        if extreme:
            g = torch.where(torch.rand(g.shape) < extreme, torch.full_like(g, -1000.0), g)
    else:
        g = torch.randn(B, T, HV, K, dtype=dtype)
        kw["use_gate_in_kernel"] = True
        kw["dt_bias"] = 0.5 * torch.randn(HV * K, dtype=torch.float32)
        if gate in ("unb", "unb4d", "bnd"):
            if a_max is not None:
                A = torch.full((HV,), math.log(a_max), dtype=torch.float32)
            else:
                A = torch.empty(HV, dtype=torch.float32).uniform_(0, math.log(4.0))
            kw["A_log"] = A.view(1, 1, HV, 1) if gate == "unb4d" else A
        if gate in ("bnd", "bnd_noA"):
            kw["lower_bound"] = -5.0 if lower_bound is None else lower_bound
    if h0:
        shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        kw["initial_state"] = torch.randn(*shape, dtype=dtype)
    if state_v_first:
        kw["state_v_first"] = True
    return [q, k, v, g, beta], kw


def _assert_rel(name, ref, got, tol):
    err = rel_rms(ref, got)
    assert err <= tol, f"{name}: rel-RMS {err:.3e} > {tol:.1e}"
    assert torch.isfinite(got).all(), f"{name}: non-finite"


# (id, make_case kwargs, extra op kwargs)
EQUIV_CASES = [
    ("T1", dict(T=1), {}),
    ("T63", dict(T=63), {}),
    ("T64", dict(T=64), {}),
    ("T65", dict(T=65, h0=True), {}),
    ("T130-B2", dict(B=2, T=130, h0=True), {}),
    ("T130-chunk32", dict(T=130, h0=True), dict(chunk_size=32)),
    ("gva-KneV", dict(B=2, T=97, H=2, HV=4, K=32, V=16, h0=True), {}),
    ("gva-KneV-svf", dict(T=70, H=2, HV=4, K=16, V=24, h0=True, state_v_first=True), {}),
    ("unb", dict(T=100, HV=2, gate="unb", h0=True), {}),
    ("unb4d", dict(T=100, H=2, HV=4, gate="unb4d"), dict(chunk_size=32)),
    ("bnd", dict(T=80, gate="bnd", h0=True), {}),
    ("bnd_noA", dict(T=80, HV=2, gate="bnd_noA"), {}),
    ("l2-sigmoid-neg", dict(T=90, HV=2, gate="unb", h0=True),
     dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)),
    ("l2-sigmoid", dict(T=90, gate="bnd"), dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)),
    ("scale", dict(T=77, K=24, V=8, h0=True), dict(scale=0.37)),
    ("varlen-a-i32", dict(T=130, N=3, h0=True), dict(cu=[0, 1, 64, 130], cu_dtype=torch.int32)),
    ("varlen-a-i64-c32", dict(T=130, N=3, H=2, HV=4, h0=True, gate="unb"),
     dict(cu=[0, 1, 64, 130], chunk_size=32, use_qk_l2norm_in_kernel=True)),
    ("varlen-b-i64", dict(T=163, N=3, HV=2, h0=True, state_v_first=True),
     dict(cu=[0, 15, 100, 163])),
    ("varlen-b-i32-noh0", dict(T=163, N=3, gate="bnd"), dict(cu=[0, 15, 100, 163], cu_dtype=torch.int32,
                                                            use_beta_sigmoid_in_kernel=True)),
    ("varlen-empty", dict(T=70, N=4, h0=True), dict(cu=[0, 0, 33, 33, 70])),
]


def _op_kwargs(kw, extra):
    kw = dict(kw)
    extra = dict(extra)
    cu = extra.pop("cu", None)
    cu_dtype = extra.pop("cu_dtype", torch.int64)
    chunk_size = extra.pop("chunk_size", 64)
    kw.update(extra)
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu, dtype=cu_dtype)
    return kw, chunk_size


@pytest.mark.parametrize("case,mk,extra", EQUIV_CASES, ids=[c[0] for c in EQUIV_CASES])
def test_chunked_matches_naive_fp64(case, mk, extra):
    inputs, kw = make_case(zlib.crc32(case.encode()) % 1000, **mk)
    kw, chunk_size = _op_kwargs(kw, extra)
    o_ref, ht_ref = naive_recurrent_kda(*inputs, output_final_state=True, **kw)
    o, ht = chunk_kda_reference(*inputs, output_final_state=True, chunk_size=chunk_size, **kw)
    assert o.shape == inputs[2].shape and o.dtype == F64
    N = len(kw["cu_seqlens"]) - 1 if "cu_seqlens" in kw else inputs[0].shape[0]
    HV, K, V = inputs[2].shape[2], inputs[0].shape[3], inputs[2].shape[3]
    assert ht.shape == ((N, HV, V, K) if kw.get("state_v_first") else (N, HV, K, V))
    assert o_ref.abs().max() > 1e-3  # not a trivially-zero case
    _assert_rel("o", o_ref, o, 1e-9)
    _assert_rel("ht", ht_ref, ht, 1e-9)
    o2, ht2 = chunk_kda_reference(*inputs, chunk_size=chunk_size, **kw)
    assert ht2 is None and torch.equal(o2, o)


def _scalar_loop_kda(q, k, v, g, beta, scale, h0):
    """Deliberately naive: plain Python floats, one (b, hv) at a time, no tensors."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k, v, g, beta = (x.tolist() for x in (q, k, v, g, beta))
    out = [[[[0.0] * V for _ in range(HV)] for _ in range(T)] for _ in range(B)]
    finals = [[None] * HV for _ in range(B)]
    for b in range(B):
        for hv in range(HV):
            h = hv // (HV // H)
            S = [[h0[b][hv][i][j] if h0 is not None else 0.0 for j in range(V)] for i in range(K)]
            for t in range(T):
                for i in range(K):
                    decay = math.exp(g[b][t][hv][i])
                    for j in range(V):
                        S[i][j] *= decay
                kt = k[b][t][h]
                for j in range(V):
                    pred = sum(kt[i] * S[i][j] for i in range(K))
                    err = v[b][t][hv][j] - pred
                    for i in range(K):
                        S[i][j] += beta[b][t][hv] * kt[i] * err
                for j in range(V):
                    out[b][t][hv][j] = sum(scale * q[b][t][h][i] * S[i][j] for i in range(K))
            finals[b][hv] = S
    return torch.tensor(out, dtype=F64), torch.tensor(finals, dtype=F64)


def test_naive_matches_scalar_loop():
    inputs, kw = make_case(1, B=2, T=9, H=1, HV=2, K=3, V=2, h0=True)
    h0 = kw["initial_state"]
    o_ref, ht_ref = _scalar_loop_kda(*inputs, 0.7, h0.tolist())
    o, ht = naive_recurrent_kda(*inputs, scale=0.7, initial_state=h0, output_final_state=True)
    assert torch.allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(ht, ht_ref, rtol=1e-12, atol=1e-12)
    # default scale is K**-0.5
    o_ref, _ = _scalar_loop_kda(*inputs, 3 ** -0.5, None)
    o, _ = naive_recurrent_kda(*inputs)
    assert torch.allclose(o, o_ref, rtol=1e-12, atol=1e-12)


def test_naive_varlen_equals_separate_sequences():
    """cu_seqlens must equal running each document alone with its own initial state."""
    cu = [0, 1, 20, 20, 45]
    inputs, kw = make_case(2, T=45, H=2, HV=4, K=8, V=6, h0=True, N=4, gate="unb")
    h0 = kw.pop("initial_state")
    o, ht = naive_recurrent_kda(*inputs, initial_state=h0, output_final_state=True,
                                cu_seqlens=torch.tensor(cu), **kw)
    for n in range(4):
        sl = [x[:, cu[n]:cu[n + 1]] for x in inputs]
        o_n, ht_n = naive_recurrent_kda(*sl, initial_state=h0[n:n + 1], output_final_state=True, **kw)
        assert torch.allclose(o[:, cu[n]:cu[n + 1]], o_n, rtol=0, atol=1e-14)
        assert torch.allclose(ht[n], ht_n[0], rtol=0, atol=1e-14)
    assert torch.equal(ht[2], h0[2])  # empty document: state passes through


def test_gate_formulas():
    torch.manual_seed(3)
    HV, K = 3, 4
    g = 8 * torch.randn(2, 5, HV, K, dtype=F64)
    A = torch.randn(HV, dtype=torch.float32)
    dt = torch.randn(HV * K, dtype=torch.float32)
    x = g + dt.double().view(HV, K)
    a = A.double().exp().view(HV, 1)
    assert torch.allclose(kda_gate(g, A, dt), -a * F.softplus(x, threshold=20.0))
    assert torch.allclose(kda_gate(g, A.view(1, 1, HV, 1), dt), -a * F.softplus(x, threshold=20.0))
    assert torch.allclose(kda_gate(g, A, None), -a * F.softplus(g, threshold=20.0))
    assert torch.allclose(kda_gate(g, A, dt, lower_bound=-5.0), -5.0 * torch.sigmoid(a * x))
    assert torch.allclose(kda_gate(g, None, dt, lower_bound=-3.0), -3.0 * torch.sigmoid(x))
    assert kda_gate(g, A, dt).dtype == F64
    assert kda_gate(g.to(torch.bfloat16), A, dt).dtype == torch.float32
    # softplus switch at 20 is exact and gradients stay finite for huge inputs
    big = torch.tensor([[[[1e4, 25.0, 19.0, -1e4]]]], dtype=F64, requires_grad=True)
    out = kda_gate(big, torch.zeros(1), None)
    assert torch.allclose(out, -torch.tensor([1e4, 25.0, math.log1p(math.exp(19.0)), 0.0], dtype=F64).view(1, 1, 1, 4))
    out.sum().backward()
    assert torch.isfinite(big.grad).all()
    with pytest.raises(ValueError):
        kda_gate(g, None, dt)


def test_prepare_inputs():
    torch.manual_seed(4)
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    g, beta = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2)
    A = torch.zeros(2)
    qq, kk, gg, bb = prepare_inputs(q, k, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                    use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                                    lower_bound=None, A_log=A, dt_bias=None)
    assert torch.allclose(qq, q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6))
    assert torch.allclose(kk.norm(dim=-1), torch.ones(1, 4, 2), atol=1e-5)
    assert torch.allclose(gg, -F.softplus(g))
    assert torch.allclose(bb, 2 * torch.sigmoid(beta))
    q16 = q.to(torch.bfloat16)
    out = prepare_inputs(q16, q16, g, beta, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                         use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                         A_log=None, dt_bias=None)
    assert all(t.dtype == torch.float32 for t in out)
    with pytest.raises(ValueError):
        prepare_inputs(q, k, g, beta, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                       use_beta_sigmoid_in_kernel=False, allow_neg_eigval=True, lower_bound=None,
                       A_log=None, dt_bias=None)


def test_l2norm_epsilon_is_1e_6():
    """The l2norm is x / sqrt(sum x^2 + 1e-6) (fla's l2norm eps), pinned where the epsilon matters:
    rows whose sum of squares is near 1e-6 (another epsilon, 1e-5 or 1e-7 or none, moves them by
    tens of percent; at unit-scale inputs, test_prepare_inputs', it moves nothing visible), and an
    all-zero row (0, not NaN). Checked against a hand computation in Python floats, in
    prepare_inputs, in the chunked reference's stages and in both references' outputs."""
    torch.manual_seed(6)
    K = 16
    q = 1e-4 * torch.randn(1, 4, 2, K, dtype=F64)  # sum q^2 ~ 1.6e-7 .. 4e-7
    k = 3e-4 * torch.randn(1, 4, 2, K, dtype=F64)  # sum k^2 ~ 1.4e-6
    q[0, 3, 1] = 0.0

    def by_hand(x):
        out = torch.empty_like(x)
        for idx in torch.cartesian_prod(*(torch.arange(n) for n in x.shape[:-1])).tolist():
            row = [float(e) for e in x[tuple(idx)]]
            r = 1.0 / math.sqrt(sum(e * e for e in row) + 1e-6)
            out[tuple(idx)] = torch.tensor([e * r for e in row], dtype=F64)
        return out

    want_q, want_k = by_hand(q), by_hand(k)
    norms = want_q.norm(dim=-1)
    assert 0.2 < norms[0, :3].min() and norms[0, :3].max() < 0.6, "inputs not in the epsilon's range"
    assert norms[0, 3, 1] == 0.0
    g, beta = torch.zeros(1, 4, 2, K, dtype=F64), torch.zeros(1, 4, 2, dtype=F64)
    qq, kk, _, _ = prepare_inputs(q, k, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False,
                                  use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                                  A_log=None, dt_bias=None)
    torch.testing.assert_close(qq, want_q, rtol=1e-12, atol=0)
    torch.testing.assert_close(kk, want_k, rtol=1e-12, atol=0)
    # through both references: one token per sequence of a zero state, o = scale (q^ . k^) beta v
    v = torch.randn(1, 4, 2, 8, dtype=F64)
    beta = torch.rand(1, 4, 2, dtype=F64)
    cu = torch.tensor([0, 1, 2, 3, 4])
    gg = torch.zeros_like(g)
    o_want = 0.5 * ((want_q * want_k).sum(-1) * beta)[..., None] * v
    for fn in (naive_recurrent_kda, chunk_kda_reference):
        o, _ = fn(q, k, v, gg, beta, scale=0.5, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        torch.testing.assert_close(o, o_want, rtol=1e-12, atol=1e-300)
    _, _, st = chunk_kda_reference(q, k, v, gg, beta, use_qk_l2norm_in_kernel=True, return_stages=True)
    torch.testing.assert_close(st["q"], want_q, rtol=1e-12, atol=0)
    torch.testing.assert_close(st["k"], want_k, rtol=1e-12, atol=0)


def test_dtypes_and_errors():
    inputs, kw = make_case(5, T=20, H=2, HV=4, K=8, V=8, dtype=torch.float32, h0=True)
    inputs = [inputs[0].to(torch.bfloat16)] + inputs[1:]
    for fn in (naive_recurrent_kda, chunk_kda_reference):
        o, ht = fn(*inputs, output_final_state=True, **kw)
        assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    inputs2, _ = make_case(5, B=2, T=8, K=4, V=4)
    with pytest.raises(ValueError):
        naive_recurrent_kda(*inputs2, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError):
        chunk_kda_reference(*inputs2, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError):
        chunk_kda_reference(*inputs2, initial_state=torch.zeros(3, 1, 4, 4, dtype=F64))
    with pytest.raises(ValueError):
        chunk_kda_reference(*inputs2, use_gate_in_kernel=True)  # no A_log, no lower_bound


def _grad_inputs(inputs, kw):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    kw = dict(kw)
    for name in ("A_log", "dt_bias", "initial_state"):
        if name in kw:
            kw[name] = kw[name].detach().clone().requires_grad_()
    return leaves, kw


def _grads(fn, inputs, kw, seed=0, **extra):
    leaves, kw = _grad_inputs(inputs, kw)
    o, ht = fn(*leaves, output_final_state=True, **kw, **extra)
    torch.manual_seed(seed)
    do = torch.randn(o.shape, dtype=o.dtype)      # not randn_like: strides must not matter
    dht = torch.randn(ht.shape, dtype=ht.dtype)
    ((o * do).sum() + (ht * dht).sum()).backward()
    names = ["q", "k", "v", "g", "beta"]
    out = {n: x.grad for n, x in zip(names, leaves)}
    for name in ("A_log", "dt_bias", "initial_state"):
        if name in kw:
            out[name] = kw[name].grad
    return o, ht, out


def test_gradients_flow_and_chunked_matches_naive():
    inputs, kw = make_case(6, T=75, H=2, HV=4, K=12, V=10, gate="unb", h0=True)
    extra = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    _, _, gn = _grads(naive_recurrent_kda, inputs, kw, **extra)
    _, _, gc = _grads(chunk_kda_reference, inputs, kw, chunk_size=32, **extra)
    assert set(gc) == {"q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"}
    for name, gr in gc.items():
        assert gr is not None, name
        assert torch.isfinite(gr).all(), name
        assert gr.abs().max() > 0, name
        assert rel_rms(gn[name], gr) <= 1e-8, f"d{name}: {rel_rms(gn[name], gr):.3e}"
    assert gc["A_log"].shape == kw["A_log"].shape and gc["A_log"].dtype == torch.float32


def test_gradients_varlen_state_v_first():
    inputs, kw = make_case(7, T=100, HV=2, K=8, V=12, h0=True, N=3, state_v_first=True, gate="bnd")
    kw["cu_seqlens"] = torch.tensor([0, 1, 40, 100], dtype=torch.int32)
    _, _, gn = _grads(naive_recurrent_kda, inputs, kw)
    _, _, gc = _grads(chunk_kda_reference, inputs, kw)
    for name, gr in gc.items():
        assert torch.isfinite(gr).all() and gr.abs().max() > 0, name
        assert rel_rms(gn[name], gr) <= 1e-8, f"d{name}: {rel_rms(gn[name], gr):.3e}"


@pytest.mark.parametrize("mode", ["pre-1000", "A16"])
def test_extreme_gates_finite(mode):
    if mode == "pre-1000":
        inputs, kw = make_case(8, T=150, H=2, HV=4, K=16, V=8, gate="pre", extreme=0.3, h0=True)
    else:
        inputs, kw = make_case(9, T=150, H=2, HV=4, K=16, V=8, gate="unb", a_max=16.0, h0=True)
        inputs[3] = inputs[3] * 4 + 2  # big raw gates: per-step decay down to ~ -16 * 14
    extra = dict(use_qk_l2norm_in_kernel=True)
    for dtype in (F64, torch.float32):
        ins = [x.to(dtype) for x in inputs]
        kwd = dict(kw)
        kwd["initial_state"] = kw["initial_state"].to(dtype)
        on, hn, gn = _grads(naive_recurrent_kda, ins, kwd, **extra)
        oc, hc, gc = _grads(chunk_kda_reference, ins, kwd, **extra)
        for name, t in [("o", oc), ("ht", hc), *gc.items()]:
            assert torch.isfinite(t).all(), f"{dtype} {name} not finite"
        # fp32: the in-chunk cumsum reaches ~-3e4 with -1000 steps, so g2 differences carry ~1e-3
        # relative rounding; that is the chunked form's inherent fp32 error, not a bug.
        tol = 1e-9 if dtype == F64 else 2e-3
        _assert_rel("o", on, oc, tol)
        _assert_rel("ht", hn, hc, tol)
        if dtype == F64:
            for name in gc:
                assert rel_rms(gn[name], gc[name]) <= 1e-8, name
    if mode == "pre-1000":
        assert (inputs[3] == -1000).float().mean() > 0.25


def test_gradcheck_chunked_tiny():
    inputs, kw = make_case(10, T=5, H=1, HV=2, K=3, V=3, gate="unb", h0=True)
    kw["dt_bias"] = kw["dt_bias"].double()
    kw["A_log"] = kw["A_log"].double()
    leaves, kw = _grad_inputs(inputs, kw)
    A, dt, h0 = kw.pop("A_log"), kw.pop("dt_bias"), kw.pop("initial_state")

    def f(q, k, v, g, beta, A, dt, h0):
        o, ht = chunk_kda_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True, A_log=A,
                                    dt_bias=dt, chunk_size=4, use_qk_l2norm_in_kernel=True,
                                    use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, **kw)
        return o, ht

    assert torch.autograd.gradcheck(f, (*leaves, A, dt, h0), eps=1e-6, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- stages

def _chunks_of(cu, T, BT):
    """(t0, t1, is_first_of_sequence) of every chunk, in order."""
    cu = cu or [0, T]
    out = []
    for n in range(len(cu) - 1):
        for t0 in range(cu[n], cu[n + 1], BT):
            out.append((n, t0, min(t0 + BT, cu[n + 1]), t0 == cu[n]))
    return out


@pytest.mark.parametrize("cu,BT", [(None, 32), ([0, 1, 50, 50, 117], 32), (None, 64)])
def test_stages_satisfy_definitions(cu, BT):
    T = 117
    N = 1 if cu is None else len(cu) - 1
    inputs, kw = make_case(11, T=T, H=2, HV=4, K=10, V=6, gate="unb", h0=True, N=N)
    kw.update(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, scale=0.6)
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu)
    o, ht, st = chunk_kda_reference(*inputs, output_final_state=True, chunk_size=BT, return_stages=True, **kw)
    on, _ = naive_recurrent_kda(*inputs, **kw)
    q, k, beta, gate = st["q"], st["k"], st["beta"], st["gate"]
    HV, K, V = 4, 10, 6
    assert q.shape == (1, T, 2, K) and beta.shape == (1, T, HV) and gate.shape == (1, T, HV, K)
    for key, shape in [("g2", (1, T, HV, K)), ("Aqk", (1, T, HV, BT)), ("Akk", (1, T, HV, BT)),
                       ("w", (1, T, HV, K)), ("u", (1, T, HV, V)), ("kg", (1, T, HV, K)),
                       ("qg", (1, T, HV, K)), ("v_new", (1, T, HV, V)), ("o", (1, T, HV, V))]:
        assert st[key].shape == shape, key
    chunks = _chunks_of(cu, T, BT)
    assert st["h"].shape == (1, len(chunks), HV, K, V)
    # preprocessing
    assert torch.allclose(q, inputs[0] / torch.sqrt((inputs[0] ** 2).sum(-1, keepdim=True) + 1e-6))
    assert torch.allclose(beta, torch.sigmoid(inputs[4]))
    assert torch.allclose(gate, kda_gate(inputs[3], kw["A_log"], kw["dt_bias"]))
    _assert_rel("o(stage)", on, st["o"], 1e-10)
    qe, ke = q.repeat_interleave(2, 2)[0], k.repeat_interleave(2, 2)[0]   # [T, HV, K]
    v = inputs[2][0]
    h0 = kw["initial_state"]
    for c, (n, t0, t1, first) in enumerate(chunks):
        L = t1 - t0
        sl = slice(t0, t1)
        g2 = gate[0, sl].cumsum(0) / math.log(2)                          # [L, HV, K]
        assert torch.allclose(st["g2"][0, sl], g2, rtol=1e-12, atol=1e-12)
        Aqk, Akk = st["Aqk"][0, sl].permute(1, 0, 2), st["Akk"][0, sl].permute(1, 0, 2)  # [HV, L, BT]
        assert (Aqk[..., L:] == 0).all() and (Akk[..., L:] == 0).all()
        Aqk, Akk = Aqk[..., :L], Akk[..., :L]
        qc, kc, vc = qe[sl].transpose(0, 1), ke[sl].transpose(0, 1), v[sl].transpose(0, 1)  # [HV, L, *]
        g2c, bc = g2.transpose(0, 1), beta[0, sl].transpose(0, 1)          # [HV, L, K], [HV, L]
        Aqk_ref = torch.zeros(HV, L, L, dtype=F64)
        Lmat = torch.zeros(HV, L, L, dtype=F64)
        for i in range(L):
            for j in range(i + 1):
                dec = torch.exp(math.log(2) * (g2c[:, i] - g2c[:, j]))
                Aqk_ref[:, i, j] = 0.6 * (qc[:, i] * kc[:, j] * dec).sum(-1)
                if j < i:
                    Lmat[:, i, j] = bc[:, i] * (kc[:, i] * kc[:, j] * dec).sum(-1)
        assert torch.allclose(Aqk, Aqk_ref, rtol=1e-10, atol=1e-12)
        eye = torch.eye(L, dtype=F64)
        assert torch.allclose((eye + Lmat) @ (Akk / bc[:, None, :]), eye.expand(HV, L, L), atol=1e-9)
        assert (Akk.triu(1) == 0).all()
        w = st["w"][0, sl].transpose(0, 1)
        u = st["u"][0, sl].transpose(0, 1)
        assert torch.allclose(w, Akk @ (torch.exp2(g2c) * kc), atol=1e-12)
        assert torch.allclose(u, Akk @ vc, atol=1e-12)
        G = g2c[:, -1:, :]
        kg = st["kg"][0, sl].transpose(0, 1)
        assert torch.allclose(kg, kc * torch.exp2(G - g2c), atol=1e-12)
        assert torch.allclose(st["qg"][0, sl].transpose(0, 1), qc * torch.exp2(g2c), atol=1e-12)
        h = st["h"][0, c]
        if first:
            assert torch.equal(h, h0[n])
        else:  # the state before this chunk is the naive final state of the sequence's prefix
            t_seq0 = cu[n] if cu else 0
            sl_pre = [x[:, t_seq0:t0] for x in inputs]
            _, h_pre = naive_recurrent_kda(*sl_pre, output_final_state=True,
                                           **{**{a: b for a, b in kw.items() if a != "cu_seqlens"},
                                              "initial_state": h0[n:n + 1]})
            assert torch.allclose(h, h_pre[0], atol=1e-10)
        vn = st["v_new"][0, sl].transpose(0, 1)
        assert torch.allclose(vn, u - w @ h, atol=1e-12)
        o_c = st["o"][0, sl].transpose(0, 1)
        assert torch.allclose(o_c, 0.6 * (st["qg"][0, sl].transpose(0, 1) @ h) + Aqk @ vn, atol=1e-12)
        # next state
        h_next = torch.exp2(G[:, 0, :])[..., None] * h + kg.transpose(-1, -2) @ vn
        if c + 1 < len(chunks) and not chunks[c + 1][3]:
            assert torch.allclose(st["h"][0, c + 1], h_next, atol=1e-12)
        elif c + 1 == len(chunks) or chunks[c + 1][3]:
            assert torch.allclose(ht[n], h_next, atol=1e-12)
