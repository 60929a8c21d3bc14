"""Independent pure-PyTorch references for Kimi Delta Attention (KDA).

Everything here runs on any device (CPU included), in fp32 or fp64, and is differentiable by
autograd with respect to q, k, v, g, beta, A_log, dt_bias and initial_state. Nothing is fast:
these are the ground truth the CUDA kernels are tested against.

Public functions
----------------
``kda_gate(g, A_log=None, dt_bias=None, lower_bound=None)``
    The in-kernel gate activation, natural-log per-step decay, [B, T, HV, K].
``prepare_inputs(q, k, g, beta, *, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                 use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, A_log, dt_bias)``
    The in-kernel preprocessing (l2norm of q/k, gate activation, beta sigmoid).
``naive_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None,
                      output_final_state=False, *, <preprocessing flags>, state_v_first=False,
                      cu_seqlens=None) -> (o, ht)``
    The token-by-token recurrence, per (b, hv):
        S <- S * exp(g_t)[:, None]
        S <- S + (beta_t k_t) outer (v_t - S^T k_t)
        o_t = S^T (scale * q_t)
``chunk_kda_reference(<same args>, chunk_size=64, return_stages=False)``
    The chunked algorithm (docs/kda.md maps each stage to its kernel), stage by stage. With
    ``return_stages=True`` it returns ``(o, ht, stages)``.

Shapes and dtypes
-----------------
q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV]; HV % H == 0 and value
head hv reads q/k head hv // (HV // H). initial_state / ht are [N, HV, K, V] ([N, HV, V, K] with
``state_v_first``), N = B, or N = len(cu_seqlens) - 1 with cu_seqlens (which requires B == 1;
sequence n covers rows cu_seqlens[n]:cu_seqlens[n+1] of T, and empty sequences are allowed).
The compute dtype is fp64 when any of q, k, v, g, beta is fp64, else fp32. o comes back in q's
dtype, ht in the compute dtype (None unless ``output_final_state``).

Stages (``return_stages=True``)
-------------------------------
BT = chunk_size. Chunks are chunk-local to each sequence (with cu_seqlens they restart at every
sequence start; a sequence's tail chunk is padded internally with rows of gate 0, k 0, v 0,
beta 0 that affect nothing). All logs inside are base 2. Every entry is in the compute dtype:

==========  =====================  =============================================================
key         layout                 meaning
==========  =====================  =============================================================
'q', 'k'    [B, T, H, K]           q and k after the optional l2norm (not scaled, not expanded)
'beta'      [B, T, HV]             beta after the optional (s *) sigmoid
'gate'      [B, T, HV, K]          natural-log per-step gate (after kda_gate when in-kernel)
'g2'        [B, T, HV, K]          (1/ln2) * chunk-local inclusive cumsum of 'gate'
'Aqk'       [B, T, HV, BT]         row t = chunk row i of t, entry j: scale * sum_d q_i k_j
                                   exp2(g2_i - g2_j) for j <= i, 0 for j > i (fla's layout);
                                   columns past the end of a short tail chunk are 0
'Akk'       [B, T, HV, BT]         same layout: (I + L)^-1 diag(beta), L[i, j] = beta_i sum_d
                                   k_i k_j exp2(g2_i - g2_j) for j < i (strictly lower)
'w'         [B, T, HV, K]          Akk @ (exp2(g2) * k)
'u'         [B, T, HV, V]          Akk @ v
'kg'        [B, T, HV, K]          k * exp2(G - g2), G = g2 of the chunk's last valid row
'qg'        [B, T, HV, K]          q * exp2(g2)  (no scale)
'h'         [B, NT, HV, K, V]      state read by each chunk (the state BEFORE the chunk), always
                                   K-major whatever state_v_first; with cu_seqlens B = 1 and NT
                                   counts the chunks of all sequences, in order
'v_new'     [B, T, HV, V]          u - w @ h
'o'         [B, T, HV, V]          scale * qg @ h + Aqk @ v_new (compute dtype)
==========  =====================  =============================================================

'q'/'k' are per q/k head; every other per-token tensor is per value head (q/k expanded).

Numerics: exp2 is only ever applied to non-positive arguments for well-formed (<= 0) gates:
pairwise decays exp2(g2_i - g2_j) are formed as a masked [.., BT, BT, K] difference tensor with
the upper triangle set to -inf BEFORE exponentiation, so per-step gates of -1000 or
exp(A_log) = 16 stay finite in outputs and gradients.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["kda_gate", "prepare_inputs", "naive_recurrent_kda", "chunk_kda_reference"]

_RCP_LN2 = 1.0 / math.log(2.0)


def _compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def _promote(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _softplus(x: torch.Tensor) -> torch.Tensor:
    # x if x > 20 else log1p(exp(x)); the exp branch sees a clamped input so that neither branch
    # nor its gradient is ever inf/NaN.
    safe = torch.clamp(x, max=20.0)
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(safe)))


def kda_gate(g: torch.Tensor, A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
             lower_bound: float | None = None) -> torch.Tensor:
    """Natural-log per-step gate from the raw gate input g [..., HV, K].

    unbounded (lower_bound None): -exp(A_log[h]) * softplus(g + dt_bias[h, :])
    bounded:                      lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h, :]))
    bounded, A_log None:          lower_bound * sigmoid(g + dt_bias[h, :])
    A_log has HV elements in any shape; dt_bias is flat [HV * K] (optional). Computed and
    returned in g's dtype promoted to at least fp32.
    """
    HV, K = g.shape[-2], g.shape[-1]
    cd = _promote(g.dtype)
    x = g.to(cd)
    if dt_bias is not None:
        if dt_bias.numel() != HV * K:
            raise ValueError(f"dt_bias must have HV*K = {HV * K} elements, got {dt_bias.numel()}")
        x = x + dt_bias.to(cd).reshape(HV, K)
    if A_log is not None:
        if A_log.numel() != HV:
            raise ValueError(f"A_log must have HV = {HV} elements, got {A_log.numel()}")
        a = torch.exp(A_log.to(cd).reshape(HV, 1))
    if lower_bound is None:
        if A_log is None:
            raise ValueError("kda_gate: A_log is required for the unbounded gate (lower_bound=None)")
        return -a * _softplus(x)
    if A_log is None:
        return lower_bound * torch.sigmoid(x)
    return lower_bound * torch.sigmoid(a * x)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def prepare_inputs(q, k, g, beta, *, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
                   use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool,
                   lower_bound: float | None, A_log: torch.Tensor | None,
                   dt_bias: torch.Tensor | None):
    """Apply chunk_kda's in-kernel preprocessing; returns (q, k, g, beta) in fp32 (fp64 when the
    input is fp64): q/k l2-normalised (x / sqrt(sum x^2 + 1e-6)), g the natural-log per-step gate,
    beta = s * sigmoid(beta) with s = 2 if allow_neg_eigval else 1."""
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    q = q.to(_promote(q.dtype))
    k = k.to(_promote(k.dtype))
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    if use_gate_in_kernel:
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    else:
        g = g.to(_promote(g.dtype))
    beta = beta.to(_promote(beta.dtype))
    if use_beta_sigmoid_in_kernel:
        beta = (2.0 if allow_neg_eigval else 1.0) * torch.sigmoid(beta)
    return q, k, g, beta


def _common(q, k, v, g, beta, scale, initial_state, state_v_first, cu_seqlens, flags):
    """Validate, preprocess, cast to the compute dtype, expand q/k to value heads.
    Returns a dict with everything the two algorithms need."""
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(f"q and k must be [B,T,H,K] of the same shape, got {tuple(q.shape)}, {tuple(k.shape)}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if v.shape[:2] != (B, T) or HV % H != 0:
        raise ValueError(f"v must be [B,T,HV,V] with HV % H == 0, got {tuple(v.shape)} for H={H}")
    if g.shape != (B, T, HV, K):
        raise ValueError(f"g must be {(B, T, HV, K)}, got {tuple(g.shape)}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta must be {(B, T, HV)}, got {tuple(beta.shape)}")
    cd = _compute_dtype(q, k, v, g, beta)
    if scale is None:
        scale = K ** -0.5
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens requires B == 1, got B={B}")
        bounds = [int(x) for x in cu_seqlens.tolist()]
        if bounds[0] != 0 or bounds[-1] != T or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
            raise ValueError(f"cu_seqlens must be non-decreasing from 0 to T={T}, got {bounds}")
        N = len(bounds) - 1
    else:
        bounds = None
        N = B
    h0 = None
    if initial_state is not None:
        want = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state must be {want}, got {tuple(initial_state.shape)}")
        h0 = initial_state.to(cd)
        if state_v_first:
            h0 = h0.transpose(-1, -2)
    qp, kp, gp, bp = prepare_inputs(q.to(cd), k.to(cd), g.to(cd), beta.to(cd), **flags)
    gp, bp = gp.to(cd), bp.to(cd)
    rep = HV // H
    return dict(B=B, T=T, H=H, K=K, HV=HV, V=V, N=N, cd=cd, scale=float(scale), bounds=bounds,
                h0=h0, q=qp, k=kp, qe=qp.repeat_interleave(rep, dim=2),
                ke=kp.repeat_interleave(rep, dim=2), v=v.to(cd), g=gp, beta=bp)


def _flags(use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
           lower_bound, A_log, dt_bias):
    return dict(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias)


def _segments(c):
    """(state index n, batch index b, t0, t1) for each independent sequence."""
    if c["bounds"] is None:
        return [(b, b, 0, c["T"]) for b in range(c["B"])]
    bd = c["bounds"]
    return [(n, 0, bd[n], bd[n + 1]) for n in range(len(bd) - 1)]


def _final(c, finals, output_final_state, state_v_first):
    if not output_final_state:
        return None
    ht = torch.stack(finals, 0)  # [N, HV, K, V]
    return ht.transpose(-1, -2) if state_v_first else ht


def naive_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, *,
                        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                        A_log=None, dt_bias=None, state_v_first=False, cu_seqlens=None):
    """Token-by-token KDA recurrence (see the module docstring). Returns (o, ht)."""
    c = _common(q, k, v, g, beta, scale, initial_state, state_v_first, cu_seqlens,
                _flags(use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                       allow_neg_eigval, lower_bound, A_log, dt_bias))
    HV, K, V, cd = c["HV"], c["K"], c["V"], c["cd"]
    qs = c["qe"] * c["scale"]
    ke, vv, gg, bb = c["ke"], c["v"], c["g"], c["beta"]
    outs, finals = [], []
    for n, b, t0, t1 in _segments(c):
        S = c["h0"][n] if c["h0"] is not None else torch.zeros(HV, K, V, dtype=cd, device=v.device)
        rows = []
        for t in range(t0, t1):
            S = S * torch.exp(gg[b, t])[:, :, None]                        # [HV, K, V]
            kt = ke[b, t]                                                  # [HV, K]
            pred = torch.einsum("hk,hkv->hv", kt, S)
            S = S + torch.einsum("hk,hv->hkv", bb[b, t][:, None] * kt, vv[b, t] - pred)
            rows.append(torch.einsum("hk,hkv->hv", qs[b, t], S))
        outs.append(rows)
        finals.append(S)
    if c["bounds"] is None:
        o = torch.stack([torch.stack(r, 0) if r else vv.new_zeros(0, HV, V) for r in outs], 0)
    else:
        flat = [x for r in outs for x in r]
        o = (torch.stack(flat, 0) if flat else vv.new_zeros(0, HV, V))[None]
    return o.to(q.dtype), _final(c, finals, output_final_state, state_v_first)


def _to_chunks(x: torch.Tensor, BT: int) -> torch.Tensor:
    """[B, T, HV, ...] -> [B, HV, NT, BT, ...], zero-padding the tail chunk."""
    T = x.shape[1]
    NT = -(-T // BT)
    pad = NT * BT - T
    if pad:
        spec = [0, 0] * (x.dim() - 2) + [0, pad]
        x = F.pad(x, spec)
    x = x.reshape(x.shape[0], NT, BT, *x.shape[2:])
    return x.movedim(3, 1)


def _from_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """[B, HV, NT, BT, ...] -> [B, T, HV, ...], dropping the padding."""
    x = x.movedim(1, 3)
    x = x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])
    return x[:, :T]


def _chunk_core(q, k, v, g, beta, scale, h0, BT):
    """The chunked algorithm on one fixed-length batch. q, k already expanded to value heads.
    q, k, g [B, T, HV, K]; v [B, T, HV, V]; beta [B, T, HV]; h0 [B, HV, K, V].
    Returns (o [B,T,HV,V], ht [B,HV,K,V], stages)."""
    B, T, HV, K = q.shape
    V = v.shape[-1]
    cd, dev = q.dtype, q.device
    qc, kc, vc, gc = (_to_chunks(x, BT) for x in (q, k, v, g))              # [B, HV, NT, BT, *]
    bc = _to_chunks(beta, BT)                                              # [B, HV, NT, BT]
    NT = qc.shape[2]

    # Stage 1: chunk-local inclusive cumsum, base 2. Padded rows have gate 0, so the last row of
    # a padded chunk carries the last valid row's value (G below).
    g2 = torch.cumsum(gc, dim=-2) * _RCP_LN2                               # [B, HV, NT, BT, K]
    G = g2[..., -1, :]                                                     # [B, HV, NT, K]

    # Stage 2: pairwise decays exp2(g2_i - g2_j), masked to i >= j before exponentiation.
    idx = torch.arange(BT, device=dev)
    ge = (idx[:, None] >= idx[None, :])                                    # [BT, BT]
    gt = (idx[:, None] > idx[None, :])
    diff = g2[..., :, None, :] - g2[..., None, :, :]                       # [B, HV, NT, BT, BT, K]
    diff = torch.where(ge[:, :, None], diff, torch.full((), float("-inf"), dtype=cd, device=dev))
    E = torch.exp2(diff)
    Aqk = scale * torch.einsum("...id,...jd,...ijd->...ij", qc, kc, E)     # lower incl. diagonal
    Lfull = torch.einsum("...id,...jd,...ijd->...ij", kc, kc, E)
    L = torch.where(gt, bc[..., :, None] * Lfull, torch.zeros((), dtype=cd, device=dev))
    eye = torch.eye(BT, dtype=cd, device=dev)
    Tinv = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    Akk = Tinv * bc[..., None, :]                                          # column j scaled by beta_j
    w = Akk @ (torch.exp2(g2) * kc)
    u = Akk @ vc
    kg = kc * torch.exp2(G[..., None, :] - g2)
    qg = qc * torch.exp2(g2)

    # Stages 3+4: serial scan over chunks.
    h = h0 if h0 is not None else torch.zeros(B, HV, K, V, dtype=cd, device=dev)
    hs, vns, os_ = [], [], []
    for c in range(NT):
        hs.append(h)
        vn = u[:, :, c] - w[:, :, c] @ h
        os_.append(scale * (qg[:, :, c] @ h) + Aqk[:, :, c] @ vn)
        vns.append(vn)
        h = torch.exp2(G[:, :, c])[..., None] * h + kg[:, :, c].transpose(-1, -2) @ vn
    if NT:
        o_c = torch.stack(os_, 2)
        vn_c = torch.stack(vns, 2)
        h_all = torch.stack(hs, 1)                                         # [B, NT, HV, K, V]
    else:
        o_c = vc.new_zeros(B, HV, 0, BT, V)
        vn_c = o_c
        h_all = vc.new_zeros(B, 0, HV, K, V)
    o = _from_chunks(o_c, T)
    stages = {
        "gate": g, "g2": _from_chunks(g2, T), "Aqk": _from_chunks(Aqk, T), "Akk": _from_chunks(Akk, T),
        "w": _from_chunks(w, T), "u": _from_chunks(u, T), "kg": _from_chunks(kg, T),
        "qg": _from_chunks(qg, T), "h": h_all, "v_new": _from_chunks(vn_c, T), "o": o,
    }
    return o, h, stages


def chunk_kda_reference(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, *,
                        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                        A_log=None, dt_bias=None, state_v_first=False, cu_seqlens=None,
                        chunk_size=64, return_stages=False):
    """The chunked KDA algorithm, stage by stage (see the module docstring for the stage layouts).
    Returns (o, ht), or (o, ht, stages) with return_stages=True."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    c = _common(q, k, v, g, beta, scale, initial_state, state_v_first, cu_seqlens,
                _flags(use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                       allow_neg_eigval, lower_bound, A_log, dt_bias))
    BT = chunk_size
    args = (c["qe"], c["ke"], c["v"], c["g"], c["beta"])
    if c["bounds"] is None:
        o, ht, st = _chunk_core(*args, c["scale"], c["h0"], BT)
        finals = list(ht.unbind(0))
    else:
        parts, finals = [], []
        for n, _, t0, t1 in _segments(c):
            h0 = c["h0"][n:n + 1] if c["h0"] is not None else None
            o_n, ht_n, st_n = _chunk_core(*(x[:, t0:t1] for x in args), c["scale"], h0, BT)
            parts.append(st_n)
            finals.append(ht_n[0])
        st = {key: torch.cat([p[key] for p in parts], 1) for key in parts[0]}
        o = st["o"]
    ht = _final(c, finals, output_final_state, state_v_first)
    o = o.to(q.dtype).contiguous()
    if not return_stages:
        return o, ht
    st = dict(st)
    st["q"], st["k"], st["beta"] = c["q"], c["k"], c["beta"]
    return o, ht, st
