"""Does torch keep CUDA tensors alive under compute-sanitizer without kernel_fun? (2026-12-06: after
scripts/sanitize_kda.py, 48.8 MB of its tensors stay allocated under memcheck and 0 bytes without it;
the tensors are held by the calls' Python frames, and those frames by nothing the garbage collector
sees.) Three variants, each in its own function, memory_allocated after each:
    compute-sanitizer --tool memcheck python3 scripts/dev/sanitizer_frames.py
"""
import gc

import torch


@torch.library.custom_op("kf_probe::scale", mutates_args=())
def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def plain():
    x = torch.randn(1024, 1024, device="cuda")
    return float((x @ x).sum())


def custom_op():
    x = torch.randn(1024, 1024, device="cuda")
    return float(scale(x).sum())


class Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return scale(x)

    @staticmethod
    def backward(ctx, g):
        return scale(g)


def autograd():
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    Twice.apply(x).sum().backward()
    return float(x.grad.sum())


for fn in (plain, custom_op, autograd):
    fn()
    gc.collect()
    torch.cuda.synchronize()
    print(f"{fn.__name__}: allocated after: {torch.cuda.memory_allocated()} bytes", flush=True)
