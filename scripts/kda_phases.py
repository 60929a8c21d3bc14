"""Where the per-chunk KDA kernels spend their time: clock64() stamps at their phase boundaries
(thread 0 of every CTA, after each phase's barrier), as mean cycles per CTA and per phase, on the
benchmark's cases. Ours only.

    PYTHONPATH=src python3 scripts/kda_phases.py [--kernel grads|intra|both] [CASE ...]   (default: prod8192)

grads: kda_bwd_grads (backward_stages(profile=True)); intra: kda_fwd_intra in the forward
(forward_stages(profile=True)), plus when each warp finishes its own P2 tiles, counted from the
start of P2 (the work split of P2 is uneven by design: the shared qg / kg queue absorbs it). These
per-warp numbers compare clocks read by different warps, which agree only to ~2k cycles on the H200
(a warp's stamp before a barrier read up to 1.8k cycles after thread 0's stamp behind it).
"""
from __future__ import annotations

import argparse
import os

import torch

from kernel_fun.bench.cases import select
from kernel_fun.bench.run import kda_stage_call, make_inputs
from kernel_fun.kda import _kernel

# the phase stamps are per kernel: the two-kernel forward, not the streamed one
os.environ.setdefault("KERNEL_FUN_KDA_FWD_STREAMED", "0")

# (stamp slots in order, the phase each gap is)
GRADS = (range(9), ["P: inputs, gate", "V: contraction loop", "E: WY backward", "I1: off-diag row side",
                    "I1: off-diag column side", "I2+I3: diagonal blocks", "F1: cumsum + gate",
                    "F2-F4: dbeta, l2norm, dq/dk"])
INTRA = (range(7), ["P0+P1: loads, gate, cumsum, l2norm", "block sums", "P2 + qg/kg queue (P4a 1st)",
                    "P3 diagonal || kexp, Aqk, exp2(G)", "P3 merges || w, Akk rows 0-2", "P4b: w, Akk row 3"])
# slot 8 + P2 role (IntraCtx::p2_role, "warp" in kda_fwd_intra.cuh's P2 comments) in the unbounded-gate
# kernel, 8 + physical warp in the bounded one (kMid): when the warp's own P2 products are done
INTRA_WARP_P2 = range(8, 16)


def _print(name, clk, slots, phases):
    slots = list(slots)
    c = clk[:, slots].double()
    valid = c[:, -1] > 0
    c = c[valid]
    total = (c[:, -1] - c[:, 0]).mean().item()
    print(f"{name}: {int(valid.sum())} CTAs, mean {total:.0f} cycles per CTA")
    for ph, cyc in zip(phases, (c[:, 1:] - c[:, :-1]).mean(0).tolist()):
        print(f"  {ph:36s} {cyc:10.0f} cycles  {100 * cyc / total:5.1f}%")
    return valid


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=("grads", "intra", "both"), default="both")
    ap.add_argument("cases", nargs="*")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU")
        return
    for case in select("kda", a.cases or ["prod8192"]):
        inp = make_inputs(case, torch, "cuda", 0)
        (q, k, v, g, beta), common = kda_stage_call(inp)
        if a.kernel in ("intra", "both"):
            for _ in range(2):  # the first run warms up
                ws = _kernel.forward_stages(q, k, v, g, beta, profile=True, **common)[3]
            torch.cuda.synchronize()
            clk = ws["clock"]
            valid = _print(f"{case.name} kda_fwd_intra", clk, *INTRA)
            p2 = clk[valid][:, list(INTRA_WARP_P2)].double() - clk[valid][:, 2:3].double()
            print("  P2 own tiles done, per P2 slot (cycles after P2's start; role, or warp if bounded):",
                  " ".join(f"w{w}:{x:.0f}" for w, x in enumerate(p2.mean(0).tolist())))
            del ws
        if a.kernel in ("grads", "both"):
            do = torch.randn(inp["out_shape"], dtype=torch.bfloat16, device="cuda")
            for _ in range(2):
                _, st = _kernel.backward_stages(q, k, v, g, beta, do, profile=True, **common)
            torch.cuda.synchronize()
            _print(f"{case.name} kda_bwd_grads", st["clock"], *GRADS)
            del st
        del inp
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
