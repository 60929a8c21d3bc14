"""The KDA backward kernels (csrc/kda/bwd, plus the forward kernels it re-runs), UNMODIFIED, on the
host emulator (tests/emu/): every gradient and the per-stage intermediates (the states h_c, the state
gradients dh_{c+1}, dAqk, dL) against the explicit fp64 stage reference
(kernel_fun.ref.kda_bwd). No GPU needed: g++ and the CUDA headers.
"""

from __future__ import annotations

import pytest
import torch

from helpers import DA_LOG_TOL, KDA_TOL, assert_bitwise_same, emu_module, emu_skip_reason, kda_bwd_reference, rel_rms
from test_emu_kda_fwd import make_case

STAGE_TOL = 1e-2

_why = emu_skip_reason()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"kf_emu cannot be built: {_why}")


@pytest.fixture(scope="module")
def emu():
    return emu_module()


def _do_dht(inputs, kw, seed):
    """d(o) and d(final state) for a case (CPU, reproducible from seed)."""
    q, v = inputs[0], inputs[2]
    B, T, HV, V = v.shape
    K = q.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(B, T, HV, V, generator=gen).to(q.dtype)
    N = B if kw.get("cu_seqlens") is None else kw["cu_seqlens"].numel() - 1
    dht = torch.randn(*((N, HV, V, K) if kw.get("state_v_first") else (N, HV, K, V)), generator=gen)
    return do, dht


CASES = {
    "T64-K64": dict(T=64, K=64, V=64),
    "T130-h0": dict(B=2, T=130, K=64, V=64, h0=True),
    "T1": dict(T=1, K=64, V=64, h0=True),  # with h0: without one, dg of a single token is exactly 0
    "K128-V128": dict(T=100, K=128, V=128, h0=True),
    "gva": dict(T=90, H=1, HV=2, K=64, V=64, h0=True),
    "bounded": dict(T=100, gate="bounded"),
    "bounded-noalog": dict(T=80, gate="bounded_noalog"),
    "bounded16-K128": dict(T=90, K=128, gate="bounded16", h0=True),
    # sigmoid's slope where sigmoid is near 1: s (1 - s) in fp32 is 1e-3..20% off there (0 from z ~ 17),
    # dA_log is the sum of slope * z * dgate (gate.cuh, sigmoid_slope)
    "bounded-saturated": dict(T=100, gate="bounded_saturated", h0=True),
    "beta-saturated": dict(T=100, beta_shift=16.0, h0=True),  # the same slope for beta's sigmoid
    "precomputed-nol2": dict(T=100, gate="precomputed", l2norm=False, beta_sigmoid=False),
    # weak decays: every block pair of a chunk counts (I1's far pairs, e.g. rows 48..63 x columns 0..15)
    "weak-decay-K128": dict(T=128, K=128, V=64, gate="precomputed_weak", h0=True),
    "weak-decay-B2-T64": dict(B=2, T=64, K=64, V=64, gate="precomputed_weak"),
    "bounded-weak-K128": dict(T=128, K=128, V=64, gate="bounded_weak", h0=True),
    "neg-eig-svf": dict(T=70, neg_eig=True, h0=True, state_v_first=True),
    "fp16": dict(T=100, dtype=torch.float16, h0=True),
    "varlen": dict(T=200, cu=[0, 0, 1, 64, 65, 200], h0=True),
    "extreme": dict(T=130, gate="precomputed", extreme=0.5),
    "extreme-90-fp16": dict(T=200, gate="precomputed", extreme=0.9, dtype=torch.float16, h0=True),
    "K128-V256": dict(T=200, K=128, V=256, h0=True),
    "K64-V192": dict(T=150, K=64, V=192),
    "gva-2-4-K128": dict(T=140, H=2, HV=4, K=128, V=128, h0=True),
    "gva-varlen": dict(T=300, H=1, HV=2, cu=[0, 15, 100, 300], h0=True),
    "varlen-int64-bounded": dict(T=200, K=128, V=128, cu=[0, 63, 63, 200], cu_dtype=torch.int64, gate="bounded"),
    # q and k of norm ~1e-3: the l2norm's epsilon (1e-6) sets q^ and k^ and their backward, in
    # kda_bwd_grads (l2norm factors of device/gate.cuh) and, with GVA, kda_bwd_group_sum_kernel
    "l2norm-eps-tiny-qk": dict(T=90, qk_scale=1e-4, h0=True),
    "gva-l2norm-eps-tiny-qk": dict(T=90, H=1, HV=2, qk_scale=1e-4),
    # raw bf16 entries ~1e5: the forward intra rescales those rows for its fp16 products
    # (dev::row_rstd_fp16_operands), the backward's prep recomputes qg / kg from the raw ones
    "large-qk-K128": dict(T=100, K=128, V=64, qk_scale=1e5, h0=True),
}


@pytest.mark.parametrize("path", ["training", "saved", "recompute"])
@pytest.mark.parametrize("name", list(CASES))
def test_backward_matches_fp64_reference(name, path, emu):
    """path "training": the forward's Aqk / Akk / M, its intra's w / qg / kg / exp2(G) (no
    kda_bwd_prep) and its scan's states (no re-scan), as a training call keeps them; "saved": the
    factors only, kda_bwd_prep and the re-scan rebuild the rest; "recompute": the forward intra
    recomputes everything (the raw op without saved factors)."""
    inputs, kw = make_case(**CASES[name])
    q, k, v, g, beta = inputs
    B, T, HV, V = v.shape
    K = q.shape[-1]
    do, dht = _do_dht(inputs, kw, 7)
    saved = states = workspace = None
    if path != "recompute":
        _, _, _, ws = emu.forward_stages(*inputs, **kw, save_states=path == "training")
        saved = (ws["Aqk"], ws["Akk"], ws["M"])
        states = ws.get("h_ckpt")
        if path == "training":
            workspace = {n: ws[n].clone() for n in ("w", "qg", "kg", "gdecay")}
    grads, st = emu.backward_stages(*inputs, do, dht, **kw, saved=saved, states=states, workspace=workspace)
    if states is not None:  # read, never rewritten: no re-scan ran (its states differ in the last bits)
        assert torch.equal(st["h_ckpt"].view(torch.int16), states.view(torch.int16))
    for n, t in (workspace or {}).items():  # likewise: no kda_bwd_prep ran
        assert torch.equal(st[n].view(torch.int32 if n == "gdecay" else torch.int16),
                           t.view(torch.int32 if n == "gdecay" else torch.int16)), n
    ref, rst = kda_bwd_reference(inputs, kw, do, dht)
    bad = {}
    for key, tol in (("dq", KDA_TOL["dq"]), ("dk", KDA_TOL["dk"]), ("dv", KDA_TOL["dv"]), ("dg", KDA_TOL["dg"]),
                     ("dbeta", KDA_TOL["dbeta"]), ("dh0", KDA_TOL["dh0"]), ("dA_log", DA_LOG_TOL),
                     ("ddt_bias", KDA_TOL["dbias"])):
        if ref.get(key) is None:
            assert grads.get(key) is None, key
            continue
        got = grads[key]
        err = rel_rms(ref[key], got.reshape(ref[key].shape))
        if not err <= tol:
            bad[key] = err
    # stages: states, state gradients, dAqk, dL (token rows that exist)
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    nck = rst["h"].shape[1] * rst["h"].shape[0]
    h_ref = rst["h"].reshape(nck, HV, K, V).transpose(-1, -2)
    dh_ref = rst["dh"].reshape(nck, HV, K, V).transpose(-1, -2)
    stages = {"h": (h_ref, st["h_ckpt"][:nck]), "dh": (dh_ref, st["dh_ckpt"][:nck]),
              "dA": (flat(rst["dAqk"]) * (kw.get("scale") or K ** -0.5), st["dA"]), "dL": (flat(rst["dL"]), st["dL"])}
    for key, (r, got) in stages.items():
        err = rel_rms(r, got)
        if not err <= STAGE_TOL:
            bad["stage " + key] = err
    assert not bad, f"off the fp64 reference: {bad}"


@pytest.mark.parametrize("g_dtype,misalign", [(torch.bfloat16, False), (torch.float16, True), (torch.float32, True)],
                         ids=["bf16", "fp16-misaligned", "fp32-misaligned"])
def test_backward_reads_g_and_writes_dg_in_any_dtype_and_alignment(g_dtype, misalign, emu):
    """The gate's 8-wide loads (prologue and F phase) and dg's 8-wide stores take 16-byte accesses
    for an aligned fp32 / bf16 / fp16 g and dg, and a scalar path otherwise (misalign: g, q, k and dg
    one element off 16 bytes). K = 128: two gate rows per thread in kda_bwd_grads' rolled loop."""
    inputs, kw = make_case(T=100, K=128, V=64, g_dtype=g_dtype, h0=True)
    q, k, v, g, beta = inputs
    B, T, HV, V = v.shape
    gen = torch.Generator().manual_seed(11)
    do = torch.randn(B, T, HV, V, generator=gen).to(q.dtype)
    grads, _ = emu.backward_stages(*inputs, do, None, **kw, misalign=misalign)
    ref, _ = kda_bwd_reference(inputs, kw, do, None)
    assert grads["dg"].dtype == g_dtype
    for key in ("dq", "dk", "dv", "dg", "dbeta"):
        err = rel_rms(ref[key], grads[key].reshape(ref[key].shape))
        assert err <= KDA_TOL[key], (key, err)


@pytest.mark.parametrize("name", ["gva-varlen", "K128-V128"])
def test_backward_does_not_depend_on_the_thread_schedule(emu, name):
    """Bitwise identical under every fiber schedule, including warp-greedy ones (a missing barrier
    between a smem write and another warp's read shows up as a difference)."""
    inputs, kw = make_case(**CASES[name])
    q, v = inputs[0], inputs[2]
    do = torch.randn(*v.shape[:2], v.shape[2], v.shape[3], generator=torch.Generator().manual_seed(3)).to(q.dtype)
    run = lambda: emu.backward_stages(*inputs, do, None, **kw)[0]  # noqa: E731
    base = run()
    try:
        for order, greedy, seed in (("reverse", False, 0), ("random", True, 1), ("forward", True, 0)):
            emu.set_schedule(order, greedy, seed)
            got = run()
            for key, t in base.items():
                if t is not None:
                    assert torch.equal(t, got[key]), (order, greedy, key)
    finally:
        emu.set_schedule()


@pytest.mark.parametrize("case", [
    dict(T=130, H=1, HV=2, K=64, V=64, h0=True, l2norm=False),          # the sum alone: bitwise
    dict(T=130, H=1, HV=2, K=64, V=64, h0=True),                        # l2norm's backward after it
    dict(T=200, H=2, HV=8, K=128, V=64, gate="bounded", l2norm=False),  # chains of four heads
    dict(T=300, H=1, HV=4, cu=[0, 15, 100, 101, 300], h0=True, l2norm=False),  # varlen, a one-token document
])
def test_gva_chain_is_the_group_sum(emu, case):
    """GVA's dq^ / dk^ summed over each group along a chain of kda_bwd_grads' CTAs (KdaBwdParams::
    gva_flags) against kda_bwd_group_sum's sum of the per-head workspace: the same order of fp32 adds,
    so without l2norm dq / dk are bit for bit the same, with it within rounding (the l2norm backward's
    row dot is reduced in another order); every other gradient bit for bit. Each flag ends at G - 1
    (every head after the first waited for the one before it), and the running sums fill a workspace
    of G - 1 heads per group, every row written (NaN-poisoned before): kda_bwd_group_sum, which reads
    G heads per group, did not run (it would have read past the guarded buffer)."""
    inputs, kw = make_case(**case)
    do, dht = _do_dht(inputs, kw, 5)
    H, HV = inputs[0].shape[2], inputs[2].shape[2]
    G = HV // H
    chain, st = emu.backward_stages(*inputs, do, dht, **kw)
    summed = emu.backward_stages(*inputs, do, dht, **kw, gva_chain=False)[0]
    exact = not case.get("l2norm", True)
    for key, t in summed.items():
        if t is None:
            continue
        assert torch.isfinite(chain[key]).all(), key
        if key in ("dq", "dk") and not exact:
            assert rel_rms(t.double(), chain[key].double()) < 2e-3, key
        else:
            assert torch.equal(t, chain[key]), key
    cu = kw.get("cu_seqlens")
    lens = [case["T"]] if cu is None else [int(b - a) for a, b in zip(cu[:-1], cu[1:])]
    chunks = sum(-(-n // 64) for n in lens)
    flags = st["gva_flags"]
    assert (flags[:chunks] == G - 1).all()
    for key in ("dqhat", "dkhat"):
        assert st[key].shape[1] == HV - H, key
        assert torch.isfinite(st[key]).all(), key


@pytest.mark.parametrize("case", [
    dict(B=3, T=130, K=64, V=64, h0=True),                                  # uneven last slice
    dict(B=4, T=70, H=1, HV=2, K=64, V=64, h0=True, gate="bounded"),        # GVA group sums per slice
    dict(B=3, T=100, K=128, V=128, h0=True, neg_eig=True, state_v_first=True),
])
def test_backward_in_batch_slices_is_bitwise_the_whole_batch(emu, case):
    """kda_backward in slices of 1 or 2 batches (csrc/kda/bwd/kda_bwd_slice.h: per-slice workspace,
    every per-token / per-sequence pointer advanced, the gate partials summed once at the end) gives
    exactly the gradients of one pass over the whole batch, dA_log / ddt_bias / dh0 included."""
    inputs, kw = make_case(**case)
    do, dht = _do_dht(inputs, kw, 11)
    _, _, _, ws = emu.forward_stages(*inputs, **kw, save_states=True)
    saved = (ws["Aqk"], ws["Akk"], ws["M"])
    # with the forward's states and workspace, each slice reads its part of them (kda_bwd_batch_slice)
    kept = {n: ws[n].clone() for n in ("w", "qg", "kg", "gdecay")}
    for states, workspace in ((None, None), (ws["h_ckpt"], None), (ws["h_ckpt"], kept)):
        what = f"states {'saved' if states is not None else 'rescanned'}, workspace {'saved' if workspace else 'prep'}"
        whole = emu.backward_stages(*inputs, do, dht, **kw, saved=saved, states=states, workspace=workspace)[0]
        for nb in (1, 2):
            sliced = emu.backward_stages(*inputs, do, dht, **kw, saved=saved, slice_b=nb, states=states,
                                         workspace=workspace)[0]
            assert_bitwise_same(whole, sliced, f"slice of {nb}, {what}")


@pytest.mark.parametrize("shape, split, want, bounded", [
    # (B, T, H, HV, K, V): the bench cases, as docs/kda-backward.md states them
    ((1, 32768, 32, 32, 128, 128), 0, dict(stream=True, save_states=True, pair=True), True),     # long_b1_t32k: 64 chains
    ((1, 131072, 32, 32, 128, 128), 0, dict(stream=True, save_states=True, pair=True), True),    # long_b1_t128k
    ((1, 8192, 16, 16, 128, 128), 0, dict(stream=True, save_states=True, pair=True), True),      # bounded_b1: 32 chains
    ((4, 4096, 16, 16, 128, 128), 0, dict(stream=True, save_states=True, pair=False), False),     # small: 64 chains at 128
    # sliced backwards stream slice by slice: prod8192 (4 slices of 4: 128 chains at 128 each), k3_h32
    # (2 of 4); not bounded_b16 (2 of 8): the bounded-gate kernel streams up to 116 chains only
    ((16, 8192, 16, 16, 128, 256), 0, dict(stream=True, save_states=True, pair=False), False),    # prod8192
    ((16, 8192, 16, 16, 128, 128), 0, dict(stream=False, save_states=True, pair=False), True),    # bounded_b16
    ((8, 8192, 32, 32, 128, 128), 0, dict(stream=True, save_states=True, pair=False), False),     # k3_h32
    ((1, 32768, 8, 8, 128, 128), 16, dict(stream=False, save_states=True, pair=True), True),     # split: never streams
    ((2, 8192, 32, 32, 128, 128), 0, dict(stream=True, save_states=True, pair=False), False),     # 64 chains at 128
    ((4, 4096, 32, 32, 128, 128), 0, dict(stream=True, save_states=True, pair=False), False),     # 128 chains at 128
    ((8, 8192, 8, 16, 128, 128), 0, dict(stream=True, save_states=True, pair=False), False),      # gva: 128 chains at 128
    ((8, 8192, 16, 16, 128, 128), 0, dict(stream=False, save_states=True, pair=False), True),     # bounded: 128 chains
    ((6, 8192, 16, 16, 128, 128), 0, dict(stream=True, save_states=True, pair=False), True),      # bounded: 96 chains
    ((1, 8192, 64, 64, 128, 192), 0, dict(stream=False, save_states=True, pair=False), False),    # V 192: 192 chains at 64
    ((2, 8192, 16, 16, 128, 192), 0, dict(stream=True, save_states=True, pair=False), False),     # V 192: 96 chains at 64
    ((7, 4096, 16, 16, 128, 64), 0, dict(stream=True, save_states=True, pair=False), False),      # V 64: 112 chains
    ((4, 4096, 32, 32, 128, 64), 0, dict(stream=False, save_states=True, pair=False), False),     # V 64: 128 chains
    ((4, 4096, 16, 16, 64, 128), 0, dict(stream=True, save_states=True, pair=True), False),       # K 64: paired before
    ((1, 64 * 65536, 1, 1, 128, 128), 0, dict(stream=False, save_states=False, pair=True), False),  # 65536 rows: pairs
])
def test_backward_stream_policy(emu, shape, split, want, bounded):
    """kda_policy.h's bwd_pass_streams: each pass of the backward (the whole batch, or each batch
    slice) streams as bwd_stream_wanted says: fixed-length problems stream wherever they can
    (bwd_stream_possible) if V allows the 128-column dh scan and the grads kernel is the
    unbounded-gate one, else where the pass has at most 116 chains (an eighth of the SMs left), and their
    forward saves its states for it (save_states_pays), where some used to pair the re-scan with the
    dh scan and save none; a split problem, more chains or more than 65535 chunk rows do not stream
    (the last pairs as before). A pure function of the shape, the gate and the split, as the forward
    and its backward must agree."""
    assert emu.bwd_policy(*shape, split_chunks=split, bounded=bounded) == want


def _assert_every_chain_counted(dh_ready, n_seq, HV, V, T, bv=0):
    """Every dh-scan chain of n_seq sequences counted every chunk of its sequence ([sequence][value head]
    [slice] at the dh scan's width: bv, or the launcher's 64 or 128 when bv is 0); the counters a
    narrower width would use stay 0."""
    nts = -(-T // 64)
    counts = dh_ready[: n_seq * HV * (V // 64)]
    n_set = int((counts == nts).sum())
    assert n_set == n_seq * HV * (V // bv) if bv else n_set in (n_seq * HV * (V // 64), n_seq * HV * (V // 128)), counts
    assert (counts[:n_set] == nts).all() and (counts[n_set:] == 0).all(), counts


@pytest.mark.parametrize("case,bv", [
    (dict(B=2, T=1100, K=64, V=128, h0=True), 64),                   # 18 chunks: a publication mid-chain, two slices
    (dict(T=1030, K=128, V=128, gate="bounded16", h0=True), 128),     # the bounded-gate kernel (kLoLast)
    (dict(B=3, T=200, K=128, V=64, dtype=torch.float16), 0),          # fp16, three sequences, the launcher's width
    (dict(T=140, H=1, HV=2, K=64, V=192, h0=True, state_v_first=True), 64),  # GVA, three slices
])
def test_streamed_backward_is_bitwise_the_plain_one(emu, case, bv):
    """The streamed backward (KdaBwdParams::dh_ready: kda_bwd_grads beside the dh scan on the GPU, its grid
    transposed into the order the dh scan stores its checkpoints, each CTA waiting for its chunk's count)
    gives exactly the plain backward's gradients. The emulator runs the dh scan to its end first: a
    grads CTA whose checkpoint is not counted fails the launch, and each grads kernel's done counter
    must equal its CTA count (the unbounded bf16 cases with dht also run kda_bwd_grads_last_kernel)."""
    inputs, kw = make_case(**case)
    B, T, HV, V = inputs[2].shape
    do, dht = _do_dht(inputs, kw, 13)
    _, _, _, ws = emu.forward_stages(*inputs, **kw, save_states=True, bv=bv or None)
    saved = (ws["Aqk"], ws["Akk"], ws["M"])
    kept = {n: ws[n].clone() for n in ("w", "qg", "kg", "gdecay")}
    args = dict(saved=saved, states=ws["h_ckpt"], workspace=kept, bv=bv or None)
    plain = emu.backward_stages(*inputs, do, dht, **kw, **args)[0]
    streamed, st = emu.backward_stages(*inputs, do, dht, **kw, **args, streamed=True)
    assert_bitwise_same(plain, streamed, "streamed")
    _assert_every_chain_counted(st["dh_ready"], B, HV, V, T, bv)


@pytest.mark.parametrize("case,slice_b", [
    (dict(B=3, T=1100, K=64, V=128, h0=True), 2),                       # an uneven last slice, dht
    (dict(B=4, T=300, K=128, V=64, gate="bounded16"), 1),               # the bounded-gate kernel, 4 slices
    (dict(B=2, T=150, H=1, HV=2, K=64, V=128, dtype=torch.float16), 1),  # GVA: group sums per slice
])
def test_streamed_backward_in_slices_is_bitwise_the_plain_one(emu, case, slice_b):
    """A backward in batch slices streams slice by slice (kda_bwd_streams on a slice's shape: each
    slice's dh scan zeroes the counters, its grads kernels wait for their chunks' counts): exactly the
    gradients of the plain backward in one pass. The counters are the last slice's after it."""
    inputs, kw = make_case(**case)
    B, T, HV, V = inputs[2].shape
    do, dht = _do_dht(inputs, kw, 17)
    _, _, _, ws = emu.forward_stages(*inputs, **kw, save_states=True)
    saved = (ws["Aqk"], ws["Akk"], ws["M"])
    kept = {n: ws[n].clone() for n in ("w", "qg", "kg", "gdecay")}
    args = dict(saved=saved, states=ws["h_ckpt"], workspace=kept)
    plain = emu.backward_stages(*inputs, do, dht, **kw, **args)[0]
    streamed, st = emu.backward_stages(*inputs, do, dht, **kw, **args, slice_b=slice_b, streamed=True)
    assert_bitwise_same(plain, streamed, f"streamed in slices of {slice_b}")
    _assert_every_chain_counted(st["dh_ready"], B - (B - 1) // slice_b * slice_b, HV, V, T)  # the last slice's


@pytest.mark.parametrize("case,bv", [
    (dict(B=2, T=130, K=64, V=128, h0=True), 64),                                   # two V-slices per scan
    (dict(T=200, K=128, V=128, cu=[0, 0, 1, 64, 65, 200], h0=True, gate="bounded"), 64),  # varlen, empty docs
    (dict(T=90, H=1, HV=2, K=64, V=64, h0=True, state_v_first=True), 0),           # GVA, the launcher's width
])
def test_paired_scans_are_bitwise_the_two_launches(emu, case, bv):
    """kda_bwd_scans (the re-scan and the dh scan in one launch, csrc/kda/bwd/kda_bwd_scans.cuh, what
    kda_policy.h picks when both fit in one wave) gives exactly the gradients and the state / state-
    gradient checkpoints of the two separate launches."""
    inputs, kw = make_case(**case)
    B, T = inputs[2].shape[:2]
    do, dht = _do_dht(inputs, kw, 5)
    paired, sp = emu.backward_stages(*inputs, do, dht, **kw, bv=bv, pair_scans=1)
    apart, sa = emu.backward_stages(*inputs, do, dht, **kw, bv=bv, pair_scans=2)
    cu = kw.get("cu_seqlens")
    lens = [T] * B if cu is None else (cu[1:] - cu[:-1]).tolist()
    nck = sum(-(-n // 64) for n in lens)  # the chunks that exist (the rest of the buffer stays NaN)
    assert_bitwise_same({k: sa[k][:nck] for k in ("h_ckpt", "dh_ckpt")},
                        {k: sp[k][:nck] for k in ("h_ckpt", "dh_ckpt")}, "checkpoints")
    assert_bitwise_same(apart, paired, "gradients")


def test_varlen_dh_scan_at_its_own_width(emu):
    """Varlen batches run the dh scan at V-slices of 64 while the forward scan and the re-scan take
    128 (kda_policy.h's dh_scan_bv): the gradients and the dh checkpoints are exactly those of both
    scans at 128, the width forced for both (the emulator's bv argument). 16 heads: 5 x 16 chains at
    128 do not fit one wave twice, so the scans are not paired (paired scans share one width)."""
    inputs, kw = make_case(T=200, H=16, HV=16, K=128, V=128, cu=[0, 0, 1, 64, 65, 200], h0=True, gate="bounded")
    do, dht = _do_dht(inputs, kw, 9)
    own, so = emu.backward_stages(*inputs, do, dht, **kw)  # the launchers' choice: 128 and 64
    both, sb = emu.backward_stages(*inputs, do, dht, **kw, bv=128)
    nck = 5  # chunks of the documents 0, 1, 63, 1, 135 tokens: 0 + 1 + 1 + 1 + 3 (the rest stay NaN)
    assert_bitwise_same({"dh_ckpt": sb["dh_ckpt"][:nck]}, {"dh_ckpt": so["dh_ckpt"][:nck]}, "dh checkpoints")
    assert_bitwise_same(both, own, "gradients")


@pytest.mark.parametrize("HV,K,nc,max_chunks,varlen", [
    (3, 128, 1, 1, False),      # one chunk: one segment, one partial
    (2, 64, 64, 64, False),     # exactly one full segment
    (2, 128, 65, 65, False),    # a second segment of one chunk
    (4, 64, 300, 300, False),   # five segments, the last partial
    (2, 128, 130, 200, True),   # varlen: the device-side chunk total (130) below the grid bound (200)
])
def test_gate_param_passes_sum_every_chunk_exactly(emu, HV, K, nc, max_chunks, varlen):
    """kda_bwd_finish's two passes (segments of 64 chunks in place, then the segments) against a double
    sum of the same fp32 partials. The partials cancel (large terms of both signs, a small total), as
    dA_log's do; the only rounding allowed is each segment's sum and the result to fp32. Chunks past
    nc hold NaN: a pass that read them would show it."""
    gen = torch.Generator().manual_seed(nc)
    pbias = torch.full((max_chunks, HV, K), float("nan"))
    pA = torch.full((max_chunks, HV), float("nan"))
    big = 1e3 * torch.randn(nc, HV, K + 1, generator=gen, dtype=torch.float64)
    vals = torch.cat([big, -big.flip(0) + 1e-2 * torch.randn(nc, HV, K + 1, generator=gen, dtype=torch.float64)])
    vals = vals[torch.randperm(2 * nc, generator=gen)[:nc]].float()
    pbias[:nc], pA[:nc] = vals[..., :K], vals[..., K]
    dA_log, ddt_bias = emu.gate_params(pbias, pA, nc, varlen=varlen)

    def check(got, parts):  # parts [nc, ...] fp32
        p64 = parts.double()
        exact = p64.sum(0)
        segs = torch.stack([p64[s:s + 64].sum(0) for s in range(0, nc, 64)])
        bound = 2.0 ** -24 * (segs.abs().sum(0) + exact.abs()) * 1.0001 + 1e-30
        assert torch.isfinite(got).all()
        assert ((got.double() - exact).abs() <= bound).all(), (got.double() - exact).abs().max()

    check(dA_log, pA[:nc])
    check(ddt_bias, pbias[:nc])
    again = emu.gate_params(pbias, pA, nc, varlen=varlen)
    assert_bitwise_same({"dA_log": dA_log, "ddt_bias": ddt_bias}, {"dA_log": again[0], "ddt_bias": again[1]})


@pytest.mark.parametrize("name", ["weak-decay-K128", "gva-2-4-K128", "bounded16-K128"])
def test_grads_load_balancing(emu, name):
    """kda_bwd_grads' load balancing (KdaBwdParams::balance, KERNEL_FUN_KDA_BWD_BALANCE on the GPU):
    E1's dAkk tiles on other warps (bit 2) compute the same numbers, bit for bit; I1's column-side
    hand-over (bit 1) only regroups one sum, so it stays within the stage tolerance of the plain
    assignment -- and the hand-over must arrive: on weak decays its pair is not negligible."""
    inputs, kw = make_case(**CASES[name])
    do, dht = _do_dht(inputs, kw, 2)
    kw = {k: v for k, v in kw.items() if k != "output_final_state"}
    runs = {b: emu.backward_stages(*inputs, do, dht, balance=b, **kw) for b in (0, 1, 2, 3)}

    def grads(b):
        g, st = runs[b]
        return {**{k: v for k, v in g.items() if v is not None}, "dA": st["dA"], "dL": st["dL"]}

    assert_bitwise_same(grads(0), grads(2), "E1 tiles moved")
    assert_bitwise_same(grads(1), grads(3), "E1 tiles moved, I1 balanced")
    for key, ref in grads(0).items():
        assert rel_rms(ref.double(), grads(1)[key].double()) <= STAGE_TOL, key


# The split scans (csrc/kda/fwd/kda_fwd_split.cuh): the re-scan as the split forward's, the dh scan in
# pieces chained from the end (pass 1: [F | Psi] of every piece but a sequence's first; the reverse
# chain; pass 2: the ordinary dh scan over the pieces; the first piece's gradient -> dh0). Weak decays,
# so a piece's state gradient reaches far into the piece before it.
SPLIT_CASES = {
    "L1-B2-T200-h0": dict(B=2, T=200, K=64, V=64, gate="precomputed_weak", h0=True, L=1),
    "L2-K128-V128-bv128-vfirst": dict(T=330, K=128, V=128, gate="precomputed_weak", h0=True, state_v_first=True,
                                      L=2, bv=128),
    "L2-varlen-empty-onetoken": dict(T=330, cu=[0, 0, 1, 65, 330], gate="bounded_weak", h0=True, L=2),
    "L2-gva-fp16-K128": dict(T=260, H=1, HV=2, K=128, V=64, gate="precomputed_weak", dtype=torch.float16, L=2),
    "L1-unbounded-no-h0": dict(T=200, L=1),
}


@pytest.mark.parametrize("states", [False, True], ids=["rescan", "saved-states"])
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_split_backward_matches_fp64_reference_and_unsplit(name, states, emu):
    """Every gradient and the state / state-gradient checkpoints against the fp64 stage reference, and
    beside the unsplit backward (to the operands' precision); the chain's gradients entering the
    pieces' ends against the reference's dh at those chunks. states: the states the split forward
    saved (a split training forward saves them: kda_policy.h's save_states_pays; no re-scan, the dh
    scan alone is split) or the split re-scan."""
    case = dict(SPLIT_CASES[name])
    L, bv = case.pop("L"), case.pop("bv", 64)
    inputs, kw = make_case(**case)
    q, v = inputs[0], inputs[2]
    B, T, HV, V = v.shape
    K = q.shape[-1]
    do, dht = _do_dht(inputs, kw, 3)
    _, _, _, ws = emu.forward_stages(*inputs, **kw, save_states=states, bv=bv, split_chunks=L if states else 0)
    saved = (ws["Aqk"], ws["Akk"], ws["M"])
    kept = ws["h_ckpt"] if states else None
    grads, st = emu.backward_stages(*inputs, do, dht, **kw, saved=saved, states=kept, bv=bv, split_chunks=L)
    ref, rst = kda_bwd_reference(inputs, kw, do, dht)
    bad = {}
    for key, tol in (("dq", KDA_TOL["dq"]), ("dk", KDA_TOL["dk"]), ("dv", KDA_TOL["dv"]), ("dg", KDA_TOL["dg"]),
                     ("dbeta", KDA_TOL["dbeta"]), ("dh0", KDA_TOL["dh0"]), ("dA_log", DA_LOG_TOL),
                     ("ddt_bias", KDA_TOL["dbias"])):
        if ref.get(key) is not None and not rel_rms(ref[key], grads[key].reshape(ref[key].shape)) <= tol:
            bad[key] = rel_rms(ref[key], grads[key].reshape(ref[key].shape))
    nck = rst["h"].shape[1] * rst["h"].shape[0]
    h_ref = rst["h"].reshape(nck, HV, K, V).transpose(-1, -2)
    dh_ref = rst["dh"].reshape(nck, HV, K, V).transpose(-1, -2)
    for key, (r, got) in {"h": (h_ref, st["h_ckpt"][:nck]), "dh": (dh_ref, st["dh_ckpt"][:nck])}.items():
        if not rel_rms(r, got) <= STAGE_TOL:
            bad["stage " + key] = rel_rms(r, got)
    # the reverse chain: a piece's `init` is the state gradient at its end = dh_ckpt's row of its last
    # chunk (dh_{c+1} of chunk c), i.e. the reference's dh there
    lay = st["split_layout"]
    from test_emu_kda_fwd import _piece_starts
    pieces = _piece_starts(case.get("cu"), B, T, L)
    init = st["split_state"][lay["init"]: lay["init"] + len(pieces) * HV * K * V].view(len(pieces), HV, K, V)
    if kw.get("state_v_first"):
        init = init.view(len(pieces), HV, V, K).transpose(-1, -2)
    ends = [(chunk, n, i + 1 == len(pieces) or pieces[i + 1][2] != n, empty)
            for i, (chunk, _, n, empty) in enumerate(pieces)]
    want, got = [], []
    for i, (chunk, n, last, empty) in enumerate(ends):
        if empty or last:  # a sequence's last piece ends at dht (checked through dh0 / dh above)
            continue
        nxt = pieces[i + 1][0]  # the next piece's first chunk: dh entering it = dh_{c+1} of chunk nxt - 1
        want.append(dh_ref[nxt - 1].transpose(-1, -2))
        got.append(init[i])
    if want:
        err = rel_rms(torch.stack(want), torch.stack(got))
        if not err <= STAGE_TOL:
            bad["pieces' end gradients"] = err
    assert not bad, f"off the fp64 reference: {bad}"
    apart, _ = emu.backward_stages(*inputs, do, dht, **kw, saved=saved, states=kept, bv=bv)
    for key, t in apart.items():
        if t is not None:
            assert rel_rms(t.double(), grads[key]) < 5e-3, key


def test_split_dh_chain_column_blocks_give_the_same_bits(emu):
    """The reverse chain at every column block (split_chain_cols): the same gradients bit for bit."""
    inputs, kw = make_case(B=2, T=330, K=128, V=128, gate="precomputed_weak", h0=True)
    do, dht = _do_dht(inputs, kw, 5)
    _, _, _, ws = emu.forward_stages(*inputs, **kw, bv=64)
    saved = (ws["Aqk"], ws["Akk"], ws["M"])
    runs = {c: emu.backward_stages(*inputs, do, dht, **kw, saved=saved, bv=64, split_chunks=1, chain_cols=c)
            for c in (8, 16, 32)}
    ref, _ = kda_bwd_reference(inputs, kw, do, dht)
    assert rel_rms(ref["dh0"], runs[8][0]["dh0"].reshape(ref["dh0"].shape)) <= KDA_TOL["dh0"]
    for c in (16, 32):
        assert_bitwise_same(runs[8][0], runs[c][0], f"chain columns {c}")
        # bit patterns: the split buffer's unwritten tail is NaN-guarded
        assert torch.equal(runs[8][1]["split_state"].view(torch.int32), runs[c][1]["split_state"].view(torch.int32)), c


def test_split_backward_in_batch_slices_is_bitwise_the_whole_batch(emu):
    """The split scans per batch slice (each slice's own pieces' map, in the one split buffer reused
    slice after slice) give exactly the gradients of the split backward over the whole batch."""
    inputs, kw = make_case(B=3, T=200, K=64, V=64, gate="precomputed_weak", h0=True)
    do, dht = _do_dht(inputs, kw, 13)
    _, _, _, ws = emu.forward_stages(*inputs, **kw, bv=64)
    saved = (ws["Aqk"], ws["Akk"], ws["M"])
    whole = emu.backward_stages(*inputs, do, dht, **kw, saved=saved, bv=64, split_chunks=1)[0]
    for nb in (1, 2):
        sliced = emu.backward_stages(*inputs, do, dht, **kw, saved=saved, bv=64, split_chunks=1, slice_b=nb)[0]
        assert_bitwise_same(whole, sliced, f"split, slices of {nb}")


@pytest.mark.parametrize("case", [dict(T=150, K=64, V=64, gate="bounded_weak"),
                                  dict(T=130, H=1, HV=2, K=128, V=128, gate="unbounded")], ids=["K64-weak", "gva-K128"])
def test_crossing_backward_from_the_extended_calls_factors(case, emu):
    """kda/_cp.py's KernelEngine, on the kernels: the context-parallel call of a document that began
    on an earlier rank runs over [v | 0] from [0 | I] and keeps the intra's factors and workspace;
    the rank's backward is then the ordinary call's over v from the incoming state S_in, reading
    them. Those bits are the ordinary forward's over v from S_in (none depends on the values or the
    initial state), the outputs compose (o = o(0) + Q S_in, S_out = E + Phi S_in), and that backward's
    gradients, dht = dE, are the ordinary call's (the fp64 reference)."""
    inputs, kw = make_case(**case)
    q, k, v, g, beta = inputs
    HV, V, K = v.shape[2], v.shape[3], q.shape[-1]
    gen = torch.Generator().manual_seed(11)
    S_in = 0.3 * torch.randn(1, HV, K, V, generator=gen)
    ext = dict(kw, initial_state=torch.cat([torch.zeros(1, HV, K, V), torch.eye(K).expand(1, HV, K, K)], -1))
    o_ext, ht_ext, _, ws_ext = emu.forward_stages(q, k, torch.cat([v, v.new_zeros(*v.shape[:-1], K)], -1), g, beta,
                                                  **ext)
    plain = dict(kw, initial_state=S_in)
    o, ht, _, ws = emu.forward_stages(*inputs, **plain)
    names = ("Aqk", "Akk", "M", "w", "qg", "kg", "gdecay")
    for n in names:
        view = torch.int32 if n == "gdecay" else torch.int16
        assert torch.equal(ws_ext[n].view(view), ws[n].view(view)), n
    # the same call with the identity columns virtual (KdaProblem::id_cols: no [v | 0], o(0) and Q into
    # tensors of their own, what KernelEngine runs): bitwise the [v | 0] call's outputs, state and workspace
    bits = lambda t: t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)  # noqa: E731
    for bv in [None] + [b for b in (64, 128) if V % b == 0 and K % b == 0]:  # a slice: all real or all virtual
        o0, ht_id, _, ws_id = emu.forward_stages(*inputs, **dict(kw, initial_state=None), identity_cols=True, bv=bv)
        assert torch.equal(bits(o0), bits(o_ext[..., :V])), ("o(0)", bv)
        assert torch.equal(bits(ws_id["o_id"]), bits(o_ext[..., V:])), ("Q", bv)
        assert torch.equal(bits(ht_id), bits(ht_ext)), ("[E | Phi]", bv)
        for n in names:
            assert torch.equal(bits(ws_id[n]), bits(ws_ext[n])), (n, bv)
    Q = o_ext[..., V:].double()
    composed = o_ext[..., :V].double() + torch.einsum("bthk,bhkv->bthv", Q, S_in.double())
    assert rel_rms(o.double(), composed) < KDA_TOL["o"]
    E, Phi = ht_ext[..., :V].double(), ht_ext[..., V:].double()
    assert rel_rms(ht.double(), E + Phi @ S_in.double()) < KDA_TOL["ht"]
    do, dE = _do_dht(inputs, kw, 5)
    grads, _ = emu.backward_stages(*inputs, do, dE, **plain, saved=tuple(ws_ext[n] for n in names[:3]),
                                   workspace={n: ws_ext[n] for n in names[3:]})
    ref, _ = kda_bwd_reference(inputs, plain, do, dE)
    bad = {}
    for key, tol in (("dq", KDA_TOL["dq"]), ("dk", KDA_TOL["dk"]), ("dv", KDA_TOL["dv"]), ("dg", KDA_TOL["dg"]),
                     ("dbeta", KDA_TOL["dbeta"]), ("dA_log", DA_LOG_TOL), ("ddt_bias", KDA_TOL["dbias"])):
        if ref.get(key) is not None:
            err = rel_rms(ref[key], grads[key].reshape(ref[key].shape))
            if not err <= tol:
                bad[key] = err
    assert not bad, f"off the fp64 reference: {bad}"
