"""Split an ncu per-instruction export (scripts/ncu_kda.sh's ncu_<kernel>_sass.csv.gz) at the phase
stamps of kda_bwd_grads (each `CS2R ... SR_CLOCKLO` of KF_GRADS_PHASE starts a new segment) and print,
per segment: warp instructions executed per CTA, the share of the stall samples, the top stall
reasons and the most executed opcodes. No GPU needed.

    python3 scripts/ncu_phases.py ncu_kda_bwd_grads_sass.csv.gz [--ctas N] [--top K] [--memory]

--memory: instead, per segment and memory opcode, per CTA: the global sectors and how many of them
ncu counts as excess (uncoalesced, or a vector store split into narrower ones), and the shared
wavefronts and their bank-conflict excess (docs/notes/2026-12-03-lsu-traffic.md found the split
workspace stores and the conflicted 8-float vectors this way).

--ctas: the launch's CTA count (default: the executions of the kernel's first instruction / warps
per CTA, which --warps gives; 16 for kda_bwd_grads). A kernel without stamps is one segment.
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip


def segmented(data: list, ix: dict):
    """(segment, opcode with its modifiers, row) per SASS row: a new segment at each phase stamp."""
    seg = 0
    for r in data:
        src = r[ix["Source"]].strip()
        if "SR_CLOCKLO" in src:
            seg += 1
        words = src.split()
        op = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "?")
        yield seg, op, r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv_gz")
    ap.add_argument("--ctas", type=int, default=0)
    ap.add_argument("--warps", type=int, default=16)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--memory", action="store_true")
    a = ap.parse_args()
    rows = list(csv.reader(gzip.open(a.csv_gz, "rt")))
    hdr, data = rows[1], rows[2:]
    ix = {h: i for i, h in enumerate(hdr)}
    stalls = [h for h in hdr if h.startswith("stall_") and "(Not Issued)" not in h]
    ctas = a.ctas or int(data[0][ix["Instructions Executed"]]) // a.warps
    if a.memory:
        memory_table(data, ix, ctas, a.top)
        return
    executed, samples = collections.Counter(), collections.Counter()
    why, ops = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
    for seg, op, r in segmented(data, ix):
        e = int(r[ix["Instructions Executed"]] or 0)
        executed[seg] += e
        samples[seg] += int(r[ix["Warp Stall Sampling (All Samples)"]] or 0)
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


MEMORY_COLUMNS = ("L2 Theoretical Sectors Global", "L2 Theoretical Sectors Global Excessive",
                  "L1 Wavefronts Shared", "L1 Wavefronts Shared Excessive")


def memory_table(data: list, ix: dict, ctas: int, top: int) -> None:
    def num(r: list, h: str) -> float:
        try:
            return float(r[ix[h]].replace(",", "")) if h in ix else 0.0
        except ValueError:
            return 0.0

    agg: dict = collections.defaultdict(lambda: [0.0] * len(MEMORY_COLUMNS))
    for seg, op, r in segmented(data, ix):
        v = agg[(seg, op)]
        for i, h in enumerate(MEMORY_COLUMNS):
            v[i] += num(r, h)
    print(f"{ctas} CTAs; per CTA: global sectors (excess), shared wavefronts (excess)")
    tot = [sum(v[i] for v in agg.values()) / ctas for i in range(len(MEMORY_COLUMNS))]
    print(f"all: global {tot[0]:.0f} ({tot[1]:.0f}), shared {tot[2]:.0f} ({tot[3]:.0f})")
    for s in sorted({k[0] for k in agg}):
        rows = sorted(((op, v) for (sg, op), v in agg.items() if sg == s and (v[0] or v[2])),
                      key=lambda x: -(x[1][0] + x[1][2]))
        if not rows:
            continue
        line = ", ".join(f"{op} g {v[0] / ctas:.0f} ({v[1] / ctas:.0f}) s {v[2] / ctas:.0f} ({v[3] / ctas:.0f})"
                         for op, v in rows[:top])
        print(f"segment {s}: {line}")


if __name__ == "__main__":
    main()
