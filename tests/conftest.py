"""Shared test setup: GPU tests carry @pytest.mark.gpu and skip cleanly without a CUDA device; fla
parity tests carry @pytest.mark.fla and skip without fla.

On a machine WITH a CUDA device, a kernel-fun extension that is missing or fails to load is not a
reason to skip: every GPU test then errors with the load error (a broken build must not pass as
"all GPU tests skipped", pytest exiting 0). Deselect them explicitly (-m "not gpu") to run the CPU
tests there without the extension."""

import importlib.util

import pytest
import torch


def gpu_verdict(cuda_available: bool, ext_status: tuple) -> tuple:
    """(skip_reason, error) for the GPU tests: skip without a CUDA device; with one, error when the
    extension is unavailable (ext_status = kernel_fun._ext.status(): (ok, path or why not))."""
    if not cuda_available:
        return "no CUDA GPU", None
    ok, why = ext_status
    if ok:
        return None, None
    return None, (f"a CUDA device is present but kernel-fun's CUDA extension is unavailable: {why}. Build it "
                  "(pip install --no-build-isolation -e .), or deselect the GPU tests with -m 'not gpu'")


_GPU_ERROR = pytest.StashKey[str]()


def pytest_collection_modifyitems(config, items):
    verdict = None
    has_fla = importlib.util.find_spec("fla") is not None
    for item in items:
        if "gpu" in item.keywords:
            if verdict is None:
                cuda = torch.cuda.is_available()
                if cuda:
                    from kernel_fun import _ext

                    verdict = gpu_verdict(True, _ext.status())
                else:
                    verdict = gpu_verdict(False, (False, ""))
            skip, error = verdict
            if skip:
                item.add_marker(pytest.mark.skip(reason=skip))
            elif error:
                item.stash[_GPU_ERROR] = error
        if "fla" in item.keywords and not has_fla:
            item.add_marker(pytest.mark.skip(reason="fla-core not installed"))


def pytest_runtest_setup(item):
    error = item.stash.get(_GPU_ERROR, None)
    if error:
        pytest.fail(error, pytrace=False)
