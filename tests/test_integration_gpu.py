"""What users of a kernel library expect beyond numerics, checked on the public API of each family:
launches on the caller's current stream (CUDA-graph capture on a side stream fails otherwise),
graph replay is bit-identical to eager, memory does not grow over repeated calls, outputs never
alias across calls, results are bitwise deterministic; fla 0.6.0's use_graph with padded
cu_seqlens. Every call runs inside kernel_fun.strict() and counts our op's launches (C++ op
counters), so none of this can pass on fla's output after a fallback."""

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu


def _ours(fn, op: str):
    """fn(x) inside kernel_fun.strict(), checked to launch our op once per call (helpers.our_launches)."""
    from helpers import our_launches

    def run(x):
        with our_launches(**{op: 1}):
            return fn(x)

    return run


def _cconv_call():
    from kernel_fun.cconv import causal_conv1d, is_supported

    B, T, D, W = 2, 300, 256, 4
    x = torch.randn(B, T, D, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(D, W, device="cuda", dtype=torch.bfloat16)
    ok, why = is_supported(x, w, activation="silu")
    assert ok, why

    def run(x_):
        return causal_conv1d(x_, w, activation="silu")[0]

    return _ours(run, "cconv_fwd"), x


def _kda_call():
    from kernel_fun.kda import chunk_kda, is_supported

    B, T, H, K, V = 1, 200, 2, 128, 128
    g_ = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16, generator=g_)
    k = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16, generator=g_)
    v = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16, generator=g_)
    g = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16, generator=g_)
    beta = torch.randn(B, T, H, device="cuda", dtype=torch.bfloat16, generator=g_)
    A_log = torch.log(torch.rand(H, device="cuda") * 15 + 1)
    kw = dict(use_gate_in_kernel=True, A_log=A_log, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    ok, why = is_supported(q, v, k=k, g=g, beta=beta, **kw)
    assert ok, why

    def run(q_):
        with torch.no_grad():
            return chunk_kda(q_, k, v, g, beta, **kw)[0]

    return _ours(run, "kda_fwd"), q


CALLS = {"cconv": _cconv_call, "kda": _kda_call}


@pytest.fixture(params=sorted(CALLS))
def call(request):
    try:
        return CALLS[request.param]()
    except (ImportError, AttributeError) as e:  # family not built in this tree
        pytest.fail(f"{request.param}: {e}")


def test_deterministic_and_no_aliasing(call):
    run, x = call
    a, b = run(x), run(x)
    assert a.data_ptr() != b.data_ptr()
    assert torch.equal(a, b)


def test_side_stream_and_graph_replay_match_eager(call):
    run, x = call
    eager = run(x)
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        side = run(static_x)  # warm-up on the side stream (also: results there equal eager)
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(side, eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # fails if any launch goes to the legacy default stream
        out = run(static_x)
    fresh = torch.randn_like(x)
    static_x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run(fresh))


def test_memory_does_not_grow(call):
    run, x = call
    for _ in range(3):
        run(x)
    torch.cuda.synchronize()
    gc.collect()
    base = torch.cuda.memory_allocated()
    for _ in range(20):
        y = run(x)
        del y
    torch.cuda.synchronize()
    gc.collect()
    assert torch.cuda.memory_allocated() <= base


def test_nemo_fused_chunk_kda_runs_our_kernels():
    """NeMo's entry point on the GPU: (o, None) equal to chunk_kda on the dense layout, our ops ran
    (counted), dense input as packed documents; gradients flow."""
    import torch
    from kernel_fun import nemo
    from kernel_fun import _ext
    from kernel_fun.kda import chunk_kda
    gen = torch.Generator(device="cuda").manual_seed(0)
    B, T, H, K, V = 2, 200, 2, 128, 128
    q = torch.randn(B, T, H, K, device="cuda", generator=gen).bfloat16().requires_grad_(True)
    k = torch.randn(B, T, H, K, device="cuda", generator=gen).bfloat16()
    v = torch.randn(B, T, H, V, device="cuda", generator=gen).bfloat16()
    g = (-5 * torch.rand(B, T, H, K, device="cuda", generator=gen)).float()
    beta = torch.rand(B, T, H, device="cuda", generator=gen).bfloat16()
    assert nemo.fused_kda_unsupported_reason(q, k, v, g, beta, None) is None
    before = _ext.op_calls()["kda_fwd"]
    o, none = nemo.fused_chunk_kda(q, k, v, g, beta, None)
    assert none is None and _ext.op_calls()["kda_fwd"] == before + 1
    ref, _ = chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    from helpers import rel_rms
    assert o.shape == ref.shape and rel_rms(ref.float(), o.float()) < 2e-3  # same math; packed vs dense path
    o.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.fla  # fla's own layer: its Triton kernels compile on first use (minutes on a fresh machine)
def test_fla_kda_layer_runs_our_kernels_through_the_patch():
    """fla's own KimiDeltaAttention layer (short convolutions on), forward and backward, with
    kernel_fun.patch_fla enabled: our ops launch (counted in C++) in strict mode, the output and the
    input gradient agree with fla's own layer, and disabling the patch restores fla's functions.

    Two bf16 computations are compared with each other here (not with an fp64 reference), through
    the layer's bf16 gated norm and output projection: the bound is 2x the per-kernel tolerance, as
    in the kernel-level fla parity tests (measured on the H200, 2026-12-01: output 6.5e-3)."""
    fla_layers = pytest.importorskip("fla.layers.kda")
    import kernel_fun
    from helpers import KDA_TOL, rel_rms
    from kernel_fun import _ext, patch_fla

    torch.manual_seed(0)
    layer = fla_layers.KimiDeltaAttention(hidden_size=512, head_dim=128, num_heads=4, layer_idx=0).cuda().bfloat16()
    layer.train()
    x = torch.randn(2, 300, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref = layer(x)[0]
    ref_dx, = torch.autograd.grad(ref.float().square().sum(), x)
    original = fla_layers.chunk_kda
    before = _ext.op_calls()
    with patch_fla.enabled(), kernel_fun.strict():
        out = layer(x)[0]
        dx, = torch.autograd.grad(out.float().square().sum(), x)
    after = _ext.op_calls()
    assert fla_layers.chunk_kda is original
    ran = {k: after[k] - before[k] for k in after}
    assert ran["kda_fwd"] == 1 and ran["kda_bwd"] == 1 and ran["cconv_fwd"] == 3 and ran["cconv_bwd"] == 3, ran
    e_o, e_dx = rel_rms(ref.float(), out.float()), rel_rms(ref_dx.float(), dx.float())
    assert e_o <= 2 * KDA_TOL["o"], (e_o, e_dx)
    assert e_dx <= 2 * KDA_TOL["dq"], (e_o, e_dx)


def test_fla_06_arguments_keep_every_benchmark_case_on_our_kernels():
    """A fla 0.6.0 caller passes use_graph / max_num_seqs (with use_graph, cu_seqlens padded to
    max_num_seqs + 1 entries): is_supported says yes for every KDA case of the benchmark, in the
    training form (inputs requiring grad), with and without use_graph."""
    from kernel_fun.bench.cases import select
    from kernel_fun.bench.run import make_inputs
    from kernel_fun.kda import is_supported
    for case in select("kda"):
        inp = make_inputs(case, torch, "cuda", seed=0)
        for t in inp["leaves"]:
            t.requires_grad_(True)
        kw = dict(inp["kwargs"])
        cu = kw.get("cu_seqlens")
        variants = [{}, dict(use_graph=False, max_num_seqs=None)]  # a 0.5.2 call, 0.6.0's defaults spelled out
        if cu is not None:
            n = cu.numel() - 1
            padded = torch.cat([cu, cu[-1:].expand(3)])  # 3 empty tail sequences: max_num_seqs = n + 3
            variants.append(dict(use_graph=True, max_num_seqs=n + 3, cu_seqlens=padded, cu_seqlens_cpu=None))
        for extra in variants:
            ok, why = is_supported(*inp["sup_args"], **inp["sup_kwargs"], **{**kw, **extra})
            assert ok, f"{case.name} {extra}: {why}"
        del inp
        torch.cuda.empty_cache()


# fla 0.6.0's use_graph: cu_seqlens padded with empty tail sequences to max_num_seqs + 1 entries and
# trusted on the device (never read on the host), so a captured graph replays new documents.
USE_GRAPH_T, USE_GRAPH_MAX = 300, 6
USE_GRAPH_DOCS = {"a": [0, 100, 100, 250, 300, 300, 300],  # 4 documents (one empty) + 2 empty tail slots
                  "b": [0, 1, 64, 64, 200, 300, 300]}      # 5 documents (one token, one empty) + 1


def _use_graph_case():
    from test_kda_fwd_gpu import make_case
    inputs, kw = make_case(T=USE_GRAPH_T, cu=USE_GRAPH_DOCS["a"], h0=True)
    kw = {n: x for n, x in kw.items() if x is not None}
    return inputs, kw, dict(kw, use_graph=True, max_num_seqs=USE_GRAPH_MAX)


def test_kda_use_graph_with_padded_cu_seqlens_runs_our_kernels():
    """chunk_kda(use_graph=True, max_num_seqs, cu_seqlens padded with empty tail sequences) runs our
    forward and backward (counted, strict mode) and gives bitwise the call without use_graph (the same
    kernels: only the host-side validation of cu_seqlens is skipped), within the tolerances of the
    fp64 naive recurrence (outputs and gradients; the empty tail sequences' final states are their
    initial states)."""
    from helpers import KDA_TOL, KDA_VARLEN_TOL, assert_bitwise_same, our_launches, rel_rms
    from kernel_fun.kda import chunk_kda
    from test_kda_bwd_gpu import _do_dht, _grads_naive, _grads_through
    from test_kda_fwd_gpu import reference

    inputs, kw, kw_graph = _use_graph_case()
    with torch.no_grad(), our_launches(kda_fwd=1):
        o_g, ht_g = chunk_kda(*inputs, **kw_graph)
    with torch.no_grad():
        o_p, ht_p = chunk_kda(*inputs, **kw)
    assert_bitwise_same({"o": o_p, "ht": ht_p}, {"o": o_g, "ht": ht_g}, "forward, use_graph vs not")
    o_ref, ht_ref = reference(inputs, kw)
    assert rel_rms(o_ref, o_g) <= KDA_TOL["o"] and rel_rms(ht_ref, ht_g) <= KDA_TOL["ht"]
    assert torch.equal(ht_g[-2:], kw["initial_state"][-2:])  # empty tail sequences pass h0 through

    do, dht = _do_dht(inputs, kw)
    with our_launches(kda_fwd=1, kda_bwd=1):
        ours = _grads_through(chunk_kda, inputs, kw_graph, do, dht)
    plain = _grads_through(chunk_kda, inputs, kw, do, dht)
    assert_bitwise_same(plain, ours, "gradients, use_graph vs not")
    ref = _grads_naive(inputs, kw, do, dht)
    errs = {key: rel_rms(r, ours[key]) for key, r in ref.items() if r is not None and key != "dA_log"}
    tol = dict(KDA_VARLEN_TOL, ddt_bias=KDA_TOL["dbias"])
    assert all(errs[key] <= tol[key] for key in errs), errs


def test_kda_use_graph_capture_replays_new_documents():
    """What use_graph is for: a training step (forward, backward) captured in a CUDA graph with one
    set of documents replays another after only the padded cu_seqlens' contents change, equal bit for
    bit to an eager call (without use_graph) on the new documents."""
    from helpers import our_launches
    from kernel_fun.kda import chunk_kda
    from test_kda_bwd_gpu import _do_dht

    inputs, kw, kw_graph = _use_graph_case()
    static_cu = kw_graph["cu_seqlens"]
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    do, dht = _do_dht(inputs, kw)

    def step(call):
        o, ht = chunk_kda(*leaves, **call)
        loss = (o.float() * do.float()).sum() + (ht * dht).sum()
        return (o, ht) + torch.autograd.grad(loss, leaves)

    # detach: o and ht of an eager step would otherwise keep its autograd graph alive, and with it
    # the leaves' gradient-accumulator nodes, which remember the stream they were made on (here the
    # legacy default stream); capturing the backward then makes the capture stream wait on the legacy
    # stream ("operation would make the legacy stream depend on a capturing blocking stream", H200
    # 2026-12-02, when this line kept o and ht attached).
    first = [t.detach().clone() for t in step(kw_graph)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on a side stream, as torch.cuda.graphs asks
        step(kw_graph)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with our_launches(kda_fwd=1, kda_bwd=1):  # what the graph holds: our forward and backward
        with torch.cuda.graph(graph):
            static = step(kw_graph)
    static_cu.copy_(torch.tensor(USE_GRAPH_DOCS["b"], dtype=static_cu.dtype, device=static_cu.device))
    graph.replay()
    cu_b = torch.tensor(USE_GRAPH_DOCS["b"], dtype=static_cu.dtype, device=static_cu.device)
    eager_b = step(dict(kw, cu_seqlens=cu_b))
    torch.cuda.synchronize()
    names = ["o", "ht", "dq", "dk", "dv", "dg", "dbeta"]
    for name, r, e in zip(names, static, eager_b):
        assert torch.isfinite(r).all() and torch.equal(r, e), f"{name}: replay with new documents != eager"
    assert not torch.equal(static[0], first[0]), "the replay did not follow the new cu_seqlens"
