"""Split an ncu per-instruction export (scripts/ncu_kda.sh's ncu_<kernel>_sass.csv.gz) at the phase
stamps of kda_bwd_grads (each `CS2R ... SR_CLOCKLO` of KF_GRADS_PHASE starts a new segment) and print,
per segment: warp instructions executed per CTA, the share of the stall samples, the top stall
reasons and the most executed opcodes. No GPU needed.

    python3 scripts/ncu_phases.py ncu_kda_bwd_grads_sass.csv.gz [--ctas N] [--top K]

--ctas: the launch's CTA count (default: the executions of the kernel's first instruction / warps
per CTA, which --warps gives; 16 for kda_bwd_grads). A kernel without stamps is one segment.
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv_gz")
    ap.add_argument("--ctas", type=int, default=0)
    ap.add_argument("--warps", type=int, default=16)
    ap.add_argument("--top", type=int, default=5)
    a = ap.parse_args()
    rows = list(csv.reader(gzip.open(a.csv_gz, "rt")))
    hdr, data = rows[1], rows[2:]
    ix = {h: i for i, h in enumerate(hdr)}
    stalls = [h for h in hdr if h.startswith("stall_") and "(Not Issued)" not in h]
    ctas = a.ctas or int(data[0][ix["Instructions Executed"]]) // a.warps
    seg, executed, samples = 0, collections.Counter(), collections.Counter()
    why, ops = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
    for r in data:
        src = r[ix["Source"]].strip()
        if "SR_CLOCKLO" in src:
            seg += 1
        e = int(r[ix["Instructions Executed"]] or 0)
        executed[seg] += e
        samples[seg] += int(r[ix["Warp Stall Sampling (All Samples)"]] or 0)
        words = src.split()
        op = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "?")
        ops[seg][op.split(".")[0]] += e
        for h in stalls:
            why[seg][h[6:]] += int(r[ix[h]] or 0)
    total = sum(samples.values()) or 1
    print(f"{ctas} CTAs; {sum(executed.values()) / ctas:.0f} warp instructions per CTA")
    for s in sorted(executed):
        if not executed[s]:
            continue
        top = ", ".join(f"{k} {100 * v / max(samples[s], 1):.0f}%" for k, v in why[s].most_common(a.top))
        opl = ", ".join(f"{k} {v / ctas:.0f}" for k, v in ops[s].most_common(a.top))
        print(f"segment {s}: {executed[s] / ctas:8.0f} per CTA, {100 * samples[s] / total:5.1f}% of samples | {top} | {opl}")


if __name__ == "__main__":
    main()
