"""Where kda_bwd_grads spends its time: clock64() stamps at its phase boundaries (thread 0 of every
CTA), as mean cycles per CTA and per phase, on the benchmark's cases. Ours only.

    PYTHONPATH=src python3 scripts/kda_bwd_phases.py [CASE ...]   (default: prod8192)
"""
from __future__ import annotations

import sys

import torch

from kernel_fun.bench.cases import select
from kernel_fun.bench.run import make_inputs
from kernel_fun.kda import _kernel
from kernel_fun.kda._options import KdaOptions

PHASES = ["P: inputs, gate", "V: contraction loop", "E: WY backward", "I1: off-diag row side",
          "I1: off-diag column side", "I2+I3: diagonal blocks", "F1: cumsum + gate", "F2-F4: dbeta, l2norm, dq/dk"]


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA GPU")
        return
    for case in select("kda", sys.argv[1:] or ["prod8192"]):
        inp = make_inputs(case, torch, "cuda", 0)
        q, k, v, g, beta = inp["args"]
        kw = inp["kwargs"]
        opts = KdaOptions.from_call(scale=q.shape[-1] ** -0.5, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                    use_beta_sigmoid_in_kernel=True, allow_neg_eigval=False,
                                    lower_bound=kw.get("lower_bound"), A_log=kw["A_log"], state_v_first=False,
                                    chunk_size=64)
        do = torch.randn(inp["out_shape"], dtype=torch.bfloat16, device="cuda")
        for _ in range(2):
            _, st = _kernel.backward_stages(q, k, v, g, beta, do, opts=opts, cu_seqlens=kw.get("cu_seqlens"),
                                            A_log=kw["A_log"], dt_bias=kw["dt_bias"], profile=True)
        torch.cuda.synchronize()
        clk = st["clock"][:, :9].double()
        valid = clk[:, 8] > 0
        d = (clk[valid, 1:] - clk[valid, :-1]).mean(0)
        total = (clk[valid, 8] - clk[valid, 0]).mean().item()
        print(f"{case.name}: {int(valid.sum())} CTAs, mean {total:.0f} cycles per CTA")
        for name, c in zip(PHASES, d.tolist()):
            print(f"  {name:30s} {c:10.0f} cycles  {100 * c / total:5.1f}%")
        del inp, st
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
