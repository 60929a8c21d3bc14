"""The KDA forward kernels (csrc/kda), UNMODIFIED, on the host emulator (tests/emu/): o, the
final state, the per-chunk states and the workspace (w, qg, kg, Aqk, Akk, exp2(G)) against the fp64
chunked reference, plus checks of the emulator itself (mma.sync / ldmatrix fragment layouts against
a matmul, cp.async and wgmma deferral, and the bugs it must report). No GPU needed: g++ and the CUDA headers.

These kernels pass the same comparisons on the H200, so a mismatch here is an emulator bug, a test
layout bug, or a kernel change that broke them.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import numpy as np

import pytest
import torch

from helpers import as_stored_fp32, check_stream_flags, chunk_map_want, emu_module, emu_skip_reason, kda_reference, load_module, rel_rms

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TOL = 1e-2  # rel-RMS; the workspace and o are stored in bf16 / fp16 (their rounding alone is ~3e-3)


_why = emu_skip_reason()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"kf_emu cannot be built: {_why}")


@pytest.fixture(scope="module")
def emu():
    return emu_module()


@pytest.fixture(scope="module")
def ref():
    # this tree's reference (not whatever kernel_fun an environment has installed)
    return load_module("kf_emu_ref_kda", ROOT / "src" / "kernel_fun" / "ref" / "kda.py")


# ------------------------------------------------------------------------------------------------ cases
def make_case(B=1, T=100, H=2, HV=None, K=64, V=64, dtype=torch.bfloat16, gate="unbounded", g_dtype=None,
              l2norm=True, beta_sigmoid=True, neg_eig=False, h0=False, state_v_first=False, cu=None,
              cu_dtype=torch.int32, scale=None, extreme=0.0, seed=0, qk_scale=1.0, beta_shift=0.0):
    """qk_scale multiplies the raw q and k: 1e-4 puts sum q^2 at K * 1e-8, where the l2norm's
    epsilon (x / sqrt(sum x^2 + 1e-6)) sets the result, so a kernel with another epsilon fails."""
    HV = HV or H
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    if not l2norm:  # the delta rule needs unit keys
        q = torch.nn.functional.normalize(q, dim=-1)
        k = torch.nn.functional.normalize(k, dim=-1)
    q, k = qk_scale * q, qk_scale * k
    v = torch.randn(B, T, HV, V, generator=gen)
    beta_raw = torch.randn(B, T, HV, generator=gen) + beta_shift  # shift 14: sigmoid(beta) near 1
    kw = dict(use_qk_l2norm_in_kernel=l2norm, use_beta_sigmoid_in_kernel=beta_sigmoid, allow_neg_eigval=neg_eig,
              state_v_first=state_v_first, output_final_state=True, scale=scale)
    beta = beta_raw if beta_sigmoid else torch.sigmoid(beta_raw)
    if gate == "unbounded":
        g = torch.randn(B, T, HV, K, generator=gen)
        kw.update(use_gate_in_kernel=True, A_log=torch.log(torch.empty(HV).uniform_(1, 16, generator=gen)),
                  dt_bias=0.5 * torch.randn(HV * K, generator=gen))
    elif gate == "bounded":
        g = torch.randn(B, T, HV, K, generator=gen)
        kw.update(use_gate_in_kernel=True, A_log=torch.log(torch.empty(HV).uniform_(1, 16, generator=gen)),
                  dt_bias=0.5 * torch.randn(HV * K, generator=gen), lower_bound=-5.0)
    elif gate == "bounded_weak":  # lower_bound -0.05: every step in (-0.05, 0), a chunk decays by > e^-3.2,
        # so the tensor-core paths' far block pairs (bounded: the midpoint I3 and I1) carry weight
        g = torch.randn(B, T, HV, K, generator=gen)
        kw.update(use_gate_in_kernel=True, A_log=torch.log(torch.empty(HV).uniform_(1, 16, generator=gen)),
                  dt_bias=0.5 * torch.randn(HV * K, generator=gen), lower_bound=-0.05)
    elif gate == "bounded16":  # nearly every step at lower_bound = -5: the widest midpoint factors
        g = 3 * torch.randn(B, T, HV, K, generator=gen) + 4
        kw.update(use_gate_in_kernel=True, A_log=torch.full((HV,), math.log(16.0)), dt_bias=None, lower_bound=-5.0)
    elif gate == "bounded_saturated":  # every z = exp(A_log) x in [12, 16]: sigmoid near 1, slope ~1e-6
        g = 0.75 + 0.25 * torch.rand(B, T, HV, K, generator=gen)
        kw.update(use_gate_in_kernel=True, A_log=torch.full((HV,), math.log(16.0)), dt_bias=None, lower_bound=-5.0)
    elif gate == "bounded_noalog":
        g = torch.randn(B, T, HV, K, generator=gen)
        kw.update(use_gate_in_kernel=True, A_log=None, lower_bound=-3.0)
    elif gate == "precomputed":
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, K, generator=gen) + 2)
        kw.update(use_gate_in_kernel=False)
    elif gate == "precomputed_weak":  # ~ -0.003 per step: a chunk decays by ~0.8, so the products of
        # rows 48..63 with columns 0..15 weigh as much as the diagonal ones (with the gates above they
        # are ~1e-15 of them, and an error there shows nowhere)
        g = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, K, generator=gen) + 6)
        kw.update(use_gate_in_kernel=False)
    else:
        raise ValueError(gate)
    if extreme:  # a fraction of the per-step gates at -1000 (fla's varlen tests)
        mask = torch.rand(g.shape, generator=gen) < extreme
        g = torch.where(mask, torch.full_like(g, -1000.0), g)
    N = B
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu, dtype=cu_dtype)
        N = len(cu) - 1
    if h0:
        shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        kw["initial_state"] = 0.1 * torch.randn(shape, generator=gen)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    return (q, k, v, g.to(g_dtype or torch.float32), beta.to(dtype)), kw


CASES = {
    "T1-B2": dict(B=2, T=1),
    "T63-B2-K128-h0": dict(B=2, T=63, K=128, h0=True),
    "T64-fp16-V128": dict(T=64, dtype=torch.float16, V=128),
    "T130-K128-V128-h0": dict(T=130, K=128, V=128, h0=True),
    "T130-V128-bv64": dict(T=130, V=128, h0=True, bv=64),
    "GVA-1-2": dict(T=130, H=1, HV=2, h0=True),
    "GVA-1-2-K128-fp16": dict(T=70, H=1, HV=2, K=128, dtype=torch.float16),
    "bounded-fp16-K128": dict(T=100, K=128, gate="bounded", dtype=torch.float16, h0=True),
    "bounded-noalog": dict(T=70, gate="bounded_noalog"),
    "precomputed-nol2-nosigmoid": dict(T=130, gate="precomputed", l2norm=False, beta_sigmoid=False),
    "neg-eigval-scale": dict(T=90, neg_eig=True, scale=0.3, h0=True),
    "state-v-first": dict(T=100, K=128, h0=True, state_v_first=True),
    "g-bf16": dict(T=80, g_dtype=torch.bfloat16),
    "g-fp16-misaligned": dict(T=80, g_dtype=torch.float16, misalign=True),
    "misaligned-K128": dict(T=66, K=128, misalign=True),
    "extreme-1000": dict(T=130, gate="precomputed", extreme=0.5, h0=True),
    "weak-decay-K128": dict(T=128, K=128, gate="precomputed_weak", h0=True),  # every block pair counts
    "bounded-weak": dict(T=128, gate="bounded_weak", h0=True),
    # nearly every step at lower_bound: the bounded gate's strongest decays (the backward's midpoint
    # factors reach ~2^+-50 there); unit q, k without the kernel's l2norm; partial chunks
    "bounded16-nol2-K128-varlen": dict(T=130, K=128, gate="bounded16", l2norm=False, cu=[0, 1, 70, 130], h0=True),
    "l2norm-eps-tiny-qk": dict(T=100, qk_scale=1e-4, h0=True),  # the kernels' l2norm epsilon (gate.cuh)
    # raw bf16 entries ~1e5, beyond fp16's range: the intra's fp16 P2 operands overflow unless the raw
    # rows are rescaled (dev::row_rstd_fp16_operands)
    "large-qk-bf16-K128": dict(T=130, K=128, qk_scale=1e5, h0=True),
    # the bounded gate's midpoint P2 (dev::block_midpoint_ok): its widest factors (~2^+-57.7) on raw
    # rows at the ends of their range, large bf16 (rescaled into [2^-6, 2^14)) and small fp16
    "bounded16-large-qk-K128": dict(T=130, K=128, gate="bounded16", qk_scale=1e5, h0=True),
    "bounded16-small-qk-fp16-K128": dict(T=100, K=128, gate="bounded16", qk_scale=1e-3, dtype=torch.float16),
    "varlen-empty-onetoken": dict(T=130, cu=[0, 0, 1, 65, 130], h0=True),
    "varlen-int64-K128-V128-fp16": dict(T=100, K=128, V=128, cu=[0, 63, 63, 100], cu_dtype=torch.int64,
                                        dtype=torch.float16, h0=True),
}


def _last_rows(cu, B, T):
    """Flattened row of the last valid token of every chunk, in global chunk order."""
    segs = [(b * T, b * T + T) for b in range(B)] if cu is None else list(zip(cu[:-1], cu[1:]))
    return [min(c0 + 64, e) - 1 for s, e in segs for c0 in range(s, e, 64)]


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_stages_match_fp64_reference(name, emu, ref):
    case = dict(CASES[name])
    bv, misalign = case.pop("bv", None), case.pop("misalign", False)
    inputs, kw = make_case(**case)
    o, ht, hs, ws = emu.forward_stages(*inputs, **kw, return_intermediate_states=True, bv=bv, misalign=misalign)
    o_ref, ht_ref, st = kda_reference(inputs, kw, return_stages=True, ref=ref)
    B, T = inputs[0].shape[:2]
    K = inputs[0].shape[3]
    scale = kw.get("scale") or K ** -0.5
    flat = lambda x: x.reshape(B * T, *x.shape[2:])  # noqa: E731
    rows = _last_rows(case.get("cu"), B, T)
    checks = {
        "o": (o_ref, o),
        "ht": (ht_ref, ht),
        "h": (st["h"], hs.transpose(-1, -2) if kw.get("state_v_first") else hs),
        "qg": (flat(st["qg"]) * scale, ws["qg"]),
        "kg": (flat(st["kg"]), ws["kg"]),
        "w": (flat(st["w"]), ws["w"]),
        "Aqk": (flat(st["Aqk"]), ws["Aqk"]),
        "Akk": (flat(st["Akk"]), ws["Akk"]),
        "exp2(G)": (as_stored_fp32(torch.exp2(flat(st["g2"])[rows])), ws["gdecay"][: len(rows)]),
    }
    if case.get("cu") is not None:
        assert ws["chunk_offsets"].tolist() == chunk_map_want(case["cu"])
    bad = {}
    for key, (r, got) in checks.items():
        if r.numel() == 0:
            continue
        err = rel_rms(r, got)
        if not err <= TOL:
            bad[key] = err
    assert not bad, f"off the fp64 reference (rel-RMS > {TOL}): {bad}"
    if kw.get("initial_state") is not None and case.get("cu") == [0, 0, 1, 65, 130]:
        # an empty sequence passes its initial state through untouched
        assert torch.equal(ht[0], kw["initial_state"][0])


def test_deterministic(emu):
    inputs, kw = make_case(T=130, H=1, HV=2, cu=[0, 10, 130], h0=True)
    a = emu.forward_stages(*inputs, **kw)
    b = emu.forward_stages(*inputs, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for key in ("w", "qg", "kg", "Aqk", "Akk", "gdecay"):  # bitwise, NaN (never written) included
        assert torch.equal(_bits(a[3][key]), _bits(b[3][key])), key


def _bits(x):
    return x.view({4: torch.int32, 2: torch.int16}[x.element_size()])


@pytest.mark.parametrize("name", ["T130-K128-V128-h0", "varlen-empty-onetoken", "GVA-1-2-K128-fp16"])
def test_results_do_not_depend_on_the_thread_schedule(emu, name):
    # Under warp-greedy schedules a warp runs ahead of the others up to the next barrier, so a
    # missing __syncthreads between one warp's smem writes and another's reads shows up as poison
    # or stale data; correct kernels give bitwise the default schedule's results.
    case = dict(CASES[name])
    bv, misalign = case.pop("bv", None), case.pop("misalign", False)
    inputs, kw = make_case(**case)
    run = lambda: emu.forward_stages(*inputs, **kw, return_intermediate_states=True, bv=bv, misalign=misalign)  # noqa: E731
    base = run()
    try:
        for order, greedy, seed in [("reverse", False, 0), ("forward", True, 0), ("reverse", True, 0),
                                    ("random", True, 1)]:
            emu.set_schedule(order, greedy, seed)
            got = run()
            outs = {"o": (base[0], got[0]), "ht": (base[1], got[1]), "h": (base[2], got[2])}
            outs.update({k: (base[3][k], got[3][k]) for k in base[3]})
            diff = [k for k, (a, b) in outs.items() if not torch.equal(_bits(a), _bits(b))]
            assert not diff, f"schedule {order}{'+greedy' if greedy else ''}: {diff} differ"
    finally:
        emu.set_schedule()


# ------------------------------------------------------------------------------------------------ emulator
def _p(a: np.ndarray):
    return ctypes.c_void_p(a.ctypes.data)


def _tf32_rna(x: np.ndarray) -> np.ndarray:
    """cvt.rna.tf32.f32 in numpy: round half away from zero to 10 mantissa bits."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x1000) & 0xFFFFE000).astype(np.uint32)
    return r.view(np.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulated_mma_ldmatrix_match_matmul(emu, dtype):
    gen = torch.Generator().manual_seed(1)
    A = torch.randn(16, 16, generator=gen).to(dtype)
    B = torch.randn(16, 16, generator=gen).to(dtype)
    C = torch.randn(16, 16, generator=gen).numpy().astype(np.float32)
    a16 = np.ascontiguousarray(A.view(torch.int16).numpy().view(np.uint16))
    b16 = np.ascontiguousarray(B.view(torch.int16).numpy().view(np.uint16))
    D1, D2 = np.zeros((16, 16), np.float32), np.zeros((16, 16), np.float32)
    L = emu.lib()
    rc = L.kf_emu_selftest_mma16816(1 if dtype == torch.float16 else 2, _p(a16), _p(b16), _p(C), _p(D1), _p(D2))
    assert rc == 0, L.kf_emu_selftest_last_error().decode()
    want = A.double().numpy() @ B.double().numpy() + C
    np.testing.assert_allclose(D1, want, rtol=1e-5, atol=1e-5)  # ldmatrix.trans B
    np.testing.assert_allclose(D2, want, rtol=1e-5, atol=1e-5)  # ldmatrix B^T


def test_emulated_tf32_mma_and_cvt(emu):
    rng = np.random.default_rng(2)
    A = rng.standard_normal((16, 8)).astype(np.float32)
    B = rng.standard_normal((8, 8)).astype(np.float32)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    D = np.zeros((16, 8), np.float32)
    L = emu.lib()
    assert L.kf_emu_selftest_mma1688(_p(A), _p(B), _p(C), _p(D)) == 0, L.kf_emu_selftest_last_error().decode()
    want = _tf32_rna(A).astype(np.float64) @ _tf32_rna(B).astype(np.float64) + C
    np.testing.assert_allclose(D, want, rtol=1e-5, atol=1e-5)
    # cvt.rna: ties away from zero, 13 low bits cleared, inf kept, NaN canonical
    x = np.concatenate([rng.standard_normal(1000) * 10.0 ** rng.integers(-30, 30, 1000),
                        [1 + 2 ** -11, -(1 + 2 ** -11), 1 + 2 ** -12, 3.4e38, 0.0, -0.0]]).astype(np.float32)
    out = np.zeros(x.size, np.uint32)
    L.kf_emu_selftest_tf32(_p(x), _p(out), x.size)
    np.testing.assert_array_equal(out, _tf32_rna(x).view(np.uint32))
    assert _tf32_rna(np.array([1 + 2 ** -11], np.float32))[0] == np.float32(1 + 2 ** -10)  # tie -> away
    sp = np.array([np.inf, -np.inf, np.nan], np.float32)
    out = np.zeros(3, np.uint32)
    L.kf_emu_selftest_tf32(_p(sp), _p(out), 3)
    assert out.tolist() == [0x7F800000, 0xFF800000, 0x7FFFFFFF]


def test_cp_async_is_deferred_until_wait_group(emu):
    src = np.arange(128, dtype=np.float32) + 1
    out = np.zeros((5, 32), np.uint32)
    L = emu.lib()
    assert L.kf_emu_selftest_cp_async(_p(src), _p(out)) == 0, L.kf_emu_selftest_last_error().decode()
    poison = 0xFFFFFFFF
    assert (out[0] == poison).all(), "read before wait_group saw the copied data: cp.async is not deferred"
    assert (out[1] == poison).all()
    np.testing.assert_array_equal(out[2].view(np.float32), src[::4])  # wait_group 1: group 0 landed
    assert (out[3] == poison).all(), "wait_group 1 also performed the most recent group"
    assert (out[4] == 0).all(), "src-size 0 must zero-fill"


WGMMA_POISON = 0x7F80DEAD  # kf_emu.h's kWgmmaPoison (a signalling NaN)


def _wgmma_inputs():
    gen = torch.Generator().manual_seed(4)
    A = torch.randn(64, 16, generator=gen).to(torch.bfloat16)
    B = torch.randn(16, 64, generator=gen).to(torch.bfloat16)
    C = torch.randn(64, 64, generator=gen).numpy().astype(np.float32)
    raw = lambda x: np.ascontiguousarray(x.view(torch.int16).numpy().view(np.uint16))  # noqa: E731
    return A, B, C, raw(A), raw(B)


def test_wgmma_lands_only_at_its_wait_group(emu):
    """wgmma.mma_async is asynchronous on the GPU: its accumulator registers are undefined until the
    wgmma.wait_group that completes its commit group. The emulator models that (kf_emu.h): a read
    before the wait sees poison, so a wgmma_wait removed from a scan (csrc/kda/fwd/kda_fwd_scan.cuh,
    bwd/kda_bwd_dh_scan.cuh) fails the KDA emulator tests (tried: each of the five waits removed in
    turn, 8-18 failures each). Here: K-major and MN-major B through 128-byte-swizzle descriptors, C
    accumulated, two products chained into one accumulator, wait_group 1 landing only the older
    of two groups; N = 32 with A from shared memory (wgmma_ss) and an MN-major B descriptor that
    starts inside its 64-column swizzle block (the grads kernel's V phase)."""
    A, B, C, a16, b16 = _wgmma_inputs()
    out = np.zeros((8, 64, 64), np.uint32)
    L = emu.lib()
    assert L.kf_emu_selftest_wgmma(0, _p(a16), _p(b16), _p(C), _p(out)) == 0, L.kf_emu_selftest_last_error().decode()
    AB = A.double().numpy() @ B.double().numpy()
    f32 = lambda i: out[i].view(np.float32)  # noqa: E731
    assert (out[0] == WGMMA_POISON).all(), "the accumulator was readable before its wait_group: wgmma completed at once"
    np.testing.assert_allclose(f32(1), AB + C, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f32(2), 2 * AB, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f32(3), AB, rtol=1e-5, atol=1e-5)
    assert (out[4] == WGMMA_POISON).all(), "wait_group 1 also completed the most recent group"
    np.testing.assert_allclose(f32(5), AB, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f32(6)[:, :32], AB[:, :32], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f32(7)[:, :32], AB[:, 32:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which, message", [
    (1, "exits with 1 wgmma.mma_async in flight"),                 # no wait_group at all
    (2, "written while its wgmma.mma_async was in flight"),        # accumulator touched before the wait
    (3, "without a wgmma.fence"),                                  # issue after a wait, no fence
    (4, "A operand registers"),                                    # A registers changed before the wait
])
def test_emulator_reports_wgmma_misuse(emu, which, message):
    _, _, C, a16, b16 = _wgmma_inputs()
    out = np.zeros((8, 64, 64), np.uint32)
    L = emu.lib()
    assert L.kf_emu_selftest_wgmma(which, _p(a16), _p(b16), _p(C), _p(out)) != 0
    err = L.kf_emu_selftest_last_error().decode()
    assert message in err, err


def test_emulated_shuffles_votes_and_static_smem(emu):
    out = np.zeros(11 * 64 + 3, np.int32)
    L = emu.lib()
    assert L.kf_emu_selftest_warp_ops(_p(out)) == 0, L.kf_emu_selftest_last_error().decode()
    r = out[:11 * 64].reshape(11, 64)
    t = np.arange(64)
    lane, base = t % 32, t - t % 32

    def seg(j, ok):  # PTX shfl: a source outside the lane's segment gives the lane its own value
        return np.where(ok, base + j, t)

    np.testing.assert_array_equal(r[0], 10 * (base + (lane + 3) % 32))
    np.testing.assert_array_equal(r[1], seg(lane - 3, lane % 8 >= 3))
    np.testing.assert_array_equal(r[2], seg(lane + 2, lane % 16 + 2 < 16))
    np.testing.assert_array_equal(r[3], base + (lane ^ 5))
    # xor beyond the segment: a later segment is out of reach (own value), an earlier one is not
    np.testing.assert_array_equal(r[4], seg(lane ^ 4, (lane ^ 4) <= (lane & ~3) + 3))
    np.testing.assert_array_equal(r[5], base + (lane & ~7) + 1)
    ballot = [sum(1 << l for l in range(32) if (w * 32 + l) % 3 == 0) for w in range(2)]
    np.testing.assert_array_equal(r[6].astype(np.uint32), np.repeat(np.array(ballot, np.uint32), 32))
    np.testing.assert_array_equal(r[7], np.repeat([0, 1], 32))
    np.testing.assert_array_equal(r[8], np.repeat([1, 0], 32))
    np.testing.assert_array_equal(r[9], 2 * (base + (lane ^ 1)) + 1)
    np.testing.assert_array_equal(r[10], np.full(64, 64 * 1000 + 100))
    assert out[11 * 64:].tolist() == [40, 40, 40]


@pytest.mark.parametrize("which, message", [(0, "divergent warp collectives"), (1, "deadlock"),
                                            (2, "out of bounds"), (3, "not 16-byte aligned")])
def test_emulator_reports_kernel_bugs(emu, which, message):
    out = np.zeros(64, np.float32)
    L = emu.lib()
    assert L.kf_emu_selftest_bug(which, _p(out)) != 0
    err = L.kf_emu_selftest_last_error().decode()
    assert message in err, err


@pytest.mark.parametrize("name", ["T130-K128-V128-h0", "bounded-fp16-K128", "GVA-1-2", "varlen-empty-one"])
def test_intra_phases_into_a_scan_stage_match_the_workspace_path(emu, name):
    """The fused forward's handoff (kda_fwd_intra.cuh, IntraToStage): the intra phases writing into a
    scan stage give, bit for bit, the stage the scan loads from the two-kernel path's workspace, on
    every part the scan reads (the swizzled w / qg / kg tiles, Aqk and Akk on and below the diagonal
    blocks, exp2(G)), rows past a sequence's end zero in both."""
    case = dict(CASES, **{"varlen-empty-one": dict(T=200, cu=[0, 0, 1, 64, 65, 200], h0=True)})[name]
    inputs, kw = make_case(**case)
    a, b, lay = emu.intra_stage_check(*inputs, **kw)
    elems, oW, oQg, oKg, oAqk, oAkk, oDec, AP = lay
    K = inputs[0].shape[-1]
    cu = kw.get("cu_seqlens")
    T = inputs[0].shape[1]
    lens = [T] * inputs[0].shape[0] if cu is None else (cu[1:] - cu[:-1]).tolist()
    nchunks = sum(-(-n // 64) for n in lens)
    a, b = a[:nchunks], b[:nchunks]  # the varlen grid's idle tail has no stage
    tiles = slice(oW, oW + 3 * 64 * K)
    assert torch.equal(a[..., tiles], b[..., tiles]), "w / qg / kg tiles differ"
    rows = torch.arange(64).view(64, 1)
    cols = torch.arange(64).view(1, 64)
    low = (cols // 16 <= rows // 16).reshape(-1)  # what the scan reads of Aqk / Akk
    for off, what in ((oAqk, "Aqk"), (oAkk, "Akk")):
        x = a[..., off: off + 64 * AP].reshape(*a.shape[:2], 64, AP)[..., :64].reshape(*a.shape[:2], -1)
        y = b[..., off: off + 64 * AP].reshape(*b.shape[:2], 64, AP)[..., :64].reshape(*b.shape[:2], -1)
        assert torch.equal(x[..., low], y[..., low]), f"{what} differs"
    dec = slice(oDec, oDec + 2 * K)  # fp32 [K] as 16-bit pairs
    assert torch.equal(a[..., dec], b[..., dec]), "exp2(G) differs"
    assert (a[..., tiles] != 0).any(), "an all-zero stage compares equal to anything"


@pytest.mark.parametrize("name, bv", [(n, None) for n in CASES] + [("T130-K128-V128-h0", 64),
                                                                     ("T130-K128-V128-h0", 128)])
def test_fused_forward_is_bitwise_the_two_kernel_path(emu, name, bv):
    """kda_fwd_fused (version 0): the intra phases into a scan stage, then the state warps, in one
    CTA per (V-slice, value head, sequence), give o and the final state bit for bit as the two-kernel
    forward (whose scan runs at the same V-slice), without reading the workspace; over every forward
    case here (gate forms, -1000 gates, GVA, varlen with empty and one-token documents, fp16 / bf16,
    state_v_first, negative eigenvalues, the l2norm epsilon) and both slice widths."""
    case = {k: v for k, v in CASES[name].items() if k not in ("bv", "misalign")}
    bv = bv or CASES[name].get("bv")
    inputs, kw = make_case(**case)
    o2, ht2, _, _ = emu.forward_stages(*inputs, **kw, bv=bv)
    o1, ht1, ws1 = emu.forward_fused(*inputs, **kw, bv=bv)
    assert all(t.isnan().all() for t in ws1.values() if t.is_floating_point()), \
        "the fused forward wrote the workspace: the two-kernel path ran"
    assert torch.equal(o1.view(torch.int16), o2.view(torch.int16)), "o differs"
    assert torch.equal(ht1, ht2), "final state differs"
    assert o1.abs().sum() > 0


STREAMED = [(n, -1) for n, c in CASES.items() if "cu" not in c] + [("B3-T200-K128-V256-h0", -1)]
# pass 1 stopped early: at chunk 0 (the launches serialised), mid-sequence, past the last chunk
STREAMED += [(n, stop) for n in ("B3-T200-K128-V256-h0", "T63-B2-K128-h0", "state-v-first", "GVA-1-2")
             for stop in (0, 1, 2, 9)]


@pytest.mark.parametrize("name, stop", STREAMED)
def test_streamed_forward_is_bitwise_the_two_kernel_path(emu, name, stop):
    """The streamed forward (kda_policy.h's fwd_stream_choice: the scan's pass 1 with kda_fwd_intra
    beside it, flags in between, pass 2 resuming what pass 1 stopped): the intra's transposed grid
    computes every (chunk, head) exactly once and publishes it; o, the final state, the per-chunk
    states and the workspace are bit for bit the two-kernel path's, whether pass 1 finds every chunk
    published (stop -1), none (0: as when a tool serialises the launches) or those before chunk
    `stop`; each chain's resume chunk is where pass 1 stopped it."""
    extra = {"B3-T200-K128-V256-h0": dict(B=3, T=200, K=128, V=256, h0=True)}
    conf = extra.get(name) or CASES[name]
    case = {k: v for k, v in conf.items() if k not in ("bv", "misalign")}
    inputs, kw = make_case(**case)
    run = dict(bv=conf.get("bv"), misalign=conf.get("misalign", False), return_intermediate_states=True)
    o2, ht2, hs2, ws2 = emu.forward_stages(*inputs, **kw, **run)
    o1, ht1, hs1, ws1 = emu.forward_stages(*inputs, **kw, **run, streamed=True, stream_stop=stop)
    assert torch.equal(o1.view(torch.int16), o2.view(torch.int16)), "o differs"
    assert torch.equal(ht1, ht2), "final state differs"
    assert torch.equal(hs1.view(torch.int16), hs2.view(torch.int16)), "per-chunk states differ"
    for n in ("w", "qg", "kg", "Aqk", "Akk", "gdecay"):
        assert torch.equal(ws1[n].view(torch.int16) if ws1[n].dtype != torch.float32 else ws1[n],
                           ws2[n].view(torch.int16) if ws2[n].dtype != torch.float32 else ws2[n]), n
    B, T = inputs[0].shape[:2]
    HV, V = inputs[2].shape[2], inputs[2].shape[3]
    check_stream_flags(ws1["chunk_ready"], B, T, HV, V, None if stop < 0 else min(stop, -(-T // 64)))
    assert o1.abs().sum() > 0


@pytest.mark.parametrize("shape, sms, want", [
    # (B, T, H, HV, K, V): the bench cases on the H200's 132 SMs, as docs/kda-forward.md states them
    ((1, 8192, 16, 16, 128, 128), 132, 64),     # bounded_b1: 32 chains, the intra on the other 100 SMs
    ((1, 32768, 32, 32, 128, 128), 132, 128),   # long_b1_t32k: 32 chains of 128 columns
    ((1, 131072, 32, 32, 128, 128), 132, 128),  # long_b1_t128k
    ((4, 4096, 16, 16, 128, 128), 132, 0),      # small: 64 chains would cost the intra too many SMs
    ((16, 8192, 16, 16, 128, 256), 132, 0),     # prod8192: the scan fills the GPU
    ((16, 8192, 16, 16, 128, 128), 132, 0),     # bounded_b16
    ((1, 32768, 32, 32, 128, 128), 40, 0),      # 32 chains need sms - 8 >= 32
    ((1, 64 * 65536, 1, 1, 128, 128), 132, 0),  # 65536 chunk rows: past the transposed grid's y
])
def test_stream_choice_model(emu, shape, sms, want):
    """kda_policy.h's fwd_stream_choice (KERNEL_FUN_KDA_FWD_STREAMED=2): where the overlap is
    possible (every scan CTA resident with 8 SMs to spare, fixed length, <= 65535 chunk rows) and
    the model at least 5% faster, which slice width; the picks the docs quote."""
    bv, cost, now = emu.stream_choice(*shape, sms=sms)
    assert bv == want, (bv, cost, now)
    if want:
        assert cost < 0.95 * now


def test_stream_rows_are_counted_at_the_calls_chunk_size(emu):
    """fwd_stream_possible bounds the streamed intra's grid rows (<= 65535) at the call's chunk size
    (kda_problem.h's stream_chunks): B1 T2560000 H32 has 40000 rows of 64-token chunks, where the
    model streams, and 80000 of 32-token chunks, where it cannot, so a forced 32-token call there runs
    its two kernels one after the other (the flags and scan_save sized alike)."""
    shape = (1, 64 * 40000, 32, 32, 128, 128)
    assert emu.stream_choice(*shape)[0] != 0
    assert emu.stream_choice(*shape, fwd_chunk=32)[0] == 0
    assert emu.stream_choice(1, 32 * 40000, 32, 32, 128, 128, fwd_chunk=32)[0] != 0  # 40000 rows at 32


def _bf16_raw(x: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))


def test_tma_pipeline_through_mbarriers(emu):
    """A producer thread loads tiles by TMA into a 2-stage ring (common/pipeline.cuh, tma_desc.h);
    consumers wait on the stage's full barrier, read it, release it: the column sums are exact."""
    ntiles = 7
    x = torch.randint(-8, 8, (16 * ntiles, 64), generator=torch.Generator().manual_seed(3)).float()
    out = np.zeros(64, np.float32)
    L = emu.lib()
    assert L.kf_emu_selftest_tma_pipeline(0, _p(_bf16_raw(x)), ntiles, _p(out)) == 0, \
        L.kf_emu_selftest_last_error().decode()
    np.testing.assert_array_equal(out, x.sum(0).numpy())


def test_tma_pipeline_misuse_does_not_pass_unnoticed(emu):
    """What the emulator must show: consumers that skip the full-barrier wait read poison (NaN);
    a producer that refills a stage before the consumers released it drives the barriers' phases
    apart (a deadlock on an mbarrier, as the GPU would hang); no producer at all is a deadlock."""
    ntiles = 6
    x = _bf16_raw(torch.ones(16 * ntiles, 64))
    L = emu.lib()
    out = np.zeros(64, np.float32)
    L.kf_emu_selftest_tma_pipeline(1, _p(x), ntiles, _p(out))  # may also end in a deadlock
    assert np.isnan(out).all(), "consumers that did not wait read no poison"
    for which in (2, 3):
        out = np.zeros(64, np.float32)
        assert L.kf_emu_selftest_tma_pipeline(which, _p(x), ntiles, _p(out)) != 0, f"misuse {which} not reported"
        err = L.kf_emu_selftest_last_error().decode()
        assert "deadlock" in err and "mbarrier" in err, err


@pytest.mark.parametrize("rows, row0", [(16, 4), (13, 8)])
def test_tma_box_lands_with_the_128_byte_swizzle(emu, rows, row0):
    """An 8 x 64 bf16 box with CU_TENSOR_MAP_SWIZZLE_128B: element (r, c) at byte r * 128 +
    16 ((c / 8) ^ (r % 8)) + 2 (c % 8) of the 1024-byte-aligned tile; rows past the tensor's end are
    zeros; a 1-D bulk copy on the same barrier lands too."""
    src = np.arange(rows * 64, dtype=np.uint16).reshape(rows, 64) + 1
    out = np.zeros(512 + 16, np.uint16)
    L = emu.lib()
    assert L.kf_emu_selftest_tma_swizzle(_p(src), rows, row0, _p(out)) == 0, L.kf_emu_selftest_last_error().decode()
    want = np.zeros(512, np.uint16)
    for r in range(8):
        for c in range(64):
            g = row0 + r
            want[(r * 128 + 16 * ((c // 8) ^ (r % 8)) + 2 * (c % 8)) // 2] = src[g, c] if g < rows else 0
    np.testing.assert_array_equal(out[:512], want)
    np.testing.assert_array_equal(out[512:], src.reshape(-1)[:16])


def test_out_of_bounds_global_write_is_caught(emu):
    # the guard zones of kda_emu.forward_stages: a workspace buffer one row short must be reported
    inputs, kw = make_case(T=64)
    orig = emu._Guarded.alloc

    def short_w(self, name, shape, dtype, **k):
        if name == "w":
            shape = (shape[0] - 1, *shape[1:])
        return orig(self, name, shape, dtype, **k)

    emu._Guarded.alloc = short_w
    try:
        with pytest.raises(RuntimeError, match="out-of-bounds write next to 'w'"):
            emu.forward_stages(*inputs, **kw)
    finally:
        emu._Guarded.alloc = orig



def test_cluster_handoff_through_distributed_shared_memory(emu):
    """Two CTAs of a cluster (kf_emu::launch_cluster; common/pipeline.cuh's cluster wrappers): rank 0
    writes each tile into rank 1's ring through mapa and arrives on rank 1's barrier remotely; rank 1
    releases stages by arriving on rank 0's. The column sums are exact, under every schedule."""
    ntiles = 7
    want = np.array([sum(t * 100 + c for t in range(ntiles)) for c in range(64)], np.float32)
    L = emu.lib()
    for order, greedy in (("forward", False), ("reverse", True), ("random", True)):
        emu.set_schedule(order, greedy, seed=5)
        out = np.zeros(64, np.float32)
        try:
            assert L.kf_emu_selftest_cluster(ntiles, 0, _p(out)) == 0, L.kf_emu_selftest_last_error().decode()
        finally:
            emu.set_schedule()
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("bug, words", [
    (1, ("never initialised",)),                  # no cluster_sync between the inits and the first remote arrival
    (2, ("has exited",)),                         # a CTA leaves while its peer still arrives on its barriers
    (3, ("deadlock", "barrier.cluster", "mbarrier")),  # a consumer waits for a tile that never comes
    (4, ("mapa", "not in the calling CTA")),      # mapa of a global address
])
def test_cluster_misuse_is_reported(emu, bug, words):
    out = np.zeros(64, np.float32)
    L = emu.lib()
    bad = False
    for order in ("forward", "reverse"):  # a race shows under some order
        emu.set_schedule(order, True)
        try:
            if L.kf_emu_selftest_cluster(4, bug, _p(out)) != 0:
                err = L.kf_emu_selftest_last_error().decode()
                assert all(w in err for w in words), err
                bad = True
        finally:
            emu.set_schedule()
    assert bad, f"cluster misuse {bug} not reported"


# ------------------------------------------------------------------------------------------------ split forward
# The split forward (csrc/kda/fwd/kda_fwd_split.cuh): each sequence's scan in pieces of L chunks, pass 1
# ([E | Phi] of every piece but the last, from zero / the identity), the chain of the pieces' initial
# states, pass 2 (the ordinary scan over the pieces). Pieces shorter than L (a sequence's tail, partial
# chunks), one-chunk pieces, empty and one-token documents, h0 and none, both state layouts, GVA, fp16.
SPLIT_CASES = {
    # weak decays (a chunk keeps ~0.8 of the state, see CASES): a piece's state carries into the next,
    # so the map Phi and the chain are what the comparison sees (with the strong gates the state before
    # a piece has decayed to nothing within it, and a missing Phi would pass)
    "L1-B2-T200-h0": dict(B=2, T=200, gate="precomputed_weak", h0=True, L=1),
    "L2-K128-V128-bv128-h0-vfirst": dict(T=330, K=128, V=128, gate="precomputed_weak", h0=True, state_v_first=True,
                                         L=2, bv=128),
    "L2-varlen-empty-onetoken": dict(T=330, cu=[0, 0, 1, 65, 330], gate="precomputed_weak", h0=True, L=2),
    "L2-GVA-fp16-K128-V128-bv64": dict(T=260, H=1, HV=2, K=128, V=128, gate="bounded_weak", dtype=torch.float16,
                                       L=2, bv=64),
    "L1-unbounded-no-ht": dict(T=200, h0=True, L=1, final=False),
    "L1-extreme-1000": dict(T=200, gate="precomputed", extreme=0.5, h0=True, L=1),
    "L3-bounded-weak-varlen-int64": dict(T=450, gate="bounded_weak", cu=[0, 300, 450], cu_dtype=torch.int64, L=3),
}


def _piece_starts(cu, B, T, L):
    """(global chunk, flattened first token, sequence, empty) of every piece, in piece order:
    kda_split_map_kernel's cut (an empty sequence is one empty piece)."""
    segs = [(b * T, b * T + T) for b in range(B)] if cu is None else list(zip(cu[:-1], cu[1:]))
    out, chunk0 = [], 0
    for n, (s, e) in enumerate(segs):
        nc = -(-(e - s) // 64)
        for i in range(max(1, -(-nc // L))):
            out.append((chunk0 + i * L, s + i * L * 64, n, nc == 0))
        chunk0 += nc
    return out


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_split_forward_matches_fp64_reference_and_unsplit(name, emu, ref):
    case = dict(SPLIT_CASES[name])
    L, bv, final = case.pop("L"), case.pop("bv", 64), case.pop("final", True)
    inputs, kw = make_case(**case)
    kw["output_final_state"] = final
    # save_states: a training forward's states for its backward, which pass 2 writes when split
    # (kda_policy.h's save_states_pays), [max_chunks, HV, V, K] in the global chunk order
    o, ht, hs, ws = emu.forward_stages(*inputs, **kw, return_intermediate_states=True, bv=bv, split_chunks=L,
                                       save_states=True)
    o_ref, ht_ref, st = kda_reference(inputs, kw, return_stages=True, ref=ref)
    vfirst = kw.get("state_v_first")
    nck = st["h"].numel() // st["h"].shape[-1] // st["h"].shape[-2] // st["h"].shape[-3]
    checks = {"o": (o_ref, o), "h": (st["h"], hs.transpose(-1, -2) if vfirst else hs),
              "saved states": (st["h"], ws["h_ckpt"][:nck].transpose(-1, -2).reshape(st["h"].shape))}
    if final:
        checks["ht"] = (ht_ref, ht)
    # the chain's result: every piece's initial state is the reference's state before its first chunk
    B, T = inputs[0].shape[:2]
    HV, K, V = inputs[2].shape[2], inputs[0].shape[3], inputs[2].shape[3]
    lay = ws["split_layout"]
    pieces = _piece_starts(case.get("cu"), B, T, L)
    init = ws["split_state"][lay["init"]: lay["init"] + len(pieces) * HV * K * V].view(len(pieces), HV, K, V)
    if vfirst:
        init = init.view(len(pieces), HV, V, K).transpose(-1, -2)
    h_all = st["h"].reshape(-1, HV, K, V)
    h0 = kw.get("initial_state")
    want = []
    for chunk, _, n, empty in pieces:
        if not empty:
            want.append(h_all[chunk])
        else:  # an empty sequence's one piece starts (and ends) with its initial state
            want.append(torch.zeros(HV, K, V) if h0 is None else (h0[n].transpose(-1, -2) if vfirst else h0[n]))
    checks["piece initial states"] = (torch.stack(want), init)
    bad = {key: rel_rms(r, got) for key, (r, got) in checks.items() if r.numel() and not rel_rms(r, got) <= TOL}
    assert not bad, f"off the fp64 reference (rel-RMS > {TOL}): {bad}"
    # the map the kernels built: the pieces' first tokens (the derived problem's cu_seqlens)
    cu_pieces = ws["split_map"][lay["cu"]: lay["cu"] + 2 * len(pieces)].view(torch.int64)
    assert cu_pieces.tolist() == [tok for _, tok, _, _ in pieces]
    assert ws["split_map"][lay["seq_piece0"] + (len(case["cu"]) - 1 if case.get("cu") else B)].item() == len(pieces)
    # beside the unsplit forward: the same to the operands' precision (not bitwise: Phi's product and
    # the chain round differently from one long chain)
    o1, ht1, hs1, _ = emu.forward_stages(*inputs, **kw, return_intermediate_states=True, bv=bv)
    assert rel_rms(o1.double(), o) < 5e-3 and rel_rms(hs1.double(), hs) < 5e-3
    if final:
        assert rel_rms(ht1, ht) < 5e-3


def test_split_forward_deterministic(emu):
    inputs, kw = make_case(T=260, cu=[0, 10, 260], h0=True)
    a = emu.forward_stages(*inputs, **kw, bv=64, split_chunks=1)
    b = emu.forward_stages(*inputs, **kw, bv=64, split_chunks=1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(_bits(a[3]["split_state"]), _bits(b[3]["split_state"]))


@pytest.mark.parametrize("K,V,vfirst", [(64, 64, False), (128, 128, True)])
def test_split_chain_column_blocks_give_the_same_bits(K, V, vfirst, emu, ref):
    """The chain kernel's column block (8, 16 or 32 value columns per CTA, split_chain_cols) spreads
    the work differently and changes no result bit: every sum runs over j in the same order. Two
    sequences of six one-chunk pieces (five chain steps each) from h0, both state layouts, both K;
    each width's states also match the fp64 reference (a width whose kernel were wrong fails there,
    not only in the comparison)."""
    inputs, kw = make_case(B=2, T=330, K=K, V=V, gate="precomputed_weak", h0=True, state_v_first=vfirst)
    kw["output_final_state"] = True
    runs = {c: emu.forward_stages(*inputs, **kw, bv=64, split_chunks=1, chain_cols=c) for c in (8, 16, 32)}
    o_ref, ht_ref = kda_reference(inputs, kw, ref=ref)[:2]
    for c, (o, ht, _, ws) in runs.items():
        assert rel_rms(o_ref, o) <= TOL and rel_rms(ht_ref, ht) <= TOL, c
        assert torch.equal(_bits(o), _bits(runs[8][0])) and torch.equal(ht, runs[8][1]), c
        assert torch.equal(_bits(ws["split_state"]), _bits(runs[8][3]["split_state"])), c
    with pytest.raises(RuntimeError, match="the column block must be 8, 16 or 32, got 12"):
        emu.forward_stages(*inputs, **kw, bv=64, split_chunks=1, chain_cols=12)


def test_split_chain_column_rule(emu):
    """split_chain_cols: the narrowest block whose grid (V / cols x HV x N CTAs) fits the SMs."""
    assert emu.split_chain_cols(1, 32768, 8, 8, 128, 128) == 8     # long_b1_t32k_h8: 128 CTAs on 132 SMs
    assert emu.split_chain_cols(1, 8192, 16, 16, 128, 128) == 16   # bounded_b1: 128 CTAs
    assert emu.split_chain_cols(1, 32768, 32, 32, 128, 128) == 32  # long_b1_t32k: 128 CTAs
    assert emu.split_chain_cols(4, 8192, 32, 32, 128, 256) == 32   # more than fit: the widest
    assert emu.split_chain_cols(1, 32768, 8, 8, 128, 128, sms=78) == 16  # a smaller device


def test_split_choice_model(emu):
    """kda_policy.h's fwd_split_choice: it splits few long chains (B1 T32768 with 8 heads: 16 scan
    chains on 132 SMs), not where its modelled gain is within the stale streamed model's error
    (bounded_b1), and never where the heads fill the GPU or the intra dominates."""
    chunks, bv, cost, other = emu.split_choice(1, 32768, 8, 8, 128, 128)
    assert chunks > 0 and bv in (64, 128) and cost < 0.75 * other
    assert emu.split_choice(1, 8192, 16, 16, 128, 128)[0] == 0  # bounded_b1: inside the 25% margin
    assert 512 // chunks <= 33  # at most kSplitMaxExtraPieces + 1 pieces
    assert emu.split_choice(1, 32768, 32, 32, 128, 128)[0] == 0  # long_b1_t32k: the intra alone is ~1.5 ms
    assert emu.split_choice(16, 8192, 16, 16, 128, 128)[0] == 0  # bounded_b16: 512 chains
    assert emu.split_choice(1, 32768, 8, 8, 64, 64)[1] == 64  # K = 64: the virtual columns are one 64-slice
    # 128 chains at V = 64 cannot stream (at most 124 on 132 SMs): compared with the two kernels, as a
    # varlen batch is (the intra of 128 heads dominates: no split), and not at all under 128 chunks
    unstreamed = emu.split_choice(1, 32768, 128, 128, 64, 64)
    assert emu.stream_choice(1, 32768, 128, 128, 64, 64)[0] == 0 and unstreamed[0] == 0 and unstreamed[3] > 5000
    assert emu.split_choice(1, 4096, 128, 128, 64, 64)[3] == 0


def test_split_choice_model_for_varlen(emu):
    """A varlen batch splits by its longest document (KdaOptions::max_seq_len, from the front's host copy
    of cu_seqlens): one 32768-token document at 8 heads as the fixed-length call does, two documents
    of 24576 + 8192 tokens too (the model counts the longest's pieces for both); not where the longest
    is not known (torch.compile, use_graph: max_seq_len 0), nor for short documents or many chains."""
    fixed = emu.split_choice(1, 32768, 8, 8, 128, 128)
    one = emu.split_choice_varlen(1, 32768, 32768, 8, 8, 128, 128)
    assert one[0] > 0 and one[1] == fixed[1] and abs(one[0] - fixed[0]) <= 1 and one[2] < 0.75 * one[3]
    two = emu.split_choice_varlen(2, 32768, 24576, 8, 8, 128, 128)
    assert two[0] > 0 and two[2] < 0.75 * two[3]
    assert emu.split_choice_varlen(2, 16384, 12288, 4, 4, 128, 128)[0] > 0          # the GPU test's batch
    assert emu.split_choice_varlen(2, 8192, 8191, 4, 4, 128, 128)[0] > 0            # 128 chunks
    assert emu.split_choice_varlen(1, 32768, 0, 8, 8, 128, 128)[0] == 0             # not known
    # short: under kSplitUnstreamedMinChunks, though the model, whose chain is optimistic, would split
    assert emu.split_choice_varlen(2, 8192, 8128, 4, 4, 128, 128)[0] == 0
    assert emu.split_choice_varlen(2, 4096, 2048, 8, 8, 128, 128)[0] == 0
    assert emu.split_choice_varlen(6, 8192, 3063, 32, 32, 128, 128)[0] == 0         # the bench's varlen: 384 chains
    assert emu.split_choice_varlen(1, 32768, 32768, 32, 32, 128, 128)[0] == 0       # long_b1_t32k's heads: the intra


def test_short_chunk_policy(emu):
    """kda_policy.h's fwd_short_chunks_pay: the 32-token forward wherever the 64-token one would run
    its two kernels one after the other (neither streamed nor split), however many chains; the bench
    cases as the stream model decides them on 132 SMs."""
    for shape in [(16, 8192, 16, 16, 128, 128),   # bounded_b16
                  (16, 8192, 16, 16, 128, 256),   # prod8192
                  (4, 4096, 16, 16, 128, 128),    # small: 64 chains, not streamed
                  (8, 8192, 8, 16, 128, 128)]:    # gva: 128 chains
        assert emu.stream_choice(*shape)[0] == 0 and emu.split_choice(*shape)[0] == 0
        assert emu.short_chunks(*shape)
    # the streamed cases keep 64-token chunks; so does a split call
    for shape in [(1, 8192, 16, 16, 128, 128), (1, 32768, 32, 32, 128, 128)]:
        assert emu.stream_choice(*shape)[0] != 0
        assert not emu.short_chunks(*shape, streams=True)
    assert not emu.short_chunks(1, 32768, 8, 8, 128, 128, split_chunks=emu.split_choice(1, 32768, 8, 8, 128, 128)[0])
    assert emu.short_chunks(1, 32768, 8, 8, 128, 128)  # ... which is what decides it


def test_scan_width_alone_by_chunk_size(emu):
    """kda_policy.h's fwd_scan_bv_alone: the 32-token scan at BV = 64 (two of its CTAs
    share an SM), the 64-token scan at scan_choice's width (one CTA per SM at either width: 128 where
    the chains fill the GPU, 64 where twice as many still fit one wave)."""
    for shape, at64 in [((16, 8192, 16, 16, 128, 128), 128),   # bounded_b16
                        ((16, 8192, 16, 16, 128, 256), 128),   # prod8192
                        ((8, 8192, 8, 16, 128, 128), 128),     # gva: 128 chains
                        ((4, 4096, 16, 16, 128, 128), 64)]:    # small: 64 chains
        assert emu.scan_bv(*shape, fwd_chunk=32) == 64
        assert emu.scan_bv(*shape, fwd_chunk=64) == at64


C32_CASES = {
    "K128-T100": dict(T=100, K=128, gate="bounded"),  # chunks of 32, 32, 32 and 4 tokens
    "K64-B2-gva": dict(B=2, T=70, H=1, HV=2, K=64, gate="bounded"),
    "K128-fp16-h8": dict(T=96, K=128, gate="bounded", dtype=torch.float16),
    "bounded16-K128-nol2": dict(T=90, K=128, gate="bounded16", l2norm=False),  # the widest midpoint factors
    "bounded-weak-K64": dict(T=64, gate="bounded_weak"),  # every block pair carries weight
    "noalog-large-qk": dict(T=80, K=128, gate="bounded_noalog", qk_scale=1e5),  # rows rescaled for fp16
    # the one-sided P2 form (SIMT diagonal tiles, fp16 tile pairs): unbounded and precomputed gates
    "unbounded-K128-T100": dict(T=100, K=128),
    "unbounded-K64-B2-gva-fp16": dict(B=2, T=70, H=1, HV=2, dtype=torch.float16),
    "extreme-1000-K128": dict(T=96, K=128, gate="precomputed", extreme=0.5),
    "weak-decay-K128": dict(T=64, K=128, gate="precomputed_weak"),
    # varlen through the chunk map at 32 tokens: an empty and a one-token document, a 33-token one
    "varlen-bounded-K128": dict(T=200, K=128, gate="bounded", cu=[0, 0, 1, 34, 100, 200]),
    "varlen-unbounded-gva": dict(T=150, H=1, HV=2, cu=[0, 31, 32, 150], cu_dtype=torch.int64),
}


@pytest.mark.parametrize("name", list(C32_CASES))
def test_intra_on_32_token_chunks_matches_fp64_reference(name, emu, ref):
    """The experimental 32-token intra (csrc/kda/fwd/kda_fwd_intra_c32.cuh), both P2 forms: its
    workspace against the fp64 reference's stages at chunk_size = 32 (w, qg, kg, Aqk, Akk, exp2(G) of
    every chunk's last row). The 64-token phases it is built from, run on 32-token chunks."""
    inputs, kw = make_case(**C32_CASES[name])
    B, T, _, K = inputs[0].shape
    ws = emu.intra_c32(*inputs, **kw)
    rk = {n: kw[n] for n in ("scale", "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
                             "allow_neg_eigval", "lower_bound", "cu_seqlens") if kw.get(n) is not None}
    rk.update({n: kw[n].double() for n in ("A_log", "dt_bias") if kw.get(n) is not None})
    _, _, st = ref.chunk_kda_reference(*(x.double() for x in inputs), **rk, chunk_size=32, return_stages=True)
    flat = lambda x: x.reshape(B * T, *x.shape[2:])  # noqa: E731
    segs = [(b * T, b * T + T) for b in range(B)] if kw.get("cu_seqlens") is None else \
        list(zip(kw["cu_seqlens"].tolist()[:-1], kw["cu_seqlens"].tolist()[1:]))
    rows = [min(c0 + 32, e) - 1 for s, e in segs for c0 in range(s, e, 32)]
    checks = {
        "qg": (flat(st["qg"]) * (kw.get("scale") or K ** -0.5), ws["qg"]),
        "kg": (flat(st["kg"]), ws["kg"]),
        "w": (flat(st["w"]), ws["w"]),
        "Aqk": (flat(st["Aqk"]), ws["Aqk"]),
        "Akk": (flat(st["Akk"]), ws["Akk"]),
        "exp2(G)": (as_stored_fp32(torch.exp2(flat(st["g2"])[rows])), ws["gdecay"][: len(rows)]),
    }
    bad = {key: err for key, (r, got) in checks.items() if not (err := rel_rms(r, got)) <= TOL}
    assert not bad, f"off the fp64 reference (rel-RMS > {TOL}): {bad}"


STREAMED_C32 = [("B3-T200-V256", stop) for stop in (-1, 0, 1, 3, 9)] + [
    ("gva-fp16", -1), ("gva-fp16", 2), ("unbounded-V64", -1), ("unbounded-V64", 4)]


@pytest.mark.parametrize("name, stop", STREAMED_C32)
def test_streamed_32_token_forward_is_bitwise_its_two_kernels(emu, ref, name, stop):
    """The 32-token forward streamed (forward_sequence with fwd_chunk = 32 and the flags: the 32-token
    scan's pass 1, the 32-token intra beside it on its transposed grid, pass 2): o and the final state
    bit for bit the 32-token two kernels', whether pass 1 finds every chunk published (-1), none (0)
    or those before 32-token chunk `stop`; one flag per 32-token chunk and head, each resume chunk
    where pass 1 stopped; and against the fp64 reference."""
    conf = {"B3-T200-V256": dict(B=3, T=200, K=128, V=256, gate="bounded", h0=True),
            "gva-fp16": dict(B=2, T=130, H=2, HV=4, K=128, V=128, gate="bounded", dtype=torch.float16, h0=True),
            "unbounded-V64": dict(B=2, T=96, K=128, V=64, h0=True)}[name]
    inputs, kw = make_case(**conf)
    bv = 64 if conf["V"] == 64 else 128
    o2, ht2, _, _ = emu.forward_stages(*inputs, **kw, bv=bv, fwd_chunk=32)
    o1, ht1, _, ws1 = emu.forward_stages(*inputs, **kw, bv=bv, fwd_chunk=32, streamed=True, stream_stop=stop)
    assert torch.equal(_bits(o1), _bits(o2)), "o differs"
    assert torch.equal(ht1, ht2), "final state differs"
    B, T = inputs[0].shape[:2]
    HV, V = inputs[2].shape[2], inputs[2].shape[3]
    check_stream_flags(ws1["chunk_ready"], B, T, HV, V, None if stop < 0 else min(stop, -(-T // 32)), chunk=32)
    o_ref, ht_ref = kda_reference(inputs, kw, ref=ref)
    bad = {key: err for key, (r, got) in {"o": (o_ref, o1), "ht": (ht_ref, ht1)}.items()
           if not (err := rel_rms(r, got)) <= TOL}
    assert not bad, f"off the fp64 reference (rel-RMS > {TOL}): {bad}"


def test_intra_on_32_token_chunks_refuses_what_it_does_not_serve(emu):
    inputs, kw = make_case(T=40, K=128, gate="bounded")
    with pytest.raises(RuntimeError, match="unsplit calls without states"):
        emu.forward_stages(*inputs, **kw, fwd_chunk=32, return_intermediate_states=True)


@pytest.mark.parametrize("name,bv", [("K128-T100", 64), ("K128-T100", 128), ("K64-B2-gva", 64), ("K128-fp16-h8", 128),
                                     ("unbounded-K128-T100", 128), ("extreme-1000-K128", 64),
                                     ("bounded-weak-K64", 64), ("varlen-bounded-K128", 128),
                                     ("varlen-unbounded-gva", 64)])
def test_forward_on_32_token_chunks_matches_fp64_reference(name, bv, emu, ref):
    """The experimental 32-token forward (the 32-token intra, then the scan at C = 32:
    kda_fwd_scan_c32_kernel) with an initial state: o and the final state against the fp64 reference
    (the outputs do not depend on the chunk size)."""
    case = dict(C32_CASES[name], h0=True)
    case.setdefault("V", 128 if bv == 128 else 64)
    inputs, kw = make_case(**case)
    o, ht, _ = emu.forward_c32(*inputs, **kw, bv=bv)
    o_ref, ht_ref = kda_reference(inputs, kw, ref=ref)
    bad = {key: err for key, (r, got) in {"o": (o_ref, o), "ht": (ht_ref, ht)}.items()
           if not (err := rel_rms(r, got)) <= TOL}
    assert not bad, f"off the fp64 reference (rel-RMS > {TOL}): {bad}"


def test_forward_sequence_takes_the_32_token_chunks(emu):
    """forward_sequence's branch for KdaProblem::fwd_chunk = 32 (what csrc/api sets where
    KERNEL_FUN_KDA_FWD_CHUNK=32 opts in) runs the 32-token intra and scan: bitwise those stages run by
    hand, and not the 64-token forward's bits, with fixed lengths and with cu_seqlens (the chunk map
    at 32 tokens)."""
    inputs, kw = make_case(**dict(C32_CASES["K128-T100"], h0=True, V=128))
    o_seq, ht_seq, _, _ = emu.forward_stages(*inputs, **kw, bv=128, fwd_chunk=32)
    o_c32, ht_c32, _ = emu.forward_c32(*inputs, **kw, bv=128)
    o_64, _, _, _ = emu.forward_stages(*inputs, **kw, bv=128)
    assert torch.equal(_bits(o_seq), _bits(o_c32)) and torch.equal(ht_seq, ht_c32)
    assert not torch.equal(_bits(o_seq), _bits(o_64))
    inputs, kw = make_case(**dict(C32_CASES["varlen-bounded-K128"], h0=True, V=128))
    o_seq, ht_seq, _, ws = emu.forward_stages(*inputs, **kw, bv=128, fwd_chunk=32)
    o_c32, ht_c32, _ = emu.forward_c32(*inputs, **kw, bv=128)
    assert torch.equal(_bits(o_seq), _bits(o_c32)) and torch.equal(ht_seq, ht_c32)
    assert ws["chunk_offsets"].tolist()[:6] == [0, 0, 1, 3, 6, 10]  # per document ceil(len / 32)
