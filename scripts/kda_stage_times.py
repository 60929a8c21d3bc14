"""Per-kernel times of the KDA forward on the benchmark's cases (the numbers docs/kda-forward.md
quotes): each of our kernels' CUDA time per call (torch profiler, mean of --iters calls after 2
warm-ups) and the whole call's median by CUDA events. Ours only; fla is timed by the benchmark.

    PYTHONPATH=src python3 scripts/kda_stage_times.py [--iters 5] [CASE ...]   (default: every KDA case)
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from kernel_fun.bench.cases import KdaCase, select
from kernel_fun.bench.run import make_inputs, time_calls
from kernel_fun.kda import chunk_kda


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to time")
        return
    for case in [c for c in select("kda", args.cases or None) if isinstance(c, KdaCase)]:
        inp = make_inputs(case, torch, "cuda", 0)

        def call():
            return chunk_kda(*inp["args"], **inp["kwargs"])

        with torch.no_grad():
            for _ in range(2):
                call()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.iters):
                    call()
                torch.cuda.synchronize()
            total = time_calls(torch, call, warmup=1, iters=10)["ms"]
        per = {}
        for e in prof.key_averages():
            if e.device_type.name == "CUDA" and "kda_fwd" in e.key:
                name = e.key.split("(")[0].split("<")[0].split("::")[-1].replace("void ", "")
                per[name] = per.get(name, 0.0) + e.device_time_total / args.iters / 1000
        stages = "  ".join(f"{k} {v:.3f}" for k, v in sorted(per.items()))
        print(f"{case.name:14s} total {total:7.3f} ms   {stages}", flush=True)
        del inp
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
