"""Independent pure-PyTorch references for the short causal depthwise conv1d (fla's causal_conv1d).

``causal_conv1d_ref(x, weight, bias=None, residual=None, initial_state=None,
                    output_final_state=False, activation=None, cu_seqlens=None) -> (y, final_state)``

    x [B, T, D] (any strides), weight [D, W], bias [D], residual [B, T, D]:
        y[t, d] = act(sum_w weight[d, w] * x~[t - W + 1 + w, d] + bias[d]) + residual[t, d]
    act in {None, 'silu', 'swish'} (silu == swish). x~ is x within the sequence; at a negative
    position pos in [-W, -1] it reads initial_state[n, d, W + pos] (slot 0 is only ever read back
    into final_state, for an empty sequence), or 0 without an initial state. final_state
    [N, D, W] holds x~[T - W + w] in slot w. With cu_seqlens (B == 1) each document
    cu_seqlens[n]:cu_seqlens[n+1] is independent and starts from initial_state[n] (or zeros).
    Computed in fp32 (fp64 when x is fp64); y and final_state come back in x's dtype.

``causal_conv1d_update_ref(x, cache, residual=None, weight=None, bias=None, activation=None)
    -> (y, new_cache)``

    One decode step. x [N, D], [N, 1, D] or [1, N, D]; cache [N, D, W]. new_cache is cache
    shifted left by one slot with x in slot W - 1 (a NEW tensor, in cache's dtype);
    y = act(sum_w new_cache[..., w] * weight[:, w] + bias) + residual, in x's shape and dtype.

Both are differentiable by autograd (x, weight, bias, residual, initial_state / cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d_ref", "causal_conv1d_update_ref"]


def _act(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")


def _check_activation(activation):
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")


def causal_conv1d_ref(x, weight, bias=None, residual=None, initial_state=None, output_final_state=False,
                      activation=None, cu_seqlens=None):
    """Causal depthwise conv1d reference; see the module docstring. Returns (y, final_state)."""
    _check_activation(activation)
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, D], got {tuple(x.shape)}")
    B, T, D = x.shape
    if weight.dim() != 2 or weight.shape[0] != D:
        raise ValueError(f"weight must be [D={D}, W], got {tuple(weight.shape)}")
    W = weight.shape[1]
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens requires B == 1, got B={B}")
        bd = [int(t) for t in cu_seqlens.tolist()]
        if bd[0] != 0 or bd[-1] != T or any(b > a for a, b in zip(bd[1:], bd[:-1])):
            raise ValueError(f"cu_seqlens must be non-decreasing from 0 to T={T}, got {bd}")
        segs = [(0, bd[n], bd[n + 1]) for n in range(len(bd) - 1)]
    else:
        segs = [(b, 0, T) for b in range(B)]
    N = len(segs)
    if initial_state is not None and tuple(initial_state.shape) != (N, D, W):
        raise ValueError(f"initial_state must be {(N, D, W)}, got {tuple(initial_state.shape)}")
    wt = weight.to(cd)                                                     # [D, W]
    ys, finals = [], []
    for n, (b, t0, t1) in enumerate(segs):
        xs = x[b, t0:t1].to(cd)                                            # [L, D]
        if initial_state is not None:
            pre = initial_state[n].to(cd).transpose(0, 1)                  # [W, D]: positions -W..-1
        else:
            pre = xs.new_zeros(W, D)
        xe = torch.cat([pre, xs], 0)                                       # row r <-> position r - W
        L = t1 - t0
        if L:
            win = xe[1:].unfold(0, W, 1)                                   # [L, D, W]; window of t
            yl = (win * wt).sum(-1)
        else:
            yl = xs.new_zeros(0, D)
        if bias is not None:
            yl = yl + bias.to(cd)
        ys.append(_act(yl, activation))
        finals.append(xe[L:L + W].transpose(0, 1))                         # [D, W]: positions L-W..L-1
    if cu_seqlens is not None:
        y = torch.cat(ys, 0)[None]
    else:
        y = torch.stack(ys, 0)
    if residual is not None:
        y = y + residual.to(cd)
    final_state = torch.stack(finals, 0).to(x.dtype) if output_final_state else None
    return y.to(x.dtype), final_state


def causal_conv1d_update_ref(x, cache, residual=None, weight=None, bias=None, activation=None):
    """One decode step of the causal conv; see the module docstring. Returns (y, new_cache)."""
    _check_activation(activation)
    if weight is None:
        raise ValueError("causal_conv1d_update_ref needs weight [D, W]")
    N, D, W = cache.shape
    if weight.shape != (D, W):
        raise ValueError(f"weight must be {(D, W)}, got {tuple(weight.shape)}")
    if x.dim() == 2:
        xs = x
    elif x.dim() == 3 and x.shape[1] == 1:
        xs = x[:, 0]
    elif x.dim() == 3 and x.shape[0] == 1:
        xs = x[0]
    else:
        raise ValueError(f"x must be [N, D], [N, 1, D] or [1, N, D], got {tuple(x.shape)}")
    if xs.shape != (N, D):
        raise ValueError(f"x holds {tuple(xs.shape)} tokens, cache wants {(N, D)}")
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    win = torch.cat([cache[..., 1:].to(cd), xs.to(cd)[..., None]], -1)    # [N, D, W]
    y = (win * weight.to(cd)).sum(-1)
    if bias is not None:
        y = y + bias.to(cd)
    y = _act(y, activation)
    if residual is not None:
        y = y + residual.to(cd).reshape(N, D)
    new_cache = torch.cat([cache[..., 1:], xs.to(cache.dtype)[..., None]], -1)
    return y.reshape(x.shape).to(x.dtype), new_cache
