"""Loading the compiled extension (``kernel_fun/_C*.so``) and saying why it is unavailable.

The library registers its ops under ``torch.ops.kernel_fun`` through the LibTorch stable ABI;
it is loaded with ``torch.ops.load_library`` on first use, never at ``import kernel_fun``.
"""

from __future__ import annotations

import glob
import os
import threading

_lock = threading.Lock()
_state: tuple[bool, str] | None = None
# Written by setup.py at every build: why the package has no extension library (the toolkit was
# missing, KERNEL_FUN_SKIP_CUDA=1, ...). Only the build knows it.
_REASON_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_build_reason.txt")


def _find_library() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    for pat in ("_C.abi3.so", "_C*.so", "_C*.pyd"):
        hits = sorted(glob.glob(os.path.join(here, pat)))
        if hits:
            return hits[0]
    return None


def _build_reason() -> str:
    try:
        with open(_REASON_FILE, encoding="utf-8") as f:
            reason = f.read().strip()
    except OSError:
        reason = ""
    return reason or "it was built without one; the reason was not recorded"


def status() -> tuple[bool, str]:
    """(True, path) when the kernels are loaded, else (False, why not). Cached after first call."""
    global _state
    if _state is not None:
        return _state
    with _lock:
        if _state is not None:
            return _state
        path = _find_library()
        if path is None:
            _state = (False, f"kernel-fun has no CUDA extension: {_build_reason()}. "
                             "GPU kernels are unavailable")
            return _state
        try:
            import torch

            torch.ops.load_library(path)
            # Fakes/autograd registrations live in Python next to each family.
            from kernel_fun import _fakes  # noqa: F401

            _state = (True, path)
        except Exception as e:  # noqa: BLE001 - report, never crash the caller
            _state = (False, f"kernel-fun's CUDA extension failed to load from {path}: {e}")
        return _state


def available() -> bool:
    return status()[0]


def build_info() -> str | None:
    if not available():
        return None
    import torch

    return torch.ops.kernel_fun.build_info(torch.empty(0))


def ops():
    """torch.ops.kernel_fun, loading the library first; raises with the reason if unavailable."""
    ok, why = status()
    if not ok:
        raise RuntimeError(why)
    import torch

    return torch.ops.kernel_fun


def op_calls() -> dict[str, int]:
    """How often each kernel op ran in this process ({} without the extension): counted in C++
    at every launch, so a compiled graph's or a backward's calls count too (Python around the
    ops runs only once, at trace time). Tests and ``python -m kernel_fun.check`` use it to prove
    that our kernels, not fla's, served a call."""
    if not available():
        return {}
    import torch

    text = torch.ops.kernel_fun.op_calls(torch.empty(0))
    return {name: int(n) for name, n in (item.split("=") for item in text.split(";") if item)}
