"""fla's Triton kernels on the CPU, through Triton's interpreter (TRITON_INTERPRET=1), with the 16-bit
arithmetic of the GPU: a way to put fla's *algorithm* (its stages, its 16-bit intermediates, its
tf32 products) beside ours (the host emulator, tests/emu) on the very same inputs without a GPU.

    TRITON_INTERPRET=1 PYTHONPATH=src python3 scripts/dev/fla_interp.py --check
    TRITON_INTERPRET=1 PYTHONPATH=src python3 scripts/dev/stage_compare.py CASE --emu   # fla column too

`enable()` (stage_compare calls it in --emu mode) must run before fla is imported. Why each change
(Triton 3.6's interpreter as shipped, fla-core 0.5.2):
- bf16 tensors are held as raw uint16 bits and the interpreter's arithmetic, reductions and tl.dot
  run numpy on those bits (garbage); fp32 -> bf16 casts truncate. Here bf16 arithmetic is done in
  fp32 and rounded to nearest even, as the GPU does; a bf16 tl.sum rounds at every level of a tree
  (the GPU reduces in bf16); bf16 tl.dot operands are widened exactly.
- tl.dot with input_precision tf32 on fp32 operands keeps their top 19 bits (KF_INTERP_TF32=0: exact).
- fla's autotuner would benchmark on a GPU: the first config is taken.
- On a machine without a GPU fla turns tf32 off (IS_TF32_SUPPORTED) and its `gather` alias misses
  the interpreter's patching of tl.*; fla's loop counters are Python ints in the interpreter, so
  `i_t.to(tl.int64)` fails. A copy of the installed fla is patched for those (in a temp folder,
  nothing of fla is kept in this repository) and put first on sys.path.
- numpy >= 2 refuses int() of a one-element array: the interpreter's tensor __index__ is redefined.

What it is good for (docs/notes/2026-12-02-fla-on-cpu.md): fla's o / dq / dg / dA_log errors
against the fp64 recurrence come out at fla's H200 levels on five option mixes (medians over
seeds), so fla's stage errors can be read on the CPU. It is a model, not fla on a GPU: on
strong_bounded_T200 fla's H200 dA_log median is ~10x below this model's; the exact GPU inputs are
needed to say which (stage_compare --from).
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import sys
import tempfile

import numpy as np

_FLA_COPY = None


def _bf16_to_f32(u16):
    return (np.asarray(u16).astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(x):
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


def _patch_interpreter():
    import triton.language as tl
    import triton.runtime.interpreter as it

    B = it.InterpreterBuilder
    orig_binary, orig_cast, orig_dot, orig_sum = B.binary_op, B.cast_impl, B.create_dot, it.ReduceOps.sum

    def as_f32(h):
        d = np.asarray(h.data)
        if h.dtype.scalar == tl.bfloat16 and d.dtype == np.uint16:
            return _bf16_to_f32(d)
        return d.astype(np.float32)

    def binary_op(self, lhs, rhs, op):
        out_t = lhs.dtype.scalar
        if out_t != tl.bfloat16 and rhs.dtype.scalar != tl.bfloat16:
            return orig_binary(self, lhs, rhs, op)
        r = op(as_f32(lhs), as_f32(rhs))
        if r.dtype == np.bool_:  # comparisons
            return it.TensorHandle(r, out_t)
        if out_t != tl.bfloat16:
            return it.TensorHandle(np.asarray(r).astype(it._get_np_dtype(out_t)), out_t)
        return it.TensorHandle(_f32_to_bf16(r), out_t)

    def cast_impl(self, src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if s == tl.bfloat16 and d == tl.float32:
            return it.TensorHandle(_bf16_to_f32(src.data), d)
        if s == tl.float32 and d == tl.bfloat16:
            return it.TensorHandle(_f32_to_bf16(src.data), d)
        return orig_cast(self, src, dst_type)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            a = it.TensorHandle(as_f32(a), tl.float32)
            b = it.TensorHandle(as_f32(b), tl.float32)
        elif (os.environ.get("KF_INTERP_TF32", "1") == "1" and a.dtype.scalar == tl.float32
              and b.dtype.scalar == tl.float32 and "TF32" in str(input_precision).upper()
              and "X3" not in str(input_precision).upper()):
            keep = np.uint32(0xFFFFE000)  # the tensor core reads the top 19 bits of each operand
            a = it.TensorHandle((np.ascontiguousarray(a.data, np.float32).view(np.uint32) & keep).view(np.float32),
                                tl.float32)
            b = it.TensorHandle((np.ascontiguousarray(b.data, np.float32).view(np.uint32) & keep).view(np.float32),
                                tl.float32)
        return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def reduce_sum(self, input):
        if not (input.dtype.scalar == tl.bfloat16 and input.handle.data.dtype == np.uint16 and self.axis is not None):
            return orig_sum(self, input)
        x = np.moveaxis(_bf16_to_f32(input.handle.data), self.axis, 0)
        while x.shape[0] > 1:  # a tree of bf16 adds
            if x.shape[0] % 2:
                x = np.concatenate([x, np.zeros_like(x[:1])], 0)
            x = _bf16_to_f32(_f32_to_bf16(x[0::2] + x[1::2]))
        r = x[0]
        if self.keep_dims:
            r = np.expand_dims(r, self.axis)
        return self.to_tensor(_f32_to_bf16(r), input.dtype)

    B.binary_op, B.cast_impl, B.create_dot, it.ReduceOps.sum = binary_op, cast_impl, create_dot, reduce_sum

    orig_patch_tensor = it._patch_lang_tensor

    def patch_tensor(tensor, scope):
        orig_patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    it._patch_lang_tensor = patch_tensor

    import triton.runtime.autotuner as at
    orig_run = at.Autotuner.run

    def run(self, *args, **kwargs):
        if len(self.configs) > 1:
            self.configs = self.configs[:1]
        return orig_run(self, *args, **kwargs)

    at.Autotuner.run = run


# (file under fla/, pattern, replacement): see the module docstring
_FLA_EDITS = (
    ("utils/_device.py", r"^IS_TF32_SUPPORTED = .*$", "IS_TF32_SUPPORTED = True"),
    ("ops/utils/op.py", r"^    gather = tl\.gather$",
     "    @triton.jit\n    def gather(src, index, axis):\n        return tl.gather(src, index, axis)"),
    ("ops/kda/chunk_bwd.py", r"i_t\.to\(tl\.int64\)", "tl.cast(i_t, tl.int64)"),
    ("ops/common/chunk_delta_h.py", r"i_t\.to\(tl\.int64\)", "tl.cast(i_t, tl.int64)"),
)


def _fla_copy() -> str:
    """A patched copy of the installed fla package; returns the folder to put first on sys.path."""
    import importlib.util

    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("fla is not installed (pip install fla-core==0.5.2)")
    src = pathlib.Path(list(spec.submodule_search_locations)[0])
    root = pathlib.Path(tempfile.mkdtemp(prefix="kf_fla_interp_"))
    shutil.copytree(src, root / "fla", ignore=shutil.ignore_patterns("__pycache__"))
    for rel, pat, rep in _FLA_EDITS:
        p = root / "fla" / rel
        text, n = re.subn(pat, rep, p.read_text(), flags=re.M)
        if n == 0:
            raise RuntimeError(f"fla_interp: '{pat}' not found in fla/{rel} (another fla version?)")
        p.write_text(text)
    return str(root)


def enable() -> None:
    """Patch the interpreter and put the patched fla first on sys.path (before fla is imported)."""
    global _FLA_COPY
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("set TRITON_INTERPRET=1 before Python starts (Triton reads it at import)")
    if "fla" in sys.modules:
        raise RuntimeError("fla_interp.enable() must run before fla is imported")
    if _FLA_COPY is None:
        _patch_interpreter()
        _FLA_COPY = _fla_copy()
        sys.path.insert(0, _FLA_COPY)


def _check() -> int:
    """A small bf16 chunk_kda through fla on the CPU against the fp64 recurrence."""
    import torch

    enable()
    from fla.ops.kda import chunk_kda

    from kernel_fun.check import rel_rms
    from kernel_fun.ref.kda import naive_recurrent_kda

    torch.manual_seed(0)
    B, T, H, K, V = 1, 80, 1, 64, 64
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v, g, beta = torch.randn(B, T, H, V), -torch.rand(B, T, H, K), torch.rand(B, T, H)
    kw = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
    o, ht = chunk_kda(*(x.bfloat16() for x in (q, k, v)), g, beta.bfloat16(), **kw)
    ro, rht = naive_recurrent_kda(*(x.bfloat16().double() for x in (q, k, v)), g.double(),
                                  beta.bfloat16().double(), **kw)
    eo, eh = rel_rms(ro, o.double()), rel_rms(rht, ht.double())
    print(f"fla on the CPU, bf16 T={T}: o rel-RMS {eo:.2e}, ht {eh:.2e} (bf16 storage: ~4e-3)")
    return 0 if max(eo, eh) < 1e-2 else 1


if __name__ == "__main__":
    if "--check" not in sys.argv:
        print(__doc__)
        sys.exit(0)
    sys.exit(_check())
