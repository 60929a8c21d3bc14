"""``python -m kernel_fun.bench.accuracy``: every gradient of ``chunk_kda`` against the fp64
token-by-token recurrence, over a random matrix of options, ours and fla's on the same inputs.

Why it exists: ``dA_log`` and ``ddt_bias`` are sums over every token of ``dgate * d(gate)/d(.)``.
An error in dgate that is correlated across tokens (a rounding that one side of a cancellation
makes and the other does not) adds up in them although dg itself looks fine, so the other
gradients' tests do not see it. This matrix measures every gradient of every case against the
fp64 recurrence (``kernel_fun.ref.kda.naive_recurrent_kda`` through autograd), ours and fla's,
and writes ``<out>/<gpu>-grad-accuracy.json``: one row per case with its options and, per
gradient, our rel-RMS, fla's (null with the reason where fla cannot run the case) and the bound
    max(fla's tolerance, 1.25 x fla's own error on the same inputs)
(fla's tolerances: ``FLA_TOL`` / ``FLA_VARLEN_TOL``, from fla 0.5.2's tests/ops/test_kda.py).
tests/test_kda_grad_accuracy_gpu.py runs the same matrix against fp64 on every GPU run and holds
our errors to those bounds, reading fla's errors from the committed JSON.

    python -m kernel_fun.bench.accuracy --out bench/results            # ours and fla's
    python -m kernel_fun.bench.accuracy --no-fla --label before ...    # ours only

``--workers N`` spreads the cases over N processes on the same GPU (fla's Triton compile and
autotune of each new option mix is single-threaded CPU work; the cases are small).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import time

GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dh0")
OUTPUTS = ("o", "ht")

# fla 0.5.2, tests/ops/test_kda.py: test_chunk (dense) and test_chunk_varlen. dA is checked there as
# a warning only; it is the bound fla states for itself, and the one we hold ours to.
FLA_TOL = {"o": 0.005, "ht": 0.005, "dq": 0.008, "dk": 0.008, "dv": 0.008, "dg": 0.02, "dbeta": 0.02,
           "dA_log": 0.003, "ddt_bias": 0.008, "dh0": 0.008}
FLA_VARLEN_TOL = {"o": 0.005, "ht": 0.005, "dq": 0.007, "dk": 0.008, "dv": 0.007, "dg": 0.015, "dbeta": 0.015,
                  "dA_log": 0.008, "ddt_bias": 0.005, "dh0": 0.007}
FLA_FACTOR = 1.25

# The gate forms. "raw" gates are the log-decays themselves (use_gate_in_kernel=False); the others
# are computed in the kernel from a raw input g:
#   unbounded         -exp(A_log) softplus(g + dt_bias), exp(A_log) ~ U(1, 16), g ~ N(0, 1)
#   unbounded_nobias  the same without dt_bias
#   unbounded_strong  exp(A_log) = 16, g ~ N(4, 3^2): per-step decays around -64 (nothing survives a step)
#   bounded           lower_bound -5 with safe_gate, exp(A_log) ~ U(1, 16)
#   bounded_strong    lower_bound -5 with safe_gate, exp(A_log) = 16, g ~ N(4, 3^2): nearly every step at -5
#   bounded_noalog    lower_bound -3, no A_log
#   bounded_unsafe    lower_bound -12 without safe_gate (the bounded formula, unbounded kernels)
#   raw               logsigmoid(N(2, 1))
#   raw_strong        logsigmoid(N(0, 1)) / 0.1 (fla's gate_logit_normalizer): steps down to ~ -30
GATES = ("unbounded", "unbounded_nobias", "unbounded_strong", "bounded", "bounded_strong", "bounded_noalog",
         "bounded_unsafe", "raw", "raw_strong")
DTYPES = ("bf16", "fp16")


@dataclasses.dataclass(frozen=True)
class GradCase:
    """One chunk_kda call. ``raw_1000``: the fraction of raw gate inputs set to -1000 (fla's varlen
    tests: with an in-kernel gate that is no decay at all for the unbounded form, full decay for a
    raw one). ``inputs`` "randn" (zero-mean) or "rand" (fla's tests: q, k, v in [0, 1), correlated
    signs, so rounding errors add up coherently). ``g_dtype`` "fp32" or the inputs' dtype."""

    name: str
    B: int = 1
    T: int = 100
    H: int = 2
    HV: int = 2
    K: int = 64
    V: int = 64
    dtype: str = "bf16"
    gate: str = "unbounded"
    raw_1000: float = 0.0
    inputs: str = "randn"
    g_dtype: str = "fp32"
    l2norm: bool = True
    beta_sigmoid: bool = True
    neg_eig: bool = False
    h0: bool = False
    final: bool = True
    state_v_first: bool = False
    cu: tuple[int, ...] | None = None
    scale: float | None = None
    alog_4d: bool = False
    seed: int = 0

    @property
    def varlen(self) -> bool:
        return self.cu is not None

    def label(self) -> str:
        parts = [f"B{self.B} T{self.T}" if self.cu is None else f"cu={list(self.cu)}",
                 f"H{self.H}" + (f"/HV{self.HV}" if self.HV != self.H else ""), f"K{self.K} V{self.V}",
                 self.dtype, self.gate]
        if self.raw_1000:
            parts.append(f"raw-1000 {self.raw_1000:g}")
        for flag, text in ((self.inputs == "rand", "rand inputs"), (self.g_dtype != "fp32", f"g {self.g_dtype}"),
                           (not self.l2norm, "no l2norm"), (not self.beta_sigmoid, "beta given"),
                           (self.neg_eig, "neg eigval"), (self.h0, "h0"), (not self.final, "no ht"),
                           (self.state_v_first, "state_v_first"), (self.scale is not None, f"scale {self.scale}"),
                           (self.alog_4d, "A_log [1,1,HV,1]")):
            if flag:
                parts.append(text)
        return ", ".join(parts)


def _random_cu(rng: random.Random, T: int) -> tuple[int, ...]:
    """Packed documents over T tokens: 2-6 cuts, with an empty and a one-token document now and then."""
    cuts = sorted(rng.randint(0, T) for _ in range(rng.randint(1, 5)))
    if rng.random() < 0.5 and T > 2:
        cuts.append(cuts[rng.randrange(len(cuts))])  # an empty document
    if rng.random() < 0.5 and T > 3:
        c = rng.randint(1, T - 1)
        cuts += [c, c + 1]  # a one-token document
    return tuple([0] + sorted(cuts) + [T])


def _random_cases(n: int, seed: int) -> list[GradCase]:
    """n random option mixes: every gate form in turn, the rest drawn per case."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        gate = GATES[i % len(GATES)]
        long = i % 8 == 7
        T = rng.choice((1024, 2048, 4096)) if long else rng.choice((1, 2, 15, 63, 64, 65)) if i % 5 == 0 \
            else rng.randint(1, 300)
        H = rng.choice((1, 2))
        HV = H * rng.choice((1, 1, 2, 4))
        K = rng.choice((64, 128))
        V = rng.choice((64, 128)) if not long else 64
        varlen = not long and rng.random() < 0.3
        B = 1 if (varlen or long) else rng.choice((1, 2))
        raw_1000 = rng.choice((0.0, 0.0, 0.5, 0.9)) if gate in ("unbounded", "raw", "bounded_unsafe") else 0.0
        beta_sigmoid = rng.random() < 0.8
        out.append(GradCase(
            name=f"mix{i:02d}", B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=rng.choice(DTYPES), gate=gate,
            raw_1000=raw_1000, inputs=rng.choice(("randn", "randn", "rand")),
            g_dtype="fp32" if gate.startswith("raw") or rng.random() < 0.7 else "same",
            l2norm=rng.random() < 0.8, beta_sigmoid=beta_sigmoid, neg_eig=beta_sigmoid and rng.random() < 0.2,
            h0=rng.random() < 0.6, final=rng.random() < 0.8, state_v_first=rng.random() < 0.25,
            cu=_random_cu(rng, T) if varlen else None, scale=rng.choice((None, None, None, 0.1, 1.0)),
            alog_4d=rng.random() < 0.3, seed=1000 + i))
    return out


# Hand-picked cases first (what the issue and fla's own tests single out), then the random mixes.
CASES: tuple[GradCase, ...] = tuple([
    # fla 0.5.2 test_chunk_varlen[H4-D64-mask_p0.9-cu_seqlens[0, 256, 500, 1000]-fp16-gateTrue]: q
    # normalised outside, k unit, 90% of the raw gate inputs at -1000, h0, a positive dht
    GradCase("fla_varlen_mask09", T=1000, H=4, HV=4, K=64, V=64, dtype="fp16", gate="unbounded", raw_1000=0.9,
             g_dtype="same", l2norm=False, beta_sigmoid=False, h0=True, cu=(0, 256, 500, 1000), alog_4d=True),
    GradCase("fla_dense_gate", B=2, T=1024, H=2, HV=4, K=64, V=64, dtype="bf16", gate="unbounded", inputs="rand",
             g_dtype="same", l2norm=True, h0=True, scale=0.1),
    GradCase("strong_unbounded_T64", T=64, H=1, HV=1, K=128, V=128, gate="unbounded_strong", h0=True),
    GradCase("strong_unbounded_T300_gva", B=2, T=300, H=1, HV=4, K=64, V=64, gate="unbounded_strong"),
    GradCase("strong_bounded_T200", T=200, H=2, HV=2, K=128, V=64, gate="bounded_strong", h0=True),
    GradCase("raw_minus1000_T300", T=300, H=2, HV=2, K=64, V=128, gate="raw", raw_1000=0.5, h0=True),
    GradCase("varlen_empty_onetoken", T=200, H=2, HV=4, K=128, V=64, gate="unbounded", h0=True,
             cu=(0, 0, 1, 64, 64, 65, 200)),
    GradCase("T1_h0", B=2, T=1, H=2, HV=2, K=64, V=64, gate="unbounded", h0=True),
    GradCase("long_T4096", T=4096, H=1, HV=2, K=128, V=64, gate="unbounded", h0=True),
    GradCase("long_T2048_bounded_fp16", T=2048, H=2, HV=2, K=64, V=64, dtype="fp16", gate="bounded", h0=True),
] + _random_cases(56, seed=20261202))

CASE_NAMES = tuple(c.name for c in CASES)
BY_NAME = {c.name: c for c in CASES}
assert len(BY_NAME) == len(CASES)


def tolerances(case: GradCase) -> dict:
    return FLA_VARLEN_TOL if case.varlen else FLA_TOL


def bound(case: GradCase, key: str, fla_err: float | None) -> float:
    """What our rel-RMS must not exceed: fla's tolerance, or 1.25 x fla's own error if larger."""
    tol = tolerances(case)[key]
    if fla_err is None or not math.isfinite(fla_err):
        return tol
    return max(tol, FLA_FACTOR * fla_err)


# ----------------------------------------------------------------------------- inputs and calls
def make_inputs(case: GradCase, device="cuda"):
    """(inputs, kw, seeds): the five tensors, chunk_kda's keyword arguments (A_log / dt_bias /
    initial_state as leaves), and the gradients of o and the final state that seed the backward."""
    import torch
    import torch.nn.functional as F

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
    gen = torch.Generator(device=device).manual_seed(case.seed)

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    def uni(*shape):
        return torch.rand(*shape, device=device, generator=gen)

    B, T, H, HV, K, V = case.B, case.T, case.H, case.HV, case.K, case.V
    draw = uni if case.inputs == "rand" else rnd
    q, k, v = draw(B, T, H, K), draw(B, T, H, K), draw(B, T, HV, V)
    if not case.l2norm:  # the delta rule wants unit keys; fla's tests normalise outside the kernel
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    beta = rnd(B, T, HV)
    if not case.beta_sigmoid:
        beta = torch.sigmoid(beta)
    kw = dict(use_qk_l2norm_in_kernel=case.l2norm, use_beta_sigmoid_in_kernel=case.beta_sigmoid,
              allow_neg_eigval=case.neg_eig, state_v_first=case.state_v_first, output_final_state=case.final,
              scale=case.scale)
    gate = case.gate
    A_log = dt_bias = None
    if gate.startswith("raw"):
        g = F.logsigmoid(rnd(B, T, HV, K) + 2) if gate == "raw" else F.logsigmoid(rnd(B, T, HV, K)) / 0.1
        kw["use_gate_in_kernel"] = False
    else:
        strong = gate.endswith("_strong")
        g = 3 * rnd(B, T, HV, K) + 4 if strong else rnd(B, T, HV, K)
        A_log = torch.full((HV,), math.log(16.0), device=device) if strong else \
            torch.log(torch.empty(HV, device=device).uniform_(1, 16, generator=gen))
        if gate not in ("unbounded_nobias", "unbounded_strong", "bounded_strong"):
            dt_bias = 0.5 * rnd(HV * K)
        kw["use_gate_in_kernel"] = True
        if gate.startswith("bounded"):
            kw["lower_bound"] = {"bounded_noalog": -3.0, "bounded_unsafe": -12.0}.get(gate, -5.0)
            kw["safe_gate"] = gate in ("bounded", "bounded_strong")
            if gate == "bounded_noalog":
                A_log = None
        if A_log is not None:
            kw["A_log"] = A_log.reshape(1, 1, HV, 1) if case.alog_4d else A_log
        if dt_bias is not None:
            kw["dt_bias"] = dt_bias
    if case.raw_1000:
        g = torch.where(uni(*g.shape) < case.raw_1000, torch.full_like(g, -1000.0), g)
    if case.cu is not None:
        kw["cu_seqlens"] = torch.tensor(case.cu, dtype=torch.int32, device=device)
        kw["cu_seqlens_cpu"] = torch.tensor(case.cu, dtype=torch.int32)
    N = B if case.cu is None else len(case.cu) - 1
    state = (N, HV, V, K) if case.state_v_first else (N, HV, K, V)
    if case.h0:
        kw["initial_state"] = 0.1 * rnd(*state)
    seeds = dict(o=rnd(B, T, HV, V).to(dt), ht=rnd(*state) if case.final else None)
    g = g.to(torch.float32 if case.g_dtype == "fp32" else dt)
    inputs = (q.to(dt), k.to(dt), v.to(dt), g, beta.to(dt))
    return inputs, kw, seeds


_INPUTS = ("q", "k", "v", "g", "beta")
_LEAVES = ("A_log", "dt_bias", "initial_state")  # keyword arguments that get gradients too


def outputs_and_grads(fn, inputs, kw, seeds, cast=None):
    """o, ht and every gradient of <o, seeds.o> + <ht, seeds.ht> through fn (chunk_kda's
    signature), by kernel_fun.check.outputs_and_grads; gradients named as chunk_kda's inputs
    (dq .. dbeta, dA_log, ddt_bias, dh0). ``cast`` converts every leaf first (fp64 for the reference)."""
    from kernel_fun.check import outputs_and_grads as through

    conv = (lambda t: t) if cast is None else cast
    leaves = {n: conv(x) for n, x in zip(_INPUTS, inputs)}
    consts = {n: x for n, x in kw.items() if not (n in _LEAVES and x is not None)}
    leaves.update({n: conv(kw[n]) for n in _LEAVES if kw.get(n) is not None})
    outs, grads = through(fn, leaves, consts, {n: seeds[n] for n in ("o", "ht") if seeds[n] is not None})
    out = {("dh0" if n == "initial_state" else "d" + n): grads["d" + n] for n in leaves}
    out["o"], out["ht"] = outs["o"].detach(), (outs["ht"].detach() if "ht" in outs else None)
    return out


def reference(inputs, kw, seeds):
    """Autograd through the fp64 token-by-token recurrence."""
    from kernel_fun.ref.kda import naive_recurrent_kda

    rk = {n: x for n, x in kw.items() if n not in ("safe_gate", "cu_seqlens_cpu")}
    rk["output_final_state"] = seeds["ht"] is not None or kw.get("output_final_state", False)
    return outputs_and_grads(naive_recurrent_kda, inputs, rk, seeds,
                             cast=lambda t: t.double() if t.is_floating_point() else t)


def ours(inputs, kw, seeds):
    """Through kernel_fun.kda.chunk_kda in strict mode, with our forward and backward ops counted."""
    import kernel_fun
    from kernel_fun.check import count_kernel_ops, require_ran
    from kernel_fun.kda import chunk_kda

    with kernel_fun.strict(), count_kernel_ops() as counts:
        out = outputs_and_grads(chunk_kda, inputs, kw, seeds)
    require_ran(counts, ("kda_fwd", "kda_bwd"))
    return out


def fla(inputs, kw, seeds):
    from fla.ops.kda import chunk_kda

    return outputs_and_grads(chunk_kda, inputs, kw, seeds)


def errors(ref: dict, got: dict) -> dict:
    """rel-RMS of every output and gradient the reference has (kernel_fun.check.rel_rms)."""
    from kernel_fun.check import rel_rms

    out = {}
    for key in OUTPUTS + GRADS:
        r = ref.get(key)
        if r is None:
            continue
        g = got.get(key)
        out[key] = float("inf") if g is None or g.shape != r.shape else rel_rms(r, g)
    return out


def _short(e: BaseException) -> str:
    s = f"{type(e).__name__}: {e}".strip().splitlines()
    return (s[0] if s else type(e).__name__)[:300]


_FLA_NOT_NEEDED = ("not run: ours is within fla's tolerance on every gradient here, so fla's error cannot "
                   "change the bound (--fla-where needed, to fit fla's Triton compile into the device time)")


def within_tolerance(case: GradCase, errs: dict) -> bool:
    return all(e <= tolerances(case)[k] for k, e in errs.items())


def run_case(case: GradCase, impls=("ours", "fla"), fla_where: str = "all", draws: int = 0) -> dict:
    """One row: the case's options, and per implementation its errors (or why it did not run).
    fla_where "needed": fla runs only where ours exceeds fla's tolerance somewhere (elsewhere the
    bound is fla's tolerance whatever fla's error is); its row then says so.
    draws > 0: the same option mix on `draws` more seeds (case.seed + 1 ..), each implementation that
    ran on the case's own inputs, as row["draws"], and per implementation the median over all the
    inputs as row["median"]: one input's error is a wide draw (docs/notes/2026-12-02-dalog-floor.md),
    so a comparison of two implementations wants several. The bound stays on the case's own seed."""
    inputs, kw, seeds = make_inputs(case)
    t0 = time.time()
    ref = reference(inputs, kw, seeds)
    row = {"case": case.name, "label": case.label(), "options": dataclasses.asdict(case), "varlen": case.varlen,
           "tol": {k: tolerances(case)[k] for k in OUTPUTS + GRADS if ref.get(k) is not None}}
    for impl in impls:
        if impl == "fla" and fla_where == "needed" and row.get("ours") and within_tolerance(case, row["ours"]):
            row["fla"], row["fla_why"] = None, _FLA_NOT_NEEDED
            continue
        _run_impl(row, impl, inputs, kw, seeds, ref)
    if draws > 0:
        ran = [i for i in impls if row.get(i)]
        row["draws"] = [_draw(dataclasses.replace(case, seed=case.seed + d), ran) for d in range(1, draws + 1)]
        row["median"] = {i: _median_errors([row[i]] + [dr[i] for dr in row["draws"] if dr.get(i)]) for i in ran}
    row["seconds"] = round(time.time() - t0, 2)
    return row


def _draw(case: GradCase, impls) -> dict:
    """Every implementation's errors on another seed of the same option mix (None where it failed)."""
    inputs, kw, seeds = make_inputs(case)
    ref = reference(inputs, kw, seeds)
    out = {"seed": case.seed}
    for impl in impls:
        _run_impl(out, impl, inputs, kw, seeds, ref)
    return out


def _run_impl(row: dict, impl: str, inputs, kw, seeds, ref) -> None:
    """row[impl] = the implementation's errors against ref, or None and row[impl + "_why"]."""
    import torch

    try:
        got = {"ours": ours, "fla": fla}[impl](inputs, kw, seeds)
        torch.cuda.synchronize()
        row[impl] = errors(ref, got)
    except Exception as e:  # noqa: BLE001 - a row records why an implementation could not run
        row[impl] = None
        row[impl + "_why"] = _short(e)


def _median_errors(runs: list[dict]) -> dict:
    """Per output / gradient, the median of its rel-RMS over the runs that have it."""
    keys = {k for r in runs for k in r}
    return {k: statistics.median(r[k] for r in runs if k in r) for k in sorted(keys)}


def check_row(row: dict) -> list[str]:
    """The gradients (and outputs) of a row where ours is over its bound; [] when all hold."""
    case = BY_NAME[row["case"]]
    bad = []
    mine = row.get("ours")
    if mine is None:
        return [f"ours did not run: {row.get('ours_why')}"]
    theirs = row.get("fla") or {}
    for key, err in mine.items():
        b = bound(case, key, theirs.get(key))
        if not err <= b:
            bad.append(f"{key} {err:.2e} > {b:.2e}")
    return bad


# ------------------------------------------------------------------------------------------ CLI
def _worker(args):
    name, impls, fla_where, draws = args
    return run_case(BY_NAME[name], impls, fla_where, draws)


def _table(rows: list[dict], impls) -> str:
    lines = []
    keys = OUTPUTS + GRADS
    lines.append("| case | impl | " + " | ".join(keys) + " | over bound |")
    lines.append("|---|---|" + "---:|" * len(keys) + "---|")
    for r in rows:
        for impl in impls:
            e = r.get(impl)
            cells = [("-" if e is None or k not in e else f"{e[k]:.1e}") for k in keys]
            over = ", ".join(check_row(r)) if impl == "ours" else ""
            why = r.get(impl + "_why") or ""
            lines.append(f"| {r['case']} | {impl} | " + " | ".join(cells) + f" | {over or why} |")
    return "\n".join(lines)


def summary(rows: list[dict], impls) -> dict:
    """The worst rel-RMS per gradient over all rows, per implementation, and the rows over bound."""
    worst = {}
    for impl in impls:
        w = {}
        for r in rows:
            for k, e in (r.get(impl) or {}).items():
                if k not in w or e > w[k][0]:
                    w[k] = (e, r["case"])
        worst[impl] = {k: {"rel_rms": v[0], "case": v[1]} for k, v in w.items()}
    over = {r["case"]: check_row(r) for r in rows if check_row(r)}
    return {"worst": worst, "over_bound": over}


def _document(rows: list[dict], meta: dict, impls) -> dict:
    order = {n: i for i, n in enumerate(CASE_NAMES)}
    rows = sorted(rows, key=lambda r: order.get(r["case"], len(order)))
    return {"meta": meta, "summary": summary(rows, [i for i in impls if any(r.get(i) for r in rows)]), "rows": rows}


def _load_rows(path: str) -> list[dict]:
    """Rows of an earlier run whose case still has the same options in this matrix."""
    by_name = {c.name: json.loads(json.dumps(dataclasses.asdict(c))) for c in CASES}
    with open(path) as f:
        rows = json.load(f)["rows"]
    return [r for r in rows if by_name.get(r["case"]) == r.get("options")]


def _complete(row: dict, impls, fla_where: str, draws: int = 0) -> bool:
    """Whether an earlier row already answers this run: every implementation asked for either ran or
    could not (its reason), not merely went unmeasured (an ours-only run, or fla skipped as not
    needed when this run wants fla everywhere), and it has the draws asked for."""
    if len(row.get("draws") or []) < draws:
        return False
    for impl in impls:
        if row.get(impl) is not None:
            continue
        why = row.get(impl + "_why") or ""
        if not why or why.startswith("not measured") or (why == _FLA_NOT_NEEDED and fla_where == "all"):
            return False
    return True


def combine(paths: list[str], out: str, note: str = "") -> str:
    """Rows of several runs (files of this tool, measured on the same inputs: a case's inputs depend
    on its seed only) in one document. Per case the last file's row wins; each row says which run
    measured ours (ours_label) and, where fla's errors come from an earlier file because the winning
    row lacks them, which run measured fla's (fla_label); an earlier row's 'before' is kept too, and
    its 'draws' / 'median' (with draws_label, the run that measured them)."""
    rows: dict[str, dict] = {}
    metas = []
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        metas.append(doc["meta"])
        label = doc["meta"].get("label", "")
        for r in _load_rows(p):
            r = dict(r)
            r.setdefault("ours_label", label)
            if r.get("fla") is not None:
                r.setdefault("fla_label", label)
            old = rows.get(r["case"])
            if r.get("fla") is None and old is not None and old.get("fla") is not None:
                r["fla"], r["fla_label"] = old["fla"], old["fla_label"]
                r.pop("fla_why", None)
            elif r.get("fla") is None and not r.get("fla_why") and old is not None and old.get("fla_why"):
                r["fla_why"] = old["fla_why"]  # an ours-only run says nothing of why fla is missing
            if old is not None and "before" in old and "before" not in r:  # the A/B column of --merge
                r["before"] = old["before"]
            if old is not None and "draws" in old and "draws" not in r:  # --draws: more seeds, measured by
                r["draws"], r["median"] = old["draws"], old.get("median")  # that earlier run (draws_label)
                r["draws_label"] = old.get("draws_label", old.get("ours_label", ""))
            rows[r["case"]] = r
    meta = dict(metas[-1])
    # an earlier combined file's label lists its runs already: list them, not "combined: combined: ..."
    meta["label"] = "combined: " + "; ".join(m.get("label", "").removeprefix("combined: ") for m in metas)
    meta["combined_from"] = [os.path.basename(os.path.dirname(os.path.abspath(p))) + "/" + os.path.basename(p)
                             for p in paths]
    if note:
        meta["note"] = note
    impls = [i for i in ("ours", "fla") if any(r.get(i) for r in rows.values())]
    meta["impls"] = impls  # the last run's may be ours only (--no-fla) while earlier rows keep fla's
    doc = _document(list(rows.values()), meta, impls)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, os.path.basename(paths[-1]))
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernel_fun.bench.accuracy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results", help="folder for <gpu>-grad-accuracy.json")
    ap.add_argument("--no-fla", action="store_true", help="ours only (fla's columns stay null)")
    ap.add_argument("--case", action="append", help="a case name (repeatable); default: all")
    ap.add_argument("--workers", type=int, default=1, help="processes on the GPU (default 1)")
    ap.add_argument("--fla-where", choices=("all", "needed"), default="all",
                    help="'needed': run fla only where ours exceeds fla's tolerance (default: all)")
    ap.add_argument("--resume", metavar="JSON", help="keep this earlier run's rows (same options) and run "
                    "only the cases it lacks: a run cut off at a time limit goes on where it stopped")
    ap.add_argument("--label", default="", help="written into the JSON (e.g. the commit measured)")
    ap.add_argument("--draws", type=int, default=0, help="each case also on N more seeds; the rows get "
                    "'draws' and 'median' (the bound stays on the case's own seed)")
    ap.add_argument("--list", action="store_true", help="print the cases and exit (no GPU needed)")
    ap.add_argument("--before", metavar="JSON", help="no GPU: add this earlier run's errors of ours to each row "
                    "of --merge as 'before' (an A/B of two builds on the same inputs) and write --out")
    ap.add_argument("--merge", metavar="JSON", help="with --before: the run to merge into")
    ap.add_argument("--note", default="", help="with --merge or --combine: a note written into the JSON's meta")
    ap.add_argument("--combine", metavar="JSON", nargs="+", help="no GPU: one file from several runs' files "
                    "(--out): per case the row of the last file that has it, labelled with its run "
                    "(ours_label); where that row lacks fla's errors, an earlier file's are kept (fla_label)")
    a = ap.parse_args(argv)
    names = a.case or list(CASE_NAMES)
    unknown = sorted(set(names) - set(CASE_NAMES))
    if unknown:
        ap.error(f"unknown case(s) {unknown}")
    if a.list:
        for c in CASES:
            if c.name in names:
                print(f"{c.name}: {c.label()}")
        return 0
    if a.combine:
        path = combine(a.combine, a.out, a.note)
        print(f"wrote {path}")
        return 0
    if a.merge:
        with open(a.merge) as f:
            doc = json.load(f)
        before, before_meta = {}, {}
        if a.before:
            before = {r["case"]: r for r in _load_rows(a.before)}
            with open(a.before) as f:
                before_meta = json.load(f)["meta"]
        for r in doc["rows"]:
            if r["case"] in before:
                r["before"] = before[r["case"]].get("ours")
            if r.get("fla") is None and not r.get("fla_why"):  # an ours-only run: say why fla is missing
                r["fla"], r["fla_why"] = None, "not measured (meta.note says why)"
        doc["meta"]["before_label"] = before_meta.get("label", "")
        if a.note:
            doc["meta"]["note"] = a.note
        doc["summary"] = summary(doc["rows"], [i for i in ("ours", "fla", "before") if any(r.get(i) for r in doc["rows"])])
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, os.path.basename(a.merge))
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {path}")
        return 0
    import torch

    from kernel_fun import versions
    from kernel_fun.bench.report import gpu_slug

    impls = ("ours",) if a.no_fla else ("ours", "fla")
    t0 = time.time()
    meta = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "versions": versions(),
            "label": a.label, "impls": list(impls), "fla_where": a.fla_where, "draws": a.draws,
            "bound": f"max(fla's tolerance, {FLA_FACTOR} x fla's own error on the same inputs)",
            "reference": "autograd through kernel_fun.ref.kda.naive_recurrent_kda in fp64"}
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"{gpu_slug(meta['device'])}-grad-accuracy.json")
    rows = [r for r in _load_rows(a.resume) if r["case"] in names and _complete(r, impls, a.fla_where, a.draws)] \
        if a.resume else []
    todo = [n for n in names if n not in {r["case"] for r in rows}]
    # longest first, so the long cases do not all end up last; the file is rewritten after every case,
    # so a run stopped at a time limit leaves what it finished (and --resume goes on from there)
    todo.sort(key=lambda n: -BY_NAME[n].T)

    def done(row):
        rows.append(row)
        meta["seconds"] = round(time.time() - t0, 1)
        with open(path, "w") as f:
            json.dump(_document(rows, meta, impls), f, indent=1)
        print(f"[{len(rows)}/{len(names)}] {row['case']} ({row['seconds']} s)", file=sys.stderr, flush=True)

    if a.workers > 1 and todo:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(a.workers) as pool:
            for row in pool.imap_unordered(_worker, [(n, impls, a.fla_where, a.draws) for n in todo]):
                done(row)
    else:
        for n in todo:
            done(_worker((n, impls, a.fla_where, a.draws)))
    doc = _document(rows, meta, impls)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(_table(doc["rows"], impls))
    over = doc["summary"]["over_bound"]
    print(f"\n{len(rows)} cases, {len(over)} with a gradient over its bound; wrote {path} "
          f"({meta.get('seconds', 0)} s)")
    for impl, w in doc["summary"]["worst"].items():
        print(f"worst {impl}: " + ", ".join(f"{k} {v['rel_rms']:.2e} ({v['case']})" for k, v in w.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
