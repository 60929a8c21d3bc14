"""Time the KDA forward's scan kernel alone per V-slice width: the cost model's pick ("auto") and
each width forced by KERNEL_FUN_KDA_SCAN_BV (64, 128), on the benchmark shapes, and check each
forced width's o and final state against the auto run -- the data to re-tune kda_fwd_scan_bv.

    PYTHONPATH=src python3 scripts/bench_kda_scan.py [--iters 5] [--cases prod8192,b1h16]

Times are the summed CUDA time of kernels named kda_fwd_scan* per call (torch profiler), mean over
--iters calls after 2 warm-ups. A width that raises or disagrees with auto (rel-RMS > 5e-3) is
reported as such, never hides the others."""
from __future__ import annotations

import argparse
import os
import re

import torch
from torch.profiler import ProfilerActivity, profile

CASES = {  # name: (B, T, H, K, V, cu_seqlens or None)
    "prod8192": (16, 8192, 16, 128, 256, None),
    "b16h16v128": (16, 8192, 16, 128, 128, None),
    "b1h16": (1, 8192, 16, 128, 128, None),
    "b1t32768h32": (1, 32768, 32, 128, 128, None),
    "varlen6-h32": (1, 16384, 32, 128, 128, [0, 1000, 4000, 4100, 9000, 12000, 16384]),
    "k64v64": (8, 4096, 16, 64, 64, None),
}
WIDTHS = [None, "64", "128"]  # None: the cost model's pick


def make(B, T, H, K, V, cu):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, T, H, K, device="cuda", generator=gen).bfloat16()
    k = torch.randn(B, T, H, K, device="cuda", generator=gen).bfloat16()
    v = torch.randn(B, T, H, V, device="cuda", generator=gen).bfloat16()
    g = torch.randn(B, T, H, K, device="cuda", generator=gen)
    beta = torch.randn(B, T, H, device="cuda", generator=gen).bfloat16()
    A_log = torch.log(torch.empty(H, device="cuda").uniform_(1, 16, generator=gen))
    dt_bias = 0.5 * torch.randn(H * K, device="cuda", generator=gen)
    from kernel_fun.kda._options import KdaOptions
    opts = KdaOptions(scale=K ** -0.5, gate="unbounded", l2norm=True, beta_sigmoid=1)
    kw = dict(opts=opts, output_final_state=True, A_log=A_log, dt_bias=dt_bias)
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device="cuda")
    return (q, k, v, g, beta), kw


def rel_rms(ref, got):
    ref, got = ref.double(), got.double()
    return ((ref - got).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    from kernel_fun.kda import _kernel

    refs = {}
    for bv in WIDTHS:
        if bv:
            os.environ["KERNEL_FUN_KDA_SCAN_BV"] = bv
        else:
            os.environ.pop("KERNEL_FUN_KDA_SCAN_BV", None)
        label = f"bv{bv}" if bv else "auto"
        for name in args.cases.split(","):
            try:
                inputs, kw = make(*CASES[name])
                for _ in range(2):
                    o, ht, _, _ = _kernel.forward_stages(*inputs, **kw)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(args.iters):
                        o, ht, _, _ = _kernel.forward_stages(*inputs, **kw)
                    torch.cuda.synchronize()
                us = sum(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                         for e in prof.key_averages() if "kda_fwd_scan" in e.key)
                ms = us / args.iters / 1000
                # the width that ran, from the kernel name (kda_fwd_scan_kernel<WT, K, BV>)
                ran = {m.group(1) for e in prof.key_averages()
                       for m in [re.search(r"kda_fwd_scan_kernel<[^,]+, *\d+, *(\d+)>", e.key)] if m}
                if name not in refs:
                    refs[name] = (o.clone(), ht.clone())
                    note = f"reference (ran bv{'/'.join(sorted(ran)) or '?'})"
                else:
                    eo, eh = rel_rms(refs[name][0], o), rel_rms(refs[name][1], ht)
                    bad = not (max(eo, eh) <= 5e-3)
                    note = f"vs auto: o {eo:.1e} ht {eh:.1e}" + ("  MISMATCH" if bad else "")
                print(f"{name:14s} {label:9s} scan {ms:7.3f} ms   {note}", flush=True)
                del inputs, kw, o, ht
            except Exception as exc:  # noqa: BLE001 -- report and go on
                print(f"{name:14s} {label:9s} FAILED: {type(exc).__name__}: {exc}"[:300], flush=True)
            torch.cuda.empty_cache()
    os.environ.pop("KERNEL_FUN_KDA_SCAN_BV", None)

if __name__ == "__main__":
    main()
