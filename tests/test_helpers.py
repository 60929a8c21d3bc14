"""The comparison metric every test relies on must itself be able to fail."""

import torch
from helpers import rel_rms


def test_rel_rms_has_no_absolute_escape():
    # values of the size exp2 of -1000-ish gates produce: a 2x error is a 2x error, not "0"
    ref = torch.full((64,), 1e-12, dtype=torch.float64)
    assert abs(rel_rms(ref, 2 * ref) - 1.0) < 1e-12
    assert rel_rms(ref, ref) == 0.0


def test_rel_rms_zero_reference_and_nonfinite():
    z = torch.zeros(8, dtype=torch.float64)
    assert rel_rms(z, z) == 0.0
    assert rel_rms(z, z + 1e-30) == float("inf")  # anything nonzero against an exact zero
    assert rel_rms(torch.ones(3), torch.tensor([1.0, float("nan"), 1.0])) == float("inf")


def test_rel_rms_is_relative():
    ref = torch.tensor([3.0, 4.0], dtype=torch.float64)  # RMS 5/sqrt(2)
    got = ref + torch.tensor([0.5, -0.5], dtype=torch.float64)
    assert abs(rel_rms(ref, got) - 0.5 / (5 / 2 ** 0.5)) < 1e-12


def test_as_stored_fp32_flushes_what_fp32_cannot_hold():
    from helpers import as_stored_fp32
    ref = torch.tensor([1e-270, 2.0 ** -127, 2.0 ** -126, 0.1], dtype=torch.float64)
    got = as_stored_fp32(ref)
    assert got.tolist() == [0.0, 0.0, 2.0 ** -126, float(torch.tensor(0.1).float())]


def test_our_launches_fails_unless_exactly_our_ops_ran(monkeypatch):
    """helpers.our_launches, which the GPU tests use to prove our kernels (not fla's) served a call:
    strict mode inside, and exactly the wanted launches (kernel_fun._ext.op_calls faked here)."""
    import pytest
    from helpers import our_launches
    from kernel_fun import _dispatch, _ext

    state = {"kda_fwd": 0, "kda_bwd": 0}
    monkeypatch.setattr(_ext, "op_calls", lambda: dict(state))
    with our_launches(kda_fwd=1):
        assert _dispatch.strict_enabled()
        state["kda_fwd"] += 1
    assert not _dispatch.strict_enabled()
    for bump in ({}, {"kda_fwd": 2}, {"kda_fwd": 1, "kda_bwd": 1}):
        with pytest.raises(AssertionError, match="our kernel ops launched"):
            with our_launches(kda_fwd=1):
                for name, n in bump.items():
                    state[name] += n
