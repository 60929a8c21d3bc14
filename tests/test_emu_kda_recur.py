"""The fp32 token recurrence (csrc/kda/recur/kda_recur.cuh), UNMODIFIED, on the host emulator: the
forward and every gradient against the fp64 references, where every sequence fits in one chunk.

Nothing but the outputs is rounded to 16 bits there, so the fp32 outputs (the final state, dh0, dg
in fp32, dA_log, ddt_bias) must agree with fp64 to ~1e-6 -- far below what the chunk kernels can
reach (their 16-bit intermediates leave dA_log at 1e-3 .. 1e-2 on one chunk) -- and the 16-bit ones
to their own rounding (~2e-3 in bf16). No GPU needed: g++ and the CUDA headers.
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_bitwise_same, emu_module, emu_skip_reason, kda_bwd_reference, kda_reference, rel_rms
from test_emu_kda_bwd import _do_dht
from test_emu_kda_fwd import make_case

_why = emu_skip_reason()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"kf_emu cannot be built: {_why}")

FP32_TOL = 1e-5   # outputs kept in fp32 end to end
HALF_TOL = 4e-3   # outputs rounded once to bf16 / fp16 (bf16: ~1.6e-3 rel-RMS)

CASES = {
    "T1-h0": dict(T=1, K=64, V=64, h0=True),
    "B2-T23-K128": dict(B=2, T=23, K=128, V=64, h0=True),
    "T64-gva-V128": dict(T=64, H=1, HV=2, K=64, V=128, h0=True),
    "bounded-svf": dict(T=50, gate="bounded", h0=True, state_v_first=True),
    "bounded16-K128": dict(T=64, K=128, V=64, gate="bounded16", h0=True),
    "bounded-noalog": dict(T=40, gate="bounded_noalog"),
    "precomputed-extreme-fp16": dict(T=60, gate="precomputed", extreme=0.5, h0=True, dtype=torch.float16),
    "varlen-empty-onetoken": dict(T=64, cu=[0, 0, 1, 30, 30, 64], h0=True),
    "varlen-int64-gva-K128": dict(T=40, H=2, HV=4, K=128, V=64, cu=[0, 17, 40], cu_dtype=torch.int64),
    "neg-eig-no-l2norm": dict(T=33, neg_eig=True, l2norm=False, gate="precomputed", h0=True),
    "l2norm-eps-tiny-qk": dict(T=20, qk_scale=1e-4, h0=True),
    "K64-V192": dict(T=30, K=64, V=192, scale=0.1),
}


@pytest.fixture(scope="module")
def emu():
    return emu_module()


@pytest.mark.parametrize("name", list(CASES))
def test_recurrence_matches_fp64(name, emu):
    inputs, kw = make_case(**CASES[name])
    q, k, v, g, beta = inputs
    do, dht = _do_dht(inputs, kw, 7)
    o, ht, _, _ = emu.forward_stages(*inputs, **kw, recurrent=True)
    ro, rht = kda_reference(inputs, kw)  # the fp64 chunk form: the recurrence's own values to fp64 rounding
    grads, _ = emu.backward_stages(*inputs, do, dht, **kw, recurrent=True)
    ref, _ = kda_bwd_reference(inputs, kw, do, dht)
    errs = {"o": rel_rms(ro, o.double()), "ht": rel_rms(rht, ht.double())}
    for key in ("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"):
        if ref.get(key) is None:
            assert grads.get(key) is None, key
            continue
        errs[key] = rel_rms(ref[key], grads[key].reshape(ref[key].shape))
    fp32 = {"ht", "dh0", "dA_log", "ddt_bias"} | ({"dg"} if g.dtype == torch.float32 else set()) \
        | ({"dbeta"} if beta.dtype == torch.float32 else set())
    bad = {n: f"{e:.2e}" for n, e in errs.items() if not e <= (FP32_TOL if n in fp32 else HALF_TOL)}
    assert not bad, f"off the fp64 references: {bad} (all: {errs})"


def test_recurrence_writes_the_chunk_state_once_per_sequence(emu):
    """return_intermediate_states: one chunk per sequence, its state is the initial state (zeros for an
    empty h0), in the output dtype; an empty document has no chunk (the row count is the chunk count)."""
    inputs, kw = make_case(T=64, cu=[0, 0, 1, 30, 64], h0=True)
    _, _, hs, _ = emu.forward_stages(*inputs, **kw, recurrent=True, return_intermediate_states=True)
    h0 = kw["initial_state"]
    assert hs.shape[:2] == (1, 3)
    assert torch.equal(hs[0].float(), h0[1:].to(hs.dtype).float())


def test_recurrence_is_bitwise_deterministic_under_every_schedule(emu):
    inputs, kw = make_case(T=40, H=1, HV=2, K=64, V=64, h0=True, cu=[0, 9, 40])
    do, dht = _do_dht(inputs, kw, 3)
    run = lambda: emu.backward_stages(*inputs, do, dht, **kw, recurrent=True)[0]  # noqa: E731
    base = run()
    for order, greedy in (("reverse", False), ("random", True)):
        emu.set_schedule(order, greedy, 5)
        try:
            other = run()
        finally:
            emu.set_schedule()
        assert_bitwise_same(base, other, order)


def test_recurrence_only_where_every_sequence_fits_one_chunk(emu):
    """T = 65 cannot take the recurrence (kda_policy.h's recurrent_possible): the request falls back to
    the chunk kernels, whose workspace is then written (the recurrence leaves it NaN-poisoned)."""
    inputs, kw = make_case(T=65, K=64, V=64)
    _, _, _, ws = emu.forward_stages(*inputs, **kw, recurrent=True)
    assert not torch.isnan(ws["Aqk"][:65].float()).any()
    inputs, kw = make_case(T=64, K=64, V=64)
    _, _, _, ws = emu.forward_stages(*inputs, **kw, recurrent=True)
    assert torch.isnan(ws["Aqk"][:64].float()).all()
