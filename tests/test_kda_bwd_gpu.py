"""The KDA backward on our sm_90a kernels: every gradient of chunk_kda (dq, dk, dv, dg through every
gate form, dbeta through the sigmoid, dA_log, ddt_bias, dh0, the final state's gradient) against
autograd through the fp64 naive recurrence, over the contract's dense and varlen sets; each backward
kernel's stage against the explicit fp64 stage reference; NaN-poisoned outputs; bitwise
determinism; CUDA-graph capture and replay of a training step; torch.compile(fullgraph=True) of a
training step; parity with fla's gradients."""

from __future__ import annotations


import pytest
import torch

from kernel_fun import _ext
from kernel_fun.bench import accuracy as acc
from helpers import (DA_LOG_TOL, KDA_TOL, KDA_VARLEN_TOL, assert_bitwise_same, kda_bwd_reference, kda_reference,
                     rel_rms, run_gpu_script, run_serialised)
from test_kda_fwd_gpu import make_case, options

pytestmark = pytest.mark.gpu

STAGE_TOL = 0.01


def _kernel():
    from kernel_fun.kda import _kernel
    return _kernel


def _grads_through(fn, inputs, kw, do, dht):
    """Every gradient of loss = <o, do> + <ht, dht> through fn (chunk_kda's signature), by name."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    call = {n: x for n, x in kw.items() if x is not None}
    extra = {}
    for n in ("A_log", "dt_bias", "initial_state"):
        if call.get(n) is not None:
            call[n] = extra[n] = call[n].detach().clone().requires_grad_(True)
    o, ht = fn(*leaves, **call)
    loss = (o.float() * do.float()).sum()
    if dht is not None:
        loss = loss + (ht * dht).sum()
    grads = torch.autograd.grad(loss, leaves + list(extra.values()), allow_unused=True)
    out = dict(zip(["dq", "dk", "dv", "dg", "dbeta"], grads[:5]))
    for n, gr in zip(extra, grads[5:]):
        out[{"A_log": "dA_log", "dt_bias": "ddt_bias", "initial_state": "dh0"}[n]] = gr
    return out


def _grads_ours(inputs, kw, do, dht):
    """Gradients through the public chunk_kda, with our forward and backward counted as launched."""
    from kernel_fun.kda import chunk_kda
    before = _ext.op_calls()
    out = _grads_through(chunk_kda, inputs, kw, do, dht)
    after = _ext.op_calls()
    assert after["kda_fwd"] == before["kda_fwd"] + 1, "our forward did not run"
    assert after["kda_bwd"] == before["kda_bwd"] + 1, "our backward did not run"
    return out


def _grads_naive(inputs, kw, do, dht):
    """Autograd through the fp64 token-by-token recurrence (kernel_fun.ref.naive_recurrent_kda)."""
    from kernel_fun.ref.kda import naive_recurrent_kda
    leaves = [x.detach().double().requires_grad_(True) for x in inputs]
    rk = {n: kw.get(n) for n in ("scale", "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel",
                                 "allow_neg_eigval", "state_v_first", "cu_seqlens", "lower_bound")}
    rk = {n: x for n, x in rk.items() if x is not None}
    extra = {}
    use_gate = kw.get("use_gate_in_kernel", False)
    for n in ("A_log", "dt_bias", "initial_state"):
        if kw.get(n) is not None and (n == "initial_state" or use_gate):
            rk[n] = extra[n] = kw[n].detach().double().requires_grad_(True)
    o, ht = naive_recurrent_kda(*leaves, output_final_state=dht is not None, use_gate_in_kernel=use_gate, **rk)
    loss = (o * do.double()).sum()
    if dht is not None:
        loss = loss + (ht * dht.double()).sum()
    grads = torch.autograd.grad(loss, leaves + list(extra.values()), allow_unused=True)
    out = dict(zip(["dq", "dk", "dv", "dg", "dbeta"], grads[:5]))
    for n, gr in zip(extra, grads[5:]):
        out[{"A_log": "dA_log", "dt_bias": "ddt_bias", "initial_state": "dh0"}[n]] = gr
    return out


def _do_dht(inputs, kw, seed=11):
    q, v = inputs[0], inputs[2]
    B, T, HV, V = v.shape
    K = q.shape[-1]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    do = torch.randn(B, T, HV, V, device="cuda", generator=gen).to(q.dtype)
    dht = None
    if kw.get("output_final_state"):
        N = B if kw.get("cu_seqlens") is None else kw["cu_seqlens"].numel() - 1
        shape = (N, HV, V, K) if kw.get("state_v_first") else (N, HV, K, V)
        dht = torch.randn(*shape, device="cuda", generator=gen)
    return do, dht


CASES = {
    "T1-h0": dict(B=2, T=1, h0=True),
    "T63": dict(B=2, T=63, h0=True),
    "T130": dict(B=2, T=130),
    "T1000": dict(B=1, T=1000, h0=True),
    "K64-V64": dict(T=300, K=64, V=64, h0=True),
    "K64-V192": dict(T=200, K=64, V=192),
    "K128-V256": dict(T=300, V=256, h0=True),
    "K128-V512": dict(T=129, H=1, V=512, h0=True),
    "GVA-2-4": dict(T=333, H=2, HV=4, h0=True),
    "GVA-2-8-fp16": dict(T=200, H=2, HV=8, dtype=torch.float16),
    "bounded": dict(T=500, gate="bounded", h0=True),
    "bounded-noalog": dict(T=300, gate="bounded_noalog"),
    "precomputed-nol2": dict(T=400, gate="precomputed", l2norm=False, beta_sigmoid=False),
    "neg-eigval": dict(T=300, neg_eig=True, h0=True),
    "scale": dict(T=200, scale=0.3),
    "state-v-first": dict(T=300, h0=True, state_v_first=True),
    "g-bf16": dict(T=300, g_dtype=torch.bfloat16),
    "fp16": dict(T=500, dtype=torch.float16, h0=True),
    "extreme-unbounded16": dict(T=400, gate="unbounded16", h0=True),
    "extreme-bounded16": dict(T=400, gate="bounded16", h0=True),
    "extreme-1000": dict(T=400, gate="precomputed", extreme=0.5, h0=True),
    # weak decays: the far block pairs of a chunk weigh as much as the near ones (with the gates
    # above they are ~1e-15 of them, and a kernel that dropped them passed every case)
    "weak-decay": dict(T=300, gate="precomputed_weak", h0=True),
    "bounded-weak": dict(T=300, gate="bounded_weak", h0=True),
}
VARLEN_CASES = {
    "varlen-onetoken": dict(T=200, cu=[0, 1, 64, 65, 200], h0=True),
    "varlen-empty-int64": dict(T=300, cu=[0, 0, 100, 100, 300], cu_dtype=torch.int64, h0=True),
    "varlen-fla-gva": dict(T=2000, H=2, HV=4, cu=[0, 15, 100, 300, 1200, 2000], h0=True),
    "varlen-extreme-bounded": dict(T=1000, cu=[0, 256, 500, 1000], gate="bounded"),
    "varlen-extreme-1000": dict(T=1000, cu=[0, 256, 500, 1000], gate="precomputed", extreme=0.3),
}


def _check_against_naive(case, tol):
    inputs, kw = make_case(**case)
    do, dht = _do_dht(inputs, kw)
    ours = _grads_ours(inputs, kw, do, dht)
    ref = _grads_naive(inputs, kw, do, dht)
    bad = {}
    for key, r in ref.items():
        if r is None:
            continue
        got = ours[key]
        src = {"dA_log": kw.get("A_log"), "ddt_bias": kw.get("dt_bias"), "dh0": kw.get("initial_state")}.get(key)
        if src is None:
            src = inputs[["dq", "dk", "dv", "dg", "dbeta"].index(key)]
        assert got is not None and got.shape == r.shape and got.dtype == src.dtype, key
        assert torch.isfinite(got).all(), f"{key} has NaN/Inf"
        t = DA_LOG_TOL if key == "dA_log" else (KDA_TOL["dbias"] if key == "ddt_bias" else tol[key])
        err = rel_rms(r, got)
        if not err <= t:
            bad[key] = (err, t)
    assert not bad, f"gradients off the fp64 naive recurrence: {bad}"


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_match_fp64_naive(name):
    """Every gradient of the public chunk_kda (our forward and backward, their launches counted)
    against autograd through the fp64 naive recurrence. On real kernels this is the check of the
    autograd wiring (kernel_fun.kda._kernel's backward): dq and dk swapped there fail it (as they fail
    tests/test_kda_autograd_wiring.py on CPU, with faked ops); the emulator tests call the kernel ops
    directly and cannot see such a swap."""
    _check_against_naive(CASES[name], KDA_TOL)


@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_varlen_gradients_match_fp64_naive(name):
    _check_against_naive(VARLEN_CASES[name], KDA_VARLEN_TOL)


@pytest.mark.parametrize("name", ["T1000", "K128-V256", "GVA-2-4", "state-v-first", "fp16", "varlen-fla-gva"])
def test_gradients_with_the_rescan_match_fp64_naive(name, monkeypatch):
    """KERNEL_FUN_KDA_SAVE_STATES=0: the forward passes no state buffer on and the backward re-runs
    the scan into its own per-slice workspace. (By default the cases above, all with few scan chains,
    keep the forward's states for the streamed backward where they have a fixed length, and the
    varlen one re-scans into the forward's buffer: kda_policy.h's save_states_pays.)"""
    monkeypatch.setenv("KERNEL_FUN_KDA_SAVE_STATES", "0")
    case = {**CASES, **VARLEN_CASES}[name]
    _check_against_naive(case, KDA_VARLEN_TOL if name in VARLEN_CASES else KDA_TOL)


# enough scan chains that the backward would not pair its scans, so the forward's scan saves its
# states and the backward runs no re-scan (kda_policy.h's save_states_pays)
SAVED_STATES_CASES = {
    "B8-H16": dict(B=8, T=200, H=16, V=128, h0=True),
    "B4-H16-V256-fp16": dict(B=4, T=150, H=16, V=256, dtype=torch.float16, gate="bounded"),
    "varlen-H16": dict(T=2000, H=16, HV=16, cu=[0, 15, 100, 300, 1200, 2000], h0=True),
}


@pytest.mark.parametrize("name", list(SAVED_STATES_CASES))
def test_gradients_from_saved_states_match_fp64_naive(name):
    case = SAVED_STATES_CASES[name]
    launches = _kda_launches(case)
    assert launches.get("kda_fwd_scan_kernel") == 1 and "kda_bwd_scans_kernel" not in launches, launches
    _check_against_naive(case, KDA_VARLEN_TOL if "cu" in case else KDA_TOL)


@pytest.mark.parametrize("name", ["T1000", "varlen-fla-gva", "bounded", "fp16"])
def test_chunk_size_32_training_call_is_the_64_one(name):
    """fla's chunk_size=32 through a training call: our forward and backward run (counted) and every
    gradient is bit for bit the chunk_size=64 call's (our kernels chunk as they choose), within the
    fp64 recurrence's tolerance."""
    inputs, kw = make_case(**{**CASES, **VARLEN_CASES}[name])
    do, dht = _do_dht(inputs, kw)
    ours64 = _grads_ours(inputs, kw, do, dht)
    ours32 = _grads_ours(inputs, {**kw, "chunk_size": 32}, do, dht)
    assert_bitwise_same(ours64, ours32, name)
    ref = _grads_naive(inputs, kw, do, dht)
    for key in ("dq", "dk", "dv", "dg"):
        assert rel_rms(ref[key], ours32[key]) <= KDA_TOL[key], key


@pytest.mark.parametrize("g_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradients_with_g_one_element_off_16_bytes(g_dtype):
    """g a contiguous view one element into its storage: the front passes it on as it is, so the
    kernels' 8-wide g loads (gate prologue, gate backward) take their scalar path."""
    from kernel_fun.kda import chunk_kda
    inputs, kw = make_case(T=300, h0=True, g_dtype=g_dtype)
    do, dht = _do_dht(inputs, kw)
    ref = _grads_naive(inputs, kw, do, dht)
    q, k, v, g, beta = (x.detach().clone().requires_grad_(True) for x in inputs)
    buf = torch.zeros(g.numel() + 1, dtype=g.dtype, device=g.device)
    buf[1:].copy_(g.detach().reshape(-1))
    buf.requires_grad_(True)
    g_off = buf[1:].view(g.shape)
    assert g_off.is_contiguous() and g_off.data_ptr() % 16 != 0
    call = {n: x for n, x in kw.items() if x is not None}
    before = _ext.op_calls()
    o, ht = chunk_kda(q, k, v, g_off, beta, **call)
    loss = (o.float() * do.float()).sum() + (ht * dht).sum()
    dq, dk, dv, dbuf, dbeta = torch.autograd.grad(loss, [q, k, v, buf, beta])
    after = _ext.op_calls()
    assert after["kda_fwd"] == before["kda_fwd"] + 1 and after["kda_bwd"] == before["kda_bwd"] + 1
    got = dict(dq=dq, dk=dk, dv=dv, dg=dbuf[1:].view(g.shape), dbeta=dbeta)
    errs = {key: rel_rms(ref[key], t) for key, t in got.items()}
    assert all(errs[key] <= KDA_TOL[key] for key in errs), errs


# ------------------------------------------------------------------------------------------------
# each backward kernel's stage against the explicit fp64 stage reference (kernel_fun.ref.kda_bwd)
def _backward_stages(inputs, kw, do, dht, poison=False):
    q, k, v, g, beta = inputs
    return _kernel().backward_stages(
        q, k, v, g, beta, do, dht, opts=options(inputs, kw), initial_state=kw.get("initial_state"),
        cu_seqlens=kw.get("cu_seqlens"), A_log=kw.get("A_log") if kw.get("use_gate_in_kernel") else None,
        dt_bias=kw.get("dt_bias") if kw.get("use_gate_in_kernel") else None, poison=poison)


@pytest.mark.parametrize("name", ["T1000", "GVA-2-4", "K64-V192", "state-v-first", "extreme-1000", "fp16"])
def test_stages_match_fp64_stage_reference(name):
    inputs, kw = make_case(**CASES[name])
    do, dht = _do_dht(inputs, kw)
    grads, st = _backward_stages(inputs, kw, do, dht, poison=True)
    _, rst = kda_bwd_reference(inputs, kw, do, dht)
    q, v = inputs[0], inputs[2]
    B, T, HV, V = v.shape
    K = q.shape[-1]
    nck = rst["h"].shape[0] * rst["h"].shape[1]
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    scale = kw.get("scale") or K ** -0.5
    checks = {
        "M (forward intra, recomputed)": (flat(rst["M"]), st["M"]),
        "h_c (re-scan)": (rst["h"].reshape(nck, HV, K, V).transpose(-1, -2), st["h_ckpt"][:nck]),
        "dh_{c+1} (dh scan)": (rst["dh"].reshape(nck, HV, K, V).transpose(-1, -2), st["dh_ckpt"][:nck]),
        "dv (dh scan)": (rst["dv"], grads["dv"]),
        "scale dAqk (grads)": (flat(rst["dAqk"]) * scale, st["dA"]),
        "dL (grads)": (flat(rst["dL"]), st["dL"]),
    }
    if HV != q.shape[2]:  # GVA: d(normalised q / k) per value head, summed along the group's chain:
        G = HV // q.shape[2]  # value head r holds heads 0 .. r of its group; the last one has no rows
        for key in ("dq", "dk"):
            run = flat(rst[f"{key}_hat"]).unflatten(1, (-1, G)).cumsum(2)[:, :, :G - 1]
            checks[f"{key}^ running sums (grads)"] = (run, st[f"{key}hat"].unflatten(1, (-1, G - 1)))
    bad = {}
    for key, (r, got) in checks.items():
        assert torch.isfinite(got).all(), f"{key}: NaN/Inf (unwritten elements?)"
        err = rel_rms(r, got)
        if not err <= STAGE_TOL:
            bad[key] = err
    assert not bad, f"stages off the reference: {bad}"


@pytest.mark.parametrize("which", ["dq", "dk"])
def test_raw_backward_names_a_misaligned_dq_dk(which):
    """dq / dk rows are stored in 8-byte pieces (kda_bwd_grads; kda_bwd_group_sum with GVA), so an
    output starting off 16 bytes is refused by name rather than written misaligned; the aligned call
    runs."""
    from kernel_fun.kda._kernel import gate_params
    inputs, kw = make_case(T=70, H=1, HV=2, K=64, V=64)
    q, k, v, g, beta = inputs
    opts = options(inputs, kw)
    A, D = gate_params(opts, kw.get("A_log"), kw.get("dt_bias"))
    do = torch.randn_like(v)
    grads = {n: torch.empty_like(t) for n, t in (("dq", q), ("dk", k), ("dv", v), ("dg", g), ("dbeta", beta))}
    dA = torch.empty(A.shape, device="cuda") if A is not None else None
    dD = torch.empty(D.shape, device="cuda") if D is not None else None

    def call(out):
        torch.ops.kernel_fun.kda_bwd(q, k, v, g, beta, A, D, None, None, do, None, None, None, None, None, None,
                                     None, None, None, opts.encode(), out["dq"], out["dk"], out["dv"], out["dg"],
                                     out["dbeta"], dA, dD, None)

    bad = dict(grads)
    bad[which] = torch.empty(q.numel() + 4, dtype=q.dtype, device="cuda")[4:].view_as(q)  # 8 bytes off
    with pytest.raises((ValueError, RuntimeError), match=f"{which} must start 16-byte aligned"):
        call(bad)
    call(grads)
    torch.cuda.synchronize()
    assert torch.isfinite(grads["dq"]).all() and torch.isfinite(grads["dk"]).all()


def test_poisoned_outputs_are_all_written():
    """Every output starts as NaN (backward_stages(poison=True)) and comes back finite, equal to the
    unpoisoned run."""
    inputs, kw = make_case(T=500, H=2, HV=4, cu=[0, 1, 100, 100, 500], h0=True)
    do, dht = _do_dht(inputs, kw)
    a, _ = _backward_stages(inputs, kw, do, dht, poison=True)
    b, _ = _backward_stages(inputs, kw, do, dht, poison=False)
    assert_bitwise_same(b, a, "poisoned")


def test_bitwise_deterministic():
    inputs, kw = make_case(B=2, T=1000, H=2, HV=4, h0=True)
    do, dht = _do_dht(inputs, kw)
    a = _grads_ours(inputs, kw, do, dht)
    b = _grads_ours(inputs, kw, do, dht)
    for key, t in a.items():
        assert torch.equal(t, b[key]), key


@pytest.mark.parametrize("states", ["few-chains", "workspace", "saved"])
@pytest.mark.parametrize("slice_b", ["1", "3"])
def test_backward_in_batch_slices_is_bitwise_one_pass(slice_b, states, monkeypatch):
    """The backward run in batch slices (KERNEL_FUN_KDA_BWD_SLICE forces the slice; the scan width
    is pinned so both runs pick the same) gives exactly the gradients of one pass, dA_log, ddt_bias
    and dh0 (summed / written across slices) included. The states: saved by the forward's scan for
    the streamed backward ("few-chains": the one pass streams, the slices do not), re-scanned into
    per-slice workspace (KERNEL_FUN_KDA_SAVE_STATES=0), or saved by the forward's scan ("saved", 64
    chains per batch), each slice reading its own part."""
    monkeypatch.setenv("KERNEL_FUN_KDA_SCAN_BV", "64")
    if states == "workspace":
        monkeypatch.setenv("KERNEL_FUN_KDA_SAVE_STATES", "0")
    B = 4
    case = dict(B=B, T=300, H=2, HV=4, V=128, h0=True) if states != "saved" else \
        dict(B=B, T=130, H=16, HV=16, V=256, h0=True)
    inputs, kw = make_case(**case)
    do, dht = _do_dht(inputs, kw)
    monkeypatch.setenv("KERNEL_FUN_KDA_BWD_SLICE", str(B))
    # the path named: the forward's scan is the only state scan exactly when it saved the states
    launches = _kda_launches(case)
    rescans = launches.get("kda_fwd_scan_kernel", 0) - 1 + launches.get("kda_bwd_scans_kernel", 0)
    assert (rescans == 0) == (states != "workspace"), launches
    whole = _grads_ours(inputs, kw, do, dht)
    monkeypatch.setenv("KERNEL_FUN_KDA_BWD_SLICE", slice_b)
    sliced = _grads_ours(inputs, kw, do, dht)
    assert_bitwise_same(whole, sliced, f"slice of {slice_b}")


@pytest.mark.parametrize("name", ["T1000", "K128-V256", "varlen-fla-gva", "state-v-first"])
def test_paired_scans_are_bitwise_the_two_launches(name, monkeypatch):
    """The re-scan and the dh scan in one launch (kda_bwd_scans; kda_policy.h picks it when both fit
    in one wave, as at every size here) give exactly the gradients and checkpoints of two launches
    (KERNEL_FUN_KDA_BWD_PAIR_SCANS forces either)."""
    inputs, kw = make_case(**{**CASES, **VARLEN_CASES}[name])
    do, dht = _do_dht(inputs, kw)
    monkeypatch.setenv("KERNEL_FUN_KDA_BWD_PAIR_SCANS", "1")
    paired, sp = _backward_stages(inputs, kw, do, dht, poison=True)
    monkeypatch.setenv("KERNEL_FUN_KDA_BWD_PAIR_SCANS", "0")
    apart, sa = _backward_stages(inputs, kw, do, dht, poison=True)
    _, rst = kda_bwd_reference(inputs, kw, do, dht)
    nck = rst["h"].shape[0] * rst["h"].shape[1]  # the chunks that exist (the rest stays NaN)
    assert_bitwise_same({k: sa[k][:nck] for k in ("h_ckpt", "dh_ckpt")},
                        {k: sp[k][:nck] for k in ("h_ckpt", "dh_ckpt")}, "checkpoints")
    assert_bitwise_same(apart, paired, "gradients")


def _kda_launches(case: dict) -> dict:
    """{kernel name: launches} of the KDA kernels one training call of the case makes through the
    public chunk_kda (the production backward: its workspace sliced as kda_bwd_slice_batches picks;
    torch profiler)."""
    from torch.profiler import ProfilerActivity, profile
    inputs, kw = make_case(**case)
    do, dht = _do_dht(inputs, kw)
    _grads_ours(inputs, kw, do, dht)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _grads_ours(inputs, kw, do, dht)
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and "kda_" in e.key:
            # "void ns::name<args>(params)" or, not a template, "ns::name(ns::Params)"
            name = e.key.split("(")[0].split("<")[0].split("::")[-1].replace("void ", "")
            out[name] = out.get(name, 0) + e.count
    return out


def _bwd_kernels(case: dict) -> set:
    """Names of the KDA kernels one training call of the case launches (_kda_launches)."""
    return set(_kda_launches(case))


def test_saved_states_replace_the_rescan(monkeypatch):
    """Where the backward would not pair its scans, a training forward's scan keeps the state before
    every chunk and the backward runs no re-scan: kda_fwd_scan is launched once per training call
    (the forward's), and with KERNEL_FUN_KDA_SAVE_STATES=0 once more per batch slice (B16 T256 H16
    V256: 4 slices of 4 batches, the scans apart). With few chains (one sequence of 4 heads) it keeps
    them too, for the streamed backward (kda_policy.h's save_states_pays, bwd_stream_wanted)."""
    monkeypatch.delenv("KERNEL_FUN_KDA_BWD_PAIR_SCANS", raising=False)
    monkeypatch.delenv("KERNEL_FUN_KDA_BWD_SLICE", raising=False)
    monkeypatch.delenv("KERNEL_FUN_KDA_SAVE_STATES", raising=False)
    case = dict(B=16, T=256, H=16, V=256)
    saved = _kda_launches(case)
    few = _kda_launches(dict(B=1, T=300, H=4, V=128, h0=True))
    monkeypatch.setenv("KERNEL_FUN_KDA_SAVE_STATES", "0")
    rescan = _kda_launches(case)
    assert saved.get("kda_fwd_scan_kernel") == 1 and "kda_bwd_scans_kernel" not in saved, saved
    assert saved.get("kda_bwd_dh_scan_kernel") == 4, saved
    assert rescan.get("kda_fwd_scan_kernel") == 1 + rescan.get("kda_bwd_dh_scan_kernel", 0) == 5, rescan
    # few chains: the backward streams (kda_bwd_grads beside the dh scan), which needs the states too
    assert few.get("kda_fwd_scan_kernel") == 1 and few.get("kda_bwd_dh_scan_kernel") == 1, few
    assert "kda_bwd_scans_kernel" not in few, few


def test_saved_workspace_replaces_prep(monkeypatch):
    """A training forward keeps its intra's w, qg, kg and exp2(G), so the backward runs no
    kda_bwd_prep; KERNEL_FUN_KDA_SAVE_WORKSPACE=0 rebuilds them there (once per batch slice)."""
    monkeypatch.delenv("KERNEL_FUN_KDA_BWD_SLICE", raising=False)
    monkeypatch.delenv("KERNEL_FUN_KDA_SAVE_WORKSPACE", raising=False)
    case = dict(B=16, T=256, H=16, V=256)
    kept = _kda_launches(case)
    monkeypatch.setenv("KERNEL_FUN_KDA_SAVE_WORKSPACE", "0")
    rebuilt = _kda_launches(case)
    assert "kda_bwd_prep_kernel" not in kept, kept
    assert rebuilt.get("kda_bwd_prep_kernel") == 4, rebuilt


@pytest.mark.parametrize("name", ["T1000", "GVA-2-4", "fp16", "varlen-fla-gva"])
def test_gradients_with_prep_match_fp64_naive(name, monkeypatch):
    """KERNEL_FUN_KDA_SAVE_WORKSPACE=0: kda_bwd_prep rebuilds w, qg, kg and exp2(G) from the saved
    factors (the path every test above skips by default)."""
    monkeypatch.setenv("KERNEL_FUN_KDA_SAVE_WORKSPACE", "0")
    case = {**CASES, **VARLEN_CASES}[name]
    _check_against_naive(case, KDA_VARLEN_TOL if name in VARLEN_CASES else KDA_TOL)


def test_backward_pairs_its_scans_only_when_both_fit_one_wave(monkeypatch):
    """kda_policy.h's bwd_pair_scans as launched: one sequence of 4 heads (8 scan CTAs at V = 128)
    runs kda_bwd_scans; 16 x 16 sequence-heads at V = 256 (128 CTAs per scan after the 4-batch
    slicing) run the two scans apart. (Where the forward saves no states: KERNEL_FUN_KDA_SAVE_STATES=0.)"""
    monkeypatch.delenv("KERNEL_FUN_KDA_BWD_PAIR_SCANS", raising=False)
    monkeypatch.setenv("KERNEL_FUN_KDA_SAVE_STATES", "0")
    small = _bwd_kernels(dict(B=1, T=300, H=4, V=128, h0=True))
    assert "kda_bwd_scans_kernel" in small and "kda_bwd_dh_scan_kernel" not in small, small
    big = _bwd_kernels(dict(B=16, T=256, H=16, V=256))
    assert "kda_bwd_scans_kernel" not in big and "kda_bwd_dh_scan_kernel" in big, big


def _bwd_workspace_bytes(B, T, HV, K, V, slice_b, saved):
    """kda::workspace() of a fixed-length backward with saved factors and an in-kernel gate, with
    slice_b batches per slice: w, qg, kg, exp2(G) and h_ckpt (unless the forward saved them: saved),
    dh_ckpt per slice; pbias, pA whole."""
    nts = -(-T // 64)
    rows, c = slice_b * T, slice_b * nts
    per_slice = c * HV * V * K * 2 if saved else 3 * rows * HV * K * 2 + c * HV * K * 4 + 2 * c * HV * V * K * 2
    return per_slice + B * nts * HV * (K + 1) * 4 + (B + 1) * 4


@pytest.mark.parametrize("states", ["", "0"], ids=["saved", "rebuilt"])
def test_backward_memory_is_gradients_plus_one_slice_of_workspace(states, monkeypatch):
    """Peak memory of the backward (from after the forward to the gradients): the gradients plus the
    workspace of one batch slice, nothing else: no zero-filled gradients of the outputs the loss does
    not use (the saved factors, 3 x 32 MiB here), no whole-batch checkpoints (B16 T1024 H16 K128
    V256: 512 scan CTAs, so the launcher runs 4 slices of 4 batches; whole-batch workspace 704 MiB).
    With the forward's saved states and workspace (held since the forward, so before the baseline)
    no per-slice h_ckpt, w, qg, kg or exp2(G) either."""
    for knob in ("KERNEL_FUN_KDA_SAVE_STATES", "KERNEL_FUN_KDA_SAVE_WORKSPACE"):
        if states:
            monkeypatch.setenv(knob, states)
        else:  # the default
            monkeypatch.delenv(knob, raising=False)
    B, T, H, K, V = 16, 1024, 16, 128, 256
    inputs, kw = make_case(B=B, T=T, H=H, V=V, final=False)
    leaves = [x.detach().clone().to(torch.bfloat16).requires_grad_(True) for x in inputs]
    call = {n: x for n, x in kw.items() if x is not None}
    from kernel_fun.kda import chunk_kda
    o, _ = chunk_kda(*leaves, **call)
    do = torch.randn_like(o)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    before = _ext.op_calls()["kda_bwd"]
    o.backward(do)
    torch.cuda.synchronize()
    assert _ext.op_calls()["kda_bwd"] == before + 1
    peak = torch.cuda.max_memory_allocated() - base
    grads = sum(x.numel() * x.element_size() for x in leaves)  # same shapes and dtypes as the inputs
    bound = grads + _bwd_workspace_bytes(B, T, H, K, V, 4, states == "") + (16 << 20)  # allocator rounding
    assert peak <= bound, f"backward peak {peak / 2**20:.0f} MiB > {bound / 2**20:.0f} MiB"


def test_extreme_gates_give_finite_gradients():
    """Per-step gates of -1000 on 90% of the entries and exp(A_log) = 16: finite and within tolerance."""
    for case in (dict(T=300, gate="precomputed", extreme=0.9, h0=True, dtype=torch.float16),
                 dict(T=300, gate="unbounded16", h0=True)):
        _check_against_naive(case, KDA_TOL)


def test_cuda_graph_capture_and_replay_of_a_training_step():
    from kernel_fun.kda import chunk_kda
    inputs, kw = make_case(B=2, T=300, H=2, HV=4, h0=True)
    call = {n: x for n, x in kw.items() if x is not None}
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    do, dht = _do_dht(inputs, kw)

    def step():
        o, ht = chunk_kda(*leaves, **call)
        loss = (o.float() * do.float()).sum() + (ht * dht).sum()
        return torch.autograd.grad(loss, leaves)

    eager = [t.clone() for t in step()]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on a side stream, as torch.cuda.graphs asks
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for t in static:
        t.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for e, r in zip(eager, static):
        assert torch.equal(e, r)
    # new inputs copied into the captured buffers: the replay follows them
    with torch.no_grad():
        leaves[0].copy_(leaves[0] * 0.5)
    graph.replay()
    fresh = step()
    torch.cuda.synchronize()
    for e, r in zip(fresh, static):
        assert torch.equal(e, r)


def test_compile_fullgraph_training_step_runs_our_kernels():
    from kernel_fun.kda import chunk_kda
    inputs, kw = make_case(B=2, T=200, H=2, HV=2)
    call = {n: x for n, x in kw.items() if x is not None and n != "output_final_state"}
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    do, _ = _do_dht(inputs, kw)

    def step(q, k, v, g, beta):
        o, _ = chunk_kda(q, k, v, g, beta, **call)
        return (o.float() * do.float()).sum(), o

    eager_loss, eager_o = step(*leaves)
    eager = torch.autograd.grad(eager_loss, leaves)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)  # a graph break raises
    before = _ext.op_calls()
    loss, o = compiled(*leaves)
    grads = torch.autograd.grad(loss, leaves)
    after = _ext.op_calls()
    assert after["kda_fwd"] > before["kda_fwd"], "the compiled graph did not run our forward"
    assert after["kda_bwd"] > before["kda_bwd"], "the compiled graph did not run our backward"
    # Our kernels' results bitwise the eager call's; the loss only to rounding: inductor's fused
    # multiply-and-sum adds the 10^5 products in another order than eager's sum, and whether the two
    # round to the same float depends on o's last bits (on an H100, with gate-fold.patch's o, inductor's
    # sum of the eager o itself was 1 ulp from eager's: scripts/dev/compile_diff_gpu.py,
    # docs/notes/2026-12-06-gate-fold.md, section 5).
    assert torch.equal(o, eager_o)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=0)
    for e, c in zip(eager, grads):
        assert torch.equal(e, c)


# Over the bound on this test's one input (T = 500: the chunk kernels, not the one-chunk recurrence that
# closed the accuracy matrix's last open cases), measured on the H200 (2026-12-03, e8123b9). dA_log has one value per
# head (two here), so its rel-RMS is one draw of a heavy-tailed error: on six CPU draws of this case
# through scripts/dev/dalog_floor.py's rounding model, ours (with the last-chunk fix) has the median
# 3.6e-3 and fla 3.6e-3, maxima 9.2e-3 / 2.4e-2. Strict: a pass fails the run, so the mark stays true.
PARITY_OPEN = {
    "bounded": "dA_log 2.27e-2 against fla's 1.45e-2 (bound 1.81e-2) on this input; CPU draws: median ours 3.6e-3, fla 3.6e-3",
}


@pytest.mark.fla
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=f"open: {PARITY_OPEN[n]}")) if n in PARITY_OPEN else n
    for n in ["T1000", "bounded", "GVA-2-4", "extreme-unbounded16"]])
def test_gradient_parity_with_fla(name, monkeypatch):
    """Every gradient of ours within fla's tolerance of the fp64 naive recurrence, or at most 2x
    fla's own error on the same inputs (fla 0.5.2's Triton backward, FLA_TILELANG=0)."""
    monkeypatch.setenv("FLA_TILELANG", "0")
    from fla.ops.kda import chunk_kda as fla_chunk_kda
    inputs, kw = make_case(**CASES[name])
    do, dht = _do_dht(inputs, kw)
    ours = _grads_ours(inputs, kw, do, dht)
    ref = _grads_naive(inputs, kw, do, dht)
    fla = _grads_through(fla_chunk_kda, inputs, kw, do, dht)
    report = {}
    for key, r in ref.items():
        if r is None or fla.get(key) is None:
            continue
        e_ours, e_fla = rel_rms(r, ours[key]), rel_rms(r, fla[key])
        report[key] = (round(e_ours, 5), round(e_fla, 5))
        # the bound (kernel_fun.bench.accuracy): fla's tolerance, or 1.25 x fla's own error
        b = max(acc.FLA_TOL[key], acc.FLA_FACTOR * e_fla)
        assert e_ours <= b, f"{key}: ours {e_ours:.3e}, fla {e_fla:.3e} ({report})"
    print(f"{name} rel-RMS (ours, fla): {report}")


# The split scans (csrc/kda/fwd/kda_fwd_split.cuh; the model's choice by default, forced here): the
# forward's scan, the backward's re-scan and its dh scan in pieces of L chunks. Weak decays, so a
# wrong map or chain reaches the gradients.
SPLIT_CASES = {
    "T3000-h0-L4": dict(T=3000, gate="precomputed_weak", h0=True, L=4),
    "varlen-empty-onetoken-L2": dict(T=2000, cu=[0, 0, 1, 65, 700, 2000], gate="bounded_weak", h0=True, L=2),
    "gva-vfirst-fp16-L3": dict(T=1500, H=1, HV=2, dtype=torch.float16, gate="precomputed_weak", state_v_first=True,
                               h0=True, L=3),
    "B2-K64-V64-unbounded-L1": dict(B=2, T=700, K=64, V=64, h0=True, L=1),
    "H20-chain32-L2": dict(T=1000, H=20, gate="precomputed_weak", h0=True, L=2),  # the chain's 32 columns
}


@pytest.mark.parametrize("states", ["saved", "rescan"])
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_split_scans_gradients_match_fp64_naive(name, states, monkeypatch):
    """Every gradient of a training call whose scans are split (the launches counted by the
    profiler: pass 1 of both scans, both chains) against autograd through the fp64 naive recurrence.
    states: "saved", the split forward keeps its states and the backward runs no re-scan (the
    forward's pass 1 runs once); "rescan", without the buffer (KERNEL_FUN_KDA_SAVE_STATES=0) the
    backward re-runs the split scan (twice)."""
    case = dict(SPLIT_CASES[name])
    L = case.pop("L")
    monkeypatch.setenv("KERNEL_FUN_KDA_SPLIT", "1")
    monkeypatch.setenv("KERNEL_FUN_KDA_SPLIT_CHUNKS", str(L))
    if states == "rescan":
        monkeypatch.setenv("KERNEL_FUN_KDA_SAVE_STATES", "0")
    launches = _kda_launches(case)
    for kern in ("kda_split_map_kernel", "kda_fwd_scan_local_kernel", "kda_bwd_dh_scan_local_kernel",
                 "kda_split_chain_kernel"):
        assert launches.get(kern, 0) >= 1, (kern, launches)
    assert "kda_bwd_scans_kernel" not in launches, launches
    n_local = launches["kda_fwd_scan_local_kernel"]  # the backward's re-scan: once per batch slice
    assert n_local == 1 if states == "saved" else n_local >= 2, (states, launches)
    _check_against_naive(case, KDA_VARLEN_TOL if "cu" in case else KDA_TOL)


# The launch switches that decide what a training forward leaves its backward (the split scans' saved
# states, the token recurrence's missing chunk factors) travel in the options the backward gets from
# its forward: a switch changed between the forward and the backward must not change the backward's
# path (it would read states or factors its forward never wrote).
SWITCH_CASES = {
    "recurrent-default-then-0": ("KERNEL_FUN_KDA_RECURRENT", None, "0", dict(T=64, gate="bounded", h0=True)),
    "recurrent-0-then-default": ("KERNEL_FUN_KDA_RECURRENT", "0", None, dict(T=64, gate="bounded", h0=True)),
    "split-1-then-0": ("KERNEL_FUN_KDA_SPLIT", "1", "0", dict(T=3000, gate="precomputed_weak", h0=True)),
    "split-0-then-1": ("KERNEL_FUN_KDA_SPLIT", "0", "1", dict(T=3000, gate="precomputed_weak", h0=True)),
}


# The streamed backward (kda_policy.h's bwd_stream_wanted): kda_bwd_grads beside the dh scan, its CTAs in
# the order the dh scan stores the checkpoints, each waiting for its chunk's count. Few chains, so that
# the model streams them too.
STREAMED_BWD_CASES = {
    "bounded16-T4096-H4": dict(T=4096, H=4, V=128, gate="bounded16", h0=True),  # the bounded-gate kernel
    "unbounded-B2-T2000-dht": dict(B=2, T=2000, H=2, V=128, h0=True),  # + kda_bwd_grads_last_kernel beside it
    "fp16-K64-V256": dict(T=3000, H=2, K=64, V=256, dtype=torch.float16),
    "gva-vfirst": dict(T=1500, H=1, HV=2, V=128, h0=True, state_v_first=True),
    # classes streamed since the thirty-ninth session: 128 chains at 64 columns, 64 at the 128 the dh
    # scan streams at; and the most bwd_stream_possible allows, 128 chains at 128 (gva's)
    "B4-H16-64-chains-at-128": dict(B=4, T=1100, H=16, V=128),
    "gva-B8-128-chains-at-128": dict(B=8, T=700, H=8, HV=16, V=128),
    # since the fortieth session: V not a multiple of 128 (the dh scan at 64 columns) up to 116 chains
    "V64-B7-112-chains-at-64": dict(B=7, T=700, H=16, V=64),
}


@pytest.mark.parametrize("name", list(STREAMED_BWD_CASES))
def test_streamed_backward_is_bitwise_the_plain_one(name, monkeypatch):
    """KERNEL_FUN_KDA_BWD_STREAMED unset (the model streams these shapes, with the split scans off):
    every gradient bit for bit as with KERNEL_FUN_KDA_BWD_STREAMED=0, over 3 training calls (a checkpoint read before the dh
    scan stored it would show in some call); the kda_bwd_streamed counter proves which ran."""
    from kernel_fun.kda import chunk_kda

    inputs, kw = make_case(**STREAMED_BWD_CASES[name])
    do, dht = _do_dht(inputs, kw)
    monkeypatch.setenv("KERNEL_FUN_KDA_SPLIT", "0")  # (the split scans' model would take these few chains)

    def grads(streamed: bool):
        (monkeypatch.delenv("KERNEL_FUN_KDA_BWD_STREAMED", raising=False) if streamed
         else monkeypatch.setenv("KERNEL_FUN_KDA_BWD_STREAMED", "0"))
        before = _ext.op_calls()
        out = _grads_through(chunk_kda, inputs, kw, do, dht)
        after = _ext.op_calls()
        assert after["kda_bwd"] == before["kda_bwd"] + 1, "our backward did not run"
        assert after["kda_bwd_streamed"] == before["kda_bwd_streamed"] + int(streamed), (name, streamed)
        return out

    plain = grads(False)
    for _ in range(3):
        assert_bitwise_same(plain, grads(True), name)
    ref = _grads_naive(inputs, kw, do, dht)
    assert rel_rms(ref["dk"], plain["dk"]) <= KDA_TOL["dk"]


@pytest.mark.parametrize("case, slice_b", [
    (dict(B=3, T=1100, H=4, V=128, h0=True), 2),           # an uneven last slice, dht (grads_last beside)
    (dict(B=4, T=700, H=8, V=64, gate="bounded16"), 1),    # the bounded-gate kernel, the dh scan at 64
])
def test_streamed_backward_in_slices_is_bitwise_the_plain_one(case, slice_b, monkeypatch):
    """A backward in batch slices (KERNEL_FUN_KDA_BWD_SLICE, as the policy slices prod8192 or
    bounded_b16) streams slice by slice (KERNEL_FUN_KDA_BWD_STREAMED=2: the policy streams the
    bounded-gate kernel only up to 116 chains): every gradient bit for bit as with =0 and the same
    slices, over 3 training calls; counted as streamed."""
    from kernel_fun.kda import chunk_kda

    inputs, kw = make_case(**case)
    do, dht = _do_dht(inputs, kw)
    monkeypatch.setenv("KERNEL_FUN_KDA_SPLIT", "0")
    monkeypatch.setenv("KERNEL_FUN_KDA_BWD_SLICE", str(slice_b))

    def grads(streamed: bool):
        monkeypatch.setenv("KERNEL_FUN_KDA_BWD_STREAMED", "2" if streamed else "0")
        before = _ext.op_calls()
        out = _grads_through(chunk_kda, inputs, kw, do, dht)
        after = _ext.op_calls()
        assert after["kda_bwd"] == before["kda_bwd"] + 1, "our backward did not run"
        assert after["kda_bwd_streamed"] == before["kda_bwd_streamed"] + int(streamed), streamed
        return out

    plain = grads(False)
    for _ in range(3):
        assert_bitwise_same(plain, grads(True), f"slices of {slice_b}")
    ref = _grads_naive(inputs, kw, do, dht)
    assert rel_rms(ref["dk"], plain["dk"]) <= KDA_TOL["dk"]


def test_streamed_backward_with_launches_serialised(tmp_path):
    """CUDA_LAUNCH_BLOCKING=1 (a subprocess): the dh scan ends before kda_bwd_grads starts, every count
    already final; the same bits as the plain backward, and no hang (bounded by the timeout)."""
    run_serialised(_SERIALISED_BWD, tmp_path, "serialised backward: same bits, streamed", timeout=180)


_SERIALISED_BWD = r"""
import os, sys, torch
sys.path.insert(0, os.path.join(os.environ["KF_ROOT"], "tests"))
import test_kda_bwd_gpu as t
from kernel_fun import _ext
from kernel_fun.kda import chunk_kda
inputs, kw = t.make_case(T=2048, H=4, V=128, gate="bounded16", h0=True)
do, dht = t._do_dht(inputs, kw)
os.environ["KERNEL_FUN_KDA_BWD_STREAMED"] = "0"
plain = t._grads_through(chunk_kda, inputs, kw, do, dht)
os.environ.pop("KERNEL_FUN_KDA_BWD_STREAMED")
n0 = _ext.op_calls()["kda_bwd_streamed"]
streamed = t._grads_through(chunk_kda, inputs, kw, do, dht)
assert _ext.op_calls()["kda_bwd_streamed"] == n0 + 1, "did not stream"
t.assert_bitwise_same(plain, streamed, "serialised")
print("serialised backward: same bits, streamed")
"""


def test_streamed_backward_with_a_last_row_wider_than_the_gpu(tmp_path):
    """The streamed backward forced (KERNEL_FUN_KDA_BWD_STREAMED=2) on 256 chains (B1 H256 K = V = 64,
    the most bwd_stream_possible allows, final-state gradient: kda_bwd_grads_last_kernel runs first):
    the main grads kernel's last chunk row has 256 CTAs, more than the GPU has SMs, and thread 0 of
    each waits for the previous kernel (grads_stream_end), as does the last-chunk kernel's last CTA.
    In a subprocess, so that a hang fails the test at its timeout: the call ends, is counted as
    streamed, gives the plain backward's bits, and dq / dk / dv match the fp64 recurrence."""
    run_gpu_script(_WIDE_ROW_BWD, tmp_path, "wide last row: same bits, streamed", timeout=240)


_WIDE_ROW_BWD = r"""
import os, sys, torch
sys.path.insert(0, os.path.join(os.environ["KF_ROOT"], "tests"))
import test_kda_bwd_gpu as t
from kernel_fun import _ext
from kernel_fun.kda import chunk_kda
inputs, kw = t.make_case(B=1, T=200, H=256, K=64, V=64, h0=True)
do, dht = t._do_dht(inputs, kw)
assert dht is not None
os.environ["KERNEL_FUN_KDA_BWD_STREAMED"] = "0"
plain = t._grads_through(chunk_kda, inputs, kw, do, dht)
os.environ["KERNEL_FUN_KDA_BWD_STREAMED"] = "2"
for _ in range(2):
    n0 = _ext.op_calls()["kda_bwd_streamed"]
    streamed = t._grads_through(chunk_kda, inputs, kw, do, dht)
    assert _ext.op_calls()["kda_bwd_streamed"] == n0 + 1, "did not stream"
    t.assert_bitwise_same(plain, streamed, "wide last row")
ref = t._grads_naive(inputs, kw, do, dht)
for name in ("dq", "dk", "dv"):
    assert t.rel_rms(ref[name], plain[name]) <= t.KDA_TOL[name], name
print("wide last row: same bits, streamed")
"""


# cu_seqlens of documents of one length: chunk_kda runs the fixed-length batch (kernel_fun.kda's
# _documents). One long document with few heads: the fixed-length policy streams its backward,
# which a varlen call never does, so the counter tells which path ran.
EQUAL_DOCS_CASES = {
    "one-doc": dict(T=4096, H=4, V=128, cu=[0, 4096], gate="bounded16", h0=True),
    "four-docs-gva": dict(T=1200, H=2, HV=4, cu=[0, 300, 600, 900, 1200], h0=True),
}


@pytest.mark.parametrize("name", list(EQUAL_DOCS_CASES))
def test_equal_documents_run_as_the_fixed_length_batch(name, monkeypatch):
    """o, the final state and every gradient of the packed call are bit for bit those of the call on
    the [N, L] batch without cu_seqlens; KERNEL_FUN_KDA_VARLEN_AS_BATCH=0 keeps the varlen path (for
    one document: no streamed backward), and both are within the fp64 recurrence's tolerance."""
    from kernel_fun.kda import chunk_kda

    monkeypatch.setenv("KERNEL_FUN_KDA_SPLIT", "0")  # (the split scans' model would take one document)
    case = EQUAL_DOCS_CASES[name]
    inputs, kw = make_case(**case)
    do, dht = _do_dht(inputs, kw)
    N = len(case["cu"]) - 1
    L = case["T"] // N
    as_batch = lambda t: t[0].unflatten(0, (N, L))  # noqa: E731
    batch = [as_batch(x) for x in inputs]
    kw_b = {**kw, "cu_seqlens": None}

    def run(inp, kw_, do_, varlen_switch=None):
        (monkeypatch.setenv("KERNEL_FUN_KDA_VARLEN_AS_BATCH", varlen_switch) if varlen_switch
         else monkeypatch.delenv("KERNEL_FUN_KDA_VARLEN_AS_BATCH", raising=False))
        with torch.no_grad():
            o, ht = chunk_kda(*inp, **{n: x for n, x in kw_.items() if x is not None})
        before = _ext.op_calls()
        grads = _grads_through(chunk_kda, inp, kw_, do_, dht)
        streamed = _ext.op_calls()["kda_bwd_streamed"] - before["kda_bwd_streamed"]
        return o, ht, grads, streamed

    o, ht, grads, streamed = run(inputs, kw, do)
    o_b, ht_b, grads_b, streamed_b = run(batch, kw_b, as_batch(do))
    assert torch.equal(o, o_b.flatten(0, 1).unsqueeze(0)) and (ht is None or torch.equal(ht, ht_b))
    per_token = ("dq", "dk", "dv", "dg", "dbeta")  # [N, L, ...] in the batch: packed as [1, T, ...]
    assert_bitwise_same({n: t.flatten(0, 1).unsqueeze(0) if n in per_token else t for n, t in grads_b.items()},
                        grads, name)
    assert streamed == streamed_b
    o_v, _, grads_v, streamed_v = run(inputs, kw, do, "0")
    if N == 1:
        assert (streamed, streamed_v) == (1, 0), (streamed, streamed_v)
    o_ref, _ = kda_reference(inputs, kw)
    ref = _grads_naive(inputs, kw, do, dht)
    for out_o, out_g in ((o, grads), (o_v, grads_v)):
        assert rel_rms(o_ref, out_o) <= KDA_TOL["o"]
        for key in per_token:
            assert rel_rms(ref[key], out_g[key]) <= KDA_TOL[key], key


@pytest.mark.parametrize("name", list(SWITCH_CASES))
def test_the_backward_takes_its_forwards_path(name, monkeypatch):
    """Every gradient bitwise the same whether or not the switch changes after the forward."""
    from kernel_fun.kda import chunk_kda

    switch, before, after, shape = SWITCH_CASES[name]
    inputs, kw = make_case(**shape)

    def grads(change: bool):
        (monkeypatch.setenv(switch, before) if before is not None else monkeypatch.delenv(switch, raising=False))
        leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        h0 = kw["initial_state"].detach().clone().requires_grad_(True)
        call = {n: x for n, x in kw.items() if x is not None and n != "initial_state"}
        o, ht = chunk_kda(*leaves, initial_state=h0, **call)
        if change:
            (monkeypatch.setenv(switch, after) if after is not None else monkeypatch.delenv(switch, raising=False))
        (o.float().square().sum() + ht.square().sum()).backward()
        return [x.grad for x in leaves if x.grad is not None] + [h0.grad]

    same, changed = grads(False), grads(True)
    assert len(same) == len(changed) == 6  # dq, dk, dv, dg, dbeta, dh0
    for i, (a, b) in enumerate(zip(same, changed)):
        assert torch.equal(a, b), (name, i)


@pytest.mark.parametrize("name", ["T1000", "T63", "K64-V192", "GVA-2-8-fp16", "bounded"])
def test_identity_columns_are_the_zero_padded_call(name):
    """The raw forward with identity columns (o_id: KdaProblem::id_cols, what KernelEngine runs for
    the context-parallel document that began on an earlier rank) is bitwise the call over [v | 0]
    from [0 | I] it replaces: o(0), Q, the final state [E | Phi] and every buffer it keeps for the
    backward; and o(0) + Q S_in, E + Phi S_in are the ordinary call's from S_in (the fp64 reference).
    The identity columns always take the chunk kernels, so the [v | 0] call is kept off the token
    recurrence for the bitwise part (T63: one-chunk sequences)."""
    import dataclasses

    from kernel_fun.kda._cp import KernelEngine, _zero_columns

    inputs, kw = make_case(**dict(CASES[name], h0=False))
    q, k, v, g, beta = inputs
    B, K, HV, V = q.shape[0], q.shape[-1], v.shape[2], v.shape[3]
    eng = KernelEngine(options(inputs, kw).encode())
    part = (q, k, v, g, beta, *eng.gate(kw.get("A_log"), kw.get("dt_bias")))
    eye = torch.eye(K, device="cuda").expand(B, HV, K, K)
    init = torch.cat([eye.new_zeros(B, HV, K, V), eye], -1).contiguous()
    chunked = KernelEngine(dataclasses.replace(options(inputs, kw), recurrent=0).encode())
    o_ext, ht_ext, kept_ext = chunked.run(part, _zero_columns(v, K), init, True, True)
    before = _ext.op_calls()
    o0, Q, ht, kept = eng.run_identity(part, True)
    assert _ext.op_calls()["kda_fwd"] == before["kda_fwd"] + 1
    assert o0.is_contiguous() and Q.is_contiguous() and Q.shape == v.shape[:-1] + (K,)
    bits = lambda t: t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)  # noqa: E731
    assert torch.equal(bits(o0), bits(o_ext[..., :V])), "o(0)"
    assert torch.equal(bits(Q), bits(o_ext[..., V:])), "Q"
    assert torch.equal(bits(ht), bits(ht_ext)), "[E | Phi]"
    for i, (a, b) in enumerate(zip(kept, kept_ext)):
        assert torch.equal(bits(a), bits(b)), ("kept", i)
    gen = torch.Generator(device="cuda").manual_seed(7)
    S_in = 0.3 * torch.randn(B, HV, K, V, device="cuda", generator=gen)
    o_ref, ht_ref = kda_reference(inputs, dict(kw, initial_state=S_in, output_final_state=True))[:2]
    o = o0.double() + torch.einsum("bthk,bhkv->bthv", Q.double(), S_in.double())
    assert rel_rms(o_ref, o) < KDA_TOL["o"]
    assert rel_rms(ht_ref, ht[..., :V].double() + ht[..., V:].double() @ S_in.double()) < KDA_TOL["ht"]


def test_identity_columns_refuse_what_they_do_not_serve():
    """o_id's checks name the argument: no initial state, its shape and dtype, V + K within 512."""
    inputs, kw = make_case(**dict(CASES["T130"], h0=False))
    q, k, v, g, beta = inputs
    B, T, HV, V = v.shape
    K = q.shape[-1]
    A, D = _kernel().gate_params(options(inputs, kw), kw.get("A_log"), kw.get("dt_bias"))
    enc = options(inputs, kw).encode()

    def call(o_id, h0=None, vv=v):
        o = q.new_empty(B, T, HV, vv.shape[-1])
        _ext.ops().kda_fwd(q, k, vv, g, beta, A, D, h0, None, enc, o, None, None, None, None, None, None, None, None,
                           None, None, o_id)

    with pytest.raises(ValueError, match="o_id .*initial_state None"):
        call(q.new_empty(B, T, HV, K), h0=torch.zeros(B, HV, K, V, device="cuda"))
    with pytest.raises(ValueError, match=r"o_id must have shape \[.*\], got \["):
        call(q.new_empty(B, T, HV, K + 8))
    with pytest.raises(ValueError, match="o_id must be .*, got "):
        call(q.new_empty(B, T, HV, K, dtype=torch.float32))
    wide = torch.zeros(B, T, HV, 512, dtype=v.dtype, device="cuda")
    with pytest.raises(ValueError, match="o_id needs V \\+ K <= 512"):
        call(q.new_empty(B, T, HV, K), vv=wide)


@pytest.mark.parametrize("name", ["T1000", "GVA-2-4", "bounded", "K128-V512"])
def test_crossing_call_backward_from_the_kept_factors(name):
    """kda/_cp.py's KernelEngine on our raw ops, the context-parallel path's document that began on an
    earlier rank: the forward over [v | 0] from [0 | I] keeps its factors and workspace (two calls for
    V + K > 512: K128-V512), and the backward is the ordinary call's over v from S_in reading them. Its
    gradients (o(0) seeded with do, E with dE) are the ordinary call's from S_in against the fp64
    naive recurrence, with our forward twice and our backward once counted."""
    from kernel_fun.kda._cp import KernelEngine, _Crossing

    inputs, kw = make_case(**dict(CASES[name], h0=False))
    q, k, v, g, beta = inputs
    K, HV, V = q.shape[-1], v.shape[2], v.shape[3]
    gen = torch.Generator(device="cuda").manual_seed(5)
    S_in = 0.3 * torch.randn(1, HV, K, V, device="cuda", generator=gen)
    eng = KernelEngine(options(inputs, kw).encode())
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    extra = {n: kw[n].detach().clone().requires_grad_(True) for n in ("A_log", "dt_bias") if kw.get(n) is not None}
    before = _ext.op_calls()
    o0, Q, E, Phi = _Crossing.apply(eng, {"S_in": S_in[0]}, K, True, *leaves,
                                    *eng.gate(extra.get("A_log"), extra.get("dt_bias")))
    assert not Q.requires_grad and not Phi.requires_grad
    do, dE = _do_dht(inputs, kw)
    grads = torch.autograd.grad([o0, E], leaves + list(extra.values()), [do, dE], allow_unused=True)
    after = _ext.op_calls()
    calls = 2 if V + K > 512 else 1
    assert (after["kda_fwd"] - before["kda_fwd"], after["kda_bwd"] - before["kda_bwd"]) == (calls, 1)
    ours = dict(zip(["dq", "dk", "dv", "dg", "dbeta"], grads[:5]))
    ours.update({{"A_log": "dA_log", "dt_bias": "ddt_bias"}[n]: gr for n, gr in zip(extra, grads[5:])})
    ref = _grads_naive(inputs, dict(kw, initial_state=S_in), do, dE)
    bad = {}
    for key, r in ref.items():
        if r is None or key == "dh0":
            continue
        t = DA_LOG_TOL if key == "dA_log" else (KDA_TOL["dbias"] if key == "ddt_bias" else KDA_TOL[key])
        err = rel_rms(r, ours[key])
        if not err <= t:
            bad[key] = (err, t)
    assert not bad, f"gradients off the fp64 naive recurrence: {bad}"
