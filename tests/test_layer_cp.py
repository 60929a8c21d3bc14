"""A KDA layer's token mixing (the short convolutions of q, k and v with SiLU, then chunk_kda with the
gate, beta sigmoid and l2norm in the kernel) under fla's cp_context, every call on our front with one
context object: 2-3 processes each holding its slice of one packed sequence, against one process on
the whole sequence (o and every gradient: the conv inputs and weights, g, beta, A_log, dt_bias).

This is the composition issue 21 asks to run wholly on our kernels: the conv's exchange of W - 1
tails and KDA's exchange of state maps, in one backward graph, with the same context (ours, and
fla's build_cp_context where fla is importable, made once with the conv's kernel size). On the CPU
the references run underneath (gloo); on a GPU every rank shares GPU 0 (gloo over CUDA tensors) and
runs in strict mode with our launches counted, so neither half can fall back to fla."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import assert_ranks_equal_one_process, cp_contexts, join_cp_group, leave_cp_group
from kernel_fun.cconv import causal_conv1d
from kernel_fun.kda import chunk_kda

LEAVES = ("xq", "xk", "xv", "wq", "wk", "wv", "g", "beta", "A_log", "dt_bias")
PER_RANK = ("wq", "wk", "wv", "A_log", "dt_bias")  # not per token: the ranks' gradients add up

CASES = {
    # documents across the rank boundary and one ending inside each slice; W = 4
    "cross": (dict(cu=[0, 13, 70, 96], H=2, K=16, V=16, W=4, seed=1, weak=True), 2),
    # one document over three ranks: the middle rank's conv tails and its KDA map both pass on
    "one_doc_three_ranks": (dict(cu=[0, 96], H=1, K=16, V=32, W=3, seed=2, weak=True), 3),
}


def _inputs(case, device):
    gen = torch.Generator().manual_seed(case["seed"])
    T, H, K, V, W = case["cu"][-1], case["H"], case["K"], case["V"], case["W"]
    t = {
        "xq": torch.randn(1, T, H * K, generator=gen), "xk": torch.randn(1, T, H * K, generator=gen),
        "xv": torch.randn(1, T, H * V, generator=gen),
        "wq": torch.randn(H * K, W, generator=gen) / W, "wk": torch.randn(H * K, W, generator=gen) / W,
        "wv": torch.randn(H * V, W, generator=gen) / W,
        "g": torch.randn(1, T, H, K, generator=gen), "beta": torch.randn(1, T, H, generator=gen),
        # weak decays: the state, and so each rank's map, outlives a slice
        "A_log": torch.log(torch.empty(H).uniform_(1, 8, generator=gen) * (0.003 if case.get("weak") else 1.0)),
        "dt_bias": 0.5 * torch.randn(H * K, generator=gen),
        "do": torch.randn(1, T, H, V, generator=gen),
    }
    lowp = torch.float64 if device == "cpu" else torch.bfloat16
    return {n: x.to(device=device, dtype=lowp if n not in ("A_log", "dt_bias", "g") else
                    (torch.float64 if device == "cpu" else torch.float32)) for n, x in t.items()}


def _layer(t, H, K, V, **ctx_kw):
    """The token mixing of a KDA layer: q, k, v through their short convolutions (SiLU), then
    chunk_kda. ctx_kw is cp_context=... or cu_seqlens=..., passed to every call alike."""
    T = t["xq"].shape[1]
    q = causal_conv1d(t["xq"], t["wq"], activation="silu", **ctx_kw)[0].view(1, T, H, K)
    k = causal_conv1d(t["xk"], t["wk"], activation="silu", **ctx_kw)[0].view(1, T, H, K)
    v = causal_conv1d(t["xv"], t["wv"], activation="silu", **ctx_kw)[0].view(1, T, H, V)
    o, ht = chunk_kda(q, k, v, t["g"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                      use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                      **ctx_kw)
    assert ht is None
    return o


def _run(t, sl, case, **ctx_kw):
    leaves = {n: (t[n][:, sl] if n not in PER_RANK else t[n]).clone().requires_grad_(True) for n in LEAVES}
    o = _layer(leaves, case["H"], case["K"], case["V"], **ctx_kw)
    (o.float() * t["do"][:, sl].float()).sum().backward()
    return [o.detach().cpu()] + [leaves[n].grad.cpu() for n in LEAVES]


def _worker(rank, world, path, case, out, device, shared_gpu=False):
    join_cp_group(rank, world, path, device, "KERNEL_FUN_KDA_CP", shared_gpu)
    os.environ["KERNEL_FUN_CCONV_CP"] = "1"
    done = False
    try:
        t = _inputs(case, device)
        part = case["cu"][-1] // world
        sl = slice(rank * part, (rank + 1) * part)
        ctxs = cp_contexts(case["cu"], rank, world, dist.group.WORLD, device, case["W"])
        if device == "cuda":  # our kernels under both halves: strict mode, launches counted
            import kernel_fun
            from kernel_fun.check import count_kernel_ops

            with kernel_fun.strict(), count_kernel_ops() as counts:
                res = [_run(t, sl, case, cp_context=c) for c in ctxs]
            n = len(ctxs)
            assert counts["cconv_fwd"] == 3 * n and counts["cconv_bwd"] == 3 * n, dict(counts)
            assert counts["kda_fwd"] >= n and counts["kda_bwd"] == counts["kda_fwd"], dict(counts)
        else:
            res = [_run(t, sl, case, cp_context=c) for c in ctxs]
        torch.save(res, f"{out}.{rank}")
        done = True
    finally:
        leave_cp_group(done)


def _check(name, tmp_path, device, tol, shared_gpu=False):
    case, world = CASES[name]
    if device == "cuda":  # K = V = 128 (bf16): our kernels' shapes
        case = dict(case, K=128, V=128)
    out = str(tmp_path / "res")
    mp.spawn(_worker, args=(world, str(tmp_path / "rdzv"), case, out, device, shared_gpu), nprocs=world, join=True)
    t = _inputs(case, device)
    ref = _run(t, slice(None), case, cu_seqlens=torch.tensor(case["cu"], dtype=torch.int32, device=device))
    per_rank = [torch.load(f"{out}.{k}") for k in range(world)]
    assert_ranks_equal_one_process(per_rank, ref, ("o",) + LEAVES, PER_RANK, tol)


@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_layer_equals_one_process(name, tmp_path):
    _check(name, tmp_path, "cpu", 1e-6)  # fp32 states and maps (fla's contract) over fp64 inputs


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_layer_ranks_on_one_gpu_equal_one_process(name, tmp_path):
    """The same with every rank on GPU 0, joined by gloo over CUDA tensors, our kernels underneath
    (bf16, K = V = 128; the tolerance is bf16's: the slices chunk the documents differently)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    _check(name, tmp_path, "cuda", 3e-2, shared_gpu=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_layer_on_gpus_equals_one_gpu(name, tmp_path):
    """Over NCCL, one process per GPU (the multi-GPU machine); skips where there are fewer GPUs."""
    world = CASES[name][1]
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    _check(name, tmp_path, "cuda", 3e-2)
