"""SASS of one kernel split at its phase stamps: per segment the static instruction count, the most
frequent opcodes and the spill instructions (STL / LDL). Compiled here by scripts/sass_size.sh (its
flags, its summary of registers and spills per kernel first), no GPU.

The per-chunk kernels stamp their phase boundaries with `clock64()` reads (KF_GRADS_PHASE,
dev::stamp_clock), which compile to `CS2R ... SR_CLOCKLO`: segment i is the code after the i-th
such read (for kda_bwd_grads: 1 = P, 2 = the V loop, 3 = E, ...). A loop's body appears once, so
a segment's count is per iteration for a loop. What it is for: kda_bwd_grads' two kernels (SIMT and
kMid) spill differently for the same source change, and a spill reload inside the V loop costs
every slice (docs/notes/2026-12-01-kda-backward.md, fourteenth session; scripts/dev/experiments/README.md,
fifteenth): see where an edit moves instructions and spills before timing it.

    python3 scripts/dev/sass_phases.py [--file F.cu] [--kernel SUBSTRING] [--top N]

Defaults: csrc/kda/bwd/instantiations/kda_bwd_grads_bf16_k128.cu, every kernel in it.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", default="csrc/kda/bwd/instantiations/kda_bwd_grads_bf16_k128.cu")
    ap.add_argument("--kernel", default="", help="only kernels whose mangled name contains this")
    ap.add_argument("--top", type=int, default=8)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["bash", str(ROOT / "scripts/sass_size.sh"), a.file], check=True, cwd=ROOT,
                       env={**os.environ, "SASS_OUT": tmp})
        sass = (Path(tmp) / (Path(a.file).stem + ".sass")).read_text()
    fn, segs = None, {}
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            fn = m.group(1) if a.kernel in m.group(1) else None
            if fn:
                segs[fn] = [collections.Counter()]
            continue
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if not fn or not m:
            continue
        words = m.group(1).split()
        op = (words[1] if words[0].startswith("@") else words[0]).split(".")[0]
        if "SR_CLOCKLO" in m.group(1):
            segs[fn].append(collections.Counter())
        if op != "NOP":
            segs[fn][-1][op] += 1
    for fn, parts in segs.items():
        print(f"== {fn}: {sum(sum(c.values()) for c in parts)} instructions")
        for i, c in enumerate(parts):
            top = ", ".join(f"{k} {v}" for k, v in c.most_common(a.top))
            print(f"  segment {i:2d}: {sum(c.values()):5d}  spills STL {c['STL']} LDL {c['LDL']} | {top}")


if __name__ == "__main__":
    main()
