"""Build of kernel-fun's C++/CUDA extension (see docs/build.md for why setuptools).

One shared library, ``kernel_fun/_C.abi3.so``, holds every kernel and registers the ops under the
``kernel_fun`` torch namespace through the LibTorch stable ABI, so it has no Python symbols and
no dependency on one torch build's C++ ABI. It is built only when a CUDA toolkit is found; without
one the pure-Python package still installs and reports its kernels as unavailable.

Environment:
  KERNEL_FUN_CUDA_ARCHS   e.g. "90a" (default) or "90a;100a": the SASS targets to build.
  TORCH_CUDA_ARCH_LIST    honoured when KERNEL_FUN_CUDA_ARCHS is unset ("9.0a", "9.0;10.0a"...).
  KERNEL_FUN_SKIP_CUDA=1  build no extension even when nvcc is present.
  MAX_JOBS                parallel compile jobs (torch's build honours it).
"""

import glob
import os
import re
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _log(msg: str) -> None:
    print(f"kernel-fun setup: {msg}", file=sys.stderr)


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


def _cutlass_include() -> str:
    # Locate the package without importing it: only its headers are needed, not its Python deps.
    import importlib.util

    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "kernel-fun setup: the CUTLASS/CuTe headers come from the PyPI package "
            "nvidia-cutlass (see requirements-build.txt); install it first"
        )
    inc = os.path.join(list(spec.submodule_search_locations)[0], "source", "include")
    if not os.path.isdir(os.path.join(inc, "cute")):
        raise SystemExit(f"kernel-fun setup: no CuTe headers under {inc}")
    return inc


def _extensions():
    if os.environ.get("KERNEL_FUN_SKIP_CUDA") == "1":
        _log("KERNEL_FUN_SKIP_CUDA=1: building no CUDA extension")
        return [], {}
    try:
        import torch  # noqa: F401
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        _log("torch is not importable at build time: building no CUDA extension "
             "(install with --no-build-isolation after torch)")
        return [], {}
    if CUDA_HOME is None or not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        _log("no CUDA toolkit found: building no CUDA extension (GPU kernels unavailable)")
        return [], {}

    archs = _cuda_archs()
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


ext_modules, cmdclass = _extensions()
options = {"bdist_wheel": {"py_limited_api": "cp310"}} if ext_modules else {}
setup(ext_modules=ext_modules, cmdclass=cmdclass, options=options)
