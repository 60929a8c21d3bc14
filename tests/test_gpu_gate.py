"""The GPU tests' gate (tests/conftest.py), on CPU: without a CUDA device they skip; with one and an
extension that is missing or fails to load they ERROR with the load error, so `pytest` on a GPU
machine with a broken build exits non-zero instead of reporting everything skipped."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import gpu_verdict

ROOT = Path(__file__).resolve().parents[1]


def test_verdict():
    assert gpu_verdict(False, (False, "anything")) == ("no CUDA GPU", None)
    assert gpu_verdict(True, (True, "/x/_C.abi3.so")) == (None, None)
    skip, error = gpu_verdict(True, (False, "undefined symbol: foo"))
    assert skip is None and "undefined symbol: foo" in error and "-m 'not gpu'" in error


def _pytest_with(tmp_path: Path, cuda: bool, load_error: str | None) -> subprocess.CompletedProcess:
    """One GPU test run in a subprocess whose torch says cuda is (not) available and whose extension
    status is the given load error (a plugin patches both before collection)."""
    plugin = tmp_path / "kf_fake_machine.py"
    plugin.write_text(textwrap.dedent(f"""
        import torch
        torch.cuda.is_available = lambda: {cuda!r}
        from kernel_fun import _ext
        _ext._state = {(False, load_error) if load_error else None!r}
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    test = "tests/test_integration_gpu.py::test_fla_06_arguments_keep_every_benchmark_case_on_our_kernels"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "kf_fake_machine", "-p", "no:cacheprovider",
                           test], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("cuda", [True, False], ids=["cuda", "no_cuda"])
def test_gpu_tests_error_on_a_gpu_machine_without_the_extension(tmp_path, cuda):
    r = _pytest_with(tmp_path, cuda, "planted: undefined symbol kf_foo")
    out = r.stdout + r.stderr
    if cuda:
        assert r.returncode != 0, out
        assert "1 error" in out and "planted: undefined symbol kf_foo" in out, out
    else:  # CI without a GPU: skipped, exit 0
        assert r.returncode == 0 and "1 skipped" in out, out
