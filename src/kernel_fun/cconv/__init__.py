"""kernel_fun.cconv: fla's short causal depthwise conv1d (``causal_conv1d``) and its decode step
(``causal_conv1d_update``), served by our Hopper kernels.

    y[t, d] = act(sum_w weight[d, w] * x~[t - W + 1 + w, d] + bias[d]) + residual[t, d]

with act in {None, 'silu', 'swish'}, W in 1..4, x~ the input inside its sequence, reading
``initial_state[n, d, W + pos]`` at positions pos < 0 (slot 0 is padding) and 0 without an initial
state; ``final_state[n, d, w] = x~[T_n - W + w]`` in x's dtype. With ``cu_seqlens`` (B == 1) the
documents packed along T never mix. Sums are fp32; results are bitwise reproducible.

Routing, per call (``causal_conv1d`` takes fla 0.5.2's exact arguments):

1. Invalid input (wrong shapes, dtypes, devices, W outside 1..4, bad cu_seqlens when
   cu_seqlens_cpu is given, B != 1 with cu_seqlens, a keyword fla does not read) raises
   ``ValueError``/``TypeError`` naming the argument, on every path. The checks live in C++
   (``torch.ops.kernel_fun.cconv_support``, for tensors on any device), the keyword check in Python.
2. CPU tensors run the torch reference (``kernel_fun.ref.cconv``), forward and backward by autograd.
3. CUDA tensors run our kernels when the call is supported (``is_supported``), else fla with the
   caller's original arguments (reason logged once at WARNING), else a clear RuntimeError.
4. ``cp_context`` (fla's context parallelism) goes to fla, or with ``KERNEL_FUN_CCONV_CP=1`` to ours
   on any device: one ordinary call per rank around an exchange of W - 1 tokens (``_cp.py``).

Gradients are the exact ones (what autograd of the reference gives), including the gradient of
``final_state``: every slot w flows to x[T_n - W + w] (or to initial_state when T_n < W).
**Deviation from fla:** fla 0.5.2's backward drops the final-state gradient of slot 0 (it reaches
neither x[T_n - W] nor initial_state) and, for T_n < W - 1, sends the other slots to the wrong
tokens; fla also gives initial_state no gradient from final_state. Our results differ from fla's
exactly there; everywhere else they match fla within rounding.

Backward cost: one fused kernel recomputes the pre-activation in registers (no forward re-run),
writes dx and per-CTA fp32 partials of dw/db, and a second kernel reduces them in a fixed order
and computes d initial_state. The autograd node saves only x, weight, bias and initial_state.
"""

from __future__ import annotations

import time

import torch

from kernel_fun import _dispatch, _env, _ext
from kernel_fun.cconv import _cp

__all__ = ["causal_conv1d", "causal_conv1d_update", "is_supported", "warmup"]

FAMILY = "cconv"
# fla 0.6.0 moved the convolution to fla.modules.causal_conv1d (the old names stay as aliases there);
# fla 0.5.2 has fla.modules.convolution. Fallbacks try them in this order.
_FLA_MODULE = ("fla.modules.causal_conv1d", "fla.modules.convolution", "fla.modules.conv")
# Keywords fla's causal_conv1d reads from **kwargs (0.5.2 and 0.6.0): only seq_idx, by its 'mix' and
# 'cuda' backends ('triton' ignores it, and so do our kernels and the CPU reference there). Any other
# keyword is a TypeError naming it, on every path, as Python raises for a misspelt parameter: fla's
# **kwargs would swallow a typo such as activaton="silu" and return the result without activation.
_KNOWN_KWARGS = frozenset({"seq_idx"})
_BACKENDS = ("triton", "cuda", "mix")
_ACT_CODE = {None: 0, "silu": 1, "swish": 1}


class _Unsupported(Exception):
    """A valid call our kernels do not cover (the CUDA path falls back to fla)."""


def _fail(fn: str, exc, msg: str):
    raise exc(f"kernel_fun.cconv.{fn}: {msg}")


def _check_types(fn: str, tensors: dict, activation) -> None:
    for name, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            _fail(fn, TypeError, f"{name} must be a tensor{'' if name == 'x' else ' or None'}, got {type(t).__name__}")
    if tensors.get("x") is None:
        _fail(fn, TypeError, "x must be a tensor, got None")
    if activation is not None and not isinstance(activation, str):
        _fail(fn, TypeError, f"activation must be None or a string, got {type(activation).__name__}")


def _flatten(x: torch.Tensor, weight, residual):
    """fla folds trailing dims into D when x.shape[-1] != weight.shape[0] ('b t ... -> b t (...)');
    the residual follows x's view. Returns (x view, residual view)."""
    if weight is not None and weight.dim() >= 1 and x.dim() > 3 and x.shape[-1] != weight.shape[0]:
        x = x.flatten(2)
    if residual is not None and residual.shape != x.shape and residual.numel() == x.numel():
        residual = residual.reshape(x.shape)
    return x, residual


def _verdict(fn: str, text: str) -> str | None:
    """Turn cconv_support's answer into None (supported), a reason (unsupported) or a ValueError."""
    if not text:
        return None
    kind, _, msg = text.partition(": ")
    if kind == "invalid":
        _fail(fn, ValueError, msg)
    return msg


def _check(x, weight, bias, residual, initial_state, output_final_state, activation, cu_seqlens,
           cu_seqlens_cpu) -> str | None:
    """Validate through the C++ checks; None when our kernels can take the call, else why not.
    Without the extension only the Python-level checks run (the reference / fla check the rest)."""
    if not _ext.available():
        return _ext.status()[1]
    return _verdict("causal_conv1d", _ext.ops().cconv_support(
        x, weight, bias, residual, initial_state, bool(output_final_state), activation, cu_seqlens,
        cu_seqlens_cpu))


def _call_meta(x, weight, bias, residual, initial_state, output_final_state, activation, cu_seqlens) -> tuple:
    """What the support check depends on apart from sizes - each tensor's (dtype, device) or None,
    output_final_state, activation - as constants for ``_plan`` at trace time. Sizes stay out:
    under torch.compile they may be symbolic (a new document count, length or width must neither
    recompile nor break the graph). A compiled graph's size rules are checked when it runs, by
    the kernel op itself (the C++ validation every op repeats, with the same messages)."""
    d = lambda t: None if t is None else (t.dtype, str(t.device))  # noqa: E731
    return (d(x), d(weight), d(bias), d(residual), d(initial_state), d(cu_seqlens), bool(output_final_state),
            activation)


@torch.compiler.assume_constant_result
def _plan(meta: tuple) -> str:
    """cconv_support's verdict ("", "invalid: ..." or "unsupported: ...") for the dtypes and devices
    ``_call_meta`` describes, on meta stand-ins of valid sizes: how a torch.compile'd call is
    routed (a constant at trace time; eager calls check the real tensors, cu_seqlens_cpu's values
    included)."""
    x_m, w_m, b_m, r_m, h_m, cu_m, output_final_state, activation = meta
    ok, why = _ext.status()
    if not ok:
        return f"unsupported: {why}"
    for name, m in (("weight", w_m), ("bias", b_m), ("residual", r_m), ("initial_state", h_m), ("cu_seqlens", cu_m)):
        if m is not None and m[1] != x_m[1]:
            return f"invalid: {name} must be on x's device ({x_m[1]}), got {m[1]}"
    B, T, D, W = 1, 4, 8, 4  # sizes every rule of the C++ check accepts
    stand_in = lambda m, *shape: None if m is None else torch.empty(shape, dtype=m[0], device="meta")  # noqa: E731
    return _ext.ops().cconv_support(stand_in(x_m, B, T, D), stand_in(w_m, D, W), stand_in(b_m, D),
                                    stand_in(r_m, B, T, D), stand_in(h_m, 1, D, W), output_final_state, activation,
                                    stand_in(cu_m, 2), None)


@torch.compiler.assume_constant_result
def _routing_const(has_cp: bool, backend, device: str) -> str | None:
    """The environment switches, cp_context, backend and device, as one trace-time constant under
    torch.compile (the environment is read when a graph is traced)."""
    why = _dispatch.common_reason(FAMILY, True if has_cp else None)
    if why:
        return why
    if backend != "triton":
        return f"backend={backend!r} asks for fla's {backend} implementation"
    if not device.startswith(("cuda", "meta")):
        return f"x is on {device} (kernel-fun's kernels are CUDA; the torch reference serves CPU)"
    return None


def _routing_reason(x, backend, cp_context) -> str | None:
    """Why our CUDA kernels cannot serve this valid call for reasons of routing (None if none)."""
    return _routing_const(cp_context is not None, backend, str(x.device))


def _prepare(x, weight, bias, residual, initial_state, output_final_state, activation, backend,
             cu_seqlens, cu_seqlens_cpu):
    """Validate (raises on invalid input); return (x [B, T, D], residual view, kernel reason):
    the reason is why our kernels cannot take these tensors (None when they can)."""
    _check_types("causal_conv1d", dict(x=x, weight=weight, bias=bias, residual=residual,
                                       initial_state=initial_state, cu_seqlens=cu_seqlens,
                                       cu_seqlens_cpu=cu_seqlens_cpu), activation)
    if backend not in _BACKENDS:
        _fail("causal_conv1d", ValueError, f"backend must be one of {_BACKENDS}, got {backend!r}")
    xf, rf = _flatten(x, weight, residual)
    if torch.compiler.is_compiling():
        # The C++ check on meta stand-ins (a trace-time constant, no graph break); cu_seqlens_cpu's
        # values are not read in a compiled graph (that would be a data-dependent guard).
        return xf, rf, _verdict("causal_conv1d", _plan(_call_meta(xf, weight, bias, rf, initial_state,
                                                                  output_final_state, activation, cu_seqlens)))
    why = _check(xf, weight, bias, rf, initial_state, output_final_state, activation, cu_seqlens,
                 cu_seqlens_cpu)
    return xf, rf, why


def is_supported(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                 activation=None, backend="triton", cu_seqlens=None, cu_seqlens_cpu=None,
                 chunk_indices=None, cp_context=None, **kwargs) -> tuple[bool, str | None]:
    """(True, None) when ``causal_conv1d`` with these arguments runs our CUDA kernels, else
    (False, reason). Never raises: invalid input comes back as (False, 'invalid: ...')."""
    if cp_context is not None and _env.flag(_cp.ENV):  # one ordinary call per rank (cconv/_cp.py)
        try:
            _dispatch.reject_unknown_kwargs("kernel_fun.cconv.causal_conv1d", kwargs, _KNOWN_KWARGS)
            _cp.validate(x, weight, residual, initial_state, output_final_state, cp_context)
        except (TypeError, ValueError) as e:
            return False, f"invalid: {e}"
        return is_supported(x, weight, bias, residual, None, False, activation, backend, cp_context.cu_seqlens,
                            getattr(cp_context, "cu_seqlens_cpu", None))
    try:
        _dispatch.reject_unknown_kwargs("kernel_fun.cconv.causal_conv1d", kwargs, _KNOWN_KWARGS)
        _, _, why = _prepare(x, weight, bias, residual, initial_state, output_final_state, activation,
                             backend, cu_seqlens, cu_seqlens_cpu)
    except (TypeError, ValueError) as e:
        return False, f"invalid: {e}"
    why = _routing_reason(x, backend, cp_context) or why
    return (why is None), why


class _CausalConv1dFn(torch.autograd.Function):
    """Our kernels, forward and backward. Saves only x, weight, bias, initial_state (and
    cu_seqlens): no y, no pre-activation."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, initial_state, cu_seqlens, output_final_state, act):
        B, T, D = x.shape
        W = weight.shape[1]
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        y = torch.empty((B, T, D), dtype=x.dtype, device=x.device)
        ht = torch.empty((N, D, W), dtype=x.dtype, device=x.device) if output_final_state else None
        _ext.ops().cconv_fwd(x, weight, bias, residual, initial_state, cu_seqlens, act, y, ht)
        ctx.save_for_backward(x, weight, bias, initial_state, cu_seqlens)
        ctx.act = act
        ctx.residual_dtype = residual.dtype if residual is not None else None
        return y, ht

    @staticmethod
    def backward(ctx, dy, dht):
        x, weight, bias, initial_state, cu_seqlens = ctx.saved_tensors
        if dy.dtype != x.dtype:
            dy = dy.to(x.dtype)
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dw = torch.empty(weight.shape, dtype=weight.dtype, device=x.device)
        db = torch.empty(bias.shape, dtype=bias.dtype, device=x.device) if bias is not None else None
        dh0 = (torch.empty(initial_state.shape, dtype=initial_state.dtype, device=x.device)
               if initial_state is not None else None)
        _ext.ops().cconv_bwd(x, weight, bias, initial_state, cu_seqlens, dy, dht, ctx.act, dx, dw, db, dh0)
        dres = None
        if ctx.residual_dtype is not None and ctx.needs_input_grad[3]:
            dres = dy if dy.dtype == ctx.residual_dtype else dy.to(ctx.residual_dtype)
        return dx, dw, db, dres, dh0, None, None, None


def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                  activation=None, backend="triton", cu_seqlens=None, cu_seqlens_cpu=None,
                  chunk_indices=None, cp_context=None, **kwargs):
    """fla's ``causal_conv1d`` (same arguments, same results); returns (y, final_state or None).
    ``chunk_indices`` is accepted and not needed (our kernels find sequences themselves);
    ``cu_seqlens_cpu``, when given, is validated on the host, so no device sync ever happens.
    ``seq_idx`` (a keyword fla reads for its 'mix' and 'cuda' backends) goes to fla with those
    backends and is ignored with 'triton', as fla ignores it."""
    _dispatch.reject_unknown_kwargs("kernel_fun.cconv.causal_conv1d", kwargs, _KNOWN_KWARGS)
    if cp_context is not None and _env.flag(_cp.ENV):
        return _cp_call(x, weight, bias, residual, initial_state, output_final_state, activation, cp_context)
    xf, rf, why = _prepare(x, weight, bias, residual, initial_state, output_final_state, activation,
                           backend, cu_seqlens, cu_seqlens_cpu)
    # Meta tensors (shape inference) take our ops' fakes when the extension is there, exactly the
    # GPU path's output shapes; else the reference, which also runs on meta (dense input).
    if x.device.type == "cpu" or (x.device.type == "meta" and not _ext.available()):
        # The reference computes any valid call (float64 too) as fla's triton backend does; what
        # only fla's context parallelism or its other backends read, it cannot.
        extra = ("cp_context" if cp_context is not None else
                 f"seq_idx with backend={backend!r}" if kwargs.get("seq_idx") is not None and backend != "triton"
                 else None)
        if extra:
            hint = "; KERNEL_FUN_CCONV_CP=1 runs it on ours" if cp_context is not None else ""
            raise RuntimeError(f"kernel_fun.cconv.causal_conv1d: {extra} is not supported on CPU "
                               f"(the torch reference serves CPU tensors; fla is CUDA-only{hint})")
        if weight is None:
            _fail("causal_conv1d", ValueError, "weight is required on CPU (fla has no weight-free path)")
        from kernel_fun.ref.cconv import causal_conv1d_ref

        y, ht = causal_conv1d_ref(xf, weight, bias, rf, initial_state, output_final_state, activation,
                                  cu_seqlens)
        return y.view(x.shape), ht
    why = _routing_reason(x, backend, cp_context) or why
    if why is not None:
        return _dispatch.fallback(
            FAMILY, why, _FLA_MODULE, "causal_conv1d", (x,),
            dict(weight=weight, bias=bias, residual=residual, initial_state=initial_state,
                 output_final_state=output_final_state, activation=activation, backend=backend,
                 cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
                 cp_context=cp_context, **kwargs))
    cu = cu_seqlens if cu_seqlens is None or cu_seqlens.is_contiguous() else cu_seqlens.contiguous()
    y, ht = _CausalConv1dFn.apply(xf, weight, bias, rf, initial_state, cu, bool(output_final_state),
                                  _ACT_CODE[activation])
    if not torch.compiler.is_compiling() and x.is_cuda:  # after the kernel launched
        B, T, D = xf.shape
        _dispatch.log_engaged(FAMILY, f"B={B} T={T} D={D} W={weight.shape[1]} dtype={str(x.dtype)[6:]} "
                                      f"activation={activation} varlen={cu_seqlens is not None}")
    return y.view(x.shape), ht


def _cp_call(x, weight, bias, residual, initial_state, output_final_state, activation, cp_context):
    """fla's context-parallel conv on ours (cconv/_cp.py): one call of causal_conv1d per rank with the
    previous rank's tails as document 0's initial state, the gradients exchanged in the backward."""
    _cp.validate(x, weight, residual, initial_state, output_final_state, cp_context)

    def conv(xs, w, b, r, h0, act, cu, cu_cpu):
        return causal_conv1d(xs, w, b, r, h0, False, act, "triton", cu, cu_cpu)

    return _cp.ConvCP.apply(x, weight, bias, residual, conv, activation, cp_context), None


def causal_conv1d_update(x, cache, residual=None, weight=None, bias=None, activation=None):
    """fla's ``causal_conv1d_update``: one decode step. x is [N, D], [N, 1, D] or [1, N, D];
    cache [N, D, W] is shifted left by one slot with x entering slot W-1, IN PLACE, and returned.
    y = act(sum_w weight[:, w] * cache[..., w] + bias) + residual has x's shape and dtype.
    Inference only (no autograd through our kernel, as in fla)."""
    _check_types("causal_conv1d_update", dict(x=x, cache=cache, residual=residual, weight=weight, bias=bias),
                 activation)
    xf, rf = _flatten(x, weight, residual)
    why = None
    if _ext.available():
        why = _verdict("causal_conv1d_update",
                       _ext.ops().cconv_update_support(xf, cache, rf, weight, bias, activation))
    else:
        why = _ext.status()[1]
    if not x.is_cuda:
        if weight is None or cache is None:
            _fail("causal_conv1d_update", ValueError, "weight and cache are required on CPU")
        from kernel_fun.ref.cconv import causal_conv1d_update_ref

        y, new_cache = causal_conv1d_update_ref(xf, cache, rf, weight, bias, activation)
        with torch.no_grad():
            cache.copy_(new_cache)
        return y.view(x.shape), cache
    why = why or _dispatch.common_reason(FAMILY, None)
    if why is not None:
        return _dispatch.fallback(FAMILY, why, _FLA_MODULE, "causal_conv1d_update", (x, cache),
                                  dict(residual=residual, weight=weight, bias=bias, activation=activation))
    _dispatch.log_engaged(FAMILY, f"decode N={xf.numel() // max(xf.shape[-1], 1)} D={xf.shape[-1]} "
                                  f"W={weight.shape[1]} dtype={str(x.dtype)[6:]} activation={activation}")
    y = torch.empty(xf.shape, dtype=x.dtype, device=x.device)
    _ext.ops().cconv_update(xf, cache, rf, weight, bias, _ACT_CODE[activation], y)
    return y.view(x.shape), cache


def warmup(B, T, D=(2048,), W=4, dtype=torch.bfloat16, activation="silu") -> float:
    """Run forward+backward once per D (and a decode step) so first-call costs (module loading,
    occupancy queries) are paid now; returns the seconds spent. Raises RuntimeError when nothing
    could be prepared (no CUDA device, extension unavailable, or the family disabled)."""
    if not torch.cuda.is_available():
        raise RuntimeError("kernel_fun.cconv.warmup: no CUDA device")
    ok, why = _ext.status()
    if not ok:
        raise RuntimeError(f"kernel_fun.cconv.warmup: {why}")
    off = _env.family_disabled(FAMILY)
    if off:
        raise RuntimeError(f"kernel_fun.cconv.warmup: family disabled by {off}")
    Ds = (D,) if isinstance(D, int) else tuple(D)
    if not Ds:
        raise RuntimeError("kernel_fun.cconv.warmup: no D given")
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    for d in Ds:
        x = torch.randn(B, T, d, device=dev, dtype=dtype, requires_grad=True)
        w = torch.randn(d, W, device=dev, dtype=dtype, requires_grad=True)
        ok, why = is_supported(x, w, activation=activation)
        if not ok:
            raise RuntimeError(f"kernel_fun.cconv.warmup: D={d} not supported: {why}")
        y, _ = causal_conv1d(x, w, activation=activation)
        y.backward(torch.ones_like(y))
        cache = torch.zeros(B, d, W, device=dev, dtype=dtype)
        causal_conv1d_update(x.detach()[:, -1], cache, weight=w.detach(), activation=activation)
        del x, w, y, cache
    torch.cuda.synchronize()
    return time.perf_counter() - t0
