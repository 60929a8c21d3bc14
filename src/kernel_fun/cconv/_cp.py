"""causal_conv1d under fla's ``cp_context`` (context parallelism) on our conv.

Each rank holds a contiguous slice of one packed sequence ([1, T_rank, D]) and the context of
``fla.ops.cp.build_cp_context`` (any object with its fields: ``group``, ``cu_seqlens`` (local),
``cu_seqlens_cpu``, ``is_first_rank``, ``pre_num_conv_tokens``). The rank's first document may have
begun on the previous rank; its first W - 1 taps then read that rank's last W - 1 tokens:

- forward: every rank all-gathers its last W - 1 tokens ("tails", [W - 1, D]); a rank whose first
  document began earlier makes them document 0's initial_state (its last min(W - 1,
  pre_num_conv_tokens) slots) and runs one ordinary call of ours with the local cu_seqlens;
- backward: that call's backward gives dx, dw, db and d initial_state; every rank all-gathers the
  part of d initial_state that came from the previous rank's tails, and adds the next rank's to the
  gradient of its own last W - 1 tokens. dw and db stay per rank (the data-parallel reduce sums them).

Every rank takes part in both all-gathers (W - 1 rows of D each), first ranks too, so that no rank
waits in a collective the others skip; both passes run inside one autograd function for that reason.
With W = 1 there is nothing to exchange and no collective at all.

Where this differs from fla 0.5.2 (docs/notes/2026-12-03-cp-conv-reading.md): ``residual`` is added
(fla's context-parallel branch drops it); with W = 1 no rank sends its slice. As in fla, the
caller's ``cu_seqlens`` is not read (the context's local one is), and ``initial_state`` /
``output_final_state`` are not allowed.

Opt-in (``KERNEL_FUN_CCONV_CP=1``) until its 2-GPU test has run on the H200s: by default a
``cp_context`` call goes to fla, as before.
"""

from __future__ import annotations

import torch

from kernel_fun import _cp

ENV = "KERNEL_FUN_CCONV_CP"


def validate(x, weight, residual, initial_state, output_final_state, cp_context) -> None:
    """What our context-parallel conv needs beyond the ordinary checks (ValueError naming it)."""
    _cp.check_call("kernel_fun.cconv.causal_conv1d", cp_context, ("group", "is_first_rank", "pre_num_conv_tokens"),
                   initial_state, output_final_state, x, "x", 3)
    if weight is None:
        raise ValueError("kernel_fun.cconv.causal_conv1d: weight is required with cp_context")
    W = weight.shape[-1]
    if W > 1 and x.shape[1] < W - 1:
        raise ValueError(f"kernel_fun.cconv.causal_conv1d: x holds {x.shape[1]} tokens on this rank; with "
                         f"cp_context each rank needs at least W - 1 = {W - 1}")


class ConvCP(torch.autograd.Function):
    """One context-parallel conv call: the tails' exchange, one call of ``conv`` (our front, on
    leaves of its own, so its backward is the ordinary one), and the gradients' exchange."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, conv, activation, cp_context):
        group = cp_context.group
        W = weight.shape[-1]
        D = x.shape[-1]
        cu = cp_context.cu_seqlens
        N = cu.numel() - 1
        valid = 0 if cp_context.is_first_rank else min(W - 1, int(cp_context.pre_num_conv_tokens))
        init = None
        if W > 1:
            heads = _cp.neighbour(x[0, x.shape[1] - (W - 1):], group, -1)  # the previous rank's tails
            if valid > 0:
                init = torch.zeros(N, D, W, dtype=x.dtype, device=x.device)
                init[0, :, W - valid:] = heads[W - 1 - valid:].transpose(0, 1)
        with torch.enable_grad():
            leaves = _cp.leaves((x, weight, bias, residual, init), force=(init,))
            y, _ = conv(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], activation, cu,
                        getattr(cp_context, "cu_seqlens_cpu", None))
        ctx.graph = (y, leaves)
        ctx.exchange = (group, W, valid)
        return y.detach()

    @staticmethod
    def backward(ctx, dy):
        y, leaves = ctx.graph
        group, W, valid = ctx.exchange
        ctx.graph = None
        dx, dw, db, dres, dinit = _cp.grads(y, dy, leaves)
        if W > 1:  # every rank joins this all-gather, whatever it needs
            x = leaves[0]
            D = x.shape[-1]
            # the gradient of the previous rank's tails: document 0's initial-state slots that held them
            dtails = torch.zeros(W - 1, D, dtype=x.dtype, device=x.device)
            if valid > 0 and dinit is not None:
                dtails[W - 1 - valid:] = dinit[0, :, W - valid:].transpose(0, 1)
            from_next = _cp.neighbour(dtails, group, +1)  # the next rank's, for this rank's own tails
            if ctx.needs_input_grad[0]:
                dx = dx.clone()
                dx[0, x.shape[1] - (W - 1):] += from_next
        return dx, dw, db, dres, None, None, None
