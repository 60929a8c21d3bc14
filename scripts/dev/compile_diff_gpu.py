"""Where a torch.compile(fullgraph=True) training step and the eager one part, on the GPU: the shape of
tests/test_kda_bwd_gpu.py's test_compile_fullgraph_training_step_runs_our_kernels, run eager twice and
compiled once, and each of o, the loss and the five gradients compared (equal, or the largest
difference); then the loss's reduction alone, eager and compiled, on the same o. Says whether a
compiled step's different loss comes from our kernels (o differs) or from inductor's sum (o equal, the
compiled sum of the same o differs). Written for docs/notes/2026-12-06-gate-fold.md (sections 3 and 5).

    PYTHONPATH=src:tests python3 scripts/dev/compile_diff_gpu.py
"""
from __future__ import annotations

import torch

from kernel_fun.kda import chunk_kda
from test_kda_bwd_gpu import _do_dht
from test_kda_fwd_gpu import make_case


def _diff(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if torch.equal(a, b):
        print(f"  {name}: equal")
    else:
        d = (a.double() - b.double()).abs()
        print(f"  {name}: DIFFERENT at {int((d > 0).sum())} of {d.numel()}, max {d.max().item():.3e}")


def main() -> None:
    inputs, kw = make_case(B=2, T=200, H=2, HV=2)
    call = {n: x for n, x in kw.items() if x is not None and n != "output_final_state"}
    print("options:", {n: (tuple(x.shape) if isinstance(x, torch.Tensor) else x) for n, x in call.items()})
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    do, _ = _do_dht(inputs, kw)

    def loss_of(o):
        return (o.float() * do.float()).sum()

    def step(q, k, v, g, beta):
        o, _ = chunk_kda(q, k, v, g, beta, **call)
        return loss_of(o), o

    runs = {}
    for name in ("eager", "eager again"):
        loss, o = step(*leaves)
        runs[name] = (loss.detach(), o.detach(), torch.autograd.grad(loss, leaves))
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    loss, o = compiled(*leaves)
    runs["compiled"] = (loss.detach(), o.detach(), torch.autograd.grad(loss, leaves))
    e_loss, e_o, e_grads = runs["eager"]
    for name in ("eager again", "compiled"):
        loss, o, grads = runs[name]
        print(f"{name} against eager: loss {loss.item()!r} / {e_loss.item()!r}")
        _diff("o", o, e_o)
        _diff("loss", loss, e_loss)
        for n, a, b in zip("q k v g beta".split(), grads, e_grads):
            _diff(f"d{n}", a, b)
    compiled_sum = torch.compile(loss_of, fullgraph=True)
    print("the loss's reduction alone on the eager o, compiled against eager:")
    _diff("loss", compiled_sum(e_o), loss_of(e_o))


if __name__ == "__main__":
    main()
