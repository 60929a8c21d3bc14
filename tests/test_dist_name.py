"""The distribution name is one name: pyproject's [project] name is what the docs tell users to
`pip install`, what setup.py's install hint names, and what the release workflow publishes and
checks. The import package stays `kernel_fun` whatever the distribution is called.

("kernel-fun" on PyPI is an unrelated project that also installs a `kernel_fun` package: a doc
that told users to install it would give them someone else's kernels.)"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
TAKEN = "kernel-fun"  # on PyPI, another project (0.2.0, Blackwell kernels)


def _normalize(name: str) -> str:
    """PEP 503: runs of -, _ and . are one separator, case does not matter."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _project_name() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    table = text.split("\n[project]\n", 1)[1].split("\n[", 1)[0]
    m = re.search(r'^name\s*=\s*"([^"]+)"', table, re.M)
    assert m, "pyproject.toml's [project] table has no name"
    return m.group(1)


def _install_targets(text: str):
    """(line number, requirement) for every package a `pip install` command in text names: options,
    the files after -r / -c, and local paths ('.', '.[test]', './x') are not package names."""
    for lineno, line in enumerate(text.splitlines(), 1):
        for cmd in re.findall(r"pip install\b([^`&;|\n]*)", line):
            skip_next = False
            for tok in cmd.split():
                tok = tok.strip("\"'`(),")
                if skip_next:
                    skip_next = False
                    continue
                if tok in ("-r", "-c", "--requirement", "--constraint", "-t", "--target", "-d"):
                    skip_next = True
                    continue
                if not tok or tok.startswith(("-", ".", "/", "~", "$")) or "/" in tok:
                    continue
                m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", tok)
                if m:
                    yield lineno, m.group(0)


def _user_docs() -> dict[str, str]:
    """Files that tell users how to install: README, the reference docs (not the dated notes),
    setup.py's install hint and the release workflow."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "setup.py",
             ROOT / ".github" / "workflows" / "release.yml"]
    return {str(p.relative_to(ROOT)): p.read_text() for p in files}


def test_the_distribution_name_is_not_the_taken_one():
    name = _project_name()
    assert _normalize(name) != _normalize(TAKEN), (
        f"pyproject name {name!r} is PyPI's {TAKEN!r}, another project")
    assert (ROOT / "src" / "kernel_fun" / "__init__.py").is_file(), "the import package is kernel_fun"


def test_docs_install_the_distribution_pyproject_names():
    name = _normalize(_project_name())
    ours, wrong = [], []
    for path, text in _user_docs().items():
        for lineno, req in _install_targets(text):
            if _normalize(req).startswith("kernel"):
                (ours if _normalize(req) == name else wrong).append(f"{path}:{lineno}: {req}")
    assert not wrong, f"install commands that name another distribution than {name!r}: {wrong}"
    docs_with_it = {w.split(":")[0] for w in ours}
    assert {"README.md", "docs/build.md"} <= docs_with_it, (
        f"README.md and docs/build.md must show `pip install ... {name}`; found it in {sorted(docs_with_it)}")


def test_release_workflow_publishes_that_name():
    name = _project_name()
    wf = (ROOT / ".github" / "workflows" / "release.yml").read_text()
    for index in ("https://pypi.org/p/", "https://test.pypi.org/p/"):
        urls = set(re.findall(re.escape(index) + r"([A-Za-z0-9._-]+)", wf))
        assert urls == {name}, f"release.yml's {index} environment URLs {urls} != {{{name!r}}}"
    # setuptools names the sdist after the normalised name with underscores
    stem = re.sub(r"[-_.]+", "_", name).lower()
    stems = set(re.findall(r"([A-Za-z0-9_]+)-\*\.tar\.gz", wf))
    assert stems == {stem}, f"release.yml looks for sdists {stems}, setuptools writes {stem}-*.tar.gz"
    assert f'importlib.metadata.version("{name}")' in wf


def test_metadata_lookups_use_that_name():
    """importlib.metadata lookups of our own distribution (by any spelling) use pyproject's name."""
    name = _normalize(_project_name())
    calls = re.compile(r'(?:version|distribution|metadata|_dist_version)\(\s*"(kernel[^"]*)"')
    bad = [f"{p.relative_to(ROOT)}: {n}" for p in (ROOT / "src").rglob("*.py")
           for n in calls.findall(p.read_text()) if _normalize(n) != name]
    assert not bad, f"metadata lookups by another name than {name!r}: {bad}"
