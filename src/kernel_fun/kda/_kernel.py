"""The KDA forward on our sm_90a kernels (csrc/kda/sm90/, docs/kda-forward.md).

``support_reason`` says whether the kernels can serve a (validated, CUDA) call; ``forward`` runs
them (no autograd: the front routes calls that need gradients to fla); ``forward_stages`` also
returns the workspace (w, qg, kg, Aqk, Akk, exp2(G)) for per-stage tests.

Two launches (plus a one-CTA chunk map for varlen), no host synchronisation: cu_seqlens is read
natively (int32 or int64) on the device; cu_seqlens_cpu is used only to size the optional
intermediate-states output (the front always supplies it).
"""

from __future__ import annotations

import torch

from kernel_fun import _ext

CHUNK = 64


def support_reason(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                   use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
                   state_v_first, cu_seqlens, cu_seqlens_cpu, A_log, dt_bias, chunk_size,
                   return_intermediate_states, disable_recompute) -> str | None:
    """None when our kernels can run this call, else why not (the C++ op decides)."""
    if initial_state is not None and initial_state.dtype != torch.float32:
        return f"initial_state dtype {initial_state.dtype} (kernels take float32)"
    if use_gate_in_kernel and A_log is None and lower_bound is None:
        return "the unbounded gate needs A_log"
    reason = _ext.ops().kda_fwd_support(q, k, v, g, beta, cu_seqlens, int(chunk_size))
    return reason or None


def _f32_flat(t):
    return None if t is None else t.detach().reshape(-1).to(torch.float32).contiguous()


def _run(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
         use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first,
         cu_seqlens, cu_seqlens_cpu, A_log, dt_bias, return_intermediate_states, poison=False):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev, dt = q.device, q.dtype
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if v.data_ptr() % 16:  # the scan copies v rows with 16-byte cp.async
        v = v.clone()
    nts = -(-T // CHUNK)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.contiguous()
        N = cu_seqlens.numel() - 1
        max_chunks = T // CHUNK + N
    else:
        N = B
        max_chunks = B * nts
    if scale is None:
        scale = K ** -0.5
    o = torch.empty(B, T, HV, V, dtype=dt, device=dev)
    ws = {
        "w": torch.empty(B * T, HV, K, dtype=dt, device=dev),
        "qg": torch.empty(B * T, HV, K, dtype=dt, device=dev),
        "kg": torch.empty(B * T, HV, K, dtype=dt, device=dev),
        "Aqk": torch.empty(B * T, HV, CHUNK, dtype=dt, device=dev),
        "Akk": torch.empty(B * T, HV, CHUNK, dtype=dt, device=dev),
        "gdecay": torch.empty(max_chunks, HV, K, dtype=torch.float32, device=dev),
        "chunk_offsets": torch.zeros(N + 1, dtype=torch.int32, device=dev),
    }
    st_shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    ht = torch.empty(st_shape, dtype=torch.float32, device=dev) if output_final_state else None
    h_states = None
    if return_intermediate_states:
        if cu_seqlens is None:
            lead = (B, nts)
        else:
            host = cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()  # one D2H read
            lens = (host[1:] - host[:-1]).to(torch.int64)
            lead = (1, int(((lens + CHUNK - 1) // CHUNK).sum()))
        h_states = torch.empty(*lead, HV, *((V, K) if state_v_first else (K, V)), dtype=dt, device=dev)
    if poison:  # tests: NaN everywhere the kernels are supposed to write
        for t in (o, ht, h_states, *ws.values()):
            if t is not None and t.is_floating_point():
                t.fill_(float("nan"))
    h0 = initial_state.contiguous() if initial_state is not None else None
    args = (q, k, v, g, beta, _f32_flat(A_log) if use_gate_in_kernel else None,
            _f32_flat(dt_bias) if use_gate_in_kernel else None, h0, cu_seqlens, float(scale),
            bool(use_qk_l2norm_in_kernel), bool(use_gate_in_kernel), bool(use_beta_sigmoid_in_kernel),
            bool(allow_neg_eigval), None if lower_bound is None else float(lower_bound), bool(state_v_first),
            o, ht, h_states, ws["w"], ws["qg"], ws["kg"], ws["Aqk"], ws["Akk"], ws["gdecay"], ws["chunk_offsets"])
    ops = _ext.ops()
    err = ops.kda_fwd_check(*args)  # validation in C++, raised here (see kda_ops.cpp)
    if err:
        raise ValueError(err)
    ops.kda_fwd(*args)
    return o, ht, h_states, ws


def forward(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
            state_v_first, cu_seqlens, cu_seqlens_cpu, A_log, dt_bias, chunk_size,
            return_intermediate_states, disable_recompute):
    """(o, final_state), or (o, final_state, h) with return_intermediate_states. No autograd.
    safe_gate, chunk_size (64 only) and disable_recompute do not change what the forward computes."""
    o, ht, h_states, _ = _run(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, A_log=A_log, dt_bias=dt_bias,
        return_intermediate_states=return_intermediate_states)
    if return_intermediate_states:
        return o, ht, h_states
    return o, ht


def forward_stages(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                   allow_neg_eigval=False, lower_bound=None, state_v_first=False, cu_seqlens=None,
                   cu_seqlens_cpu=None, A_log=None, dt_bias=None, return_intermediate_states=False, poison=False):
    """Like forward, plus the workspace, for per-stage tests: returns (o, final_state, h_states, ws)
    with ws = {w, qg, kg: [B*T, HV, K]; Aqk, Akk: [B*T, HV, 64]; gdecay: [max_chunks, HV, K] fp32;
    chunk_offsets: [N+1] int32}. qg and Aqk carry `scale`; Akk = (I + L)^-1 diag(beta)."""
    return _run(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                cu_seqlens_cpu=cu_seqlens_cpu, A_log=A_log, dt_bias=dt_bias,
                return_intermediate_states=return_intermediate_states, poison=poison)
