"""chunk_kda under fla's ``cp_context`` (context parallelism) on our chunk_kda.

Each rank holds a contiguous slice of one packed sequence ([1, T_rank, ...]) and the context of
``fla.ops.cp.build_cp_context`` (fields used: ``group``, ``cu_seqlens`` (local), ``cu_seqlens_cpu``,
``is_first_rank``, ``is_last_rank``, ``pre_num_ranks``). Over a rank's part of one document the
state evolves affinely, ``S_out = Phi S_in + E`` (S: [K, V] per value head; Phi: [K, K], the product
of the tokens' transitions; E: the part's final state from a zero state), and so does every output:
``o_t = o_t(0) + Q_t S_in`` with ``Q_t = scale q_t^T Phi_{..t}`` (the transitions up to token t).
One call of ours over the values [v | 0] from the initial state [0 | I] (the state's columns never
mix) gives all of them at once: its outputs are [o(0) | Q], its final state [E | Phi]. So each rank
does its work before any collective, whatever its neighbours hold:

1. a first document that began on an earlier rank by such a call (two calls, [v] from 0 and [0]
   from I, where V + K > 512; its [E | Phi] too where it goes on to the next rank as well); a last
   document that began here and goes on by an ordinary call with its final state: the state
   entering it is zero, so E is its whole map (Phi is sent as zeros); the documents between them by
   one ordinary call;
2. every rank all-gathers its last document's [E | Phi] (HV x K x (V + K) fp32; zeros where the
   document ends on the rank);
3. a rank whose first document began earlier chains the earlier ranks' maps in rank order
   (h = Phi_j h + E_j, fp32) into that document's initial state S_in and adds ``Q S_in`` to the
   document's outputs (one batched matmul per value head in the inputs' dtype, fp32 accumulation).

The ranks' calls run side by side, and every token is processed once: at V + K value columns in a
document that began on an earlier rank, at V elsewhere (why this form: docs/notes/2026-12-05-cp-one-call.md).

The backward: the correction's gradients (dQ = do S_in^T, and dS_in = Q^T do through the chain into
the gathered maps) first, one all-reduce of the maps' gradients (each rank takes its own slot: the
gradient of its last document's final state), then one backward of the rank's calls with their
output and final-state gradients. Both passes run inside one autograd function, so that no rank
skips a collective the others wait in.

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


def validate(q, initial_state, output_final_state, return_intermediate_states, cp_context) -> list[int]:
    """The checks beyond the ordinary ones (ValueError naming the argument); returns the rank's
    document offsets on the host (read once: without cu_seqlens_cpu that is a device sync)."""
    _cp.check_call("kernel_fun.kda.chunk_kda", cp_context, _FIELDS, initial_state, output_final_state, q, "q", 4)
    if return_intermediate_states:
        raise ValueError("kernel_fun.kda.chunk_kda: return_intermediate_states is not allowed with cp_context")
    # the rank's documents must tile its slice: the calls below slice the tokens by them
    cu, T = _host_cu(cp_context), q.shape[1]
    if not cu or cu[0] != 0 or cu[-1] != T or any(a > b for a, b in zip(cu, cu[1:])):
        raise ValueError(f"kernel_fun.kda.chunk_kda: cp_context.cu_seqlens must run from 0 to this rank's "
                         f"T = {T} without decreasing, got {cu}")
    if not cp_context.is_first_rank and int(cp_context.pre_num_ranks) < 1:
        raise ValueError(f"kernel_fun.kda.chunk_kda: cp_context.pre_num_ranks must be at least 1 where "
                         f"is_first_rank is False, got {cp_context.pre_num_ranks}")
    return cu


def _host_cu(cp_context) -> list[int]:
    cu = getattr(cp_context, "cu_seqlens_cpu", None)
    return (cu if cu is not None else cp_context.cu_seqlens.cpu()).tolist()


def segments(cu: list[int], need_in: bool, need_map: bool) -> list[tuple[int, int, str]]:
    """The rank's calls as (first token, end, kind) over its local document offsets ``cu``: "in" for
    a first document that began on an earlier rank (its outputs depend on the incoming state: [o(0)
    | Q], and [E | Phi] too where it also goes on, the slice being that one document), "out" for a
    last document that began here and goes on (its final state E from zero is its whole map: the
    state entering it is zero), "plain" for the documents between, together."""
    if not (need_in or need_map):
        return [(cu[0], cu[-1], "plain")]
    if len(cu) == 2:
        return [(cu[0], cu[-1], "in" if need_in else "out")]
    lo, hi = (cu[1] if need_in else cu[0]), (cu[-2] if need_map else cu[-1])
    return ([(cu[0], cu[1], "in")] if need_in else []) + ([(lo, hi, "plain")] if lo < hi else []) + \
        ([(cu[-2], cu[-1], "out")] if need_map else [])


def _in_call(call, part, K: int, V: int, need_map: bool):
    """A document that began on an earlier rank: its call(s) with the identity beside the values.
    ``(outs, joined, finals, cols, outputs, states)``: the calls' own outputs, how many of ``outputs``
    each holds side by side, their final states and the columns of [E | Phi] each holds (what the
    backward differentiates); the outputs [o(0), Q] ([1, T, HV, V] and [1, T, HV, K]) and, when
    need_map, [E, Phi] ([HV, K, V] and [HV, K, K], fp32)."""
    v = part[2]
    HV = v.shape[2]
    eye = torch.eye(K, dtype=torch.float32, device=v.device).expand(1, HV, K, K)
    zeros_v = v.new_zeros(v.shape[:-1] + (K,))
    if V + K <= _MAX_V:
        init = torch.cat([eye.new_zeros(1, HV, K, V), eye], dim=-1).contiguous()
        o_ext, ht = call(*part[:2], torch.cat([v, zeros_v], dim=-1), *part[3:], initial_state=init,
                         output_final_state=need_map)
        outs, joined = [o_ext], [2]
        finals, cols = ([ht], [(0, V + K)]) if need_map else ([], [])
        outputs = [o_ext[..., :V], o_ext[..., V:]]
        states = [ht[0, ..., :V], ht[0, ..., V:]] if need_map else []
    else:  # wider than our kernels' values: two calls of the same tokens
        o0, E = call(*part, output_final_state=need_map)
        Q, Phi = call(*part[:2], zeros_v, *part[3:], initial_state=eye.contiguous(), output_final_state=need_map)
        outs, joined = [o0, Q], [1, 1]
        finals, cols = ([E, Phi], [(0, V), (V, V + K)]) if need_map else ([], [])
        outputs = [o0, Q]
        states = [E[0], Phi[0]] if need_map else []
    return outs, joined, finals, cols, outputs, [s.float() for s in states]


class KdaCP(torch.autograd.Function):
    """One context-parallel chunk_kda call. ``call(q, k, v, g, beta, A_log, dt_bias, **kw)`` is our
    chunk_kda with the caller's options; ``cu`` the rank's document offsets on the host (``validate``'s);
    ``tensors`` are (q, k, v, g, beta, A_log, dt_bias), the last two None when not given."""

    @staticmethod
    def forward(ctx, call, cp_context, cu, *tensors):
        import torch.distributed as dist

        group = cp_context.group
        rank = dist.get_rank(group)
        q, v = tensors[0], tensors[2]
        K, HV, V = q.shape[-1], v.shape[2], v.shape[-1]
        need_map = not cp_context.is_last_rank  # the last document goes on to the next rank
        need_in = not cp_context.is_first_rank  # the first document began on an earlier rank
        if need_in and int(cp_context.pre_num_ranks) > rank:
            raise ValueError(f"kernel_fun.kda.chunk_kda: cp_context.pre_num_ranks = {cp_context.pre_num_ranks} "
                             f"on rank {rank}: the first document cannot begin before rank 0")
        segs = segments(cu, need_in, need_map)
        outs, joined, finals, cols, cuts, per_seg = [], [], [], [], [], []
        hm = torch.zeros(HV, K, V + K, dtype=torch.float32, device=q.device)
        with torch.enable_grad():
            leaves = _cp.leaves(tensors)
            # 1. the rank's calls, before any collective
            for lo, hi, kind in segs:
                if len(segs) == 1:
                    part = leaves
                else:  # a slice of the tokens; A_log and dt_bias are per head
                    part = [t if t is None or t.dim() < 2 else t[:, lo:hi] for t in leaves]
                if kind == "in":
                    o_s, j_s, f_s, c_s, outputs, states = _in_call(call, part, K, V, need_map and hi == cu[-1])
                    if states:
                        hm = torch.cat(states, dim=-1).detach()
                elif kind == "out":  # began here from zero: E is the map (Phi meets a zero state)
                    o, ht = call(*part, output_final_state=True)
                    o_s, j_s, f_s, c_s, outputs = [o], [1], [ht], [(0, V)], [o]
                    hm = torch.cat([ht[0].float(), hm[..., V:]], dim=-1).detach()
                else:
                    if len(segs) == 1:  # the whole slice: the context's own offsets
                        cu_kw = dict(cu_seqlens=cp_context.cu_seqlens,
                                     cu_seqlens_cpu=getattr(cp_context, "cu_seqlens_cpu", None))
                    else:  # the documents between the crossing ones, from the host copy
                        host = torch.tensor([c - lo for c in cu if lo <= c <= hi], dtype=torch.int32)
                        cu_kw = dict(cu_seqlens=host.to(q.device), cu_seqlens_cpu=host)
                    o, _ = call(*part, output_final_state=False, **cu_kw)
                    o_s, j_s, f_s, c_s, outputs = [o], [1], [], [], [o]
                outs += o_s
                joined += j_s
                finals += f_s
                cols += c_s
                # the correction's graph starts from detached copies, so that the backward can take
                # its gradients (and all-reduce the maps') before the one backward of the calls
                per_seg.append([t.detach().requires_grad_(True) for t in outputs])
                cuts += per_seg[-1]
        # 2. every rank's [E | Phi]
        gathered = torch.stack(_cp.gather(hm, group)).requires_grad_(True)
        with torch.enable_grad():
            pieces = [c[0] for c in per_seg]
            if need_in:
                # 3. the first document's initial state from the earlier ranks' maps, in rank order,
                # and its outputs' share of it: o += Q S_in (the first call's tokens are its tokens)
                h = torch.zeros(HV, K, V, dtype=torch.float32, device=q.device)
                for j in range(rank - int(cp_context.pre_num_ranks), rank):
                    h = gathered[j, :, :, V:] @ h + gathered[j, :, :, :V]
                Qf = per_seg[0][1][0].transpose(0, 1)  # [HV, T_first, K]
                pieces[0] = pieces[0] + (Qf @ h.to(Qf.dtype)).transpose(0, 1)[None]
            # contiguous, as fla returns it (an "in" call's o(0) is a view beside its Q)
            o = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0].contiguous()
        ctx.graph = (outs, finals, cols, joined, cuts, o, gathered, leaves)
        ctx.group = group
        return o.detach()

    @staticmethod
    def backward(ctx, do):
        import torch.distributed as dist

        outs, finals, cols, joined, cuts, o, gathered, leaves = ctx.graph
        ctx.graph = None
        # the correction's gradients: the calls' outputs' ([do | dQ]) and the gathered maps'
        _, d_cuts = _cp.grads(o, do, [], extra=tuple(cuts) + (gathered,))
        d_gathered = d_cuts.pop().contiguous()
        # every rank's gradient for every rank's [E | Phi], summed: each takes its own slot (every
        # rank joins, whatever it needs)
        dist.all_reduce(d_gathered, group=ctx.group)
        d_outs, it = [], iter(d_cuts)
        for n in joined:  # a call's output is n cuts side by side ([o(0) | Q]: 2)
            d_outs.append(torch.cat([next(it) for _ in range(n)], dim=-1) if n > 1 else next(it))
        # the last document's final state ([E | Phi], [E] and [Phi], or [E] alone): its columns of
        # this rank's slot
        mine = d_gathered[dist.get_rank(ctx.group)]
        d_finals = [mine[None, ..., a:b].to(f.dtype) for f, (a, b) in zip(finals, cols)]
        # one backward of the rank's calls, with the outputs' and the final states' gradients
        want = [t for t in leaves if t is not None and t.requires_grad]
        got = iter(torch.autograd.grad(outs + finals, want, d_outs + d_finals, allow_unused=True))
        return (None, None, None, *[next(got) if t is not None and t.requires_grad else None for t in leaves])

