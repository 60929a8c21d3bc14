"""An explicit, stage-by-stage fp64 reference of the KDA backward (no autograd inside).

``chunk_kda_bwd_reference`` computes every gradient of ``chunk_kda`` by the same decomposition the
CUDA kernels use (docs/kda.md has the stage table), so each backward kernel can be tested
on its own against the stage it implements; tests/test_ref_kda_bwd.py checks the whole against
torch autograd through ``chunk_kda_reference``.

Notation per (b, value head hv), chunk c, chunk rows i, j (all logs natural here: the kernels'
base-2 g2 = gn / ln2 gives exp2(g2_i - g2_j) = exp(gn_i - gn_j), and the 1/ln2 of the cumsum
cancels against d exp2 / dx, so no ln2 factor appears anywhere in the backward):

    gn = chunk-local inclusive cumsum of the per-step gate, G = gn of the chunk's last row
    E_ij = exp(gn_i - gn_j) (i >= j)                      per dimension d
    Aqk = scale sum_d q_i k_j E_ij (i >= j);  Kt = sum_d k_i k_j E_ij (i > j);  L = beta_i Kt_ij
    M = (I + L)^-1,  Akk = M diag(beta),  w = Akk (k exp(gn)),  u = Akk v
    kg = k exp(G - gn),  qg = q exp(gn)
    forward scan: v'_c = u_c - w_c h_c,  o_c = scale qg_c h_c + Aqk_c v'_c,
                  h_{c+1} = exp(G_c) h_c + kg_c^T v'_c

Backward stages (what each kernel computes):

    B3 dh scan (reverse over chunks), dh = dht:
        dv'_c = Aqk_c^T do_c + kg_c dh          dh here is dh_{c+1}, stored per chunk ('dh')
        dv_c  = Akk_c^T dv'_c                   (v enters only through u)
        dh    = exp(G_c) dh + scale qg_c^T do_c - w_c^T dv'_c      ->  dh0 after chunk 0
    B4 per chunk, given h_c and dh_{c+1}:
        dAqk = do v'^T (i >= j);  dqg = do h^T;  dkg = v' dh^T;  dw = -dv' h^T
        dAkk = dw kexp^T + dv' v^T;  dkexp = Akk^T dw
        dbeta_j += sum_i dAkk_ij M_ij;  dL = -(M^T (dAkk diag beta) M^T) (i > j)
        dbeta_i += sum_j dL_ij Kt_ij;  dKt = beta_i dL_ij;  dA1 = scale dAqk
        dq^ = sum_j dA1_ij k_j E_ij + scale exp(gn) dqg
        dk^ = sum_i dA1_ij q_i E_ij + sum_j dKt_ij k_j E_ij + sum_i dKt_ij k_i E_ij
              + exp(G - gn) dkg + exp(gn) dkexp
        dgn_i += sum_j P_ij, dgn_j -= sum_i P_ij with P = dA1 q_i k_j E + dKt k_i k_j E (per d);
        dgn += scale qg dqg - kg dkg + kexp dkexp;  dG = exp(G) sum_v h dh + sum_i kg dkg
        dgn[last row] += dG;  dgate = reverse chunk-local cumsum of dgn
    then the preprocessing backward: l2norm, gate activation (dA_log, ddt_bias), beta sigmoid, and
    the GVA sum of dq^/dk^ over each q/k head's value heads.
"""

from __future__ import annotations

import torch

from kernel_fun.ref.kda import _common, _flags, _from_chunks, _segments, _softplus, _to_chunks

__all__ = ["chunk_kda_bwd_reference", "kda_bwd_core"]


def _masks(BT, dev):
    idx = torch.arange(BT, device=dev)
    return idx[:, None] >= idx[None, :], idx[:, None] > idx[None, :]


def kda_bwd_core(q, k, v, gate, beta, scale, h0, do, dht, BT=64):
    """The backward of the chunked core on one fixed-length batch, all tensors in one float dtype.

    q, k [B,T,HV,K] (after l2norm, expanded to value heads), v [B,T,HV,V], gate [B,T,HV,K] (natural
    log per-step decay), beta [B,T,HV] (after the sigmoid), h0 / dht [B,HV,K,V] or None, do
    [B,T,HV,V]. Returns (grads, stages): grads = dict(q, k, v, gate, beta, h0) w.r.t. those inputs;
    stages = per-stage tensors (see the module docstring), chunk tensors in [B, T, HV, ...] layout,
    states in [B, NT, HV, K, V]."""
    B, T, HV, K = q.shape
    V = v.shape[-1]
    cd, dev = q.dtype, q.device
    qc, kc, vc, gc, doc = (_to_chunks(x, BT) for x in (q, k, v, gate, do))  # [B, HV, NT, BT, *]
    bc = _to_chunks(beta, BT)                                                # [B, HV, NT, BT]
    NT = qc.shape[2]
    ge, gt = _masks(BT, dev)
    zero = torch.zeros((), dtype=cd, device=dev)

    # ---- recompute the forward's per-chunk quantities
    gn = torch.cumsum(gc, dim=-2)
    G = gn[..., -1, :]                                                       # [B, HV, NT, K]
    diff = gn[..., :, None, :] - gn[..., None, :, :]
    E = torch.exp(torch.where(ge[:, :, None], diff, torch.full((), float("-inf"), dtype=cd, device=dev)))
    Aqk = scale * torch.einsum("...id,...jd,...ijd->...ij", qc, kc, E)
    Kt = torch.where(gt, torch.einsum("...id,...jd,...ijd->...ij", kc, kc, E), zero)
    L = bc[..., :, None] * Kt
    eye = torch.eye(BT, dtype=cd, device=dev)
    M = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    Akk = M * bc[..., None, :]
    kexp = kc * torch.exp(gn)
    w = Akk @ kexp
    u = Akk @ vc
    kg = kc * torch.exp(G[..., None, :] - gn)
    qg = qc * torch.exp(gn)

    h = h0 if h0 is not None else torch.zeros(B, HV, K, V, dtype=cd, device=dev)
    hs, vns = [], []
    for c in range(NT):  # B2: the re-scan (states before each chunk)
        hs.append(h)
        vn = u[:, :, c] - w[:, :, c] @ h
        vns.append(vn)
        h = torch.exp(G[:, :, c])[..., None] * h + kg[:, :, c].transpose(-1, -2) @ vn

    # ---- B3: reverse dh scan
    dh = dht if dht is not None else torch.zeros(B, HV, K, V, dtype=cd, device=dev)
    dhs, dvns, dvs = [None] * NT, [None] * NT, [None] * NT
    for c in reversed(range(NT)):
        dvn = Aqk[:, :, c].transpose(-1, -2) @ doc[:, :, c] + kg[:, :, c] @ dh
        dhs[c] = dh
        dvns[c] = dvn
        dvs[c] = Akk[:, :, c].transpose(-1, -2) @ dvn
        dh = (torch.exp(G[:, :, c])[..., None] * dh + scale * qg[:, :, c].transpose(-1, -2) @ doc[:, :, c]
              - w[:, :, c].transpose(-1, -2) @ dvn)
    dh0 = dh

    if NT == 0:
        empty = q.new_zeros(B, T, HV, K)
        grads = dict(q=empty, k=empty.clone(), v=v.new_zeros(v.shape), gate=empty.clone(),
                     beta=beta.new_zeros(beta.shape), h0=dh0)
        stages = dict(dh=q.new_zeros(B, 0, HV, K, V), h=q.new_zeros(B, 0, HV, K, V), dv=grads["v"])
        return grads, stages

    h_all = torch.stack(hs, 2)                                               # [B, HV, NT, K, V]
    dh_all = torch.stack(dhs, 2)
    vn = torch.stack(vns, 2)                                                 # [B, HV, NT, BT, V]
    dvn = torch.stack(dvns, 2)
    dv_c = torch.stack(dvs, 2)

    # ---- B4: per chunk
    dAqk = torch.where(ge, doc @ vn.transpose(-1, -2), zero)
    dqg = doc @ h_all.transpose(-1, -2)                                      # [.., BT, K]
    dkg = vn @ dh_all.transpose(-1, -2)
    dw = -(dvn @ h_all.transpose(-1, -2))
    dAkk = dw @ kexp.transpose(-1, -2) + dvn @ vc.transpose(-1, -2)
    dkexp = Akk.transpose(-1, -2) @ dw
    dbeta = (dAkk * M).sum(-2)                                               # column side, over i >= j
    dM = dAkk * bc[..., None, :]
    dL = torch.where(gt, -(M.transpose(-1, -2) @ dM @ M.transpose(-1, -2)), zero)
    dbeta = dbeta + (dL * Kt).sum(-1)                                        # row side
    dKt = bc[..., :, None] * dL
    dA1 = scale * dAqk

    dq = torch.einsum("...ij,...jd,...ijd->...id", dA1, kc, E) + scale * torch.exp(gn) * dqg
    dk = (torch.einsum("...ij,...id,...ijd->...jd", dA1, qc, E)
          + torch.einsum("...ij,...jd,...ijd->...id", dKt, kc, E)
          + torch.einsum("...ij,...id,...ijd->...jd", dKt, kc, E)
          + torch.exp(G[..., None, :] - gn) * dkg + torch.exp(gn) * dkexp)
    P = (torch.einsum("...ij,...id,...jd,...ijd->...ijd", dA1, qc, kc, E)
         + torch.einsum("...ij,...id,...jd,...ijd->...ijd", dKt, kc, kc, E))
    dgn = P.sum(-2) - P.sum(-3)
    dgn = dgn + scale * qg * dqg - kg * dkg + kexp * dkexp
    dG = torch.exp(G) * (h_all * dh_all).sum(-1) + (kg * dkg).sum(-2)       # [B, HV, NT, K]
    dgn = dgn.clone()
    dgn[..., -1, :] += dG
    dgate = torch.flip(torch.cumsum(torch.flip(dgn, [-2]), -2), [-2])

    grads = dict(q=_from_chunks(dq, T), k=_from_chunks(dk, T), v=_from_chunks(dv_c, T),
                 gate=_from_chunks(dgate, T), beta=_from_chunks(dbeta, T), h0=dh0)
    stages = dict(
        h=h_all.movedim(1, 2), dh=dh_all.movedim(1, 2), v_new=_from_chunks(vn, T), dv_new=_from_chunks(dvn, T),
        dv=grads["v"], dAqk=_from_chunks(dAqk, T), dAkk=_from_chunks(dAkk, T), dL=_from_chunks(dL, T),
        M=_from_chunks(M, T), dq_hat=grads["q"], dk_hat=grads["k"], dgn=_from_chunks(dgn, T),
        dgate=grads["gate"], dbeta_hat=grads["beta"], dG=dG.movedim(1, 2),
    )
    return grads, stages


def _gate_bwd(graw, dgate, A_log, dt_bias, lower_bound):
    """d(gate)/d(raw g, A_log, dt_bias) for the in-kernel gate (docs/contract.md, "The gate")."""
    HV, K = graw.shape[-2], graw.shape[-1]
    cd = dgate.dtype
    x = graw.to(cd)
    if dt_bias is not None:
        x = x + dt_bias.to(cd).reshape(HV, K)
    a = torch.exp(A_log.to(cd).reshape(HV, 1)) if A_log is not None else None
    if lower_bound is None:
        sp = _softplus(x)
        sig = torch.where(x > 20.0, torch.ones((), dtype=cd), torch.sigmoid(x))
        dx = dgate * (-a) * sig
        dA = (dgate * (-a) * sp)
    else:
        z = a * x if a is not None else x
        s = torch.sigmoid(z)
        dz = dgate * lower_bound * s * (1 - s)
        dx = dz * a if a is not None else dz
        dA = dz * z if a is not None else None
    dA_log = None if dA is None else dA.sum(dim=tuple(range(dA.dim() - 2))).sum(-1)  # [HV]
    ddt = None if dt_bias is None else dx.sum(dim=tuple(range(dx.dim() - 2))).reshape(-1)
    return dx, dA_log, ddt


def chunk_kda_bwd_reference(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None, *,
                            use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                            use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                            A_log=None, dt_bias=None, state_v_first=False, cu_seqlens=None,
                            chunk_size=64, return_stages=False):
    """Every gradient of ``chunk_kda(q, k, v, g, beta, ...)`` for output gradient ``do`` (and
    ``dht`` for the final state, in its layout), by the explicit stages above. Arguments as
    ``chunk_kda_reference``. Returns a dict with dq, dk, dv, dg, dbeta (input shapes), dA_log
    (A_log's shape) and ddt_bias (None when not applicable) and dh0 (initial_state's layout, None
    without one), in the compute dtype; with ``return_stages`` also the stages dict."""
    c = _common(q, k, v, g, beta, scale, initial_state, state_v_first, cu_seqlens,
                _flags(use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                       allow_neg_eigval, lower_bound, A_log, dt_bias))
    cd, BT = c["cd"], chunk_size
    H, HV, K = c["H"], c["HV"], c["K"]
    rep = HV // H
    do = do.to(cd)
    if dht is not None:
        dht = dht.to(cd)
        if state_v_first:
            dht = dht.transpose(-1, -2)
    args = (c["qe"], c["ke"], c["v"], c["g"], c["beta"])
    if c["bounds"] is None:
        grads, st = kda_bwd_core(*args, c["scale"], c["h0"], do, dht, BT)
        dh0 = grads["h0"]
    else:
        parts, sts, dh0s = [], [], []
        for n, _, t0, t1 in _segments(c):
            h0 = c["h0"][n:n + 1] if c["h0"] is not None else None
            dhtn = dht[n:n + 1] if dht is not None else None
            gr, stn = kda_bwd_core(*(x[:, t0:t1] for x in args), c["scale"], h0, do[:, t0:t1], dhtn, BT)
            parts.append(gr)
            sts.append(stn)
            dh0s.append(gr["h0"])
        grads = {key: torch.cat([p[key] for p in parts], 1) for key in ("q", "k", "v", "gate", "beta")}
        dh0 = torch.cat(dh0s, 0)
        # chunk tensors [1, T, ...] and per-chunk states [1, NT, ...] both concatenate along dim 1
        keys = max((s.keys() for s in sts), key=len)  # empty sequences carry only the state stages
        st = {key: torch.cat([s[key] for s in sts if key in s], 1) for key in keys}

    B, T = q.shape[0], q.shape[1]
    # GVA: the value heads of a group share q/k; their gradients add (fixed order: a plain sum)
    dq_hat = grads["q"].reshape(B, T, H, rep, K).sum(3)
    dk_hat = grads["k"].reshape(B, T, H, rep, K).sum(3)
    qr, kr = q.to(cd), k.to(cd)
    if use_qk_l2norm_in_kernel:
        def l2_bwd(x, dy):
            r = torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
            y = x * r
            return r * (dy - y * (y * dy).sum(-1, keepdim=True))
        dq, dk = l2_bwd(qr, dq_hat), l2_bwd(kr, dk_hat)
    else:
        dq, dk = dq_hat, dk_hat
    dA_log = ddt_bias = None
    if use_gate_in_kernel:
        dg, dA, ddt = _gate_bwd(g, grads["gate"], A_log, dt_bias, lower_bound)
        if A_log is not None and dA is not None:
            dA_log = dA.reshape(A_log.shape)
        ddt_bias = ddt
    else:
        dg = grads["gate"]
    dbeta = grads["beta"]
    if use_beta_sigmoid_in_kernel:
        s = 2.0 if allow_neg_eigval else 1.0
        sig = torch.sigmoid(beta.to(cd))
        dbeta = dbeta * s * sig * (1 - sig)
    if initial_state is not None:
        dh0 = dh0.transpose(-1, -2) if state_v_first else dh0
    else:
        dh0 = None
    out = dict(dq=dq, dk=dk, dv=grads["v"], dg=dg, dbeta=dbeta, dA_log=dA_log, ddt_bias=ddt_bias, dh0=dh0)
    if return_stages:
        return out, st
    return out
