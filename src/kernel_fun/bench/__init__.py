"""kernel-fun's benchmark: ``python -m kernel_fun.bench`` (see docs/benchmark.md).

Times kernel_fun and fla on the named cases of bench/anchors-h200.md in one process,
prints a table (ms, fla/ours, TB/s and % of the measured copy roofline) and writes
``<out>/<gpu>.json``, ``<out>/<gpu>.md`` and ``<out>/<gpu>.png``.

Importing this package imports neither torch's CUDA runtime nor fla: the case list and the
report writers are plain Python; ``kernel_fun.bench.run`` imports torch when it runs.
"""

from kernel_fun.bench.cases import CASE_NAMES, CASES, PASSES, CconvCase, KdaCase, select

__all__ = ["CASES", "CASE_NAMES", "PASSES", "KdaCase", "CconvCase", "select", "main"]


def main(argv=None) -> int:
    from kernel_fun.bench.__main__ import main as _main

    return _main(argv)
