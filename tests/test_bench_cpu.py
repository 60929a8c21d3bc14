"""CPU-only tests of the benchmark (CI has no GPU): the CLI's --list, --merge, argument checks and
no-GPU paths, the case list against the anchors, the byte model, the writers from synthetic rows,
the progress lines, and the runner's bookkeeping with fake implementations and a fake CUDA clock."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from kernel_fun.bench import cases as bc
from kernel_fun.bench import report, run as brun

@pytest.fixture(autouse=True)
def _restore_dispatch_memory():
    """The runner's probe and the fakes below touch kernel_fun._dispatch's once-only memory;
    leave it as we found it for the other test files."""
    from kernel_fun import _dispatch

    seen, logged = set(_dispatch._seen), _dispatch._versions_logged
    yield
    with _dispatch._lock:
        _dispatch._seen.clear()
        _dispatch._seen.update(seen)
    _dispatch._versions_logged = logged


ANCHOR_CASES = {"prod8192", "k3_h32", "small", "bounded_b16", "bounded_b8_h32", "bounded_b1", "long_b1_t32k",
                "long_b1_t32k_doc", "long_b1_t32k_h8", "long_docs_h8", "long_b1_t128k", "varlen", "gva",
                "cconv_d2048", "cconv_d4096", "cconv_small"}


def _cli(*args, env_extra=None):
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "kernel_fun.bench", *args], capture_output=True,
                          text=True, env=env, timeout=300)


# ---------------------------------------------------------------- CLI

def test_list_prints_every_case():
    r = _cli("--list")
    assert r.returncode == 0, r.stderr
    for name in ANCHOR_CASES:
        assert name in r.stdout
    assert "fwd+bwd GB" in r.stdout


def test_list_shows_the_flashkda_b8_h32_case():
    r = _cli("--list", "--family", "kda", "--pass", "fwd")
    assert r.returncode == 0, r.stderr
    names = [ln.split()[0] for ln in r.stdout.splitlines()[1:]]
    assert names[names.index("bounded_b16") + 1] == "bounded_b8_h32"
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("bounded_b8_h32 "))
    assert "B8 T8192 H32 K128 V128 bounded gate (lower_bound=-5, safe_gate)" in line
    # fwd bytes: q, k, g, v, o 8*8192*32*128*2 each, beta 8*8192*32*2, A_log 32*4, dt_bias 32*128*4
    bt = 8 * 8192
    fwd = 5 * bt * 32 * 128 * 2 + bt * 32 * 2 + 32 * 4 + 32 * 128 * 4
    assert line.split()[-1] == f"{fwd / 1e9:.3f}"


def test_list_filters_family_and_case():
    r = _cli("--list", "--family", "cconv")
    assert r.returncode == 0 and "cconv_d2048" in r.stdout and "prod8192" not in r.stdout
    r = _cli("--list", "--case", "varlen", "--case", "gva", "--pass", "fwd")
    assert r.returncode == 0
    body = r.stdout.splitlines()[1:]
    assert [ln.split()[0] for ln in body] == ["varlen", "gva"]
    assert "fwd+bwd" not in r.stdout


def test_unknown_case_is_an_error():
    r = _cli("--case", "nope")
    assert r.returncode == 2 and "unknown case" in r.stderr and "prod8192" in r.stderr


def test_no_gpu_says_so_points_to_list_and_merge_and_exits_1(tmp_path):
    r = _cli("--out", str(tmp_path))
    assert r.returncode == 1, r.stderr
    assert "no CUDA GPU found" in r.stderr and "--list" in r.stderr and "--merge" in r.stderr
    assert r.stdout == "" and list(tmp_path.iterdir()) == []


def test_no_gpu_message_in_process(monkeypatch, tmp_path, capsys):
    import kernel_fun.bench.__main__ as bm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bm.main(["--out", str(tmp_path), "--family", "cconv"]) == 1
    err = capsys.readouterr().err
    assert "no CUDA GPU found" in err and "--list" in err and "--merge" in err
    assert list(tmp_path.iterdir()) == []


def test_list_works_without_a_gpu(monkeypatch, capsys):
    import kernel_fun.bench.__main__ as bm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bm.main(["--list", "--family", "kda"]) == 0
    out = capsys.readouterr().out
    assert "prod8192" in out and "varlen" in out and "cconv_d2048" not in out


def test_merge_works_without_a_gpu(tmp_path):
    rows, _ = _synthetic_rows()
    (tmp_path / "a.json").write_text(json.dumps(rows))
    r = _cli("--merge", str(tmp_path / "a.json"), "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert "cconv_d2048" in r.stdout and (tmp_path / "out" / "h200.json").exists()


@pytest.mark.parametrize("args, named", [
    (["--budget-s", "-1"], "--budget-s"),
    (["--budget-s", "0"], "--budget-s"),
    (["--budget-s", "nan"], "--budget-s"),
    (["--budget-s", "soon"], "--budget-s"),
    (["--iters", "0"], "--iters"),
    (["--iters", "2.5"], "--iters"),
    (["--warmup", "0"], "--warmup"),
    (["--seed", "-1"], "--seed"),
    (["--case", "nope"], "--case"),
    (["--family", "gdn"], "--family"),
    (["--pass", "bwd"], "--pass"),
    (["--list", "--merge", "a.json"], "--merge"),
])
def test_nonsense_arguments_exit_2_naming_the_argument(args, named, capsys):
    import kernel_fun.bench.__main__ as bm

    with pytest.raises(SystemExit) as e:
        bm.main(args)
    assert e.value.code == 2
    assert f"argument {named}" in capsys.readouterr().err


def test_unreadable_merge_files_exit_2(tmp_path, capsys):
    import kernel_fun.bench.__main__ as bm

    (tmp_path / "obj.json").write_text("{}")
    for path, why in ((tmp_path / "missing.json", "cannot read"), (tmp_path / "obj.json", "not a results file")):
        with pytest.raises(SystemExit) as e:
            bm.main(["--merge", str(path), "--out", str(tmp_path / "out")])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--merge" in err and why in err
    assert not (tmp_path / "out").exists()


def test_budget_accepts_a_positive_number(capsys):
    from kernel_fun.bench.__main__ import _parser

    assert _parser().parse_args(["--budget-s", "2.5"]).budget_s == 2.5


def test_import_touches_neither_fla_nor_cuda():
    code = ("import sys, kernel_fun.bench, kernel_fun.bench.report, kernel_fun.bench.run\n"
            "assert not any(m == 'fla' or m.startswith('fla.') for m in sys.modules), 'fla imported'\n"
            "t = sys.modules.get('torch')\n"
            "assert t is None or not t.cuda.is_initialized(), 'CUDA initialised'\n"
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


# ---------------------------------------------------------------- the case list

def test_case_list_holds_every_anchor_case():
    assert set(bc.CASE_NAMES) == ANCHOR_CASES
    by = {c.name: c for c in bc.CASES}
    p = by["prod8192"]
    assert (p.B, p.T, p.H, p.HV, p.K, p.V, p.lower_bound) == (16, 8192, 16, 16, 128, 256, None)
    for n in ("bounded_b16", "bounded_b8_h32", "bounded_b1", "long_b1_t32k", "varlen"):
        c = by[n]
        assert (c.K, c.V, c.lower_bound, c.safe_gate) == (128, 128, -5.0, True), n
    assert (by["long_b1_t32k"].B, by["long_b1_t32k"].T, by["long_b1_t32k"].H) == (1, 32768, 32)
    h8 = by["long_b1_t32k_h8"]
    assert (h8.B, h8.T, h8.H, h8.HV, h8.K, h8.V, h8.lower_bound) == (1, 32768, 8, 8, 128, 128, -5.0)
    b = by["bounded_b8_h32"]  # anchors-h200.md: fla 6.73 ms for B8 T8192 H32 bounded fwd
    assert (b.B, b.T, b.H, b.HV, b.anchor_fla_ms) == (8, 8192, 32, 32, {"fwd": 6.73})
    assert bc.CASE_NAMES.index("bounded_b8_h32") == bc.CASE_NAMES.index("bounded_b16") + 1
    v = by["varlen"]
    assert v.doc_lens == (1300, 547, 2048, 963, 271, 3063) and v.B == 1 and v.T == 8192 and v.H == 32
    g = by["gva"]
    assert (g.H, g.HV, g.lower_bound) == (8, 16, None)
    assert (by["cconv_d4096"].B, by["cconv_d4096"].T, by["cconv_d4096"].D, by["cconv_d4096"].W) == (16, 8192, 4096, 4)
    assert all(c.activation == "silu" for c in bc.CASES if c.family == "cconv")


def test_select_and_passes():
    assert [c.name for c in bc.select("cconv")] == ["cconv_d2048", "cconv_d4096", "cconv_small"]
    assert [c.name for c in bc.select("all", ["gva", "small"])] == ["gva", "small"]  # the caller's order
    assert bc.passes("all") == ("fwd", "fwd+bwd")
    with pytest.raises(ValueError):
        bc.select("kda", ["nope"])
    with pytest.raises(ValueError):
        bc.passes("bwd")


# ---------------------------------------------------------------- byte model

def test_bytes_prod8192_match_the_anchor_floor():
    c = next(c for c in bc.CASES if c.name == "prod8192")
    bt = 16 * 8192
    qkg = 3 * bt * 16 * 128 * 2
    v = o = bt * 16 * 256 * 2
    beta = bt * 16 * 2
    small = 16 * 4 + 16 * 128 * 4  # A_log, dt_bias
    inputs = qkg + v + beta + small
    assert c.io_bytes() == (inputs, o)
    assert c.bytes("fwd") == inputs + o
    assert abs(c.bytes("fwd") / 1e9 - 3.76) < 0.01          # anchors-h200.md: 3.76 GB
    bwd = c.bytes("fwd+bwd") - c.bytes("fwd")
    assert bwd == 2 * inputs + o                             # re-read inputs, read do, write grads
    assert abs(bwd / 1e9 - 6.5) < 0.1                        # anchors-h200.md: ~6.5 GB


def test_bytes_cconv_floor_near_the_anchor():
    c = next(c for c in bc.CASES if c.name == "cconv_d2048")
    ms = c.bytes("fwd") / 4.21e12 * 1e3
    assert abs(ms - 0.25) < 0.01                             # anchors: HBM floor fwd 0.25 ms
    assert 0.60 < c.bytes("fwd+bwd") / 4.21e12 * 1e3 < 0.66  # anchors: 0.62 ms


def test_gva_and_varlen_bytes():
    g = next(c for c in bc.CASES if c.name == "gva")
    i, o = g.io_bytes()
    bt = 8 * 8192
    assert o == bt * 16 * 128 * 2
    assert i == 2 * bt * 8 * 128 * 2 + 2 * bt * 16 * 128 * 2 + bt * 16 * 2 + 16 * 4 + 16 * 128 * 4
    v = next(c for c in bc.CASES if c.name == "varlen")
    assert v.io_bytes()[0] % 4 == 0 and v.io_bytes()[0] > v.io_bytes()[1]


# ---------------------------------------------------------------- writers

def _synthetic_rows():
    meta = {"gpu": "h200", "device_name": "NVIDIA H200", "copy_tbps": 4.2, "date": "2026-11-29 12:00:00 UTC",
            "versions": {"kernel_fun": "0.1.0", "torch": "2.11.0", "fla": "0.5.2", "triton": "3.6.0"}}
    common = {k: meta[k] for k in ("gpu", "device_name", "copy_tbps", "versions", "date")}
    c = next(c for c in bc.CASES if c.name == "cconv_d2048")
    k = next(c for c in bc.CASES if c.name == "prod8192")
    rows = []
    for case, pass_, ours_ms, fla_ms, note in (
            (c, "fwd", 0.30, 0.60, None),
            (k, "fwd+bwd", None, 49.5, "backward not implemented: routes to fla"),
    ):
        for impl, ms in (("kernel_fun", ours_ms), ("fla", fla_ms)):
            b = case.bytes(pass_)
            rows.append(report.new_row(
                family=case.family, case=case.name, impl=impl, ms=ms, bytes=b,
                status="ok" if ms is not None else "not_run",
                note=None if ms is not None else note,
                tbps=None if ms is None else b / (ms * 1e-3) / 1e12,
                roofline_frac=None if ms is None else b / (ms * 1e-3) / 1e12 / 4.2,
                floor_ms=b / 4.2e12 * 1e3, peak_mem_gib=None if ms is None else 1.5,
                anchor_fla_ms=dict(case.anchor_fla_ms), shape=case.shape(), params=case.params(),
                iters=10, warmup=3, **{"pass": pass_}, **common))
    rows[0]["speedup_vs_fla"] = report.speedup(rows[0], rows[1])
    return rows, dict(meta, iters=10, warmup=3, flush_l2=True, wall_s=12.0)


def test_writers_from_synthetic_rows(tmp_path):
    rows, meta = _synthetic_rows()
    msgs = report.write_all(rows, meta, str(tmp_path))
    names = sorted(p.name for p in tmp_path.iterdir())
    try:
        import matplotlib  # noqa: F401
        assert names == ["h200.json", "h200.md", "h200.png"]
        assert (tmp_path / "h200.png").read_bytes()[:4] == b"\x89PNG"
    except ImportError:
        assert names == ["h200.json", "h200.md"]
        assert any("PNG skipped" in m for m in msgs)
    data = json.loads((tmp_path / "h200.json").read_text())
    assert isinstance(data, list) and len(data) == 4
    for r in data:
        for key in ("family", "case", "pass", "impl", "ms", "gpu", "bytes", "tbps", "status",
                    "peak_mem_gib", "versions", "shape", "params"):
            assert key in r
        assert r["pass"] in ("fwd", "fwd+bwd", "bwd") and r["impl"] in report.IMPLS
        assert r["status"] in report.STATUSES
        if r["status"] != "ok":
            assert r["ms"] is None and r["note"]
    assert data[0]["speedup_vs_fla"] == pytest.approx(2.0)
    md = (tmp_path / "h200.md").read_text()
    assert "NVIDIA H200" in md and "2026-11-29" in md and "4.20 TB/s" in md and "0.5.2" in md
    assert "2.00x" in md and "not run" in md and "backward not implemented" in md
    assert md.count("| cconv_d2048 | fwd |") == 1 and "| prod8192 | fwd+bwd |" in md
    table = report.format_table(rows)
    assert "2.00x" in table and "not run" in table


def test_writers_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    rows, meta = _synthetic_rows()
    msgs = report.write_all(rows, meta, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h200.json", "h200.md"]
    assert any("PNG skipped" in m for m in msgs)
    assert "PNG skipped" in (tmp_path / "h200.md").read_text()


def test_gpu_slug():
    assert report.gpu_slug("NVIDIA H200") == "h200"
    assert report.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert report.gpu_slug("") == "gpu"


def test_format_duration():
    assert [brun.format_duration(s) for s in (0, 4.4, 59.4, 83, 3599, 3600, 7500)] == \
        ["0s", "4s", "59s", "1m23s", "59m59s", "1h00m", "2h05m"]


def test_format_progress():
    # before any unit has finished there is no mean to extrapolate from
    assert brun.format_progress(1, 12, "kda prod8192 fwd", 0.2, []) == \
        "[1/12] kda prod8192 fwd  elapsed 0s  eta ?"
    # unit 3 starts: 2 done, mean 25 s, 10 not finished (this one included) -> 250 s
    assert brun.format_progress(3, 12, "kda prod8192 fwd+bwd", 83, [20.0, 30.0]) == \
        "[3/12] kda prod8192 fwd+bwd  elapsed 1m23s  eta ~4m10s"
    # unit 3 ends after 33 s: mean 27.67 s x 9 left = 249 s
    assert brun.format_progress(3, 12, "kda prod8192 fwd+bwd", 116, [20.0, 30.0, 33.0], 33.0) == \
        "[3/12] kda prod8192 fwd+bwd  done in 33s  elapsed 1m56s  eta ~4m09s"
    assert brun.format_progress(2, 2, "cconv t fwd", 5, [2.0, 3.0], 3.0).endswith("eta ~0s")


def test_new_row_rejects_unknown_keys():
    with pytest.raises(KeyError):
        report.new_row(bogus=1)


# ---------------------------------------------------------------- the runner, on a fake clock

class _FakeEvent:
    def __init__(self, enable_timing=True):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 1 << 28)


def _kda_math(q, k, v, g, beta, **kw):
    o = v * torch.sigmoid(beta.float()).to(v.dtype).unsqueeze(-1)
    return o + 0 * (q.sum() + k.sum() + g.sum()).to(v.dtype), None


def _cconv_math(x, w, activation=None, **kw):
    return torch.nn.functional.silu(x * w[:, -1]), None


def _kda_routes_grad_to_fla(q, k, v, g, beta, **kw):
    from kernel_fun import _dispatch

    if q.requires_grad and torch.is_grad_enabled():
        _dispatch.log_fallback("kda", "backward not implemented yet")
    else:
        _dispatch.log_engaged("kda", "fake")
    return _kda_math(q, k, v, g, beta, **kw)


def _ok(*a, **k):
    return True, None


TINY = [bc.KdaCase("t_kda", B=1, T=64, H=2, HV=4, K=8, V=8, anchor_fla_ms={"fwd": 1.0}),
        bc.KdaCase("t_varlen", B=1, T=40, H=2, HV=2, K=8, V=8, lower_bound=-5.0, safe_gate=True,
                   doc_lens=(10, 30)),
        bc.CconvCase("t_cc", B=2, T=32, D=16)]


def _run(monkeypatch, ours: dict, fla: dict, cases=TINY, passes=bc.PASSES, with_fla=True, progress=None):
    monkeypatch.setattr(brun, "load_ours", lambda fam: ours[fam])
    monkeypatch.setattr(brun, "load_fla", lambda fam: fla[fam])
    cfg = brun.Config(cases=list(cases), passes=passes, iters=3, warmup=2, with_fla=with_fla,
                      flush_l2=False, device="cpu")
    meta = {"gpu": "fake", "device_name": "Fake GPU", "copy_tbps": 1.0, "versions": {}, "date": "d"}
    return brun.run(cfg, meta, log=lambda s: None, progress=progress)


def _by(rows):
    return {(r["case"], r["pass"], r["impl"]): r for r in rows}


def test_runner_times_both_and_fills_rows(fake_cuda, monkeypatch):
    rows = _run(monkeypatch,
                ours={"kda": (_kda_routes_grad_to_fla, _ok, None), "cconv": (_cconv_math, _ok, None)},
                fla={"kda": (_kda_math, None), "cconv": (_cconv_math, None)})
    by = _by(rows)
    assert len(rows) == 3 * 2 * 2
    r = by[("t_kda", "fwd", "kernel_fun")]
    assert r["status"] == "ok" and r["ms"] > 0 and r["engaged"] is True
    assert r["bytes"] == TINY[0].bytes("fwd") and r["tbps"] > 0 and r["roofline_frac"] == pytest.approx(r["tbps"])
    assert r["peak_mem_gib"] == pytest.approx(0.25) and r["speedup_vs_fla"] > 0
    assert r["anchor_fla_ms"] == {"fwd": 1.0} and r["shape"]["HV"] == 4
    # gradient-needing KDA call routed to fla: not timed, not faked
    r = by[("t_kda", "fwd+bwd", "kernel_fun")]
    assert r["status"] == "not_run" and r["ms"] is None and r["engaged"] is False
    assert r["note"].startswith("backward not implemented: routes to fla")
    assert r["speedup_vs_fla"] is None
    assert by[("t_kda", "fwd+bwd", "fla")]["status"] == "ok"
    assert by[("t_cc", "fwd+bwd", "kernel_fun")]["status"] == "ok"
    # a second case of the same family still sees the fallback (once-only logging is reset)
    assert by[("t_varlen", "fwd+bwd", "kernel_fun")]["status"] == "not_run"
    assert by[("t_varlen", "fwd", "kernel_fun")]["status"] == "ok"
    # the leaves are left without grads
    for r in rows:
        assert set(r) == set(report.ROW_KEYS)


def test_runner_honours_is_supported_and_missing_pieces(fake_cuda, monkeypatch):
    def says_no(q, v, **kw):
        return False, "K must be 128"

    def raises(x, w, **kw):
        raise TypeError("boom")

    rows = _run(monkeypatch,
                ours={"kda": (_kda_math, says_no, None), "cconv": (_cconv_math, raises, None)},
                fla={"kda": (None, "fla not importable (No module named 'fla')"),
                     "cconv": (_cconv_math, None)})
    by = _by(rows)
    r = by[("t_kda", "fwd", "kernel_fun")]
    assert r["status"] == "not_run" and r["ms"] is None and "K must be 128" in r["note"]
    r = by[("t_kda", "fwd", "fla")]
    assert r["status"] == "not_run" and "fla not importable" in r["note"]
    r = by[("t_cc", "fwd", "kernel_fun")]
    assert r["status"] == "not_run" and "TypeError: boom" in r["note"]
    assert by[("t_cc", "fwd", "fla")]["status"] == "ok"

    rows = _run(monkeypatch,
                ours={"kda": (None, None, "kernel_fun.kda.chunk_kda missing (family not implemented yet)"),
                      "cconv": (_cconv_math, _ok, None)},
                fla={"kda": (_kda_math, None), "cconv": (_cconv_math, None)}, with_fla=False)
    assert {r["impl"] for r in rows} == {"kernel_fun"}
    r = _by(rows)[("t_kda", "fwd", "kernel_fun")]
    assert r["status"] == "not_run" and "not implemented yet" in r["note"]


def test_runner_stops_after_a_broken_context(fake_cuda, monkeypatch):
    def crashes(*a, **k):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    lines = []
    rows = _run(monkeypatch,
                ours={"kda": (crashes, _ok, None), "cconv": (_cconv_math, _ok, None)},
                fla={"kda": (_kda_math, None), "cconv": (_cconv_math, None)}, progress=lines.append)
    assert rows[0]["status"] == "error" and "illegal memory access" in rows[0]["note"]
    for r in rows[1:]:
        assert r["status"] == "not_run" and r["ms"] is None and "context broken" in r["note"]
    # the unit that broke ends normally; the rest is announced once, not line by line
    assert lines[0].startswith("[1/6] kda t_kda fwd  elapsed") and lines[1].startswith("[1/6] kda t_kda fwd  done in")
    assert len(lines) == 3 and lines[2].startswith("[2/6] skipped: CUDA context broken")
    assert lines[2].endswith("this and the 4 after it not run")


def test_runner_reports_progress_per_case_and_pass(fake_cuda, monkeypatch):
    lines = []
    _run(monkeypatch,
         ours={"kda": (_kda_math, _ok, None), "cconv": (_cconv_math, _ok, None)},
         fla={"kda": (_kda_math, None), "cconv": (_cconv_math, None)}, progress=lines.append)
    units = [f"{c.family} {c.name} {p}" for c in TINY for p in bc.PASSES]
    assert len(lines) == 2 * len(units)
    for i, what in enumerate(units):
        start, end = lines[2 * i], lines[2 * i + 1]
        assert start.startswith(f"[{i + 1}/6] {what}  elapsed ") and "done in" not in start
        assert end.startswith(f"[{i + 1}/6] {what}  done in ")
    assert lines[0].endswith("eta ?") and lines[1].split("eta ")[1].startswith("~")


def test_engagement_probe_reads_the_dispatch_log():
    from kernel_fun import _dispatch

    with brun.EngagementProbe("cconv") as p:
        _dispatch.log_fallback("cconv", "W=5 unsupported")
    assert p.fallbacks == ["W=5 unsupported"] and p.verdict() is False
    with brun.EngagementProbe("cconv") as p:  # same message again: still seen
        _dispatch.log_fallback("cconv", "W=5 unsupported")
    assert p.fallbacks == ["W=5 unsupported"]
    assert logging.getLogger("kernel_fun").handlers == []


def _fake_main_env(monkeypatch):
    import functools

    import kernel_fun.bench.__main__ as bm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bm, "select", lambda family, names: list(TINY))
    monkeypatch.setattr(brun, "Config", functools.partial(brun.Config, device="cpu"))
    monkeypatch.setattr(brun, "gather_meta", lambda torch_: {
        "gpu": "fake-gpu", "device_name": "Fake GPU", "copy_tbps": 1.0, "versions": {"fla": "0.5.2"},
        "date": "2026-11-29"})
    monkeypatch.setattr(brun, "load_ours", lambda fam: {"kda": (_kda_routes_grad_to_fla, _ok, None),
                                                        "cconv": (_cconv_math, _ok, None)}[fam])
    monkeypatch.setattr(brun, "load_fla", lambda fam: ({"kda": _kda_math, "cconv": _cconv_math}[fam], None))
    return bm


def test_main_end_to_end_writes_exactly_three_files(fake_cuda, monkeypatch, tmp_path, capsys):
    bm = _fake_main_env(monkeypatch)
    assert bm.main(["--out", str(tmp_path), "--no-flush", "--iters", "3"]) == 0
    out, err = capsys.readouterr()
    assert "fla/ours" in out and "t_kda" in out and "backward not implemented" in out
    # progress goes to stderr only: stdout stays the log and the table
    assert "[1/6] kda t_kda fwd  elapsed" in err and "[6/6] cconv t_cc fwd+bwd  done in" in err
    assert "[1/6]" not in out and "eta" not in out
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[:2] == ["fake-gpu.json", "fake-gpu.md"] and len(names) <= 3
    assert "partial" not in (tmp_path / "fake-gpu.md").read_text()
    rows = json.loads((tmp_path / "fake-gpu.json").read_text())
    assert len(rows) == len(TINY) * 2 * 2 and all(r["iters"] == 3 for r in rows)


def test_main_budget_reports_the_rest_as_not_run(fake_cuda, monkeypatch, tmp_path, capsys):
    bm = _fake_main_env(monkeypatch)
    # the smallest budget the parser accepts (0 is refused) is used up before the first case
    assert bm.main(["--out", str(tmp_path), "--no-flush", "--budget-s", "1e-9"]) == 0
    rows = json.loads((tmp_path / "fake-gpu.json").read_text())
    assert rows and all(r["status"] == "not_run" and r["ms"] is None and "budget" in r["note"] for r in rows)
    assert "[1/6] skipped: --budget-s 1e-09 used up before this case" in capsys.readouterr().err


def test_merge_runs_prefers_the_newest_timed_row(tmp_path):
    import json

    from kernel_fun.bench import __main__ as cli
    from kernel_fun.bench import report

    def row(case, impl, status, ms, date):
        return report.new_row(family="kda", case=case, **{"pass": "fwd"}, impl=impl, status=status, ms=ms,
                              date=date, gpu="h200", device_name="NVIDIA H200")

    a = [row("prod8192", "kernel_fun", "ok", 6.4, "2026-11-29T22:00"),
         row("varlen", "kernel_fun", "not_run", None, "2026-11-29T22:00")]
    b = [row("prod8192", "kernel_fun", "not_run", None, "2026-11-29T22:30"),
         row("varlen", "kernel_fun", "ok", 0.8, "2026-11-29T22:30")]
    rows, meta = report.merge_runs([a, b])
    got = {(r["case"], r["status"]): r["ms"] for r in rows}
    assert got == {("prod8192", "ok"): 6.4, ("varlen", "ok"): 0.8}
    assert "merged from 2 runs" in meta["notes"][0]
    # a merged table merged again with a third run counts the runs its rows come from, not its inputs
    c = [row("small", "kernel_fun", "ok", 0.5, "2026-11-29T23:00")]
    _, meta2 = report.merge_runs([rows, c])
    assert "merged from 3 runs" in meta2["notes"][0]
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert cli.main(["--merge", str(pa), str(pb), "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "h200.json").read_text())[1]["ms"] == 0.8


def test_forward_rows_leave_no_inference_tensors_for_the_fwd_bwd_row(fake_cuda, monkeypatch):
    # fla caches tensors derived from cu_seqlens (its chunk indices) across calls. A tensor cached
    # while a forward row ran under inference_mode cannot be saved for backward by the fwd+bwd row
    # that follows: fla's varlen fwd+bwd failed that way on the H200 until forward rows moved to
    # no_grad.
    cache = {}

    def _kda_caching(q, k, v, g, beta, **kw):
        if "idx" not in cache:
            cache["idx"] = torch.ones(v.shape[-1], dtype=v.dtype)  # made inside whichever pass runs first
        return (v * cache["idx"]) * torch.sigmoid(beta.float()).to(v.dtype).unsqueeze(-1), None

    rows = _run(monkeypatch, ours={"kda": (_kda_math, _ok, None)}, fla={"kda": (_kda_caching, None)},
                cases=TINY[1:2])
    by = _by(rows)
    assert by[("t_varlen", "fwd", "fla")]["status"] == "ok"
    r = by[("t_varlen", "fwd+bwd", "fla")]
    assert r["status"] == "ok", r["note"]


# ---------------------------------------------------------------- FlashKDA rows

FLASHKDA_ROWS = {("bounded_b16", "fwd"), ("bounded_b8_h32", "fwd"), ("bounded_b1", "fwd"),
                 ("long_b1_t32k", "fwd"), ("long_b1_t32k_doc", "fwd"), ("long_b1_t32k_h8", "fwd"),
                 ("long_docs_h8", "fwd"), ("long_b1_t128k", "fwd"), ("varlen", "fwd")}


def test_flashkda_rows_only_for_bounded_forward_k128_without_gva():
    got = {(c.name, p) for c in bc.CASES for p in bc.PASSES if brun.flashkda_supports(c, p)}
    assert got == FLASHKDA_ROWS  # none for prod8192 (V=256, unbounded), gva, cconv or fwd+bwd
    bnd = dict(B=1, T=64, lower_bound=-5.0, safe_gate=True)
    assert brun.flashkda_supports(bc.KdaCase("x", H=2, HV=2, K=128, V=128, **bnd), "fwd")
    for c in (bc.KdaCase("x", H=2, HV=2, K=64, V=128, **bnd),           # K != 128
              bc.KdaCase("x", H=2, HV=2, K=128, V=64, **bnd),           # V != 128
              bc.KdaCase("x", H=2, HV=4, K=128, V=128, **bnd),          # GVA
              bc.KdaCase("x", B=1, T=64, H=2, HV=2, K=128, V=128),      # unbounded gate
              bc.KdaCase("x", B=1, T=64, H=2, HV=2, K=128, V=128, lower_bound=-5.0),  # no safe_gate
              bc.KdaCase("x", B=1, T=64, H=2, HV=2, K=128, V=128, lower_bound=-6.0, safe_gate=True),
              bc.KdaCase("x", H=2, HV=2, K=128, V=128, dtype="fp16", **bnd)):
        assert not brun.flashkda_supports(c, "fwd"), c
    assert not brun.flashkda_supports(bc.KdaCase("x", H=2, HV=2, K=128, V=128, **bnd), "fwd+bwd")


FK_CASES = [bc.KdaCase("t_fk", B=2, T=64, H=2, HV=2, K=128, V=128, lower_bound=-5.0, safe_gate=True),
            bc.KdaCase("t_fk_varlen", B=1, T=64, H=2, HV=2, K=128, V=128, lower_bound=-5.0, safe_gate=True,
                       doc_lens=(20, 44))]


class _FakeFlashKda:
    """flash_kda.fwd as its docstring states it, computed independently of kernel_fun.kda: asserts
    the argument types and layouts, writes ``out`` in place; ``skew`` scales the result (a wrong
    mapping)."""

    def __init__(self, skew=1.0):
        self.calls, self.skew = [], skew

    def fwd(self, q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None,
            final_state=None, cu_seqlens=None):
        from kernel_fun.ref.kda import naive_recurrent_kda

        B, T, H, K = q.shape
        assert all(t.dtype == torch.bfloat16 for t in (q, k, v, g, beta, out))
        assert v.shape == out.shape == (B, T, H, 128) and K == 128 and beta.shape == (B, T, H)
        assert A_log.dtype == dt_bias.dtype == torch.float32 and A_log.shape == (H,) and dt_bias.shape == (H, K)
        assert isinstance(lower_bound, float) and -5.0 <= lower_bound <= 0.0 and scale == K ** -0.5
        assert initial_state is None and final_state is None
        if cu_seqlens is not None:
            assert cu_seqlens.dtype == torch.int64 and B == 1
        self.calls.append(dict(out=out, dt_bias=dt_bias, cu_seqlens=cu_seqlens))
        gate = lower_bound * torch.sigmoid(torch.exp(A_log)[:, None] * (g.float() + dt_bias))
        o, _ = naive_recurrent_kda(q.float(), k.float(), v.float(), gate, torch.sigmoid(beta.float()),
                                   scale=scale, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
        out.copy_(o * self.skew)


def _run_fk(monkeypatch, fk, passes=bc.PASSES, ours=None, with_flashkda=True, cases=FK_CASES):
    from kernel_fun.kda import chunk_kda  # on CPU tensors: its torch reference

    monkeypatch.setattr(brun, "load_flashkda", lambda: fk)
    ours = ours or {"kda": (chunk_kda, _ok, None)}
    monkeypatch.setattr(brun, "load_ours", lambda fam: ours[fam])
    cfg = brun.Config(cases=list(cases), passes=passes, iters=3, warmup=2, with_fla=False,
                      with_flashkda=with_flashkda, flush_l2=False, device="cpu")
    meta = {"gpu": "fake", "device_name": "Fake GPU", "copy_tbps": 1.0, "versions": {}, "date": "d"}
    return brun.run(cfg, meta, log=lambda s: None)


def test_flashkda_row_is_timed_and_agrees_with_kernel_fun(fake_cuda, monkeypatch):
    fk = _FakeFlashKda()
    rows = _run_fk(monkeypatch, (fk.fwd, None))
    by = _by(rows)
    # forward rows only; fwd+bwd has none
    assert sorted(k for k in by if k[2] == "flashkda") == [("t_fk", "fwd", "flashkda"),
                                                          ("t_fk_varlen", "fwd", "flashkda")]
    for name in ("t_fk", "t_fk_varlen"):
        r = by[(name, "fwd", "flashkda")]
        assert r["status"] == "ok", r["note"]
        assert r["ms"] > 0 and r["tbps"] > 0 and r["bytes"] == by[(name, "fwd", "kernel_fun")]["bytes"]
        # bf16 outputs of two fp32 computations of the same thing: ~ bf16 rounding apart
        assert 0 < r["rel_rms_vs_kernel_fun"] < 5e-3
        assert r["note"] == f"rel-RMS vs kernel_fun {r['rel_rms_vs_kernel_fun']:.1e}"
        assert r["engaged"] is None and r["speedup_vs_fla"] is None and set(r) == set(report.ROW_KEYS)
        assert by[(name, "fwd", "kernel_fun")]["rel_rms_vs_kernel_fun"] is None
    # warm-up 2 + timed 3 + the agreement call, per case; a fresh `out` each call, the converted
    # dt_bias / cu_seqlens made once per case
    assert len(fk.calls) == 2 * 6
    for calls in (fk.calls[:6], fk.calls[6:]):
        assert len({id(c["out"]) for c in calls}) == 6
        assert len({id(c["dt_bias"]) for c in calls}) == 1
    assert all(c["cu_seqlens"] is None for c in fk.calls[:6])
    assert fk.calls[6]["cu_seqlens"].tolist() == [0, 20, 44 + 20]


def test_flashkda_disagreement_is_an_error_not_a_timing(fake_cuda, monkeypatch):
    rows = _run_fk(monkeypatch, (_FakeFlashKda(skew=1.1).fwd, None), passes=("fwd",), cases=FK_CASES[:1])
    r = _by(rows)[("t_fk", "fwd", "flashkda")]
    assert r["status"] == "error" and r["ms"] is None and r["tbps"] is None
    assert 0.09 < r["rel_rms_vs_kernel_fun"] < 0.11
    assert r["note"].startswith("disagrees with kernel_fun's chunk_kda on the same inputs: rel-RMS 0.1")
    assert "> 0.02" in r["note"] and "not reported" in r["note"]
    assert _by(rows)[("t_fk", "fwd", "kernel_fun")]["status"] == "ok"


def test_flashkda_not_importable_is_not_run_with_the_error(fake_cuda, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_kda", None)  # makes `import flash_kda` fail
    fk = brun.load_flashkda()
    assert fk[0] is None and fk[1].startswith("flash_kda not importable (ModuleNotFoundError: ")
    assert fk[1].endswith(")") and "flash_kda" in fk[1][len("flash_kda not importable"):]
    rows = _run_fk(monkeypatch, fk)
    fk_rows = [r for r in rows if r["impl"] == "flashkda"]
    assert [(r["case"], r["pass"]) for r in fk_rows] == [("t_fk", "fwd"), ("t_fk_varlen", "fwd")]
    for r in fk_rows:
        assert r["status"] == "not_run" and r["ms"] is None and r["note"] == fk[1]
    # --no-flashkda: no rows at all, and flash_kda is not even looked for
    monkeypatch.setattr(brun, "load_flashkda", lambda: pytest.fail("load_flashkda called"))
    from kernel_fun.kda import chunk_kda

    monkeypatch.setattr(brun, "load_ours", lambda fam: (chunk_kda, _ok, None))
    cfg = brun.Config(cases=list(FK_CASES), passes=("fwd",), iters=1, warmup=1, with_fla=False,
                      with_flashkda=False, flush_l2=False, device="cpu")
    rows = brun.run(cfg, {"copy_tbps": 1.0}, log=lambda s: None)
    assert {r["impl"] for r in rows} == {"kernel_fun"}


def test_flashkda_needs_kernel_fun_for_its_agreement_check(fake_cuda, monkeypatch):
    fk = _FakeFlashKda()
    rows = _run_fk(monkeypatch, (fk.fwd, None), passes=("fwd",), cases=FK_CASES[:1],
                   ours={"kda": (None, None, "kernel_fun.kda not importable: boom")})
    r = _by(rows)[("t_fk", "fwd", "flashkda")]
    assert r["status"] == "not_run" and r["ms"] is None and fk.calls == []
    assert r["note"] == "not timed: its agreement check needs kernel_fun's chunk_kda (kernel_fun.kda not importable: boom)"


def test_no_flashkda_flag():
    from kernel_fun.bench.__main__ import _parser

    assert _parser().parse_args(["--no-flashkda"]).no_flashkda is True
    assert _parser().parse_args([]).no_flashkda is False
    assert brun.Config(cases=[], passes=("fwd",)).with_flashkda is True


def _flashkda_table_rows():
    rows, meta = _synthetic_rows()
    b = next(c for c in bc.CASES if c.name == "bounded_b16")
    common = {k: rows[0][k] for k in ("gpu", "device_name", "copy_tbps", "versions", "date", "iters", "warmup")}
    for impl, ms, note, rel in (("kernel_fun", 3.0, None, None), ("fla", 6.0, None, None),
                                ("flashkda", 3.3, "rel-RMS vs kernel_fun 3.1e-03", 3.1e-3)):
        rows.append(report.new_row(family="kda", case=b.name, impl=impl, ms=ms, status="ok", note=note,
                                   bytes=b.bytes("fwd"), rel_rms_vs_kernel_fun=rel, shape=b.shape(),
                                   params=b.params(), anchor_fla_ms=dict(b.anchor_fla_ms),
                                   **{"pass": "fwd"}, **common))
    return rows, meta


def test_table_has_flashkda_columns_blank_without_a_row(tmp_path):
    rows, meta = _flashkda_table_rows()
    h = report.TABLE_HEADER
    i_ms, i_ratio = h.index("flashkda ms"), h.index("flashkda/ours")
    assert i_ratio == i_ms + 1 and h.index("fla/ours") < i_ms
    lines = {(t[0], t[1]): t for t in report.table_rows(rows)}
    bnd = lines[("bounded_b16", "fwd")]
    assert (bnd[i_ms], bnd[i_ratio], bnd[h.index("fla/ours")]) == ("3.300", "1.10x", "2.00x")
    assert bnd[-1] == "flashkda: rel-RMS vs kernel_fun 3.1e-03"
    for key in (("cconv_d2048", "fwd"), ("prod8192", "fwd+bwd")):
        assert (lines[key][i_ms], lines[key][i_ratio]) == ("", "")
    # a flashkda row that did not run: said so, no ratio
    rows[-1].update(status="not_run", ms=None, note="flash_kda not importable (x)")
    bnd = {(t[0], t[1]): t for t in report.table_rows(rows)}[("bounded_b16", "fwd")]
    assert (bnd[i_ms], bnd[i_ratio]) == ("not run", "-") and "flashkda: flash_kda not importable (x)" in bnd[-1]
    rows, meta = _flashkda_table_rows()
    report.write_all(rows, meta, str(tmp_path))
    md = (tmp_path / "h200.md").read_text()
    assert "| fla/ours | flashkda ms | flashkda/ours |" in md
    assert "| bounded_b16 | fwd | 3.000 | 6.000 | 2.00x | 3.300 | 1.10x |" in md
    assert "| cconv_d2048 | fwd | 0.300 | 0.600 | 2.00x |  |  |" in md
    data = json.loads((tmp_path / "h200.json").read_text())
    fk = [r for r in data if r["impl"] == "flashkda"]
    assert len(fk) == 1 and fk[0]["rel_rms_vs_kernel_fun"] == 3.1e-3 and "flashkda" in report.IMPLS
    table = report.format_table(rows)
    assert "flashkda ms" in table and "1.10x" in table


def test_merge_note_names_the_rows_whose_fla_time_is_older():
    """A run with --no-fla merged over one with fla: the note names each row pair from two
    processes (the table's ratio there is across runs), and only those."""
    from kernel_fun.bench import report

    def row(case, impl, ms, date):
        return report.new_row(family="kda", case=case, **{"pass": "fwd"}, impl=impl, status="ok", ms=ms,
                              date=date, gpu="h200", device_name="NVIDIA H200")

    old = [row("prod8192", "kernel_fun", 4.2, "D1"), row("prod8192", "fla", 9.2, "D1"),
           row("small", "kernel_fun", 0.5, "D1"), row("small", "fla", 1.3, "D1")]
    new = [row("prod8192", "kernel_fun", 4.1, "D2")]
    _, meta = report.merge_runs([old, new])
    assert "except in these rows" in meta["notes"][0]
    assert "prod8192 fwd (ours D2, fla D1)" in meta["notes"][0] and "small" not in meta["notes"][0]
    _, meta = report.merge_runs([old])
    assert "come from the same process" in meta["notes"][0] and "except" not in meta["notes"][0]
    # FlashKDA's rows likewise: a run without FlashKDA over one with it
    old_fk = [row("bounded_b16", "kernel_fun", 3.0, "D1"), row("bounded_b16", "flashkda", 3.5, "D1")]
    _, meta = report.merge_runs([old_fk, [row("bounded_b16", "kernel_fun", 2.9, "D2")]])
    assert "bounded_b16 fwd (ours D2, flashkda D1)" in meta["notes"][0]


def test_merge_runs_keeps_flashkda_rows():
    rows, _ = _flashkda_table_rows()
    old = [dict(r, ms=None, status="not_run", note="flash_kda not importable (x)", date="2026-11-01")
           for r in rows if r["impl"] == "flashkda"]
    merged, _ = report.merge_runs([old, rows])
    fk = [r for r in merged if r["impl"] == "flashkda"]
    assert len(fk) == 1 and fk[0]["status"] == "ok" and fk[0]["ms"] == 3.3
    merged, _ = report.merge_runs([rows, old])  # the newer untimed row does not replace a timing
    assert [r["ms"] for r in merged if r["impl"] == "flashkda"] == [3.3]


def test_build_flashkda_script_links_cutlass_and_builds_in_place(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env.pop("FLASH_KDA_CUDA_ARCHS", None)
    r = subprocess.run(["bash", os.path.join(root, "scripts", "build_flashkda.sh"), str(tmp_path / "none")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and "no FlashKDA source tree" in r.stderr
    # a stand-in tree: setup.py records what the build sees, flash_kda imports
    src = tmp_path / "fk"
    (src / "flash_kda").mkdir(parents=True)
    (src / "cutlass").mkdir()  # what `git archive` leaves for the submodule
    (src / "flash_kda" / "__init__.py").write_text("def fwd(*a, **k):\n    pass\n")
    (src / "setup.py").write_text(
        "import os, subprocess, sys\n"
        "git = subprocess.run(['git', 'rev-parse', 'HEAD'], capture_output=True).returncode\n"
        "inc = all(os.path.isdir(os.path.join('cutlass', d)) for d in ('include', 'tools/util/include', 'examples/common'))\n"
        "open('seen.txt', 'w').write(f\"{sys.argv[1:]} {os.environ['FLASH_KDA_CUDA_ARCHS']} git={git} inc={inc}\")\n")
    r = subprocess.run(["bash", os.path.join(root, "scripts", "build_flashkda.sh"), str(src)],
                       capture_output=True, text=True, env=env, timeout=120)
    import importlib.util

    spec = importlib.util.find_spec("cutlass_library")  # nvidia-cutlass: our own build needs it too
    assert r.returncode == 0, r.stderr
    assert (src / "seen.txt").read_text() == "['build_ext', '--inplace'] 90a git=1 inc=True"
    assert os.path.islink(src / "cutlass")
    assert os.path.realpath(src / "cutlass") == os.path.realpath(
        os.path.join(list(spec.submodule_search_locations)[0], "source"))
    assert f"export PYTHONPATH={src}" in r.stdout


# ---------------------------------------------------------------- --host-ahead

def test_host_ahead_sleep_is_twice_the_slowest_enqueue_within_bounds():
    assert brun.host_ahead_ms([5.0, 0.001, 0.002]) == pytest.approx(4.0)  # first call (compile) left out
    assert brun.host_ahead_ms([0.001]) == pytest.approx(2.0)                # one call: it is all there is
    assert brun.host_ahead_ms([0.0, 0.0001]) == brun.HOST_AHEAD_MIN_MS
    assert brun.host_ahead_ms([]) == brun.HOST_AHEAD_MIN_MS
    assert brun.host_ahead_ms([0.0, 1.0]) == brun.HOST_AHEAD_MAX_MS


def test_host_ahead_puts_one_gpu_sleep_before_each_timed_call(fake_cuda, monkeypatch):
    trace = []
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: trace.append(("sleep", cycles)), raising=False)
    monkeypatch.setattr(brun, "_sleep_cycles_per_ms", 1000.0)  # the calibration's result, 1 cycle per us
    orig_record = _FakeEvent.record
    monkeypatch.setattr(_FakeEvent, "record", lambda self, stream=None: (trace.append(("event",)),
                                                                          orig_record(self))[1])

    class _Flush:
        def zero_(self):
            trace.append(("flush",))

    def step():
        time.sleep(0.002)  # the host's enqueue time: 2 ms
        trace.append(("step",))

    res = brun.time_calls(torch, step, warmup=3, iters=4, flush=_Flush(), host_ahead=True)
    assert res["ms"] > 0
    timed = trace[trace.index(("flush",)):]  # the warm-up calls come first, with no sleep
    assert [e[0] for e in timed] == ["flush", "sleep", "event", "step", "event"] * 4
    cycles = {e[1] for e in timed if e[0] == "sleep"}
    assert len(cycles) == 1 and 4000 <= cycles.pop() <= 1000 * brun.HOST_AHEAD_MAX_MS  # >= 2 x 2 ms

    trace.clear()
    brun.time_calls(torch, step, warmup=2, iters=3, flush=_Flush())
    assert not [e for e in trace if e[0] == "sleep"]  # off by default


def test_host_ahead_rows_say_so_in_the_note_and_the_timing_line():
    rows, meta = _synthetic_rows()
    for r in rows:
        r["host_ahead"] = r["impl"] == "kernel_fun"
    md = report.markdown(rows, dict(meta, host_ahead="yes"))
    assert "host kept ahead of the GPU (a GPU sleep before each timed call, --host-ahead): yes" in md
    ok_ours = [r for r in rows if r["impl"] == "kernel_fun" and r["status"] == "ok"]
    assert ok_ours and md.count("host kept ahead of the GPU: kernel_fun") == len(ok_ours)
    merged, mmeta = report.merge_runs([rows])
    assert mmeta["host_ahead"] == "rows marked in the note"
    for r in rows:
        r["host_ahead"] = False
    assert report.merge_runs([rows])[1]["host_ahead"] == "no"
