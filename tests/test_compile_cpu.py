"""torch.compile(fullgraph=True) without a GPU.

The CUDA path is traced with fake CUDA tensors (FakeTensorMode needs no device): dynamo must
capture chunk_kda and causal_conv1d - dense, varlen with and without cu_seqlens_cpu, inputs that
need gradients - as one graph holding our ops, and a new varlen document count must not
recompile again after the first dynamic graph. These need the built extension (the ops' schemas
and fakes); the CPU-reference cases below run everywhere. The GPU twins, which also run the
compiled graphs and count the ops' launches, are in test_compile_gpu.py.
"""

import logging

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kernel_fun import _ext
from kernel_fun.cconv import causal_conv1d
from kernel_fun.kda import chunk_kda

needs_ext = pytest.mark.skipif(not _ext.available(), reason="needs the built extension (op schemas and fakes)")


class Capture:
    """A dynamo backend that keeps the captured graphs (and runs them, on fake tensors here)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def targets(self, i=-1) -> set[str]:
        """Every function called in graph i, its nested graphs (an autograd.Function's forward and
        backward) included."""
        return {str(n.target) for gm in self.graphs[i].modules() if isinstance(gm, torch.fx.GraphModule)
                for n in gm.graph.nodes if n.op == "call_function"}


def _kda_inputs(T=130, grad=False):
    q = torch.randn(1, T, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    k = torch.randn(1, T, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    v = torch.randn(1, T, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    g = (-torch.rand(1, T, 2, 128, device="cuda")).requires_grad_(grad)
    beta = torch.rand(1, T, 2, device="cuda").requires_grad_(grad)
    return q, k, v, g, beta


@needs_ext
def test_chunk_kda_new_lengths_do_not_break_the_graph():
    torch._dynamo.reset()
    cap = Capture()
    compiled = torch.compile(lambda *a: chunk_kda(*a, use_qk_l2norm_in_kernel=True)[0], backend=cap, fullgraph=True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        for T in (130, 200, 257, 64):
            inputs = _kda_inputs(T=T)
            assert compiled(*inputs).shape == inputs[2].shape
    assert "kernel_fun.kda_forward.default" in cap.targets() and len(cap.graphs) <= 2


@needs_ext
@pytest.mark.parametrize("mode", ["dense", "varlen", "varlen-host-offsets", "varlen-grad"])
def test_chunk_kda_is_one_graph_of_our_op(mode):
    torch._dynamo.reset()
    cap = Capture()

    def f(q, k, v, g, beta, cu, cu_cpu):
        return chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)[0]

    compiled = torch.compile(f, backend=cap, fullgraph=True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        inputs = _kda_inputs(grad=mode == "varlen-grad")
        for n in (2, 3, 4, 5) if mode != "dense" else (None,):
            offsets = None if n is None else [0] + list(range(130 - n + 1, 131))  # n documents
            cu = None if n is None else torch.tensor(offsets, device="cuda", dtype=torch.int32)
            cu_cpu = torch.tensor(offsets, dtype=torch.int32) if mode == "varlen-host-offsets" else None
            o = compiled(*inputs, cu, cu_cpu)
            assert o.shape == inputs[2].shape and o.device.type == "cuda"
    assert "kernel_fun.kda_forward.default" in cap.targets()
    # a static graph, then (automatic dynamic shapes) one graph for every later document count
    assert len(cap.graphs) <= 2, f"{len(cap.graphs)} graphs for 4 document counts"


@needs_ext
def test_causal_conv1d_new_widths_and_lengths_do_not_break_the_graph():
    """The q, k and v convolutions of a layer have different widths D; eval batches other lengths."""
    torch._dynamo.reset()
    cap = Capture()
    compiled = torch.compile(lambda x, w: causal_conv1d(x, w, activation="silu")[0], backend=cap, fullgraph=True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        for T, D in ((100, 256), (100, 512), (64, 256), (300, 128)):
            x = torch.randn(2, T, D, device="cuda", dtype=torch.bfloat16)
            assert compiled(x, torch.randn(D, 4, device="cuda", dtype=torch.bfloat16)).shape == x.shape
    # static, then D dynamic, then T dynamic too (dynamo marks each size dynamic when it first
    # changes); the fourth call reuses the third graph
    assert "kernel_fun.cconv_fwd" in cap.targets() and len(cap.graphs) <= 3


@needs_ext
@pytest.mark.parametrize("mode", ["dense", "varlen", "varlen-state", "grad"])
def test_causal_conv1d_is_one_graph_of_our_op(mode):
    torch._dynamo.reset()
    cap = Capture()

    def f(x, w, cu, h0):
        return causal_conv1d(x, w, activation="silu", cu_seqlens=cu, initial_state=h0)[0]

    compiled = torch.compile(f, backend=cap, fullgraph=True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        grad = mode == "grad"
        w = torch.randn(256, 4, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
        for n in (2, 3, 4, 5) if mode.startswith("varlen") else (None,):
            x = torch.randn(1 if n else 2, 100, 256, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
            cu = None if n is None else torch.arange(0, n + 1, device="cuda", dtype=torch.int32)
            h0 = torch.randn(n, 256, 4, device="cuda", dtype=torch.bfloat16) if mode == "varlen-state" else None
            y = compiled(x, w, cu, h0)
            assert y.shape == x.shape
    assert "kernel_fun.cconv_fwd" in cap.targets()
    assert len(cap.graphs) <= 2, f"{len(cap.graphs)} graphs"


@needs_ext
def test_invalid_input_is_still_an_error_naming_the_argument_under_compile():
    """Devices, dtypes and flags are checked at trace time (sizes when the graph runs, by the op)."""
    def f(x, w, **kw):
        return causal_conv1d(x, w, **kw)[0]

    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(2, 100, 256, device="cuda", dtype=torch.bfloat16)
        w_cpu = torch.randn(256, 4, dtype=torch.bfloat16)
        torch._dynamo.reset()
        with pytest.raises(Exception, match=r"weight must be on x's device \(cuda:0\), got cpu"):
            torch.compile(f, backend=Capture(), fullgraph=True)(x, w_cpu)
        w_int = torch.ones(256, 4, device="cuda", dtype=torch.int32)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="weight must be a floating tensor, got int32"):
            torch.compile(f, backend=Capture(), fullgraph=True)(x, w_int)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="activation must be None, 'silu' or 'swish', got 'relu'"):
            torch.compile(f, backend=Capture(), fullgraph=True)(x, w_cpu.cuda(), activation="relu")


@needs_ext
def test_meta_tensors_take_our_ops_fakes_without_fla_or_an_engaged_line(caplog, monkeypatch):
    """Shape inference on meta tensors: our ops' fakes answer (fla is never asked), and no
    'engaged' line is logged for a call that launched nothing."""
    from kernel_fun import _dispatch

    monkeypatch.setattr(_dispatch, "fla_function", lambda m, n: pytest.fail("fla was asked for meta tensors"))
    _dispatch.forget_logged("kda")
    _dispatch.forget_logged("cconv")
    dev = "meta"
    q = torch.empty(1, 130, 2, 64, device=dev, dtype=torch.bfloat16)
    v = torch.empty(1, 130, 4, 128, device=dev, dtype=torch.bfloat16)
    g = torch.empty(1, 130, 4, 64, device=dev)
    beta = torch.empty(1, 130, 4, device=dev)
    cu = torch.empty(4, device=dev, dtype=torch.int32)  # contents unknowable: trusted, as fla's use_graph
    with caplog.at_level(logging.INFO, logger="kernel_fun"):
        o, ht = chunk_kda(q, q, v, g, beta, cu_seqlens=cu, output_final_state=True)
        y, _ = causal_conv1d(torch.empty(2, 50, 96, device=dev, dtype=torch.bfloat16),
                             torch.empty(96, 4, device=dev, dtype=torch.bfloat16), activation="silu")
    assert o.shape == v.shape and o.device.type == "meta" and o.dtype == torch.bfloat16
    assert ht.shape == (3, 4, 64, 128) and ht.dtype == torch.float32
    assert y.shape == (2, 50, 96) and y.device.type == "meta"
    assert "engaged" not in caplog.text


def test_cpu_reference_compiles_fullgraph():
    """CPU tensors (the torch reference) compile without a graph break, with and without the
    extension (its support check is a trace-time constant), and match eager."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 40, 32, generator=gen)
    w = torch.randn(32, 4, generator=gen)
    conv = lambda x, w: causal_conv1d(x, w, activation="silu")[0]  # noqa: E731
    assert torch.allclose(torch.compile(conv, fullgraph=True, backend="eager")(x, w), conv(x, w), atol=1e-6)
    q = torch.randn(2, 70, 2, 16, generator=gen)
    v = torch.randn(2, 70, 2, 24, generator=gen)
    g = -torch.rand(2, 70, 2, 16, generator=gen)
    beta = torch.rand(2, 70, 2, generator=gen)
    kda = lambda q, v, g, beta: chunk_kda(q, q, v, g, beta, use_qk_l2norm_in_kernel=True)[0]  # noqa: E731
    assert torch.allclose(torch.compile(kda, fullgraph=True, backend="eager")(q, v, g, beta), kda(q, v, g, beta),
                          atol=1e-5)
