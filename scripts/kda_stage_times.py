"""Per-kernel times of the KDA forward and backward on the benchmark's cases (the numbers
docs/kda-forward.md and docs/kda-backward.md quote): each of our kernels' CUDA time per call (torch
profiler, mean of --iters calls after 2 warm-ups), the whole call's median by CUDA events, and the
peak memory above the inputs. Ours; fla is timed by the benchmark. --flashkda adds a line per case
that FlashKDA serves (its forward: bounded gate, K = V = 128, no GVA) with ITS kernels' times, the
same way, when flash_kda is importable: how its forward's time splits between its two kernels.

    PYTHONPATH=src python3 scripts/kda_stage_times.py [--iters 5] [--pass fwd|fwd+bwd|all] [--flashkda] [--fp16] [CASE ...]

--fp16 runs the forward with fp16 q, k, v, g, beta (the bench's are bf16); forward only.
--shape times a shape that is not a bench case, after the named cases (repeatable):
    --shape k64_b4:B=4,T=4096,H=16,HV=16,K=64,V=128,gate=unbounded   (gate: unbounded or bounded)
"""
from __future__ import annotations

import argparse
import os

import torch
from torch.profiler import ProfilerActivity, profile

from kernel_fun.bench.cases import KdaCase, select
from kernel_fun.bench.run import make_inputs, time_calls
from kernel_fun.kda import chunk_kda

# torch.profiler serialises the launches, so the streamed forward (the scan and the intra at once)
# would time its resume path: per-kernel times here are those of the two kernels one after the other.
os.environ.setdefault("KERNEL_FUN_KDA_FWD_STREAMED", "0")


def _report(name: str, what: str, call, iters: int, tag: str) -> None:
    """One line: call()'s CUDA-event median and peak memory, and the CUDA time per call of each kernel
    whose name holds `tag` (profiler, mean of `iters` calls after 2 warm-ups)."""
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    res = time_calls(torch, call, warmup=1, iters=10)
    per = _per_kernel(prof, iters, tag)
    stages = "  ".join(f"{k} {v:.3f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1]))
    print(f"{name:14s} {what:8s} total {res['ms']:7.3f} ms  peak {res['peak_mem_gib']:6.2f} GiB   {stages}",
          flush=True)


def _per_kernel(prof, iters: int, tag: str) -> dict:
    per = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and tag in e.key:
            name = e.key.split("(")[0].split("<")[0].split("::")[-1].replace("void ", "")
            per[name] = per.get(name, 0.0) + e.device_time_total / iters / 1000
    return per


def _shape_case(spec: str) -> KdaCase:
    """An ad-hoc case from NAME:B=..,T=..,H=..,HV=..,K=..,V=..,gate=unbounded|bounded."""
    name, _, fields = spec.partition(":")
    kv = dict(f.split("=", 1) for f in fields.split(",") if f)
    gate = kv.pop("gate", "unbounded")
    if gate not in ("unbounded", "bounded"):
        raise SystemExit(f"--shape {spec!r}: gate must be unbounded or bounded")
    try:
        dims = {k: int(v) for k, v in kv.items()}
    except ValueError:
        raise SystemExit(f"--shape {spec!r}: every field but gate is an integer") from None
    dims.setdefault("HV", dims.get("H", 0))
    unknown = dims.keys() - {"B", "T", "H", "HV", "K", "V"}
    if unknown:
        raise SystemExit(f"--shape {spec!r}: unknown field(s) {sorted(unknown)}")
    missing = {"B", "T", "H", "K", "V"} - dims.keys()
    if missing or not name:
        raise SystemExit(f"--shape {spec!r}: want NAME:B=..,T=..,H=..,K=..,V=.. (missing {sorted(missing)})")
    gate_kw = dict(lower_bound=-5.0, safe_gate=True) if gate == "bounded" else {}
    return KdaCase(name, **dims, **gate_kw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--pass", dest="pass_", choices=("fwd", "fwd+bwd", "all"), default="all")
    ap.add_argument("--flashkda", action="store_true", help="also FlashKDA's kernels, where it serves the case")
    ap.add_argument("--fp16", action="store_true", help="fp16 q, k, v, g, beta; forward only")
    ap.add_argument("--shape", action="append", default=[], metavar="NAME:B=..,T=..,...",
                    help="an ad-hoc shape after the named cases (repeatable)")
    args = ap.parse_args()
    if args.fp16:
        args.pass_ = "fwd"
    extra = [_shape_case(s) for s in args.shape]
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to time")
        return
    passes = ("fwd", "fwd+bwd") if args.pass_ == "all" else (args.pass_,)
    named = select("kda", args.cases or None) if args.cases or not extra else []
    for case in [c for c in named if isinstance(c, KdaCase)] + extra:
        inp = make_inputs(case, torch, "cuda", 0)
        if args.fp16:
            inp["args"] = tuple(x.detach().half() for x in inp["args"])
        for pass_ in passes:
            grad = pass_ == "fwd+bwd"
            for t in inp["leaves"]:
                t.requires_grad_(grad)
            do = torch.randn(inp["out_shape"], dtype=torch.bfloat16, device="cuda") if grad else None

            def call():
                o = chunk_kda(*inp["args"], **inp["kwargs"])[0]
                if grad:
                    torch.autograd.backward(o, do)
                    for t in inp["leaves"]:
                        t.grad = None

            with torch.set_grad_enabled(grad):
                _report(case.name + (" fp16" if args.fp16 else ""), pass_, call, args.iters, "kda_")
            del do
        if args.flashkda:
            _flashkda_line(case, inp, args.iters)
        del inp
        torch.cuda.empty_cache()


def _flashkda_line(case, inp, iters: int) -> None:
    """FlashKDA's forward on the same inputs (kernel_fun.bench.run's mapping), its kernels' times."""
    from kernel_fun.bench.run import flashkda_step, flashkda_supports, load_flashkda

    if not flashkda_supports(case, "fwd"):
        return
    fwd, why = load_flashkda()
    if fwd is None:
        print(f"{case.name:14s} flashkda skipped: {why}", flush=True)
        return
    with torch.no_grad():
        _report(case.name, "flashkda", flashkda_step(fwd, inp, torch), iters, "flash_kda")


if __name__ == "__main__":
    main()
