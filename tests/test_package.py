"""Package-level behaviour: light import, the extension's op registry, no-CUDA reporting."""

import subprocess
import sys

import pytest


def test_import_is_light():
    code = "import sys, kernel_fun; heavy = [m for m in ('torch', 'triton', 'fla') if m in sys.modules]; print(heavy)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"import kernel_fun pulled in {out.strip()}"


def test_extension_status_is_explained():
    from kernel_fun import _ext

    ok, detail = _ext.status()
    assert isinstance(detail, str) and detail
    if not ok:
        assert "unavailable" in detail or "failed to load" in detail


def test_every_out_param_op_has_a_schema_and_a_fake():
    from kernel_fun import _ext, _fakes

    if not _ext.available():
        pytest.skip(_ext.status()[1])
    import torch

    for name in _fakes.OUT_PARAM_OPS:
        op = getattr(torch.ops.kernel_fun, name, None)
        assert op is not None, f"kernel_fun::{name} is listed in _fakes.OUT_PARAM_OPS but not registered"
        schema = op.default._schema
        assert len(schema.returns) == 0, f"{name} must return nothing (outputs are caller-allocated)"
        assert any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments), \
            f"{name} must mark its outputs Tensor(a!)"
        assert torch._library.simple_registry.singleton.find(f"kernel_fun::{name}").fake_impl.kernel is not None
    # and the other way: every registered op that writes caller-allocated outputs is listed
    for full in torch._C._dispatch_get_all_op_names():
        ns, _, name = full.partition("::")
        if ns != "kernel_fun" or name.startswith("_"):
            continue
        schema = getattr(torch.ops.kernel_fun, name.split(".")[0]).default._schema
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        if writes and not schema.returns:
            assert name in _fakes.OUT_PARAM_OPS, f"kernel_fun::{name} writes outputs but has no fake (_fakes.OUT_PARAM_OPS)"


def test_build_info_reports_cuda_and_cutlass():
    from kernel_fun import _ext

    if not _ext.available():
        pytest.skip(_ext.status()[1])
    info = _ext.build_info()
    assert "cuda=" in info and "cutlass=" in info and "sm_" in info
