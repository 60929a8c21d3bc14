"""kernel_fun.patch_fla on a stand-in fla package (the real one is CUDA-only and not needed here):
the layer modules' bindings are rebound and restored, the fallback still reaches fla's own
function (never the patch), and a second enable() is refused. The GPU twin, which runs fla's real
KimiDeltaAttention layer through the patch, is in test_integration_gpu.py."""

import sys
import types

import pytest

from kernel_fun import _dispatch, cconv, kda, patch_fla


@pytest.fixture
def fake_fla(monkeypatch):
    calls = []

    def fla_chunk_kda(*args, **kwargs):
        calls.append("fla.chunk_kda")
        return "fla-result"

    def fla_causal_conv1d(*args, **kwargs):
        calls.append("fla.causal_conv1d")

    def fla_update(*args, **kwargs):
        calls.append("fla.causal_conv1d_update")

    mods = {name: types.ModuleType(name) for name in
            ("fla", "fla.ops", "fla.ops.kda", "fla.layers", "fla.layers.kda", "fla.modules",
             "fla.modules.convolution")}
    mods["fla.ops.kda"].chunk_kda = fla_chunk_kda
    mods["fla.layers.kda"].chunk_kda = fla_chunk_kda            # `from fla.ops.kda import chunk_kda`
    mods["fla.layers.kda"].layer = lambda *a: mods["fla.layers.kda"].chunk_kda(*a)  # calls the global
    mods["fla.modules.convolution"].causal_conv1d = fla_causal_conv1d
    mods["fla.modules.convolution"].causal_conv1d_update = fla_update
    mods["fla.modules"].causal_conv1d = fla_causal_conv1d       # re-exported
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    yield mods, calls
    assert not _dispatch._fla_originals, "a test left a patch active"


def test_enable_rebinds_and_disable_restores(fake_fla):
    mods, _ = fake_fla
    original = mods["fla.ops.kda"].chunk_kda
    with patch_fla.enabled() as patch:
        assert mods["fla.layers.kda"].chunk_kda is kda.chunk_kda
        assert mods["fla.ops.kda"].chunk_kda is kda.chunk_kda  # later `from ... import` get ours too
        assert mods["fla.modules.convolution"].causal_conv1d is cconv.causal_conv1d
        assert mods["fla.modules"].causal_conv1d is cconv.causal_conv1d
        assert mods["fla.modules.convolution"].causal_conv1d_update is cconv.causal_conv1d_update
        assert "fla.layers.kda.chunk_kda" in patch.routed and len(patch.routed) == 5
    assert mods["fla.layers.kda"].chunk_kda is original and mods["fla.ops.kda"].chunk_kda is original
    assert mods["fla.modules"].causal_conv1d.__name__ == "fla_causal_conv1d"


def test_fallback_reaches_fla_not_the_patch(fake_fla):
    mods, calls = fake_fla
    with patch_fla.enabled(cconv=False):
        assert mods["fla.modules.convolution"].causal_conv1d.__name__ == "fla_causal_conv1d"  # left alone
        got = _dispatch.fallback("kda", "test reason", "fla.ops.kda", "chunk_kda", (1,), {})
    assert got == "fla-result" and calls == ["fla.chunk_kda"]


def test_patches_do_not_stack_and_need_fla(fake_fla, monkeypatch):
    patch = patch_fla.enable()
    try:
        with pytest.raises(RuntimeError, match="already active"):
            patch_fla.enable()
    finally:
        patch.disable()
    patch.disable()  # idempotent
    monkeypatch.setitem(sys.modules, "fla", None)  # as if fla were not installed
    with pytest.raises(RuntimeError, match="fla \\(fla-core\\) is not installed"):
        patch_fla.enable()
