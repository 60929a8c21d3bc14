"""Build (and cache) the host-emulator shared library: the project's CUDA kernels compiled by g++
with -DKF_EMU against tests/emu/kf_emu.h.

    python tests/emu/build.py            # builds if needed, prints the library path
    python tests/emu/build.py --force    # rebuilds

The library lands in tests/emu/_build/<hash>/ (git-ignored); <hash> covers every source the build
reads (csrc headers, tests/emu sources), the flags and the compiler version, so an edited kernel
triggers a rebuild and an unchanged tree reuses the cached library.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CSRC = ROOT / "csrc"
BUILD_DIR = Path(os.environ.get("KF_EMU_BUILD_DIR", HERE / "_build"))
SOURCES = ["kf_emu.cpp", "kda_emu.cpp", "emu_selftest.cpp"]
# torch-free host sources of the project the drivers link (the options parser)
CSRC_SOURCES = ["kda/kda_options.cpp"]
LIB_NAME = "libkf_emu_kda.so"
CXX = os.environ.get("CXX", "g++")
FLAGS = ["-O2", "-std=c++17", "-DKF_EMU", "-fno-strict-aliasing", "-fPIC", "-pthread", "-Wall", "-Wno-unknown-pragmas"]


def cuda_include() -> Path | None:
    """Directory holding cuda_runtime.h / cuda_bf16.h (only headers are used, no CUDA library)."""
    for env in ("KF_EMU_CUDA_INCLUDE",):
        if os.environ.get(env):
            return Path(os.environ[env])
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            return Path(os.environ[env]) / "include"
    return Path("/usr/local/cuda/include")


def skip_reason() -> str | None:
    """None when the library can be built here, else why not."""
    if shutil.which(CXX) is None:
        return f"no C++ compiler ({CXX!r} not on PATH)"
    inc = cuda_include()
    for h in ("cuda_runtime.h", "cuda_bf16.h", "cuda_fp16.h"):
        if inc is None or not (inc / h).is_file():
            return f"CUDA headers not found ({inc}/{h}; set CUDA_HOME or KF_EMU_CUDA_INCLUDE)"
    return None


def _inputs() -> list[Path]:
    files = sorted(p for p in CSRC.rglob("*") if p.suffix in (".h", ".cuh", ".hpp"))
    files += sorted(HERE / s for s in SOURCES) + [HERE / "kf_emu.h"] + [CSRC / s for s in CSRC_SOURCES]
    return files


def _key() -> str:
    h = hashlib.sha256()
    for p in _inputs():
        h.update(str(p.relative_to(ROOT)).encode())
        h.update(p.read_bytes())
    h.update(" ".join([CXX, *FLAGS, str(cuda_include())]).encode())
    try:
        h.update(subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout.encode())
    except (OSError, subprocess.CalledProcessError):
        pass
    return h.hexdigest()[:16]


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"kf_emu build failed:\n$ {' '.join(cmd)}\n{r.stdout}{r.stderr}")


def build(force: bool = False, verbose: bool = False) -> Path:
    """Path of the built library (compiled only when the sources changed)."""
    why = skip_reason()
    if why:
        raise RuntimeError(f"cannot build the kf_emu library: {why}")
    out_dir = BUILD_DIR / _key()
    lib = out_dir / LIB_NAME
    if lib.is_file() and not force:
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir, prefix="tmp-"))
    try:
        inc = ["-I", str(CSRC), "-I", str(HERE), "-isystem", str(cuda_include())]
        srcs = [HERE / s for s in SOURCES] + [CSRC / s for s in CSRC_SOURCES]
        objs = [tmp / (s.stem + ".o") for s in srcs]
        cmds = [[CXX, *FLAGS, *inc, "-c", str(s), "-o", str(o)] for s, o in zip(srcs, objs)]
        jobs = max(1, min(len(cmds), os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(jobs) as ex:
            for cmd, fut in zip(cmds, [ex.submit(_run, c) for c in cmds]):
                if verbose:
                    print("$", " ".join(cmd), file=sys.stderr)
                fut.result()
        tmp_lib = tmp / LIB_NAME
        _run([CXX, "-shared", "-pthread", *map(str, objs), "-o", str(tmp_lib)])
        os.replace(tmp_lib, lib)  # atomic: concurrent builders never see a partial library
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return lib


if __name__ == "__main__":
    print(build(force="--force" in sys.argv, verbose=True))
