"""torch.compile: the ops trace without a graph break (their fakes are no-ops over caller-allocated
outputs), and the public entry points compile and match eager."""

import pytest
import torch

pytestmark = pytest.mark.gpu


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


def test_cconv_public_api_compiles_fwd_and_bwd():
    from kernel_fun.cconv import causal_conv1d

    x = torch.randn(2, 100, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, 4, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def f(x, w):
        return causal_conv1d(x, w, activation="silu")[0].float().square().sum()

    torch._dynamo.reset()
    eager = f(x, w)
    gx, gw = torch.autograd.grad(eager, (x, w))
    compiled = torch.compile(f)(x, w)
    cgx, cgw = torch.autograd.grad(compiled, (x, w))
    assert torch.allclose(eager, compiled, rtol=1e-5)
    assert torch.equal(gx, cgx) and torch.equal(gw, cgw)


def test_kda_public_api_compiles():
    from kernel_fun.kda import chunk_kda

    B, T, H, K, V = 1, 130, 2, 128, 128
    q = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)
    g = -torch.rand(B, T, H, K, device="cuda", dtype=torch.float32)
    beta = torch.rand(B, T, H, device="cuda", dtype=torch.float32)

    def f(q):
        return chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0] * 2

    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(torch.compile(f)(q), f(q))
