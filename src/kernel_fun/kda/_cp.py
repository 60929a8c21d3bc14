"""chunk_kda under fla's ``cp_context`` (context parallelism) on our chunk_kda.

Each rank holds a contiguous slice of one packed sequence ([1, T_rank, ...]) and the context of
``fla.ops.cp.build_cp_context`` (fields used: ``group``, ``cu_seqlens`` (local), ``cu_seqlens_cpu``,
``is_first_rank``, ``is_last_rank``, ``pre_num_ranks``). Over a slice of one document the state
evolves affinely, ``S_out = Phi S_in + E`` (S: [K, V] per value head; Phi: [K, K], the product of
the tokens' transitions; E: the slice's final state from a zero state), so:

1. a rank whose last document goes on to the next rank computes that document's [E | Phi] on its
   slice by one call of ours over the values [v | 0] from the initial state [0 | I] (the state's
   columns never mix, so its final state is E beside Phi; two calls where V + K > 512), in fp32;
2. every rank all-gathers [E | Phi] (HV x K x (V + K) fp32 each);
3. a rank whose first document began earlier chains the earlier ranks' maps in rank order
   (h = Phi_j h + E_j, fp32) into that document's initial state;
4. one ordinary call of ours on the rank's slice with the local cu_seqlens and that initial state.

The backward is autograd through the same calls: the gradient of the gathered [E | Phi] is summed
over the ranks (one all-reduce every rank joins) and each rank takes its own slot back through
step 1. Both passes run inside one autograd function, so that no rank skips a collective the
others wait in.

Costs beyond the ordinary call: one more call on the last document's tokens with V + K value
columns, an all-gather and an all-reduce of world x HV x K x (V + K) fp32. As in fla,
``initial_state`` and ``output_final_state`` are not allowed and the context's cu_seqlens is used.

Opt-in (``KERNEL_FUN_KDA_CP=1``) until its multi-GPU test has run: by default a ``cp_context`` call
goes to fla, as before.
"""

from __future__ import annotations

import torch

from kernel_fun import _cp

ENV = "KERNEL_FUN_KDA_CP"
_MAX_V = 512  # our kernels' widest value head (docs/contract.md)
_FIELDS = ("group", "is_first_rank", "is_last_rank", "pre_num_ranks")


def validate(q, initial_state, output_final_state, return_intermediate_states, cp_context) -> None:
    _cp.check_call("kernel_fun.kda.chunk_kda", cp_context, _FIELDS, initial_state, output_final_state, q, "q", 4)
    if return_intermediate_states:
        raise ValueError("kernel_fun.kda.chunk_kda: return_intermediate_states is not allowed with cp_context")


def _host_cu(cp_context) -> list[int]:
    cu = getattr(cp_context, "cu_seqlens_cpu", None)
    return (cu if cu is not None else cp_context.cu_seqlens.cpu()).tolist()


class KdaCP(torch.autograd.Function):
    """One context-parallel chunk_kda call. ``call(q, k, v, g, beta, A_log, dt_bias, **kw)`` is our
    chunk_kda with the caller's options; ``tensors`` are (q, k, v, g, beta, A_log, dt_bias), the last
    two None when not given."""

    @staticmethod
    def forward(ctx, call, cp_context, state_v_first, *tensors):
        import torch.distributed as dist

        group = cp_context.group
        rank = dist.get_rank(group)
        q, v = tensors[0], tensors[2]
        K, HV, V = q.shape[-1], v.shape[2], v.shape[-1]
        cu = _host_cu(cp_context)
        with torch.enable_grad():
            leaves = _cp.leaves(tensors)
            # 1. [E | Phi] of the last document's part on this rank (zeros where it ends here)
            if not cp_context.is_last_rank:
                s0, s1 = cu[-2], cu[-1]
                part = [None if t is None or t.dim() < 2 else t[:, s0:s1] for t in leaves]
                part[5:] = leaves[5:]  # A_log, dt_bias: per head, not per token
                eye = torch.eye(K, dtype=torch.float32, device=q.device).expand(1, HV, K, K)
                zeros_v = part[2].new_zeros(part[2].shape[:-1] + (K,))
                if V + K <= _MAX_V:
                    # one call over the values [v | 0] from the initial state [0 | I]: its final state
                    # is [E | Phi] (the columns never mix), and the chunks' intra work is done once
                    v_ext = torch.cat([part[2], zeros_v], dim=-1)
                    init = torch.cat([eye.new_zeros(1, HV, K, V), eye], dim=-1).contiguous()
                    _, EP = call(*part[:2], v_ext, *part[3:], initial_state=init, output_final_state=True)
                    hm = EP[0].float()  # [HV, K, V + K], fp32 on every path
                else:  # wider than our kernels' values: two calls
                    _, E = call(*part, output_final_state=True)
                    _, Phi = call(*part[:2], zeros_v, *part[3:], initial_state=eye.contiguous(),
                                  output_final_state=True)
                    hm = torch.cat([E[0], Phi[0]], dim=-1).float()
            else:
                hm = torch.zeros(HV, K, V + K, dtype=torch.float32, device=q.device)
        # 2. every rank's [E | Phi]
        gathered = torch.stack(_cp.gather(hm.detach(), group)).requires_grad_(True)
        with torch.enable_grad():
            # 3. the first document's initial state from the earlier ranks' maps, in rank order
            init = None
            if not cp_context.is_first_rank:
                h = torch.zeros(HV, K, V, dtype=torch.float32, device=q.device)
                for j in range(rank - int(cp_context.pre_num_ranks), rank):
                    h = gathered[j, :, :, V:] @ h + gathered[j, :, :, :V]
                N = len(cu) - 1
                first = h.transpose(-1, -2) if state_v_first else h
                init = torch.cat([first[None], first.new_zeros((N - 1,) + first.shape)]) if N > 1 else first[None]
            # 4. the rank's own call
            o, _ = call(*leaves, initial_state=init, output_final_state=False, cu_seqlens=cp_context.cu_seqlens,
                        cu_seqlens_cpu=getattr(cp_context, "cu_seqlens_cpu", None), state_v_first=state_v_first)
        ctx.graph = (o, hm, gathered, leaves)
        ctx.group = group
        return o.detach()

    @staticmethod
    def backward(ctx, do):
        import torch.distributed as dist

        o, hm, gathered, leaves = ctx.graph
        ctx.graph = None
        d_own, (d_gathered,) = _cp.grads(o, do, leaves, extra=(gathered,))
        # every rank's gradient for every rank's [E | Phi], summed: each takes its own slot (every rank
        # joins, whatever it needs)
        d_gathered = d_gathered.contiguous()
        dist.all_reduce(d_gathered, group=ctx.group)
        if hm.requires_grad:  # this rank's [E | Phi] came from its own tensors
            d_map, _ = _cp.grads(hm, d_gathered[dist.get_rank(ctx.group)], leaves)
            d_own = [a if b is None else (b if a is None else a + b) for a, b in zip(d_own, d_map)]
        return (None, None, None, *d_own)
