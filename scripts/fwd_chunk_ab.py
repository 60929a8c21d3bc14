"""The forward without autograd at 64 and at 32 tokens per chunk, and as the launch policy picks
(kda_policy.h's fwd_short_chunks_pay), on the benchmark's cases, in one process: for each case the
modes take turns over --rounds rounds (CUDA-event medians of --iters calls, L2 flushed before each),
and each mode's best-round median is kept. Which chunk size the policy ran is read from the op
counters (kda_fwd_c32). The numbers behind the policy: docs/notes/2026-12-05-short-chunk-policy.md.

    PYTHONPATH=src python3 scripts/fwd_chunk_ab.py [--rounds 3] [--iters 20] [--fp16] [--out FILE.json] [CASE ...]

--fp16 runs the cases with fp16 q, k, v, g, beta (the bench's are bf16).
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from kernel_fun.check import count_kernel_ops
from kernel_fun.bench.cases import KdaCase, select
from kernel_fun.bench.run import make_inputs, time_calls
from kernel_fun.kda import chunk_kda

CASES = ["bounded_b16", "bounded_b8_h32", "prod8192", "k3_h32", "gva", "small", "varlen", "bounded_b1",
         "long_b1_t32k", "long_b1_t32k_h8"]
# mode -> the environment it runs under (None: unset, the policy)
MODES = {
    "64": {"KERNEL_FUN_KDA_FWD_CHUNK": "64"},
    "32": {"KERNEL_FUN_KDA_FWD_CHUNK": "32"},
    "policy": {"KERNEL_FUN_KDA_FWD_CHUNK": None},
    "64-unstreamed": {"KERNEL_FUN_KDA_FWD_CHUNK": "64", "KERNEL_FUN_KDA_FWD_STREAMED": "0",
                      "KERNEL_FUN_KDA_SPLIT": "0"},
    "32-unstreamed": {"KERNEL_FUN_KDA_FWD_CHUNK": "32", "KERNEL_FUN_KDA_FWD_STREAMED": "0",
                      "KERNEL_FUN_KDA_SPLIT": "0"},
}
KNOBS = ("KERNEL_FUN_KDA_FWD_CHUNK", "KERNEL_FUN_KDA_FWD_STREAMED", "KERNEL_FUN_KDA_SPLIT")


def _set(env: dict) -> None:
    for name in KNOBS:
        os.environ.pop(name, None)
    for name, value in env.items():
        if value is not None:
            os.environ[name] = value


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--fp16", action="store_true", help="fp16 inputs instead of the bench's bf16")
    ap.add_argument("--out", default=None)
    ap.add_argument("--mem", action="store_true",
                    help="also each mode's peak allocated memory over one call, beyond the inputs (MiB)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fwd_chunk_ab.py needs a GPU")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    names = args.cases or CASES
    rows = []
    print(f"{torch.cuda.get_device_name()}  ({torch.cuda.get_device_properties(0).multi_processor_count} SMs)")
    print(f"{'case':16s} " + " ".join(f"{m:>14s}" for m in MODES) + "   policy ran   32/64")
    for case in select("kda", names):
        if not isinstance(case, KdaCase):
            continue
        inputs = make_inputs(case, torch, "cuda", 0)
        call_args, call_kw = inputs["args"], dict(inputs["kwargs"])
        if args.fp16:
            call_args = tuple(x.half() for x in call_args)

        def step():
            with torch.no_grad():
                chunk_kda(*call_args, **call_kw)

        best = {m: float("inf") for m in MODES}
        peak = {}
        ran = None
        if args.mem:
            for mode, env in MODES.items():
                _set(env)
                step()
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                peak[mode] = (torch.cuda.max_memory_allocated() - base) / 2**20
        for _ in range(args.rounds):
            for mode, env in MODES.items():
                _set(env)
                with count_kernel_ops() as counts:
                    res = time_calls(torch, step, warmup=3, iters=args.iters, flush=flush)
                if mode == "policy":
                    ran = 32 if counts["kda_fwd_c32"] else 64
                best[mode] = min(best[mode], res["ms"])
        _set({})
        row = {"case": case.name, "dtype": "fp16" if args.fp16 else "bf16", "ms": best, "policy_chunk": ran,
               "device": torch.cuda.get_device_name()}
        if peak:
            row["peak_mib"] = peak
        rows.append(row)
        print(f"{case.name + (' fp16' if args.fp16 else ''):16s} " + " ".join(f"{best[m]:14.3f}" for m in MODES) +
              f"   {ran:>10d}   {best['32'] / best['64']:.3f}", flush=True)
        if peak:
            print(f"{'  peak MiB':16s} " + " ".join(f"{peak[m]:14.1f}" for m in MODES), flush=True)
        del inputs, call_args, call_kw
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
