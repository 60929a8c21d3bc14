"""Independent pure-PyTorch references (CPU-capable, fp64-capable, autograd-differentiable) for the
ops kernel-fun implements: KDA (``kda``) and the short causal conv1d (``cconv``)."""

from kernel_fun.ref.cconv import causal_conv1d_ref, causal_conv1d_update_ref
from kernel_fun.ref.kda import chunk_kda_reference, kda_gate, naive_recurrent_kda, prepare_inputs

__all__ = [
    "kda_gate",
    "prepare_inputs",
    "naive_recurrent_kda",
    "chunk_kda_reference",
    "causal_conv1d_ref",
    "causal_conv1d_update_ref",
]
