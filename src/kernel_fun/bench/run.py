"""Running the cases on the GPU: inputs, engagement checks, CUDA-event timing, memory, roofline.

Nothing here runs at import; torch, fla, flash_kda and the kernel_fun families are imported by
``run``.

Per case: inputs are allocated once (outside every timed region) and shared by all
implementations; per (case, pass, impl): warm-up calls (the first one also compiles/autotunes
and, for kernel_fun, is the engagement probe), then ``iters`` calls each bracketed by its own
pair of CUDA events, with L2 flushed before each (outside the events); the row's ``ms`` is the
median. Between cases everything is freed (del + torch.cuda.empty_cache()).

Engagement honesty (kernel_fun rows only): the family's ``is_supported`` is asked first; then
the first warm-up call listens to the ``kernel_fun`` logger. A call that kernel_fun routes to fla
(it logs "falling back to fla - <reason>") is NOT timed: the row is "not_run" with the reason,
so fla is never timed twice under two names. A KDA fwd+bwd routed this way is reported as
"backward not implemented: routes to fla".

FlashKDA (impl "flashkda", MoonshotAI/FlashKDA's ``flash_kda.fwd``, when importable) gets a row
only where it computes the same call: ``flashkda_supports`` (forward, bounded gate with
safe_gate, K = V = 128, H == HV, bf16). ``flashkda_step`` maps the case's chunk_kda inputs to
its arguments once per case; after timing, its output is compared with kernel_fun's chunk_kda on
the same inputs (``rel_rms_vs_kernel_fun``), and a disagreement above FLASHKDA_REL_RMS_TOL makes
the row an error instead of a timing.
"""

from __future__ import annotations

import gc
import importlib
import logging
import statistics
import time
from dataclasses import dataclass, field

from kernel_fun.bench.cases import CconvCase, KdaCase
from kernel_fun.bench.report import new_row, speedup

GIB = float(1 << 30)


@dataclass
class Config:
    cases: list
    passes: tuple[str, ...]
    iters: int = 20
    warmup: int = 3
    with_fla: bool = True
    with_flashkda: bool = True  # rows only where flashkda_supports(case, pass)
    flush_l2: bool = True
    seed: int = 0
    device: str = "cuda"
    budget_s: float | None = None   # start no new case after this many seconds
    host_ahead: bool = False        # a GPU sleep before each timed call (time_calls): GPU time, not launch time
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- implementations

_FAMILY_API = {
    # family: (kernel_fun module, function, [fla (module, function) candidates])
    "kda": ("kernel_fun.kda", "chunk_kda", [("fla.ops.kda", "chunk_kda")]),
    "cconv": ("kernel_fun.cconv", "causal_conv1d",
              [("fla.modules.causal_conv1d", "causal_conv1d"), ("fla.modules.convolution", "causal_conv1d"),
               ("fla.modules.conv", "causal_conv1d")]),
}


def _short(e: BaseException, limit: int = 300) -> str:
    s = f"{type(e).__name__}: {e}".strip().splitlines()
    s = s[0] if s else type(e).__name__
    return s if len(s) <= limit else s[: limit - 3] + "..."


def load_ours(family: str):
    """(function, is_supported, None) or (None, None, why not)."""
    mod_name, fn_name, _ = _FAMILY_API[family]
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001
        return None, None, f"{mod_name} not importable: {_short(e)}"
    fn = getattr(mod, fn_name, None)
    if fn is None:
        return None, None, f"{mod_name}.{fn_name} missing (family not implemented yet)"
    sup = getattr(mod, "is_supported", None)
    if sup is None:
        return None, None, f"{mod_name}.is_supported missing: cannot confirm engagement"
    return fn, sup, None


def load_fla(family: str):
    """(function, None) or (None, why not)."""
    errs = []
    for mod_name, fn_name in _FAMILY_API[family][2]:
        try:
            return getattr(importlib.import_module(mod_name), fn_name), None
        except Exception as e:  # noqa: BLE001
            errs.append(f"{mod_name}.{fn_name}: {_short(e, 160)}")
    return None, "fla not importable (" + "; ".join(errs) + ")"


# ---------------------------------------------------------------- FlashKDA (forward only)

FLASHKDA_REL_RMS_TOL = 2e-2  # its output vs kernel_fun's on the same inputs; above: an error row


def flashkda_supports(case, pass_: str) -> bool:
    """Whether FlashKDA computes this (case, pass) as chunk_kda does: forward only, bounded gate
    (lower_bound in [-5, 0] with safe_gate), K = V = 128, no GVA (H == HV), bf16. Only these
    (case, pass) get a flashkda row."""
    return (isinstance(case, KdaCase) and pass_ == "fwd" and case.dtype == "bf16"
            and case.lower_bound is not None and -5.0 <= case.lower_bound <= 0.0 and case.safe_gate
            and case.K == 128 and case.V == 128 and case.H == case.HV)


def load_flashkda():
    """(flash_kda.fwd, None) or (None, why not)."""
    try:
        return importlib.import_module("flash_kda").fwd, None
    except Exception as e:  # noqa: BLE001
        return None, f"flash_kda not importable ({_short(e)})"


def flashkda_step(fwd, inputs: dict, torch):
    """The one mapping of a case's chunk_kda inputs (``make_inputs``) to ``flash_kda.fwd``. The
    conversions happen here, once, outside any timed region: dt_bias [HV*K] -> [H, K] (H == HV),
    cu_seqlens int32 -> int64, scale K**-0.5 (chunk_kda's default), lower_bound as a float.
    q, k, v, g and beta (logits) are passed as they are: FlashKDA l2-normalises q/k, applies the
    beta sigmoid and the bounded gate lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) itself.
    Returns step(): one call into a freshly allocated ``out`` (as chunk_kda allocates its
    output), returned."""
    q, k, v, g, beta = inputs["args"]
    kw = inputs["kwargs"]
    H, K = q.shape[2], q.shape[3]
    A_log = kw["A_log"]
    dt_bias = kw["dt_bias"].reshape(H, K).contiguous()
    lower_bound = float(kw["lower_bound"])
    cu = kw.get("cu_seqlens")
    cu = None if cu is None else cu.to(torch.int64).contiguous()
    scale = K ** -0.5
    out_shape = tuple(inputs["out_shape"])

    def step():
        out = torch.empty(out_shape, dtype=v.dtype, device=v.device)
        fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, cu_seqlens=cu)
        return out

    return step


def ask_supported(is_supported, first, second, kwargs) -> tuple[bool, str | None]:
    """Call the family's is_supported; any exception or odd answer means 'not run'."""
    try:
        ans = is_supported(first, second, **kwargs)
    except Exception as e:  # noqa: BLE001
        return False, f"is_supported raised {_short(e)}"
    if isinstance(ans, bool):
        return ans, None if ans else "is_supported returned False (no reason given)"
    try:
        ok, reason = ans
    except Exception:  # noqa: BLE001
        return False, f"is_supported returned {ans!r}, expected (bool, reason)"
    return bool(ok), (None if ok else f"unsupported: {reason}")


class EngagementProbe(logging.Handler):
    """Listens to the ``kernel_fun`` logger during one call: did the family say 'engaged' or
    'falling back to fla - <reason>'? kernel_fun logs each message once per process, so the
    family's once-only memory is cleared first (best effort: if kernel_fun._dispatch changes
    shape, the probe only sees first-time messages)."""

    def __init__(self, family: str):
        super().__init__(level=logging.DEBUG)
        self.family = family
        self.fallbacks: list[str] = []
        self.engaged = False

    def emit(self, record):  # noqa: D401 - logging API
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001
            return
        if self.family not in msg:
            return
        if "falling back to fla" in msg:
            self.fallbacks.append(msg.split("falling back to fla", 1)[1].lstrip(" -:"))
        elif "engaged" in msg:
            self.engaged = True

    def __enter__(self):
        self._logger = logging.getLogger("kernel_fun")
        self._old_level = self._logger.level
        if self._logger.getEffectiveLevel() > logging.INFO:
            self._logger.setLevel(logging.INFO)
        self._logger.addHandler(self)
        try:
            from kernel_fun import _dispatch

            _dispatch.forget_logged(self.family)
        except Exception:  # noqa: BLE001 - best effort, see the class docstring
            pass
        return self

    def __exit__(self, *exc):
        self._logger.removeHandler(self)
        self._logger.setLevel(self._old_level)
        return False

    def verdict(self) -> bool | None:
        if self.fallbacks:
            return False
        return True if self.engaged else None


# ---------------------------------------------------------------- inputs

def make_inputs(case, torch, device, seed: int) -> dict:
    """All tensors of one case, allocated once. Returns {args, kwargs, leaves, out_shape,
    sup_args, sup_kwargs}: the call is fn(*args, **kwargs), the support question
    is_supported(*sup_args, **sup_kwargs, **kwargs); leaves get requires_grad for fwd+bwd."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    bf16 = torch.bfloat16

    def randn(*shape, dtype=bf16):
        return torch.randn(shape, dtype=dtype, device=device, generator=gen)

    if isinstance(case, KdaCase):
        B, T, H, HV, K, V = case.B, case.T, case.H, case.HV, case.K, case.V
        q, k = randn(B, T, H, K), randn(B, T, H, K)
        v = randn(B, T, HV, V)
        g = randn(B, T, HV, K)                      # raw gate input
        beta = randn(B, T, HV)                      # logits (sigmoid in kernel)
        A_log = torch.empty(HV, dtype=torch.float32, device=device).uniform_(1, 16, generator=gen).log_()
        dt_bias = 0.1 * randn(HV * K, dtype=torch.float32)
        kwargs = dict(A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True,
                      use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
        if case.lower_bound is not None:
            kwargs["lower_bound"] = case.lower_bound
        if case.safe_gate:
            kwargs["safe_gate"] = True
        if case.doc_lens is not None:
            offs = [0]
            for n in case.doc_lens:
                offs.append(offs[-1] + n)
            kwargs["cu_seqlens"] = torch.tensor(offs, dtype=torch.int32, device=device)
            kwargs["cu_seqlens_cpu"] = torch.tensor(offs, dtype=torch.int32)
        # is_supported(q, v, **kw) takes k, g, beta as keywords (else it allocates stand-ins)
        return dict(args=(q, k, v, g, beta), kwargs=kwargs,
                    leaves=[q, k, v, g, beta, A_log, dt_bias],
                    out_shape=(B, T, HV, V), sup_args=(q, v), sup_kwargs=dict(k=k, g=g, beta=beta))
    if isinstance(case, CconvCase):
        x = randn(case.B, case.T, case.D)
        w = randn(case.D, case.W)
        kwargs = dict(activation=case.activation)
        return dict(args=(x, w), kwargs=kwargs, leaves=[x, w],
                    out_shape=(case.B, case.T, case.D), sup_args=(x, w), sup_kwargs={})
    raise TypeError(f"unknown case type {type(case).__name__}")



def kda_stage_call(inputs: dict) -> tuple[tuple, dict]:
    """A KDA case's make_inputs as kernel_fun.kda._kernel.forward_stages / backward_stages
    arguments (the profiling scripts: scripts/kda_phases.py, scripts/dev/stream_trace.py):
    ((q, k, v, g, beta), {opts, cu_seqlens, A_log, dt_bias}), the options the bench's chunk_kda call
    resolves to (in-kernel gate, l2norm and beta sigmoid, the default scale, chunk 64)."""
    from kernel_fun.kda._options import KdaOptions

    q = inputs["args"][0]
    kw = inputs["kwargs"]
    opts = KdaOptions.from_call(scale=q.shape[-1] ** -0.5, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                use_beta_sigmoid_in_kernel=True, allow_neg_eigval=False,
                                lower_bound=kw.get("lower_bound"), A_log=kw["A_log"], state_v_first=False,
                                chunk_size=64)
    return inputs["args"], dict(opts=opts, cu_seqlens=kw.get("cu_seqlens"), A_log=kw["A_log"], dt_bias=kw["dt_bias"])

# ---------------------------------------------------------------- timing

def measure_copy_tbps(torch, nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth, counting bytes read + bytes written, median of iters."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src.random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        ts.append((a, b))
    torch.cuda.synchronize()
    ms = statistics.median(a.elapsed_time(b) for a, b in ts)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e12


# The host-ahead sleep: at least this long, at most HOST_AHEAD_MAX_MS, and twice the host's time to
# enqueue one call (its slowest warm-up call after the first).
HOST_AHEAD_MIN_MS = 0.5
HOST_AHEAD_MAX_MS = 50.0
_sleep_cycles_per_ms: float | None = None


def sleep_cycles_per_ms(torch) -> float:
    """The rate of torch.cuda._sleep (a spin on the SM clock), measured once per process by CUDA
    events around a sleep of 10^6 cycles."""
    global _sleep_cycles_per_ms
    if _sleep_cycles_per_ms is None:
        n = 1_000_000
        torch.cuda._sleep(n)  # the first launch of the sleep kernel is not timed
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(n)
        b.record()
        torch.cuda.synchronize()
        _sleep_cycles_per_ms = n / max(a.elapsed_time(b), 1e-3)
    return _sleep_cycles_per_ms


def host_ahead_ms(host_s: list[float]) -> float:
    """How long the GPU sleeps before each timed call: twice the host's slowest enqueue of one
    call in the warm-up (seconds, first call left out: it may compile), within the bounds above."""
    worst = max(host_s[1:] or host_s or [0.0]) * 1e3
    return min(HOST_AHEAD_MAX_MS, max(HOST_AHEAD_MIN_MS, 2.0 * worst))


def time_calls(torch, step, *, warmup: int, iters: int, before_each=None, flush=None,
               probe=None, host_ahead: bool = False) -> dict:
    """Warm up, then time ``iters`` calls of step() with CUDA events. The first warm-up call runs
    inside ``probe`` (a context manager) when given; if the probe reports a fallback, timing
    stops there and {"fallback": reasons} is returned.

    host_ahead: before each timed call the GPU sleeps (torch.cuda._sleep, after the L2 flush) for
    ``host_ahead_ms`` of the warm-up's host enqueue times, so the host has queued the whole call
    before its first kernel starts and the events time the GPU's work. Without it, a call whose
    kernels take less time than the host's launches and autograd (bounded_b1's training call: ~1.3
    ms of kernels) is timed at the host's pace, which wanders between calls."""
    host_s: list[float] = []
    for i in range(max(1, warmup)):
        if before_each:
            before_each()
        if i == 0 and probe is not None:
            with probe:
                step()
            torch.cuda.synchronize()
            if probe.fallbacks:
                return {"fallback": probe.fallbacks}
        else:
            t0 = time.perf_counter()
            step()
            host_s.append(time.perf_counter() - t0)
    if before_each:
        before_each()
    sleep_cycles = int(sleep_cycles_per_ms(torch) * host_ahead_ms(host_s)) if host_ahead else 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    events = []
    for _ in range(iters):
        if before_each:
            before_each()
        if flush is not None:
            flush.zero_()
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        events.append((a, b))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ts = [a.elapsed_time(b) for a, b in events]
    return {"ms": statistics.median(ts), "ms_min": min(ts), "ms_max": max(ts),
            "peak_mem_gib": max(0, peak) / GIB}


_BROKEN_MARKERS = ("CUDA error", "illegal memory access", "unspecified launch failure",
                   "device-side assert", "misaligned address", "illegal instruction")


# ---------------------------------------------------------------- the run

def format_duration(s: float) -> str:
    """45s, 1m23s, 2h05m."""
    s = max(0, round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_progress(i: int, n: int, what: str, elapsed_s: float, done_s: list[float],
                    took_s: float | None = None) -> str:
    """The progress line of unit i of n (1-based), at its start or (``took_s`` given) its end.
    ETA = mean time of the finished units x the units not finished; a rough guess, since a
    fwd+bwd unit takes several times a fwd one, hence the "~"."""
    eta = f"~{format_duration(statistics.fmean(done_s) * (n - len(done_s)))}" if done_s else "?"
    took = "" if took_s is None else f"  done in {format_duration(took_s)}"
    return f"[{i}/{n}] {what}{took}  elapsed {format_duration(elapsed_s)}  eta {eta}"


def _free(torch):
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _routed_note(family: str, grad: bool, reason: str, prefix: str) -> str:
    if family == "kda" and grad and any(w in reason.lower() for w in ("backward", "grad")):
        return f"backward not implemented: routes to fla ({reason})"
    return f"{prefix}{reason}"


def _load_impls(cfg: Config, log) -> dict:
    """{family: {impl: (function or None, is_supported or None, why not)}}."""
    impls: dict[str, dict] = {}
    for fam in sorted({c.family for c in cfg.cases}):
        fn, sup, why = load_ours(fam)
        impls[fam] = {"kernel_fun": (fn, sup, why)}
        if fn is None:
            log(f"{fam}: kernel_fun not run: {why}")
        if cfg.with_fla:
            ffn, fwhy = load_fla(fam)
            impls[fam]["fla"] = (ffn, None, fwhy)
            if ffn is None:
                log(f"{fam}: {fwhy}: timing kernel_fun only")
    if cfg.with_flashkda and any(flashkda_supports(c, p) for c in cfg.cases for p in cfg.passes):
        kfn, kwhy = load_flashkda()
        impls["kda"]["flashkda"] = (kfn, None, kwhy)
        if kfn is None:
            log(f"kda: {kwhy}: no flashkda timings")
    return impls


def run(cfg: Config, meta: dict, log=print, on_case_done=None, progress=None) -> list[dict]:
    """Time every (case, pass, impl) of cfg; returns the rows. ``meta`` (gpu, device_name,
    copy_tbps, versions, date) is copied into each row. ``on_case_done(rows)`` is called after
    each case (the CLI rewrites its files there, so a run cut short still leaves results).
    ``progress(line)`` gets a ``format_progress`` line as each (case, pass) starts and ends, and
    one line when the rest is skipped."""
    import torch

    t_start = time.monotonic()
    common = {k: meta.get(k) for k in ("gpu", "device_name", "copy_tbps", "versions", "date")}
    copy_tbps = meta.get("copy_tbps")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=cfg.device) if cfg.flush_l2 else None
    impls = _load_impls(cfg, log)
    impl_names = ("kernel_fun", "fla") if cfg.with_fla else ("kernel_fun",)

    rows: list[dict] = []
    skip: str | None = None  # once set, every later row is "not_run" with this note
    n_units, done_s, said_skip = len(cfg.cases) * len(cfg.passes), [], False
    for ci, case in enumerate(cfg.cases):
        if skip is None and cfg.budget_s is not None and time.monotonic() - t_start > cfg.budget_s:
            skip = f"skipped: --budget-s {cfg.budget_s:g} used up before this case"
        inputs, alloc_err = None, None
        if skip is None:
            try:
                inputs = make_inputs(case, torch, cfg.device, cfg.seed + ci)
            except Exception as e:  # noqa: BLE001
                alloc_err = _short(e)
                log(f"[{case.name}] could not allocate inputs: {alloc_err}")
        for pi, pass_ in enumerate(cfg.passes):
            unit, t_unit = ci * len(cfg.passes) + pi + 1, time.monotonic()
            what = f"{case.family} {case.name} {pass_}"
            ran = skip is None  # skipped units take no time: kept out of the ETA's mean
            if progress is not None and (ran or not said_skip):
                progress(format_progress(unit, n_units, what, t_unit - t_start, done_s) if ran else
                         f"[{unit}/{n_units}] {skip}; this and the {n_units - unit} after it not run")
                said_skip = not ran
            grad = pass_ == "fwd+bwd"
            nbytes = case.bytes(pass_)
            pass_rows, do = {}, None
            with_fk = cfg.with_flashkda and flashkda_supports(case, pass_)
            for impl in impl_names + (("flashkda",) if with_fk else ()):
                row = new_row(family=case.family, case=case.name, impl=impl, bytes=nbytes,
                              floor_ms=nbytes / (copy_tbps * 1e9) if copy_tbps else None,
                              iters=cfg.iters, warmup=cfg.warmup,
                              anchor_fla_ms=dict(case.anchor_fla_ms) or None,
                              shape=case.shape(), params=case.params(), status="not_run",
                              host_ahead=cfg.host_ahead, **{"pass": pass_}, **common)
                pass_rows[impl] = row
                rows.append(row)
                fn, sup, why = impls[case.family][impl]
                if skip is not None:
                    row["note"] = skip
                    continue
                if inputs is None:
                    row["status"], row["note"] = "error", f"input allocation failed: {alloc_err}"
                    continue
                if fn is None:
                    row["note"] = why
                    continue
                for t in inputs["leaves"]:
                    t.requires_grad_(grad)
                    t.grad = None
                if grad and do is None:
                    try:
                        do = torch.randn(inputs["out_shape"], dtype=torch.bfloat16, device=cfg.device)
                    except Exception as e:  # noqa: BLE001
                        row["status"], row["note"] = "error", f"allocating do: {_short(e)}"
                        continue
                if impl == "flashkda":
                    ref_fn, _, ref_why = impls[case.family]["kernel_fun"]
                    _measure_flashkda(torch, row, case, fn, ref_fn, ref_why, inputs, cfg, flush, log)
                else:
                    _measure(torch, row, case, impl, fn, sup, inputs, grad, do, cfg, flush, log)
                if row["status"] == "error" and any(m in row["note"] for m in _BROKEN_MARKERS):
                    skip = f"skipped: CUDA context broken by an earlier error ({row['note']})"
                if skip is None:
                    try:
                        _free(torch)
                    except Exception as e:  # noqa: BLE001
                        skip = f"skipped: CUDA context broken by an earlier error ({_short(e)})"
            if "kernel_fun" in pass_rows:
                pass_rows["kernel_fun"]["speedup_vs_fla"] = speedup(pass_rows["kernel_fun"],
                                                                   pass_rows.get("fla"))
            if ran:
                now = time.monotonic()
                done_s.append(now - t_unit)
                if progress is not None:
                    progress(format_progress(unit, n_units, what, now - t_start, done_s, now - t_unit))
            del do
        del inputs
        if skip is None:
            try:
                _free(torch)
            except Exception as e:  # noqa: BLE001
                skip = f"skipped: CUDA context broken by an earlier error ({_short(e)})"
        if on_case_done is not None:
            on_case_done(rows)
    del flush
    return rows


def _measure(torch, row, case, impl, fn, sup, inputs, grad, do, cfg, flush, log) -> None:
    """Fill one row: engagement checks (kernel_fun only), then the timing."""
    tag = f"[{case.name} {row['pass']}] {impl}"
    probe = None
    if impl == "kernel_fun":
        ok, reason = ask_supported(sup, *inputs["sup_args"],
                                   {**inputs["sup_kwargs"], **inputs["kwargs"]})
        if not ok:
            row["note"], row["engaged"] = _routed_note(case.family, grad, reason, ""), False
            log(f"{tag}: not run: {row['note']}")
            return
        probe = EngagementProbe(case.family)
    res = _time_one(torch, fn, inputs, grad, do, cfg, flush, probe)
    if "fallback" in res:
        row["note"] = _routed_note(case.family, grad, "; ".join(res["fallback"]),
                                   "kernel_fun routes this call to fla: ")
        row["engaged"] = False
    elif "error" in res:
        row["status"], row["note"] = "error", res["error"]
    else:
        _fill_timing(row, res)
        if probe is not None:
            row["engaged"] = probe.verdict()
            if row["engaged"] is None:
                row["note"] = "engagement not confirmed (no 'engaged' log seen)"
    log(f"{tag}: " + (f"{row['ms']:.3f} ms" if row["status"] == "ok"
                      else f"{row['status'].replace('_', ' ')}: {row['note']}"))


def _fill_timing(row, res) -> None:
    tbps = row["bytes"] / (res["ms"] * 1e-3) / 1e12
    row.update(status="ok", ms=res["ms"], ms_min=res["ms_min"], ms_max=res["ms_max"],
               peak_mem_gib=round(res["peak_mem_gib"], 4), tbps=tbps,
               roofline_frac=tbps / row["copy_tbps"] if row.get("copy_tbps") else None)


def _measure_flashkda(torch, row, case, fwd, ref_fn, ref_why, inputs, cfg, flush, log) -> None:
    """Fill one flashkda row: time ``flashkda_step``, then check its output once against
    kernel_fun's chunk_kda (``ref_fn``) on the same inputs. Without that reference nothing is
    timed; above FLASHKDA_REL_RMS_TOL the row is an error, its time not reported."""
    from kernel_fun.check import rel_rms  # the project's metric (inf for a non-finite output)

    tag = f"[{case.name} {row['pass']}] flashkda"
    if ref_fn is None:
        row["note"] = f"not timed: its agreement check needs kernel_fun's chunk_kda ({ref_why})"
        log(f"{tag}: not run: {row['note']}")
        return
    stage = "timing"
    try:
        step = flashkda_step(fwd, inputs, torch)
        with torch.no_grad():  # as the other forward rows (see _time_one)
            res = time_calls(torch, step, warmup=cfg.warmup, iters=cfg.iters, flush=flush,
                             host_ahead=cfg.host_ahead)
            stage = "agreement check"
            got = step()
            want = ref_fn(*inputs["args"], **inputs["kwargs"])[0]
            rel = rel_rms(want, got)
            del got, want
    except Exception as e:  # noqa: BLE001 - a failing implementation is a row, not a crash
        row["status"], row["note"] = "error", (_short(e) if stage == "timing"
                                               else f"agreement check failed: {_short(e)}")
        log(f"{tag}: error: {row['note']}")
        return
    row["rel_rms_vs_kernel_fun"] = rel
    if not rel <= FLASHKDA_REL_RMS_TOL:  # also catches nan
        row["status"] = "error"
        row["note"] = (f"disagrees with kernel_fun's chunk_kda on the same inputs: rel-RMS {rel:.3g} > "
                       f"{FLASHKDA_REL_RMS_TOL:g} (argument mapping?); its {res['ms']:.3f} ms not reported")
    else:
        _fill_timing(row, res)
        row["note"] = f"rel-RMS vs kernel_fun {rel:.1e}"
    log(f"{tag}: " + (f"{row['ms']:.3f} ms ({row['note']})" if row["status"] == "ok"
                      else f"error: {row['note']}"))


def _time_one(torch, fn, inputs, grad, do, cfg, flush, probe) -> dict:
    args, kwargs, leaves = inputs["args"], inputs["kwargs"], inputs["leaves"]
    try:
        if grad:
            def step():
                out = fn(*args, **kwargs)[0]
                torch.autograd.backward(out, do)

            def reset():
                for t in leaves:
                    t.grad = None

            return time_calls(torch, step, warmup=cfg.warmup, iters=cfg.iters, before_each=reset,
                              flush=flush, probe=probe, host_ahead=cfg.host_ahead)

        def fstep():
            fn(*args, **kwargs)

        # no_grad, not inference_mode: fla caches tensors derived from cu_seqlens (its chunk indices)
        # across calls, and an inference tensor from a forward row cannot be saved for backward
        # in the fwd+bwd row that follows (fla's varlen fwd+bwd failed that way on 2026-12-01).
        with torch.no_grad():
            return time_calls(torch, fstep, warmup=cfg.warmup, iters=cfg.iters, flush=flush,
                              probe=probe, host_ahead=cfg.host_ahead)
    except Exception as e:  # noqa: BLE001 - a failing implementation is a row, not a crash
        return {"error": _short(e)}
    finally:
        for t in leaves:
            t.grad = None


def gather_meta(torch, measure_roofline: bool = True, log=print) -> dict:
    from kernel_fun.bench.report import gpu_slug

    name = torch.cuda.get_device_name()
    try:
        import kernel_fun

        versions = kernel_fun.versions()
    except Exception as e:  # noqa: BLE001
        versions = {"error": _short(e)}
    meta = {"gpu": gpu_slug(name), "device_name": name, "versions": versions,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    meta["copy_tbps"] = measure_copy_tbps(torch) if measure_roofline else None
    if meta["copy_tbps"]:
        log(f"copy roofline: {meta['copy_tbps']:.2f} TB/s (device-to-device, read + write)")
    return meta
