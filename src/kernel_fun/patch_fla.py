"""Route an existing fla model's KDA layers and short convolutions to kernel-fun, reversibly.

fla's ``KimiDeltaAttention`` calls ``chunk_kda`` and its ``ShortConvolution`` calls
``causal_conv1d`` (and ``causal_conv1d_update`` when decoding) through the names its modules
imported. ``enable()`` rebinds those names, in every loaded ``fla`` module that holds fla's
function, to kernel-fun's drop-ins (same arguments, same results); ``disable()`` puts fla's back::

    import kernel_fun.patch_fla as patch_fla
    with patch_fla.enabled():             # or: handle = patch_fla.enable(); ...; handle.disable()
        loss = model(batch).loss          # fla's layers, our kernels
        loss.backward()

Calls our kernels cannot serve still fall back to fla's own functions (never back into the
patch). Modules imported after ``enable()`` that do ``from fla.ops.kda import chunk_kda`` get ours
too, because the defining modules are rebound as well. Patch before ``torch.compile`` traces the
model (a compiled graph keeps whichever function it traced).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading

from kernel_fun import _dispatch

__all__ = ["enable", "enabled", "Patch"]

# (family, name, fla modules that define it - first importable wins, kernel_fun module)
_TARGETS = (
    ("kda", "chunk_kda", ("fla.ops.kda",), "kernel_fun.kda"),
    ("cconv", "causal_conv1d", ("fla.modules.causal_conv1d", "fla.modules.convolution", "fla.modules.conv"),
     "kernel_fun.cconv"),
    ("cconv", "causal_conv1d_update",
     ("fla.modules.causal_conv1d", "fla.modules.convolution", "fla.modules.conv"), "kernel_fun.cconv"),
)
# The modules whose classes call those names: imported first so their bindings exist to patch.
_USERS = ("fla.layers.kda", "fla.modules.convolution", "fla.modules.causal_conv1d", "fla.modules.conv")
_lock = threading.Lock()


class Patch:
    """One ``enable()``: the bindings it replaced, restored by ``disable()`` (idempotent)."""

    def __init__(self, replaced: list[tuple[object, str, object]], originals: dict):
        self._replaced = replaced
        self._originals = originals
        self.active = True

    @property
    def routed(self) -> list[str]:
        """'module.name' of every binding now pointing at kernel-fun."""
        return sorted(f"{mod.__name__}.{name}" for mod, name, _ in self._replaced)

    def disable(self) -> None:
        with _lock:
            if not self.active:
                return
            for mod, name, original in reversed(self._replaced):
                setattr(mod, name, original)
            for key in self._originals:
                _dispatch._fla_originals.pop(key, None)
            self.active = False

    def __enter__(self) -> Patch:
        return self

    def __exit__(self, *exc) -> None:
        self.disable()


def _import(name: str):
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a module this fla version does not have
        return None


def enable(kda: bool = True, cconv: bool = True) -> Patch:
    """Rebind fla's chunk_kda (kda=True) and causal_conv1d / causal_conv1d_update (cconv=True) to
    kernel-fun's in every loaded fla module. Raises RuntimeError when fla is not installed or a
    patch is already active (disable it first: patches do not stack)."""
    if _import("fla") is None:
        raise RuntimeError("kernel_fun.patch_fla: fla (fla-core) is not installed")
    for name in _USERS:
        _import(name)
    with _lock:
        if _dispatch._fla_originals:
            raise RuntimeError("kernel_fun.patch_fla: a patch is already active; disable() it first")
        replaced: list[tuple[object, str, object]] = []
        originals: dict[tuple[str, str], object] = {}
        for family, name, defining, ours_module in _TARGETS:
            if (family == "kda" and not kda) or (family == "cconv" and not cconv):
                continue
            original = next((getattr(m, name) for m in map(_import, defining) if m is not None and hasattr(m, name)),
                            None)
            if original is None:
                continue  # this fla version has no such function
            ours = getattr(importlib.import_module(ours_module), name)
            for key in defining:
                originals[(key, name)] = original
            for mod in [m for n, m in list(sys.modules.items()) if m is not None and (n == "fla" or n.startswith("fla."))]:
                if getattr(mod, name, None) is original:
                    setattr(mod, name, ours)
                    replaced.append((mod, name, original))
        _dispatch._fla_originals.update(originals)
        return Patch(replaced, originals)


@contextlib.contextmanager
def enabled(kda: bool = True, cconv: bool = True):
    """``with enabled(): ...`` - enable() for the block, disable() after it (also on error)."""
    patch = enable(kda=kda, cconv=cconv)
    try:
        yield patch
    finally:
        patch.disable()
