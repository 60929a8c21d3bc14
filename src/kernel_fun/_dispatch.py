"""Shared routing for every family: our kernel, else fla with the caller's original arguments,
else a clear error. Logging happens once per distinct message.

    kernel-fun {versions}                                   INFO, once, before the first engage
    kernel-fun <family>: engaged (B= T= ...)                INFO, once per family
    kernel-fun <family>: falling back to fla - <reason>     WARNING, once per reason
"""

from __future__ import annotations

import importlib
import logging
import threading

_log = logging.getLogger("kernel_fun")
_lock = threading.Lock()
_seen: set[tuple[str, str]] = set()
_versions_logged = False


def _once(key: tuple[str, str]) -> bool:
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
        return True


def forget_logged(family: str) -> None:
    """Let the once-only engaged/fallback lines of a family log again (benchmarks and tests that
    need to see, per call, whether our kernels engaged)."""
    with _lock:
        for key in [k for k in _seen if k[0] == family]:
            _seen.discard(key)


def log_engaged(family: str, detail: str) -> None:
    global _versions_logged
    if not _once((family, "engaged")):
        return
    if not _versions_logged:
        _versions_logged = True
        from kernel_fun import versions

        _log.info("kernel-fun %s", versions())
    _log.info("kernel-fun %s: engaged (%s)", family, detail)


def log_fallback(family: str, reason: str) -> None:
    if _once((family, "fallback:" + reason)):
        _log.warning("kernel-fun %s: falling back to fla - %s", family, reason)


def fla_function(module: str, name: str):
    """fla's function, or None when fla is not importable."""
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001 - any import failure means "no fla"
        return None


def fallback(family: str, reason: str, module: str, name: str, args: tuple, kwargs: dict):
    """Call fla with exactly the caller's arguments, or raise with the reason."""
    fn = fla_function(module, name)
    if fn is None:
        raise RuntimeError(
            f"kernel-fun {family}: cannot run this call - {reason}; and fla (fla-core) is not "
            f"installed to fall back to"
        )
    log_fallback(family, reason)
    return fn(*args, **kwargs)
