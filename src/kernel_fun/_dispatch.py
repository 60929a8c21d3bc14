"""Shared routing for every family: our kernel, else fla with the caller's original arguments,
else a clear error. Logging happens once per distinct message.

    kernel-fun {versions}                                   INFO, once, before the first engage
    kernel-fun <family>: engaged (B= T= ...)                INFO, once per family
    kernel-fun <family>: falling back to fla - <reason>     WARNING, once per reason
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
import threading

import torch

_log = logging.getLogger("kernel_fun")
_lock = threading.Lock()
_seen: set[tuple[str, str]] = set()
_versions_logged = False
# (fla module, name) -> fla's own function, while kernel_fun.patch_fla has replaced that name.
_fla_originals: dict[tuple[str, str], object] = {}
_strict: contextvars.ContextVar[bool] = contextvars.ContextVar("kernel_fun_strict", default=False)


class KernelFunUnsupported(RuntimeError):
    """Strict mode: our kernels cannot serve a call (the message says why) and falling back to fla
    was not allowed."""


def strict_enabled() -> bool:
    from kernel_fun import _env

    return _strict.get() or _env.flag("KERNEL_FUN_STRICT")


@contextlib.contextmanager
def strict(enabled: bool = True):
    """Within the block, a call our kernels cannot serve raises KernelFunUnsupported with the reason
    instead of falling back to fla (a benchmark that asks for our kernels runs them or stops).
    The environment switch KERNEL_FUN_STRICT=1 does the same for the whole process."""
    token = _strict.set(enabled)
    try:
        yield
    finally:
        _strict.reset(token)


def _once(key: tuple[str, str]) -> bool:
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
        return True


def reject_unknown_kwargs(qualname: str, kwargs: dict, known: frozenset) -> None:
    """TypeError naming every keyword in kwargs that fla's function does not read from its
    **kwargs, as Python raises for a misspelt parameter, on every path: fla's **kwargs would
    swallow a typo (dt_bais=, activaton=) and return a result without it."""
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"{qualname}() got unexpected keyword argument(s): {', '.join(repr(u) for u in unknown)}")


def common_reason(family: str, cp_context) -> str | None:
    """The routing reasons every family shares, in order: the environment switches off the
    family, context parallelism (fla's). None when none applies. (An unknown keyword is no
    reason to route: each front raises TypeError for it first, on every path.)"""
    from kernel_fun import _env

    off = _env.family_disabled(family)
    if off:
        return f"disabled by {off}"
    if cp_context is not None:
        return "cp_context (context parallelism) is fla's"
    return None


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
    """fla's function, or None when fla is not importable. While ``kernel_fun.patch_fla`` routes
    fla's names to ours, this still returns fla's own (a fallback must not call back into us)."""
    original = _fla_originals.get((module, name))
    if original is not None:
        return original
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001 - any import failure means "no fla"
        return None


@torch.compiler.disable  # fla runs outside a compiled graph (a graph break); logging takes a lock
def fallback(family: str, reason: str, module, name: str, args: tuple, kwargs: dict):
    """Call fla with exactly the caller's arguments, or raise with the reason (strict mode, or no
    fla). module: one module name or a tuple of candidates, tried in order (fla moved some)."""
    if strict_enabled():
        raise KernelFunUnsupported(f"kernel-fun {family}: our kernels cannot serve this call - {reason} "
                                   f"(strict mode: KERNEL_FUN_STRICT=1 or kernel_fun.strict())")
    fn = None
    for mod in (module,) if isinstance(module, str) else tuple(module):
        fn = fla_function(mod, name)
        if fn is not None:
            break
    if fn is None:
        raise RuntimeError(
            f"kernel-fun {family}: cannot run this call - {reason}; and fla (fla-core) is not "
            f"installed to fall back to"
        )
    log_fallback(family, reason)
    return fn(*args, **kwargs)
