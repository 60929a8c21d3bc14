"""The context-parallel benchmark (kernel_fun.bench.cp) on the CPU: two gloo processes run its rank
function on a small one-document case (the torch reference under our front), and rank 0's rows
must say what ran: our rows timed with every rank's number, fla's not run with the reason. The
timed rows on GPUs (cp2_b1_t128k) need the 2-GPU machine."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import join_cp_group, leave_cp_group
from kernel_fun.bench import cp
from kernel_fun.bench.cases import CASES, KdaCase

BY_NAME = {c.name: c for c in CASES}
SMALL = KdaCase("long_small", B=1, T=128, H=1, HV=1, K=16, V=16, lower_bound=-5.0, safe_gate=True)


def _worker(rank, world, path, out):
    join_cp_group(rank, world, path, "cpu", "KERNEL_FUN_KDA_CP")
    done = False
    try:
        rows = cp.run_rank(SMALL, iters=2, warmup=1, device="cpu")
        if rank == 0:
            with open(out, "w") as f:
                json.dump(rows, f)
        else:
            assert rows is None
        done = True
    finally:
        leave_cp_group(done)


def test_cp_bench_rows_on_two_cpu_ranks(tmp_path):
    out = tmp_path / "rows.json"
    mp.spawn(_worker, args=(2, str(tmp_path / "rdzv"), str(out)), nprocs=2, join=True)
    rows = json.loads(out.read_text())
    by = {(r["impl"], r["pass"]): r for r in rows}
    assert set(by) == {(i, p) for i in cp.IMPLS for p in ("fwd", "fwd+bwd")}
    for p in ("fwd", "fwd+bwd"):
        ours = by[("kernel_fun", p)]
        assert ours["case"] == "cp2_small" and ours["status"] == "ok", ours
        assert ours["ms"] > 0 and ours["note"].startswith("per rank: ") and ours["note"].count(" ms") == 2
        assert ours["shape"]["ranks"] == 2 and ours["shape"]["tokens_per_rank"] == 64
        fla = by[("fla", p)]
        assert fla["status"] == "not_run" and fla["note"], fla


def test_cp_bench_case_names_and_checks():
    assert cp.row_case(BY_NAME["long_b1_t128k"], 2) == "cp2_b1_t128k"
    assert (BY_NAME["long_b1_t128k"].B, BY_NAME["long_b1_t128k"].T, BY_NAME["long_b1_t128k"].H) == (1, 131072, 32)
    with pytest.raises(ValueError, match="one document"):
        cp.check_case(BY_NAME["varlen"], 2)
    with pytest.raises(ValueError, match="not a multiple of the 3 ranks"):
        cp.check_case(BY_NAME["long_b1_t128k"], 3)
