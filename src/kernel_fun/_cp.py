"""What the two context-parallel paths (cconv/_cp.py, kda/_cp.py) share: the argument checks, the
collectives (every rank joins each one, whatever it needs), and the inner graph each path runs its
ordinary calls in: detached leaves of the caller's tensors, so that one autograd function holds the
whole rank's work and its backward (with the backward's collective) runs on every rank."""

from __future__ import annotations

import torch


def check_call(qualname: str, cp_context, fields: tuple, initial_state, output_final_state, x,
               x_name: str, x_dims: int) -> None:
    """The checks both families' context-parallel paths share (ValueError naming the argument): the
    context has the fields of fla's build_cp_context that the path reads (and a cu_seqlens), no
    initial_state / output_final_state (the earlier ranks' tokens are the initial state; fla
    asserts both off), and x is one packed sequence [1, T, ...] of x_dims dimensions."""
    for field in fields + ("cu_seqlens",):
        if not hasattr(cp_context, field):
            raise ValueError(f"{qualname}: cp_context has no '{field}' (fla's build_cp_context makes one)")
    if cp_context.cu_seqlens is None:
        raise ValueError(f"{qualname}: cp_context.cu_seqlens is None (the rank's local documents are needed)")
    if initial_state is not None:
        raise ValueError(f"{qualname}: initial_state is not allowed with cp_context (the earlier ranks' "
                         f"tokens are the initial state)")
    if output_final_state:
        raise ValueError(f"{qualname}: output_final_state is not allowed with cp_context")
    if x.dim() != x_dims or x.shape[0] != 1:
        raise ValueError(f"{qualname}: {x_name} must be [1, T, ...] ({x_dims} dimensions) with cp_context (one "
                         f"packed sequence per rank), got {list(x.shape)}")


def gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's t (the same shape everywhere), in rank order: one all-gather."""
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def neighbour(t: torch.Tensor, group, step: int) -> torch.Tensor:
    """The t of rank + step (zeros where there is none), by one all-gather (its rows are buffers of
    their own, so the row is returned as it is)."""
    import torch.distributed as dist

    rows = gather(t, group)
    r = dist.get_rank(group) + step
    return rows[r] if 0 <= r < len(rows) else torch.zeros_like(t)


def leaves(tensors, force=()) -> list:
    """Detached copies of tensors (None stays None) that require grad where the originals do, or
    where the original is one of `force` (by identity: tensors built inside the function)."""
    return [None if t is None else t.detach().requires_grad_(t.requires_grad or any(t is f for f in force))
            for t in tensors]


def grads(output: torch.Tensor, grad_output: torch.Tensor, of: list) -> list:
    """The gradients of output (given grad_output) for each leaf of `of` (None where it needs none)."""
    want = [t for t in of if t is not None and t.requires_grad]
    it = iter(torch.autograd.grad(output, want, grad_output, allow_unused=True))
    return [next(it) if t is not None and t.requires_grad else None for t in of]


def local_context(cu: list[int], rank: int, world: int, group, conv1d_kernel_size: int | None = None):
    """The fields fla's ``build_cp_context`` gives rank ``rank`` of ``world`` for the packed
    documents ``cu`` (host offsets over the whole sequence), with fla.ops.cp.context's semantics and
    without fla: equal slices of ``cu[-1] // world`` tokens, the local document boundaries (int32,
    on the CPU: move ``cu_seqlens`` to the device before a call), and where the rank's first and
    last documents begin and end. For the tests and the context-parallel benchmark."""
    import types

    part = cu[-1] // world
    lo, hi = rank * part, (rank + 1) * part
    local = torch.tensor([0] + [c - lo for c in cu if lo < c < hi] + [hi - lo], dtype=torch.int32)
    first_start = max(c for c in cu[:-1] if c <= lo)
    last_end = min(c for c in cu[1:] if c >= hi)
    return types.SimpleNamespace(
        group=group, cu_seqlens=local, cu_seqlens_cpu=local.clone(), pre_num_conv_tokens=lo - first_start,
        is_first_rank=first_start // part == rank, pre_num_ranks=rank - first_start // part,
        is_last_rank=(last_end - 1) // part == rank, post_num_ranks=(last_end - 1) // part - rank,
        conv1d_kernel_size=conv1d_kernel_size)
