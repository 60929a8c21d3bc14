"""CLI: ``python -m kernel_fun.bench [--family kda|cconv|all] [--case NAME ...] [--pass P]
[--iters N] [--warmup N] [--out DIR] [--no-fla] [--no-flashkda] [--no-flush] [--host-ahead] [--budget-s S]
[--seed N]
[--list | --merge JSON ...]``. See docs/benchmark.md."""

from __future__ import annotations

import argparse
import os
import sys
import time

from kernel_fun.bench.cases import CASE_NAMES, select, passes

NO_GPU_MESSAGE = ("no CUDA GPU found: nothing can be timed here. Without a GPU, --list prints the "
                  "cases and their byte floors, and --merge A.json B.json ... merges result files "
                  "into --out.")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kernel_fun.bench",
        description="Time kernel_fun against fla (and FlashKDA where it applies) on the named cases "
                    "(CUDA events, median).")
    p.add_argument("--family", choices=("kda", "cconv", "all"), default="all")
    p.add_argument("--case", action="append", type=_case_name, metavar="NAME", default=None,
                   help="a case name (repeatable); default: every case of --family")
    p.add_argument("--pass", dest="pass_", choices=("fwd", "fwd+bwd", "all"), default="all")
    p.add_argument("--iters", type=_int_in(1), default=20, help="timed calls; the median is kept (default 20)")
    # >= 1: the first warm-up call is the engagement probe (and time_calls makes at least one)
    p.add_argument("--warmup", type=_int_in(1), default=3, help="untimed calls first (default 3)")
    p.add_argument("--out", default=os.path.join("bench", "results"),
                   help="folder for <gpu>.json/.md/.png (default bench/results)")
    p.add_argument("--no-fla", action="store_true", help="no fla rows")
    p.add_argument("--no-flashkda", action="store_true",
                   help="no FlashKDA rows (by default: bounded-gate forward rows with K=V=128, H=HV, "
                        "when flash_kda is importable)")
    p.add_argument("--no-flush", action="store_true", help="do not flush L2 before each timed call")
    p.add_argument("--host-ahead", action="store_true",
                   help="before each timed call the GPU sleeps longer than the host takes to enqueue the call, "
                        "so the events time the GPU's work, not the host's launches (rows whose kernels take "
                        "less than their launches; docs/benchmark.md)")
    p.add_argument("--budget-s", type=_budget, default=None, metavar="S",
                   help="start no new case after S seconds (> 0); the rest are reported as not run")
    # case i is seeded seed + i: a 32-bit seed (numpy's range) leaves torch's 64-bit one room
    p.add_argument("--seed", type=_int_in(0, 2**32 - 1), default=0, help="input seed (default 0)")
    no_gpu = p.add_mutually_exclusive_group()
    no_gpu.add_argument("--list", action="store_true", help="print the cases and exit (no GPU needed)")
    no_gpu.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                        help="no timing (no GPU needed): merge these result files (oldest first; the "
                             "newest timed row of each case/pass/impl wins) and write "
                             "<gpu>.json/.md/.png to --out")
    return p


# argparse types: a raised ArgumentTypeError becomes "argument --x: <message>", exit status 2.

def _int_in(lo: int, hi: int | None = None):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be >= {lo}" + ("" if hi is None else f" and <= {hi}")
                                             + f", got {v}")
        return v
    return parse


def _budget(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number of seconds") from None
    # 0 would time nothing and still overwrite --out with "not run" rows; `not >` also catches nan
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {s}")
    return v


def _case_name(s: str) -> str:
    if s not in CASE_NAMES:
        raise argparse.ArgumentTypeError(f"unknown case {s!r}; known: {', '.join(CASE_NAMES)}")
    return s


def list_cases(cases, pass_list) -> str:
    lines = [f"{'case':<14} {'family':<6} {'shape':<70} " + "  ".join(f"{p + ' GB':>10}" for p in pass_list)]
    for c in cases:
        gb = "  ".join(f"{c.bytes(p) / 1e9:>10.3f}" for p in pass_list)
        lines.append(f"{c.name:<14} {c.family:<6} {c.describe():<70} {gb}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    cases = select(args.family, args.case)  # the parser already rejected unknown names
    pass_list = passes(args.pass_)
    if not cases:
        parser.error(f"no case matches --family {args.family} --case {' --case '.join(args.case)}")
    if args.list:
        print(list_cases(cases, pass_list))
        return 0
    if args.merge:
        import json

        from kernel_fun.bench import report

        runs = []
        for path in args.merge:
            try:
                with open(path) as f:
                    runs.append(json.load(f))
            except (OSError, ValueError) as e:
                parser.error(f"argument --merge: cannot read {path}: {e}")
            if not isinstance(runs[-1], list) or not all(isinstance(r, dict) for r in runs[-1]):
                parser.error(f"argument --merge: {path} is not a results file (a JSON list of rows)")
        if not any(runs):
            parser.error("argument --merge: the files hold no rows")
        rows, meta = report.merge_runs(runs)
        print(report.format_table(rows))
        for m in report.write_all(rows, meta, args.out):
            print(m)
        return 0

    # non-zero: a script that asked for timings must not mistake "nothing timed" for success
    try:
        import torch
    except ImportError as e:
        print(f"{NO_GPU_MESSAGE} (torch not importable: {e})", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return 1

    from kernel_fun.bench import report
    from kernel_fun.bench.run import Config, gather_meta, run

    # fla 0.5.2 swaps a TileLang kernel into its KDA backward when tilelang is installed (and HV == H);
    # unless the caller chose otherwise, time its default Triton backward, and say which ran.
    os.environ.setdefault("FLA_TILELANG", "0")
    # fla 0.5.2 can hand a chunk_kda forward to FlashKDA when flash_kda is importable; fla's rows are
    # fla's own Triton kernels (FlashKDA has its own rows), unless the caller chose otherwise.
    os.environ.setdefault("FLA_FLASH_KDA", "0")
    t0 = time.time()
    meta = gather_meta(torch)
    if isinstance(meta.get("versions"), dict):  # copied into every row, so merged pages keep it
        meta["versions"]["fla_backend"] = (f"FLA_TILELANG={os.environ['FLA_TILELANG']}: Triton backward"
                                           f"{'' if os.environ['FLA_TILELANG'] == '0' else ' unless tilelang is installed'}"
                                           f"; FLA_FLASH_KDA={os.environ['FLA_FLASH_KDA']}")
    meta.update(iters=args.iters, warmup=args.warmup, flush_l2=not args.no_flush,
                host_ahead="yes" if args.host_ahead else "no")
    print(f"kernel-fun bench on {meta['device_name']} ({meta['gpu']}): "
          f"{len(cases)} case(s) x {len(pass_list)} pass(es); versions {meta['versions']}", flush=True)
    cfg = Config(cases=cases, passes=pass_list, iters=args.iters, warmup=args.warmup,
                 with_fla=not args.no_fla, with_flashkda=not args.no_flashkda,
                 flush_l2=not args.no_flush, host_ahead=args.host_ahead, seed=args.seed,
                 budget_s=args.budget_s)

    def checkpoint(rows_so_far):  # a run cut short (device time limit) still leaves results
        part = dict(meta, notes=["partial: the run had not finished when this was written"])
        report.write_json(rows_so_far, os.path.join(args.out, meta["gpu"] + ".json"))
        report.write_markdown(rows_so_far, part, os.path.join(args.out, meta["gpu"] + ".md"))

    # progress on stderr, so stdout keeps only the results
    rows = run(cfg, meta, log=lambda s: print(s, flush=True), on_case_done=checkpoint,
               progress=lambda s: print(s, file=sys.stderr, flush=True))
    meta["wall_s"] = time.time() - t0
    print()
    print(report.format_table(rows))
    for m in report.write_all(rows, meta, args.out):
        print(m)
    return 0


if __name__ == "__main__":
    sys.exit(main())
