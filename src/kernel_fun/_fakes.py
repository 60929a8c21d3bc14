"""Fake (meta) implementations of the kernel_fun ops, so torch.compile traces them.

Every op that launches a kernel writes into caller-allocated outputs (``Tensor(a!)`` in its
schema) and returns nothing, so its fake is a no-op: output shapes are decided in Python before
the call. Imported by ``_ext`` once the library has loaded (the schemas must exist first).
Add each new kernel op to ``OUT_PARAM_OPS``; tests/test_package.py checks the list against the
library both ways.
"""

from __future__ import annotations

import torch

OUT_PARAM_OPS: tuple[str, ...] = (
    # cconv family (csrc/api/cconv_ops.cpp)
    "cconv_fwd",
    "cconv_bwd",
    "cconv_update",
    # kda family (csrc/api/kda_ops.cpp)
    "kda_fwd",
    "kda_bwd",
)


def _noop(*args, **kwargs):
    return None


for _name in OUT_PARAM_OPS:
    if hasattr(torch.ops.kernel_fun, _name):
        torch.library.register_fake(f"kernel_fun::{_name}")(_noop)
