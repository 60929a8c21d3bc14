"""kernel_fun.kda: fla's ``chunk_kda`` (Kimi Delta Attention), served by our Hopper kernels.

``chunk_kda`` takes fla 0.5.2's exact arguments and returns fla's results. Routing, per call:

1. Invalid input (a wrong shape, dtype, device, bad cu_seqlens, a bad flag combination) raises
   ``ValueError``/``TypeError`` naming the argument, on every path.
2. CPU tensors run the torch reference (``kernel_fun.ref.kda``), forward and backward through
   autograd, in the inputs' precision (float32/float64 work).
3. CUDA tensors run our kernels when the call is supported (see ``is_supported``), else fla with
   the caller's original arguments (reason logged once at WARNING), else a clear error.

Calls that need gradients run our backward too (kernel_fun::kda_backward, registered as the
autograd formula of kernel_fun::kda_forward), under the same support rules.
"""

from __future__ import annotations

import functools
import inspect
import time
import warnings

import torch

from kernel_fun import _dispatch, _env, _ext
from kernel_fun.kda import _cp
from kernel_fun.kda._options import KdaOptions, launch_switches, with_max_seq_len

__all__ = ["chunk_kda", "is_supported", "warmup"]

FAMILY = "kda"
_FLA = ("fla.ops.kda", "chunk_kda")
# Keyword arguments fla's chunk_kda reads from **kwargs (0.5.2 and 0.6.0); any other keyword is a
# TypeError naming it, as Python raises for a misspelt parameter, on every path (a typo such as
# dt_bais= would otherwise give the no-bias result).
_KNOWN_KWARGS = frozenset({"A_log", "dt_bias", "chunk_size"})


def _take_kwargs(kwargs: dict, state_v_first: bool) -> bool:
    """Check chunk_kda's **kwargs in place: fla's deprecated transpose_state_layout is honoured (as
    state_v_first, fla's rule: not both); an unknown keyword raises TypeError. Returns state_v_first."""
    if "transpose_state_layout" in kwargs:
        value = kwargs.pop("transpose_state_layout")
        if state_v_first:
            _fail(ValueError, "cannot pass both state_v_first and the deprecated transpose_state_layout")
        warnings.warn("chunk_kda: `transpose_state_layout` is deprecated and renamed to `state_v_first`.",
                      DeprecationWarning, stacklevel=3)
        state_v_first = bool(value)
    _dispatch.reject_unknown_kwargs("kernel_fun.kda.chunk_kda", kwargs, _KNOWN_KWARGS)
    return state_v_first


def _fail(exc, msg: str):
    raise exc(f"kernel_fun.kda.chunk_kda: {msg}")


def _documents(host_cu: torch.Tensor, T: int, intermediate_states: bool) -> tuple[tuple[int, int] | None, int]:
    """(equal, longest) of the validated host cu_seqlens: longest, the longest document's tokens (the
    launch model's KdaOptions::max_seq_len); equal, (N, L) where the documents cut T > 0 tokens into N
    of one length L (one document: [0, T]), else None. Such a call is the fixed-length batch [N, L]: the
    inputs are views of it (splitting the token dimension never copies), and the fixed-length launch
    policy (the streamed forward and backward, the split scans, the backward's batch slices) applies,
    which a varlen batch, whose documents the kernels see only on the device, does not take.
    Not for a call that returns the per-chunk states (intermediate_states: h keeps its varlen layout),
    nor with KERNEL_FUN_KDA_VARLEN_AS_BATCH=0."""
    lengths = host_cu[1:] - host_cu[:-1]
    longest = int(lengths.max())
    equal = (T > 0 and not intermediate_states and int(lengths.min()) == longest
             and _env.flag("KERNEL_FUN_KDA_VARLEN_AS_BATCH", True))
    return ((lengths.numel(), longest) if equal else None), longest


def _check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B: int, T: int) -> torch.Tensor | None:
    """Validate cu_seqlens; return a host copy (one device->host read only when the caller gave
    no cu_seqlens_cpu, as fla also does) so the kernels can build their chunk map sync-free."""
    if cu_seqlens is None:
        if cu_seqlens_cpu is not None:
            _fail(ValueError, "cu_seqlens_cpu was given without cu_seqlens")
        return None
    if not isinstance(cu_seqlens, torch.Tensor):
        _fail(TypeError, f"cu_seqlens must be a tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        _fail(ValueError, f"cu_seqlens must be 1-D with N+1 >= 2 entries, got shape {list(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        _fail(TypeError, f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if B != 1:
        _fail(ValueError, f"cu_seqlens requires batch size B == 1 (packed sequences), got B={B}")
    host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.detach().cpu()
    if not isinstance(host, torch.Tensor) or host.shape != cu_seqlens.shape:
        _fail(ValueError, f"cu_seqlens_cpu must be a tensor of cu_seqlens' shape {list(cu_seqlens.shape)}")
    host = host.to("cpu", torch.int64)
    if int(host[0]) != 0:
        _fail(ValueError, f"cu_seqlens must start at 0, got {int(host[0])}")
    if bool((host[1:] < host[:-1]).any()):
        _fail(ValueError, "cu_seqlens must be non-decreasing (sequence lengths >= 0)")
    if int(host[-1]) != T:
        _fail(ValueError, f"cu_seqlens must end at T={T} (the packed length), got {int(host[-1])}")
    return host


def _validate(q, k, v, g, beta, scale, initial_state, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
              allow_neg_eigval, safe_gate, lower_bound, state_v_first, cu_seqlens, cu_seqlens_cpu,
              kwargs, use_graph: bool = False, max_num_seqs: int | None = None,
              return_intermediate_states: bool = False, disable_recompute: bool = False) -> torch.Tensor | None:
    """chunk_kda's argument rules, for every device: CPU tensors, CUDA tensors (whether our kernels
    or fla then serve the call) and meta tensors go through this one function. It stays in Python:
    kernel-less installs need it for the CPU reference, and under torch.compile its comparisons
    of (possibly symbolic) sizes become guards. Returns the host copy of cu_seqlens (or None)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            _fail(TypeError, f"{name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            _fail(TypeError, f"{name} must be a floating-point tensor, got {t.dtype}")
    if q.dim() != 4:
        _fail(ValueError, f"q must be [B, T, H, K], got shape {list(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        _fail(ValueError, f"k must have q's shape {list(q.shape)}, got {list(k.shape)}")
    if v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        _fail(ValueError, f"v must be [B={B}, T={T}, HV, V], got shape {list(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H != 0:
        _fail(ValueError, f"v's head count HV={HV} must be a multiple of q's H={H} (GVA)")
    if K > 256:
        _fail(ValueError, f"head dim K={K} is above fla's limit of 256")
    if tuple(g.shape) != (B, T, HV, K):
        _fail(ValueError, f"g must be [B, T, HV, K]={[B, T, HV, K]}, got {list(g.shape)}")
    if tuple(beta.shape) != (B, T, HV):
        _fail(ValueError, f"beta must be [B, T, HV]={[B, T, HV]}, got {list(beta.shape)}")
    dev = q.device
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.device != dev:
            _fail(ValueError, f"{name} is on {t.device} but q is on {dev}")
    # fla checks nothing here, but its kernels need it: with v's dtype not k's its forward fails to
    # compile (a Triton dot of Akk, in k's dtype, with v); with q's not k's the forward returns o
    # held at v's precision and the backward fails to compile (do, in q's dtype, dotted with v).
    # g and beta may differ (every kernel reads them as fp32).
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            _fail(TypeError, f"{name} must have q's dtype {q.dtype}, got {t.dtype} "
                             f"(q, k and v share one dtype; g and beta may differ)")
    if scale is not None and not isinstance(scale, (int, float)):
        _fail(TypeError, f"scale must be a float or None, got {type(scale).__name__}")
    chunk_size = kwargs.get("chunk_size", 64)
    if chunk_size not in (32, 64):  # fla's words: its callers match them
        _fail(ValueError, f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        _fail(ValueError, "allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    if return_intermediate_states:  # both asserted by fla: h is for inference engines, outside autograd
        if not torch.is_inference_mode_enabled():
            _fail(ValueError, "return_intermediate_states is only allowed in inference mode (torch.inference_mode())")
        if disable_recompute:
            _fail(ValueError, "return_intermediate_states must be used with disable_recompute=False")
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            _fail(ValueError, "lower_bound must be given when safe_gate=True and use_gate_in_kernel=True")
        if not (-5 <= lower_bound < 0):
            _fail(ValueError, f"lower_bound must lie in [-5, 0) with safe_gate, got {lower_bound}")
    if use_gate_in_kernel:
        A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
        if A_log is None and lower_bound is None:
            _fail(ValueError, "A_log must be given when use_gate_in_kernel=True")
        if A_log is not None:
            if not isinstance(A_log, torch.Tensor) or A_log.numel() != HV:
                _fail(ValueError, f"A_log must have HV={HV} elements, got "
                                  f"{list(A_log.shape) if isinstance(A_log, torch.Tensor) else type(A_log).__name__}")
            if A_log.device != dev:
                _fail(ValueError, f"A_log is on {A_log.device} but q is on {dev}")
        if dt_bias is not None:
            if not isinstance(dt_bias, torch.Tensor) or dt_bias.numel() != HV * K:
                _fail(ValueError, f"dt_bias must have HV*K={HV * K} elements")
            if dt_bias.device != dev:
                _fail(ValueError, f"dt_bias is on {dt_bias.device} but q is on {dev}")
    if use_graph and max_num_seqs is not None and isinstance(cu_seqlens, torch.Tensor) and \
            cu_seqlens.shape[0] != max_num_seqs + 1:
        _fail(ValueError, f"use_graph: cu_seqlens must hold exactly max_num_seqs + 1 = {max_num_seqs + 1} "
                          f"entries (pad with empty tail sequences), got {cu_seqlens.shape[0]}")
    # use_graph: the contents change between replays; torch.compile: reading them would be a
    # data-dependent guard (a graph break), so a compiled graph trusts them as fla's use_graph does.
    # Meta offsets (shape inference) have no contents to read either, unless a host copy is given.
    trust_device_cu = (use_graph or torch.compiler.is_compiling()
                       or (isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device.type == "meta"
                           and cu_seqlens_cpu is None))
    if trust_device_cu and cu_seqlens is not None:
        host_cu = None
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            _fail(ValueError, "cu_seqlens must be a 1-D tensor with N+1 >= 2 entries")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            _fail(TypeError, f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
        if B != 1:
            _fail(ValueError, f"cu_seqlens requires batch size B == 1 (packed sequences), got B={B}")
    else:
        host_cu = _check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B, T)
    if cu_seqlens is not None and cu_seqlens.device != dev:
        _fail(ValueError, f"cu_seqlens is on {cu_seqlens.device} but q is on {dev}")
    if initial_state is not None:
        N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        want = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        if not isinstance(initial_state, torch.Tensor) or tuple(initial_state.shape) != want:
            got = list(initial_state.shape) if isinstance(initial_state, torch.Tensor) else type(initial_state).__name__
            _fail(ValueError, f"initial_state must be {list(want)} "
                              f"({'[N, HV, V, K]' if state_v_first else '[N, HV, K, V]'}), got {got}")
        if initial_state.dtype != torch.float32:  # fla asserts it; float64 inputs take a float32 state too
            _fail(TypeError, f"initial_state must be float32 (as fla asserts), got {initial_state.dtype}")
        if initial_state.device != dev:
            _fail(ValueError, f"initial_state is on {initial_state.device} but q is on {dev}")
    return host_cu


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _call_meta(q, v, g, beta, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
               allow_neg_eigval, lower_bound, state_v_first, cu_seqlens, cp_context, kwargs,
               return_intermediate_states=False) -> tuple:
    """Everything but the sizes that the routing decision of a valid call depends on (dtypes,
    flags), as Python constants, so that ``_plan`` runs once at trace time under torch.compile
    (assume_constant_result). Sizes stay out: under torch.compile they may be symbolic (a new
    document count, batch or length must neither recompile nor break the graph), so
    ``_size_reason`` checks them with plain comparisons, which are guards."""
    return (q.dtype, v.dtype, g.dtype, beta.dtype, None if cu_seqlens is None else cu_seqlens.dtype,
            cp_context is not None, float(scale), bool(use_qk_l2norm_in_kernel), bool(use_gate_in_kernel),
            bool(use_beta_sigmoid_in_kernel), bool(allow_neg_eigval),
            None if lower_bound is None else float(lower_bound), bool(state_v_first),
            use_gate_in_kernel and kwargs.get("A_log") is not None, int(kwargs.get("chunk_size", 64)),
            bool(return_intermediate_states))


@torch.compiler.assume_constant_result
def _limits() -> tuple[int, int]:
    """The C++ support check's size limits: (max HV and max sequences, max tokens)."""
    return _limits_of(_ext.ops())


@functools.lru_cache(maxsize=4)
def _limits_of(ops) -> tuple[int, int]:
    grid, tokens = ops.kda_limits(torch.empty(0))
    return int(grid), int(tokens)


def _size_reason(q: torch.Tensor, v: torch.Tensor, cu_seqlens) -> str | None:
    """The size rules of the C++ support check (csrc/api/kda_ops.cpp, support_reason), with its
    limits, on sizes that may be symbolic under torch.compile. Same order and words as the C++;
    tests/test_kda_api.py checks the two agree over a grid of sizes."""
    grid, max_tokens = _limits()
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K != 64 and K != 128:
        return f"K={K} (kernels support K in {{64, 128}})"
    if V % 64 != 0 or V > 512 or V == 0:
        return f"V={V} (kernels support V a multiple of 64 up to 512)"
    if HV > grid:
        return f"HV > {grid}"
    if cu_seqlens is not None:
        if cu_seqlens.shape[0] - 1 > grid:
            return f"more than {grid} varlen sequences"
    elif B > grid:
        return f"B={B} > {grid} sequences (the scan grid's z dimension)"
    if T > 0 and B > max_tokens // T:
        return "more than 2^30 tokens"
    return None


@torch.compiler.assume_constant_result
def _plan(meta: tuple) -> tuple:
    """(reason, options, uses_A_log, uses_dt_bias) for a valid CUDA call described by
    ``_call_meta``: reason is None when our kernels serve it as far as all but its sizes go, else
    why not; options is the call's encoded KdaOptions. The environment switches (the launch
    switches too), cp_context and the extension (read on every call), then the C++ support check on meta
    stand-ins of supported sizes (the sizes are ``_size_reason``'s); the same eagerly and at trace
    time."""
    has_cp = meta[5]
    options, uses_A_log, uses_dt_bias = _options(meta, launch_switches())
    why = _dispatch.common_reason(FAMILY, True if has_cp else None)
    if why is None:
        ok, status = _ext.status()
        why = None if ok else status
    if why is None:
        why = _support_reason(meta, options, _ext.ops())
    return why, options, uses_A_log, uses_dt_bias


@functools.lru_cache(maxsize=512)
def _options(meta: tuple, switches: tuple[int, int, int]) -> tuple[str, bool, bool]:
    """(encoded KdaOptions, uses_A_log, uses_dt_bias) of the call ``_call_meta`` describes, with the
    launch switches read for it (``_plan``, every eager call)."""
    (_, _, _, _, _, _, scale, l2norm, gate_in_kernel, beta_sigmoid, neg_eig, lower_bound, state_v_first,
     has_A_log, chunk_size, intermediate_states) = meta
    opts = KdaOptions.from_call(scale=scale, use_qk_l2norm_in_kernel=l2norm, use_gate_in_kernel=gate_in_kernel,
                                use_beta_sigmoid_in_kernel=beta_sigmoid, allow_neg_eigval=neg_eig,
                                lower_bound=lower_bound, A_log=True if has_A_log else None,
                                state_v_first=state_v_first, chunk_size=chunk_size,
                                return_intermediate_states=intermediate_states, switches=switches)
    return opts.encode(), opts.uses_A_log, opts.uses_dt_bias


@functools.lru_cache(maxsize=512)
def _support_reason(meta: tuple, options: str, ops) -> str | None:
    """The C++ support check on meta stand-ins of sizes it accepts, for the dtypes and options of
    the call: once per distinct call and op library (the eager hot path pays a dict lookup)."""
    q_dtype, v_dtype, g_dtype, beta_dtype, cu_dtype = meta[:5]
    stand_in = lambda shape, dt: torch.empty(shape, dtype=dt, device="meta")  # noqa: E731
    B, T, H, K = 1, 64, 1, 64  # sizes every rule of the C++ check accepts
    cu_t = None if cu_dtype is None else stand_in((2,), cu_dtype)
    return ops.kda_support(stand_in((B, T, H, K), q_dtype), stand_in((B, T, H, K), q_dtype),
                           stand_in((B, T, H, K), v_dtype), stand_in((B, T, H, K), g_dtype),
                           stand_in((B, T, H), beta_dtype), cu_t, options) or None


def _route(q, v, cu_seqlens, meta: tuple) -> tuple:
    """_plan's answer with the size rules applied: (reason, options, uses_A_log, uses_dt_bias)."""
    plan = _plan(meta)
    if plan[0] is None:
        why = _size_reason(q, v, cu_seqlens)
        if why is not None:
            return (why,) + plan[1:]
    return plan


def _crossing_engine(call, q, k, v, g, beta, scale, opts: dict, kwargs: dict):
    """How a context-parallel rank runs the document that began on an earlier rank
    (kda/_cp.py's _Crossing): our raw ops with the call's encoded options where our kernels serve
    the rank's slice (CUDA tensors, the ordinary routing; the calls keep the default state layout),
    else the front's chunk_kda (the torch reference on the CPU, fla where it routes there). The
    slice is validated here once, as each of its calls would be."""
    _validate(q, k, v, g, beta, scale, None, opts["use_gate_in_kernel"], opts["use_beta_sigmoid_in_kernel"],
              opts["allow_neg_eigval"], opts["safe_gate"], opts["lower_bound"], False, None, None, kwargs)
    if q.device.type == "cuda":
        reason, options, _, _ = _route(q, v, None, _call_meta(
            q, v, g, beta, q.shape[-1] ** -0.5 if scale is None else scale, opts["use_qk_l2norm_in_kernel"],
            opts["use_gate_in_kernel"], opts["use_beta_sigmoid_in_kernel"], opts["allow_neg_eigval"],
            opts["lower_bound"], False, None, None, kwargs))
        if reason is None:
            return _cp.KernelEngine(options)
    return _cp.CallEngine(call)


def _reference(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
               use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
               return_intermediate_states, state_v_first, cu_seqlens, kwargs):
    """The CPU path: the chunked torch reference, differentiable by autograd."""
    from kernel_fun.ref.kda import chunk_kda_reference

    out = chunk_kda_reference(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, A_log=kwargs.get("A_log") if use_gate_in_kernel else None,
        dt_bias=kwargs.get("dt_bias") if use_gate_in_kernel else None, state_v_first=state_v_first,
        cu_seqlens=cu_seqlens, chunk_size=kwargs.get("chunk_size", 64),
        return_stages=return_intermediate_states,
    )
    if return_intermediate_states:
        o, ht, stages = out
        return o.to(q.dtype), ht, stages["h"].to(k.dtype)
    o, ht = out
    return o.to(q.dtype), (ht.float() if ht is not None and ht.dtype != torch.float64 else ht)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs,
):
    """fla's ``chunk_kda`` (same arguments, same results; fla 0.5.2's and 0.6.0's): returns
    ``(o, final_state)``, or ``(o, final_state, h)`` with ``return_intermediate_states`` (inference
    only). ``use_graph`` / ``max_num_seqs`` (fla 0.6.0) keep fla's meaning: with ``use_graph`` the
    device ``cu_seqlens`` (padded with empty tail sequences to ``max_num_seqs + 1`` entries) is
    trusted and never read on the host, so a captured CUDA graph can be replayed after only its
    contents change; our kernels need no preallocated per-sequence buffers for that."""
    orig_args = (q, k, v, g, beta)
    graph_kwargs = {} if not use_graph and max_num_seqs is None else dict(use_graph=use_graph,
                                                                          max_num_seqs=max_num_seqs)
    orig_kwargs = dict(
        scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        safe_gate=safe_gate, lower_bound=lower_bound, disable_recompute=disable_recompute,
        return_intermediate_states=return_intermediate_states, state_v_first=state_v_first,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, cp_context=cp_context, **graph_kwargs, **kwargs,
    )
    kwargs = dict(kwargs)
    state_v_first = _take_kwargs(kwargs, state_v_first)
    if cp_context is not None and _env.flag(_cp.ENV):
        cu = _cp.validate(q, initial_state, output_final_state, return_intermediate_states, cp_context)
        opts = dict(scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                    use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                    safe_gate=safe_gate, lower_bound=lower_bound, disable_recompute=disable_recompute,
                    **{n: x for n, x in kwargs.items() if n not in ("A_log", "dt_bias")})

        def call(q_, k_, v_, g_, beta_, A_log_, dt_bias_, **kw):
            extra = {**opts, **kw, **({"A_log": A_log_} if A_log_ is not None else {}),
                     **({"dt_bias": dt_bias_} if dt_bias_ is not None else {})}
            return chunk_kda(q_, k_, v_, g_, beta_, **extra)

        o = _cp.KdaCP.apply(call, _crossing_engine(call, q, k, v, g, beta, scale, opts, kwargs), cp_context, cu,
                            q, k, v, g, beta, kwargs.get("A_log"), kwargs.get("dt_bias"))
        return o, None
    host_cu = _validate(q, k, v, g, beta, scale, initial_state, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                        allow_neg_eigval, safe_gate, lower_bound, state_v_first, cu_seqlens, cu_seqlens_cpu,
                        kwargs, use_graph=bool(use_graph), max_num_seqs=max_num_seqs,
                        return_intermediate_states=return_intermediate_states, disable_recompute=disable_recompute)
    if scale is None:
        scale = q.shape[-1] ** -0.5

    if q.device.type == "cpu":
        if cp_context is not None:
            _fail(ValueError, "cp_context is not supported on CPU tensors (KERNEL_FUN_KDA_CP=1 runs it on ours)")
        return _reference(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                          use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
                          return_intermediate_states, state_v_first, cu_seqlens, kwargs)

    # documents of one length are the fixed-length batch
    docs, longest = (None, 0) if host_cu is None else _documents(host_cu, q.shape[1], return_intermediate_states)
    if docs is not None:
        # unflatten + squeeze, not x[0]: their backwards are views of the gradient, where select's
        # fills a zero tensor of the input's size and copies the gradient in (measured: ~1 ms per
        # training call at long_b1_t32k_doc's size, 7.85 against 6.79 ms)
        q, k, v, g, beta = (x.unflatten(1, docs).squeeze(0) for x in (q, k, v, g, beta))
        cu_seqlens = host_cu = None
    reason, options, uses_A_log, uses_dt_bias = _route(q, v, cu_seqlens, _call_meta(
        q, v, g, beta, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
        allow_neg_eigval, lower_bound, state_v_first, cu_seqlens, cp_context, kwargs, return_intermediate_states))
    if reason is not None:
        return _dispatch.fallback(FAMILY, reason, *_FLA, orig_args, orig_kwargs)
    if host_cu is not None:  # eager varlen: the longest document, for the launch model
        options = with_max_seq_len(options, longest)

    from kernel_fun.kda import _kernel

    A_log = kwargs.get("A_log") if uses_A_log else None
    dt_bias = kwargs.get("dt_bias") if uses_dt_bias else None
    # Meta tensors (shape inference, deferred init) take this path too: our ops' fakes give the
    # outputs' shapes and dtypes, exactly as on the GPU (no reference, no fla).
    out = _kernel.forward(q, k, v, g, beta, options=options, initial_state=initial_state,
                          output_final_state=output_final_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=host_cu,
                          A_log=A_log, dt_bias=dt_bias, return_intermediate_states=return_intermediate_states)
    if docs is not None:  # o back in the packed layout (a view); the final state is [N, ...] either way
        out = (out[0].flatten(0, 1).unsqueeze(0),) + tuple(out[1:])
    if not torch.compiler.is_compiling() and q.device.type == "cuda":  # after the kernels launched
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        _dispatch.log_engaged(FAMILY, f"B={B} T={T} H={H} HV={HV} K={K} V={V} dtype={q.dtype} "
                                      f"varlen={cu_seqlens is not None}{' (equal documents)' if docs else ''} "
                                      f"grad={_needs_grad(q, k, v, g, beta)}")
    return out


def is_supported(q: torch.Tensor, v: torch.Tensor, **kwargs) -> tuple[bool, str | None]:
    """Would ``chunk_kda(q, ..., v, ..., **kwargs)`` run our kernels? ``(True, None)`` or
    ``(False, reason)``. Pass k, g, beta as keywords when you have them (otherwise stand-ins of
    the contract's shapes are allocated for the check). Never raises for bad input: that is a
    reason too."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    k = kwargs.pop("k", None)
    g = kwargs.pop("g", None)
    beta = kwargs.pop("beta", None)
    k = q if k is None else k
    g = q.new_empty((B, T, HV, K)) if g is None else g
    beta = q.new_empty((B, T, HV)) if beta is None else beta
    try:
        bound = inspect.signature(chunk_kda).bind(q, k, v, g, beta, **kwargs)
    except TypeError as e:
        return False, f"invalid input: {e}"
    bound.apply_defaults()
    a = bound.arguments
    extra = dict(a.pop("kwargs"))
    try:
        a["state_v_first"] = _take_kwargs(extra, a["state_v_first"])
        _validate(q, k, v, g, beta, a["scale"], a["initial_state"], a["use_gate_in_kernel"],
                  a["use_beta_sigmoid_in_kernel"], a["allow_neg_eigval"], a["safe_gate"],
                  a["lower_bound"], a["state_v_first"], a["cu_seqlens"], a["cu_seqlens_cpu"], extra,
                  use_graph=bool(a["use_graph"]), max_num_seqs=a["max_num_seqs"],
                  return_intermediate_states=a["return_intermediate_states"], disable_recompute=a["disable_recompute"])
    except (ValueError, TypeError) as e:
        return False, f"invalid input: {e}"
    if q.device.type != "cuda":
        return False, f"tensors on {q.device} run the torch reference, not our kernels"
    scale = a["scale"] if a["scale"] is not None else K ** -0.5
    reason = _route(q, v, a["cu_seqlens"], _call_meta(
        q, v, g, beta, scale, a["use_qk_l2norm_in_kernel"], a["use_gate_in_kernel"], a["use_beta_sigmoid_in_kernel"],
        a["allow_neg_eigval"], a["lower_bound"], a["state_v_first"], a["cu_seqlens"], a["cp_context"], extra,
        a["return_intermediate_states"]))[0]
    return (reason is None), reason


def warmup(K: int = 128, V: int = 256, HV: int = 16, H: int | None = None, dtype=torch.bfloat16,
           device: str | torch.device = "cuda", **kwargs) -> float:
    """Load and run our KDA kernels once at these head dims (a tiny problem) so the first
    training step pays nothing; returns seconds. Raises with the reason if our kernels cannot
    serve this configuration (nothing would have been prepared)."""
    t0 = time.perf_counter()
    H = HV if H is None else H
    dev = torch.device(device)
    B, T = 1, 128
    q = torch.randn(B, T, H, K, device=dev, dtype=dtype)
    k = torch.randn(B, T, H, K, device=dev, dtype=dtype)
    v = torch.randn(B, T, HV, V, device=dev, dtype=dtype)
    g = -torch.rand(B, T, HV, K, device=dev, dtype=dtype)
    beta = torch.rand(B, T, HV, device=dev, dtype=dtype)
    opts = dict(kwargs)
    with torch.no_grad():
        ok, why = is_supported(q, v, k=k, g=g, beta=beta, **opts)
        if not ok:
            raise RuntimeError(f"kernel_fun.kda.warmup: our kernels cannot serve this configuration - {why}")
        chunk_kda(q, k, v, g, beta, **opts)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0
