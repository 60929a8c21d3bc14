"""The chunk_kda front on CPU: argument errors name the argument, the CPU path runs the
reference forward and backward, is_supported explains itself, env switches parse safely."""

import logging

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
    h0 = torch.randn(1, 4, 16, 24, dtype=dtype)
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == q.dtype and o.shape == v.shape
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert rel_rms(o_ref, o) < tol and rel_rms(ht_ref, ht) < tol


def test_cpu_path_backward_reaches_every_input():
    q, k, v, g, beta = _inputs(T=20)
    A_log = torch.log(torch.empty(4, dtype=torch.float64).uniform_(1, 16))
    dt_bias = torch.randn(4 * 16, dtype=torch.float64) * 0.1
    h0 = torch.randn(1, 4, 16, 24, dtype=torch.float64)
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
    o, ht, h = chunk_kda(q, k, v, g, beta, return_intermediate_states=True)
    assert h.shape == (1, 2, 4, 16, 24) and ht is None


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


def test_env_flags_parse_and_warn(monkeypatch, caplog):
    monkeypatch.setenv("KERNEL_FUN_KDA_DISABLE", "1")
    assert _env.family_disabled("kda") == "KERNEL_FUN_KDA_DISABLE=1"
    monkeypatch.setenv("KERNEL_FUN_KDA_DISABLE", "perhaps")
    with caplog.at_level(logging.WARNING, logger="kernel_fun"):
        assert _env.family_disabled("kda") is None
    assert "KERNEL_FUN_KDA_DISABLE" in caplog.text
    monkeypatch.setenv("KERNEL_FUN_DISABLE", "yes")
    assert _env.family_disabled("cconv") == "KERNEL_FUN_DISABLE=1"
    monkeypatch.setenv("KERNEL_FUN_KDA_MIN_CTAS", "-3")
    assert _env.integer("KERNEL_FUN_KDA_MIN_CTAS", 256, minimum=0) == 256


def test_versions_has_the_keys():
    v = kernel_fun.versions()
    for key in ("kernel_fun", "torch", "triton", "fla", "cutlass", "cuda", "device", "extension"):
        assert isinstance(v.get(key), str) and v[key]


def test_kernel_path_wiring_without_a_gpu(monkeypatch):
    """chunk_kda and is_supported hand our kernel layer the same, complete keyword set (meta tensors
    reach the kernel path; the kernel layer is replaced by a recorder)."""
    from kernel_fun import _dispatch, _ext
    from kernel_fun.kda import _kernel, _plan

    seen = []

    class Ops:  # the C++ support check, recorded: it sees meta tensors of the call's shapes
        @staticmethod
        def kda_support(q, k, v, g, beta, cu, options):
            seen.append(("support", (q.device.type, tuple(q.shape), tuple(v.shape), cu is not None, options)))
            return ""

    monkeypatch.setattr(_ext, "status", lambda: (True, "stub"))
    monkeypatch.setattr(_ext, "ops", lambda: Ops)
    monkeypatch.setattr(_dispatch, "fla_function", lambda module, name: None)  # as without fla
    monkeypatch.setattr(_kernel, "forward", lambda *a, **kw: seen.append(("forward", kw)) or ("o", None))
    dev = torch.device("meta")
    q = torch.empty(1, 70, 2, 16, device=dev)
    v = torch.empty(1, 70, 4, 24, device=dev)
    g = torch.empty(1, 70, 4, 16, device=dev)
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
    assert support1 == ("meta", (1, 70, 2, 16), (1, 70, 4, 24), True, fwd["options"])  # one options string
    opts = _kernel._decode(fwd["options"])
    assert opts.scale == 16 ** -0.5 and opts.lower_bound == -5.0 and opts.gate == "bounded" and fwd["A_log"] is A_log
    assert opts.chunk_size == 64 and opts.l2norm and fwd["output_final_state"] and fwd["cu_seqlens"] is cu
    assert torch.equal(fwd["cu_seqlens_cpu"], cu_cpu.long())
    # an unknown flag is a routing reason (fla is not installed here, so the fallback raises it)
    with pytest.raises(RuntimeError, match="unrecognized argument no_such_flag"), torch.no_grad():
        chunk_kda(q, q, v, g, beta, no_such_flag=1)
    # is_supported binds chunk_kda's own signature: valid keywords pass validation and reach the
    # device check; a bad value or an unknown positional is an invalid-input reason
    ok, why = is_supported(q, v, k=q, g=g, beta=beta, **kw)
    assert not ok and why.startswith("tensors on meta")
    ok, why = is_supported(q, v, k=q, g=g, beta=beta, chunk_size=48)
    assert not ok and "chunk_size" in why
