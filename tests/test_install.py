"""Installing cannot silently lose the kernels: setup.py's decision, the recorded reason, the sdist.

setup.py is imported under another name than __main__, so its functions run here without a build;
the environment (toolkit, torch, CUTLASS) is faked per test. Two tests run setuptools' PEP 517
backend in a subprocess on a copy of the tree, as pip does, so nothing here writes into the
checkout (whose own _build_reason.txt belongs to the install under test).
"""

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def setup_py(monkeypatch):
    """setup.py as a module; setup() must not run on import (it would start a build)."""
    import setuptools

    def no_build(**kw):
        raise AssertionError("importing setup.py ran setup()")

    monkeypatch.setattr(setuptools, "setup", no_build)
    spec = importlib.util.spec_from_file_location("kernel_fun_setup", ROOT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake_toolkit(root: pathlib.Path) -> pathlib.Path:
    nvcc = root / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\nexit 1\n")
    nvcc.chmod(0o755)
    return nvcc


@pytest.fixture
def no_toolkit(setup_py, monkeypatch, tmp_path):
    """No nvcc anywhere setup.py looks (this machine may well have one)."""
    for var in ("CUDA_HOME", "CUDA_PATH", "KERNEL_FUN_SKIP_CUDA"):
        monkeypatch.delenv(var, raising=False)
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(setup_py, "DEFAULT_CUDA_HOME", str(tmp_path / "no-cuda"))
    return setup_py


@pytest.fixture
def toolkit(no_toolkit, monkeypatch, tmp_path):
    """nvcc present through CUDA_HOME; returns its path."""
    nvcc = _fake_toolkit(tmp_path / "cuda")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    return nvcc


def _hide(monkeypatch, module):
    # None in sys.modules makes `import module` raise ImportError and find_spec return None.
    monkeypatch.setitem(sys.modules, module, None)


def _assert_install_hint(msg: str):
    assert "pip install -r requirements-build.txt && pip install --no-build-isolation ." in msg
    assert "KERNEL_FUN_SKIP_CUDA=1" in msg


# ---- setup.py's decision --------------------------------------------------------------------


def test_toolkit_without_torch_refuses_with_the_install_hint(toolkit, setup_py, monkeypatch):
    # What pip's default build isolation looks like from inside the build.
    _hide(monkeypatch, "torch")
    with pytest.raises(SystemExit) as e:
        setup_py.kernel_less_reason()
    msg = str(e.value.code)
    assert str(toolkit) in msg and "torch is not importable" in msg
    _assert_install_hint(msg)


def test_toolkit_without_cutlass_refuses_with_the_install_hint(toolkit, setup_py, monkeypatch):
    pytest.importorskip("torch")
    _hide(monkeypatch, "cutlass_library")
    with pytest.raises(SystemExit) as e:
        setup_py.kernel_less_reason()
    msg = str(e.value.code)
    assert "nvidia-cutlass" in msg
    _assert_install_hint(msg)


def test_toolkit_with_torch_and_cutlass_builds_the_extension(toolkit, setup_py):
    pytest.importorskip("torch")
    if importlib.util.find_spec("cutlass_library") is None:
        pytest.skip("nvidia-cutlass not installed")
    assert setup_py.kernel_less_reason() is None


@pytest.mark.parametrize("torch_present", [True, False])
def test_no_toolkit_builds_kernel_less_and_says_so(no_toolkit, monkeypatch, torch_present):
    if not torch_present:
        _hide(monkeypatch, "torch")  # `pip install kernel-fun-hopper` on a CPU box: still installs
    reason = no_toolkit.kernel_less_reason()
    assert reason and "no CUDA toolkit (nvcc)" in reason


def test_skip_cuda_wins_over_a_toolkit(toolkit, setup_py, monkeypatch):
    _hide(monkeypatch, "torch")  # would otherwise refuse
    monkeypatch.setenv("KERNEL_FUN_SKIP_CUDA", "1")
    assert setup_py.kernel_less_reason() == "KERNEL_FUN_SKIP_CUDA=1 was set at build time"


def test_nvcc_is_found_without_torch(no_toolkit, monkeypatch, tmp_path):
    assert no_toolkit._find_nvcc() is None
    on_path = _fake_toolkit(tmp_path / "on-path")
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert no_toolkit._find_nvcc() == str(on_path)
    in_cuda_path = _fake_toolkit(tmp_path / "cuda-path")
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "cuda-path"))
    assert no_toolkit._find_nvcc() == str(in_cuda_path)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "not-a-toolkit"))  # no nvcc there: look on
    assert no_toolkit._find_nvcc() == str(in_cuda_path)
    monkeypatch.delenv("CUDA_PATH")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    default = _fake_toolkit(tmp_path / "default-cuda")
    monkeypatch.setattr(no_toolkit, "DEFAULT_CUDA_HOME", str(tmp_path / "default-cuda"))
    assert no_toolkit._find_nvcc() == str(default)


# ---- the recorded reason reaches status() and versions() ------------------------------------


@pytest.fixture
def no_library(monkeypatch, tmp_path):
    """kernel_fun._ext as in a package without the extension, its reason file under tmp_path."""
    from kernel_fun import _ext

    monkeypatch.setattr(_ext, "_find_library", lambda: None)
    monkeypatch.setattr(_ext, "_REASON_FILE", str(tmp_path / "_build_reason.txt"))
    monkeypatch.setattr(_ext, "_state", None)  # status() caches; monkeypatch restores it after
    return _ext


def test_setup_writes_where_the_package_reads(setup_py):
    from kernel_fun import _ext

    assert pathlib.Path(setup_py.REASON_FILE).name == pathlib.Path(_ext._REASON_FILE).name
    assert pathlib.Path(setup_py.REASON_FILE).parent == ROOT / "src" / "kernel_fun"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"_build_reason.txt"' in pyproject, "the reason must be package data to reach wheels"


def test_status_reports_the_recorded_reason(no_library, no_toolkit):
    reason = no_toolkit.kernel_less_reason()
    no_toolkit.record_reason(reason, no_library._REASON_FILE)
    ok, why = no_library.status()
    assert not ok and reason in why and "unavailable" in why


def test_versions_reports_the_recorded_reason(no_library, setup_py):
    import kernel_fun

    setup_py.record_reason("KERNEL_FUN_SKIP_CUDA=1 was set at build time", no_library._REASON_FILE)
    ext = kernel_fun.versions()["extension"]
    assert "KERNEL_FUN_SKIP_CUDA=1 was set at build time" in ext
    assert "toolkit" not in ext  # the old message blamed a missing toolkit whatever the cause


def test_a_later_build_overwrites_the_reason(no_library, setup_py):
    path = no_library._REASON_FILE
    setup_py.record_reason("no CUDA toolkit (nvcc) was found at build time", path)
    setup_py.record_reason("KERNEL_FUN_SKIP_CUDA=1 was set at build time", path)
    why = no_library.status()[1]
    assert "KERNEL_FUN_SKIP_CUDA=1" in why and "toolkit" not in why


def test_unrecorded_reason_is_neutral(no_library):
    ok, why = no_library.status()
    assert not ok and "not recorded" in why and "unavailable" in why
    assert "toolkit" not in why and "KERNEL_FUN_SKIP_CUDA" not in why


# ---- the PEP 517 backend on a copy of the tree, as pip runs it ------------------------------


@pytest.fixture
def tree(tmp_path):
    dst = tmp_path / "tree"
    dst.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE", "MANIFEST.in",
                 "requirements-build.txt"):
        shutil.copy2(ROOT / name, dst / name)
    shutil.copytree(ROOT / "csrc", dst / "csrc")
    shutil.copytree(ROOT / "src" / "kernel_fun", dst / "src" / "kernel_fun",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__", "_build_reason.txt"))
    # the tests too: setuptools adds some of them to an sdist by itself
    shutil.copytree(ROOT / "tests", dst / "tests",
                    ignore=shutil.ignore_patterns("_build", "__pycache__", ".pytest_cache", "*.py[cod]"))
    return dst


def _backend(tree, hook: str, env: dict) -> subprocess.CompletedProcess:
    code = f"from setuptools import build_meta as b; print(b.{hook})"
    return subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=120)


def test_isolated_build_with_a_toolkit_fails_fast_with_the_hint(tree, tmp_path):
    _fake_toolkit(tmp_path / "cuda")
    stub = tmp_path / "stub" / "torch"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('hidden, as in an isolated build')\n")
    env = {**os.environ, "CUDA_HOME": str(tmp_path / "cuda"), "PYTHONPATH": str(stub.parent)}
    env.pop("KERNEL_FUN_SKIP_CUDA", None)
    r = _backend(tree, "get_requires_for_build_wheel()", env)
    assert r.returncode != 0, "setup.py did not refuse (did setup() even run under build_meta?)"
    _assert_install_hint(r.stderr)
    assert not (tree / "build").exists(), "it should fail before building anything"


def test_sdist_ships_the_kernel_sources_and_no_build_reason(tree):
    env = {**os.environ, "KERNEL_FUN_SKIP_CUDA": "1"}
    r = _backend(tree, "build_sdist('dist')", env)
    assert r.returncode == 0, r.stderr[-3000:]
    # setup() ran under the backend (the __main__ guard lets it) and recorded its reason.
    assert (tree / "src" / "kernel_fun" / "_build_reason.txt").read_text().startswith(
        "KERNEL_FUN_SKIP_CUDA=1")
    (sdist,) = (tree / "dist").glob("kernel_fun_hopper-*.tar.gz")  # the distribution name, normalised
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    want = {str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*") if p.is_file()}
    assert want <= names, f"sdist lacks {sorted(want - names)[:5]}"
    assert {"setup.py", "requirements-build.txt", "src/kernel_fun/py.typed"} <= names
    assert not any(n.endswith("_build_reason.txt") or n.endswith(".so") for n in names)
    # The whole test tree or none of it: tests/test_*.py alone (setuptools' default) cannot run
    # without conftest.py, helpers.py and tests/emu/.
    shipped = {n for n in names if n.startswith("tests/") and not n.endswith("/")}
    tree_tests = {str(p.relative_to(tree)) for p in (tree / "tests").rglob("*") if p.is_file()}
    assert "tests/conftest.py" in tree_tests and "tests/helpers.py" in tree_tests
    assert shipped in (set(), tree_tests), f"a partial test tree: lacks {sorted(tree_tests - shipped)[:5]}"


def test_release_ships_only_a_checked_sdist():
    wf = (ROOT / ".github" / "workflows" / "release.yml").read_text()
    # A kernel-less wheel from the CUDA-less release runner would be what pip picks everywhere.
    assert "uv build --sdist" in wf and "bdist_wheel" not in wf and "--wheel" not in wf
    assert "twine check --strict" in wf
    assert 'GITHUB_REF_NAME#v' in wf  # the tag must equal the version that ships
