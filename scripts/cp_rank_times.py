"""One GPU's estimate of the context-parallel call's time: each rank's own work, timed alone.

The context-parallel row (kernel_fun.bench.cp, cp2_b1_t128k) needs one GPU per rank, which has not
been lent. What its time is made of can be measured on one GPU: every rank's call of
kernel_fun/kda/_cp.py with the collectives stood in for (the all-gather returns this rank's own map
world times, the all-reduce does nothing), so each rank's kernels run as they would, one rank after
another. The row's time would be the slowest rank's plus the collectives (an all-gather and an
all-reduce of world x HV x K x (V + K) fp32: 8 MiB at long_b1_t128k over 2 ranks) and the ranks'
skew. Printed beside the one-GPU call on the whole sequence; not a bench row.

    python scripts/cp_rank_times.py --case long_b1_t128k --world 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch
import torch.distributed as dist

import kernel_fun
from kernel_fun import _cp
from kernel_fun.bench.cases import select
from kernel_fun.bench.cp import _time as time_step
from kernel_fun.bench.run import make_inputs
from kernel_fun.kda import chunk_kda
from kernel_fun.kda._cp import ENV


def _stand_ins(rank: int, world: int):
    """The collectives of the context-parallel path, for one simulated rank on this process."""
    dist.get_rank = lambda group=None: rank
    dist.all_reduce = lambda t, group=None: None
    _cp.gather = lambda t, group: [t.clone() for _ in range(world)]


def _step(inputs, do, grad: bool, **kw):
    """(step, reset): one call (and its backward), and the leaves' gradients cleared."""
    args, kwargs = inputs["args"], inputs["kwargs"]
    for t in inputs["leaves"]:
        t.requires_grad_(grad)

    def step():
        o = chunk_kda(*args, **kwargs, **kw)[0]
        if grad:
            torch.autograd.backward(o, do)

    def reset():
        for t in inputs["leaves"]:
            t.grad = None

    return step, reset


def _time(inputs, do, grad: bool, device: str, **kw) -> float:
    step, reset = _step(inputs, do, grad, **kw)
    with kernel_fun.strict(), (torch.enable_grad() if grad else torch.no_grad()):
        return time_step(torch, step, device, 2, 5, reset)["ms"]


def _kernel_ms(inputs, do, **kw) -> dict:
    """{kernel: ms} of one training call under torch.profiler (launches serialised: the stages'
    own times, not the call's), the largest first."""
    from torch.profiler import ProfilerActivity, profile

    step, reset = _step(inputs, do, True, **kw)
    reset()
    with kernel_fun.strict(), torch.enable_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    ms = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA":
            name = e.key.split("(")[0].split("<")[0].split("::")[-1].replace("void ", "")[:60]
            ms[name] = ms.get(name, 0.0) + e.device_time_total / 1e3
    return dict(sorted(ms.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="long_b1_t128k")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--T", type=int, default=None, help="the whole sequence's length (default: the case's)")
    ap.add_argument("--device", default="cuda", help="cpu: the plumbing on the reference (wall clock)")
    ap.add_argument("--stages", action="store_true", help="also each rank's kernels' ms (torch.profiler, CUDA)")
    ap.add_argument("--out", default=None, help="also write the numbers as JSON here")
    ap.add_argument("--zero-padded", action="store_true",
                    help="the crossing call over a [v | 0] buffer, o(0) and Q column blocks of one output (the "
                         "form before the kernels' identity columns), for an A/B")
    a = ap.parse_args()
    if a.zero_padded:
        from kernel_fun.kda._cp import CallEngine, KernelEngine
        KernelEngine.run_identity = CallEngine.run_identity
    (case,) = select("kda", [a.case])
    if a.T:
        case = dataclasses.replace(case, T=a.T)
    dev = a.device
    os.environ[ENV] = "1"
    res = {"case": case.name, "world": a.world, "ranks": []}
    whole = make_inputs(case, torch, dev, 0)
    do = torch.randn(whole["out_shape"], dtype=torch.bfloat16, device=dev)
    res["one_gpu"] = {p: _time(whole, do, p == "fwd+bwd", dev) for p in ("fwd", "fwd+bwd")}
    if a.stages and dev == "cuda":
        res["one_gpu"]["kernels_ms"] = _kernel_ms(whole, do)
    del whole, do
    local = dataclasses.replace(case, T=case.T // a.world)
    for r in range(a.world):
        _stand_ins(r, a.world)
        ctx = _cp.local_context([0, case.T], r, a.world, None)
        ctx.cu_seqlens = ctx.cu_seqlens.to(dev)
        inputs = make_inputs(local, torch, dev, r)
        do = torch.randn(inputs["out_shape"], dtype=torch.bfloat16, device=dev)
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = {p: _time(inputs, do, p == "fwd+bwd", dev, cp_context=ctx) for p in ("fwd", "fwd+bwd")}
        times["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else float("nan")
        if a.stages and dev == "cuda":
            times["kernels_ms"] = _kernel_ms(inputs, do, cp_context=ctx)
        res["ranks"].append(times)
        del inputs, do
    print(f"{case.name}: one GPU fwd {res['one_gpu']['fwd']:.2f} ms, fwd+bwd {res['one_gpu']['fwd+bwd']:.2f} ms")
    for name, ms in list(res["one_gpu"].get("kernels_ms", {}).items())[:12]:
        print(f"    {ms:8.3f} ms  {name}")
    for r, t in enumerate(res["ranks"]):
        print(f"  rank {r} of {a.world} alone: fwd {t['fwd']:.2f} ms, fwd+bwd {t['fwd+bwd']:.2f} ms, "
              f"peak {t['peak_gib']:.2f} GiB")
        for name, ms in list(t.get("kernels_ms", {}).items())[:12]:
            print(f"    {ms:8.3f} ms  {name}")
    for p in ("fwd", "fwd+bwd"):
        slowest = max(t[p] for t in res["ranks"])
        print(f"  {p}: slowest rank / one GPU = {slowest / res['one_gpu'][p]:.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
