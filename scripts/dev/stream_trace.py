"""Where the streamed forward loses time: a per-CTA timeline of kda_fwd_intra and a per-step one of
kda_fwd_scan, from a build with scripts/dev/experiments/stream-trace.patch (globaltimer and %smid
stamps written into the forward stages' profile buffer), both orders of the two kernels.

    bash scripts/ab_prepare.sh ab_trace=HEAD+scripts/dev/experiments/stream-trace.patch   # here, ~3 min
    # device call, carry [".whl", "ab_trace"]:
    KF_TESTS=none KF_PROBE='bash scripts/use_prebuilt.sh ab_trace | tail -1; \
      PYTHONPATH=$PWD/ab_trace/src:$PYTHONPATH python3 scripts/dev/stream_trace.py long_b1_t32k bounded_b1' \
      bash scripts/gpu_run.sh

Per case and order (KERNEL_FUN_KDA_FWD_STREAMED 1, then 0) it prints:
- intra: CTAs, the span from the first start to the last end, the mean CTA time, how many SMs ran
  intra CTAs and how many CTAs were resident on them on average (sum of CTA times / (SMs x span));
  the mean gap on an SM between one CTA's end and the next one's start there;
- scan: per chunk step of a chain (thread 0's stamps) the mean step time and the part spent
  before the step's barrier (its data and, streamed, its flag), for the steps while intra CTAs were
  still running and for those after.
The streamed forward's CTAs at two per SM on the SMs the scan leaves, ~24 us each alone, predict
its time; where the measured one is longer, these numbers say which side waits.
"""
from __future__ import annotations

import argparse
import os

import torch

from kernel_fun.bench.cases import select
from kernel_fun.bench.run import kda_stage_call, make_inputs
from kernel_fun.kda import _kernel


def _trace(case, streamed: str):
    os.environ["KERNEL_FUN_KDA_FWD_STREAMED"] = streamed
    (q, k, v, g, beta), common = kda_stage_call(make_inputs(case, torch, "cuda", 0))
    for _ in range(3):  # the first runs warm up; the last one's stamps are read
        ws = _kernel.forward_stages(q, k, v, g, beta, profile=True, **common)[3]
    torch.cuda.synchronize()
    B, T, HV, V = q.shape[0], q.shape[1], v.shape[2], v.shape[3]
    chunks = B * -(-T // 64)
    raw = ws["clock"].reshape(-1).cpu()
    off = chunks * HV * 16
    intra = raw[off:off + chunks * HV * 4].view(-1, 4)
    chains = B * HV * (V // 64)
    scan = raw[off + chunks * HV * 4:off + chunks * HV * 4 + chains * chunks * 2].view(chains, chunks, 2)
    if int(intra[:, 0].min()) == 0:
        raise SystemExit("no trace stamps: run with a build of scripts/dev/experiments/stream-trace.patch")
    return intra, scan


def _report(name: str, intra: torch.Tensor, scan: torch.Tensor) -> None:
    t0 = int(min(intra[:, 0].min(), scan[scan[:, 0, 0] > 0][:, 0, 0].min()))
    st, en, sm = (intra[:, 0] - t0).double() / 1e3, (intra[:, 1] - t0).double() / 1e3, intra[:, 2]
    dur = en - st
    span = float(en.max() - st.min())
    sms = sorted(set(sm.tolist()))
    resident = float(dur.sum()) / (len(sms) * span)
    gaps = []
    for s in sms:  # per SM: next start minus the earliest end still open (two slots per SM)
        idx = (sm == s).nonzero().flatten()
        order = st[idx].argsort()
        s_st, s_en = st[idx][order], en[idx][order]
        for i in range(2, len(order)):
            gaps.append(float(s_st[i] - torch.sort(s_en[:i]).values[i - 2]))
    gap = sum(gaps) / len(gaps) if gaps else float("nan")
    intra_end = float(en.max())
    print(f"{name}: intra {len(dur)} CTAs from {float(st.min()):.1f} to {intra_end:.1f} us, "
          f"mean {float(dur.mean()):.2f} us per CTA (median {float(dur.median()):.2f}), on {len(sms)} SMs, "
          f"{resident:.2f} resident per SM on average, mean slot gap {gap:.2f} us")
    live = scan[(scan[:, :, 0] > 0).any(1)]  # (a sum of ns stamps overflows int64)
    a = (live[:, :, 0] - t0).double() / 1e3
    b = (live[:, :, 1] - t0).double() / 1e3
    step = a[:, 1:] - a[:, :-1]
    before = b[:, :-1] - a[:, :-1]
    during = a[:, :-1] < intra_end
    for label, m in (("while the intra runs", during), ("after it", ~during)):
        if bool(m.any()):
            print(f"  scan steps {label}: {int(m.sum())}, mean {float(step[m].mean()):.2f} us, "
                  f"of which before the barrier {float(before[m].mean()):.2f} us")
    print(f"  scan: {live.shape[0]} chains, first step at {float(a[:, 0].min()):.1f} us, "
          f"last barrier at {float(b[:, -1].max()):.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU")
        return
    for case in select("kda", a.cases or ["long_b1_t32k"]):
        for streamed in ("1", "0"):
            intra, scan = _trace(case, streamed)
            _report(f"{case.name} streamed={streamed}", intra, scan)


if __name__ == "__main__":
    main()
