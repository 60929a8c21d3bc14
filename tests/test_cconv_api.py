"""CPU tests of the kernel_fun.cconv front: routing (CPU -> torch reference), is_supported reasons,
environment switches, errors that name the argument (checked in C++ by cconv_support), and the CPU
path's forward and backward against the reference."""

from __future__ import annotations

import pytest
import torch

import kernel_fun.cconv as cc
from kernel_fun import _ext
from kernel_fun.ref.cconv import causal_conv1d_ref, causal_conv1d_update_ref

needs_ext = pytest.mark.skipif(not _ext.available(), reason="extension not built: C++ validation unavailable")


def _inputs(B=2, T=12, D=16, W=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g, dtype=dtype)
    w = torch.randn(D, W, generator=g, dtype=dtype)
    return x, w


# ------------------------------------------------------------------ routing

def test_cpu_runs_the_reference_forward_and_backward():
    x, w = _inputs(dtype=torch.float64)
    b = torch.randn(16, dtype=torch.float64)
    h0 = torch.randn(2, 16, 4, dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b, h0)]
    y, ht = cc.causal_conv1d(leaves[0], leaves[1], leaves[2], initial_state=leaves[3], output_final_state=True,
                             activation="silu")
    yr, hr = causal_conv1d_ref(x, w, b, None, h0, True, "silu")
    assert torch.equal(y, yr) and torch.equal(ht, hr)
    (y.sum() + ht.sum()).backward()
    ref_leaves = [t.clone().requires_grad_(True) for t in (x, w, b, h0)]
    yr, hr = causal_conv1d_ref(ref_leaves[0], ref_leaves[1], ref_leaves[2], None, ref_leaves[3], True, "silu")
    (yr.sum() + hr.sum()).backward()
    for a, r in zip(leaves, ref_leaves):
        assert torch.equal(a.grad, r.grad)


def test_cpu_varlen_and_multidim_x():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 20, 2, 8, generator=g)
    w = torch.randn(16, 3, generator=g)
    cu = torch.tensor([0, 1, 9, 9, 20])
    y, ht = cc.causal_conv1d(x, w, cu_seqlens=cu, cu_seqlens_cpu=cu, output_final_state=True)
    yr, hr = causal_conv1d_ref(x.flatten(2), w, cu_seqlens=cu, output_final_state=True)
    assert y.shape == x.shape and torch.equal(y.flatten(2), yr) and torch.equal(ht, hr)


def test_cpu_update_is_in_place():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 1, 16, generator=g)
    cache = torch.randn(3, 16, 4, generator=g)
    w = torch.randn(16, 4, generator=g)
    yr, cr = causal_conv1d_update_ref(x, cache.clone(), None, w, None, "silu")
    ptr = cache.data_ptr()
    y, c = cc.causal_conv1d_update(x, cache, weight=w, activation="silu")
    assert c is cache and cache.data_ptr() == ptr
    assert torch.equal(y, yr) and torch.equal(cache, cr)


def test_cpu_cannot_take_fla_only_arguments():
    x, w = _inputs()
    with pytest.raises(RuntimeError, match="cp_context is not supported on CPU"):
        cc.causal_conv1d(x, w, cp_context=object())
    # seq_idx is read by fla's cuda and mix backends only
    seq_idx = torch.zeros(2, 12, dtype=torch.int32)
    for backend in ("cuda", "mix"):
        with pytest.raises(RuntimeError, match=f"seq_idx with backend='{backend}' is not supported on CPU"):
            cc.causal_conv1d(x, w, backend=backend, seq_idx=seq_idx)


def test_seq_idx_is_ignored_with_triton_as_fla_does():
    """fla 0.5.2 / 0.6.0 read seq_idx (their one **kwargs keyword) for the mix / cuda backends only;
    with 'triton' they ignore it, and so does the reference."""
    x, w = _inputs()
    y, _ = cc.causal_conv1d(x, w, activation="silu")
    y_idx, _ = cc.causal_conv1d(x, w, activation="silu", seq_idx=torch.zeros(2, 12, dtype=torch.int32))
    assert torch.equal(y, y_idx)
    assert cc.causal_conv1d(x, w, backend="cuda", seq_idx=None)[0].shape == x.shape


MISSPELT = dict(activaton="silu")  # fla's **kwargs would swallow it: a result without the activation


def _assert_names_the_keyword(call):
    with pytest.raises(TypeError, match=r"causal_conv1d\(\) got unexpected keyword argument\(s\): 'activaton'"):
        call()


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("disabled", [False, True], ids=["ours", "fla_route"])
def test_misspelt_keyword_is_a_type_error_on_every_path(device, disabled, monkeypatch):
    """CPU (the reference), meta (the non-CPU path: our ops' fakes or fla) and the fla route
    (KERNEL_FUN_CCONV_DISABLE=1): a TypeError naming the keyword, before any routing."""
    from kernel_fun import _dispatch

    monkeypatch.setattr(_dispatch, "fla_function", lambda m, n: pytest.fail("reached fla"))
    if disabled:
        monkeypatch.setenv("KERNEL_FUN_CCONV_DISABLE", "1")
    x, w = (t.to(device) for t in _inputs())
    _assert_names_the_keyword(lambda: cc.causal_conv1d(x, w, **MISSPELT))
    ok, why = cc.is_supported(x, w, **MISSPELT)
    assert not ok and why.startswith("invalid:") and "'activaton'" in why


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["ours", "disabled", "backend_cuda"])
def test_misspelt_keyword_is_a_type_error_on_cuda(route, monkeypatch):
    from kernel_fun import _dispatch

    monkeypatch.setattr(_dispatch, "fla_function", lambda m, n: pytest.fail("reached fla"))
    if route == "disabled":
        monkeypatch.setenv("KERNEL_FUN_CCONV_DISABLE", "1")
    x, w = (t.cuda().bfloat16() for t in _inputs())
    backend = "cuda" if route == "backend_cuda" else "triton"
    _assert_names_the_keyword(lambda: cc.causal_conv1d(x, w, backend=backend, **MISSPELT))


@pytest.mark.gpu
@pytest.mark.fla
def test_seq_idx_reaches_fla_with_its_cuda_backends():
    """seq_idx is legitimate: with backend='cuda' the call goes to fla with it (no TypeError)."""
    pytest.importorskip("causal_conv1d", reason="fla's cuda backend needs the causal-conv1d package")
    from helpers import rel_rms

    x, w = (t.cuda().bfloat16() for t in _inputs(B=1))
    seq_idx = torch.zeros(1, 12, dtype=torch.int32, device="cuda")  # one sequence: the dense result
    y, _ = cc.causal_conv1d(x, w, activation="silu", backend="cuda", seq_idx=seq_idx)
    y_ref, _ = cc.causal_conv1d(x, w, activation="silu")
    assert rel_rms(y_ref.float(), y.float()) < 1e-2


# ------------------------------------------------------------------ is_supported reasons

def test_is_supported_reasons(monkeypatch):
    x, w = _inputs()
    ok, why = cc.is_supported(x, w, activation="silu")
    assert not ok and "cpu" in why
    ok, why = cc.is_supported(x, w, fancy_flag=1)
    assert not ok and why.startswith("invalid:") and "unexpected keyword argument(s): 'fancy_flag'" in why
    ok, why = cc.is_supported(x, w, seq_idx=None)
    assert not ok and "cpu" in why  # a keyword fla reads: valid
    ok, why = cc.is_supported(x, w, cp_context=object())
    assert not ok and "cp_context" in why
    ok, why = cc.is_supported(x, w, backend="cuda")
    assert not ok and "backend" in why
    ok, why = cc.is_supported(x, w, backend="nope")
    assert not ok and why.startswith("invalid:") and "backend" in why
    ok, why = cc.is_supported(x, 3)
    assert not ok and why.startswith("invalid:") and "weight" in why


@pytest.mark.parametrize("var", ["KERNEL_FUN_DISABLE", "KERNEL_FUN_CCONV_DISABLE"])
def test_env_switches_are_read_on_every_call(monkeypatch, var):
    x, w = _inputs()
    monkeypatch.setenv(var, "1")
    ok, why = cc.is_supported(x, w)
    assert not ok and f"disabled by {var}=1" == why
    monkeypatch.setenv(var, "0")
    ok, why = cc.is_supported(x, w)
    assert "disabled" not in why  # now only "x is on cpu"


@needs_ext
def test_unsupported_reasons_from_the_cpp_check():
    ops = _ext.ops()
    x, w = _inputs()
    assert "weight=None" in ops.cconv_support(x, None, None, None, None, False, None, None, None)
    assert "float64" in ops.cconv_support(x.double(), w, None, None, None, False, None, None, None)


@needs_ext
def test_token_limit_from_the_cpp_check():
    # Stride-0 views: the check reads shapes only, nothing of this size is allocated.
    ops = _ext.ops()
    w = torch.randn(8, 4)
    x = torch.empty(1, 1, 1).expand(2 ** 16, 2 ** 15, 8)  # B * T = 2^31
    assert "2^31" in ops.cconv_support(x, w, None, None, None, False, None, None, None)
    x = torch.empty(1, 1, 1).expand(2 ** 16, 2 ** 15 - 1, 8)
    assert ops.cconv_support(x, w, None, None, None, False, None, None, None) == ""


# ------------------------------------------------------------------ errors naming the argument

BAD = [
    ("W5", dict(weight=torch.randn(16, 5)), ValueError, r"W=5.*1\.\.4"),
    ("W0", dict(weight=torch.randn(16, 0)), ValueError, "weight"),
    ("weight_rows", dict(weight=torch.randn(15, 4)), ValueError, r"weight must be \[D, W\]"),
    ("weight_int", dict(weight=torch.ones(16, 4, dtype=torch.int64)), ValueError, "weight must be a floating"),
    ("bias_shape", dict(bias=torch.randn(15)), ValueError, r"bias must be \[D\]"),
    ("residual_shape", dict(residual=torch.randn(2, 11, 16)), ValueError, "residual must have x's shape"),
    ("state_shape", dict(initial_state=torch.randn(2, 16, 3)), ValueError, r"initial_state must be \[N, D, W\]"),
    ("x_2d", dict(x=torch.randn(12, 16)), ValueError, r"x must be \[B, T, D\]"),
    ("x_int", dict(x=torch.ones(2, 12, 16, dtype=torch.int32)), ValueError, "x must be a floating"),
    ("activation", dict(activation="gelu"), ValueError, "activation must be None, 'silu' or 'swish'"),
    ("cu_batch", dict(cu_seqlens=torch.tensor([0, 12])), ValueError, "cu_seqlens requires B == 1"),
    ("cu_dtype", dict(x=torch.randn(1, 12, 16), cu_seqlens=torch.tensor([0., 12.])), ValueError,
     "cu_seqlens must be int32 or int64"),
    ("cu_short", dict(x=torch.randn(1, 12, 16), cu_seqlens=torch.tensor([0])), ValueError, r"cu_seqlens must be 1-D"),
    ("cu_cpu_alone", dict(x=torch.randn(1, 12, 16), cu_seqlens_cpu=torch.tensor([0, 12])), ValueError,
     "cu_seqlens_cpu was given without cu_seqlens"),
    ("cu_decreasing", dict(x=torch.randn(1, 12, 16), cu_seqlens=torch.tensor([0, 8, 5, 12]),
                           cu_seqlens_cpu=torch.tensor([0, 8, 5, 12])), ValueError, "non-decreasing"),
    ("cu_last", dict(x=torch.randn(1, 12, 16), cu_seqlens=torch.tensor([0, 8, 11]),
                     cu_seqlens_cpu=torch.tensor([0, 8, 11])), ValueError, "must end at T=12"),
    ("cu_start", dict(x=torch.randn(1, 12, 16), cu_seqlens=torch.tensor([1, 8, 12]),
                      cu_seqlens_cpu=torch.tensor([1, 8, 12])), ValueError, "must start at 0"),
    ("cu_cpu_len", dict(x=torch.randn(1, 12, 16), cu_seqlens=torch.tensor([0, 8, 12]),
                        cu_seqlens_cpu=torch.tensor([0, 12])), ValueError, r"cu_seqlens_cpu must be \[N\+1\]"),
    ("state_varlen", dict(x=torch.randn(1, 12, 16), cu_seqlens=torch.tensor([0, 8, 12]),
                          initial_state=torch.randn(1, 16, 4)), ValueError, r"initial_state must be \[N, D, W\] = \[2"),
    ("backend", dict(backend="tpu"), ValueError, "backend must be one of"),
    ("x_type", dict(x=[[1.0]]), TypeError, "x must be a tensor"),
    ("weight_type", dict(weight="w"), TypeError, "weight must be a tensor or None"),
    ("activation_type", dict(activation=1), TypeError, "activation must be None or a string"),
]


@needs_ext
@pytest.mark.parametrize("name,kw,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise_naming_the_argument(name, kw, exc, msg):
    x, w = _inputs()
    args = dict(x=x, weight=w)
    args.update(kw)
    with pytest.raises(exc, match=msg):
        cc.causal_conv1d(**args)
    ok, why = cc.is_supported(**args)
    assert not ok and why.startswith("invalid:")


@needs_ext
@pytest.mark.parametrize("kw,msg", [
    (dict(x=torch.randn(3, 2, 16)), r"x must be \[N, D\], \[N, 1, D\] or \[1, N, D\]"),
    (dict(cache=torch.randn(3, 16, 3)), r"cache must be \[N, D, W\]"),
    (dict(weight=torch.randn(16, 6)), "W=6"),
    (dict(residual=torch.randn(3, 15)), "residual must have x's shape"),
    (dict(activation="tanh"), "activation"),
    (dict(cache=torch.randn(3, 16, 1).expand(3, 16, 4)), "overlapping"),
])
def test_update_bad_inputs(kw, msg):
    g = torch.Generator().manual_seed(3)
    args = dict(x=torch.randn(3, 16, generator=g), cache=torch.randn(3, 16, 4, generator=g),
                weight=torch.randn(16, 4, generator=g))
    args.update(kw)
    with pytest.raises(ValueError, match=msg):
        cc.causal_conv1d_update(**args)


@needs_ext
def test_support_op_schema_and_answers():
    ops = _ext.ops()
    x, w = _inputs()
    assert ops.cconv_support(x, w, None, None, None, False, "swish", None, None) == ""
    assert ops.cconv_support(x, w, None, None, None, True, None, None, None) == ""
    assert ops.cconv_support(x, None, None, None, None, False, None, None, None).startswith("unsupported: ")
    assert ops.cconv_support(x, torch.randn(16, 7), None, None, None, False, None, None, None).startswith(
        "invalid: ")
    assert ops.cconv_update_support(x[:, 0], torch.randn(2, 16, 4), None, w, None, "silu") == ""
    assert ops.cconv_update_support(x[:, 0], None, None, w, None, None).startswith("unsupported: ")


def test_warmup_raises_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(RuntimeError):
        cc.warmup(1, 16)
