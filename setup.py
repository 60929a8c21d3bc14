"""Build of kernel-fun's C++/CUDA extension (see docs/build.md for why setuptools).

One shared library, ``kernel_fun/_C.abi3.so``, holds every kernel and registers the ops under the
``kernel_fun`` torch namespace through the LibTorch stable ABI, so it has no Python symbols and
no dependency on one torch build's C++ ABI.

Where a CUDA toolkit (nvcc) is found, the build makes the extension or fails saying how to
install; it never quietly leaves the kernels out (pip's default build isolation hides the
installed torch, which used to produce exactly that). Without nvcc, or with
KERNEL_FUN_SKIP_CUDA=1, the pure-Python package installs, and the reason is recorded in
``kernel_fun/_build_reason.txt`` for ``kernel_fun.versions()`` to report.

Environment:
  KERNEL_FUN_CUDA_ARCHS   e.g. "90a" (default) or "90a;100a": the SASS targets to build.
  TORCH_CUDA_ARCH_LIST    honoured when KERNEL_FUN_CUDA_ARCHS is unset ("9.0a", "9.0;10.0a"...).
  KERNEL_FUN_SKIP_CUDA=1  build no extension even when nvcc is present.
  MAX_JOBS                parallel compile jobs (torch's build honours it).
"""

import glob
import importlib.util
import os
import re
import shutil
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
# Read by kernel_fun._ext.status() when the package has no extension library.
REASON_FILE = os.path.join(ROOT, "src", "kernel_fun", "_build_reason.txt")
# torch's cpp_extension falls back to the same place when nothing else names a toolkit.
DEFAULT_CUDA_HOME = "/usr/local/cuda"

INSTALL_HINT = """\
To build the kernels, install with the build requirements and without build isolation (the
kernels compile against the installed torch, which an isolated build cannot see):
    pip install -r requirements-build.txt && pip install --no-build-isolation .
(add -e for an editable install; from PyPI: install torch for your CUDA major, nvidia-cutlass
and ninja first, then `pip install --no-build-isolation kernel-fun-hopper`).
To install without the GPU kernels on purpose, set KERNEL_FUN_SKIP_CUDA=1."""


def _log(msg: str) -> None:
    print(f"kernel-fun setup: {msg}", file=sys.stderr)


def _refuse(nvcc: str, problem: str) -> None:
    raise SystemExit(
        f"kernel-fun setup: a CUDA toolkit is present ({nvcc}), but {problem}, so the GPU kernels "
        f"cannot be built; refusing to build kernel-fun without them.\n{INSTALL_HINT}"
    )


def _find_nvcc() -> str | None:
    """Path of nvcc, found without torch: in an isolated build torch is absent, and this is what
    still tells "no toolkit here" apart from "a toolkit this build cannot use"."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    on_path = shutil.which("nvcc")
    if on_path:
        return on_path
    default = os.path.join(DEFAULT_CUDA_HOME, "bin", "nvcc")
    return default if os.path.isfile(default) else None


def _cutlass_include() -> str | None:
    """The CUTLASS/CuTe include dir of the installed nvidia-cutlass package, or None.

    Found without importing the package: only its headers are needed, not its Python deps."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    inc = os.path.join(list(spec.submodule_search_locations)[0], "source", "include")
    return inc if os.path.isdir(os.path.join(inc, "cute")) else None


def kernel_less_reason() -> str | None:
    """Why this build makes no CUDA extension, or None to build it.

    Raises SystemExit with the install hint when nvcc is present but the extension cannot be
    built: a kernel-less package on a machine with a toolkit is a mistake, not a choice."""
    if os.environ.get("KERNEL_FUN_SKIP_CUDA") == "1":
        return "KERNEL_FUN_SKIP_CUDA=1 was set at build time"
    nvcc = _find_nvcc()
    if nvcc is None:
        return ("no CUDA toolkit (nvcc) was found at build time (looked at CUDA_HOME, CUDA_PATH, "
                f"PATH, {DEFAULT_CUDA_HOME}); install one and reinstall")
    try:
        import torch.utils.cpp_extension  # noqa: F401
    except ImportError as e:
        _refuse(nvcc, f"torch is not importable in this build environment ({e}); pip's default "
                      "build isolation hides the installed torch")
    if _cutlass_include() is None:
        _refuse(nvcc, "the CUTLASS/CuTe headers (PyPI package nvidia-cutlass) are not installed")
    return None


def record_reason(reason: str, path: str = REASON_FILE) -> None:
    """Write the reason into the package; every build writes it, so none is left stale, not even
    a copy in an old build/lib that the next wheel would pick up."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(reason + "\n")


def _cuda_archs() -> list[str]:
    """Return arch tokens like ['90a'] from the environment (default sm_90a)."""
    raw = os.environ.get("KERNEL_FUN_CUDA_ARCHS")
    if not raw:
        raw = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not raw:
        return ["90a"]
    archs = []
    for tok in re.split(r"[;, ]+", raw.strip()):
        if not tok:
            continue
        tok = tok.replace("+PTX", "").replace(".", "")
        if not re.fullmatch(r"\d{2,3}[af]?", tok):
            raise SystemExit(f"kernel-fun setup: bad CUDA arch '{tok}' in {raw!r} (want e.g. 90a)")
        archs.append(tok)
    return archs


def compile_flags(archs: list[str]) -> tuple[list[str], list[str]]:
    """(c++ flags, nvcc flags) of the extension's sources; scripts/sass_size.sh compiles with the same."""
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    # Stable ABI: compile against torch's header-only/shim surface of 2.10, so one build keeps
    # loading in later torch releases.
    target = "-DTORCH_TARGET_VERSION=0x020a000000000000"
    common = ["-O3", "-std=c++17", target, "-DUSE_CUDA",
              f'-DKF_CUDA_ARCHS="{",".join("sm_" + a for a in archs)}"']
    nvcc = common + gencode + [
        "--expt-relaxed-constexpr",
        "--expt-extended-lambda",
        "-lineinfo",
        "-Xptxas=--warn-on-spills",
        "--use_fast_math",
        "-DNDEBUG",
    ]
    return common, nvcc


def _extensions(archs: list[str]):
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

    # torch trusts CUDA_HOME as given; a value without nvcc would fail deep inside the compile.
    if CUDA_HOME is None or not os.path.isfile(os.path.join(CUDA_HOME, "bin", "nvcc")):
        _refuse(_find_nvcc() or "nvcc", f"torch's CUDA_HOME ({CUDA_HOME}) has no bin/nvcc; point "
                                        "CUDA_HOME at the toolkit")

    common, nvcc = compile_flags(archs)
    srcs = sorted(
        glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True)
        + glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True)
    )
    _log(f"building {len(srcs)} sources for {', '.join('sm_' + a for a in archs)}")
    ext = CUDAExtension(
        name="kernel_fun._C",
        sources=srcs,
        include_dirs=[os.path.join(ROOT, "csrc"), _cutlass_include()],
        extra_compile_args={"cxx": common, "nvcc": nvcc},
        py_limited_api=True,
    )
    return [ext], {"build_ext": BuildExtension}


# setuptools' PEP 517 backend (pip, build, uv) and `python setup.py` both run this file as
# __main__; tests import it under another name to call the functions above without a build.
if __name__ == "__main__":
    reason = kernel_less_reason()
    if reason is None:
        archs = _cuda_archs()
        ext_modules, cmdclass = _extensions(archs)
        record_reason(f"it was built ({', '.join('sm_' + a for a in archs)}), but its library is "
                      "missing from the installed package")
    else:
        _log(f"building no CUDA extension: {reason}")
        ext_modules, cmdclass = [], {}
        record_reason(reason)
    options = {"bdist_wheel": {"py_limited_api": "cp310"}} if ext_modules else {}
    setup(ext_modules=ext_modules, cmdclass=cmdclass, options=options)
