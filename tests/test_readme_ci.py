"""README's setup and test commands are exactly what CI runs (.ci/run)."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _commands(text: str) -> set[str]:
    return {ln.strip() for ln in text.splitlines() if ln.strip().startswith(("pip install", "python -m pytest"))}


def test_ci_runs_the_readme_commands():
    readme = _commands((ROOT / "README.md").read_text())
    ci = _commands((ROOT / ".ci" / "run").read_text())
    assert ci, ".ci/run has no setup/test command"
    missing = ci - readme
    assert not missing, f"README.md lacks the commands CI runs: {missing}"


def test_version_has_one_source():
    import kernel_fun

    init = (ROOT / "src" / "kernel_fun" / "__init__.py").read_text()
    assert f'__version__ = "{kernel_fun.__version__}"' in init
    assert "version" not in (ROOT / "setup.py").read_text().split("setup(")[-1]
