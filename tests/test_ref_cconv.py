"""CPU tests of the pure-torch causal conv1d references (kernel_fun.ref.cconv) against an independent
F.conv1d formulation, plus gradcheck and decode-step chaining."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from kernel_fun.ref import causal_conv1d_ref, causal_conv1d_update_ref

F64 = torch.float64


def conv1d_independent(x, weight, bias, residual, initial_state, activation, cu_seqlens):
    """Per document: left-pad with the initial state's slots 1..W-1 (or zeros), run a grouped
    F.conv1d, and read the final state slot by slot with explicit index arithmetic."""
    B, T, D = x.shape
    W = weight.shape[1]
    docs = ([(b, 0, T) for b in range(B)] if cu_seqlens is None else
            [(0, int(cu_seqlens[n]), int(cu_seqlens[n + 1])) for n in range(len(cu_seqlens) - 1)])
    ys, finals = [], []
    for n, (b, t0, t1) in enumerate(docs):
        xs = x[b, t0:t1].double().t()                                   # [D, L]
        L = t1 - t0
        pad = (initial_state[n, :, 1:].double() if initial_state is not None
               else torch.zeros(D, W - 1, dtype=F64))
        xp = torch.cat([pad, xs], 1)[None]                              # [1, D, W-1+L]
        if L:
            y = F.conv1d(xp, weight.double()[:, None, :], None if bias is None else bias.double(), groups=D)[0].t()
        else:
            y = torch.zeros(0, D, dtype=F64)
        if activation in ("silu", "swish"):
            y = y * torch.sigmoid(y)
        ys.append(y)
        fs = torch.zeros(D, W, dtype=F64)
        for w in range(W):
            pos = L - W + w
            if pos >= 0:
                fs[:, w] = xs[:, pos]
            elif initial_state is not None:
                fs[:, w] = initial_state[n, :, W + pos].double()
        finals.append(fs)
    y = torch.cat(ys, 0)[None] if cu_seqlens is not None else torch.stack(ys, 0)
    if residual is not None:
        y = y + residual.double()
    return y, torch.stack(finals, 0)


def _make(seed, B, T, D, W, *, bias, residual, h0, N=None, dtype=F64, noncontig=False):
    torch.manual_seed(seed)
    if noncontig:
        x = torch.randn(B, T, 3 * D, dtype=dtype)[:, :, D:2 * D]  # a slice of a wider tensor
        assert not x.is_contiguous()
    else:
        x = torch.randn(B, T, D, dtype=dtype)
    weight = torch.randn(D, W, dtype=dtype)
    b = torch.randn(D, dtype=dtype) if bias else None
    r = torch.randn(B, T, D, dtype=dtype) if residual else None
    s = torch.randn(N or B, D, W, dtype=dtype) if h0 else None
    return x, weight, b, r, s


@pytest.mark.parametrize("W", [1, 2, 3, 4])
@pytest.mark.parametrize("activation", [None, "silu", "swish"])
def test_matches_conv1d_all_options(W, activation):
    for i, (bias, residual, h0) in enumerate(itertools.product([False, True], repeat=3)):
        x, w, b, r, s = _make(100 * W + i, 2, 11, 6, W, bias=bias, residual=residual, h0=h0)
        y, fs = causal_conv1d_ref(x, w, b, r, s, output_final_state=True, activation=activation)
        y_ref, fs_ref = conv1d_independent(x, w, b, r, s, activation, None)
        assert torch.allclose(y, y_ref, rtol=1e-12, atol=1e-12)
        assert torch.allclose(fs, fs_ref, rtol=0, atol=0)
        assert fs.shape == (2, 6, W)
    y2, none = causal_conv1d_ref(x, w, b, r, s, activation=activation)
    assert none is None and torch.equal(y2, y)


@pytest.mark.parametrize("T", [1, 2, 3])
def test_short_sequences(T):
    """T < W: the window and the final state both reach into the initial state."""
    for h0 in (False, True):
        x, w, b, r, s = _make(T, 2, T, 5, 4, bias=True, residual=False, h0=h0)
        y, fs = causal_conv1d_ref(x, w, b, None, s, output_final_state=True, activation="silu")
        y_ref, fs_ref = conv1d_independent(x, w, b, None, s, "silu", None)
        assert torch.allclose(y, y_ref, rtol=1e-12, atol=1e-12)
        assert torch.equal(fs, fs_ref)
    # spelled out for T=1: y = w[:, 3] * x + sum_{w<3} weight[:, w] * h0[:, w+1]
    if T == 1:
        y, fs = causal_conv1d_ref(x, w, None, None, s, output_final_state=True)
        expect = w[:, 3] * x[:, 0] + (w[:, :3] * s[:, :, 1:]).sum(-1)
        assert torch.allclose(y[:, 0], expect)
        assert torch.equal(fs[:, :, :3], s[:, :, 1:]) and torch.equal(fs[:, :, 3], x[:, 0])


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("W", [2, 4])
def test_varlen(cu_dtype, W):
    cu = torch.tensor([0, 1, 3, 3, 20, 21], dtype=cu_dtype)  # one-token docs, a 2-token doc < W, an empty doc
    for i, (bias, residual, h0) in enumerate(itertools.product([False, True], repeat=3)):
        x, w, b, r, s = _make(7 + i, 1, 21, 8, W, bias=bias, residual=residual, h0=h0, N=5)
        y, fs = causal_conv1d_ref(x, w, b, r, s, output_final_state=True, activation="swish", cu_seqlens=cu)
        y_ref, fs_ref = conv1d_independent(x, w, b, r, s, "swish", cu)
        assert torch.allclose(y, y_ref, rtol=1e-12, atol=1e-12)
        assert torch.equal(fs, fs_ref)
        # no mixing across boundaries: each document alone gives the same result
        for n in range(5):
            t0, t1 = int(cu[n]), int(cu[n + 1])
            y_n, fs_n = causal_conv1d_ref(x[:, t0:t1], w, b, None if r is None else r[:, t0:t1],
                                          None if s is None else s[n:n + 1], output_final_state=True,
                                          activation="swish")
            assert torch.allclose(y[:, t0:t1], y_n, rtol=0, atol=1e-14)
            assert torch.equal(fs[n], fs_n[0])
    if h0:
        assert torch.equal(fs[2], s[2])  # empty doc: the state passes through untouched


def test_noncontiguous_and_dtypes():
    x, w, b, r, s = _make(3, 2, 17, 16, 4, bias=True, residual=True, h0=True, noncontig=True)
    y, fs = causal_conv1d_ref(x, w, b, r, s, output_final_state=True, activation="silu")
    y_ref, fs_ref = conv1d_independent(x.contiguous(), w, b, r, s, "silu", None)
    assert torch.allclose(y, y_ref, rtol=1e-12, atol=1e-12) and torch.equal(fs, fs_ref)
    xb = x.to(torch.bfloat16)
    yb, fsb = causal_conv1d_ref(xb, w.float(), b.float(), r.to(torch.bfloat16), s.to(torch.bfloat16),
                                output_final_state=True, activation="silu")
    assert yb.dtype == torch.bfloat16 and fsb.dtype == torch.bfloat16
    assert (yb.double() - y).abs().max() < 0.1


def test_bad_activation():
    x, w, *_ = _make(0, 1, 4, 2, 3, bias=False, residual=False, h0=False)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_ref(x, w, activation="relu")
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_update_ref(x[0], torch.zeros(4, 2, 3, dtype=F64), weight=w, activation="gelu")


def test_gradcheck_tiny():
    x, w, b, r, s = _make(5, 1, 6, 3, 3, bias=True, residual=True, h0=True, N=3)
    cu = torch.tensor([0, 1, 2, 6])
    leaves = [t.clone().requires_grad_() for t in (x, w, b, r, s)]

    def f(x, w, b, r, s):
        return causal_conv1d_ref(x, w, b, r, s, output_final_state=True, activation="silu", cu_seqlens=cu)

    assert torch.autograd.gradcheck(f, leaves)
    x, w, b, r, s = _make(6, 2, 2, 2, 4, bias=True, residual=False, h0=True)
    leaves = [t.clone().requires_grad_() for t in (x, w, b, s)]
    assert torch.autograd.gradcheck(
        lambda x, w, b, s: causal_conv1d_ref(x, w, b, None, s, output_final_state=True), leaves)


@pytest.mark.parametrize("layout", ["ND", "N1D", "1ND"])
def test_update_chains_with_full_sequence(layout):
    N, T, D, W = 3, 7, 5, 4
    x, w, b, r, s = _make(9, N, T, D, W, bias=True, residual=True, h0=True)
    y_full, fs_full = causal_conv1d_ref(x, w, b, r, s, output_final_state=True, activation="silu")
    # prefix then decode: the prefix's final state is the decode cache
    y_pre, cache = causal_conv1d_ref(x[:, :3], w, b, r[:, :3], s, output_final_state=True, activation="silu")
    assert torch.equal(y_pre, y_full[:, :3])
    for t in range(3, T):
        xt, rt = x[:, t], r[:, t]
        if layout == "N1D":
            xt, rt = xt[:, None], rt[:, None]
        elif layout == "1ND":
            xt, rt = xt[None], rt[None]
        old = cache.clone()
        y_t, new_cache = causal_conv1d_update_ref(xt, cache, rt, w, b, "silu")
        assert torch.equal(cache, old), "the reference must not update the cache in place"
        assert y_t.shape == xt.shape
        assert torch.allclose(y_t.reshape(N, D), y_full[:, t], rtol=1e-12, atol=1e-12)
        assert torch.equal(new_cache[..., :-1], old[..., 1:]) and torch.equal(new_cache[..., -1], x[:, t])
        cache = new_cache
    assert torch.equal(cache, fs_full)


def test_update_gradients():
    x, w, b, r, s = _make(10, 2, 1, 3, 4, bias=True, residual=True, h0=True)
    leaves = [t.clone().requires_grad_() for t in (x[:, 0], s, r[:, 0], w, b)]
    assert torch.autograd.gradcheck(lambda x, c, r, w, b: causal_conv1d_update_ref(x, c, r, w, b, "swish"), leaves)
