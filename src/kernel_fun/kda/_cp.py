"""chunk_kda under fla's ``cp_context`` (context parallelism) on our chunk_kda.

Each rank holds a contiguous slice of one packed sequence ([1, T_rank, ...]) and the context of
``fla.ops.cp.build_cp_context`` (fields used: ``group``, ``cu_seqlens`` (local), ``cu_seqlens_cpu``,
``is_first_rank``, ``is_last_rank``, ``pre_num_ranks``). Over a rank's part of one document the
state evolves affinely, ``S_out = Phi S_in + E`` (S: [K, V] per value head; Phi: [K, K], the product
of the tokens' transitions; E: the part's final state from a zero state), and so does every output:
``o_t = o_t(0) + Q_t S_in`` with ``Q_t = scale q_t^T Phi_{..t}`` (the transitions up to token t).
One call of ours over the values [v | 0] from the initial state [0 | I] (the state's columns never
mix) gives all of them at once: its outputs are [o(0) | Q], its final state [E | Phi]. On our
kernels the K identity columns are virtual (KdaProblem::id_cols: a zero value tile, the identity as
their initial state, Q written to a tensor of its own), so no [v | 0] is built and o(0) needs no copy
out of [o(0) | Q]. So each rank does its work before any collective, whatever its neighbours hold:

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

The backward: dS_in = Q^T do through the chain into the gathered maps first, one all-reduce of the
maps' gradients (each rank takes its own slot: the gradient of its last document's final state),
then one backward of the rank's calls with their output and final-state gradients. The document
that began earlier is differentiated as the ordinary call over v from S_in (_Crossing): V value
columns, not V + K. Both passes run inside one autograd function, so that no rank skips a
collective the others wait in.

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


class KernelEngine:
    """The crossing document's calls on our raw ops (kernel_fun::kda_forward / kda_backward) with the
    call's encoded options. The forward keeps the intra's factors (Aqk, Akk, M) and its workspace
    (w, qg, kg, exp2(G)): none of them depends on the values, so the call over [v | 0] leaves exactly
    what the ordinary call over v would. The backward is that ordinary call's from S_in, at V value
    columns (it re-runs the scan from S_in: no per-chunk states are kept)."""

    def __init__(self, options: str):
        from kernel_fun.kda import _kernel

        self.kernel, self.options, self.opts = _kernel, options, _kernel._decode(options)

    def gate(self, A_log, dt_bias):
        """The gate parameters as the ops take them (flat fp32, None where the gate does not read
        them), made under autograd so their gradients reach the caller's shapes and dtypes."""
        return self.kernel.gate_params(self.opts, A_log, dt_bias)

    def run(self, part, v, init, final: bool, keep: bool):
        """(o, final state or None, what the backward reads or None) of one call over values v."""
        q, k, _, g, beta, A, D = part
        out = self.kernel.kda_forward(q, k, v, g, beta, A, D, init, None, self.options, final, keep, False, keep)
        return out[0], (out[1] if final else None), (tuple(out[2:5]) + tuple(out[6:10]) if keep else None)

    def run_identity(self, part, final: bool):
        """(o(0), Q, [E | Phi] or None, what the backward reads) of the call over [v | 0] from [0 | I],
        with the K identity columns virtual in our kernels (KdaProblem::id_cols): no [v | 0] buffer,
        o(0) and Q written to tensors of their own."""
        return self.kernel.forward_identity_columns(*part, self.options, final)

    def grads(self, kept, part, S_in, do, dht, needs):
        """The gradients of part's tensors for the ordinary call from S_in, given do and dht."""
        q, k, v, g, beta, A, D = part
        Aqk, Akk, M, w, qg, kg, gdecay = kept
        out = self.kernel.kda_backward(q, k, v, g, beta, A, D, S_in, None, do, dht, Aqk, Akk, M, None, w, qg, kg,
                                       gdecay, self.options)
        return [d if n and t is not None else None for d, n, t in zip(out[:7], needs, part)]


class CallEngine:
    """The crossing document's calls through ``call`` (the front's chunk_kda): any device and route
    (the torch reference on the CPU, fla where it routes there). Keeps nothing: its backward runs
    the ordinary call's forward from S_in again, under autograd."""

    def __init__(self, call):
        self.call = call

    def gate(self, A_log, dt_bias):
        return A_log, dt_bias

    def run(self, part, v, init, final: bool, keep: bool):
        return (*self.call(part[0], part[1], v, *part[3:], initial_state=init, output_final_state=final), None)

    def run_identity(self, part, final: bool):
        """As KernelEngine's, through one call over [v | 0] from [0 | I] (o(0) and Q its column blocks)."""
        v = part[2]
        HV, V, K = v.shape[2], v.shape[3], part[0].shape[-1]
        eye = _identity_state(K, HV, v.device)
        init = torch.cat([eye.new_zeros(1, HV, K, V), eye], dim=-1).contiguous()
        o_ext, ht, kept = self.run(part, _zero_columns(v, K), init, final, True)
        return o_ext[..., :V], o_ext[..., V:], ht, kept

    def grads(self, kept, part, S_in, do, dht, needs):
        with torch.enable_grad():
            xs = [None if t is None else t.detach().requires_grad_(bool(n)) for t, n in zip(part, needs)]
            o, ht = self.call(*xs, initial_state=S_in, output_final_state=dht is not None)
            return _cp.grads([o] + ([ht] if dht is not None else []), [do] + ([dht] if dht is not None else []),
                             xs)


class _Crossing(torch.autograd.Function):
    """The document that began on an earlier rank: ``(o(0), Q, E, Phi)`` for part = (q, k, v, g, beta,
    A, D) (A, D: the engine's gate parameters), E and Phi None unless ``need_map``. Forward: one call
    over [v | 0] from [0 | I] (o(0) = its first V output columns, Q the rest; its final state [E |
    Phi]), or two calls where V + K is wider than our kernels' values.

    Backward: the rank's true outputs are those of the ordinary call over v from the true incoming
    state S_in, o = o(0) + Q S_in and S_out = E + Phi S_in, and the loss sees Q and Phi only through
    them (the correction on this rank, the chain on the later ones, which forms Phi S_in again from
    the same maps: dPhi = dE S_in^T), so every input's gradient is that call's backward with
    ``initial_state = S_in``, ``do`` and ``dht = dE``: V value columns instead of V + K, and the
    gradients of Q and Phi are never formed. S_in is the chain's, put in ``box["S_in"]`` ([HV, K, V]
    fp32) by KdaCP's forward before any backward runs; Q and Phi are not differentiable outputs."""

    @staticmethod
    def forward(ctx, engine, box, K: int, need_map: bool, *part):
        v = part[2]
        HV, V = v.shape[2], v.shape[3]
        if V + K <= _MAX_V:
            o0, Q, ht, kept = engine.run_identity(part, need_map)
            E, Phi = (ht[..., :V], ht[..., V:]) if need_map else (None, None)
        else:  # wider than our kernels' values: two calls of the same tokens
            eye = _identity_state(K, HV, v.device)
            o0, E, kept = engine.run(part, v, None, need_map, True)
            Q, Phi, _ = engine.run(part, v.new_zeros(v.shape[:-1] + (K,)), eye.contiguous(), need_map, False)
        ctx.engine, ctx.box, ctx.kept = engine, box, kept
        ctx.save_for_backward(*part)
        ctx.mark_non_differentiable(*[t for t in (Q, Phi) if t is not None])
        ctx.set_materialize_grads(False)
        return o0, Q, E, Phi

    @staticmethod
    def backward(ctx, do, _dQ, dE, _dPhi):
        part = ctx.saved_tensors
        if do is None:  # only the map was used (never by KdaCP, which always places o(0))
            do = torch.zeros_like(part[2])
        grads = ctx.engine.grads(ctx.kept, part, ctx.box["S_in"][None], do.contiguous(),
                                 None if dE is None else dE.contiguous(), ctx.needs_input_grad[4:])
        ctx.kept = None
        return (None, None, None, None, *grads)


def _words(x: torch.Tensor) -> torch.Tensor:
    """x as 8-byte words (four bf16 each) where its rows allow it, else x: a copy between row-strided
    tensors ([..., :V] of a [..., V + K] buffer) runs torch's generic strided kernel, whose index
    arithmetic per element made such copies ~1.8 TB/s on the H200 at 2 bytes an element."""
    es = x.element_size()
    rows_fit = x.stride(-1) == 1 and (x.shape[-1] * es) % 8 == 0 and (x.storage_offset() * es) % 8 == 0
    if es < 8 and rows_fit and all(s * es % 8 == 0 for s in x.stride()[:-1]):
        return x.view(torch.int64)
    return x


def _copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src), as 8-byte words where both allow it."""
    a, b = _words(dst), _words(src)
    if a.dtype == b.dtype:
        a.copy_(b)
    else:
        dst.copy_(src)


def _identity_state(K: int, HV: int, device) -> torch.Tensor:
    """[1, HV, K, K] fp32: the identity per value head, the initial state whose outputs are Q and whose
    final state is Phi (a view: callers make it contiguous, alone or beside zero columns)."""
    return torch.eye(K, dtype=torch.float32, device=device).expand(1, HV, K, K)


def _zero_columns(v: torch.Tensor, K: int) -> torch.Tensor:
    """[v | 0]: K zero columns beside the values, in one buffer (v copied once, only the new columns
    zero-filled)."""
    V = v.shape[-1]
    out = v.new_empty(v.shape[:-1] + (V + K,))
    _copy_rows(out[..., :V], v)
    _words(out[..., V:]).zero_()
    return out


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[1, T, HV, D] -> a [HV, T, D] view (no copy): the layout of the per-head matmuls, whose
    strided batches cuBLAS reads and writes in place."""
    return x[0].transpose(0, 1)


class KdaCP(torch.autograd.Function):
    """One context-parallel chunk_kda call. ``call(q, k, v, g, beta, A_log, dt_bias, **kw)`` is our
    chunk_kda with the caller's options; ``engine`` runs the document that began on an earlier rank
    (_Crossing: KernelEngine or CallEngine, the front's choice); ``cu`` the rank's document offsets
    on the host (``validate``'s); ``tensors`` are (q, k, v, g, beta, A_log, dt_bias), the last two
    None when not given.

    The correction of the first document's outputs (``o += Q S_in``) is written by hand, in the
    outputs' own layout: o(0) copied into the output (or, where that document is the rank's whole
    slice and o(0) a tensor of its own, o(0) is the output), then one strided batched matmul adds Q
    S_in in place; in the backward ``dS_in = Q^T do``, and only the small chain from the gathered
    maps to S_in is differentiated by autograd. The row-strided copies of CallEngine's form (o(0) out
    of the call's [o(0) | Q], v into [v | 0]) move 8-byte words (``_copy_rows``)."""

    @staticmethod
    def forward(ctx, call, engine, cp_context, cu, *tensors):
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
        outs, finals, spans, placed = [], [], [], []
        box = {}  # S_in, for _Crossing's backward
        o0 = Q = None
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
                    maps = need_map and hi == cu[-1]
                    o0, Q, E, Phi = _Crossing.apply(engine, box, K, maps, *part[:5], *engine.gate(*part[5:]))
                    outs.append(o0)
                    if maps:
                        finals.append(E)
                        hm = torch.cat([E[0].detach().float(), Phi[0].float()], dim=-1)
                    o0, Q = o0.detach(), Q.detach()
                elif kind == "out":  # began here from zero: E is the map (Phi meets a zero state)
                    o, ht = call(*part, output_final_state=True)
                    outs.append(o)
                    finals.append(ht)
                    hm = torch.cat([ht[0].detach().float(), hm[..., V:]], dim=-1)
                    placed.append((lo, hi, o))
                else:
                    if len(segs) == 1:  # the whole slice: the context's own offsets
                        cu_kw = dict(cu_seqlens=cp_context.cu_seqlens,
                                     cu_seqlens_cpu=getattr(cp_context, "cu_seqlens_cpu", None))
                    else:  # the documents between the crossing ones, from the host copy
                        host = torch.tensor([c - lo for c in cu if lo <= c <= hi], dtype=torch.int32)
                        cu_kw = dict(cu_seqlens=host.to(q.device), cu_seqlens_cpu=host)
                    o, _ = call(*part, output_final_state=False, **cu_kw)
                    outs.append(o)
                    placed.append((lo, hi, o))
                spans.append((lo, hi))
        # 2. every rank's [E | Phi]
        gathered = torch.stack(_cp.gather(hm.detach(), group)).requires_grad_(True)
        with torch.no_grad():
            if len(segs) == 1 and placed:  # one ordinary call: its output is the rank's (contiguous)
                o = placed[0][2].detach()
            elif len(segs) == 1 and o0.is_contiguous():  # one crossing document whose o(0) has a tensor of
                o = o0  # its own (KernelEngine): the correction below goes into it in place, no copy
            else:
                o = torch.empty(q.shape[:2] + (HV, V), dtype=(o0 if o0 is not None else placed[0][2]).dtype,
                                device=q.device)
                for lo, hi, out in placed:
                    o[:, lo:hi].copy_(out)
        h = None
        if need_in:
            # 3. the first document's initial state from the earlier ranks' maps, in rank order (the
            # one part autograd differentiates), and its outputs' share of it, o = o(0) + Q S_in,
            # written into o's own layout (its first call's tokens are the document's tokens)
            with torch.enable_grad():
                h = torch.zeros(HV, K, V, dtype=torch.float32, device=q.device)
                for j in range(rank - int(cp_context.pre_num_ranks), rank):
                    h = gathered[j, :, :, V:] @ h + gathered[j, :, :, :V]
            box["S_in"] = h.detach()
            with torch.no_grad():
                lo, hi = segs[0][0], segs[0][1]
                dst = o[:, lo:hi]
                if o is not o0:
                    _copy_rows(dst, o0)
                _heads_first(dst).baddbmm_(_heads_first(Q), h.detach().to(Q.dtype))
        ctx.graph = (outs, spans, finals, Q, h, segs[0][:2], gathered, leaves, V)
        ctx.group = group
        return o

    @staticmethod
    def backward(ctx, do):
        import torch.distributed as dist

        outs, spans, finals, Q, h, (in_lo, in_hi), gathered, leaves, V = ctx.graph
        ctx.graph = None
        do = do.contiguous()
        d_gathered = torch.zeros_like(gathered)
        if h is not None:
            # dS_in = Q^T do per value head (the first document's tokens), then through the chain into
            # the gathered maps
            d_h = torch.bmm(_heads_first(Q).transpose(1, 2), _heads_first(do[:, in_lo:in_hi])).float()
            d_gathered = torch.autograd.grad(h, gathered, d_h)[0].contiguous()
        # every rank's gradient for every rank's [E | Phi], summed: each takes its own slot (every
        # rank joins, whatever it needs)
        dist.all_reduce(d_gathered, group=ctx.group)
        # the last document's final state E (of [E | Phi], whose Phi part _Crossing never needs): its
        # columns of this rank's slot
        mine = d_gathered[dist.get_rank(ctx.group)]
        d_finals = [mine[None, ..., :V].to(f.dtype) for f in finals]
        # one backward of the rank's calls, with the outputs' (contiguous slices: one sequence) and
        # the final states' gradients
        want = [t for t in leaves if t is not None and t.requires_grad]
        got = iter(torch.autograd.grad(outs + finals, want, [do[:, lo:hi] for lo, hi in spans] + d_finals,
                                       allow_unused=True))
        return (None, None, None, None, *[next(got) if t is not None and t.requires_grad else None for t in leaves])
