"""Whether a torch.compile(fullgraph=True) training step hands our KDA forward op the same arguments as
the eager step, on the CPU (no GPU): a logging CPU kernel stands in for `kernel_fun::kda_forward`
(it records each argument's shape, strides, dtype, start alignment mod 16 and an md5 of its bytes, and
returns zero buffers), then the eager and the compiled step of tests/test_kda_bwd_gpu.py's
test_compile_fullgraph_training_step_runs_our_kernels shape run once each (the front's routing,
`_route(_call_meta(...))`, and `_kernel.forward`, as chunk_kda calls them for CUDA tensors) and the
two records are compared. Written for docs/notes/2026-12-06-gate-fold.md (section 3): the compiled step's loss was not
bitwise the eager one's with gate-fold.patch on an H100.

    PYTHONPATH=src python3 scripts/dev/compile_args_cpu.py
"""
from __future__ import annotations

import hashlib

import torch

import kernel_fun.kda as kda
from kernel_fun.kda import _kernel

calls: list[list[str]] = []


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return repr(t)
    digest = hashlib.md5(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:8]
    return f"{tuple(t.shape)} strides {tuple(t.stride())} {t.dtype} ptr%16={t.data_ptr() % 16} md5 {digest}"


@torch.library.register_kernel("kernel_fun::kda_forward", "cpu")
def _logging_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, options, output_final_state,
                     save_factors, save_states, save_workspace):
    calls.append([_describe(x) for x in (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens)]
                 + [options, repr((output_final_state, save_factors, save_states, save_workspace))])
    bufs = _kernel._forward_buffers(q, v, cu_seqlens, options, output_final_state, save_factors, save_states,
                                    save_workspace)
    return tuple(torch.zeros_like(b) for b in bufs)


def main() -> None:
    torch.manual_seed(0)
    B, T, H, K, V = 2, 200, 2, 128, 128
    q, k = (torch.randn(B, T, H, K, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(B, T, H, V, dtype=torch.bfloat16)
    g = torch.randn(B, T, H, K)
    beta = torch.randn(B, T, H, dtype=torch.bfloat16)
    A_log, dt_bias = torch.rand(H) + 1, 0.5 * torch.randn(H * K)
    do = torch.randn(B, T, H, V, dtype=torch.bfloat16)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta)]

    def step(q, k, v, g, beta):
        # the front's own routing (chunk_kda's lines for a CUDA call; on CPU tensors chunk_kda itself
        # would take the torch reference), so the options are built as they are under compile
        reason, options, _, _ = kda._route(q, v, None, kda._call_meta(
            q, v, g, beta, K ** -0.5, True, True, True, False, None, False, None, None, {"A_log": A_log}))
        assert reason is None, reason
        o, _ = _kernel.forward(q, k, v, g, beta, options=options, initial_state=None, output_final_state=False,
                               cu_seqlens=None, cu_seqlens_cpu=None, A_log=A_log, dt_bias=dt_bias,
                               return_intermediate_states=False)
        return (o.float() * do.float()).sum()

    step(*leaves)
    torch.compile(step, fullgraph=True)(*leaves)
    names = ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens", "options", "flags"]
    for name, eager, compiled in zip(names, *calls):
        print(f"{'same' if eager == compiled else 'DIFFERENT':9s} {name}: {eager}"
              + ("" if eager == compiled else f"\n          compiled: {compiled}"))


if __name__ == "__main__":
    main()
