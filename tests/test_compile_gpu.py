"""torch.compile(fullgraph=True) on the GPU: the public entry points compile without a graph break
(dense and varlen, with and without cu_seqlens_cpu, forward and backward), the compiled graphs
launch our ops (counted in C++ at every launch, so calls from inside a compiled graph count), and
their results equal eager's. test_compile_cpu.py traces the same calls on fake tensors in CI."""

import pytest
import torch

from helpers import HOW_KDA_RAN
from kernel_fun import _ext

pytestmark = pytest.mark.gpu


def _delta(before: dict) -> dict:
    """The op launches since `before`, without the counters that say how a KDA op ran (HOW_KDA_RAN)."""
    after = _ext.op_calls()
    return {k: after[k] - before.get(k, 0) for k in after
            if after[k] != before.get(k, 0) and k not in HOW_KDA_RAN}


def test_cconv_op_traces_fullgraph():
    x = torch.randn(2, 100, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 4, device="cuda", dtype=torch.bfloat16)

    def f(x, w):
        y = torch.empty_like(x)
        torch.ops.kernel_fun.cconv_fwd(x, w, None, None, None, None, 1, y, None)
        return y * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(x, w), f(x, w))


@pytest.mark.parametrize("varlen", [False, True])
def test_causal_conv1d_compiles_fullgraph_fwd_and_bwd(varlen):
    from kernel_fun.cconv import causal_conv1d

    B = 1 if varlen else 2
    x = torch.randn(B, 100, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, 4, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, 30, 31, 100], device="cuda", dtype=torch.int32) if varlen else None

    def f(x, w, cu):
        return causal_conv1d(x, w, activation="silu", cu_seqlens=cu)[0].float().square().sum()

    torch._dynamo.reset()
    eager = f(x, w, cu)
    gx, gw = torch.autograd.grad(eager, (x, w))
    before = _ext.op_calls()
    compiled = torch.compile(f, fullgraph=True)(x, w, cu)
    cgx, cgw = torch.autograd.grad(compiled, (x, w))
    assert _delta(before) == {"cconv_fwd": 1, "cconv_bwd": 1}
    assert torch.allclose(eager, compiled, rtol=1e-5)
    assert torch.equal(gx, cgx) and torch.equal(gw, cgw)


@pytest.mark.parametrize("mode", ["dense", "varlen", "varlen-host-offsets"])
def test_chunk_kda_compiles_fullgraph_fwd_and_bwd(mode):
    from kernel_fun.kda import chunk_kda

    B, T, H, K, V = (1 if mode != "dense" else 2), 130, 2, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *s, dt=torch.bfloat16: torch.randn(*s, device="cuda", generator=gen).to(dt).requires_grad_()  # noqa: E731
    q, k, v = mk(B, T, H, K), mk(B, T, H, K), mk(B, T, H, V)
    g = (-torch.rand(B, T, H, K, device="cuda", generator=gen)).requires_grad_()
    beta = torch.rand(B, T, H, device="cuda", generator=gen).requires_grad_()
    offsets = [0, 60, 61, 130]
    cu = None if mode == "dense" else torch.tensor(offsets, device="cuda", dtype=torch.int32)
    cu_cpu = torch.tensor(offsets, dtype=torch.int32) if mode == "varlen-host-offsets" else None

    def f(q, k, v, g, beta):
        o, _ = chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
        return o.float().square().sum()

    torch._dynamo.reset()
    args = (q, k, v, g, beta)
    eager = f(*args)
    grads = torch.autograd.grad(eager, args)
    before = _ext.op_calls()
    compiled = torch.compile(f, fullgraph=True)(*args)
    cgrads = torch.autograd.grad(compiled, args)
    assert _delta(before) == {"kda_fwd": 1, "kda_bwd": 1}
    assert torch.allclose(eager, compiled, rtol=1e-5)  # the compiled sum may reduce in another order
    for a, b in zip(grads, cgrads):
        assert torch.equal(a, b)
