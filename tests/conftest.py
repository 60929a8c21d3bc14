"""Shared test setup: GPU tests carry @pytest.mark.gpu and skip cleanly without a GPU or without
the built extension; fla parity tests carry @pytest.mark.fla and skip without fla."""

import importlib.util

import pytest
import torch


def _gpu_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    from kernel_fun import _ext

    ok, why = _ext.status()
    return None if ok else why


def pytest_collection_modifyitems(config, items):
    gpu_reason = None
    gpu_checked = False
    has_fla = importlib.util.find_spec("fla") is not None
    for item in items:
        if "gpu" in item.keywords:
            if not gpu_checked:
                gpu_reason, gpu_checked = _gpu_skip_reason(), True
            if gpu_reason:
                item.add_marker(pytest.mark.skip(reason=gpu_reason))
        if "fla" in item.keywords and not has_fla:
            item.add_marker(pytest.mark.skip(reason="fla-core not installed"))
