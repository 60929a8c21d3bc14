"""``python -m kernel_fun.check``: on CPU, that it refuses (exit 1, the reason, what was not checked)
without a GPU, that one failing check makes the exit non-zero while the others still run, strict
mode, the comparison and engagement helpers, and the forward+backward plumbing through the CPU
reference path; on the GPU, that every check passes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import kernel_fun
from kernel_fun import check


def _no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_without_a_gpu_it_prints_versions_and_the_reason_and_fails(monkeypatch, capsys):
    _no_gpu(monkeypatch)
    assert check.main([]) == 1
    out = capsys.readouterr().out
    assert f"kernel_fun: {kernel_fun.__version__}" in out and "torch: " in out
    assert "FAIL environment: no CUDA device" in out
    names = [c.name for c in check.family_checks("all")]
    for name in names:  # says what was not checked
        assert f"NOT CHECKED {name}" in out
    assert "PASS" not in out and "self-check FAILED" in out


def test_family_selects_the_checks_not_run(monkeypatch, capsys):
    _no_gpu(monkeypatch)
    assert check.main(["--family", "kda"]) == 1
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("NOT CHECKED")]
    assert lines and all(ln.startswith("NOT CHECKED kda ") for ln in lines)


def test_extension_unavailable_is_a_failure_with_its_reason(monkeypatch, capsys):
    from kernel_fun import _ext

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_ext, "status", lambda: (False, "built without its CUDA extension (test)"))
    assert check.main(["--quiet"]) == 1
    out = capsys.readouterr().out
    assert "FAIL environment: built without its CUDA extension (test)" in out
    assert "kernel_fun:" not in out  # --quiet: no versions


def test_module_entry_point_exits_non_zero_without_a_gpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU even on a GPU machine
    r = subprocess.run([sys.executable, "-m", "kernel_fun.check", "--family", "cconv"], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "no CUDA device" in r.stdout and "NOT CHECKED cconv" in r.stdout


def _boom():
    raise RuntimeError("kernel exploded\non two lines")


def test_one_failing_check_fails_the_run_and_the_rest_still_run(capsys):
    checks = [check.Check("first", _boom), check.Check("second", lambda: "o 1.0e-03")]
    assert check.main([], checks=checks) == 1
    out = capsys.readouterr().out
    assert "FAIL first: RuntimeError: kernel exploded on two lines\n" in out  # one line per check
    assert "PASS second (o 1.0e-03)" in out
    assert "self-check FAILED: 1 of 2 checks failed" in out


def test_all_passing_checks_exit_zero(capsys):
    checks = [check.Check("a", lambda: "x"), check.Check("b", lambda: "")]
    assert check.main([], checks=checks) == 0
    out = capsys.readouterr().out
    assert "PASS a (x)" in out and "PASS b\n" in out and "self-check passed: 2 checks" in out


def test_quiet_prints_only_failures_and_the_summary(capsys):
    checks = [check.Check("ok", lambda: "fine"), check.Check("bad", _boom)]
    assert check.main(["--quiet"], checks=checks) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == ["FAIL bad: RuntimeError: kernel exploded on two lines", "self-check FAILED: 1 of 2 checks failed"]


def test_checks_run_in_strict_mode():
    from kernel_fun import _dispatch

    def needs_strict():
        if not _dispatch.strict_enabled():
            raise AssertionError("not strict")
        return ""

    assert check.run_check(check.Check("strict", needs_strict)).ok
    assert not _dispatch.strict_enabled()  # and only inside the check


def test_a_fallback_inside_a_check_is_a_failure_with_the_reason():
    from kernel_fun import _dispatch

    def falls_back():
        return _dispatch.fallback("kda", "W=5 unsupported (test)", "fla.ops.kda", "chunk_kda", (), {})

    r = check.run_check(check.Check("fb", falls_back))
    assert not r.ok and "KernelFunUnsupported" in r.detail and "W=5 unsupported (test)" in r.detail


def test_family_checks_names_and_bad_family():
    for fam in check.FAMILIES:
        names = [c.name for c in check.family_checks(fam)]
        assert names and all(n.startswith(fam + " ") for n in names)
        assert any("forward+backward" in n and "CUDA graph" not in n for n in names)
        assert any("CUDA graph" in n for n in names)
        assert any("varlen" in n for n in names)
    assert len(check.family_checks("all")) == sum(len(check.family_checks(f)) for f in check.FAMILIES)
    with pytest.raises(ValueError):
        check.family_checks("conv")


def test_compare_passes_within_and_names_what_is_over_tolerance():
    ref = torch.randn(64, 32, dtype=torch.float64)
    assert check.compare({"o": (ref, ref.clone())}, {"o": 1e-3}) == "o 0.0e+00"
    assert re.fullmatch(r"o [1-9]\.\de-0[89]", check.compare({"o": (ref, ref.float())}, {"o": 1e-3}))
    worse = ref * 1.01  # rel-RMS exactly 1e-2
    with pytest.raises(check.CheckFailed, match=r"dq rel-RMS 1\.0e-02 > 5e-03"):
        check.compare({"o": (ref, ref), "dq": (ref, worse)}, {"o": 5e-3, "dq": 5e-3})
    nan = ref.clone()
    nan[0, 0] = float("nan")
    with pytest.raises(check.CheckFailed, match="inf"):
        check.compare({"o": (ref, nan)}, 1e-3)
    with pytest.raises(check.CheckFailed, match="shape"):
        check.compare({"o": (ref, ref[:1])}, 1e-3)
    with pytest.raises(check.CheckFailed, match="missing"):
        check.compare({"o": (ref, None)}, 1e-3)


def test_compare_round_ref_measures_beyond_our_dtype_rounding():
    ref = torch.randn(4096, dtype=torch.float64)
    got = ref.to(torch.bfloat16)  # exact up to bf16 rounding (~2e-3 rel-RMS)
    with pytest.raises(check.CheckFailed):
        check.compare({"y": (ref, got)}, 1e-3)
    assert check.compare({"y": (ref, got)}, 1e-3, round_ref=True) == "y 0.0e+00"


def test_require_equal():
    a = torch.arange(6.0)
    assert check.require_equal(["o"], [a], [a.clone()]) == "replay == eager: o"
    with pytest.raises(check.CheckFailed, match="replay differs from eager: o"):
        check.require_equal(["o"], [a], [a + 1])


def test_require_ran_names_the_ops_never_called():
    import collections

    check.require_ran(collections.Counter(kda_fwd=1, kda_bwd=2), check.KDA_OPS)
    with pytest.raises(check.CheckFailed, match="kernel_fun::kda_bwd never called"):
        check.require_ran(collections.Counter(kda_fwd=1), check.KDA_OPS)


def test_count_kernel_ops_reports_the_launches_inside_the_block(monkeypatch):
    """The counter is the difference of the C++ launch counters across the block (a backward's
    launches included), by op; ops that did not launch are absent."""
    from kernel_fun import _ext

    state = {"cconv_fwd": 5, "kda_fwd": 2, "kda_bwd": 2}
    monkeypatch.setattr(_ext, "op_calls", lambda: dict(state))
    with check.count_kernel_ops() as counts:
        state["kda_fwd"] += 1
        state["kda_bwd"] += 3
    assert counts == {"kda_fwd": 1, "kda_bwd": 3}


def test_count_kernel_ops_without_launches_is_empty():
    with check.count_kernel_ops() as counts:
        torch.ones(3).sum()
    assert counts == {}


@pytest.mark.parametrize("case", ["equal", "scaled", "tiny", "zero", "zero-vs-tiny", "nan", "noise"])
def test_rel_rms_is_the_test_suites_metric(case):
    import helpers

    ref = torch.randn(257, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got = {"equal": lambda: ref.clone(), "scaled": lambda: 1.003 * ref, "tiny": lambda: None,
           "zero": lambda: torch.zeros_like(ref), "zero-vs-tiny": lambda: None,
           "nan": lambda: ref.where(ref > 0, torch.nan), "noise": lambda: ref + 0.01 * ref.flip(0)}[case]()
    if case == "tiny":
        ref, got = 1e-12 * ref, 2e-12 * ref
    if case == "zero-vs-tiny":
        ref, got = torch.zeros_like(ref), torch.full_like(ref, 1e-30)
    assert check.rel_rms(ref, got) == helpers.rel_rms(ref, got)


def test_tolerances_match_the_test_suite():
    import helpers

    assert check.CCONV_TOL == helpers.CCONV_TOL
    for name, tol in check.KDA_TOL.items():
        want = {"ddt_bias": helpers.KDA_TOL["dbias"], "dA_log": helpers.DA_LOG_TOL}.get(name)
        assert tol == (want if want is not None else helpers.KDA_TOL[name]), name


def test_forward_backward_plumbing_through_the_cpu_reference_path(monkeypatch):
    """The GPU checks' bodies on CPU tensors: kernel_fun's CPU path (the torch reference in fp32)
    against fp64, every output and input gradient compared. The CPU cconv path sums the bias
    gradient per sequence in bf16, hence the looser tolerance here (the GPU check keeps 1e-3)."""
    kda = check.kda_forward_backward(dict(B=2, T=70, H=1, HV=2, K=32, V=16), device="cpu", kernel_ops=())
    assert [p.split()[0] for p in kda.split(", ")] == ["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dA_log",
                                                        "ddt_bias", "dh0"]
    kda_varlen = check.kda_forward_backward(dict(B=1, T=70, H=1, HV=1, K=32, V=16, cu=(0, 1, 1, 70)),
                                            device="cpu", kernel_ops=())
    assert kda_varlen.startswith("o ")
    monkeypatch.setattr(check, "CCONV_TOL", 1e-2)
    for shape in (check.CCONV_DENSE, check.CCONV_VARLEN):
        cc = check.cconv_forward_backward(shape, device="cpu", kernel_ops=())
        assert [p.split()[0] for p in cc.split(", ")] == ["y", "ht", "dx", "dweight", "dbias", "dresidual", "dh0"]
    with pytest.raises(check.CheckFailed, match="our kernels did not run"):  # the CPU path runs no op of ours
        check.kda_forward_backward(dict(B=1, T=8, H=1, HV=1, K=16, V=16), device="cpu")


@pytest.mark.gpu
def test_every_check_passes_on_the_gpu(capsys):
    rc = check.main([])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "FAIL" not in out and out.count("PASS ") == len(check.family_checks("all"))
