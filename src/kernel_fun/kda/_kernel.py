"""The KDA forward and backward on our sm_90a kernels (csrc/kda/, docs/kda.md).

``forward`` runs our kernels on a call the front (kernel_fun.kda) has validated and routed here.
Gradients flow through two functional custom ops, ``kernel_fun::kda_forward`` and
``kernel_fun::kda_backward`` (the latter registered as the former's autograd formula), so a
``torch.compile(fullgraph=True)`` training step sees our ops as single nodes with no graph break.
``forward_stages`` / ``backward_stages`` also return the workspace, for per-stage tests.

No call synchronises with the host: cu_seqlens is read natively (int32 or int64) on the device;
cu_seqlens_cpu is used only to size the optional intermediate-states output.

What the forward saves for the backward: its inputs (q, k, v, g, beta, A_log, dt_bias,
initial_state, cu_seqlens; no copies) and, when autograd will need them, the intra factors Aqk,
Akk and M ([B*T, HV, 64] each); the backward rebuilds the rest of the workspace and the
per-chunk states itself (kda_backward in csrc/kda/bwd/kda_bwd.cu, docs/kda-backward.md).
"""

from __future__ import annotations

import functools

import torch

from kernel_fun import _env, _ext
from kernel_fun.kda._options import KdaOptions

CHUNK = 64

@functools.lru_cache(maxsize=256)
def _decode(options: str) -> KdaOptions:
    """The KdaOptions behind an encoded string (the custom ops receive the string)."""
    kv = dict(item.split("=", 1) for item in options.split(";") if item)
    return KdaOptions(scale=float.fromhex(kv["scale"]), gate=kv["gate"], lower_bound=float.fromhex(kv["lower_bound"]),
                      l2norm=kv["l2norm"] == "1", beta_sigmoid=int(kv["beta_sigmoid"]),
                      state_v_first=kv["state_v_first"] == "1", chunk_size=int(kv["chunk_size"]),
                      intermediate_states=kv["intermediate_states"] == "1", max_seq_len=int(kv["max_seq_len"]),
                      split=int(kv["split"]),
                      split_chunks=int(kv["split_chunks"]), recurrent=int(kv["recurrent"]))


def _state_shape(N, HV, K, V, state_v_first):
    return (N, HV, V, K) if state_v_first else (N, HV, K, V)


def _aligned(t):
    """Contiguous with a 16-byte aligned start (the kernels copy rows with 16-byte cp.async)."""
    if t is None:
        return None
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _flat_f32(A_log, dt_bias):
    """A_log / dt_bias as the ops take them (flat fp32, or None). Done outside the custom ops, so
    autograd maps their gradients back to the caller's shape and dtype (A_log in any shape with HV
    elements, dt_bias in any float dtype)."""
    A = None if A_log is None else A_log.reshape(-1).to(torch.float32)
    D = None if dt_bias is None else dt_bias.reshape(-1).to(torch.float32)
    return A, D


def gate_params(opts: KdaOptions, A_log, dt_bias):
    """_flat_f32 of the parameters the gate of opts reads (None for the others)."""
    return _flat_f32(A_log if opts.uses_A_log else None, dt_bias if opts.uses_dt_bias else None)


# ---------------------------------------------------------------- the functional custom ops
@torch.library.custom_op("kernel_fun::kda_forward", mutates_args=())
def kda_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, initial_state: torch.Tensor | None,
                cu_seqlens: torch.Tensor | None, options: str, output_final_state: bool, save_factors: bool,
                save_states: bool, save_workspace: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]:
    """(o, final_state, Aqk, Akk, M, h, w, qg, kg, gdecay). final_state is an empty tensor unless
    output_final_state; Aqk, Akk and M ([B*T, HV, 64] in q's dtype, what the backward reads instead
    of recomputing the forward intra) are empty tensors unless save_factors; h (the buffer for the
    state before every chunk, [max_chunks, HV, V, K] in q's dtype, which the forward's scan fills
    where the backward then skips its re-scan, else the backward's re-scan does) is empty unless
    save_states (which needs save_factors); w, qg, kg ([B*T, HV, K] in q's dtype) and gdecay
    ([max_chunks, HV, K] fp32), the forward intra's products that the backward then need not
    rebuild, are empty unless save_workspace (which needs save_factors)."""
    bufs = _forward_buffers(q, v, cu_seqlens, options, output_final_state, save_factors, save_states,
                            save_workspace)
    o, ht, Aqk, Akk, M, h, w, qg, kg, gdecay = bufs
    _ext.ops().kda_fwd(_aligned(q), _aligned(k), _aligned(v), g.contiguous(), beta.contiguous(), A_log, dt_bias,
                       None if initial_state is None else initial_state.contiguous(), cu_seqlens, options, o,
                       ht if output_final_state else None, None, *((Aqk, Akk, M) if save_factors else (None,) * 3),
                       h if save_states else None, *((w, qg, kg, gdecay) if save_workspace else (None,) * 4))
    return bufs


def _max_chunks(B, T, cu_seqlens):
    """Every chunk the per-chunk grid can address (csrc/api's max_chunks, against which it checks the
    buffers sized by this): B * ceil(T / 64), or T // 64 + N with cu_seqlens (N sequences)."""
    return B * (-(-T // CHUNK)) if cu_seqlens is None else T // CHUNK + cu_seqlens.shape[0] - 1


def _forward_buffers(q, v, cu_seqlens, options, output_final_state, save_factors, save_states, save_workspace):
    opts = _decode(options)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    o = q.new_empty(B, T, HV, V)
    ht = q.new_empty(_state_shape(N, HV, K, V, opts.state_v_first) if output_final_state else (0,),
                     dtype=torch.float32)
    fshape = (B * T, HV, CHUNK) if save_factors else (0,)
    max_chunks = _max_chunks(B, T, cu_seqlens)
    hshape = (max_chunks, HV, V, K) if save_states else (0,)
    wshape = (B * T, HV, K) if save_workspace else (0,)
    return (o, ht, q.new_empty(fshape), q.new_empty(fshape), q.new_empty(fshape), q.new_empty(hshape),
            q.new_empty(wshape), q.new_empty(wshape), q.new_empty(wshape),
            q.new_empty((max_chunks, HV, K) if save_workspace else (0,), dtype=torch.float32))


@kda_forward.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, options, output_final_state, save_factors,
      save_states, save_workspace):
    return _forward_buffers(q, v, cu_seqlens, options, output_final_state, save_factors, save_states,
                            save_workspace)


@torch.library.custom_op("kernel_fun::kda_backward", mutates_args=())
def kda_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, initial_state: torch.Tensor | None,
                 cu_seqlens: torch.Tensor | None, do: torch.Tensor, dht: torch.Tensor | None, Aqk: torch.Tensor | None,
                 Akk: torch.Tensor | None, M: torch.Tensor | None, h: torch.Tensor | None,
                 w: torch.Tensor | None, qg: torch.Tensor | None, kg: torch.Tensor | None,
                 gdecay: torch.Tensor | None, options: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                        torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0): dg / dbeta in g's / beta's dtypes; dA_log,
    ddt_bias (fp32, flat) and dh0 (fp32) are empty tensors when A_log / dt_bias / initial_state is
    None. Aqk / Akk / M: the forward's saved factors (all three), or None to recompute them; h: the
    forward's saved states (with the factors), or None to re-run the scan; w / qg / kg / gdecay: the
    forward intra's (with the factors), or None to rebuild them (kda_bwd_prep)."""
    dq, dk, dv, dg, dbeta, dA, dD, dh0 = _grad_buffers(q, v, g, beta, A_log, dt_bias, initial_state)
    _ext.ops().kda_bwd(_aligned(q), _aligned(k), _aligned(v), g.contiguous(), beta.contiguous(), A_log, dt_bias,
                       None if initial_state is None else initial_state.contiguous(), cu_seqlens, _aligned(do),
                       None if dht is None else dht.contiguous(), Aqk, Akk, M, h, w, qg, kg, gdecay, options,
                       dq, dk, dv, dg, dbeta,
                       dA if A_log is not None else None, dD if dt_bias is not None else None,
                       dh0 if initial_state is not None else None)
    return dq, dk, dv, dg, dbeta, dA, dD, dh0


def _grad_buffers(q, v, g, beta, A_log, dt_bias, initial_state):
    f32 = torch.float32
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            torch.empty_like(g, memory_format=torch.contiguous_format),
            torch.empty_like(beta, memory_format=torch.contiguous_format),
            q.new_empty((A_log.numel(),) if A_log is not None else (0,), dtype=f32),
            q.new_empty((dt_bias.numel(),) if dt_bias is not None else (0,), dtype=f32),
            (torch.empty_like(initial_state, memory_format=torch.contiguous_format)
             if initial_state is not None else q.new_empty((0,), dtype=f32)))


@kda_backward.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, do, dht, Aqk, Akk, M, h, w, qg, kg, gdecay,
      options):
    return _grad_buffers(q, v, g, beta, A_log, dt_bias, initial_state)


def _setup_context(ctx, inputs, output):
    (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, options, output_final_state, save_factors,
     save_states, save_workspace) = inputs
    _, _, Aqk, Akk, M, h, w, qg, kg, gdecay = output
    if not save_factors:  # (autograd recorded the op, so the front asked for the factors: never here)
        Aqk = Akk = M = None
    if not save_states:
        h = None
    if not save_workspace:
        w = qg = kg = gdecay = None
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, Aqk, Akk, M, h, w, qg, kg,
                          gdecay)
    # Outputs the loss does not use (the factors, a final state not asked for) arrive as None, not as
    # zero tensors autograd would allocate and fill: 0.75 GiB of zeros at prod8192 otherwise.
    ctx.set_materialize_grads(False)
    ctx.options = options
    ctx.output_final_state = output_final_state


def _backward(ctx, do, dht, *_factor_grads):
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, Aqk, Akk, M, h, w, qg, kg, gdecay = ctx.saved_tensors
    if do is None:  # only the final state was used
        do = q.new_zeros(q.shape[0], q.shape[1], v.shape[2], v.shape[3])
    if not ctx.output_final_state:
        dht = None
    dq, dk, dv, dg, dbeta, dA, dD, dh0 = kda_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                                                       do, dht, Aqk, Akk, M, h, w, qg, kg, gdecay, ctx.options)
    return (dq, dk, dv, dg, dbeta, dA if A_log is not None else None, dD if dt_bias is not None else None,
            dh0 if initial_state is not None else None, None, None, None, None, None, None)


kda_forward.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- entry points
def forward(q, k, v, g, beta, *, options: str, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
            A_log, dt_bias, return_intermediate_states):
    """(o, final_state), or (o, final_state, h) with return_intermediate_states (inference only).
    Differentiable (through kernel_fun::kda_forward's registered backward). options: the call's
    encoded KdaOptions; A_log / dt_bias: the caller's tensors, or None when the gate does not use them.
    Traceable by torch.compile: the custom op is the only thing that touches data."""
    A, D = _flat_f32(A_log, dt_bias)  # the front passes only what the gate reads
    if return_intermediate_states:
        return _forward_with_states(q, k, v, g, beta, _decode(options), initial_state, output_final_state,
                                    cu_seqlens, cu_seqlens_cpu, A, D)
    # the factors the backward reads are kept only when autograd will need them
    save = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, A, D, initial_state))
    # and a buffer for the state before every chunk, which the forward's scan fills where that saves
    # the backward its re-scan (kda_policy.h's save_states_pays; memory for time: docs/kda-backward.md)
    save_states = save and _env.flag("KERNEL_FUN_KDA_SAVE_STATES", True)
    # and the intra's w / qg / kg / exp2(G), so the backward need not rebuild them (kda_bwd_prep)
    save_workspace = save and _env.flag("KERNEL_FUN_KDA_SAVE_WORKSPACE", True)
    o, ht = kda_forward(q, k, v, g, beta, A, D, initial_state, cu_seqlens, options, bool(output_final_state), save,
                        save_states, save_workspace)[:2]
    return o, (ht if output_final_state else None)


def forward_identity_columns(q, k, v, g, beta, A, D, options: str, final: bool):
    """The forward over v from a zero state with K identity columns beside v's (KdaProblem::id_cols):
    the context-parallel call of a document that began on an earlier rank (kda/_cp.py's KernelEngine).
    Returns (o(0), Q, [E | Phi] or None, kept): o(0) [B, T, HV, V] and Q [B, T, HV, K] in q's dtype, the
    final state [B, HV, K, V + K] fp32 where final, and kept = (Aqk, Akk, M, w, qg, kg, gdecay), which
    the backward of the ordinary call over v reads as its forward's (none depends on the values or the
    initial state). One forward of our kernels at V + K state columns, without a [v | 0] copy and with
    o(0) and Q in tensors of their own. A, D: flat fp32 gate parameters (gate_params). Not
    differentiable: the caller's autograd.Function differentiates the ordinary call."""
    opts = _decode(options)
    B, _, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o, _, Aqk, Akk, M, _, w, qg, kg, gdecay = _forward_buffers(q, v, None, options, False, True, False, True)
    Q = q.new_empty(o.shape[:-1] + (K,))
    ht = q.new_empty(_state_shape(B, HV, K, V + K, opts.state_v_first), dtype=torch.float32) if final else None
    _ext.ops().kda_fwd(_aligned(q), _aligned(k), _aligned(v), g.contiguous(), beta.contiguous(), A, D, None, None,
                       options, o, ht, None, Aqk, Akk, M, None, w, qg, kg, gdecay, Q)
    return o, Q, ht, (Aqk, Akk, M, w, qg, kg, gdecay)


def _state_buffer(q, v, opts, cu_seqlens, cu_seqlens_cpu):
    """(h_states buffer for the raw op, number of chunks the caller sees). Without cu_seqlens one
    state per chunk of each sequence row; with it the raw op wants room for every chunk the grid can
    address (T // 64 + N), while the caller sees exactly the chunks that exist (counted from the host
    copy of cu_seqlens)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    inner = (V, K) if opts.state_v_first else (K, V)
    if cu_seqlens is None:
        hs = q.new_empty(B, -(-T // CHUNK), HV, *inner)
        return hs, hs.shape[1]
    host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()
    lens = (host[1:] - host[:-1]).to(torch.int64)
    total = int(((lens + CHUNK - 1) // CHUNK).sum())
    return q.new_empty(1, _max_chunks(B, T, cu_seqlens), HV, *inner), total


def _forward_with_states(q, k, v, g, beta, opts, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu, A, D):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    o = q.new_empty(B, T, HV, V)
    ht = q.new_empty(_state_shape(N, HV, K, V, opts.state_v_first), dtype=torch.float32) if output_final_state else None
    hs, total = _state_buffer(q, v, opts, cu_seqlens, cu_seqlens_cpu)
    _ext.ops().kda_fwd(_aligned(q), _aligned(k), _aligned(v), g.contiguous(), beta.contiguous(), A, D,
                       None if initial_state is None else initial_state.contiguous(), cu_seqlens, opts.encode(), o, ht,
                       hs, None, None, None, None, None, None, None, None)
    return o, ht, hs[:, :total]


def forward_stages(q, k, v, g, beta, *, opts: KdaOptions, initial_state=None, output_final_state=False,
                   cu_seqlens=None, A_log=None, dt_bias=None, return_intermediate_states=False, poison=False,
                   profile=False):
    """The forward plus its workspace, for per-stage tests: (o, final_state, h_states, ws) with
    ws = {w, qg, kg: [B*T, HV, K]; Aqk, Akk, M: [B*T, HV, 64]; gdecay: [max_chunks, HV, K] fp32;
    chunk_offsets: [2N+1] int32, the chunk offsets then the sequences longest first; chunk_ready:
    the streamed forward's flags, counter and resume chunks (int32; unwritten where it does not
    stream); split_map (int32), split_state (fp32): the split forward's pieces, their local, initial and
    final states (kda_problem.h's SplitLayout; empty where the forward does not split); scan_save: the
    streamed chains' saved states, only where the forward can stream}. qg and Aqk carry `scale`; Akk = (I + L)^-1 diag(beta); M = (I + L)^-1
    (the three factors a training forward saves). With poison, every output and workspace buffer
    starts as NaN. With profile also ws["clock"]: kda_fwd_intra's clock64() at its phase boundaries,
    [CTAs, 16] (scripts/kda_phases.py)."""
    A, D = gate_params(opts, A_log, dt_bias)
    hs, total = (_state_buffer(q, v, opts, cu_seqlens, None) if return_intermediate_states else (None, 0))
    out = _ext.ops().kda_fwd_stages(_aligned(q), _aligned(k), _aligned(v), g.contiguous(), beta.contiguous(), A, D,
                                    None if initial_state is None else initial_state.contiguous(), cu_seqlens,
                                    opts.encode(), bool(output_final_state), hs, bool(poison), bool(profile))
    names = ("Aqk", "Akk", "M", "w", "qg", "kg", "gdecay", "chunk_offsets", "chunk_ready", "split_map", "split_state",
             "scan_save")
    ws = dict(zip(names, out[2:-1] if profile else out[2:]))  # scan_save: only where it can stream
    if profile:
        ws["clock"] = out[-1].view(-1, 16)
    return (out[0], (out[1] if output_final_state else None), (hs[:, :total] if hs is not None else None), ws)


_BWD_WS = ("w", "qg", "kg", "Aqk", "Akk", "gdecay", "chunk_offsets", "M", "h_ckpt", "dh_ckpt")


def backward_stages(q, k, v, g, beta, do, dht=None, *, opts: KdaOptions, initial_state=None, cu_seqlens=None,
                    A_log=None, dt_bias=None, saved=None, poison=False, profile=False):
    """Every gradient plus the backward's intermediates, for per-stage tests. Returns (grads, st):
    grads = {dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0} (None where not applicable; dA_log /
    ddt_bias flat fp32 for the prepared A_log / dt_bias); st = {dA: scale * dAqk (i >= j), dL:
    -(M^T dM M^T) (i > j), both [B*T, HV, 64] fp32; h_ckpt, dh_ckpt: [max_chunks, HV, V, K], the state
    before chunk c and the state gradient dh_{c+1} chunk c reads; M, and the recomputed forward
    workspace (with GVA dqhat / dkhat, [B*T, HV - H, K]: row r < G - 1 of a group holds the running sum
    of dq^ / dk^ over its heads 0 .. r, the last head has none; and gva_flags: the grads
    kernel's chain, kda_bwd_grads.cuh's grads_gva_chain); with profile also clock: kda_bwd_grads'
    clock64() at its phase boundaries, [CTAs, 16]}.
    pbias / pA (the per-chunk gate partials) come back as the gate-parameter passes leave them: rows
    0, 64, 128, ... hold the sums of their 64-chunk segments (kda_bwd_finish.cuh works in place).
    saved: the forward's (Aqk, Akk, M) (kda_bwd_prep rebuilds the rest), or None (the forward intra
    recomputes everything)."""
    A, D = gate_params(opts, A_log, dt_bias)
    out = _ext.ops().kda_bwd_stages(_aligned(q), _aligned(k), _aligned(v), g.contiguous(), beta.contiguous(), A, D,
                                    None if initial_state is None else initial_state.contiguous(), cu_seqlens,
                                    _aligned(do), None if dht is None else dht.contiguous(),
                                    *(saved if saved is not None else (None,) * 3), opts.encode(), bool(poison),
                                    bool(profile))
    dq, dk, dv, dg, dbeta, dA_log, ddt, dh0, dA, dL = out[:10]
    grads = dict(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, dA_log=dA_log if A is not None else None,
                 ddt_bias=ddt if D is not None else None, dh0=dh0 if initial_state is not None else None)
    st = dict(dA=dA, dL=dL)
    ws = out[10:]
    base = [n for n in _BWD_WS if saved is None or n not in ("Aqk", "Akk", "M")]
    names = base + (["dqhat", "dkhat", "gva_flags"] if v.shape[2] != q.shape[2] else []) + \
        (["pbias", "pA"] if opts.gate != "precomputed" else []) + ["split_map", "split_state"]
    if profile:
        st["clock"] = ws[-1].view(-1, 16)
        ws = ws[:-1]
    st.update(zip(names, ws))
    return grads, st
