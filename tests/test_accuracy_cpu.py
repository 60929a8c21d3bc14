"""kernel_fun.bench.accuracy without a GPU: the option matrix covers what it must, the bound is
max(fla's tolerance, 1.25 x fla's error), inputs are reproducible, and the committed
bench/results/h200-grad-accuracy.json holds one row per case of this matrix with its options."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from helpers import GRAD_ACCURACY_OPEN
from kernel_fun.bench import accuracy as acc

_RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "h200-grad-accuracy.json"


def test_matrix_covers_the_option_space():
    cases = acc.CASES
    assert len(cases) >= 60
    assert {c.gate for c in cases} == set(acc.GATES)
    assert {c.dtype for c in cases} == {"bf16", "fp16"}
    assert any(c.gate.startswith("unbounded") and c.raw_1000 for c in cases)  # raw inputs at -1000, gate in kernel
    assert any(c.gate.startswith("raw") and c.raw_1000 for c in cases)        # log-decays of -1000
    assert any(c.gate == "unbounded_strong" for c in cases)                   # exp(A_log) = 16, strong decays
    short = [c for c in cases if c.T <= 300]
    assert {1, 2, 64}.issubset({c.T for c in short}) and len(short) >= 40
    assert sum(c.T >= 1024 for c in cases) >= 5
    docs = [c.cu for c in cases if c.cu is not None]
    assert any(any(b == a for a, b in zip(cu, cu[1:])) for cu in docs)        # an empty document
    assert any(any(b - a == 1 for a, b in zip(cu, cu[1:])) for cu in docs)    # a one-token document
    assert any(c.HV > c.H for c in cases) and any(c.HV == c.H for c in cases)
    for flag in ("h0", "final", "l2norm", "beta_sigmoid", "neg_eig", "state_v_first", "alog_4d"):
        assert {getattr(c, flag) for c in cases} == {False, True}, flag
    assert all(c.beta_sigmoid for c in cases if c.neg_eig)  # fla's rule
    assert {c.inputs for c in cases} == {"randn", "rand"}


def test_bound_is_fla_tolerance_or_its_error_with_margin():
    dense = next(c for c in acc.CASES if not c.varlen)
    varlen = next(c for c in acc.CASES if c.varlen)
    assert acc.bound(dense, "ddt_bias", None) == 0.008
    assert acc.bound(varlen, "ddt_bias", None) == 0.005
    assert acc.bound(dense, "dA_log", 0.001) == 0.003          # fla's tolerance when fla is better
    assert acc.bound(dense, "dA_log", 0.02) == pytest.approx(0.025)
    assert acc.bound(dense, "dq", float("nan")) == 0.008       # no usable fla error: the tolerance


def test_inputs_are_reproducible_and_follow_the_options():
    case = acc.BY_NAME["fla_varlen_mask09"]
    a, kw, seeds = acc.make_inputs(case, device="cpu")
    b, _, _ = acc.make_inputs(case, device="cpu")
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    q, k, v, g, beta = a
    assert q.dtype == torch.float16 and g.dtype == torch.float16
    assert 0.85 < (g == -1000).float().mean().item() < 0.95
    assert kw["A_log"].shape == (1, 1, 4, 1) and kw["cu_seqlens"].tolist() == [0, 256, 500, 1000]
    assert kw["initial_state"].shape == (3, 4, 64, 64) and seeds["ht"].shape == (3, 4, 64, 64)
    strong = next(c for c in acc.CASES if c.gate == "bounded_strong")
    _, kw, _ = acc.make_inputs(strong, device="cpu")
    assert kw["lower_bound"] == -5.0 and kw["safe_gate"] and "dt_bias" not in kw


def test_reference_gradients_are_the_cpu_chunk_kda_ones():
    """The fp64 recurrence through autograd against the front's CPU path (the chunked torch
    reference, also fp64 here): two independent formulations, one small case."""
    case = acc.GradCase("tiny", B=1, T=20, H=1, HV=2, K=16, V=16, gate="unbounded", h0=True, cu=(0, 7, 7, 20))
    inputs, kw, seeds = acc.make_inputs(case, device="cpu")
    ref = acc.reference(inputs, kw, seeds)
    from kernel_fun.kda import chunk_kda
    # fp64 everywhere but the initial state, which chunk_kda takes in fp32 only (as fla asserts)
    wide = {n: (t.double() if n in ("A_log", "dt_bias") else t) for n, t in kw.items()}
    got = acc.outputs_and_grads(chunk_kda, [x.double() for x in inputs], wide, seeds)
    errs = acc.errors(ref, got)
    assert max(errs.values()) < 1e-8, errs


@pytest.mark.skipif(not _RESULTS.exists(), reason="no committed grad-accuracy results yet")
def test_committed_results_match_this_matrix():
    doc = json.loads(_RESULTS.read_text())
    rows = {r["case"]: r for r in doc["rows"]}
    assert set(rows) == set(acc.CASE_NAMES)
    over = set()
    for c in acc.CASES:
        row = rows[c.name]
        assert row["options"] == json.loads(json.dumps(dataclasses.asdict(c))), c.name
        assert row["ours"] is not None and set(row["ours"]) >= {"dq", "dk", "dv", "dg", "dbeta"}, c.name
        if row.get("fla") is None:
            assert row.get("fla_why"), f"{c.name}: fla's row is null without a reason"
        elif acc.check_row(row):  # where fla's error is known: max(tolerance, 1.25 x fla's)
            over.add(c.name)
    # over the bound on exactly the cases the tests know as open (none, once the work is done)
    assert over == set(GRAD_ACCURACY_OPEN), (sorted(over), sorted(GRAD_ACCURACY_OPEN))


def test_list_needs_no_gpu(capsys):
    assert acc.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == len(acc.CASES) and "fla_varlen_mask09" in out


def test_resume_keeps_only_rows_of_unchanged_cases_and_merge_adds_before(tmp_path):
    a, b = acc.CASES[0], acc.CASES[1]
    opts = lambda c: json.loads(json.dumps(dataclasses.asdict(c)))  # noqa: E731
    stale = dict(opts(b), T=b.T + 1)  # the matrix changed this case since the run
    run = {"meta": {"label": "x"}, "rows": [
        {"case": a.name, "options": opts(a), "ours": {"dq": 1e-3}},
        {"case": b.name, "options": stale, "ours": {"dq": 2e-3}}]}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    assert [r["case"] for r in acc._load_rows(str(path))] == [a.name]
    new = {"meta": {"label": "new"}, "rows": [{"case": a.name, "options": opts(a), "ours": {"dq": 5e-4}}]}
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "h200-grad-accuracy.json").write_text(json.dumps(new))
    out = tmp_path / "out"
    assert acc.main(["--merge", str(tmp_path / "new" / "h200-grad-accuracy.json"), "--before", str(path),
                     "--out", str(out), "--note", "why"]) == 0
    doc = json.loads((out / "h200-grad-accuracy.json").read_text())
    row = doc["rows"][0]
    assert row["before"] == {"dq": 1e-3} and row["fla"] is None and row["fla_why"]
    assert doc["meta"]["before_label"] == "x" and doc["meta"]["note"] == "why"


def test_resume_reruns_rows_without_the_implementations_asked_for():
    ours_only = {"case": "x", "ours": {"dq": 1e-3}, "fla": None, "fla_why": "not measured (meta.note says why)"}
    skipped = {"case": "x", "ours": {"dq": 1e-3}, "fla": None, "fla_why": acc._FLA_NOT_NEEDED}
    failed = {"case": "x", "ours": {"dq": 1e-3}, "fla": None, "fla_why": "AssertionError: fla cannot run it"}
    both = {"case": "x", "ours": {"dq": 1e-3}, "fla": {"dq": 2e-3}}
    assert acc._complete(ours_only, ("ours",), "all")
    assert not acc._complete(ours_only, ("ours", "fla"), "needed")
    assert acc._complete(skipped, ("ours", "fla"), "needed") and not acc._complete(skipped, ("ours", "fla"), "all")
    assert acc._complete(failed, ("ours", "fla"), "all") and acc._complete(both, ("ours", "fla"), "all")


def test_draws_run_more_seeds_and_report_medians(monkeypatch):
    """--draws N: the same option mix on seeds case.seed + 1 .. N for every implementation that ran,
    the median over all inputs per gradient; the bound stays on the case's own seed; --resume re-runs
    a row with fewer draws than asked."""
    case = acc.BY_NAME["fla_varlen_mask09"]
    seen = []
    monkeypatch.setattr(acc, "make_inputs", lambda c, device="cuda": (seen.append(c.seed) or c.seed, {}, {}))
    monkeypatch.setattr(acc, "reference", lambda inputs, kw, seeds: {"dq": torch.ones(4)})
    # ours' error on seed s: 0.001 * (s + 1); fla's: 0.002 (s even) / 0.004 (s odd)
    monkeypatch.setattr(acc, "ours", lambda inputs, kw, seeds: {"dq": torch.ones(4) * (1 + 0.001 * (inputs + 1))})
    monkeypatch.setattr(acc, "fla", lambda inputs, kw, seeds: {"dq": torch.ones(4) * (1 + (0.004 if inputs % 2 else 0.002))})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    row = acc.run_case(case, ("ours", "fla"), "all", draws=3)
    s0 = case.seed
    assert seen == [s0, s0 + 1, s0 + 2, s0 + 3]
    assert [d["seed"] for d in row["draws"]] == [s0 + 1, s0 + 2, s0 + 3]
    assert row["ours"]["dq"] == pytest.approx(0.001 * (s0 + 1), rel=1e-3)  # the bound's input: the case's own
    assert row["median"]["ours"]["dq"] == pytest.approx(0.001 * (s0 + 2.5), rel=1e-3)
    assert row["median"]["fla"]["dq"] == pytest.approx(0.003, rel=1e-3)
    assert not acc._complete(dict(row, draws=row["draws"][:2]), ("ours", "fla"), "all", draws=3)
    assert acc._complete(row, ("ours", "fla"), "all", draws=3)


@pytest.mark.skipif(not _RESULTS.exists(), reason="no committed grad-accuracy results yet")
def test_combine_takes_the_last_run_and_keeps_earlier_fla_errors(tmp_path):
    rows = [r for r in json.loads(_RESULTS.read_text())["rows"] if r.get("fla")][:2]
    assert len(rows) == 2
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    older = [dict(r, ours={k: 1.0 for k in r["ours"]}, before={"dg": 9.0}, draws=[{"seed": 1}], median={"dg": 3.0})
             for r in rows]
    for r in older:
        r.pop("ours_label", None), r.pop("fla_label", None)
    newer = [dict(rows[0], ours={k: 2.0 for k in rows[0]["ours"]}, fla=None, fla_why="not measured")]
    newer[0].pop("before", None), newer[0].pop("ours_label", None), newer[0].pop("fla_label", None)
    (a / "h.json").write_text(json.dumps({"meta": {"label": "old"}, "rows": older}))
    (b / "h.json").write_text(json.dumps({"meta": {"label": "new"}, "rows": newer}))
    assert acc.main(["--combine", str(a / "h.json"), str(b / "h.json"), "--out", str(tmp_path / "out"),
                     "--note", "n"]) == 0
    doc = json.loads((tmp_path / "out" / "h.json").read_text())
    got = {r["case"]: r for r in doc["rows"]}
    first, second = got[rows[0]["case"]], got[rows[1]["case"]]
    assert set(first["ours"].values()) == {2.0} and first["ours_label"] == "new"  # the last run wins
    assert first["fla"] == rows[0]["fla"] and first["fla_label"] == "old"         # fla's from the older
    assert "fla_why" not in first and first["before"] == {"dg": 9.0}
    # the extra seeds of an earlier run stay, labelled with that run
    assert first["draws"] == [{"seed": 1}] and first["median"] == {"dg": 3.0} and first["draws_label"] == "old"
    assert set(second["ours"].values()) == {1.0} and second["ours_label"] == "old"
    assert doc["meta"]["note"] == "n" and doc["meta"]["label"] == "combined: old; new"
    # a row fla could not run keeps its reason through a later ours-only run (which has none)
    (a / "h.json").write_text(json.dumps({"meta": {"label": "old"}, "rows": [dict(older[0], fla=None, fla_why="asserts")]}))
    (b / "h.json").write_text(json.dumps({"meta": {"label": "new"}, "rows": [dict(newer[0], fla_why=None)]}))
    assert acc.main(["--combine", str(a / "h.json"), str(b / "h.json"), "--out", str(tmp_path / "out2")]) == 0
    doc2 = json.loads((tmp_path / "out2" / "h.json").read_text())
    row = doc2["rows"][0]
    assert row["fla"] is None and row["fla_why"] == "asserts" and row["ours_label"] == "new"
    # a combined file combined again lists the runs once, not "combined: combined: ..."
    assert acc.main(["--combine", str(tmp_path / "out" / "h.json"), str(b / "h.json"), "--out", str(tmp_path / "out3")]) == 0
    assert json.loads((tmp_path / "out3" / "h.json").read_text())["meta"]["label"] == "combined: old; new; new"
