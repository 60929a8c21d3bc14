"""The KDA forward kernels on the host emulator, through ctypes: ``forward_stages`` mirrors
``kernel_fun.kda._kernel.forward_stages`` (same arguments and outputs, CPU tensors) and runs the
UNMODIFIED csrc/kda kernels under tests/emu/kf_emu.h; ``backward_stages`` the same for the backward.

Every output and workspace buffer sits inside a guard zone: buffers are poisoned with NaN (so an
element the kernels never write shows up), and the guard elements around them must be untouched
afterwards (an out-of-bounds write raises). Inputs are copied into NaN-padded buffers, so an
out-of-bounds read turns into a NaN in the results.
"""

from __future__ import annotations

import ctypes
import importlib.util
import math
from pathlib import Path

import torch

CHUNK = 64
GUARD = 256  # elements of guard zone on each side of every buffer

_DTYPE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
_lib = None


def _build_module():
    spec = importlib.util.spec_from_file_location("kf_emu_build", Path(__file__).with_name("build.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_PTRS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0", "cu_seqlens", "options", "o", "ht", "h_states",
         "w", "qg", "kg", "Aqk", "Akk", "M", "gdecay", "chunk_offsets", "h_ckpt", "dh_ckpt", "dqhat", "dkhat",
         "pbias", "pA", "dout", "dht", "dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias", "dbg_dA",
         "dbg_dL", "chunk_ready", "scan_save", "recur_state")
_INTS = ("cu_int64", "B", "T", "H", "HV", "K", "V", "N", "max_chunks", "dtype", "g_dtype", "beta_dtype", "bv",
         "saved_factors", "slice_b", "pair_scans", "balance", "stream_stop", "recurrent", "saved_states",
         "saved_workspace")


class KdaEmuArgs(ctypes.Structure):
    """Mirror of KdaEmuArgs in kda_emu.cpp (every field 8 bytes)."""
    _fields_ = ([(n, ctypes.c_void_p) for n in _PTRS] + [(n, ctypes.c_int64) for n in _INTS] +
                [("split_chunks", ctypes.c_int64), ("split_map", ctypes.c_void_p), ("split_state", ctypes.c_void_p),
                 ("fwd_chunk", ctypes.c_int64), ("chain_cols", ctypes.c_int64), ("id_cols", ctypes.c_int64),
                 ("o_id", ctypes.c_void_p), ("dh_ready", ctypes.c_void_p), ("gva_flags", ctypes.c_void_p)])


def lib():
    """The loaded emulator library (built on first use; see build.py)."""
    global _lib
    if _lib is None:
        path = _build_module().build()
        L = ctypes.CDLL(str(path))
        L.kda_emu_args_size.restype = ctypes.c_int
        L.kda_emu_last_error.restype = ctypes.c_char_p
        for fn in (L.kda_emu_forward, L.kda_emu_backward, L.kda_emu_intra_c32, L.kda_emu_forward_c32):
            fn.argtypes = [ctypes.POINTER(KdaEmuArgs)]
            fn.restype = ctypes.c_int
        L.kf_emu_configure.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        L.kf_emu_configure.restype = None
        L.kf_emu_set_schedule.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_uint64]
        L.kf_emu_set_schedule.restype = None
        L.kf_emu_selftest_last_error.restype = ctypes.c_char_p
        vp = ctypes.c_void_p
        L.kf_emu_selftest_mma16816.argtypes = [ctypes.c_int, vp, vp, vp, vp, vp]
        L.kf_emu_selftest_mma1688.argtypes = [vp, vp, vp, vp]
        L.kf_emu_selftest_tf32.argtypes = [vp, vp, ctypes.c_int]
        L.kf_emu_selftest_tf32.restype = None
        L.kf_emu_selftest_cp_async.argtypes = [vp, vp]
        L.kf_emu_selftest_bug.argtypes = [ctypes.c_int, vp]
        L.kf_emu_selftest_wgmma.argtypes = [ctypes.c_int, vp, vp, vp, vp]
        L.kf_emu_selftest_warp_ops.argtypes = [vp]
        L.kda_emu_stream_choice.argtypes = [ctypes.c_int64] * 7 + [ctypes.c_void_p, ctypes.c_int64]
        L.kda_emu_stream_choice.restype = ctypes.c_int
        L.kda_emu_split_layout.argtypes = [ctypes.POINTER(KdaEmuArgs), vp]
        L.kda_emu_split_layout.restype = ctypes.c_int
        L.kda_emu_split_choice.argtypes = [ctypes.c_int64] * 7 + [vp]
        L.kda_emu_split_choice.restype = ctypes.c_int
        L.kda_emu_split_choice_varlen.argtypes = [ctypes.c_int64] * 8 + [vp]
        L.kda_emu_split_choice_varlen.restype = ctypes.c_int
        L.kda_emu_split_chain_cols.argtypes = [ctypes.c_int64] * 7
        L.kda_emu_bwd_policy.argtypes = [ctypes.c_int64] * 8
        L.kda_emu_bwd_policy.restype = ctypes.c_int
        L.kda_emu_short_chunks.argtypes = [ctypes.c_int64] * 8
        L.kda_emu_short_chunks.restype = ctypes.c_int
        L.kda_emu_scan_bv.argtypes = [ctypes.c_int64] * 7
        L.kda_emu_scan_bv.restype = ctypes.c_int
        L.kda_emu_split_chain_cols.restype = ctypes.c_int
        L.kda_emu_fused_forward.argtypes = [ctypes.POINTER(KdaEmuArgs)]
        L.kda_emu_fused_forward.restype = ctypes.c_int
        L.kda_emu_intra_stage_check.argtypes = [ctypes.POINTER(KdaEmuArgs), vp, vp, vp]
        L.kda_emu_intra_stage_check.restype = ctypes.c_int
        i64 = ctypes.c_int64
        L.kda_emu_gate_params.argtypes = [vp, vp, vp, vp, i64, i64, i64, i64, i64]
        L.kda_emu_gate_params.restype = ctypes.c_int
        L.kf_emu_selftest_tma_pipeline.argtypes = [ctypes.c_int, vp, ctypes.c_int, vp]
        L.kf_emu_selftest_cluster.argtypes = [ctypes.c_int, ctypes.c_int, vp]
        L.kf_emu_selftest_tma_swizzle.argtypes = [vp, ctypes.c_int, ctypes.c_int, vp]
        if L.kda_emu_args_size() != ctypes.sizeof(KdaEmuArgs):
            raise RuntimeError("KdaEmuArgs layout differs between kda_emu.cpp and kda_emu.py")
        _lib = L
    return _lib


def stream_choice(B, T, H, HV, K, V, sms=132, fwd_chunk=64):
    """kda_policy.h's fwd_stream_choice for a fixed-length problem chunked at fwd_chunk tokens: (slice
    width or 0, modelled streamed us, modelled two-kernel us)."""
    cost = (ctypes.c_double * 2)()
    bv = lib().kda_emu_stream_choice(B, T, H, HV, K, V, sms, ctypes.cast(cost, ctypes.c_void_p), fwd_chunk)
    return bv, cost[0], cost[1]


def split_choice(B, T, H, HV, K, V, sms=132):
    """kda_policy.h's fwd_split_choice for a fixed-length problem: (piece length in chunks or 0, the
    scans' width, modelled split us, modelled us of the forward it would replace)."""
    out = (ctypes.c_double * 3)()
    chunks = lib().kda_emu_split_choice(B, T, H, HV, K, V, sms, ctypes.cast(out, ctypes.c_void_p))
    return chunks, int(out[0]), out[1], out[2]


def split_choice_varlen(N, T, longest, H, HV, K, V, sms=132):
    """The same for a varlen batch of N documents over T tokens, the longest of `longest` tokens (0: not
    known, as under torch.compile)."""
    out = (ctypes.c_double * 3)()
    chunks = lib().kda_emu_split_choice_varlen(N, T, longest, H, HV, K, V, sms, ctypes.cast(out, ctypes.c_void_p))
    return chunks, int(out[0]), out[1], out[2]


def bwd_policy(B, T, H, HV, K, V, split_chunks=0, bounded=False):
    """kda_policy.h's backward choices for a fixed-length problem: {stream: bwd_pass_streams (the whole
    batch or each of its slices), save_states: save_states_pays, pair: bwd_pair_scans}, with a split of
    split_chunks chunks (0: none), the unbounded gate or the bounded one (lower_bound -5)."""
    bits = lib().kda_emu_bwd_policy(B, T, H, HV, K, V, split_chunks, int(bounded))
    return {"stream": bool(bits & 1), "save_states": bool(bits & 2), "pair": bool(bits & 4)}


def split_chain_cols(B, T, H, HV, K, V, sms=132):
    """fwd/kda_fwd_split.cuh's split_chain_cols for a fixed-length problem: the split chain kernel's
    column block (8, 16 or 32)."""
    return lib().kda_emu_split_chain_cols(B, T, H, HV, K, V, sms)


def short_chunks(B, T, H, HV, K, V, streams=False, split_chunks=0):
    """kda_policy.h's fwd_short_chunks_pay for a fixed-length problem: whether a forward that saves
    nothing runs the 32-token chunks, given the launcher's streaming and split decisions."""
    return bool(lib().kda_emu_short_chunks(B, T, H, HV, K, V, int(streams), split_chunks))


def scan_bv(B, T, H, HV, K, V, fwd_chunk=64):
    """kda_policy.h's fwd_scan_bv_alone for a fixed-length problem chunked at fwd_chunk tokens: the
    V-slice width of the forward's scan run on its own (neither streamed nor split)."""
    return lib().kda_emu_scan_bv(B, T, H, HV, K, V, fwd_chunk)


SPLIT_LAYOUT = ("NP", "map_ints", "state_floats", "cu", "seq_piece0", "piece_seq", "piece_flags", "init", "final")


def set_schedule(order: str = "forward", warp_greedy: bool = False, seed: int = 0) -> None:
    """The emulator's fiber schedule: order "forward" (thread order), "reverse" or "random" (a fresh
    seeded permutation every pass); warp_greedy runs each warp as far as the barriers allow before
    the next one starts (exposes smem reads of another warp's writes without a barrier between)."""
    lib().kf_emu_set_schedule({"forward": 0, "reverse": 1, "random": 2}[order], int(warp_greedy), seed)


def configure(threads: int = 0, stack_kib: int = 0, ftz: bool | None = None) -> None:
    """Worker OS threads (0: KF_EMU_THREADS or the core count), per-fiber stack, FTZ (None: keep)."""
    lib().kf_emu_configure(threads, stack_kib, -1 if ftz is None else int(ftz))


def _ptr(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


class _Guarded:
    """Buffers allocated inside poisoned guard zones; ``check()`` raises on any touched guard."""

    def __init__(self):
        self.bufs = []  # (name, flat buffer, start, numel, snapshot of the flat buffer)

    def alloc(self, name, shape, dtype, fill=float("nan"), offset=0, init=None):
        n = math.prod(shape)
        flat = torch.full((n + 2 * GUARD + offset,), fill, dtype=dtype)
        view = flat[GUARD + offset:GUARD + offset + n].view(shape)
        if init is not None:
            view.copy_(init)
        self.bufs.append((name, flat, GUARD + offset, n, flat.clone()))
        return view

    def copy_in(self, name, t, offset=0):
        """t copied into a NaN-padded buffer (offset elements further in: misaligned on purpose)."""
        fill = float("nan") if t.is_floating_point() else 0
        return self.alloc(name, tuple(t.shape), t.dtype, fill=fill, offset=offset, init=t)

    def check(self):
        for name, flat, start, n, before in self.bufs:
            bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
            for part in (slice(0, start), slice(start + n, None)):
                if not bool((flat[part].view(bits) == before[part].view(bits)).all()):
                    raise RuntimeError(f"kf_emu: out-of-bounds write next to {name!r}")


def _options(q, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
             lower_bound, A_log, state_v_first):
    from kernel_fun.kda._options import KdaOptions

    return KdaOptions.from_call(scale=q.shape[-1] ** -0.5 if scale is None else scale,
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                                allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound,
                                A_log=A_log if use_gate_in_kernel else None, state_v_first=state_v_first,
                                chunk_size=64)


def _setup(q, k, v, g, beta, opts, initial_state, cu_seqlens, A_log, dt_bias, misalign, backward, saved=None,
           recurrent=False):
    """Guarded copies of the inputs, the workspace and the common argument fields. recurrent: the fp32
    token recurrence where every sequence fits in one chunk (KdaProblem::recurrent)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dt = q.dtype
    if dt not in (torch.bfloat16, torch.float16):
        raise ValueError("q dtype must be bfloat16 or float16")
    gz = _Guarded()
    off = 1 if misalign else 0
    # The backward's q / k are 16-byte aligned by contract (the front's _aligned, checked in csrc/api:
    # kda_bwd_grads copies them with cp.async); g may sit anywhere in both directions.
    off_qk = 0 if backward else off
    x = dict(q=gz.copy_in("q", q.contiguous(), off_qk), k=gz.copy_in("k", k.contiguous(), off_qk),
             v=gz.copy_in("v", v.contiguous()), g=gz.copy_in("g", g.contiguous(), off),
             beta=gz.copy_in("beta", beta.contiguous()))
    if cu_seqlens is not None:
        cu = cu_seqlens.detach().cpu().contiguous()
        N = cu.numel() - 1
        max_chunks = T // CHUNK + N
    else:
        cu = None
        N = B
        max_chunks = B * (-(-T // CHUNK))
    ws = {
        "w": gz.alloc("w", (B * T, HV, K), dt),
        "qg": gz.alloc("qg", (B * T, HV, K), dt),
        "kg": gz.alloc("kg", (B * T, HV, K), dt),
        "gdecay": gz.alloc("gdecay", (max_chunks, HV, K), torch.float32),
        "chunk_offsets": gz.alloc("chunk_offsets", (2 * N + 1,), torch.int32, fill=0),  # offsets, then the order
    }
    if saved is not None:  # the forward's factors, as inputs
        for name, t in zip(("Aqk", "Akk", "M"), saved):
            ws[name] = gz.copy_in(name, t.contiguous())
    else:
        for name in ("Aqk", "Akk", "M"):
            ws[name] = gz.alloc(name, (B * T, HV, CHUNK), dt)
    if backward:
        ws["h_ckpt"] = gz.alloc("h_ckpt", (max_chunks, HV, V, K), dt)
        ws["dh_ckpt"] = gz.alloc("dh_ckpt", (max_chunks, HV, V, K), dt)
        if recurrent:  # kda_problem.h's workspace(): recur_slice_floats(K) per (sequence, value head, slice)
            ws["recur_state"] = gz.alloc("recur_state", (N, HV, V // 32, CHUNK * K * 35 + CHUNK), torch.float32)
        if HV != H or recurrent:
            ws["dqhat"] = gz.alloc("dqhat", (B * T, HV, K), torch.float32)
            ws["dkhat"] = gz.alloc("dkhat", (B * T, HV, K), torch.float32)
        if opts.gate != "precomputed":
            ws["pbias"] = gz.alloc("pbias", (max_chunks, HV, K), torch.float32)
            ws["pA"] = gz.alloc("pA", (max_chunks, HV), torch.float32)
    if initial_state is not None:
        x["h0"] = gz.copy_in("initial_state", initial_state.detach().to(torch.float32).contiguous())
    f32 = lambda n, t: None if t is None else gz.copy_in(n, t.detach().reshape(-1).to(torch.float32))  # noqa: E731
    x["A_log"] = f32("A_log", A_log) if opts.uses_A_log else None
    x["dt_bias"] = f32("dt_bias", dt_bias) if opts.uses_dt_bias else None
    enc = ctypes.create_string_buffer(opts.encode().encode())
    fields = dict(cu_seqlens=_ptr(cu), options=ctypes.cast(enc, ctypes.c_void_p),
                  cu_int64=int(cu is not None and cu.dtype == torch.int64), B=B, T=T, H=H, HV=HV, K=K, V=V, N=N,
                  max_chunks=max_chunks, dtype=_DTYPE[dt], g_dtype=_DTYPE[g.dtype], beta_dtype=_DTYPE[beta.dtype],
                  saved_factors=int(saved is not None), recurrent=int(recurrent))
    for name, t in list(x.items()) + list(ws.items()):
        fields[name] = _ptr(t)
    return gz, ws, fields, (cu, enc)


def _split_buffers(a, gz, ws, split_chunks, chain_cols=0):
    """The split scans' two buffers (kda_problem.h's SplitLayout) for args a, guarded, into ws (with
    ws["split_layout"]) and a; nothing when split_chunks is 0. chain_cols: the chain kernel's column
    block (8, 16 or 32; 0: the launcher's rule, split_chain_cols for 132 SMs)."""
    if not split_chunks:
        return
    a.split_chunks = int(split_chunks)
    a.chain_cols = int(chain_cols)
    lay = (ctypes.c_int64 * len(SPLIT_LAYOUT))()
    if lib().kda_emu_split_layout(ctypes.byref(a), ctypes.cast(lay, ctypes.c_void_p)):
        raise RuntimeError(lib().kda_emu_last_error().decode())
    ws["split_layout"] = dict(zip(SPLIT_LAYOUT, list(lay)))
    ws["split_map"] = gz.alloc("split_map", (lay[1],), torch.int32, fill=-1)
    ws["split_state"] = gz.alloc("split_state", (lay[2],), torch.float32)
    a.split_map, a.split_state = _ptr(ws["split_map"]), _ptr(ws["split_state"])


def forward_stages(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                   allow_neg_eigval=False, lower_bound=None, state_v_first=False, cu_seqlens=None,
                   A_log=None, dt_bias=None, return_intermediate_states=False, bv=None, misalign=False,
                   streamed=False, stream_stop=-1, recurrent=False, save_states=False, split_chunks=0,
                   chain_cols=0, fwd_chunk=64, identity_cols=False):
    """(o, final_state, h_states, ws) as kernel_fun.kda._kernel.forward_stages, on the emulator.
    recurrent=True: the fp32 token recurrence (csrc/kda/recur/) where every sequence fits in one chunk
    (the chunk kernels' workspace in ws is then left unwritten).
    bv forces the scan's V-slice (64 or 128; default: the launcher's choice). misalign=True stores
    q, k and g one element off 16-byte alignment (the intra kernel's fallback load paths).
    streamed=True runs the streamed forward's kernels (the intra's transposed grid publishing every
    chunk, the scan's pass 1 waiting for each chunk's flag, pass 2 resuming the chains pass 1
    stopped; ws["chunk_ready"], ws["scan_save"]), whatever the launch policy says. stream_stop: -1
    the intra runs before pass 1 (no chain stops), 0 after it (every chain stops at chunk 0, as
    under a tool that serialises launches), m > 0 pass 1 finds only chunks < m published (chunks at
    the call's size: with fwd_chunk=32 the streamed 32-token forward).
    save_states=True: the scan also writes the state before every chunk into ws["h_ckpt"] (a
    training forward's saved states, [max_chunks, HV, V, K], which backward_stages' states reads).
    fwd_chunk=32: forward_sequence's 32-token forward (KdaProblem::fwd_chunk; ws then holds its
    workspace as kda_problem.h's workspace() sizes it: Aqk / Akk [B*T, HV, 32], gdecay one row per
    32-token chunk).
    split_chunks=L > 0: the split forward (csrc/kda/fwd/kda_fwd_split.cuh) with pieces of L chunks,
    whatever the launch policy says; ws["split_map"] (int32), ws["split_state"] (fp32) and
    ws["split_layout"] (kda_problem.h's SplitLayout, a dict of SPLIT_LAYOUT); chain_cols forces the
    chain kernel's column block (8, 16 or 32; 0: the launcher's rule).
    identity_cols=True: K identity columns beside v's (KdaProblem::id_cols, the context-parallel call of
    a document that began on an earlier rank): o holds the value columns' outputs from a zero state,
    ws["o_id"] ([B, T, HV, K]) the identity columns' (Q), and the final state has V + K columns ([E |
    Phi]); initial_state must be None."""
    opts = _options(q, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                    allow_neg_eigval, lower_bound, A_log, state_v_first)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    gz, ws, f, keep = _setup(q, k, v, g, beta, opts, initial_state, cu_seqlens, A_log, dt_bias, misalign, False,
                             recurrent=recurrent)
    cu = keep[0]
    N = f["N"]
    o = gz.alloc("o", (B, T, HV, V), q.dtype)
    W = V + K if identity_cols else V  # the state's columns
    if identity_cols:
        ws["o_id"] = gz.alloc("o_id", (B, T, HV, K), q.dtype)
    st_shape = (N, HV, W, K) if state_v_first else (N, HV, K, W)
    ht = gz.alloc("ht", st_shape, torch.float32) if output_final_state else None
    h_states = None
    if return_intermediate_states:
        if cu is None:
            lead = (B, -(-T // CHUNK))
        else:
            lens = (cu[1:] - cu[:-1]).to(torch.int64)
            lead = (1, int(((lens + CHUNK - 1) // CHUNK).sum()))
        h_states = gz.alloc("h_states", (*lead, HV, *((V, K) if state_v_first else (K, V))), q.dtype)
    if streamed:
        # kda_problem.h's stream_flag_count: one flag per chunk at the call's size (stream_chunks)
        chunks = f["max_chunks"] if fwd_chunk != 32 else _c32_chunk_bound(B, T, N, cu is not None)
        nflags = chunks * HV + 1 + HV * N * (V // 64) + 3
        ws["chunk_ready"] = gz.alloc("chunk_ready", (nflags,), torch.int32, fill=0)
        ws["scan_save"] = gz.alloc("scan_save", (N, HV, K, V), torch.float32)
    if save_states:
        ws["h_ckpt"] = gz.alloc("h_ckpt", (f["max_chunks"], HV, V, K), q.dtype)
    if fwd_chunk == 32:  # kda_problem.h's workspace(): Aqk, Akk [B*T, HV, 32], gdecay one row per 32-token chunk
        ws["gdecay"] = gz.alloc("gdecay (c32)", (_c32_chunk_bound(B, T, N, cu is not None), HV, K), torch.float32)
        ws.update({n: gz.alloc(n + " (c32)", (B * T, HV, 32), q.dtype) for n in ("Aqk", "Akk")})
        f.update({n: _ptr(ws[n]) for n in ("gdecay", "Aqk", "Akk")})
    a = KdaEmuArgs(**f, o=_ptr(o), ht=_ptr(ht), h_states=_ptr(h_states), bv=int(bv or 0),
                   chunk_ready=_ptr(ws.get("chunk_ready")), scan_save=_ptr(ws.get("scan_save")),
                   stream_stop=int(stream_stop), h_ckpt=_ptr(ws.get("h_ckpt")), fwd_chunk=int(fwd_chunk))
    if identity_cols:
        a.V, a.id_cols, a.o_id = W, K, _ptr(ws["o_id"])
    L = lib()
    _split_buffers(a, gz, ws, split_chunks, chain_cols)
    if L.kda_emu_forward(ctypes.byref(a)):
        raise RuntimeError(L.kda_emu_last_error().decode())
    gz.check()
    return o, ht, h_states, ws


def forward_fused(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                  allow_neg_eigval=False, lower_bound=None, state_v_first=False, cu_seqlens=None, A_log=None,
                  dt_bias=None, bv=None, **_ignored):
    """(o, final_state, ws) of the fused forward (csrc/kda/fwd/kda_fwd_fused.cuh), on the emulator:
    the forward sequence with the fused kernel chosen. ws: the workspace buffers, NaN-poisoned, which
    the fused forward neither reads nor writes (they stay NaN)."""
    opts = _options(q, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                    allow_neg_eigval, lower_bound, A_log, state_v_first)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    gz, ws, f, keep = _setup(q, k, v, g, beta, opts, initial_state, cu_seqlens, A_log, dt_bias, False, False)
    N = f["N"]
    o = gz.alloc("o", (B, T, HV, V), q.dtype)
    ht = gz.alloc("ht", (N, HV, V, K) if state_v_first else (N, HV, K, V), torch.float32) if output_final_state else None
    a = KdaEmuArgs(**f, o=_ptr(o), ht=_ptr(ht), h_states=None, bv=int(bv or 0))
    L = lib()
    if L.kda_emu_fused_forward(ctypes.byref(a)):
        raise RuntimeError(L.kda_emu_last_error().decode())
    gz.check()
    return o, ht, ws


def _c32_chunk_bound(B, T, N, varlen):
    """kda_problem.h's chunk_bound at 32 tokens: gdecay's rows in the 32-token forward."""
    return T // 32 + N if varlen else B * (-(-T // 32))


def intra_c32(q, k, v, g, beta, *, scale=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, A_log=None, dt_bias=None,
              misalign=False, cu_seqlens=None, **_ignored):
    """The experimental 32-token forward intra (csrc/kda/fwd/kda_fwd_intra_c32.cuh) alone: its
    workspace {w, qg, kg: [B*T, HV, K]; Aqk, Akk, M: [B*T, HV, 32]; gdecay: [B * ceil(T / 32), HV, K]
    fp32}, NaN where never written (gdecay: T // 32 + N rows with cu_seqlens)."""
    return _c32(q, k, v, g, beta, None, False, 0, dict(
        scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias, misalign=misalign, cu_seqlens=cu_seqlens))[2]


def forward_c32(q, k, v, g, beta, *, initial_state=None, output_final_state=False, bv=64, **kw):
    """The experimental 32-token forward (that intra, then kda_fwd_scan_c32_kernel at V-slice bv):
    (o, final_state, ws) with ws as intra_c32's. kw: intra_c32's options."""
    return _c32(q, k, v, g, beta, initial_state, output_final_state, bv, kw)


def _c32(q, k, v, g, beta, initial_state, output_final_state, bv, kw):
    opts = _options(q, kw.get("scale"), kw.get("use_qk_l2norm_in_kernel", False), kw.get("use_gate_in_kernel", False),
                    kw.get("use_beta_sigmoid_in_kernel", False), kw.get("allow_neg_eigval", False),
                    kw.get("lower_bound"), kw.get("A_log"), False)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    gz, _, f, keep = _setup(q, k, v, g, beta, opts, initial_state, kw.get("cu_seqlens"), kw.get("A_log"),
                            kw.get("dt_bias"), kw.get("misalign", False), False)
    dt = q.dtype
    ws = {n: gz.alloc(n + " (c32)", (B * T, HV, K), dt) for n in ("w", "qg", "kg")}
    ws.update({n: gz.alloc(n + " (c32)", (B * T, HV, 32), dt) for n in ("Aqk", "Akk", "M")})
    rows = _c32_chunk_bound(B, T, f["N"], kw.get("cu_seqlens") is not None)
    ws["gdecay"] = gz.alloc("gdecay (c32)", (rows, HV, K), torch.float32)
    f.update({n: _ptr(t) for n, t in ws.items()})
    o = ht = None
    if bv:
        o = gz.alloc("o", (B, T, HV, V), dt)
        ht = gz.alloc("ht", (f["N"], HV, K, V), torch.float32) if output_final_state else None
        f.update(o=_ptr(o), ht=_ptr(ht))
    a = KdaEmuArgs(**f, bv=int(bv))
    fn = lib().kda_emu_forward_c32 if bv else lib().kda_emu_intra_c32
    if fn(ctypes.byref(a)):
        raise RuntimeError(lib().kda_emu_last_error().decode())
    gz.check()
    return o, ht, ws


def intra_stage_check(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm_in_kernel=False,
                      use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                      lower_bound=None, state_v_first=False, cu_seqlens=None, A_log=None, dt_bias=None, **_ignored):
    """The intra phases written into a scan stage (IntraToStage, the fused forward's handoff) and the
    stage dev::scan_load_chunk fills from the workspace of the two-kernel forward, for every (chunk,
    value head): (from_intra, from_load, layout), stages [max_chunks, HV, elems] in q's dtype (raw
    16-bit), layout = {elems, w, qg, kg, Aqk, Akk, dec, AP} (offsets in elements)."""
    opts = _options(q, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                    allow_neg_eigval, lower_bound, A_log, state_v_first)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    gz, ws, f, keep = _setup(q, k, v, g, beta, opts, initial_state, cu_seqlens, A_log, dt_bias, False, False)
    o = gz.alloc("o", (B, T, HV, V), q.dtype)
    a = KdaEmuArgs(**f, o=_ptr(o), ht=None, h_states=None, bv=0)
    L = lib()
    if L.kda_emu_forward(ctypes.byref(a)):
        raise RuntimeError(L.kda_emu_last_error().decode())
    bound = 4 * CHUNK * K + 3 * CHUNK * 72 + 2 * K + 512  # >= ScanStage<WT, K, 64>::kStageElems
    n = f["max_chunks"] * HV
    outs = [torch.full((n * bound,), -1, dtype=torch.int16) for _ in range(2)]
    layout = torch.zeros(8, dtype=torch.int64)
    if L.kda_emu_intra_stage_check(ctypes.byref(a), _ptr(outs[0]), _ptr(outs[1]), _ptr(layout)):
        raise RuntimeError(L.kda_emu_last_error().decode())
    elems = int(layout[0])
    return outs[0][: n * elems].view(f["max_chunks"], HV, elems), outs[1][: n * elems].view(f["max_chunks"], HV, elems), \
        layout.tolist()


def gate_params(pbias, pA, nc, varlen=False):
    """kda_bwd_finish's dA_log / ddt_bias passes on given fp32 partials pbias [max_chunks, HV, K] and
    pA [max_chunks, HV] (the first nc chunks written; copies are passed, the kernels work in place)."""
    pbias, pA = pbias.clone().contiguous(), pA.clone().contiguous()
    max_chunks, HV, K = pbias.shape
    dA_log = torch.full((HV,), float("nan"))
    ddt_bias = torch.full((HV, K), float("nan"))
    if lib().kda_emu_gate_params(_ptr(pbias), _ptr(pA), _ptr(dA_log), _ptr(ddt_bias), HV, K, nc, max_chunks,
                                 int(varlen)):
        raise RuntimeError(lib().kda_emu_last_error().decode())
    return dA_log, ddt_bias


# chunk_kda's keyword arguments that the emulator's stages take (everything but scale and the flags of
# the call's outputs); a caller holding chunk_kda's keyword arguments picks these.
CALL_KEYS = ("initial_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
             "allow_neg_eigval", "lower_bound", "state_v_first", "cu_seqlens", "A_log", "dt_bias")


def training_call(q, k, v, g, beta, do, dht=None, *, scale=None, **kw):
    """One training call as chunk_kda's autograd runs it: the forward (o, final state), then the
    backward from the factors it saved (Aqk, Akk, M: kda_bwd_prep, not the forward intra). kw: CALL_KEYS.
    Returns (o, final_state, grads, st) with st = backward_stages' stages plus the forward's M."""
    o, ht, _, ws = forward_stages(q, k, v, g, beta, scale=scale, output_final_state=True, **kw)
    grads, st = backward_stages(q, k, v, g, beta, do, dht, scale=scale, saved=(ws["Aqk"], ws["Akk"], ws["M"]), **kw)
    st["M"] = ws["M"]
    return o, ht, grads, st


def chunk_kda_outputs(inputs, kw, seeds):
    """kernel_fun.bench.accuracy.ours on the emulator: o, ht and every gradient of one training call
    (training_call) in that tool's format, so its errors() compares them with its reference. inputs:
    (q, k, v, g, beta); kw: chunk_kda's keyword arguments; seeds: the output gradients {"o", "ht"}."""
    scale = kw.get("scale") or inputs[0].shape[-1] ** -0.5
    o, ht, grads, _ = training_call(*inputs, seeds["o"], seeds["ht"], scale=scale,
                                    **{n: kw.get(n) for n in CALL_KEYS})
    out = {k_: v_ for k_, v_ in grads.items() if v_ is not None}
    if kw.get("A_log") is not None and "dA_log" in out:  # the leaf's own shape ([HV] or [1, 1, HV, 1])
        out["dA_log"] = out["dA_log"].reshape(kw["A_log"].shape)
    out["o"] = o
    if kw.get("output_final_state"):
        out["ht"] = ht
    return out


def backward_stages(q, k, v, g, beta, do, dht=None, *, scale=None, initial_state=None,
                    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                    allow_neg_eigval=False, lower_bound=None, state_v_first=False, cu_seqlens=None, A_log=None,
                    dt_bias=None, bv=None, misalign=False, saved=None, slice_b=0, pair_scans=0, balance=-1,
                    recurrent=False, states=None, workspace=None, split_chunks=0, chain_cols=0,
                    streamed=False, gva_chain=True, **_ignored):
    """(grads, st) as kernel_fun.kda._kernel.backward_stages, on the emulator: grads = {dq, dk, dv, dg,
    dbeta, dA_log, ddt_bias, dh0} (None where not applicable), st = {dA, dL, and the workspace}.
    saved: the forward's (Aqk, Akk, M) (from forward_stages' ws): kda_bwd_prep instead of the intra.
    slice_b: run the stages on slice_b batches at a time (csrc/kda/bwd/kda_bwd_slice.h; the workspace
    then holds the last slice's values only). pair_scans: 0 = the launcher's choice
    (kda_policy.h's bwd_pair_scans), 1 = the re-scan and the dh scan in one launch
    (csrc/kda/bwd/kda_bwd_scans.cuh), 2 = two launches. balance: kda_bwd_grads' load-balancing bits
    (KdaBwdParams::balance: 1 I1, 2 E1), -1 = the default. recurrent=True: the fp32 token recurrence's
    backward where every sequence fits in one chunk (st's chunk-kernel stages are then unwritten).
    states: the forward's saved states (forward_stages' ws["h_ckpt"] with save_states), beside saved:
    no re-scan; st["h_ckpt"] is then a copy of them. workspace: the forward's {w, qg, kg, gdecay}
    (forward_stages' ws), beside saved: no kda_bwd_prep; st's are then copies of them.
    streamed=True (with states): the streamed backward's grids and counters (KdaBwdParams::dh_ready;
    on the GPU kda_bwd_grads runs beside the dh scan): st["dh_ready"] holds the counters after it.
    split_chunks=L > 0: the split scans (the re-scan and the dh scan in pieces of L chunks), whatever
    the launch policy says; st["split_map"], st["split_state"], st["split_layout"] and chain_cols as
    forward_stages'.
    gva_chain (GVA): the grads kernel sums dq^ / dk^ over each group along a chain of its CTAs
    (KdaBwdParams::gva_flags; st["gva_flags"] holds the flags after it, st["dqhat"] / ["dkhat"] the
    running sums of each group's heads 0 .. G - 2); False: every head's dq^ / dk^ to the workspace and
    kda_bwd_group_sum sums them (the chain's reference; the GPU always chains)."""
    opts = _options(q, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                    allow_neg_eigval, lower_bound, A_log, state_v_first)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    gz, ws, f, keep = _setup(q, k, v, g, beta, opts, initial_state, cu_seqlens, A_log, dt_bias, misalign, True,
                             saved, recurrent=recurrent)
    dt = q.dtype
    if states is not None:  # in place of the per-call h_ckpt workspace, which then stays NaN
        ws["h_ckpt"] = gz.copy_in("h_ckpt (saved)", states.contiguous())
        f["h_ckpt"] = _ptr(ws["h_ckpt"])
    for name in ("w", "qg", "kg", "gdecay") if workspace is not None else ():
        ws[name] = gz.copy_in(name + " (saved)", workspace[name].contiguous())
        f[name] = _ptr(ws[name])
    do_ = gz.copy_in("do", do.to(dt).contiguous())
    dht_ = gz.copy_in("dht", dht.to(torch.float32).contiguous()) if dht is not None else None
    grads = dict(dq=gz.alloc("dq", (B, T, H, K), dt), dk=gz.alloc("dk", (B, T, H, K), dt),
                 dv=gz.alloc("dv", (B, T, HV, V), dt),
                 dg=gz.alloc("dg", tuple(g.shape), g.dtype, offset=1 if misalign else 0),
                 dbeta=gz.alloc("dbeta", tuple(beta.shape), beta.dtype),
                 dA_log=gz.alloc("dA_log", (HV,), torch.float32) if f["A_log"] else None,
                 ddt_bias=gz.alloc("ddt_bias", (HV * K,), torch.float32) if f["dt_bias"] else None,
                 dh0=gz.alloc("dh0", tuple(initial_state.shape), torch.float32) if initial_state is not None else None)
    st = dict(dA=gz.alloc("dbg_dA", (B * T, HV, CHUNK), torch.float32, fill=0.0),
              dL=gz.alloc("dbg_dL", (B * T, HV, CHUNK), torch.float32, fill=0.0))
    a = KdaEmuArgs(**f, dout=_ptr(do_), dht=_ptr(dht_), **{n: _ptr(t) for n, t in grads.items()},
                   dbg_dA=_ptr(st["dA"]), dbg_dL=_ptr(st["dL"]), bv=int(bv or 0),
                   slice_b=int(slice_b), pair_scans=int(pair_scans), balance=int(balance),
                   saved_states=int(states is not None), saved_workspace=int(workspace is not None))
    if streamed:  # kda_problem.h's bwd_stream_ints: a counter per (sequence, value head, 64 columns), 2 done
        ws["dh_ready"] = gz.alloc("dh_ready", (B * HV * (V // 64) + 2,), torch.int32, fill=-1)
        a.dh_ready = _ptr(ws["dh_ready"])
    if gva_chain and HV != H and not recurrent:  # kda_problem.h's gva_flag_count (max_chunks covers a slice's)
        ws["gva_flags"] = gz.alloc("gva_flags", (f["max_chunks"], H), torch.int32, fill=-1)
        a.gva_flags = _ptr(ws["gva_flags"])
        # the chain's running sums: rows of each group's heads 0 .. G - 2 only (kda_problem.h's gva_hat_row)
        for name in ("dqhat", "dkhat"):
            ws[name] = gz.alloc(name + " (chain)", (B * T, HV - H, K), torch.float32)
            setattr(a, name, _ptr(ws[name]))
    L = lib()
    _split_buffers(a, gz, ws, split_chunks, chain_cols)
    if L.kda_emu_backward(ctypes.byref(a)):
        raise RuntimeError(L.kda_emu_last_error().decode())
    gz.check()
    st.update(ws)
    return grads, st
