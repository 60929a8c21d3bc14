"""The autograd wiring of our KDA ops on CPU (kernel_fun.kda._kernel: kernel_fun::kda_forward's
registered backward, which calls kernel_fun::kda_backward), with the extension's two kernel ops
replaced by fakes: each gradient buffer the backward op fills must reach the input it belongs to.
A swap there (dq for dk, dg for dbeta, ...) gives wrong gradients only on the GPU, where
tests/test_kda_bwd_gpu.py::test_gradients_match_fp64_naive sees it; this sees it everywhere."""

from __future__ import annotations

import pytest
import torch

from kernel_fun import _ext
from kernel_fun.kda import _kernel
from kernel_fun.kda._options import KdaOptions

# the value each gradient buffer of kda_bwd is filled with, in its schema's order
GRAD_TAGS = {"dq": 1.0, "dk": 2.0, "dv": 3.0, "dg": 4.0, "dbeta": 5.0, "dA_log": 6.0, "ddt_bias": 7.0, "dh0": 8.0}


class _FakeOps:
    """kda_fwd / kda_bwd with the real ops' schemas (csrc/api/kda_ops.cpp): outputs written in place."""

    def __init__(self):
        self.bwd_calls = 0

    def kda_fwd(self, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, options, o, ht, h_states,
                Aqk, Akk, M, h_ckpt, w, qg, kg, gdecay):
        for t in (o, ht, Aqk, Akk, M, h_ckpt, w, qg, kg, gdecay):
            if t is not None:
                t.zero_()

    def kda_bwd(self, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, do, dht, Aqk, Akk, M, h_ckpt,
                w, qg, kg, gdecay, options, dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0):
        self.bwd_calls += 1
        for name, t in zip(GRAD_TAGS, (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0)):
            if t is not None:
                t.fill_(GRAD_TAGS[name])


@pytest.mark.parametrize("gate", ["unbounded", "precomputed"])
def test_each_gradient_reaches_its_input(monkeypatch, gate):
    fake = _FakeOps()
    monkeypatch.setattr(_ext, "ops", lambda: fake)
    B, T, H, HV, K, V = 1, 8, 1, 2, 64, 64
    leaf = lambda *shape: torch.randn(*shape).requires_grad_(True)  # noqa: E731
    q, k, v, g, beta = leaf(B, T, H, K), leaf(B, T, H, K), leaf(B, T, HV, V), leaf(B, T, HV, K), leaf(B, T, HV)
    h0 = leaf(B, HV, K, V)
    A_log, dt_bias = (leaf(HV), leaf(HV * K)) if gate == "unbounded" else (None, None)
    opts = KdaOptions.from_call(scale=K ** -0.5, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=gate != "precomputed",
                                use_beta_sigmoid_in_kernel=True, allow_neg_eigval=False, lower_bound=None,
                                A_log=A_log, state_v_first=False, chunk_size=64)
    o, ht = _kernel.forward(q, k, v, g, beta, options=opts.encode(), initial_state=h0, output_final_state=True,
                            cu_seqlens=None, cu_seqlens_cpu=None, A_log=A_log, dt_bias=dt_bias,
                            return_intermediate_states=False)
    (o.sum() + ht.sum()).backward()
    assert fake.bwd_calls == 1
    got = {"dq": q, "dk": k, "dv": v, "dg": g, "dbeta": beta, "dh0": h0, "dA_log": A_log, "ddt_bias": dt_bias}
    for name, x in got.items():
        if x is None:
            continue
        assert x.grad is not None and x.grad.shape == x.shape, name
        assert torch.all(x.grad == GRAD_TAGS[name]), f"{name} reached the wrong input (got {x.grad.flatten()[0]})"
