"""The KDA forward on our sm_90a kernels against the fp64 chunked reference (kernel_fun.ref.kda):
o and the final state over the contract's cases, per-stage intermediates (w, qg, kg, Aqk, Akk,
exp2(G), per-chunk states), NaN-poisoned outputs, bitwise determinism, a non-default stream,
extreme gates, bad inputs, opcheck, the chunk_kda front, and parity with fla."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from helpers import (as_stored_fp32, check_stream_flags, chunk_map_want, KDA_TOL, kda_reference, our_launches, rel_rms,
                     run_serialised)

pytestmark = pytest.mark.gpu

STAGE_TOL = 0.01  # workspace tensors are stored in bf16/fp16: their rounding alone is ~3e-3


def _kernel():
    from kernel_fun.kda import _kernel
    return _kernel


def make_case(B=1, T=100, H=2, HV=None, K=128, V=128, dtype=torch.bfloat16, gate="unbounded",
              g_dtype=None, l2norm=True, beta_sigmoid=True, neg_eig=False, h0=False, final=True,
              state_v_first=False, cu=None, cu_dtype=torch.int32, scale=None, seed=0, extreme=0.0, qk_scale=1.0):
    """Inputs + chunk_kda keyword arguments for one case (all on CUDA). qk_scale multiplies the raw q
    and k: 1e5 puts raw bf16 entries above fp16's range (the intra's fp16 P2 operands must not
    overflow), 1e-3 with fp16 inputs puts gated operands below fp16's normal range."""
    HV = HV or H
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    q = torch.randn(B, T, H, K, device=dev, generator=gen)
    k = torch.randn(B, T, H, K, device=dev, generator=gen)
    if not l2norm:  # the delta rule needs unit keys; fla's tests normalise outside the kernel
        q = torch.nn.functional.normalize(q, dim=-1)
        k = torch.nn.functional.normalize(k, dim=-1)
    q, k = qk_scale * q, qk_scale * k
    v = torch.randn(B, T, HV, V, device=dev, generator=gen)
    beta_raw = torch.randn(B, T, HV, device=dev, generator=gen)
    kw = dict(use_qk_l2norm_in_kernel=l2norm, use_beta_sigmoid_in_kernel=beta_sigmoid, allow_neg_eigval=neg_eig,
              state_v_first=state_v_first, output_final_state=final, scale=scale)
    beta = beta_raw if beta_sigmoid else torch.sigmoid(beta_raw)
    A_log = dt_bias = None
    if gate == "unbounded":
        g = torch.randn(B, T, HV, K, device=dev, generator=gen)
        A_log = torch.log(torch.empty(HV, device=dev).uniform_(1, 16, generator=gen))
        dt_bias = 0.5 * torch.randn(HV * K, device=dev, generator=gen)
        kw.update(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    elif gate == "unbounded16":  # exp(A_log) = 16 and large inputs: per-step decays of ~ -100
        g = 3 * torch.randn(B, T, HV, K, device=dev, generator=gen) + 4
        A_log = torch.full((HV,), math.log(16.0), device=dev)
        kw.update(use_gate_in_kernel=True, A_log=A_log, dt_bias=None)
    elif gate == "bounded":
        g = torch.randn(B, T, HV, K, device=dev, generator=gen)
        A_log = torch.log(torch.empty(HV, device=dev).uniform_(1, 16, generator=gen))
        dt_bias = 0.5 * torch.randn(HV * K, device=dev, generator=gen)
        kw.update(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, safe_gate=True)
    elif gate == "bounded16":  # exp(A_log) = 16, large inputs: nearly every step at lower_bound = -5, the
        # widest range of the bounded-gate midpoint factors (kda_bwd_grads' I3 on tensor cores)
        g = 3 * torch.randn(B, T, HV, K, device=dev, generator=gen) + 4
        A_log = torch.full((HV,), math.log(16.0), device=dev)
        kw.update(use_gate_in_kernel=True, A_log=A_log, dt_bias=None, lower_bound=-5.0, safe_gate=True)
    elif gate == "bounded_noalog":
        g = torch.randn(B, T, HV, K, device=dev, generator=gen)
        kw.update(use_gate_in_kernel=True, A_log=None, lower_bound=-3.0)
    elif gate == "precomputed":
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, K, device=dev, generator=gen) + 2)
        kw.update(use_gate_in_kernel=False)
    elif gate == "precomputed_weak":  # ~ -0.003 per step: the far block pairs of a chunk carry weight
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, K, device=dev, generator=gen) + 6)
        kw.update(use_gate_in_kernel=False)
    elif gate == "bounded_weak":  # every step in (-0.05, 0): the bounded tensor-core paths' far pairs count
        g = torch.randn(B, T, HV, K, device=dev, generator=gen)
        A_log = torch.log(torch.empty(HV, device=dev).uniform_(1, 16, generator=gen))
        kw.update(use_gate_in_kernel=True, A_log=A_log, dt_bias=0.5 * torch.randn(HV * K, device=dev, generator=gen),
                  lower_bound=-0.05)
    else:
        raise ValueError(gate)
    if extreme:  # fla's varlen tests: a fraction of the per-step gates at -1000
        mask = torch.rand(g.shape, device=dev, generator=gen) < extreme
        g = torch.where(mask, torch.full_like(g, -1000.0), g)
        assert not kw["use_gate_in_kernel"], "extreme entries apply to precomputed gates"
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu, dtype=cu_dtype, device=dev)
        N = len(cu) - 1
    else:
        N = B
    if h0:
        shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        kw["initial_state"] = 0.1 * torch.randn(shape, device=dev, generator=gen)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    g = g.to(g_dtype or torch.float32)
    beta = beta.to(dtype)
    return (q, k, v, g, beta), kw


def reference(inputs, kw, return_stages=False):
    """fp64 chunked reference on the GPU."""
    return kda_reference(inputs, kw, return_stages=return_stages)


def options(inputs, kw):
    """The KdaOptions of a case (what chunk_kda builds from the same arguments)."""
    from kernel_fun.kda._options import KdaOptions
    q = inputs[0]
    scale = kw.get("scale")
    return KdaOptions.from_call(
        scale=q.shape[-1] ** -0.5 if scale is None else scale,
        use_qk_l2norm_in_kernel=kw.get("use_qk_l2norm_in_kernel", False),
        use_gate_in_kernel=kw.get("use_gate_in_kernel", False),
        use_beta_sigmoid_in_kernel=kw.get("use_beta_sigmoid_in_kernel", False),
        allow_neg_eigval=kw.get("allow_neg_eigval", False), lower_bound=kw.get("lower_bound"),
        A_log=kw.get("A_log") if kw.get("use_gate_in_kernel") else None,
        state_v_first=kw.get("state_v_first", False), chunk_size=64)


def run_ours(inputs, kw, **extra):
    """(o, final_state, h_states, ws) from our kernels (kernel_fun.kda._kernel.forward_stages)."""
    q, k, v, g, beta = inputs
    args = dict(opts=options(inputs, kw), initial_state=kw.get("initial_state"),
                output_final_state=kw.get("output_final_state", False), cu_seqlens=kw.get("cu_seqlens"),
                A_log=kw.get("A_log") if kw.get("use_gate_in_kernel") else None,
                dt_bias=kw.get("dt_bias") if kw.get("use_gate_in_kernel") else None)
    args.update(extra)
    return _kernel().forward_stages(q, k, v, g, beta, **args)


# ------------------------------------------------------------------------------------------------
# o and final state against the fp64 reference over the contract's cases
CASES = {
    "T1": dict(B=2, T=1),
    "T63": dict(B=2, T=63),
    "T64": dict(B=2, T=64),
    "T65": dict(B=2, T=65, h0=True),
    "T1000": dict(B=2, T=1000, h0=True),
    "T1500-fp16": dict(B=1, T=1500, dtype=torch.float16, h0=True),
    "T8192": dict(B=1, T=8192, H=1),
    "K64-V64": dict(T=300, K=64, V=64, h0=True),
    "K64-V192": dict(T=200, K=64, V=192),
    "K128-V256": dict(T=300, V=256, h0=True),
    "K128-V320": dict(T=130, V=320),
    "K128-V512": dict(T=129, H=1, V=512, h0=True),
    "GVA-2-4": dict(T=333, H=2, HV=4, h0=True),
    "GVA-2-8-fp16": dict(T=200, H=2, HV=8, dtype=torch.float16),
    "bounded": dict(T=500, gate="bounded", h0=True),
    "bounded-noalog": dict(T=500, gate="bounded_noalog"),
    "precomputed-nol2": dict(T=400, gate="precomputed", l2norm=False, beta_sigmoid=False),
    "neg-eigval": dict(T=400, neg_eig=True, h0=True),
    "scale": dict(T=200, scale=0.3),
    "state-v-first": dict(T=300, h0=True, state_v_first=True),
    "g-bf16": dict(T=300, g_dtype=torch.bfloat16),
    "extreme-unbounded16": dict(T=700, gate="unbounded16", h0=True),
    "extreme-1000": dict(T=700, gate="precomputed", extreme=0.5, h0=True),
    "extreme-1000-90": dict(T=300, gate="precomputed", extreme=0.9, dtype=torch.float16),
    "varlen-15": dict(T=15, cu=[0, 15]),
    "varlen-onetoken": dict(T=200, cu=[0, 1, 64, 65, 200], h0=True),
    "varlen-empty-int64": dict(T=300, cu=[0, 0, 100, 100, 300], cu_dtype=torch.int64, h0=True),
    "varlen-fla": dict(T=2000, H=2, HV=4, cu=[0, 15, 100, 300, 1200, 2000], h0=True),
    "varlen-extreme-bounded": dict(T=1000, cu=[0, 256, 500, 1000], gate="bounded"),
    "varlen-extreme-1000": dict(T=1000, cu=[0, 256, 500, 1000], gate="precomputed", extreme=0.3),
    "weak-decay": dict(T=300, gate="precomputed_weak", h0=True),  # every block pair of a chunk counts
    "bounded-weak": dict(T=300, gate="bounded_weak", h0=True),
    "large-qk": dict(T=300, qk_scale=1e5, h0=True),
    "small-qk-fp16-weak": dict(T=300, qk_scale=1e-3, dtype=torch.float16, gate="precomputed_weak", h0=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_fp64_reference(name):
    inputs, kw = make_case(**CASES[name])
    o, ht, _, _ = run_ours(inputs, kw, poison=True)
    o_ref, ht_ref = reference(inputs, kw)
    assert torch.isfinite(o).all(), "o has NaN/Inf (unwritten rows or overflow)"
    assert rel_rms(o_ref, o) <= KDA_TOL["o"], f"o rel-RMS {rel_rms(o_ref, o):.3e}"
    if kw.get("output_final_state"):
        assert torch.isfinite(ht).all()
        assert rel_rms(ht_ref, ht) <= KDA_TOL["ht"], f"ht rel-RMS {rel_rms(ht_ref, ht):.3e}"


# ------------------------------------------------------------------------------------------------
# per-stage intermediates against the chunked reference
def _last_rows(cu, B, T):
    """Row (flattened over B*T) of the last valid token of every chunk, in global chunk order."""
    rows = []
    segs = [(b * T, b * T + T) for b in range(B)] if cu is None else list(zip(cu[:-1], cu[1:]))
    for s, e in segs:
        for c0 in range(s, e, 64):
            rows.append(min(c0 + 64, e) - 1)
    return rows


@pytest.mark.parametrize("name", ["T1000", "GVA-2-4", "varlen-onetoken", "extreme-1000", "state-v-first",
                                  "K64-V192"])
def test_stages_match_chunked_reference(name):
    case = CASES[name]
    inputs, kw = make_case(**case)
    o, ht, hs, ws = run_ours(inputs, kw, return_intermediate_states=True, poison=True)
    _, _, st = reference(inputs, kw, return_stages=True)
    B, T = inputs[0].shape[:2]
    HV, K = inputs[3].shape[2:]
    scale = kw.get("scale") or K ** -0.5
    flat = lambda x: x.reshape(B * T, *x.shape[2:])  # noqa: E731
    checks = {
        "qg": (flat(st["qg"]) * scale, ws["qg"]),
        "kg": (flat(st["kg"]), ws["kg"]),
        "w": (flat(st["w"]), ws["w"]),
        "Aqk": (flat(st["Aqk"]), ws["Aqk"]),
        "Akk": (flat(st["Akk"]), ws["Akk"]),
    }
    rows = _last_rows(case.get("cu"), B, T)
    G = flat(st["g2"])[rows]
    checks["exp2(G)"] = (as_stored_fp32(torch.exp2(G)), ws["gdecay"][: len(rows)])
    h_ref = st["h"]
    if kw.get("state_v_first"):
        hs = hs.transpose(-1, -2)
    checks["h"] = (h_ref, hs)
    bad = {}
    for key, (ref, got) in checks.items():
        err = rel_rms(ref, got)
        if not err <= STAGE_TOL:
            bad[key] = err
    assert not bad, f"stages off the reference: {bad}"


@pytest.mark.parametrize("cu", [[0, 15, 100, 300, 1200, 2000], [0, 0, 1, 65, 130, 130, 700], [0, 64, 128, 192],
                                [0, *itertools.accumulate((53 * i) % 300 for i in range(32))],
                                [0, *itertools.accumulate((53 * i) % 300 for i in range(33))],
                                [0, *itertools.accumulate((37 * i) % 200 for i in range(5000))]],
                         ids=["fla", "empty-onetoken", "ties", "32-docs", "33-docs", "5000-docs"])
def test_chunk_map_orders_sequences_longest_first(cu):
    """kda_chunk_map on the device (one warp's shuffles up to 32 sequences, else a cub scan and radix
    sort): the offsets, then the sequences longest first for the scans' grid. Past 4096 sequences
    the order is the identity (the last case)."""
    inputs, kw = make_case(T=cu[-1], cu=cu, H=1)
    _, _, _, ws = run_ours(inputs, kw)
    got = ws["chunk_offsets"].tolist()
    want = chunk_map_want(cu)
    N = len(cu) - 1
    if N > 4096:
        want = want[: N + 1] + list(range(N))
    assert got == want


# ------------------------------------------------------------------------------------------------
def test_bitwise_deterministic():
    inputs, kw = make_case(**CASES["varlen-fla"])
    a = run_ours(inputs, kw)
    b = run_ours(inputs, kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for key in ("w", "qg", "kg", "Aqk", "Akk"):
        assert torch.equal(a[3][key], b[3][key]), key


def test_non_default_stream():
    inputs, kw = make_case(B=2, T=700, h0=True)
    base = run_ours(inputs, kw)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        # work queued ahead on the side stream: our launches must follow it, not the legacy stream
        torch.cuda._sleep(2_000_000)
        got = run_ours(inputs, kw)
    s.synchronize()
    assert torch.equal(base[0], got[0]) and torch.equal(base[1], got[1])


def test_large_B_scan_slices():
    # enough (b, hv) pairs for the 128-wide V-slices of the scan
    inputs, kw = make_case(B=8, T=130, H=36, V=256, h0=True)
    o, ht, _, _ = run_ours(inputs, kw, poison=True)
    o_ref, ht_ref = reference(inputs, kw)
    assert rel_rms(o_ref, o) <= KDA_TOL["o"] and rel_rms(ht_ref, ht) <= KDA_TOL["ht"]


def test_empty_sequence_passes_initial_state_through():
    inputs, kw = make_case(T=64, cu=[0, 0, 64], h0=True)
    _, ht, _, _ = run_ours(inputs, kw)
    assert torch.equal(ht[0], kw["initial_state"][0])


# ------------------------------------------------------------------------------------------------
def test_support_reasons():
    from kernel_fun import _ext
    from kernel_fun.kda._options import KdaOptions

    def reason(K=128, V=128, dtype=torch.bfloat16, chunk_size=64, states=False):
        q = torch.empty(1, 8, 2, K, dtype=dtype, device="cuda")
        v = torch.empty(1, 8, 2, V, dtype=dtype, device="cuda")
        g = torch.empty(1, 8, 2, K, device="cuda")
        b = torch.empty(1, 8, 2, dtype=dtype, device="cuda")
        opts = KdaOptions(scale=0.1, l2norm=True, chunk_size=chunk_size, intermediate_states=states)
        return _ext.ops().kda_support(q, q, v, g, b, None, opts.encode()) or None

    assert reason() is None
    assert reason(K=64, V=512) is None
    assert reason(K=96) == "K=96 (kernels support K in {64, 128})"
    assert reason(V=100) == "V=100 (kernels support V a multiple of 64 up to 512)"
    assert reason(V=576) == "V=576 (kernels support V a multiple of 64 up to 512)"
    assert reason(dtype=torch.float32) == "q dtype float32 (kernels take bfloat16 or float16)"
    assert reason(chunk_size=32) is None and reason(states=True) is None
    assert reason(chunk_size=32, states=True) == ("chunk_size=32 with return_intermediate_states (our kernels "
                                                  "return a state every 64 tokens)")


def _raw_fwd_args(inputs, kw, o, ht):
    q, k, v, g, beta = inputs
    from kernel_fun.kda._kernel import gate_params
    opts = options(inputs, kw)
    A, D = gate_params(opts, kw.get("A_log"), kw.get("dt_bias"))
    return [q, k, v, g, beta, A, D, kw.get("initial_state"), kw.get("cu_seqlens"), opts.encode(), o, ht, None,
            None, None, None, None, None, None, None, None]


def test_opcheck():
    inputs, kw = make_case(T=70, H=1, K=64, V=64, h0=True)
    q = inputs[0]
    o = torch.empty(1, 70, 1, 64, dtype=q.dtype, device="cuda")
    ht = torch.empty(1, 1, 64, 64, device="cuda")
    torch.library.opcheck(torch.ops.kernel_fun.kda_fwd.default, _raw_fwd_args(inputs, kw, o, ht),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_front_engages_our_kernels():
    from kernel_fun import _dispatch
    from kernel_fun.kda import chunk_kda, is_supported
    # The first engage logs kernel_fun.versions() (its build_info op once segfaulted on the H200
    # box); make this call the first so that path is exercised here.
    _dispatch._versions_logged = False
    _dispatch.forget_logged("kda")
    inputs, kw = make_case(B=2, T=300, h0=True)
    q, k, v, g, beta = inputs
    call_kw = {n: x for n, x in kw.items() if x is not None}
    ok, why = is_supported(q, v, k=k, g=g, beta=beta, **call_kw)
    assert ok, why
    with torch.no_grad(), our_launches(kda_fwd=1):  # strict mode, our forward counted
        o, ht = chunk_kda(q, k, v, g, beta, **call_kw)
    o_ref, ht_ref = reference(inputs, kw)
    assert rel_rms(o_ref, o) <= KDA_TOL["o"] and rel_rms(ht_ref, ht) <= KDA_TOL["ht"]


@pytest.mark.fla
@pytest.mark.parametrize("name", ["T1000", "varlen-fla", "bounded"])
def test_parity_with_fla(name):
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    inputs, kw = make_case(**CASES[name])
    q, k, v, g, beta = inputs
    call_kw = {n: x for n, x in kw.items() if x is not None}
    with torch.no_grad():
        o_fla, ht_fla = fla_chunk_kda(q, k, v, g, beta, **call_kw)
    o, ht, _, _ = run_ours(inputs, kw)
    o_ref, ht_ref = reference(inputs, kw)
    e_ours, e_fla = rel_rms(o_ref, o), rel_rms(o_ref, o_fla)
    assert e_ours <= KDA_TOL["o"], (e_ours, e_fla)
    assert rel_rms(ht_ref, ht) <= KDA_TOL["ht"]
    assert rel_rms(o_fla.double(), o) <= 2 * KDA_TOL["o"]


# ------------------------------------------------------------------------------------------------
# the scan at every V-slice width it can pick (KERNEL_FUN_KDA_SCAN_BV forces one)
SCAN_CASES = {
    "K128-V256-h0": dict(B=2, T=300, V=256, h0=True),
    "K64-V192-h0": dict(T=200, K=64, V=192, h0=True),
    "fp16-T333": dict(T=333, dtype=torch.float16, h0=True),
    "state-v-first": dict(T=300, h0=True, state_v_first=True),
    "varlen-fla": dict(T=2000, H=2, HV=4, cu=[0, 15, 100, 300, 1200, 2000], h0=True),
    "varlen-empty-int64": dict(T=300, cu=[0, 0, 100, 100, 300], cu_dtype=torch.int64, h0=True),
}


def _check_scan_case(case):
    inputs, kw = make_case(**case)
    o, ht, hs, _ = run_ours(inputs, kw, return_intermediate_states=True, poison=True)
    o_ref, ht_ref, st = reference(inputs, kw, return_stages=True)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert rel_rms(o_ref, o) <= KDA_TOL["o"], f"o rel-RMS {rel_rms(o_ref, o):.3e}"
    assert rel_rms(ht_ref, ht) <= KDA_TOL["ht"], f"ht rel-RMS {rel_rms(ht_ref, ht):.3e}"
    if kw.get("state_v_first"):
        hs = hs.transpose(-1, -2)
    assert rel_rms(st["h"], hs) <= STAGE_TOL, f"h_states rel-RMS {rel_rms(st['h'], hs):.3e}"
    return o, ht


@pytest.mark.parametrize("bv", ["64", "128"])
@pytest.mark.parametrize("name", list(SCAN_CASES))
def test_scan_every_slice_width(monkeypatch, name, bv):
    case = SCAN_CASES[name]
    if case.get("V", 128) % int(bv):
        pytest.skip(f"V={case.get('V', 128)} has no {bv}-wide slices")
    monkeypatch.setenv("KERNEL_FUN_KDA_SCAN_BV", bv)
    _check_scan_case(case)


def test_scan_deterministic():
    inputs, kw = make_case(B=3, T=1000, HV=2, V=256, h0=True)
    a = run_ours(inputs, kw)
    b = run_ours(inputs, kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ------------------------------------------------------------------------------------------------
# the intra kernel per stage over every option
def _intra_stage_errors(case):
    """rel-RMS of the intra workspace (qg, kg, w, Aqk, Akk, exp2(G)) against the fp64 chunked reference."""
    inputs, kw = make_case(**case)
    _, _, _, ws = run_ours(inputs, kw, poison=True)
    _, _, st = reference(inputs, kw, return_stages=True)
    B, T = inputs[0].shape[:2]
    K = inputs[3].shape[-1]
    scale = kw.get("scale") or K ** -0.5
    flat = lambda x: x.reshape(B * T, *x.shape[2:])  # noqa: E731
    cu = case.get("cu")
    valid = torch.ones(B * T, dtype=torch.bool, device="cuda")
    if cu is not None:  # rows past the last sequence end are never written
        valid[cu[-1]:] = False
    rows = _last_rows(cu, B, T)
    pairs = {
        "qg": (flat(st["qg"]) * scale, ws["qg"]),
        "kg": (flat(st["kg"]), ws["kg"]),
        "w": (flat(st["w"]), ws["w"]),
        "Aqk": (flat(st["Aqk"]), ws["Aqk"]),
        "Akk": (flat(st["Akk"]), ws["Akk"]),
    }
    errs = {}
    for key, (ref, got) in pairs.items():
        got = got[valid]
        assert torch.isfinite(got).all(), f"{key} has NaN/Inf"
        errs[key] = rel_rms(ref[valid], got)
    errs["exp2(G)"] = rel_rms(as_stored_fp32(torch.exp2(flat(st["g2"])[rows])), ws["gdecay"][: len(rows)])
    return errs, ws


INTRA_CASES = ["T1", "T63", "T65", "T1000", "T1500-fp16", "K64-V64", "K64-V192", "GVA-2-4", "GVA-2-8-fp16",
               "bounded", "bounded-noalog", "precomputed-nol2", "scale", "g-bf16", "extreme-unbounded16",
               "extreme-1000", "extreme-1000-90", "varlen-15", "varlen-onetoken", "varlen-empty-int64",
               "varlen-fla", "varlen-extreme-bounded", "varlen-extreme-1000", "large-qk", "small-qk-fp16-weak"]


@pytest.mark.parametrize("name", INTRA_CASES)
def test_intra_stages(name):
    errs, _ = _intra_stage_errors(CASES[name])
    bad = {k: e for k, e in errs.items() if not e <= STAGE_TOL}
    assert not bad, f"intra stages off the reference: {bad}"


@pytest.mark.parametrize("extreme", [0.3, 0.6, 0.9])
def test_intra_extreme_gates_fp16_tight(extreme):
    # fp16 storage rounds at ~3e-4, so the on-chip path (decay products, boundary factorisation,
    # 3xTF32 inverse merge) is visible well below STAGE_TOL: per-step gates of -1000 on a fraction of
    # the entries, where a cumsum reaches -6e4 and exp2 of its differences is most cancellation-prone.
    case = dict(B=2, T=256, H=2, gate="precomputed", extreme=extreme, dtype=torch.float16, seed=3)
    errs, _ = _intra_stage_errors(case)
    bad = {k: e for k, e in errs.items() if not e <= 4e-3}
    assert not bad, f"intra at extreme gates (fp16): {bad}"


def test_intra_deterministic():
    inputs, kw = make_case(B=3, T=1000, H=2, h0=True)
    a = run_ours(inputs, kw)
    b = run_ours(inputs, kw)
    for key in ("w", "qg", "kg", "Aqk", "Akk", "gdecay"):
        assert torch.equal(a[3][key], b[3][key]), key


# last in the file: an error path that crashed the interpreter would otherwise hide the rest
BAD_ARGS = {  # argument index in kda_fwd's schema -> (bad value maker, the message's start)
    "k": (1, lambda t: t[:, :-1], "kernel_fun.kda: k must have shape"),
    "v": (2, lambda t: t.float(), "kernel_fun.kda: unsupported configuration: v dtype differs"),
    "beta": (4, lambda t: t[:, :-1], "kernel_fun.kda: beta must have shape"),
    "A_log": (5, lambda t: torch.zeros(2, device="cuda"), "kernel_fun.kda: A_log must have shape"),
    "options": (9, lambda t: t + ";x=1", "kernel_fun.kda: options: unknown key 'x'"),
    "o": (10, lambda t: t.float(), "kernel_fun.kda: o must be bfloat16"),
    "final_state": (11, lambda t: t[..., :-1], "kernel_fun.kda: final_state must have shape"),
    # the state buffer for the backward only beside the saved factors (Aqk, Akk, M: None here)
    "h_ckpt": (16, lambda t: torch.empty(2, 1, 64, 64, device="cuda", dtype=torch.bfloat16),
               "kernel_fun.kda: h_ckpt (the states saved for the backward) needs Aqk, Akk and M"),
}


def test_raw_op_checks_the_state_buffer_shape():
    """h_ckpt beside the factors must be [max_chunks, HV, V, K] (here 2 chunks of one head, 64 x 64)."""
    inputs, kw = make_case(T=70, H=1, K=64, V=64)
    q = inputs[0]
    o = torch.empty(1, 70, 1, 64, dtype=q.dtype, device="cuda")
    args = _raw_fwd_args(inputs, kw, o, None)
    args[13:16] = [torch.empty(70, 1, 64, dtype=q.dtype, device="cuda") for _ in range(3)]
    args[16] = torch.empty(1, 1, 64, 64, dtype=q.dtype, device="cuda")
    with pytest.raises((ValueError, RuntimeError), match="h_ckpt must have shape"):
        torch.ops.kernel_fun.kda_fwd(*args)
    args[16] = torch.empty(2, 1, 64, 64, dtype=q.dtype, device="cuda")
    torch.ops.kernel_fun.kda_fwd(*args)  # the right shape is taken


def test_raw_op_refuses_per_chunk_states_at_chunk_size_32():
    """h_states holds a state every 64 tokens, so options that ask for chunk_size=32 with h_states are
    refused by name (the front sends such calls to fla); without h_states chunk_size=32 runs."""
    import dataclasses

    inputs, kw = make_case(T=70, H=1, K=64, V=64)
    q = inputs[0]
    o = torch.empty(1, 70, 1, 64, dtype=q.dtype, device="cuda")
    args = _raw_fwd_args(inputs, kw, o, None)
    args[9] = dataclasses.replace(options(inputs, kw), chunk_size=32).encode()
    args[12] = torch.empty(1, 2, 1, 64, 64, dtype=q.dtype, device="cuda")
    with pytest.raises((ValueError, RuntimeError),
                       match="h_states holds a state every 64 tokens; options ask for chunk_size=32"):
        torch.ops.kernel_fun.kda_fwd(*args)
    args[9] = dataclasses.replace(options(inputs, kw), chunk_size=32, intermediate_states=True).encode()
    with pytest.raises((ValueError, RuntimeError), match="chunk_size=32 with return_intermediate_states"):
        torch.ops.kernel_fun.kda_fwd(*args)
    args[9] = dataclasses.replace(options(inputs, kw), chunk_size=32).encode()
    args[12] = None
    torch.ops.kernel_fun.kda_fwd(*args)
    o_ref, _ = reference(inputs, kw)
    assert rel_rms(o_ref, o) <= KDA_TOL["o"]


@pytest.mark.parametrize("name", ["T1000", "varlen-fla", "bounded"])
def test_chunk_size_32_runs_our_kernels(name):
    """fla's chunk_size=32: our kernels chunk as they choose (docs/contract.md), so the call runs our
    forward (counted, strict mode) and gives bit for bit the chunk_size=64 call's o and final state.
    One that also asks for the per-chunk states (one per 32 tokens; ours are per 64) is not ours:
    strict mode raises with that reason."""
    import kernel_fun
    from kernel_fun.kda import chunk_kda, is_supported

    inputs, kw = make_case(**CASES[name])
    call = {n: x for n, x in kw.items() if x is not None}
    q, k, v, g, beta = inputs
    assert is_supported(q, v, k=k, g=g, beta=beta, **call, chunk_size=32) == (True, None)
    with torch.no_grad(), our_launches(kda_fwd=2):
        o64, ht64 = chunk_kda(*inputs, **call)
        o32, ht32 = chunk_kda(*inputs, **call, chunk_size=32)
    assert torch.isfinite(o32).all() and torch.equal(o64, o32)
    assert (ht64 is None and ht32 is None) or torch.equal(ht64, ht32)
    o_ref, _ = reference(inputs, kw)
    assert rel_rms(o_ref, o32) <= KDA_TOL["o"]
    with torch.inference_mode(), kernel_fun.strict():
        chunk_kda(*inputs, **call, return_intermediate_states=True)  # ours at chunk_size=64
        with pytest.raises(kernel_fun.KernelFunUnsupported, match="chunk_size=32 with return_intermediate_states"):
            chunk_kda(*inputs, **call, chunk_size=32, return_intermediate_states=True)


def test_raw_op_checks_the_saved_workspace():
    """w, qg, kg (q's dtype, [B*T, HV, K]) and gdecay (fp32, [max_chunks, HV, K]) come together and
    beside the factors; each wrong one is refused by name, and the right ones are taken."""
    inputs, kw = make_case(T=70, H=1, K=64, V=64)
    q = inputs[0]
    o = torch.empty(1, 70, 1, 64, dtype=q.dtype, device="cuda")
    args = _raw_fwd_args(inputs, kw, o, None)
    rows = lambda: torch.empty(70, 1, 64, dtype=q.dtype, device="cuda")  # noqa: E731
    ws = [rows(), rows(), rows(), torch.empty(2, 1, 64, device="cuda")]  # w, qg, kg, gdecay (2 chunks)

    def refused(change, message):
        bad = list(args)
        bad[17:21] = ws
        change(bad)
        with pytest.raises((ValueError, RuntimeError)) as ei:
            torch.ops.kernel_fun.kda_fwd(*bad)
        assert message in str(ei.value), str(ei.value)

    refused(lambda a: None, "w, qg, kg and gdecay (saved for the backward) need Aqk, Akk and M")
    args[13:16] = [rows() for _ in range(3)]  # the factors from here on
    refused(lambda a: a.__setitem__(20, None), "w, qg, kg and gdecay (saved for the backward) come together")
    refused(lambda a: a.__setitem__(18, rows()[:-1]), "qg must have shape")
    refused(lambda a: a.__setitem__(20, torch.empty(2, 1, 64, device="cuda", dtype=q.dtype)),
            "gdecay must be float32")
    refused(lambda a: a.__setitem__(20, torch.empty(1, 1, 64, device="cuda")), "gdecay must have shape")
    refused(lambda a: a.__setitem__(20, torch.empty(2 * 64 + 1, device="cuda")[1:].view(2, 1, 64)),
            "gdecay must start 16-byte aligned")
    args[17:21] = ws
    torch.ops.kernel_fun.kda_fwd(*args)  # the right ones are taken


@pytest.mark.parametrize("arg", list(BAD_ARGS))
def test_bad_inputs_name_the_argument(arg):
    inputs, kw = make_case(T=70, H=1, K=64, V=64)
    q = inputs[0]
    o = torch.empty(1, 70, 1, 64, dtype=q.dtype, device="cuda")
    ht = torch.empty(1, 1, 64, 64, device="cuda")
    args = _raw_fwd_args(inputs, kw, o, ht)
    idx, bad, msg = BAD_ARGS[arg]
    args[idx] = bad(args[idx])
    with pytest.raises((ValueError, RuntimeError)) as ei:
        torch.ops.kernel_fun.kda_fwd(*args)
    assert msg in str(ei.value), str(ei.value)


def test_raw_op_rejects_short_varlen_states():
    """h_states with cu_seqlens must have room for every chunk the grid can address (T // 64 + N)."""
    inputs, kw = make_case(T=200, cu=[0, 100, 200])
    q = inputs[0]
    o = torch.empty(1, 200, 2, 128, dtype=q.dtype, device="cuda")
    args = _raw_fwd_args(inputs, kw, o, None)
    args[12] = torch.empty(1, 4, 2, 128, 128, dtype=q.dtype, device="cuda")  # 4 < 200 // 64 + 2
    with pytest.raises((ValueError, RuntimeError), match="h_states must hold 5 or more"):
        torch.ops.kernel_fun.kda_fwd(*args)


# ------------------------------------------------------------------------------------------------
# version 0 of the fused forward (csrc/kda/fwd/kda_fwd_fused.cuh): KERNEL_FUN_KDA_FWD_FUSED=1 opts in
# where no factors are saved (inference) and V is a multiple of 128; bit for bit the two kernels
FUSED_CASES = {
    "K128-V128-h0": dict(B=2, T=300, V=128, h0=True),
    "K64-V256-fp16": dict(T=200, K=64, V=256, dtype=torch.float16),
    "gva-varlen": dict(T=700, H=1, HV=2, V=128, cu=[0, 0, 1, 65, 300, 700], h0=True),
    "state-v-first": dict(T=190, V=128, h0=True, state_v_first=True),
    "bounded16": dict(T=260, V=128, gate="bounded16", h0=True),       # the widest midpoint factors
    "extreme-1000": dict(T=260, V=128, gate="precomputed", extreme=0.5, h0=True),
    "weak-decay": dict(T=260, V=128, gate="precomputed_weak", h0=True),
}


@pytest.mark.parametrize("name", list(FUSED_CASES))
def test_fused_forward_opt_in_is_bitwise_the_two_kernels(monkeypatch, name):
    from kernel_fun.kda import chunk_kda

    inputs, kw = make_case(**FUSED_CASES[name])
    call = {n: x for n, x in kw.items() if x is not None}
    monkeypatch.setenv("KERNEL_FUN_KDA_FWD_CHUNK", "64")  # the two kernels at 64 tokens, not the policy's 32
    with torch.no_grad(), our_launches(kda_fwd=1):
        o2, ht2 = chunk_kda(*inputs, **call)
    monkeypatch.setenv("KERNEL_FUN_KDA_FWD_FUSED", "1")
    with torch.no_grad(), our_launches(kda_fwd=1):
        o1, ht1 = chunk_kda(*inputs, **call)
    assert torch.equal(o1, o2), "o: fused != two kernels"
    assert torch.equal(ht1, ht2), "final state: fused != two kernels"
    # the fused kernel ran, not the two kernels (the CUDA kernels the profiler saw)
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        chunk_kda(*inputs, **call)
        torch.cuda.synchronize()
    names = " ".join(e.key for e in prof.key_averages())
    assert "kda_fwd_fused_kernel" in names and "kda_fwd_intra_kernel" not in names, names
    o_ref, ht_ref = reference(inputs, kw)
    assert rel_rms(o_ref, o1) <= KDA_TOL["o"]


def test_intra_phase_clocks_are_ordered_and_change_nothing():
    """forward_stages(profile=True) (scripts/kda_phases.py): every CTA of kda_fwd_intra stamps its
    phase boundaries in order, each warp's end of P2 lies between P2's start and the end of the
    phase after it, empty chunk slots stay 0, and the outputs are bit for bit the unprofiled ones."""
    inputs, kw = make_case(B=1, T=400, H=2, gate="bounded", h0=True, cu=[0, 70, 70, 400])
    o0, ht0, _, ws0 = run_ours(inputs, kw)
    o1, ht1, _, ws1 = run_ours(inputs, kw, profile=True)
    assert torch.equal(o0, o1) and torch.equal(ht0, ht1)
    for n in ("Aqk", "Akk", "M", "w", "qg", "kg"):  # token rows, all written (gdecay has empty slots)
        assert torch.equal(ws0[n], ws1[n]), n
    clk = ws1["clock"]
    assert clk.shape == (2 * (400 // 64 + 3), 16)  # HV x the chunk slots the grid addresses
    ran = clk[:, 0] != 0
    assert int(ran.sum()) == 2 * 8  # HV x the chunks of the three documents: 2 (70) + 0 + 6 (330)
    c = clk[ran]
    assert (c[:, 1:7] >= c[:, 0:6]).all(), "phase stamps out of order"
    warp_p2 = c[:, 8:16]
    # Stamps of different warps compare only to ~2k cycles: on the H200 a warp's P2 end read up to
    # 1.8k cycles later than thread 0's stamp behind the barrier that follows it. So the bound is the
    # barrier after that one (P3's diagonal phase, ~4k cycles later).
    assert ((warp_p2 >= c[:, 2:3]) & (warp_p2 <= c[:, 4:5])).all(), "a warp's P2 end outside P2"
    assert (clk[~ran] == 0).all()


# ------------------------------------------------------------------------------------------------
# the streamed forward (kda_policy.h's fwd_stream_choice): the scan resident first, kda_fwd_intra
# beside it, chunk flags in between; fixed length only
STREAMED_CASES = {
    "B2-K128-V128-h0": dict(B=2, T=300, V=128, h0=True),
    "K64-V256-fp16": dict(T=200, K=64, V=256, dtype=torch.float16),
    "state-v-first": dict(T=190, V=128, h0=True, state_v_first=True),
    "gva-bounded16": dict(T=260, H=1, HV=2, V=128, gate="bounded16", h0=True),
    # 256 chunks x 4 heads against 8 scan CTAs: the chains really wait on the intra here
    "B1-T16384-H4": dict(T=16384, H=4, V=128, h0=True),
}


def _stages(inputs, kw, monkeypatch, streamed):
    # the streamed forward itself, not the split scans the model would take for some of these shapes
    monkeypatch.setenv("KERNEL_FUN_KDA_SPLIT", "0")
    monkeypatch.setenv("KERNEL_FUN_KDA_FWD_STREAMED", "1" if streamed else "0")
    return run_ours(inputs, kw, return_intermediate_states=True)


@pytest.mark.parametrize("name", list(STREAMED_CASES))
def test_streamed_forward_is_bitwise_the_two_kernels(monkeypatch, name):
    """KERNEL_FUN_KDA_FWD_STREAMED=1 (wherever safe): o, the final state, the per-chunk states and
    the saved factors bit for bit as the two kernels one after the other, over 5 calls (a flag read
    before its chunk's rows landed would show as a difference in some call); the flags prove the
    streamed path ran: every (chunk, head) published once, the done counter = the intra's CTAs. A
    chain may stop and be resumed in a call where another process held the GPU past its 2 ms wait
    (pytest-xdist's workers: 2026-12-05, every chain of one call stopped at chunk 0), but in at least
    one of the 5 calls none stops: the two kernels really overlapped."""
    inputs, kw = make_case(**STREAMED_CASES[name])
    o2, ht2, hs2, ws2 = _stages(inputs, kw, monkeypatch, False)
    overlapped = []
    for _ in range(5):
        o1, ht1, hs1, ws1 = _stages(inputs, kw, monkeypatch, True)
        B, T = inputs[0].shape[:2]
        HV, V = inputs[2].shape[2], inputs[2].shape[3]
        overlapped.append(check_stream_flags(ws1["chunk_ready"], B, T, HV, V, resume="any"))
        assert torch.equal(o1, o2), "o: streamed != two kernels"
        assert torch.equal(ht1, ht2), "final state: streamed != two kernels"
        assert torch.equal(hs1, hs2), "per-chunk states: streamed != two kernels"
        for key in ("Aqk", "Akk", "M", "w", "qg", "kg", "gdecay"):
            assert torch.equal(ws1[key], ws2[key]), key
    assert any(overlapped), "every call's chains stopped: pass 1 never saw the intra's flags in time"
    o_ref, ht_ref = reference(inputs, kw)
    assert rel_rms(o_ref, o1) <= KDA_TOL["o"]


def test_streamed_forward_is_the_default_where_the_model_says_and_serves_training(monkeypatch):
    """KERNEL_FUN_KDA_FWD_STREAMED unset: the model decides (kda_policy.h's fwd_stream_choice), so
    B1 T8192 H16 K=V=128 (bench's bounded_b1: 32 chains on 132 SMs) streams on an H100 / H200 and
    B4 T4096 H16 (bench's small: 64 chains) does not; 0 never streams (the int32 workspace,
    poisoned with -1, stays untouched). A training call through chunk_kda with the streamed forward
    gives the same output and gradients as without."""
    monkeypatch.delenv("KERNEL_FUN_KDA_FWD_STREAMED", raising=False)
    inputs, kw = make_case(T=8192, H=16, V=128, gate="bounded16")
    if torch.cuda.get_device_properties(0).multi_processor_count >= 100:  # the model's H100 / H200 example
        check_stream_flags(run_ours(inputs, kw)[3]["chunk_ready"], 1, 8192, 16, 128, resume="any")
        small, small_kw = make_case(B=4, T=4096, H=16, V=128)
        ready = run_ours(small, small_kw, poison=True)[3]["chunk_ready"]
        assert bool((ready == -1).all()), "the model streamed 64 chains"
    monkeypatch.setenv("KERNEL_FUN_KDA_FWD_STREAMED", "0")
    ready = run_ours(inputs, kw, poison=True)[3]["chunk_ready"]
    assert bool((ready == -1).all()), "streamed with KERNEL_FUN_KDA_FWD_STREAMED=0"

    from kernel_fun.kda import chunk_kda

    def grads(streamed):
        monkeypatch.setenv("KERNEL_FUN_KDA_FWD_STREAMED", "1" if streamed else "0")
        leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        call = {n: x for n, x in kw.items() if x is not None}
        with our_launches(kda_fwd=1, kda_bwd=1):
            o, ht = chunk_kda(*leaves, **call)
            (o.float().square().sum() + ht.square().sum()).backward()
        return [o.detach()] + [x.grad for x in leaves]

    for a, b in zip(grads(True), grads(False)):
        assert torch.equal(a, b)


def test_streamed_forward_under_cuda_graph_replay(monkeypatch):
    """The streamed forward's memset, scan and programmatically launched intra, captured in a CUDA
    graph and replayed on new inputs: the same results as eager calls (the flags are zeroed inside
    the graph every replay)."""
    monkeypatch.setenv("KERNEL_FUN_KDA_SPLIT", "0")  # (the model would split this shape)
    monkeypatch.setenv("KERNEL_FUN_KDA_FWD_STREAMED", "1")
    inputs, kw = make_case(T=4096, H=4, V=128, h0=True)
    static = [x.clone() for x in inputs]
    args = dict(kw)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run_ours(static, args)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_ours(static, args)
    for seed in (1, 2):
        new, _ = make_case(T=4096, H=4, V=128, h0=True, seed=seed)
        for dst, src in zip(static, new):
            dst.copy_(src)
        graph.replay()
        want = run_ours(new, kw)
        torch.cuda.synchronize()
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
        check_stream_flags(out[3]["chunk_ready"], 1, 4096, 4, 128, resume="any")


def test_streamed_forward_under_torch_profiler(monkeypatch):
    """Under torch.profiler the scan's pass 1 and the intra may not run at once: a chain that waits
    2 ms for its next chunk stops and pass 2 finishes it after the intra. The result is the same
    bits, and the call returns (it hung before the resume pass existed)."""
    from torch.profiler import ProfilerActivity, profile

    inputs, kw = make_case(T=4096, H=4, V=128, h0=True)
    o2, ht2, _, _ = _stages(inputs, kw, monkeypatch, False)
    with profile(activities=[ProfilerActivity.CUDA]):
        o1, ht1, _, _ = _stages(inputs, kw, monkeypatch, True)
        torch.cuda.synchronize()
    assert torch.equal(o1, o2) and torch.equal(ht1, ht2)


_SERIALISED = r"""
import os, sys, torch
sys.path.insert(0, os.path.join(os.environ["KF_ROOT"], "tests"))
import test_kda_fwd_gpu as t
inputs, kw = t.make_case(T=2048, H=4, V=128, h0=True)
os.environ["KERNEL_FUN_KDA_FWD_STREAMED"] = "0"
o2, ht2, _, _ = t.run_ours(inputs, kw)
os.environ["KERNEL_FUN_KDA_FWD_STREAMED"] = "1"
o1, ht1, _, ws = t.run_ours(inputs, kw)
assert torch.equal(o1, o2) and torch.equal(ht1, ht2), "streamed != two kernels"
from helpers import check_stream_flags
check_stream_flags(ws["chunk_ready"], 1, 2048, 4, 128, resume=0)  # every chain stopped at chunk 0
print("serialised: same bits, every chain resumed from chunk 0")
"""


def test_streamed_forward_with_launches_serialised(tmp_path):
    """CUDA_LAUNCH_BLOCKING=1 (a subprocess): the scan's pass 1 runs alone, so every chain stops at
    chunk 0 after its 2 ms wait, and pass 2 (after the intra) computes it all: the same bits as the
    two kernels, the resume chunks all 0, and no hang (bounded by the subprocess timeout)."""
    run_serialised(_SERIALISED, tmp_path, "serialised: same bits, every chain resumed from chunk 0")


# ------------------------------------------------------------------------------------------------
# The split forward (csrc/kda/fwd/kda_fwd_split.cuh; by default where the launch model says, forced
# here): each sequence's scan in pieces of L chunks, pass 1 ([E | Phi] from zero / the identity), the
# chain of the pieces' initial states, pass 2 (the ordinary scan over the pieces). Weak decays, so a
# piece's state reaches far into the next and a wrong map or chain shows (with strong gates the state
# entering a piece has decayed to nothing within it).
SPLIT_CASES = {
    "T4000-h0-L4-bv64": dict(T=4000, gate="precomputed_weak", h0=True, L=4, bv=64),
    "T4000-h0-L4-bv128": dict(T=4000, gate="precomputed_weak", h0=True, L=4, bv=128),
    "varlen-empty-onetoken-L2": dict(T=2000, cu=[0, 0, 1, 65, 700, 2000], gate="precomputed_weak", h0=True, L=2,
                                     bv=64),
    "gva-vfirst-fp16-L3": dict(T=1500, H=1, HV=2, dtype=torch.float16, gate="bounded_weak", state_v_first=True,
                               h0=True, L=3, bv=64),
    "K64-V64-L1-no-ht": dict(T=1000, K=64, V=64, gate="precomputed_weak", final=False, L=1, bv=64),
    "extreme-1000-L2": dict(T=1000, gate="precomputed", extreme=0.5, h0=True, L=2, bv=64),
    "B2-T16384-H4-model-L": dict(B=2, T=16384, H=4, gate="bounded_weak", h0=True, L=0, bv=0),
    # the chain kernel's wider column blocks (split_chain_cols on 132 SMs; the cases above take 8):
    # 12 heads -> 16 columns (96 CTAs), 20 heads -> 32 columns (80 CTAs)
    "H12-chain16-L2": dict(T=1000, H=12, gate="precomputed_weak", h0=True, L=2, bv=64),
    "H20-chain32-vfirst-L2": dict(T=1000, H=20, gate="precomputed_weak", h0=True, state_v_first=True, L=2, bv=64),
}


def _split(monkeypatch, L, bv, on=True):
    monkeypatch.setenv("KERNEL_FUN_KDA_SPLIT", "1" if on else "0")
    if L:
        monkeypatch.setenv("KERNEL_FUN_KDA_SPLIT_CHUNKS", str(L))
    else:
        monkeypatch.delenv("KERNEL_FUN_KDA_SPLIT_CHUNKS", raising=False)
    if bv:
        monkeypatch.setenv("KERNEL_FUN_KDA_SCAN_BV", str(bv))
    else:
        monkeypatch.delenv("KERNEL_FUN_KDA_SCAN_BV", raising=False)


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_split_forward_matches_fp64_reference_and_unsplit(monkeypatch, name):
    """o, the final state and the per-chunk states against the fp64 reference and against the
    unsplit forward (to the operands' precision: Phi's product and the chain round differently from
    one long chain), bitwise the same over two calls; the pieces' map proves the split ran."""
    case = dict(SPLIT_CASES[name])
    L, bv = case.pop("L"), case.pop("bv")
    inputs, kw = make_case(**case)
    _split(monkeypatch, L, bv)
    o, ht, hs, ws = run_ours(inputs, kw, return_intermediate_states=True)
    o_b, ht_b, hs_b, ws_b = run_ours(inputs, kw, return_intermediate_states=True)
    assert ws["split_map"].numel() > 0 and ws["split_state"].numel() > 0, "the forward did not split"
    assert torch.equal(o, o_b) and torch.equal(hs, hs_b)
    if ht is not None:
        assert torch.equal(ht, ht_b)
    o_ref, ht_ref, st = reference(inputs, kw, return_stages=True)
    assert rel_rms(o_ref, o) <= KDA_TOL["o"]
    assert rel_rms(st["h"], hs.transpose(-1, -2) if kw.get("state_v_first") else hs) <= STAGE_TOL
    if ht is not None:
        assert rel_rms(ht_ref, ht) <= KDA_TOL["ht"]
    _split(monkeypatch, L, bv, on=False)
    o1, ht1, hs1, ws1 = run_ours(inputs, kw, return_intermediate_states=True)
    assert ws1["split_map"].numel() == 0, "split with KERNEL_FUN_KDA_SPLIT=0"
    assert rel_rms(o1.double(), o) < 5e-3 and rel_rms(hs1.double(), hs) < 5e-3
    if ht is not None:
        assert rel_rms(ht1, ht) < 5e-3


def test_split_is_the_models_choice_by_default_and_serves_training(monkeypatch):
    """KERNEL_FUN_KDA_SPLIT unset: the launch model decides (kda_policy.h's fwd_split_choice): B1
    T8192 with 16 heads (bounded_b1's shape, 32 chains: measured slower split) is not split, with 4
    heads (8 chains) it is. A split training call through chunk_kda runs our kernels once each way
    and its output and gradients match the unsplit call's to the operands' precision."""
    monkeypatch.delenv("KERNEL_FUN_KDA_SPLIT", raising=False)
    monkeypatch.delenv("KERNEL_FUN_KDA_SPLIT_CHUNKS", raising=False)
    wide, wide_kw = make_case(T=8192, H=16, gate="bounded_weak", h0=True)
    assert run_ours(wide, wide_kw)[3]["split_map"].numel() == 0
    inputs, kw = make_case(T=8192, H=4, gate="bounded_weak", h0=True)
    assert run_ours(inputs, kw)[3]["split_map"].numel() > 0

    from kernel_fun.kda import chunk_kda

    def grads(split):
        _split(monkeypatch, 16, 0, on=split)
        leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        h0 = kw["initial_state"].detach().clone().requires_grad_(True)
        call = {n: x for n, x in kw.items() if x is not None and n != "initial_state"}
        with our_launches(kda_fwd=1, kda_bwd=1):
            o, ht = chunk_kda(*leaves, initial_state=h0, **call)
            (o.float().square().sum() + ht.square().sum()).backward()
        return [o.detach(), ht.detach()] + [x.grad for x in leaves if x.grad is not None] + [h0.grad]

    split, whole = grads(True), grads(False)
    assert len(split) == len(whole) == 8  # o, ht, dq, dk, dv, dg, dbeta, dh0
    for i, (a, b) in enumerate(zip(split, whole)):
        assert rel_rms(b.double(), a) < (5e-3 if i < 2 else STAGE_TOL), i


def test_varlen_split_is_the_models_choice_from_the_longest_document(monkeypatch):
    """A varlen call's longest document (read from the host copy of cu_seqlens into the options'
    max_seq_len) lets the launch model split few long documents: 12288 + 4096 tokens at 4 heads split
    (counted as kda_fwd_split) in a training call through chunk_kda, whose output and gradients match
    the KERNEL_FUN_KDA_SPLIT=0 call's and whose o and final state match the fp64 reference; with
    use_graph (cu_seqlens never read on the host) it does not split."""
    from kernel_fun.kda import chunk_kda

    monkeypatch.delenv("KERNEL_FUN_KDA_SPLIT_CHUNKS", raising=False)
    inputs, kw = make_case(T=16384, H=4, cu=[0, 12288, 16384], gate="bounded_weak", h0=True)

    def run(split: str, **extra):
        monkeypatch.setenv("KERNEL_FUN_KDA_SPLIT", split)
        leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        h0 = kw["initial_state"].detach().clone().requires_grad_(True)
        call = {n: x for n, x in kw.items() if x is not None and n != "initial_state"}
        with our_launches(kda_fwd=1, kda_bwd=1) as counts:
            o, ht = chunk_kda(*leaves, initial_state=h0, **call, **extra)
            (o.float().square().sum() + ht.square().sum()).backward()
        return counts["kda_fwd_split"], [o.detach(), ht.detach()] + [x.grad for x in leaves if x.grad is not None] + [
            h0.grad]

    n_split, split = run("2")
    n_whole, whole = run("0")
    assert (n_split, n_whole) == (1, 0)
    for i, (a, b) in enumerate(zip(split, whole)):
        assert rel_rms(b.double(), a) < (5e-3 if i < 2 else STAGE_TOL), i
    o_ref, ht_ref = reference(inputs, kw)  # and both against the fp64 reference, not only each other
    assert rel_rms(o_ref, split[0]) <= KDA_TOL["o"] and rel_rms(ht_ref, split[1]) <= KDA_TOL["ht"]
    assert run("2", use_graph=True, max_num_seqs=2)[0] == 0


# ------------------------------------------------------------------------------------------------
# the experimental 32-token forward (csrc/kda/fwd/kda_fwd_intra_c32.cuh), opt-in
C32_CASES = {
    "T1000": dict(B=2, T=1000, h0=True),
    "T8192": dict(B=1, T=8192, H=1),
    "K128-V256": dict(T=300, V=256, h0=True),
    "GVA-2-4": dict(T=333, H=2, HV=4, h0=True),
    "bounded": dict(T=500, gate="bounded", h0=True),
    "bounded-noalog": dict(T=500, gate="bounded_noalog"),
    "extreme-1000": dict(T=700, gate="precomputed", extreme=0.5, h0=True),
    "bounded-weak": dict(T=300, gate="bounded_weak", h0=True),
    "large-qk": dict(T=300, qk_scale=1e5, h0=True),
    "varlen-onetoken": dict(T=200, cu=[0, 1, 64, 65, 200], h0=True),
    "varlen-empty-int64": dict(T=300, cu=[0, 0, 100, 100, 300], cu_dtype=torch.int64, h0=True),
    "varlen-fla-bounded": dict(T=2000, H=2, HV=4, cu=[0, 15, 100, 300, 1200, 2000], gate="bounded", h0=True),
    "fp16": dict(T=500, dtype=torch.float16, h0=True),
    "fp16-bounded-varlen": dict(T=700, cu=[0, 33, 400, 700], gate="bounded", dtype=torch.float16, h0=True),
}


def test_short_chunk_policy_through_chunk_kda(monkeypatch):
    """Without KERNEL_FUN_KDA_FWD_CHUNK, a forward without autograd that would run the 64-token
    forward's two kernels one after the other runs the 32-token chunks instead (kda_policy.h's
    fwd_short_chunks_pay; counted as kda_fwd_c32) and matches the fp64 reference, in bf16 and in fp16;
    a streamed or a split call keeps 64-token chunks, and so does KERNEL_FUN_KDA_FWD_CHUNK=64."""
    from kernel_fun.check import count_kernel_ops
    from kernel_fun.kda import chunk_kda

    def c32_runs(**env):
        for name in ("KERNEL_FUN_KDA_FWD_CHUNK", "KERNEL_FUN_KDA_FWD_STREAMED", "KERNEL_FUN_KDA_SPLIT"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(f"KERNEL_FUN_KDA_{name}", value)
        with torch.no_grad(), count_kernel_ops() as ran:
            o, ht = chunk_kda(*inputs, **call)
        assert rel_rms(o_ref, o) <= KDA_TOL["o"] and rel_rms(ht_ref, ht) <= KDA_TOL["ht"], env
        assert ran["kda_fwd"] == 1, dict(ran)
        return ran["kda_fwd_c32"]

    for dtype in (torch.bfloat16, torch.float16):
        inputs, kw = make_case(B=2, T=256, H=4, gate="bounded", h0=True, dtype=dtype)
        call = {n: x for n, x in kw.items() if x is not None}
        o_ref, ht_ref = reference(inputs, kw)
        assert c32_runs(FWD_STREAMED="0", SPLIT="0") == 1, dtype
    assert c32_runs(FWD_STREAMED="0", SPLIT="0", FWD_CHUNK="64") == 0
    assert c32_runs(FWD_STREAMED="1", SPLIT="0") == 0  # 8 chains: streamed wherever forced to
    assert c32_runs(FWD_STREAMED="0", SPLIT="1") == 0  # 4 chunks: split wherever forced to


def test_streamed_32_token_forward_through_chunk_kda(monkeypatch):
    """KERNEL_FUN_KDA_FWD_CHUNK=32 where the forward streams (KERNEL_FUN_KDA_FWD_STREAMED=1): the
    32-token scan's pass 1 with the 32-token intra beside it, publishing 32-token chunks (counted as
    kda_fwd_c32 and kda_fwd_streamed), over 5 calls bit for bit the 32-token two kernels at the same
    slice width (a flag read before its chunk's rows landed would show in some call), and against the
    fp64 reference. B1 T16384 H4: 512 chunks x 4 heads against 4 scan CTAs, so the chains wait on the
    intra."""
    from kernel_fun.check import count_kernel_ops
    from kernel_fun.kda import chunk_kda

    for name, value in (("FWD_CHUNK", "32"), ("SPLIT", "0"), ("SCAN_BV", "128")):
        monkeypatch.setenv(f"KERNEL_FUN_KDA_{name}", value)
    inputs, kw = make_case(T=16384, H=4, V=128, gate="bounded", h0=True)
    call = {n: x for n, x in kw.items() if x is not None}

    def run(streamed):
        monkeypatch.setenv("KERNEL_FUN_KDA_FWD_STREAMED", "1" if streamed else "0")
        with torch.no_grad(), count_kernel_ops() as ran:
            o, ht = chunk_kda(*inputs, **call)
        return o, ht, {k: ran[k] for k in ("kda_fwd", "kda_fwd_c32", "kda_fwd_streamed")}

    o2, ht2, ran = run(False)
    assert ran == {"kda_fwd": 1, "kda_fwd_c32": 1, "kda_fwd_streamed": 0}
    for _ in range(5):
        o1, ht1, ran = run(True)
        assert ran == {"kda_fwd": 1, "kda_fwd_c32": 1, "kda_fwd_streamed": 1}
        assert torch.equal(o1, o2), "o: streamed != two kernels (32-token chunks)"
        assert torch.equal(ht1, ht2), "final state: streamed != two kernels (32-token chunks)"
    o_ref, ht_ref = reference(inputs, kw)
    assert rel_rms(o_ref, o1) <= KDA_TOL["o"] and rel_rms(ht_ref, ht1) <= KDA_TOL["ht"]


@pytest.mark.parametrize("name", list(C32_CASES))
def test_forward_on_32_token_chunks_through_chunk_kda(name, monkeypatch):
    """KERNEL_FUN_KDA_FWD_CHUNK=32: chunk_kda without autograd runs the 32-token forward (counted as
    kda_fwd_c32, on top of kda_fwd) and matches the fp64 reference; with autograd (the forward keeps
    its factors for a backward at 64 tokens) it does not run. The split scans are off: a split call
    keeps 64-token chunks (B1 T8192 H1 splits by default: the H100, 2026-12-05)."""
    from kernel_fun import _ext
    from kernel_fun.kda import chunk_kda

    monkeypatch.setenv("KERNEL_FUN_KDA_FWD_CHUNK", "32")
    monkeypatch.setenv("KERNEL_FUN_KDA_SPLIT", "0")
    inputs, kw = make_case(**C32_CASES[name])
    call = {n: x for n, x in kw.items() if x is not None}
    before = _ext.op_calls()
    with torch.no_grad():
        o, ht = chunk_kda(*inputs, **call)
    after = _ext.op_calls()
    assert after["kda_fwd_c32"] - before.get("kda_fwd_c32", 0) == 1
    o_ref, ht_ref = reference(inputs, kw)
    assert torch.isfinite(o).all() and rel_rms(o_ref, o) <= KDA_TOL["o"], f"o rel-RMS {rel_rms(o_ref, o):.3e}"
    if kw.get("output_final_state"):
        assert rel_rms(ht_ref, ht) <= KDA_TOL["ht"], f"ht rel-RMS {rel_rms(ht_ref, ht):.3e}"
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    chunk_kda(*leaves, **call)
    assert _ext.op_calls()["kda_fwd_c32"] == after["kda_fwd_c32"]
