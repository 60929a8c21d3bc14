"""NeMo Automodel's fused KDA entry points (``nemo_automodel.components.models.kimi_k3.kda_fused``),
served by kernel-fun's kernels.

A Kimi-K3 model configured with ``kda_chunk_impl = "fused"`` calls

    fused_kda_unsupported_reason(q, k, v, g, beta, cu_seqlens, mode, cp_context,
                                 use_qk_l2norm_in_kernel, safe_gate) -> str | None
    fused_chunk_kda(q, k, v, g, beta, cu_seqlens) -> (o, None)

with the production call's conventions: g the (bounded) log-space gate, beta as given, q/k
l2-normalised inside the kernel, scale K^-0.5, no initial or final state. Dense input (cu_seqlens
None, a batch of B equal-length sequences) is viewed as one packed batch of B documents
(cu_seqlens = [0, T, ..., BT] made on the device: no copies, no host sync). Unlike ``chunk_kda``
these never fall back to fla: a call our kernels cannot serve raises with the reason, so a run
that asks for the fused path either gets it or stops. Gradients flow (our backward).

Coverage beyond NeMo's own kernels (K = V = 128 only): K in {64, 128}, V a multiple of 64 up to
512, bf16 and fp16, GVA, and an unbounded gate (safe_gate=False is computed exactly, our kernels
do not rely on the bound). ``fused_chunk_kda`` always l2-normalises q/k (its signature has no
switch), so use_qk_l2norm_in_kernel=False is an unsupported reason, never a silent mismatch.
"""

from __future__ import annotations

import torch

__all__ = ["fused_chunk_kda", "fused_kda_unsupported_reason"]


def _packed(q, k, v, g, beta, cu_seqlens):
    """Dense [B, T, ...] inputs as one packed batch of B documents (views; offsets on the device)."""
    if cu_seqlens is not None:
        return q, k, v, g, beta, cu_seqlens
    B, T = q.shape[:2]
    flat = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
    cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device)
    return (*flat, cu)


def _device_reason(q: torch.Tensor) -> str | None:
    if q.device.type != "cuda":
        return f"tensors on {q.device} (kernel-fun's kernels run on CUDA devices)"
    return None


def fused_kda_unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, cu_seqlens: torch.Tensor | None, mode: str = "chunk",
                                 cp_context=None, use_qk_l2norm_in_kernel: bool = True,
                                 safe_gate: bool = True) -> str | None:
    """Why kernel-fun cannot run this call, or None when it can (never raises for bad input)."""
    if mode != "chunk":
        return f"kda mode {mode!r} (kernel-fun implements the chunked algorithm only)"
    if cp_context is not None:
        return "context parallelism (cp_context) is fla's"
    if not use_qk_l2norm_in_kernel:
        return "use_qk_l2norm_in_kernel=False (fused_chunk_kda always l2-normalises q and k)"
    why = _device_reason(q)
    if why is not None:
        return why
    from kernel_fun.kda import is_supported

    ok, why = is_supported(q, v, k=k, g=g, beta=beta, cu_seqlens=cu_seqlens,
                           use_qk_l2norm_in_kernel=True)
    return None if ok else why


def fused_chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, None]:
    """NeMo's ``chunk_kda(..., output_final_state=False)`` convention: ``(o, None)``, o in the dense
    layout when the input was dense. Raises (never falls back) when our kernels cannot serve it."""
    from kernel_fun import _dispatch
    from kernel_fun.kda import chunk_kda

    # The CPU reference would serve CPU tensors without complaint: refuse them here. Every other
    # reason comes from chunk_kda itself, which strict mode turns into KernelFunUnsupported.
    why = _device_reason(q)
    if why is not None:
        raise _dispatch.KernelFunUnsupported(f"kernel-fun fused_chunk_kda: {why}")
    shape = v.shape
    pq, pk, pv, pg, pb, cu = _packed(q, k, v, g, beta, cu_seqlens)
    with _dispatch.strict():
        o, _ = chunk_kda(pq, pk, pv, pg, pb, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                         use_graph=cu_seqlens is None)  # our own offsets: no host read needed
    return (o.reshape(shape) if cu_seqlens is None else o), None
