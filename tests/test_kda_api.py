"""The chunk_kda front on CPU: argument errors name the argument, the CPU path runs the
reference forward and backward, is_supported explains itself, env switches parse safely."""

import logging
import re

import pytest
import torch

import kernel_fun
from kernel_fun import _env, _ext
from kernel_fun.kda import chunk_kda, is_supported

from helpers import rel_rms


def _inputs(B=1, T=37, H=2, HV=4, K=16, V=24, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    k = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    v = torch.randn(B, T, HV, V, generator=g, dtype=dtype)
    gate = -torch.rand(B, T, HV, K, generator=g, dtype=dtype)
    beta = torch.rand(B, T, HV, generator=g, dtype=dtype)
    return q, k, v, gate, beta


BAD_CASES = [
    ("k", lambda q, k, v, g, b: dict(k=k[:, :-1]), ValueError),
    ("v", lambda q, k, v, g, b: dict(v=v[:, :, :3]), ValueError),
    ("g", lambda q, k, v, g, b: dict(g=g[..., :-1]), ValueError),
    ("beta", lambda q, k, v, g, b: dict(beta=b[..., None]), ValueError),
    ("chunk_size", lambda q, k, v, g, b: dict(chunk_size=48), ValueError),
    ("allow_neg_eigval", lambda q, k, v, g, b: dict(allow_neg_eigval=True), ValueError),
    ("lower_bound", lambda q, k, v, g, b: dict(safe_gate=True, use_gate_in_kernel=True, lower_bound=-6.0,
                                                A_log=torch.zeros(4)), ValueError),
    ("A_log", lambda q, k, v, g, b: dict(use_gate_in_kernel=True), ValueError),
    ("A_log", lambda q, k, v, g, b: dict(use_gate_in_kernel=True, A_log=torch.zeros(3)), ValueError),
    ("dt_bias", lambda q, k, v, g, b: dict(use_gate_in_kernel=True, A_log=torch.zeros(4),
                                           dt_bias=torch.zeros(5)), ValueError),
    ("cu_seqlens", lambda q, k, v, g, b: dict(cu_seqlens=torch.tensor([0, 40, 37])), ValueError),
    ("cu_seqlens", lambda q, k, v, g, b: dict(cu_seqlens=torch.tensor([0, 10, 30])), ValueError),
    ("cu_seqlens", lambda q, k, v, g, b: dict(cu_seqlens=torch.tensor([1, 10, 37])), ValueError),
    ("cu_seqlens", lambda q, k, v, g, b: dict(cu_seqlens=torch.tensor([0.0, 37.0])), TypeError),
    ("initial_state", lambda q, k, v, g, b: dict(initial_state=torch.zeros(1, 4, 24, 16)), ValueError),
    ("q", lambda q, k, v, g, b: dict(q=q.to(torch.int64), k=k.to(torch.int64)), TypeError),
]


@pytest.mark.parametrize("name,mutate,exc", BAD_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_CASES)])
def test_bad_input_names_the_argument(name, mutate, exc):
    q, k, v, g, beta = _inputs()
    args = dict(q=q, k=k, v=v, g=g, beta=beta)
    args.update(mutate(q, k, v, g, beta))
    with pytest.raises(exc, match=name):
        chunk_kda(**args)


def test_cu_seqlens_needs_batch_one():
    q, k, v, g, beta = _inputs(B=2)
    with pytest.raises(ValueError, match="B == 1"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 37]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_path_matches_naive_reference(dtype):
    from kernel_fun.ref.kda import naive_recurrent_kda

    q, k, v, g, beta = _inputs(dtype=dtype)
    h0 = torch.randn(1, 4, 16, 24)  # float32, as fla asserts; float64 inputs compute in float64
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == q.dtype and o.shape == v.shape
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert rel_rms(o_ref, o) < tol and rel_rms(ht_ref, ht) < tol


def test_cpu_path_backward_reaches_every_input():
    q, k, v, g, beta = _inputs(T=20)
    A_log = torch.log(torch.empty(4, dtype=torch.float64).uniform_(1, 16))
    dt_bias = torch.randn(4 * 16, dtype=torch.float64) * 0.1
    h0 = torch.randn(1, 4, 16, 24)
    leaves = [q, k, v, g, beta, A_log, dt_bias, h0]
    for t in leaves:
        t.requires_grad_(True)
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, A_log=A_log, dt_bias=dt_bias,
                      use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    (o.square().sum() + ht.square().sum()).backward()
    for t in leaves:
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0


def test_cpu_varlen_resets_state_at_boundaries():
    q, k, v, g, beta = _inputs(T=40)
    cu = torch.tensor([0, 1, 17, 40], dtype=torch.int32)
    o, ht = chunk_kda(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
    for n in range(3):
        s, e = int(cu[n]), int(cu[n + 1])
        o_n, ht_n = chunk_kda(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], output_final_state=True)
        assert rel_rms(o_n, o[:, s:e]) < 1e-10 and rel_rms(ht_n[0], ht[n]) < 1e-10


def test_return_intermediate_states_on_cpu():
    q, k, v, g, beta = _inputs(T=70)
    with torch.inference_mode():
        o, ht, h = chunk_kda(q, k, v, g, beta, return_intermediate_states=True)
        _, _, h32 = chunk_kda(q, k, v, g, beta, return_intermediate_states=True, chunk_size=32)
    assert h.shape == (1, 2, 4, 16, 24) and ht is None
    assert h32.shape == (1, 3, 4, 16, 24)  # fla's: one state per chunk_size tokens


# --- one validation for every device: CPU tensors (the reference) and meta tensors (the path of
# CUDA tensors: routing, then our ops or fla) raise the same error before any routing. ---

def _h0(q, v, dtype):
    return torch.zeros(q.shape[0], v.shape[2], q.shape[3], v.shape[3], dtype=dtype)


def _mixed(q, k, v, g, b):
    return dict(q=q.float(), k=k.bfloat16(), v=v.bfloat16())


SAME_ON_EVERY_DEVICE = [  # (id, change, exception, message)
    # fla would run q float32 with k, v bfloat16 forward (o held at v's precision) and fail to
    # compile its backward; with v's dtype not k's its forward fails to compile
    ("q32_kv16", _mixed, TypeError, r"k must have q's dtype torch\.float32, got torch\.bfloat16"),
    ("v_differs", lambda q, k, v, g, b: dict(q=q.float(), k=k.float(), v=v.half()), TypeError,
     r"v must have q's dtype torch\.float32, got torch\.float16"),
    ("k_differs", lambda q, k, v, g, b: dict(k=k.float()), TypeError, r"k must have q's dtype torch\.float64"),
    ("h0_bf16", lambda q, k, v, g, b: dict(initial_state=_h0(q, v, torch.bfloat16)),
     TypeError, r"initial_state must be float32 \(as fla asserts\), got torch\.bfloat16"),
    ("h0_fp64", lambda q, k, v, g, b: dict(initial_state=_h0(q, v, torch.float64)),
     TypeError, "initial_state must be float32"),
    # fla's callers match these exact words
    ("chunk_size", lambda q, k, v, g, b: dict(chunk_size=16), ValueError,
     "`chunk_size` must be either 32 or 64"),
    # fla asserts it (h is for inference engines; the flag bypasses autograd)
    ("intermediate_outside_inference", lambda q, k, v, g, b: dict(return_intermediate_states=True), ValueError,
     r"return_intermediate_states is only allowed in inference mode"),
]


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("case", SAME_ON_EVERY_DEVICE, ids=[c[0] for c in SAME_ON_EVERY_DEVICE])
def test_validation_is_the_same_on_every_device(case, device):
    _, change, exc, msg = case
    q, k, v, g, beta = _inputs()
    args = dict(q=q, k=k, v=v, g=g, beta=beta)
    args.update(change(q, k, v, g, beta))
    args = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in args.items()}
    with pytest.raises(exc, match=msg):
        chunk_kda(**args)
    ok, why = is_supported(args.pop("q"), args.pop("v"), **args)
    assert not ok and why.startswith("invalid input:") and re.search(msg, why)


def test_mixed_g_and_beta_dtypes_stay_valid():
    """g and beta may differ from q's dtype (fla reads both as fp32), only q, k, v share one."""
    q, k, v, g, beta = _inputs(dtype=torch.float32)
    o32, _ = chunk_kda(q, k, v, g, beta)
    o, _ = chunk_kda(q, k, v, g.double(), beta.bfloat16())
    assert o.dtype == torch.float32 and rel_rms(o32, o) < 1e-2


def test_intermediate_states_need_recompute():
    q, k, v, g, beta = _inputs(T=70)
    with torch.inference_mode(), pytest.raises(ValueError, match="disable_recompute=False"):
        chunk_kda(q, k, v, g, beta, return_intermediate_states=True, disable_recompute=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", SAME_ON_EVERY_DEVICE, ids=[c[0] for c in SAME_ON_EVERY_DEVICE])
@pytest.mark.parametrize("disabled", [False, True], ids=["ours", "fla_route"])
def test_validation_is_the_same_on_cuda(case, disabled, monkeypatch):
    """On CUDA tensors, with our kernels or routed to fla (KERNEL_FUN_KDA_DISABLE=1), the same errors
    as on CPU; the call never reaches fla (which would accept some and crash or assert on others)."""
    from kernel_fun import _dispatch

    monkeypatch.setattr(_dispatch, "fla_function", lambda m, n: pytest.fail("reached fla"))
    if disabled:
        monkeypatch.setenv("KERNEL_FUN_KDA_DISABLE", "1")
    _, change, exc, msg = case
    q, k, v, g, beta = _inputs(K=64, V=64, dtype=torch.bfloat16)
    args = dict(q=q, k=k, v=v, g=g.float(), beta=beta.float())
    args.update(change(q, k, v, g, beta))
    args = {n: t.cuda() if isinstance(t, torch.Tensor) else t for n, t in args.items()}
    with pytest.raises(exc, match=msg.replace("float64", "bfloat16")):
        chunk_kda(**args)


def test_is_supported_on_cpu_says_why():
    q, k, v, g, beta = _inputs()
    ok, why = is_supported(q, v, k=k, g=g, beta=beta)
    assert not ok and "reference" in why
    ok, why = is_supported(q, v, k=k, g=g, beta=beta, chunk_size=48)
    assert not ok and "chunk_size" in why


def _big_views(B, T, H=1, HV=1, K=64, V=64, dtype=torch.bfloat16):
    """Kernel-shaped q, k, v, g, beta as stride-0 views of one element each (nothing allocated)."""
    q = torch.empty(1, 1, 1, 1, dtype=dtype).expand(B, T, H, K)
    v = torch.empty(1, 1, 1, 1, dtype=dtype).expand(B, T, HV, V)
    g = torch.empty(1, 1, 1, 1).expand(B, T, HV, K)
    beta = torch.empty(1, 1, 1).expand(B, T, HV)
    return q, q, v, g, beta


@pytest.mark.skipif(not _ext.available(), reason="extension not built: C++ support check unavailable")
def test_support_guards_grid_and_token_limits():
    # kda_support reads metadata only (CompositeExplicitAutograd), so CPU views exercise it.
    from kernel_fun.kda._options import KdaOptions

    opts = KdaOptions(scale=0.125).encode()
    support = _ext.ops().kda_support
    assert support(*_big_views(65535, 1), None, opts) == ""
    # Fixed length: the scan grid's z dimension is B (<= 65535), even with T == 0.
    assert "B=65536 > 65535" in support(*_big_views(65536, 1), None, opts)
    assert "B=65536 > 65535" in support(*_big_views(65536, 0), None, opts)
    # Varlen: N = len(cu_seqlens) - 1 is the z dimension.
    cu = torch.zeros(65537, dtype=torch.int32)
    assert support(*_big_views(1, 64), cu, opts) == "more than 65535 varlen sequences"
    # Tokens: B * T <= 2^30.
    assert support(*_big_views(2 ** 15, 2 ** 15), None, opts) == ""
    assert support(*_big_views(2 ** 15, 2 ** 15 + 1), None, opts) == "more than 2^30 tokens"
    assert support(*_big_views(1, 2 ** 30 + 1), None, opts) == "more than 2^30 tokens"
    # The options string is parsed strictly: a bad one is a reason naming the key.
    assert "unknown key 'bogus'" in support(*_big_views(1, 1), None, opts + ";bogus=1")
    assert "missing key 'scale'" in support(*_big_views(1, 1), None, opts.replace(opts.split(";")[0] + ";", ""))
    # the split switches travel in the options (so a backward splits as its forward did)
    assert "split=2;split_chunks=0;recurrent=-1" in opts  # the defaults: the launch model decides
    assert support(*_big_views(1, 64), None, opts.replace("split=2", "split=0")) == ""
    assert "bad value '3' for 'split'" in support(*_big_views(1, 1), None, opts.replace("split=2", "split=3"))
    assert "bad value '-1' for 'split_chunks'" in support(*_big_views(1, 1), None,
                                                          opts.replace("split_chunks=0", "split_chunks=-1"))
    assert "bad value '2' for 'recurrent'" in support(*_big_views(1, 1), None,
                                                      opts.replace("recurrent=-1", "recurrent=2"))
    # chunk_size=32 is ours (our kernels chunk as they choose) unless the call asks for the per-chunk
    # states, which would be one per 32 tokens
    assert opts.endswith("chunk_size=64;split=2;split_chunks=0;recurrent=-1;intermediate_states=0;max_seq_len=0")
    assert support(*_big_views(1, 64), None, opts.replace("chunk_size=64", "chunk_size=32")) == ""
    assert support(*_big_views(1, 64), None, opts.replace("intermediate_states=0", "intermediate_states=1")) == ""
    assert support(*_big_views(1, 64), None, opts.replace("chunk_size=64", "chunk_size=32").replace(
        "intermediate_states=0", "intermediate_states=1")) == (
        "chunk_size=32 with return_intermediate_states (our kernels return a state every 64 tokens)")
    assert "bad value '2' for 'intermediate_states'" in support(
        *_big_views(1, 1), None, opts.replace("intermediate_states=0", "intermediate_states=2"))
    # the longest document's tokens (the launch model's, for varlen calls): any count, never negative
    assert support(*_big_views(1, 64), None, opts.replace("max_seq_len=0", "max_seq_len=70000")) == ""
    assert "bad value '-1' for 'max_seq_len'" in support(*_big_views(1, 1), None,
                                                         opts.replace("max_seq_len=0", "max_seq_len=-1"))


def test_env_flags_parse_and_warn(monkeypatch, caplog):
    monkeypatch.setenv("KERNEL_FUN_KDA_DISABLE", "1")
    assert _env.family_disabled("kda") == "KERNEL_FUN_KDA_DISABLE=1"
    monkeypatch.setenv("KERNEL_FUN_KDA_DISABLE", "perhaps")
    with caplog.at_level(logging.WARNING, logger="kernel_fun"):
        assert _env.family_disabled("kda") is None
    assert "KERNEL_FUN_KDA_DISABLE" in caplog.text
    monkeypatch.setenv("KERNEL_FUN_DISABLE", "yes")
    assert _env.family_disabled("cconv") == "KERNEL_FUN_DISABLE=1"


def test_launch_switches_are_read_into_the_options(monkeypatch, caplog):
    """KERNEL_FUN_KDA_SPLIT / _SPLIT_CHUNKS / KERNEL_FUN_KDA_RECURRENT are read by the front into the
    call's options (which the backward receives), not by the C++ launcher; a bad value warns and
    reads as the default."""
    from kernel_fun.kda import _plan
    from kernel_fun.kda._kernel import _decode
    from kernel_fun.kda._options import KdaOptions, launch_switches

    meta = (torch.bfloat16,) * 4 + (None, False, 0.125, True, True, True, False, None, False, True, 64, False)
    for n in ("KERNEL_FUN_KDA_SPLIT", "KERNEL_FUN_KDA_SPLIT_CHUNKS", "KERNEL_FUN_KDA_RECURRENT"):
        monkeypatch.delenv(n, raising=False)
    assert launch_switches() == (2, 0, -1) and "split=2;split_chunks=0;recurrent=-1" in _plan(meta)[1]
    monkeypatch.setenv("KERNEL_FUN_KDA_SPLIT", "1")
    monkeypatch.setenv("KERNEL_FUN_KDA_SPLIT_CHUNKS", "16")
    monkeypatch.setenv("KERNEL_FUN_KDA_RECURRENT", "0")
    assert launch_switches() == (1, 16, 0) and "split=1;split_chunks=16;recurrent=0" in _plan(meta)[1]  # per call
    opts = KdaOptions.from_call(scale=0.125, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False,
                                use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                                A_log=None, state_v_first=False, chunk_size=64)
    assert (opts.split, opts.split_chunks, opts.recurrent) == (1, 16, 0)
    assert _decode(opts.encode()) == opts
    wide = KdaOptions.from_call(scale=0.125, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False,
                                use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                                A_log=None, state_v_first=False, chunk_size=32, return_intermediate_states=True)
    assert (wide.chunk_size, wide.intermediate_states) == (32, True) and _decode(wide.encode()) == wide
    monkeypatch.setenv("KERNEL_FUN_KDA_SPLIT", "4")
    monkeypatch.setenv("KERNEL_FUN_KDA_RECURRENT", "yes")
    with caplog.at_level(logging.WARNING, logger="kernel_fun"):
        assert launch_switches() == (2, 16, -1)
    assert "KERNEL_FUN_KDA_SPLIT" in caplog.text and "KERNEL_FUN_KDA_RECURRENT" in caplog.text
    with pytest.raises(ValueError, match="KdaOptions.split must be 0, 1 or 2"):
        KdaOptions(scale=1.0, split=3)
    with pytest.raises(ValueError, match="KdaOptions.recurrent must be -1, 0 or 1"):
        KdaOptions(scale=1.0, recurrent=2)


def test_versions_has_the_keys():
    v = kernel_fun.versions()
    for key in ("kernel_fun", "torch", "triton", "fla", "cutlass", "cuda", "device", "extension"):
        assert isinstance(v.get(key), str) and v[key]


@pytest.mark.parametrize("cu,batch", [([0, 70], (1, 70)), ([0, 35, 70], (2, 35)), ([0, 30, 70], None),
                                      ([0, 0, 70], None)])
def test_equal_documents_reach_the_kernels_as_a_batch(cu, batch, monkeypatch):
    """cu_seqlens of N documents of one length L: the kernel layer receives the fixed-length batch
    [N, L] (views of the inputs, no cu_seqlens) and o comes back as [1, T, HV, V]; other cuts, the
    switch KERNEL_FUN_KDA_VARLEN_AS_BATCH=0, use_graph (no host copy) and return_intermediate_states
    keep the varlen call. Meta tensors with a host copy reach the kernel path (replaced by a recorder)."""
    from kernel_fun import _dispatch, _ext
    from kernel_fun.kda import _kernel

    class Ops:
        @staticmethod
        def kda_support(q, k, v, g, beta, cu, options):
            return ""

        @staticmethod
        def kda_limits(probe):
            return [65535, 1 << 30]

    seen = []

    def forward(q, k, v, g, beta, **kw):
        seen.append((q, v, beta, kw))
        o = torch.empty(*v.shape[:3], 64, device=v.device)
        return (o, None, o) if kw["return_intermediate_states"] else (o, None)

    monkeypatch.setattr(_ext, "status", lambda: (True, "stub"))
    monkeypatch.setattr(_ext, "ops", lambda: Ops)
    monkeypatch.setattr(_dispatch, "fla_function", lambda module, name: None)
    monkeypatch.setattr(_kernel, "forward", forward)
    dev = torch.device("meta")
    q = torch.empty(1, 70, 2, 64, device=dev)
    v = torch.empty(1, 70, 4, 64, device=dev)
    g = torch.empty(1, 70, 4, 64, device=dev)
    beta = torch.empty(1, 70, 4, device=dev)
    kw = dict(cu_seqlens=torch.tensor(cu, device=dev), cu_seqlens_cpu=torch.tensor(cu))
    with torch.no_grad():
        o, _ = chunk_kda(q, q, v, g, beta, **kw)
    sq, sv, sbeta, skw = seen[-1]
    assert o.shape == (1, 70, 4, 64)
    if batch is None:
        assert sq.shape == (1, 70, 2, 64) and skw["cu_seqlens"] is kw["cu_seqlens"]
    else:
        N, L = batch
        assert (sq.shape, sv.shape, sbeta.shape) == ((N, L, 2, 64), (N, L, 4, 64), (N, L, 4))
        assert skw["cu_seqlens"] is None and skw["cu_seqlens_cpu"] is None
        monkeypatch.setenv("KERNEL_FUN_KDA_VARLEN_AS_BATCH", "0")
        with torch.no_grad():
            chunk_kda(q, q, v, g, beta, **kw)
        assert seen[-1][0].shape == (1, 70, 2, 64) and seen[-1][3]["cu_seqlens"] is kw["cu_seqlens"]
        monkeypatch.delenv("KERNEL_FUN_KDA_VARLEN_AS_BATCH")
        with torch.no_grad():
            chunk_kda(q, q, v, g, beta, cu_seqlens=kw["cu_seqlens"], use_graph=True, max_num_seqs=len(cu) - 1)
        assert seen[-1][0].shape == (1, 70, 2, 64)
        with torch.inference_mode():
            chunk_kda(q, q, v, g, beta, **kw, return_intermediate_states=True)
        assert seen[-1][0].shape == (1, 70, 2, 64)


def test_kernel_path_wiring_without_a_gpu(monkeypatch):
    """chunk_kda and is_supported hand our kernel layer the same, complete keyword set (meta tensors
    reach the kernel path; the kernel layer is replaced by a recorder)."""
    from kernel_fun import _dispatch, _ext
    from kernel_fun.kda import _kernel

    seen = []

    class Ops:  # the C++ support check, recorded: it sees meta stand-ins (sizes are _size_reason's)
        @staticmethod
        def kda_support(q, k, v, g, beta, cu, options):
            seen.append(("support", (q.device.type, q.dtype, v.dtype, cu is not None, options)))
            return ""

        @staticmethod
        def kda_limits(probe):
            return [65535, 1 << 30]

    monkeypatch.setattr(_ext, "status", lambda: (True, "stub"))
    monkeypatch.setattr(_ext, "ops", lambda: Ops)
    monkeypatch.setattr(_dispatch, "fla_function", lambda module, name: None)  # as without fla
    monkeypatch.setattr(_kernel, "forward", lambda *a, **kw: seen.append(("forward", kw)) or ("o", None))
    dev = torch.device("meta")
    q = torch.empty(1, 70, 2, 64, device=dev)
    v = torch.empty(1, 70, 4, 64, device=dev)
    g = torch.empty(1, 70, 4, 64, device=dev)
    beta = torch.empty(1, 70, 4, device=dev)
    A_log = torch.empty(4, device=dev)
    cu = torch.tensor([0, 30, 70], device=dev)
    cu_cpu = torch.tensor([0, 30, 70])
    kw = dict(use_gate_in_kernel=True, A_log=A_log, lower_bound=-5.0, safe_gate=True,
              use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, output_final_state=True)
    with torch.no_grad():
        assert chunk_kda(q, q, v, g, beta, **kw) == ("o", None)
    (k1, support1), (k2, fwd) = seen
    assert (k1, k2) == ("support", "forward")
    # one options string: the support check's, with the longest document (40 of [0, 30, 70]) filled in
    assert support1 == ("meta", torch.float32, torch.float32, True, fwd["options"].replace("max_seq_len=40",
                                                                                           "max_seq_len=0"))
    assert fwd["options"].endswith(";max_seq_len=40")
    opts = _kernel._decode(fwd["options"])
    assert opts.scale == 64 ** -0.5 and opts.lower_bound == -5.0 and opts.gate == "bounded" and fwd["A_log"] is A_log
    assert opts.chunk_size == 64 and opts.l2norm and fwd["output_final_state"] and fwd["cu_seqlens"] is cu
    assert torch.equal(fwd["cu_seqlens_cpu"], cu_cpu.long())
    # an unknown keyword is a TypeError naming it (never silently ignored, never routed to fla)
    with pytest.raises(TypeError, match="unexpected keyword argument.*'no_such_flag'"), torch.no_grad():
        chunk_kda(q, q, v, g, beta, no_such_flag=1)
    # fla 0.6.0's use_graph / max_num_seqs are accepted; with use_graph the device cu_seqlens is
    # trusted (no host read), and max_num_seqs must match its length
    seen.clear()
    with torch.no_grad():
        assert chunk_kda(q, q, v, g, beta, **{**kw, "cu_seqlens_cpu": None}, use_graph=True, max_num_seqs=2) == ("o", None)
    assert seen[-1][1]["cu_seqlens_cpu"] is None and seen[-1][1]["options"].endswith(";max_seq_len=0")
    with pytest.raises(ValueError, match="max_num_seqs"), torch.no_grad():
        chunk_kda(q, q, v, g, beta, **kw, use_graph=True, max_num_seqs=3)
    ok, why = is_supported(q, v, k=q, g=g, beta=beta, **kw, use_graph=True, max_num_seqs=3)
    assert not ok and "max_num_seqs + 1 = 4 entries" in why
    # is_supported binds chunk_kda's own signature: valid keywords pass validation and reach the
    # device check; a bad value or an unknown positional is an invalid-input reason
    ok, why = is_supported(q, v, k=q, g=g, beta=beta, **kw)
    assert not ok and why.startswith("tensors on meta")
    ok, why = is_supported(q, v, k=q, g=g, beta=beta, chunk_size=48)
    assert not ok and "chunk_size" in why


def test_unknown_keywords_raise_on_cpu_too():
    """A misspelt keyword (dt_bais) is a TypeError naming it, on the CPU reference path as well."""
    q, k, v, g, beta = _inputs()
    with pytest.raises(TypeError, match="'dt_bais'"):
        chunk_kda(q, k, v, g, beta, dt_bais=torch.zeros(4 * 16))
    ok, why = is_supported(q, v, k=k, g=g, beta=beta, dt_bais=1)
    assert not ok and "'dt_bais'" in why


def test_transpose_state_layout_is_honoured():
    """fla's deprecated alias of state_v_first changes the state layout (fla honours it), warns, and
    may not be combined with state_v_first."""
    torch.manual_seed(0)
    q, k, v, g, beta = _inputs(T=70)
    N, HV, K, V = 1, v.shape[2], q.shape[3], v.shape[3]
    h0 = torch.randn(N, HV, V, K)
    o_new, ht_new = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, state_v_first=True)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        o_old, ht_old = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                  transpose_state_layout=True)
    assert torch.equal(o_new, o_old) and torch.equal(ht_new, ht_old)
    with pytest.raises(ValueError, match="transpose_state_layout"):
        chunk_kda(q, k, v, g, beta, state_v_first=True, transpose_state_layout=True)


def test_strict_mode_raises_instead_of_falling_back(monkeypatch):
    """KERNEL_FUN_STRICT=1 / kernel_fun.strict(): a call our kernels cannot serve raises with the
    reason; fla is never called."""
    from kernel_fun import _dispatch
    called = []
    monkeypatch.setattr(_dispatch, "fla_function", lambda m, n: (lambda *a, **k: called.append(m) or "fla"))
    with kernel_fun.strict():
        with pytest.raises(kernel_fun.KernelFunUnsupported, match="because-of-test"):
            _dispatch.fallback("kda", "because-of-test", "fla.ops.kda", "chunk_kda", (), {})
    assert _dispatch.fallback("kda", "x", "fla.ops.kda", "chunk_kda", (), {}) == "fla"  # strict is off again
    monkeypatch.setenv("KERNEL_FUN_STRICT", "1")
    with pytest.raises(kernel_fun.KernelFunUnsupported, match="KERNEL_FUN_STRICT"):
        _dispatch.fallback("cconv", "why", ("fla.modules.causal_conv1d",), "causal_conv1d", (), {})
    assert called == ["fla.ops.kda"]


def test_fallback_tries_fla_module_candidates_in_order(monkeypatch):
    """fla 0.6.0 moved causal_conv1d to fla.modules.causal_conv1d; 0.5.2 has fla.modules.convolution."""
    from kernel_fun import _dispatch
    tried = []

    def fake(module, name):
        tried.append(module)
        return (lambda *a, **k: module) if module == "fla.modules.convolution" else None

    monkeypatch.setattr(_dispatch, "fla_function", fake)
    got = _dispatch.fallback("cconv", "r", ("fla.modules.causal_conv1d", "fla.modules.convolution"), "f", (), {})
    assert got == "fla.modules.convolution" and tried == ["fla.modules.causal_conv1d", "fla.modules.convolution"]


def test_nemo_entry_points_on_cpu():
    """kernel_fun.nemo: the unsupported reason names the first violated condition (never raises);
    fused_chunk_kda raises instead of falling back."""
    from kernel_fun import nemo
    q, k, v, g, beta = _inputs()
    assert "mode" in nemo.fused_kda_unsupported_reason(q, k, v, g, beta, None, mode="fused_recurrent")
    assert "cp_context" in nemo.fused_kda_unsupported_reason(q, k, v, g, beta, None, cp_context=object())
    assert "use_qk_l2norm_in_kernel" in nemo.fused_kda_unsupported_reason(q, k, v, g, beta, None,
                                                                          use_qk_l2norm_in_kernel=False)
    assert "cpu" in nemo.fused_kda_unsupported_reason(q, k, v, g, beta, None)
    with pytest.raises(kernel_fun.KernelFunUnsupported, match="cpu"):
        nemo.fused_chunk_kda(q, k, v, g, beta, None)


def test_nemo_dense_input_is_a_packed_view():
    """Dense [B, T] input becomes one packed batch of B documents: views and device offsets."""
    from kernel_fun.nemo import _packed
    q, k, v, g, beta = _inputs(B=3, T=10)
    pq, pk, pv, pg, pb, cu = _packed(q, k, v, g, beta, None)
    assert pq.shape == (1, 30, 2, 16) and pq.data_ptr() == q.data_ptr()
    assert cu.tolist() == [0, 10, 20, 30] and cu.dtype == torch.int32
    # the reference agrees: dense == packed
    o_dense, _ = chunk_kda(q, k, v, g, beta)
    o_packed, _ = chunk_kda(pq, pk, pv, pg, pb, cu_seqlens=cu)
    assert torch.allclose(o_dense.reshape(1, 30, 4, 24), o_packed, atol=1e-12)


@pytest.mark.skipif(not __import__("kernel_fun")._ext.available(), reason="needs the built extension")
@pytest.mark.parametrize("K", [32, 64, 96, 128])
@pytest.mark.parametrize("V", [0, 32, 64, 192, 512, 576])
@pytest.mark.parametrize("HV,B,T,N", [(2, 1, 100, None), (70000, 1, 64, None), (2, 70000, 1, None),
                                      (2, 1, 100, 3), (2, 1, 70000, 66000), (2, 40000, 40000, None),
                                      (2, 1, 0, None)])
def test_size_rules_agree_with_the_cpp_check(K, V, HV, B, T, N):
    """The front's size rules (_size_reason: applied with guards under torch.compile) give the C++
    support check's verdict and words on meta tensors of these sizes."""
    from kernel_fun import _ext
    from kernel_fun.kda import _size_reason
    from kernel_fun.kda._options import KdaOptions

    meta = lambda *shape, dt=torch.bfloat16: torch.empty(shape, dtype=dt, device="meta")  # noqa: E731
    q, v = meta(B, T, 1, K), meta(B, T, HV, V)
    cu = None if N is None else meta(N + 1, dt=torch.int32)
    cpp = _ext.ops().kda_support(q, q, v, meta(B, T, HV, K, dt=torch.float32), meta(B, T, HV, dt=torch.float32), cu,
                                 KdaOptions(scale=0.1).encode()) or None
    assert _size_reason(q, v, cu) == cpp

