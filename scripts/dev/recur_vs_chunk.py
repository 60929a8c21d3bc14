"""Where the fp32 token recurrence (csrc/kda/recur/) pays against the chunk kernels on one-chunk
problems: the forward and a training call (forward + backward) of chunk_kda with
KERNEL_FUN_KDA_RECURRENT=1 and =0, CUDA events, median of 20 after 3 warm-ups, and which way the
default (kda_policy.h's recurrent_default: at most 256 MiB of backward workspace) goes.

    PYTHONPATH=src python3 scripts/dev/recur_vs_chunk.py        (GPU; ~30 s)
"""
from __future__ import annotations

import os
import statistics

import torch
import torch.nn.functional as F

import kernel_fun
from kernel_fun.kda import chunk_kda

SHAPES = [  # B, T, H, K, V
    (1, 64, 2, 128, 64), (1, 64, 16, 128, 128), (2, 32, 16, 128, 128), (4, 64, 16, 128, 128),
    (1, 64, 32, 128, 128), (8, 16, 8, 64, 64), (16, 64, 16, 128, 128),
]


def _time(fn, iters=20, warm=3):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main():
    torch.manual_seed(0)
    print("B T H K V | budget MiB | fwd rec / chunk ms | fwd+bwd rec / chunk ms | default")
    for B, T, H, K, V in SHAPES:
        d = dict(device="cuda", dtype=torch.bfloat16)
        q, k = torch.randn(B, T, H, K, **d), torch.randn(B, T, H, K, **d)
        v = torch.randn(B, T, H, V, **d)
        g = torch.randn(B, T, H, K, **d)
        beta = torch.randn(B, T, H, **d)
        A_log = torch.log(torch.empty(H, device="cuda").uniform_(1, 16))
        dt_bias = 0.5 * torch.randn(H * K, device="cuda")
        h0 = torch.randn(B, H, K, V, device="cuda")
        kw = dict(A_log=A_log, dt_bias=dt_bias, initial_state=h0, output_final_state=True,
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
        leaves = [x.requires_grad_(True) for x in (q, k, v, g, beta)]

        def fwd():
            with torch.no_grad():
                chunk_kda(q, k, v, g, beta, **kw)

        def train():
            o, ht = chunk_kda(*leaves, **kw)
            (o.float().sum() + ht.sum()).backward()

        res = {}
        for mode in ("1", "0"):
            os.environ["KERNEL_FUN_KDA_RECURRENT"] = mode
            with kernel_fun.strict():
                res[mode] = (_time(fwd), _time(train))
        os.environ.pop("KERNEL_FUN_KDA_RECURRENT")
        mib = B * H * (V // 32) * (64 * K * 35 + 64) * 4 / 2**20  # kda_problem.h's recur_slice_floats
        print(f"{B} {T} {H} {K} {V} | {mib:.0f} | {res['1'][0]:.3f} / {res['0'][0]:.3f} | "
              f"{res['1'][1]:.3f} / {res['0'][1]:.3f} | {'recurrence' if mib <= 256 else 'chunk'}", flush=True)


if __name__ == "__main__":
    main()
