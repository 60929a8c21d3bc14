"""Context-parallel benchmark rows: chunk_kda over fla's ``cp_context`` on N GPUs, ours and fla's.

One process per GPU (torchrun). Every rank holds T / N tokens of the one document of a KdaCase
(B = 1, no packed documents: the case ``long_b1_t128k`` makes the row ``cp2_b1_t128k`` on two GPUs)
and runs the forward, or the training call (forward + backward), with the context. Per rank:
CUDA-event medians over ``iters`` calls (the collectives inside keep the ranks in step) and the
peak memory above the inputs, as the one-GPU benchmark measures them (``run.time_calls``). A row's
ms is the slowest rank's median, its peak_mem_gib the largest rank's; the note lists every rank.
Rank 0 writes the rows to ``<out>/<gpu>-cp.json``; merge them into the results with
``python -m kernel_fun.bench --merge bench/results/h200.json <out>/h200-cp.json --out bench/results``.

    torchrun --nproc_per_node=2 -m kernel_fun.bench.cp --case long_b1_t128k --out /tmp/cp

Ours runs with ``KERNEL_FUN_KDA_CP=1`` in strict mode, so a call our front would hand to fla is an
error row, never fla timed under our name. fla's row uses fla's own context parallel and
``build_cp_context``; it is ``not_run`` where fla is not importable. Our row takes the same context
object (fla's, or ``kernel_fun._cp.local_context`` without fla). ``--device cpu`` runs the same
plumbing over gloo on the CPU (the torch reference underneath, wall-clock timing): for the tests,
not for numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import statistics
import time

from kernel_fun.bench.cases import CASE_NAMES, KdaCase, select

IMPLS = ("kernel_fun", "fla")


def row_case(case: KdaCase, world: int) -> str:
    """long_b1_t128k on 2 ranks -> cp2_b1_t128k."""
    return f"cp{world}_{case.name.removeprefix('long_')}"


def check_case(case: KdaCase, world: int) -> None:
    if case.B != 1 or case.doc_lens is not None:
        raise ValueError(f"{case.name}: the context-parallel rows split one document (B = 1, no doc_lens)")
    if case.T % world:
        raise ValueError(f"{case.name}: T={case.T} is not a multiple of the {world} ranks")


def _time(torch, step, device: str, warmup: int, iters: int, before_each) -> dict:
    if device == "cuda":
        from kernel_fun.bench.run import time_calls

        return time_calls(torch, step, warmup=warmup, iters=iters, before_each=before_each)
    ts = []
    for i in range(warmup + iters):
        before_each()
        t0 = time.perf_counter()
        step()
        if i >= warmup:
            ts.append(1e3 * (time.perf_counter() - t0))
    return {"ms": statistics.median(ts), "ms_min": min(ts), "ms_max": max(ts), "peak_mem_gib": None}


def _impl(name: str, case: KdaCase, group, device: str):
    """(chunk_kda, its cp_context) of one implementation, or (None, reason)."""
    import torch

    cu = [0, case.T]
    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    try:
        from fla.ops.cp import build_cp_context
    except ImportError as e:
        build_cp_context = None
        no_fla = f"fla is not importable ({e})"
    if build_cp_context is not None and device == "cuda":
        cu_cpu = torch.tensor(cu, dtype=torch.int32)
        ctx = build_cp_context(cu_cpu.to(device), group, cu_seqlens_cpu=cu_cpu)
    else:
        from kernel_fun._cp import local_context

        ctx = local_context(cu, rank, world, group)
        ctx.cu_seqlens = ctx.cu_seqlens.to(device)
    if name == "kernel_fun":
        from kernel_fun.kda import chunk_kda

        return chunk_kda, ctx
    if build_cp_context is None:
        return None, no_fla
    if device != "cuda":
        return None, "fla runs on CUDA only"
    from fla.ops.kda import chunk_kda as fla_kda

    return fla_kda, ctx


def run_rank(case: KdaCase, *, passes=("fwd", "fwd+bwd"), impls=IMPLS, iters: int = 10, warmup: int = 3,
             device: str = "cuda", seed: int = 0) -> list[dict] | None:
    """This rank's part of the rows; rank 0 returns the rows, the others None. Call it on every rank
    of the default process group, with the same arguments."""
    import torch
    import torch.distributed as dist

    import kernel_fun
    from kernel_fun.bench.run import _short, make_inputs
    from kernel_fun.kda._cp import ENV

    world, rank = dist.get_world_size(), dist.get_rank()
    check_case(case, world)
    local = dataclasses.replace(case, T=case.T // world)
    inputs = make_inputs(local, torch, device, seed + rank)
    args, kwargs = inputs["args"], dict(inputs["kwargs"])
    do = torch.randn(inputs["out_shape"], dtype=args[2].dtype, device=device)
    os.environ[ENV] = "1"  # our context-parallel path is opt-in
    mine = []
    for impl in impls:
        fn, ctx = _impl(impl, case, dist.group.WORLD, device)
        for pass_ in passes:
            res = {"impl": impl, "pass": pass_}
            if fn is None:
                res["not_run"] = ctx
                mine.append(res)
                continue
            grad = pass_ == "fwd+bwd"
            for t in inputs["leaves"]:
                t.requires_grad_(grad)

            def step():
                out = fn(*args, **kwargs, cp_context=ctx)[0]
                if grad:
                    torch.autograd.backward(out, do)

            def reset():
                for t in inputs["leaves"]:
                    t.grad = None

            try:
                guard = kernel_fun.strict() if impl == "kernel_fun" else contextlib.nullcontext()
                with guard, (torch.enable_grad() if grad else torch.no_grad()):
                    res.update(_time(torch, step, device, warmup, iters, reset))
            except Exception as e:  # noqa: BLE001 - a failing implementation is a row, not a crash
                res["error"] = _short(e)
            mine.append(res)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    return _rows(case, world, everyone, iters, warmup, device) if rank == 0 else None


def _rows(case: KdaCase, world: int, per_rank: list[list[dict]], iters: int, warmup: int, device: str) -> list[dict]:
    from kernel_fun.bench.report import new_row, speedup

    rows = []
    for i, first in enumerate(per_rank[0]):
        results = [r[i] for r in per_rank]
        row = new_row(family="kda", case=row_case(case, world), impl=first["impl"], iters=iters, warmup=warmup,
                      shape=dict(case.shape(), ranks=world, tokens_per_rank=case.T // world),
                      params=dict(case.params(), cp_context="one document over all ranks"),
                      date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), **{"pass": first["pass"]})
        errors = [f"rank {k}: {r['error']}" for k, r in enumerate(results) if "error" in r]
        if "not_run" in first:
            row.update(status="not_run", note=first["not_run"])
        elif errors:
            row.update(status="error", note="; ".join(errors))
        else:
            peaks = [r.get("peak_mem_gib") for r in results]
            row.update(status="ok", ms=max(r["ms"] for r in results), ms_min=min(r["ms_min"] for r in results),
                       ms_max=max(r["ms_max"] for r in results),
                       peak_mem_gib=None if None in peaks else max(peaks),
                       note="per rank: " + ", ".join(
                           f"{r['ms']:.3f} ms" + ("" if r.get("peak_mem_gib") is None else f" {r['peak_mem_gib']:.2f} GiB")
                           for r in results) + ("" if device == "cuda" else f" (device {device}: wall clock)"))
        rows.append(row)
    by = {(r["pass"], r["impl"]): r for r in rows}
    for r in rows:
        if r["impl"] == "kernel_fun":
            r["speedup_vs_fla"] = speedup(r, by.get((r["pass"], "fla")))
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchrun --nproc_per_node=N -m kernel_fun.bench.cp",
                                description="Context-parallel chunk_kda rows, ours and fla's, one process per GPU.")
    p.add_argument("--case", default="long_b1_t128k", choices=[n for n in CASE_NAMES if n.startswith("long_")])
    p.add_argument("--pass", dest="pass_", choices=("fwd", "fwd+bwd", "all"), default="all")
    p.add_argument("--no-fla", action="store_true", help="our rows only")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", default="bench/results")
    return p


def main(argv=None) -> int:
    import torch
    import torch.distributed as dist

    from kernel_fun.bench.report import gpu_slug, write_json

    args = _parser().parse_args(argv)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    done = False
    try:
        (case,) = select("kda", [args.case])
        passes = ("fwd", "fwd+bwd") if args.pass_ == "all" else (args.pass_,)
        impls = ("kernel_fun",) if args.no_fla else IMPLS
        rows = run_rank(case, passes=passes, impls=impls, iters=args.iters, warmup=args.warmup, device=args.device)
        if rows is not None:
            name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
            import kernel_fun

            for r in rows:
                r.update(gpu=gpu_slug(name), device_name=name, versions=kernel_fun.versions())
            path = write_json(rows, os.path.join(args.out, f"{gpu_slug(name)}-cp.json"))
            for r in rows:
                print(f"{r['case']:16s} {r['pass']:8s} {r['impl']:11s} {r['status']:8s} "
                      f"{'' if r['ms'] is None else format(r['ms'], '.3f') + ' ms':>12s}  {r['note'] or ''}")
            print(f"wrote {path}")
        done = True
    finally:
        # Free garbage cycles that may still reference the process group, and leave together when
        # every rank got here (not after an error: the others may be inside a collective): a group
        # first freed by the interpreter's shutdown can abort the process from gloo's threads.
        gc.collect()
        if done:
            dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
