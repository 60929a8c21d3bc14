"""``python -m kernel_fun.check [--family cconv|kda|all] [--quiet]``: a self-check to run on your GPU.

It prints ``kernel_fun.versions()``, then one line per check (the numbers here are illustrative):

    PASS kda forward+backward B2 T100 H2 HV4 K128 V128 bf16 (o 1.9e-03, ht 1.1e-03, dq 3.0e-03, ...)
    FAIL cconv CUDA graph decode update N4 D256 W4 bf16 silu: RuntimeError: ...

Per family, on small shapes: forward and backward against the fp64 reference (``kernel_fun.ref``)
on the same inputs, every output and every input gradient within the rel-RMS tolerances the test
suite uses; proof that our kernels ran (their ``torch.ops.kernel_fun`` ops were called) rather than
fla; and CUDA-graph capture and replay (new values copied into the captured inputs) equal to an eager
call. Every check runs inside ``kernel_fun.strict()``, so a fallback to fla is a failure with its
reason. The exit status is 0 only when every check passed; without a CUDA device or the built
extension nothing can be checked and it is 1.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import sys
from typing import Callable, Iterable

# rel-RMS tolerances against the fp64 reference: tests/helpers.py's KDA_TOL / CCONV_TOL (ddt_bias is
# its "dbias") and dA_log tests/helpers.py's DA_LOG_TOL; tests/test_check.py keeps them equal.
KDA_TOL = {"o": 0.005, "ht": 0.005, "dq": 0.008, "dk": 0.008, "dv": 0.008, "dg": 0.02, "dbeta": 0.02,
           "dA_log": 0.03, "ddt_bias": 0.008, "dh0": 0.008}
CCONV_TOL = 1e-3

FAMILIES = ("cconv", "kda")

# Small shapes that still cross what the kernels special-case: a partial tail chunk (T % 64 != 0),
# B > 1, grouped value heads (HV > H), and packed documents that are empty, one token long, shorter
# than the conv window or end on a chunk boundary.
KDA_DENSE = dict(B=2, T=100, H=2, HV=4, K=128, V=128)
KDA_VARLEN = dict(B=1, T=150, H=2, HV=2, K=128, V=128, cu=(0, 1, 64, 64, 150))
CCONV_DENSE = dict(B=2, T=100, D=256, W=4)
CCONV_VARLEN = dict(B=1, T=100, D=256, W=4, cu=(0, 1, 3, 3, 100))
CCONV_DECODE = dict(N=4, D=256, W=4)

# The ops whose calls prove our kernels served a forward+backward (not fla, not the CPU reference).
KDA_OPS = ("kda_fwd", "kda_bwd")
CCONV_OPS = ("cconv_fwd", "cconv_bwd")


class CheckFailed(AssertionError):
    """A check ran and its result is wrong (the message says what)."""


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[], str]  # returns what was measured, for the PASS line; raises on failure


@dataclasses.dataclass(frozen=True)
class Result:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        if self.ok:
            return f"PASS {self.name}" + (f" ({self.detail})" if self.detail else "")
        return f"FAIL {self.name}: {self.detail}"


# ------------------------------------------------------------------------------------ numerics
def rel_rms(ref, got) -> float:
    """RMS(ref - got) / RMS(ref) in fp64, tests/helpers.py's metric (tests/test_check.py keeps them
    equal): no absolute escape, so tiny tensors are judged at their own scale; NaN/Inf -> inf."""
    ref = ref.detach().double().cpu()
    got = got.detach().double().cpu()
    if not bool(got.isfinite().all()):
        return float("inf")
    num = (ref - got).pow(2).mean().sqrt().item() if ref.numel() else 0.0
    denom = ref.pow(2).mean().sqrt().item() if ref.numel() else 0.0
    if denom == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / denom


def _tol(tols, name: str) -> float:
    return tols if isinstance(tols, float) else tols[name]


def compare(pairs: dict, tols, round_ref: bool = False) -> str:
    """pairs: name -> (fp64 reference, ours). Returns "name err, ..." or raises CheckFailed naming
    every tensor over its tolerance. round_ref rounds the reference to our dtype first (cconv's
    1e-3 is below bf16's own rounding, so its tests measure the kernel's error beyond it)."""
    errs = {}
    for name, (ref, got) in pairs.items():
        if got is None:
            raise CheckFailed(f"{name} is missing (None)")
        if tuple(got.shape) != tuple(ref.shape):
            raise CheckFailed(f"{name} has shape {tuple(got.shape)}, the reference {tuple(ref.shape)}")
        errs[name] = rel_rms(ref.to(got.dtype) if round_ref else ref, got)
    summary = ", ".join(f"{n} {e:.1e}" for n, e in errs.items())
    bad = [f"{n} rel-RMS {e:.1e} > {_tol(tols, n):.0e}" for n, e in errs.items() if not e <= _tol(tols, n)]
    if bad:
        raise CheckFailed(f"{'; '.join(bad)} ({summary})")
    return summary


def require_equal(names: Iterable[str], eager, replayed) -> str:
    """Graph replay must reproduce the eager call bit for bit (our kernels are deterministic)."""
    names = list(names)
    off = [f"{n} (rel-RMS {rel_rms(e, r):.1e})" for n, e, r in zip(names, eager, replayed) if not _equal(e, r)]
    if off:
        raise CheckFailed(f"replay differs from eager: {', '.join(off)}")
    return f"replay == eager: {', '.join(names)}"


def _equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


# ------------------------------------------------------------------------------- engagement
@contextlib.contextmanager
def count_kernel_ops():
    """Launches of our kernel ops while active, by op name (kernel_fun._ext.op_calls: counted in
    C++ at every launch, so the backward's launches count too). Filled when the block ends."""
    from kernel_fun import _ext

    counts: collections.Counter = collections.Counter()
    before = _ext.op_calls()
    try:
        yield counts
    finally:
        after = _ext.op_calls()
        counts.update({name: n - before.get(name, 0) for name, n in after.items() if n != before.get(name, 0)})


def require_ran(counts, ops: Iterable[str]) -> None:
    missing = [op for op in ops if counts[op] == 0]
    if missing:
        raise CheckFailed(f"our kernels did not run: kernel_fun::{', kernel_fun::'.join(missing)} never called")


# ---------------------------------------------------------------------- forward + backward
def outputs_and_grads(fn, leaves: dict, consts: dict, seeds: dict):
    """Call fn(**leaves, **consts) -> outputs named like seeds, then backpropagate the seeds (cast
    to each output's dtype). Returns ({output: tensor}, {"d" + leaf: gradient})."""
    import torch

    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in leaves.items()}
    outs = dict(zip(seeds, fn(**leaves, **consts)))
    grads = torch.autograd.grad(list(outs.values()), list(leaves.values()),
                                [seeds[n].to(outs[n].dtype) for n in outs])
    return outs, {"d" + n: g for n, g in zip(leaves, grads)}


def forward_backward(ours, ref, leaves: dict, consts: dict, seeds: dict, tols, kernel_ops: Iterable[str],
                     round_ref: bool = False) -> str:
    """Ours (counting our ops) and the reference on fp64 copies of the same inputs; compare every
    output and every input gradient."""
    import torch

    with count_kernel_ops() as counts:
        got, dgot = outputs_and_grads(ours, leaves, consts, seeds)
        if any(t.is_cuda for t in leaves.values()):
            torch.cuda.synchronize()  # an asynchronous kernel error belongs to this check
    require_ran(counts, kernel_ops)
    want, dwant = outputs_and_grads(ref, {n: t.double() for n, t in leaves.items()}, consts, seeds)
    pairs = {n: (want[n], got[n]) for n in got}
    pairs.update({n: (dwant[n], dgot[n]) for n in dgot})
    return compare(pairs, tols, round_ref)


def _generator(device):
    import torch

    return torch.Generator(device=device).manual_seed(0)


def _label(shape: dict) -> str:
    """"B2 T100 H2 ..." from a shape dict; packed documents show as their cu_seqlens instead of B, T."""
    cu = shape.get("cu")
    skip = ("cu", "B", "T") if cu is not None else ("cu",)
    parts = [f"{k}{v}" for k, v in shape.items() if k not in skip]
    return " ".join(([f"varlen cu=[{','.join(map(str, cu))}]"] if cu is not None else []) + parts)


def _cu(cu, device):
    import torch

    return None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)


# KDA: the flags of Kimi Linear's layer (in-kernel gate with A_log and dt_bias, l2norm, beta
# sigmoid) with an initial and a final state, so one call has a gradient for every input.
_KDA_FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  output_final_state=True)


def _kda_ours(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens=None):
    from kernel_fun.kda import chunk_kda

    return chunk_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias,
                     **_KDA_FLAGS)


def _kda_ref(q, k, v, g, beta, A_log, dt_bias, h0, cu_seqlens=None):
    from kernel_fun.ref.kda import chunk_kda_reference

    return chunk_kda_reference(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu_seqlens, A_log=A_log,
                               dt_bias=dt_bias, **_KDA_FLAGS)


def kda_inputs(B, T, H, HV, K, V, cu=None, device="cuda"):
    """(leaves, consts, seeds): bf16 q/k/v/beta, fp32 g/A_log/dt_bias/h0 as a training step has them;
    seeds are the gradients of o and ht."""
    import torch

    gen = _generator(device)

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    bf16 = torch.bfloat16
    N = B if cu is None else len(cu) - 1
    leaves = dict(q=rnd(B, T, H, K).to(bf16), k=rnd(B, T, H, K).to(bf16), v=rnd(B, T, HV, V).to(bf16),
                  g=rnd(B, T, HV, K), beta=rnd(B, T, HV).to(bf16),
                  A_log=torch.log(torch.empty(HV, device=device).uniform_(1, 16, generator=gen)),
                  dt_bias=0.5 * rnd(HV * K), h0=0.1 * rnd(N, HV, K, V))
    seeds = dict(o=rnd(B, T, HV, V).to(bf16), ht=rnd(N, HV, K, V))
    return leaves, dict(cu_seqlens=_cu(cu, device)), seeds


def kda_forward_backward(shape: dict, device="cuda", kernel_ops=KDA_OPS) -> str:
    leaves, consts, seeds = kda_inputs(**shape, device=device)
    return forward_backward(_kda_ours, _kda_ref, leaves, consts, seeds, KDA_TOL, kernel_ops)


def _cconv_ours(x, weight, bias, residual, h0, cu_seqlens=None):
    from kernel_fun.cconv import causal_conv1d

    return causal_conv1d(x, weight, bias, residual, h0, output_final_state=True, activation="silu",
                         cu_seqlens=cu_seqlens)


def _cconv_ref(x, weight, bias, residual, h0, cu_seqlens=None):
    from kernel_fun.ref.cconv import causal_conv1d_ref

    return causal_conv1d_ref(x, weight, bias, residual, h0, True, "silu", cu_seqlens)


def cconv_inputs(B, T, D, W, cu=None, device="cuda"):
    """(leaves, consts, seeds): bf16 x, weight, bias, residual and initial state (a conv layer's
    mixed-precision step); seeds are the gradients of y and the final state."""
    import torch

    gen = _generator(device)

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=gen).to(torch.bfloat16)

    N = B if cu is None else len(cu) - 1
    leaves = dict(x=rnd(B, T, D), weight=rnd(D, W) / W ** 0.5, bias=0.5 * rnd(D), residual=rnd(B, T, D),
                  h0=rnd(N, D, W))
    seeds = dict(y=rnd(B, T, D), ht=rnd(N, D, W))
    return leaves, dict(cu_seqlens=_cu(cu, device)), seeds


def cconv_forward_backward(shape: dict, device="cuda", kernel_ops=CCONV_OPS) -> str:
    leaves, consts, seeds = cconv_inputs(**shape, device=device)
    return forward_backward(_cconv_ours, _cconv_ref, leaves, consts, seeds, CCONV_TOL, kernel_ops, round_ref=True)


# ------------------------------------------------------------------------------- CUDA graphs
def graph_matches_eager(run, static: list, fresh: list, names: Iterable[str]) -> str:
    """Capture run(*static) in a CUDA graph, copy the fresh values into the static inputs, replay,
    and compare the replay's outputs with an eager run(*copies of fresh). run may update its
    inputs in place (the decode step's cache): the eager run gets copies, never the static ones."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a side stream, as torch.cuda.graph asks
        for _ in range(2):
            run(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = run(*static)
    with torch.no_grad():
        for s, f in zip(static, fresh):
            s.copy_(f)
    graph.replay()
    eager = run(*(f.clone().requires_grad_(s.requires_grad) for s, f in zip(static, fresh)))
    torch.cuda.synchronize()
    return require_equal(names, eager, replayed)


def _split_kda(leaves):
    """(the five per-token inputs a step feeds anew, the parameters and state that stay)."""
    return [leaves[n] for n in ("q", "k", "v", "g", "beta")], (leaves["A_log"], leaves["dt_bias"], leaves["h0"])


def _fresh(tensors):
    """New standard-normal values of each tensor's shape and dtype (a valid input for every one
    replaced here: raw gates, pre-sigmoid beta, activations)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(1)
    return [torch.randn(t.shape, device=t.device, generator=gen).to(t.dtype) for t in tensors]


def kda_graph_forward(shape: dict) -> str:
    import torch

    static, fixed = _split_kda(kda_inputs(**shape)[0])

    def run(*xs):
        with torch.no_grad():
            return _kda_ours(*xs, *fixed)

    return graph_matches_eager(run, static, _fresh(static), ("o", "ht"))


def kda_graph_forward_backward(shape: dict) -> str:
    import torch

    leaves, _, seeds = kda_inputs(**shape)
    static, fixed = _split_kda(leaves)
    static = [t.requires_grad_(True) for t in static]

    def run(*xs):
        o, ht = _kda_ours(*xs, *fixed)
        return (o, ht) + torch.autograd.grad((o, ht), xs, (seeds["o"], seeds["ht"]))

    return graph_matches_eager(run, static, _fresh(static), ("o", "ht", "dq", "dk", "dv", "dg", "dbeta"))


def cconv_graph_forward_backward(shape: dict) -> str:
    import torch

    leaves, _, seeds = cconv_inputs(**shape)
    static = [leaves["x"].requires_grad_(True)]
    w, b, res, h0 = (leaves[n] for n in ("weight", "bias", "residual", "h0"))

    def run(x):
        y, ht = _cconv_ours(x, w, b, res, h0)
        return (y, ht) + torch.autograd.grad((y, ht), (x,), (seeds["y"], seeds["ht"]))

    return graph_matches_eager(run, static, _fresh(static), ("y", "ht", "dx"))


def cconv_graph_decode(shape: dict) -> str:
    """The decode step as inference servers capture it: x and the cache (updated in place) static."""
    import torch

    from kernel_fun.cconv import causal_conv1d_update

    N, D, W = shape["N"], shape["D"], shape["W"]
    gen = _generator("cuda")

    def rnd(*s):
        return torch.randn(*s, device="cuda", generator=gen).to(torch.bfloat16)

    weight, bias = rnd(D, W) / W ** 0.5, 0.5 * rnd(D)
    static = [rnd(N, D), rnd(N, D, W)]

    def run(x, cache):
        with torch.no_grad():
            return causal_conv1d_update(x, cache, weight=weight, bias=bias, activation="silu")

    return graph_matches_eager(run, static, _fresh(static), ("y", "cache"))


# -------------------------------------------------------------------------------- the checks
def family_checks(family: str) -> list[Check]:
    """The checks of one family, or of both with "all" (names only: nothing runs here)."""
    if family == "all":
        return [c for f in FAMILIES for c in family_checks(f)]
    p = functools.partial
    if family == "kda":
        bf = " bf16"
        return [Check(f"kda forward+backward {_label(KDA_DENSE)}{bf}", p(kda_forward_backward, KDA_DENSE)),
                Check(f"kda forward+backward {_label(KDA_VARLEN)}{bf}", p(kda_forward_backward, KDA_VARLEN)),
                Check(f"kda CUDA graph forward {_label(KDA_DENSE)}{bf}", p(kda_graph_forward, KDA_DENSE)),
                Check(f"kda CUDA graph forward+backward {_label(KDA_DENSE)}{bf}",
                      p(kda_graph_forward_backward, KDA_DENSE))]
    if family == "cconv":
        bf = " bf16 silu"
        return [Check(f"cconv forward+backward {_label(CCONV_DENSE)}{bf}", p(cconv_forward_backward, CCONV_DENSE)),
                Check(f"cconv forward+backward {_label(CCONV_VARLEN)}{bf}",
                      p(cconv_forward_backward, CCONV_VARLEN)),
                Check(f"cconv CUDA graph forward+backward {_label(CCONV_DENSE)}{bf}",
                      p(cconv_graph_forward_backward, CCONV_DENSE)),
                Check(f"cconv CUDA graph decode update {_label(CCONV_DECODE)}{bf}",
                      p(cconv_graph_decode, CCONV_DECODE))]
    raise ValueError(f"family must be one of {FAMILIES + ('all',)}, got {family!r}")


def environment_problem() -> str | None:
    """Why no check can run here (no CUDA device, no usable extension: each that applies), or None."""
    import torch

    from kernel_fun import _ext

    problems = []
    if not torch.cuda.is_available():
        problems.append("no CUDA device (torch.cuda.is_available() is False)")
    ok, why = _ext.status()
    if not ok:
        problems.append(why)
    return "; ".join(problems) or None


def run_check(check: Check) -> Result:
    """One check in strict mode (a fallback to fla raises with its reason); any exception is its
    failure, so the checks after it still run."""
    from kernel_fun import strict

    try:
        with strict():
            return Result(check.name, True, check.run())
    except Exception as e:  # noqa: BLE001 - report every failure, keep checking
        return Result(check.name, False, f"{type(e).__name__}: {' '.join(str(e).split())}"[:1000])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kernel_fun.check",
                                description="Check that kernel-fun's kernels engage and agree with the fp64 "
                                            "reference on this GPU; exit status 0 only if every check passes.")
    p.add_argument("--family", choices=FAMILIES + ("all",), default="all")
    p.add_argument("--quiet", action="store_true", help="print only failures and the summary line")
    return p


def main(argv=None, checks: list[Check] | None = None) -> int:
    """checks: run these instead of --family's GPU checks, with no GPU required (tests inject them)."""
    args = _parser().parse_args(argv)
    out = functools.partial(print, flush=True)
    if not args.quiet:
        from kernel_fun import versions

        out("kernel-fun self-check")
        for key, value in versions().items():
            out(f"  {key}: {value}")
    if checks is None:
        checks = family_checks(args.family)
        problem = environment_problem()
        if problem:
            out(f"FAIL environment: {problem}")
            for c in checks:
                out(f"NOT CHECKED {c.name}")
            out(f"self-check FAILED: nothing checked ({len(checks)} checks need a CUDA device and the extension)")
            return 1
    failed = 0
    for check in checks:
        result = run_check(check)
        failed += not result.ok
        if not (args.quiet and result.ok):
            out(result.line())
    if failed:
        out(f"self-check FAILED: {failed} of {len(checks)} checks failed")
        return 1
    out(f"self-check passed: {len(checks)} checks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
