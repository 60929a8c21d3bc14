"""The causal conv1d family on our sm_90a kernels: forward, backward and the decode step against the
fp64 reference (kernel_fun.ref.cconv, outputs rounded to the tested tensor's dtype before the
rel-RMS), odd lengths, T < W, D not a multiple of 8, varlen with empty and one-token documents,
strided x and dy, every dtype combination, NaN-poisoned outputs, bitwise determinism, a side
stream, opcheck, CUDA-graph replay, bad inputs, and parity with fla (without final-state
gradients, where fla deviates; see kernel_fun.cconv's docstring). Every call of the public
functions checked here runs inside kernel_fun.strict() and counts our ops' launches
(helpers.our_launches), so no test can pass on fla's output after a fallback."""

from __future__ import annotations

import pytest
import torch

from helpers import CCONV_TOL, nan_like, our_launches, rel_rms

pytestmark = pytest.mark.gpu

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
DEV = "cuda"


def _cc():
    import kernel_fun.cconv as cc
    return cc


def _ops():
    from kernel_fun import _ext
    return _ext.ops()


def make(B=2, T=64, D=128, W=4, dtype=BF16, wdtype=None, bias=False, residual=False, h0=False, cu=None,
         cu_dtype=torch.int32, layout="contig", rdtype=None, hdtype=None, seed=0):
    """Inputs of one case on CUDA; layout: contig | slice (a [.., 3D] projection's middle third) |
    offset (misaligned slice) | transposed (channel stride != 1)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    if cu is not None:
        B, T = 1, cu[-1]

    def rnd(*shape):  # converted before any slicing: .to() of a view would copy it contiguous
        return torch.randn(*shape, device=DEV, generator=g).to(dtype)

    if layout == "contig":
        x = rnd(B, T, D)
    elif layout == "slice":
        x = rnd(B, T, 3 * D)[:, :, D:2 * D]
    elif layout == "offset":
        x = rnd(B, T, D + 1)[:, :, 1:]
    elif layout == "transposed":
        x = rnd(B, D, T).transpose(1, 2)
    else:
        raise ValueError(layout)
    if layout != "contig" and T * D > 1:
        assert not x.is_contiguous()
    wdtype = wdtype or dtype
    inp = dict(x=x, weight=(torch.randn(D, W, device=DEV, generator=g) / W ** 0.5).to(wdtype))
    N = B if cu is None else len(cu) - 1
    if bias:
        inp["bias"] = (0.5 * torch.randn(D, device=DEV, generator=g)).to(wdtype)
    if residual:
        inp["residual"] = torch.randn(B, T, D, device=DEV, generator=g).to(rdtype or dtype)
    if h0:
        inp["initial_state"] = torch.randn(N, D, W, device=DEV, generator=g).to(hdtype or dtype)
    if cu is not None:
        inp["cu_seqlens"] = torch.tensor(cu, dtype=cu_dtype, device=DEV)
    return inp


def _leaves(inp):
    out = {}
    for k, v in inp.items():
        if k == "cu_seqlens":
            out[k] = v
        else:
            out[k] = v.detach().clone().requires_grad_(True) if k != "x" else v.detach().requires_grad_(True)
    return out


def run(fn, inp, activation=None, final=False, dy=None, dht=None, grads=True, **kw):
    """(outputs, grads) of fn(**inp); dy and dht are handed to autograd as they are (strides too)."""
    leaves = _leaves(inp)
    y, ht = fn(**leaves, activation=activation, output_final_state=final, **kw)
    outs = {"y": y}
    if final:
        outs["final_state"] = ht
    if not grads:
        return outs, {}
    heads, seeds = [y], [dy if dy.dtype == y.dtype else dy.to(y.dtype)]
    if final and dht is not None:
        heads.append(ht)
        seeds.append(dht if dht.dtype == ht.dtype else dht.to(ht.dtype))
    names = [k for k in leaves if k != "cu_seqlens"]
    gs = torch.autograd.grad(heads, [leaves[k] for k in names], seeds, allow_unused=True)
    return outs, {"d" + k: g for k, g in zip(names, gs)}


def ref64(inp, activation=None, final=False, dy=None, dht=None, grads=True):
    from kernel_fun.ref.cconv import causal_conv1d_ref

    def f(x, weight, bias=None, residual=None, initial_state=None, cu_seqlens=None, activation=None,
          output_final_state=False):
        return causal_conv1d_ref(x, weight, bias, residual, initial_state, output_final_state, activation, cu_seqlens)

    inp64 = {k: (v if k == "cu_seqlens" else v.detach().double()) for k, v in inp.items()}
    return run(f, inp64, activation, final, dy, dht, grads)


def ours(inp, activation=None, final=False, dy=None, dht=None, grads=True, **kw):
    """run() on kernel_fun.cconv.causal_conv1d, proven to launch our forward (and our backward when
    gradients are taken) exactly once."""
    with our_launches(**({"cconv_fwd": 1, "cconv_bwd": 1} if grads else {"cconv_fwd": 1})):
        return run(_cc().causal_conv1d, inp, activation, final, dy, dht, grads, **kw)


def assert_match(ref, got, tol=CCONV_TOL, what=""):
    for k, r in ref.items():
        o = got[k]
        assert o is not None, f"{what}{k}: missing"
        assert o.shape == r.shape, f"{what}{k}: shape {tuple(o.shape)} != {tuple(r.shape)}"
        err = rel_rms(r.to(o.dtype), o)  # the reference rounded to the tested tensor's dtype
        assert err <= tol, f"{what}{k}: rel-RMS {err:.3e} > {tol:.1e}"


def grad_seeds(inp, final):
    x = inp["x"]
    g = torch.Generator(device=DEV).manual_seed(123)
    dy = torch.randn(x.shape, device=DEV, generator=g).to(x.dtype)
    dht = None
    if final:
        N = inp["initial_state"].shape[0] if "initial_state" in inp else (
            x.shape[0] if "cu_seqlens" not in inp else inp["cu_seqlens"].numel() - 1)
        dht = torch.randn(N, x.shape[2], inp["weight"].shape[1], device=DEV, generator=g).to(x.dtype)
    return dy, dht


def check_vs_ref(inp, activation, final, tol=CCONV_TOL, **kw):
    dy, dht = grad_seeds(inp, final)
    ro, rg = ref64(inp, activation, final, dy, dht)
    oo, og = ours(inp, activation, final, dy, dht, **kw)
    assert_match(ro, oo, tol)
    assert_match(rg, og, tol)
    return oo, og


# ------------------------------------------------------------------ forward + backward vs fp64

SHAPES = [(2, 1, 64), (2, 3, 64), (1, 63, 60), (2, 1000, 100), (1, 1134, 256), (2, 63, 8192), (3, 2, 128),
          (1, 257, 2048)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B%dT%dD%d" % s)
@pytest.mark.parametrize("W", [1, 2, 3, 4])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_vs_reference(shape, W, activation):
    B, T, D = shape
    i = SHAPES.index(shape) + W  # rotate the optional inputs through the grid
    opts = dict(bias=i % 2 == 0, residual=i % 3 == 0, h0=i % 2 == 1)
    final = i % 4 < 2
    check_vs_ref(make(B, T, D, W, **opts), activation, final)


@pytest.mark.parametrize("T", [1, 2, 3])
@pytest.mark.parametrize("W", [2, 3, 4])
def test_short_sequences_with_states(T, W):
    """T < W: final_state reads the initial state; its gradient flows back into initial_state."""
    check_vs_ref(make(3, T, 64, W, bias=True, h0=True), "silu", True)


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
@pytest.mark.parametrize("wdtype", [BF16, F16, F32, F64], ids=str)
def test_dtype_combinations(dtype, wdtype):
    other = F32 if dtype != F32 else BF16
    inp = make(2, 130, 96, 4, dtype=dtype, wdtype=wdtype, bias=True, residual=True, h0=True,
               rdtype=other if wdtype == F32 else dtype, hdtype=other if wdtype != F32 else dtype, seed=3)
    _, og = check_vs_ref(inp, "silu", True)
    assert og["dweight"].dtype == wdtype and og["dbias"].dtype == wdtype
    assert og["dinitial_state"].dtype == inp["initial_state"].dtype
    assert og["dresidual"].dtype == inp["residual"].dtype


@pytest.mark.parametrize("cu", [[0, 1, 64, 64, 300, 301, 1000], [0, 5000, 5001, 8000], [0, 1], [0, 0, 7, 7]],
                         ids=["mixed", "long", "one_token", "empty_docs"])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("host", [False, True], ids=["device_cu", "host_cu"])
def test_varlen(cu, cu_dtype, host):
    inp = make(cu=cu, D=256, W=4, bias=True, h0=True, cu_dtype=cu_dtype, seed=1)
    kw = {"cu_seqlens_cpu": torch.tensor(cu, dtype=cu_dtype)} if host else {}
    check_vs_ref(inp, "silu", True, **kw)


@pytest.mark.parametrize("layout", ["slice", "offset", "transposed"])
@pytest.mark.parametrize("D", [128, 100])
def test_strided_x_and_dy(layout, D):
    inp = make(2, 300, D, 4, bias=True, layout=layout, seed=2)
    x = inp["x"]
    big = torch.randn(x.shape[0], x.shape[1], 2 * D + 3, device=DEV, dtype=x.dtype)
    dy = big[:, :, 3:3 + D]  # non-contiguous, unaligned gradient
    assert not dy.is_contiguous()
    ro, rg = ref64(inp, "silu", False, dy)
    oo, og = ours(inp, "silu", False, dy)
    assert_match(ro, oo)
    assert_match(rg, og)


def test_projection_slice_is_not_copied():
    """A [.., D] slice of a fused projection feeds the kernels as is (no contiguous copy)."""
    inp = make(2, 256, 128, 4, layout="slice")
    x = inp["x"]
    before = torch.cuda.memory_allocated()
    with torch.no_grad(), our_launches(cconv_fwd=1):
        y, _ = _cc().causal_conv1d(x, inp["weight"], activation="silu")
    grew = torch.cuda.memory_allocated() - before
    assert grew <= y.numel() * y.element_size() + 4096, f"{grew} bytes allocated: x was copied"


def test_multidim_x_folds_trailing_dims():
    """fla folds x [B, T, H, K] into D = H*K when weight is [H*K, W]."""
    g = torch.Generator(device=DEV).manual_seed(5)
    x = torch.randn(2, 70, 4, 32, device=DEV, generator=g).to(BF16).requires_grad_(True)
    w = torch.randn(128, 4, device=DEV, generator=g).to(BF16).requires_grad_(True)
    with our_launches(cconv_fwd=1, cconv_bwd=1):
        y, _ = _cc().causal_conv1d(x, w, activation="silu")
        y.sum().backward()
    assert y.shape == x.shape
    from kernel_fun.ref.cconv import causal_conv1d_ref
    yr, _ = causal_conv1d_ref(x.detach().double().flatten(2), w.detach().double(), activation="silu")
    assert rel_rms(yr.to(BF16), y.flatten(2)) <= CCONV_TOL
    assert x.grad.shape == x.shape


def test_residual_gradient_is_dy():
    inp = make(2, 100, 64, 3, residual=True)
    dy, _ = grad_seeds(inp, False)
    _, og = ours(inp, "silu", False, dy)
    assert torch.equal(og["dresidual"], dy)


# ------------------------------------------------------------------ ops: poison, determinism, streams

def _op_args(inp, activation=1, final=True):
    x = inp["x"]
    B, T, D = x.shape
    W = inp["weight"].shape[1]
    N = B if "cu_seqlens" not in inp else inp["cu_seqlens"].numel() - 1
    y = nan_like(torch.empty(B, T, D, device=DEV, dtype=x.dtype))
    ht = nan_like(torch.empty(N, D, W, device=DEV, dtype=x.dtype)) if final else None
    return (x, inp["weight"], inp.get("bias"), inp.get("residual"), inp.get("initial_state"), inp.get("cu_seqlens"),
            activation, y, ht)


def _bwd_args(inp, activation=1, final=True):
    x = inp["x"]
    B, T, D = x.shape
    W = inp["weight"].shape[1]
    N = B if "cu_seqlens" not in inp else inp["cu_seqlens"].numel() - 1
    dy, dht = grad_seeds(inp, final)
    h0, bias = inp.get("initial_state"), inp.get("bias")
    return (x, inp["weight"], bias, h0, inp.get("cu_seqlens"), dy, dht, activation,
            nan_like(torch.empty_like(x, memory_format=torch.contiguous_format)),
            nan_like(torch.empty(D, W, device=DEV, dtype=inp["weight"].dtype)),
            nan_like(bias) if bias is not None else None,
            nan_like(h0) if h0 is not None else None)


@pytest.mark.parametrize("D", [256, 100])
@pytest.mark.parametrize("cu", [None, [0, 1, 40, 40, 200]], ids=["batch", "varlen"])
def test_every_output_element_written(D, cu):
    inp = make(2, 200, D, 4, bias=True, residual=True, h0=True, cu=cu)
    fa = _op_args(inp)
    _ops().cconv_fwd(*fa)
    assert torch.isfinite(fa[7]).all() and torch.isfinite(fa[8]).all()
    ba = _bwd_args(inp)
    _ops().cconv_bwd(*ba)
    for t in ba[8:]:
        assert torch.isfinite(t).all()


def test_bitwise_deterministic():
    inp = make(4, 2048, 1024, 4, bias=True, h0=True, seed=7)
    dy, dht = grad_seeds(inp, True)
    a_o, a_g = ours(inp, "silu", True, dy, dht)
    for _ in range(2):
        b_o, b_g = ours(inp, "silu", True, dy, dht)
        for k in a_o:
            assert torch.equal(a_o[k], b_o[k]), k
        for k in a_g:
            assert torch.equal(a_g[k], b_g[k]), k


def test_side_stream_matches_default_stream():
    inp = make(2, 500, 256, 4, bias=True, h0=True)
    dy, dht = grad_seeds(inp, True)
    a_o, a_g = ours(inp, "silu", True, dy, dht)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        b_o, b_g = ours(inp, "silu", True, dy, dht)
    s.synchronize()
    for k in a_o:
        assert torch.equal(a_o[k], b_o[k]), k
    for k in a_g:
        assert torch.equal(a_g[k], b_g[k]), k


def test_opcheck():
    inp = make(2, 37, 64, 4, bias=True, residual=True, h0=True)
    torch.library.opcheck(torch.ops.kernel_fun.cconv_fwd.default, _op_args(inp))
    torch.library.opcheck(torch.ops.kernel_fun.cconv_bwd.default, _bwd_args(inp))
    x = torch.randn(3, 64, device=DEV, dtype=BF16)
    cache = torch.randn(3, 64, 4, device=DEV, dtype=BF16)
    torch.library.opcheck(torch.ops.kernel_fun.cconv_update.default,
                          (x, cache, None, inp["weight"], inp["bias"], 1, torch.empty_like(x)))


def test_cuda_graph_replay_equals_eager():
    inp = make(2, 300, 256, 4, bias=True, h0=True)
    leaves = _leaves(inp)
    dy, dht = grad_seeds(inp, True)
    cc = _cc()

    def step():
        y, ht = cc.causal_conv1d(**leaves, activation="silu", output_final_state=True)
        gs = torch.autograd.grad((y, ht), [leaves["x"], leaves["weight"], leaves["bias"], leaves["initial_state"]],
                                 (dy, dht))
        return (y, ht) + tuple(gs)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with our_launches(cconv_fwd=1, cconv_bwd=1):  # what the graph holds
        with torch.cuda.graph(graph):
            captured = step()
    with our_launches(cconv_fwd=1, cconv_bwd=1):
        eager = step()
    with torch.no_grad():
        leaves["x"].add_(1.0)  # replay reads the new values
    with our_launches(cconv_fwd=1, cconv_bwd=1):
        eager2 = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager2):
        assert torch.equal(a, b)
    assert not torch.equal(eager[0], eager2[0])


# ------------------------------------------------------------------ decode step

@pytest.mark.parametrize("xshape", ["ND", "N1D", "1ND"])
@pytest.mark.parametrize("W", [1, 2, 3, 4])
@pytest.mark.parametrize("cdtype", [BF16, F32], ids=str)
def test_update_vs_reference(xshape, W, cdtype):
    from kernel_fun.ref.cconv import causal_conv1d_update_ref

    g = torch.Generator(device=DEV).manual_seed(W)
    N, D = 5, 100
    x2 = torch.randn(N, D, device=DEV, generator=g).to(BF16)
    x = {"ND": x2, "N1D": x2[:, None], "1ND": x2[None]}[xshape]
    cache = torch.randn(N, D, W, device=DEV, generator=g).to(cdtype)
    w = torch.randn(D, W, device=DEV, generator=g).to(BF16)
    b = torch.randn(D, device=DEV, generator=g).to(F32)
    res = torch.randn(x.shape, device=DEV, generator=g).to(BF16)
    yr, cr = causal_conv1d_update_ref(x.double(), cache.double(), res.double(), w.double(), b.double(), "silu")
    ptr = cache.data_ptr()
    with our_launches(cconv_update=1):
        y, c = _cc().causal_conv1d_update(x, cache, res, w, b, "silu")
    assert c is cache and cache.data_ptr() == ptr
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_rms(yr.to(y.dtype), y) <= CCONV_TOL
    assert torch.equal(cr.to(cdtype), cache)  # a pure shift: exact


def test_update_chain_equals_forward():
    """Decoding token by token from the prefill's final state reproduces the full forward."""
    inp = make(3, 40, 64, 4, bias=True)
    cc = _cc()
    with torch.no_grad(), our_launches(cconv_fwd=2, cconv_update=10):
        y_full, _ = cc.causal_conv1d(inp["x"], inp["weight"], inp["bias"], activation="silu")
        _, cache = cc.causal_conv1d(inp["x"][:, :30], inp["weight"], inp["bias"], activation="silu",
                                    output_final_state=True)
        for t in range(30, 40):
            y_t, cache = cc.causal_conv1d_update(inp["x"][:, t], cache, weight=inp["weight"], bias=inp["bias"],
                                                 activation="silu")
            assert rel_rms(y_full[:, t].double(), y_t.double()) <= CCONV_TOL


# ------------------------------------------------------------------ front: routing and bad inputs

def test_engaged_for_the_kda_layer_call():
    """is_supported says yes, and the call then really launches our forward and backward (counted
    in C++), in strict mode (a fallback to fla would raise)."""
    import kernel_fun
    from kernel_fun import _ext

    inp = make(2, 64, 256, 4)
    ok, why = _cc().is_supported(inp["x"], inp["weight"], activation="silu")
    assert ok, why
    x = inp["x"].detach().requires_grad_()
    before = _ext.op_calls()
    with kernel_fun.strict():
        y, _ = _cc().causal_conv1d(x, inp["weight"], activation="silu")
        y.float().sum().backward()
    after = _ext.op_calls()
    assert (after["cconv_fwd"] - before["cconv_fwd"], after["cconv_bwd"] - before["cconv_bwd"]) == (1, 1)


def test_warmup_prepares_and_times():
    """warmup runs forward, backward and a decode step per D (counted), and returns its time."""
    from kernel_fun import _ext

    before = _ext.op_calls()
    secs = _cc().warmup(1, 64, D=(64, 100), W=4)
    after = _ext.op_calls()
    assert {k: after[k] - before[k] for k in ("cconv_fwd", "cconv_bwd", "cconv_update")} == \
        {"cconv_fwd": 2, "cconv_bwd": 2, "cconv_update": 2}
    assert isinstance(secs, float) and 0 < secs < 600


def test_float64_x_is_unsupported_not_invalid():
    inp = make(1, 16, 64, 4, dtype=F64)
    ok, why = _cc().is_supported(inp["x"], inp["weight"])
    assert not ok and "float64" in why


@pytest.mark.parametrize("case,exc,word", [  # word: the message after "causal_conv1d: " (a regex)
    ("W5", ValueError, "weight has W=5 taps"),
    ("weight_shape", ValueError, r"weight must be \[D, W\] = \[64, W\]"),
    ("weight_cpu", ValueError, r"weight must be on x's device \(cuda:0\)"),
    ("bias_device", ValueError, r"bias must be on x's device \(cuda:0\)"),
    ("residual_shape", ValueError, r"residual must have x's shape \[2, 20, 64\]"),
    ("state_shape", ValueError, r"initial_state must be \[N, D, W\] = \[2, 64, 4\]"),
    ("cu_batch", ValueError, "cu_seqlens requires B == 1"),
    ("cu_host_decreasing", ValueError, "cu_seqlens must be non-decreasing"),
    ("cu_host_last", ValueError, "cu_seqlens must end at T=20"),
    ("activation", ValueError, "activation must be None, 'silu' or 'swish', got 'relu'"),
    ("x_int", ValueError, "x must be a floating tensor"),
    ("x_type", TypeError, "x must be a tensor, got list"),
])
def test_bad_inputs_raise_naming_the_argument(case, exc, word):
    inp = make(2, 20, 64, 4)
    x, w = inp["x"], inp["weight"]
    kw = {}
    if case == "W5":
        w = torch.randn(64, 5, device=DEV, dtype=BF16)
    elif case == "weight_shape":
        w = torch.randn(63, 4, device=DEV, dtype=BF16)
    elif case == "weight_cpu":
        w = w.cpu()
    elif case == "bias_device":
        kw["bias"] = torch.randn(64)
    elif case == "residual_shape":
        kw["residual"] = torch.randn(2, 19, 64, device=DEV, dtype=BF16)
    elif case == "state_shape":
        kw["initial_state"] = torch.randn(3, 64, 4, device=DEV, dtype=BF16)
    elif case == "cu_batch":
        kw["cu_seqlens"] = torch.tensor([0, 20], device=DEV, dtype=torch.int32)
    elif case == "cu_host_decreasing":
        x = x[:1]
        kw["cu_seqlens"] = torch.tensor([0, 12, 8, 20], device=DEV, dtype=torch.int32)
        kw["cu_seqlens_cpu"] = kw["cu_seqlens"].cpu()
    elif case == "cu_host_last":
        x = x[:1]
        kw["cu_seqlens"] = torch.tensor([0, 12, 19], device=DEV, dtype=torch.int32)
        kw["cu_seqlens_cpu"] = kw["cu_seqlens"].cpu()
    elif case == "activation":
        kw["activation"] = "relu"
    elif case == "x_int":
        x = torch.ones(2, 20, 64, device=DEV, dtype=torch.int32)
    elif case == "x_type":
        x = x.tolist()
    with pytest.raises(exc, match="causal_conv1d: " + word):
        _cc().causal_conv1d(x, w, **kw)


# ------------------------------------------------------------------ parity with fla

def _fla():
    from fla.modules.convolution import causal_conv1d, causal_conv1d_update
    return causal_conv1d, causal_conv1d_update


# Few cases on purpose: every new (D, W, length, flags) key costs fla a Triton autotune.
PARITY = [
    (dict(B=2, T=1000, D=256, W=4, bias=True, residual=True), "silu"),
    (dict(cu=[0, 1, 300, 301, 1000], D=256, W=4, h0=True), "silu"),
    (dict(B=2, T=500, D=128, W=3, dtype=F32, layout="slice"), None),
]


@pytest.mark.fla
@pytest.mark.parametrize("case,activation", PARITY, ids=["batch", "varlen_h0", "fp32_slice"])
def test_parity_with_fla(case, activation):
    """Same inputs through fla and ours; the loss has no final-state term (fla drops its slot-0
    gradient). fla rounds the recomputed pre-activation to x's dtype in its backward, so gradients
    agree to that rounding (5e-3); forward outputs to 1e-3."""
    fla_conv, _ = _fla()
    inp = make(**case)
    dy, _ = grad_seeds(inp, False)
    fo, fg = run(fla_conv, inp, activation, True, dy)
    oo, og = ours(inp, activation, True, dy)
    assert_match(fo, oo, CCONV_TOL, "fla vs ours: ")
    assert_match({k: v for k, v in fg.items() if v is not None}, og, 5e-3, "fla vs ours: ")


@pytest.mark.fla
def test_fallback_is_bitwise_fla(monkeypatch):
    fla_conv, _ = _fla()
    inp = make(2, 200, 128, 4, bias=True)
    ref, _ = fla_conv(inp["x"], inp["weight"], inp["bias"], activation="silu")
    monkeypatch.setenv("KERNEL_FUN_CCONV_DISABLE", "1")
    ok, why = _cc().is_supported(inp["x"], inp["weight"], inp["bias"], activation="silu")
    assert not ok and "KERNEL_FUN_CCONV_DISABLE" in why
    got, _ = _cc().causal_conv1d(inp["x"], inp["weight"], inp["bias"], activation="silu")
    assert torch.equal(ref, got)
    # a keyword fla's function does not read is a TypeError on the fallback path too (fla's **kwargs
    # would swallow it: a misspelt `activaton` would silently drop the activation)
    with pytest.raises(TypeError, match="'some_new_flag'"):
        _cc().causal_conv1d(inp["x"], inp["weight"], inp["bias"], activation="silu", some_new_flag=1)


@pytest.mark.fla
def test_update_parity_with_fla():
    _, fla_update = _fla()
    g = torch.Generator(device=DEV).manual_seed(9)
    x = torch.randn(4, 1, 256, device=DEV, generator=g).to(BF16)
    cache = torch.randn(4, 256, 4, device=DEV, generator=g).to(BF16)
    w = torch.randn(256, 4, device=DEV, generator=g).to(BF16)
    b = torch.randn(256, device=DEV, generator=g).to(BF16)
    c1, c2 = cache.clone(), cache.clone()
    yf, c1 = fla_update(x, c1, None, w, b, "silu")
    with our_launches(cconv_update=1):
        yo, c2 = _cc().causal_conv1d_update(x, c2, None, w, b, "silu")
    assert rel_rms(yf, yo) <= CCONV_TOL
    assert torch.equal(c1, c2)
