"""causal_conv1d under fla's cp_context on our front (kernel_fun/cconv/_cp.py), on the CPU: 2-4
processes joined by the gloo backend, each holding its slice of one packed sequence, against one
process running the whole sequence. The exchange around the conv is device-agnostic (all-gathers of
W - 1 rows); underneath runs the CPU reference here and our kernels on CUDA (the same front).

The contexts are made the way fla's build_cp_context makes them (equal slices of total // world
tokens; document 0's tokens on earlier ranks), by helpers.cp_context; with fla importable the test
also checks that fla's own contexts give the same results."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import cp_contexts, join_cp_group, leave_cp_group
from kernel_fun.cconv import causal_conv1d, is_supported


def _inputs(case):
    g = torch.Generator().manual_seed(case["seed"])
    T, D, W = case["cu"][-1], case["D"], case["W"]
    x = torch.randn(1, T, D, generator=g, dtype=torch.float64)
    w = torch.randn(D, W, generator=g, dtype=torch.float64)
    b = torch.randn(D, generator=g, dtype=torch.float64)
    r = torch.randn(1, T, D, generator=g, dtype=torch.float64) if case.get("residual") else None
    dy = torch.randn(1, T, D, generator=g, dtype=torch.float64)
    return x, w, b, r, dy


def _on(t: torch.Tensor, device: str) -> torch.Tensor:
    """float64 on the CPU (the reference); fp32 on CUDA (our kernels take 16- and 32-bit floats)."""
    return t if device == "cpu" else t.to(device=device, dtype=torch.float32)


def _run(x, w, b, r, dy, act, **kw):
    x, w, b = (t.clone().requires_grad_(True) for t in (x, w, b))
    y, ht = causal_conv1d(x, w, b, residual=r, activation=act, **kw)
    assert ht is None
    (y * dy).sum().backward()
    return y.detach(), x.grad, w.grad, b.grad


def _worker(rank, world, path, case, out, device="cpu", shared_gpu=False):
    join_cp_group(rank, world, path, device, "KERNEL_FUN_CCONV_CP", shared_gpu)
    done = False
    try:
        x, w, b, r, dy = (None if t is None else _on(t, device) for t in _inputs(case))
        part = case["cu"][-1] // world
        sl = slice(rank * part, (rank + 1) * part)
        ctxs = cp_contexts(case["cu"], rank, world, dist.group.WORLD, device, case["W"])
        res = []
        for ctx in ctxs:
            ok, why = is_supported(x[:, sl], w, b, r[:, sl] if r is not None else None, activation=case["act"],
                                   cp_context=ctx)
            assert ok or (device == "cpu" and why.startswith("x is on cpu")), why  # CPU: the reference serves it
            res.append([t.cpu() for t in _run(x[:, sl], w, b, r[:, sl] if r is not None else None, dy[:, sl],
                                               case["act"], cp_context=ctx)])
        torch.save(res, f"{out}.{rank}")
        done = True
    finally:
        leave_cp_group(done)


CASES = {
    # documents crossing the rank boundary, one ending inside a slice
    "cross_w4": dict(cu=[0, 5, 37, 64], D=8, W=4, act="silu", seed=1),
    # one long document over four ranks: ranks 1-3 hold only its middle and end
    "long_doc_4ranks": dict(cu=[0, 3, 64], D=8, W=4, act=None, seed=2),
    # a boundary exactly at the rank boundary (rank 1 starts a document: no initial state),
    # one-token documents on both sides of it
    "boundary_at_rank": dict(cu=[0, 31, 32, 33, 64], D=4, W=3, act="silu", seed=3),
    # a residual (fla's context-parallel branch drops it; ours adds it)
    "residual_w2": dict(cu=[0, 20, 48], D=4, W=2, act="swish", residual=True, seed=4),
    # W = 1: nothing to exchange, no collective
    "w1": dict(cu=[0, 10, 30], D=4, W=1, act=None, seed=5),
    # slices of 4 tokens with W = 4: rank 2's document began two ranks back
    "three_ranks_short_slices": dict(cu=[0, 1, 12], D=4, W=4, act="silu", seed=6),
    # rank 1's first document began one token before its slice: 1 of the W - 1 tails is its own
    # (pre_num_conv_tokens = 1), the other two belong to the document before and must not be read
    "one_token_before": dict(cu=[0, 31, 64], D=4, W=4, act="silu", seed=7),
}
WORLD = {"cross_w4": 2, "long_doc_4ranks": 4, "boundary_at_rank": 2, "residual_w2": 2, "w1": 2,
         "three_ranks_short_slices": 3, "one_token_before": 2}


def _check_against_one_process(name, tmp_path, device, tol, shared_gpu=False):
    case, world = CASES[name], WORLD[name]
    out = str(tmp_path / "res")
    mp.spawn(_worker, args=(world, str(tmp_path / "rdzv"), case, out, device, shared_gpu), nprocs=world, join=True)
    x, w, b, r, dy = (None if t is None else _on(t, device) for t in _inputs(case))
    y_ref, dx_ref, dw_ref, db_ref = (t.cpu() for t in _run(
        x, w, b, r, dy, case["act"], cu_seqlens=torch.tensor(case["cu"], dtype=torch.int32, device=device)))
    per_rank = [torch.load(f"{out}.{k}") for k in range(world)]
    part = case["cu"][-1] // world
    for c in range(len(per_rank[0])):  # our context, then fla's where importable
        ys = torch.cat([per_rank[k][c][0] for k in range(world)], dim=1)
        dxs = torch.cat([per_rank[k][c][1] for k in range(world)], dim=1)
        dw = sum(per_rank[k][c][2] for k in range(world))
        db = sum(per_rank[k][c][3] for k in range(world))
        n = world * part
        torch.testing.assert_close(ys, y_ref[:, :n], rtol=tol, atol=tol)
        torch.testing.assert_close(dxs, dx_ref[:, :n], rtol=tol, atol=tol)
        torch.testing.assert_close(dw, dw_ref, rtol=tol, atol=tol)  # per-rank sums added in another order
        torch.testing.assert_close(db, db_ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_conv_equals_one_process(name, tmp_path):
    _check_against_one_process(name, tmp_path, "cpu", 1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cross_w4", "long_doc_4ranks", "one_token_before", "residual_w2"])
def test_context_parallel_conv_on_gpus_equals_one_gpu(name, tmp_path):
    """The same over NCCL, one process per GPU, our kernels underneath (fp32); needs as many GPUs as
    the case has ranks (the 2-GPU machine: nvidia-h200-x2), else skips."""
    if torch.cuda.device_count() < WORLD[name]:
        pytest.skip(f"needs {WORLD[name]} GPUs, this machine has {torch.cuda.device_count()}")
    _check_against_one_process(name, tmp_path, "cuda", 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cross_w4", "long_doc_4ranks", "one_token_before", "residual_w2"])
def test_context_parallel_conv_ranks_on_one_gpu_equal_one_process(name, tmp_path):
    """The same with every rank on GPU 0, joined by gloo over CUDA tensors (our kernels under each
    rank; any GPU machine): the device path of the exchange, not NCCL."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    _check_against_one_process(name, tmp_path, "cuda", 1e-5, shared_gpu=True)


def test_context_parallel_conv_is_opt_in_and_checks_its_arguments(monkeypatch):
    ctx = types.SimpleNamespace(group=None, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32),
                                cu_seqlens_cpu=None, is_first_rank=True, pre_num_conv_tokens=0)
    x, w = torch.randn(1, 8, 4), torch.randn(4, 4)
    monkeypatch.delenv("KERNEL_FUN_CCONV_CP", raising=False)
    with pytest.raises(RuntimeError, match="cp_context is not supported on CPU"):
        causal_conv1d(x, w, cp_context=ctx)  # off by default: the CPU path has no context parallelism
    monkeypatch.setenv("KERNEL_FUN_CCONV_CP", "1")
    with pytest.raises(ValueError, match="initial_state is not allowed with cp_context"):
        causal_conv1d(x, w, initial_state=torch.zeros(1, 4, 4), cp_context=ctx)
    with pytest.raises(ValueError, match="output_final_state is not allowed with cp_context"):
        causal_conv1d(x, w, output_final_state=True, cp_context=ctx)
    with pytest.raises(ValueError, match=r"x must be \[1, T, \.\.\.\] \(3 dimensions\) with cp_context"):
        causal_conv1d(torch.randn(2, 8, 4), w, cp_context=ctx)
    with pytest.raises(ValueError, match="each rank needs at least W - 1 = 3"):
        causal_conv1d(torch.randn(1, 2, 4), w, cp_context=ctx)
    with pytest.raises(ValueError, match="cp_context has no 'pre_num_conv_tokens'"):
        causal_conv1d(x, w, cp_context=types.SimpleNamespace(group=None, cu_seqlens=ctx.cu_seqlens,
                                                             is_first_rank=True))
    ok, why = is_supported(x, w, initial_state=torch.zeros(1, 4, 4), cp_context=ctx)
    assert not ok and "initial_state is not allowed" in why
