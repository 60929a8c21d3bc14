"""The gradient-accuracy matrix's option mixes on the CPU: ours on the host emulator (tests/emu, our
CUDA kernels unmodified) and fla 0.5.2 through Triton's interpreter (scripts/dev/fla_interp.py), both
against the fp64 recurrence on the same inputs, over several seeds per mix. A model of the H200 matrix
(bench/results/h200-grad-accuracy.json), not a replacement: it says where ours and fla's algorithm
differ at the median, before device time is spent on it.

    TRITON_INTERPRET=1 PYTHONPATH=src python3 scripts/dev/accuracy_cpu.py [--seeds 3] [--max-t 1100] \\
        [--cases a,b,..] [--impls ours] --out cpu-acc.json

--impls ours runs the emulator alone (no fla, no interpreter: minutes instead of hours), e.g. to see
what a kernel change does to the errors, seed for seed, against a committed run's `ours_runs`.

Mixes longer than --max-t tokens are skipped (the interpreter runs fla at ~1 s per 10 tokens).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "emu"))

import fla_interp  # noqa: E402  (beside this script)

from kernel_fun.bench import accuracy as acc  # noqa: E402


def ours_emu(inputs, kw, seeds):
    import kda_emu

    return kda_emu.chunk_kda_outputs(inputs, kw, seeds)


IMPLS = {"ours": ours_emu, "fla": acc.fla}


def run(case, seeds: int, impls=tuple(IMPLS)) -> dict:
    per = {impl: [] for impl in impls}
    why = {}
    for s in range(seeds):
        c = dataclasses.replace(case, seed=case.seed + s)
        inputs, kw, sd = acc.make_inputs(c, device="cpu")
        ref = acc.reference(inputs, kw, sd)
        for impl in impls:
            try:
                per[impl].append(acc.errors(ref, IMPLS[impl](inputs, kw, sd)))
            except Exception as e:  # noqa: BLE001 - a row records why an implementation could not run
                why[impl] = acc._short(e)
    row = {"case": case.name, "label": case.label(), "seeds": seeds}
    for impl, runs in per.items():
        if runs:
            keys = runs[0].keys()
            row[impl] = {k: statistics.median(r[k] for r in runs) for k in keys}
            row[impl + "_runs"] = runs
        else:
            row[impl], row[impl + "_why"] = None, why.get(impl)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--max-t", type=int, default=1100)
    ap.add_argument("--cases", default="")
    ap.add_argument("--impls", default="ours,fla", help="ours, fla or both (comma-separated)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    impls = tuple(a.impls.split(","))
    if not impls or not set(impls) <= set(IMPLS):
        ap.error(f"--impls: {a.impls!r}: each one of {', '.join(IMPLS)}")
    if "fla" in impls:
        fla_interp.enable()
    names = a.cases.split(",") if a.cases else list(acc.CASE_NAMES)
    rows = []
    if os.path.exists(a.out):
        rows = json.load(open(a.out))["rows"]
    done = {r["case"] for r in rows}
    for name in names:
        case = acc.BY_NAME[name]
        if name in done:
            continue
        if case.B * case.T > a.max_t:
            rows.append({"case": name, "label": case.label(), "skipped": f"B*T = {case.B * case.T} > --max-t"})
            continue
        t0 = time.time()
        row = run(case, a.seeds, impls)
        row["seconds"] = round(time.time() - t0, 1)
        rows.append(row)
        fmt = lambda e: "-" if not e else " ".join(f"{k} {v:.1e}" for k, v in e.items())  # noqa: E731
        print(f"{name} ({row['seconds']} s)" + "".join(f"\n  {i:4s} {fmt(row[i])}" for i in impls), flush=True)
        with open(a.out, "w") as f:  # after every case: a long run can be resumed
            json.dump({"meta": {"what": __doc__.split("\n\n")[0], "seeds": a.seeds}, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
