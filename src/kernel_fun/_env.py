"""Environment switches, read on every call. A bad value warns (once per value) and keeps the
default; it never raises.

KERNEL_FUN_DISABLE=1         every family goes to fla
KERNEL_FUN_KDA_DISABLE=1     chunk_kda goes to fla
KERNEL_FUN_CCONV_DISABLE=1   causal_conv1d goes to fla
KERNEL_FUN_CCONV_CP=1        causal_conv1d with cp_context runs on ours (cconv/_cp.py), not fla's
KERNEL_FUN_KDA_CP=1          chunk_kda with cp_context runs on ours (kda/_cp.py), not fla's
KERNEL_FUN_KDA_SAVE_STATES=0 a training forward passes no buffer for the state before every chunk to
                             its backward, which then re-runs the scan into per-slice workspace (less
                             memory where the backward runs in batch slices; docs/kda-backward.md)
KERNEL_FUN_KDA_SAVE_WORKSPACE=0  a training forward does not keep its w, qg, kg and exp2(G) for the
                             backward, which then rebuilds them (kda_bwd_prep; less memory)
KERNEL_FUN_KDA_SPLIT=0|1|2, KERNEL_FUN_KDA_SPLIT_CHUNKS=L, KERNEL_FUN_KDA_RECURRENT=0|1  the split
                             scans (default 2: where the launch model says) and the token recurrence
                             (kda/_options.py: read into the call's options, so a backward takes its
                             forward's path)
"""

from __future__ import annotations

import logging
import os

_log = logging.getLogger("kernel_fun")
_warned: set[tuple[str, str]] = set()

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _bad(name: str, raw: str, default) -> None:
    if (name, raw) not in _warned:
        _warned.add((name, raw))
        _log.warning("kernel-fun: ignoring %s=%r (not understood); using the default %r", name, raw, default)


def flag(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    _bad(name, raw, default)
    return default


def integer(name: str, default: int, lo: int, hi: int) -> int:
    """A whole number in [lo, hi]; unset or empty gives the default, anything else warns and gives it."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        v = int(raw.strip())
    except ValueError:
        v = None
    if v is None or not lo <= v <= hi:
        _bad(name, raw, default)
        return default
    return v


def family_disabled(family: str) -> str | None:
    """The reason a family is switched off by the environment, or None."""
    if flag("KERNEL_FUN_DISABLE"):
        return "KERNEL_FUN_DISABLE=1"
    var = f"KERNEL_FUN_{family.upper()}_DISABLE"
    if flag(var):
        return f"{var}=1"
    return None
