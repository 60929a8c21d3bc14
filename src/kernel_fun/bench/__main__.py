"""CLI: ``python -m kernel_fun.bench [--family kda|cconv|all] [--case NAME ...] [--pass P]
[--iters N] [--warmup N] [--out DIR] [--no-fla] [--no-flush] [--budget-s S] [--seed N] [--list]``.
See docs/benchmark.md."""

from __future__ import annotations

import argparse
import os
import sys
import time

from kernel_fun.bench.cases import CASES, select, passes

NO_GPU_MESSAGE = "no CUDA GPU: nothing to benchmark"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kernel_fun.bench",
        description="Time kernel_fun against fla on the named cases (CUDA events, median).")
    p.add_argument("--family", choices=("kda", "cconv", "all"), default="all")
    p.add_argument("--case", action="append", metavar="NAME", default=None,
                   help="a case name (repeatable); default: every case of --family")
    p.add_argument("--pass", dest="pass_", choices=("fwd", "fwd+bwd", "all"), default="all")
    p.add_argument("--iters", type=_positive, default=20, help="timed calls; the median is kept (default 20)")
    p.add_argument("--warmup", type=_positive, default=3, help="untimed calls first (default 3)")
    p.add_argument("--out", default=os.path.join("bench", "results"),
                   help="folder for <gpu>.json/.md/.png (default bench/results)")
    p.add_argument("--no-fla", action="store_true", help="time kernel_fun only")
    p.add_argument("--no-flush", action="store_true", help="do not flush L2 before each timed call")
    p.add_argument("--budget-s", type=float, default=None, metavar="S",
                   help="start no new case after S seconds; the rest are reported as not run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="print the cases and exit")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="no timing: merge these result files (oldest first; the newest timed row of "
                        "each case/pass/impl wins) and write <gpu>.json/.md/.png to --out")
    return p


def _positive(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return v


def list_cases(cases, pass_list) -> str:
    lines = [f"{'case':<14} {'family':<6} {'shape':<70} " + "  ".join(f"{p + ' GB':>10}" for p in pass_list)]
    for c in cases:
        gb = "  ".join(f"{c.bytes(p) / 1e9:>10.3f}" for p in pass_list)
        lines.append(f"{c.name:<14} {c.family:<6} {c.describe():<70} {gb}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        cases = select(args.family, args.case)
        pass_list = passes(args.pass_)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not cases:
        print(f"error: no case matches --family {args.family} --case {args.case}", file=sys.stderr)
        return 2
    if args.list:
        print(list_cases(cases, pass_list))
        return 0
    if args.merge:
        import json

        from kernel_fun.bench import report

        runs = []
        for path in args.merge:
            with open(path) as f:
                runs.append(json.load(f))
        rows, meta = report.merge_runs(runs)
        print(report.format_table(rows))
        for m in report.write_all(rows, meta, args.out):
            print(m)
        return 0

    try:
        import torch
    except ImportError as e:
        print(f"{NO_GPU_MESSAGE} (torch not importable: {e})")
        return 0
    if not torch.cuda.is_available():
        print(NO_GPU_MESSAGE)
        return 0

    from kernel_fun.bench import report
    from kernel_fun.bench.run import Config, gather_meta, run

    # fla 0.5.2 swaps a TileLang kernel into its KDA backward when tilelang is installed (and HV == H);
    # unless the caller chose otherwise, time its default Triton backward, and say which ran.
    os.environ.setdefault("FLA_TILELANG", "0")
    t0 = time.time()
    meta = gather_meta(torch)
    if isinstance(meta.get("versions"), dict):  # copied into every row, so merged pages keep it
        meta["versions"]["fla_backend"] = (f"FLA_TILELANG={os.environ['FLA_TILELANG']}: Triton backward"
                                           f"{'' if os.environ['FLA_TILELANG'] == '0' else ' unless tilelang is installed'}")
    meta.update(iters=args.iters, warmup=args.warmup, flush_l2=not args.no_flush)
    print(f"kernel-fun bench on {meta['device_name']} ({meta['gpu']}): "
          f"{len(cases)} case(s) x {len(pass_list)} pass(es); versions {meta['versions']}", flush=True)
    cfg = Config(cases=cases, passes=pass_list, iters=args.iters, warmup=args.warmup,
                 with_fla=not args.no_fla, flush_l2=not args.no_flush, seed=args.seed,
                 budget_s=args.budget_s)

    def checkpoint(rows_so_far):  # a run cut short (device time limit) still leaves results
        part = dict(meta, notes=["partial: the run had not finished when this was written"])
        report.write_json(rows_so_far, os.path.join(args.out, meta["gpu"] + ".json"))
        report.write_markdown(rows_so_far, part, os.path.join(args.out, meta["gpu"] + ".md"))

    rows = run(cfg, meta, log=lambda s: print(s, flush=True), on_case_done=checkpoint)
    meta["wall_s"] = time.time() - t0
    print()
    print(report.format_table(rows))
    for m in report.write_all(rows, meta, args.out):
        print(m)
    return 0


if __name__ == "__main__":
    sys.exit(main())
