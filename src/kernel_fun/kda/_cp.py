"""chunk_kda under fla's ``cp_context`` (context parallelism) on our chunk_kda.

Each rank holds a contiguous slice of one packed sequence ([1, T_rank, ...]) and the context of
``fla.ops.cp.build_cp_context`` (fields used: ``group``, ``cu_seqlens`` (local), ``cu_seqlens_cpu``,
``is_first_rank``, ``is_last_rank``, ``pre_num_ranks``). Over a slice of one document the state
evolves affinely, ``S_out = Phi S_in + E`` (S: [K, V] per value head; Phi: [K, K], the product of
the tokens' transitions; E: the slice's final state from a zero state), and so does every output:
``o_t = o_t(0) + Q_t S_in`` with ``Q_t = scale q_t^T Phi_{..t}`` (the transitions up to token t).
One call of ours over the values [v | 0] from the initial state [0 | I] (the state's columns never
mix) gives all of them at once: its outputs are [o(0) | Q], its final state [E | Phi]. So each
rank runs one call before any collective, whatever its neighbours hold:

1. a rank whose first document began earlier or whose last document goes on to the next rank makes
   that call on its whole slice (two calls, [v] from 0 and [0] from I, where V + K > 512); any
   other rank makes its ordinary call;
2. every rank all-gathers its last document's [E | Phi] (HV x K x (V + K) fp32; zeros where the
   document ends on the rank);
3. a rank whose first document began earlier chains the earlier ranks' maps in rank order
   (h = Phi_j h + E_j, fp32) into that document's initial state S_in and adds ``Q S_in`` to the
   document's outputs (one batched matmul per value head in the inputs' dtype, fp32 accumulation).

The ranks' calls run side by side and no rank runs a second one: the slowest rank does one call
with V + K value columns on T / world tokens (the form before this one ran the [E | Phi] call and
then the rank's ordinary call after the gather, and two backwards).

The backward: the correction's gradients (dQ = do S_in^T, and dS_in = Q^T do through the chain into
the gathered maps) first, one all-reduce of the maps' gradients (each rank takes its own slot: the
gradient of its last document's final state), then one backward of the rank's call with both its
output and its final-state gradients. Both passes run inside one autograd function, so that no
rank skips a collective the others wait in.

As in fla, ``initial_state`` and ``output_final_state`` are not allowed and the context's cu_seqlens
is used; no state crosses the API, so the calls keep the default state layout whatever
``state_v_first`` says.

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


def _local_calls(call, leaves, cu_kw, N: int, K: int, V: int, need_map: bool):
    """The rank's call(s) on its slice with the identity beside the values: ``(outputs, states)``,
    outputs [o(0), Q] ([1, T, HV, V] and [1, T, HV, K]) and states, when need_map, [E, Phi] of the
    last document ([HV, K, V] and [HV, K, K], fp32); ``graph`` is what the backward differentiates
    (the calls' own outputs and final states, which the returned tensors are detached views of)."""
    q, v = leaves[0], leaves[2]
    HV = v.shape[2]
    eye = torch.eye(K, dtype=torch.float32, device=q.device).expand(N, HV, K, K)
    zeros_v = v.new_zeros(v.shape[:-1] + (K,))
    kw = dict(output_final_state=need_map, **cu_kw)
    if V + K <= _MAX_V:
        init = torch.cat([eye.new_zeros(N, HV, K, V), eye], dim=-1).contiguous()
        o_ext, ht = call(*leaves[:2], torch.cat([v, zeros_v], dim=-1), *leaves[3:], initial_state=init, **kw)
        graph = ([o_ext], [ht] if need_map else [])
        outputs = [o_ext[..., :V], o_ext[..., V:]]
        states = [ht[-1, ..., :V], ht[-1, ..., V:]] if need_map else []
    else:  # wider than our kernels' values: two calls of the same tokens
        o0, E = call(*leaves, **kw)
        Q, Phi = call(*leaves[:2], zeros_v, *leaves[3:], initial_state=eye.contiguous(), **kw)
        graph = ([o0, Q], [E, Phi] if need_map else [])
        outputs = [o0, Q]
        states = [E[-1], Phi[-1]] if need_map else []
    return graph, outputs, [s.float() for s in states]


class KdaCP(torch.autograd.Function):
    """One context-parallel chunk_kda call. ``call(q, k, v, g, beta, A_log, dt_bias, **kw)`` is our
    chunk_kda with the caller's options; ``tensors`` are (q, k, v, g, beta, A_log, dt_bias), the last
    two None when not given."""

    @staticmethod
    def forward(ctx, call, cp_context, *tensors):
        import torch.distributed as dist

        group = cp_context.group
        rank = dist.get_rank(group)
        q, v = tensors[0], tensors[2]
        K, HV, V = q.shape[-1], v.shape[2], v.shape[-1]
        cu = _host_cu(cp_context)
        N = len(cu) - 1
        need_map = not cp_context.is_last_rank  # the last document goes on to the next rank
        need_in = not cp_context.is_first_rank  # the first document began on an earlier rank
        cu_kw = dict(cu_seqlens=cp_context.cu_seqlens, cu_seqlens_cpu=getattr(cp_context, "cu_seqlens_cpu", None))
        with torch.enable_grad():
            leaves = _cp.leaves(tensors)
            # 1. the rank's one call (or two, where V + K is too wide), before any collective
            if need_map or need_in:
                graph, outputs, states = _local_calls(call, leaves, cu_kw, N, K, V, need_map)
            else:
                o, _ = call(*leaves, output_final_state=False, **cu_kw)
                graph, outputs, states = ([o], []), [o], []
        # the correction's graph starts from detached copies, so that the backward can take its
        # gradients (and all-reduce the maps') before the one backward of the calls
        cuts = [t.detach().requires_grad_(True) for t in outputs]
        hm = torch.cat(states, dim=-1).detach() if need_map else torch.zeros(HV, K, V + K, dtype=torch.float32,
                                                                      device=q.device)
        # 2. every rank's [E | Phi]
        gathered = torch.stack(_cp.gather(hm, group)).requires_grad_(True)
        with torch.enable_grad():
            o = cuts[0]
            if need_in:
                # 3. the first document's initial state from the earlier ranks' maps, in rank order,
                # and its outputs' share of it: o += Q S_in over the document's tokens
                h = torch.zeros(HV, K, V, dtype=torch.float32, device=q.device)
                for j in range(rank - int(cp_context.pre_num_ranks), rank):
                    h = gathered[j, :, :, V:] @ h + gathered[j, :, :, :V]
                first = slice(cu[0], cu[1])
                Qf = cuts[1][0, first].transpose(0, 1)  # [HV, T_first, K]
                corr = (Qf @ h.to(Qf.dtype)).transpose(0, 1)[None]
                o = torch.cat([o[:, first] + corr, o[:, cu[1]:]], dim=1)
        ctx.graph = (graph, cuts, o, gathered, leaves, need_map)
        ctx.group = group
        return o.detach()

    @staticmethod
    def backward(ctx, do):
        import torch.distributed as dist

        (outs, finals), cuts, o, gathered, leaves, need_map = ctx.graph
        ctx.graph = None
        # the correction's gradients: the calls' outputs' ([do | dQ]) and the gathered maps'
        _, d_cuts = _cp.grads(o, do, [], extra=tuple(cuts) + (gathered,))
        d_gathered = d_cuts.pop().contiguous()
        # every rank's gradient for every rank's [E | Phi], summed: each takes its own slot (every
        # rank joins, whatever it needs)
        dist.all_reduce(d_gathered, group=ctx.group)
        d_outs = [torch.cat(d_cuts, dim=-1)] if len(outs) == 1 else d_cuts
        d_finals = []
        if need_map:  # this rank's [E | Phi] is its last document's final state: a gradient there only
            mine = d_gathered[dist.get_rank(ctx.group)]
            parts = [mine] if len(finals) == 1 else [mine[..., :-mine.shape[-2]], mine[..., -mine.shape[-2]:]]
            for f, p in zip(finals, parts):
                d = torch.zeros_like(f)
                d[-1] = p.to(f.dtype)
                d_finals.append(d)
        # one backward of the rank's call(s), with the outputs' and the final states' gradients
        want = [t for t in leaves if t is not None and t.requires_grad]
        got = iter(torch.autograd.grad(outs + finals, want, d_outs + d_finals, allow_unused=True))
        return (None, None, *[next(got) if t is not None and t.requires_grad else None for t in leaves])
