"""The KDA kernels under compute-sanitizer: a few small forward + backward calls that between them
launch every KDA kernel (the two-kernel forward, the opt-in fused forward, the backward from saved
factors and by recompute, the paired scans, GVA's group sums, the gate-parameter passes, the token
recurrence of one-chunk problems, the opt-in split scans, the 32-token forward of a call without
autograd, the streamed forward at 64 and at 32 tokens per chunk, the context-parallel call's identity
columns), in strict
mode so that nothing falls back to fla. Run by scripts/sanitize_kda.sh, once per tool; alone it is
a smoke test.

    PYTHONPATH=src python3 scripts/sanitize_kda.py
    KF_MEMHIST=1 PYTHONPATH=src python3 scripts/sanitize_kda.py   # and the blocks still live after it
"""
from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
import types

import torch
import torch.nn.functional as F

import kernel_fun
from kernel_fun.kda import chunk_kda


def _inputs(T, H, HV, K, V, gate, cu=None, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.float32)  # noqa: E731
    q, k = r(1, T, H, K).to(dtype), r(1, T, H, K).to(dtype)
    v = r(1, T, HV, V).to(dtype)
    beta = torch.rand(1, T, HV, generator=g, device="cuda").to(dtype)
    kw = dict(use_qk_l2norm_in_kernel=True, output_final_state=True, cu_seqlens=cu)
    n = 1 if cu is None else cu.numel() - 1
    kw["initial_state"] = r(n, HV, K, V)
    if gate == "raw":
        gt = F.logsigmoid(r(1, T, HV, K)).to(dtype)
    else:
        gt = r(1, T, HV, K).to(dtype)
        kw.update(use_gate_in_kernel=True, A_log=r(HV) * 0.5, dt_bias=r(HV * K) * 0.1)
        if gate == "bounded":
            kw.update(safe_gate=True, lower_bound=-5.0)
    leaves = [q, k, v, gt, beta, kw["initial_state"]] + [kw[n] for n in ("A_log", "dt_bias") if n in kw]
    return (q, k, v, gt, beta), kw, leaves


def _train(args, kw, leaves):
    for t in leaves:
        t.requires_grad_(True)
    o, ht = chunk_kda(*args, **kw)
    (o.float().square().mean() + ht.float().square().mean()).backward()
    torch.cuda.synchronize()


def run_calls() -> None:
    cu = torch.tensor([0, 0, 1, 130, 130, 200], device="cuda", dtype=torch.int32)
    calls = [
        ("varlen, empty and one-token documents, bounded, K=V=128", dict(T=200, H=2, HV=2, K=128, V=128, gate="bounded", cu=cu)),
        ("GVA, unbounded, K=64 V=128, fp16", dict(T=150, H=1, HV=2, K=64, V=128, gate="unbounded", dtype=torch.float16)),
        ("raw gate, K=128 V=256", dict(T=96, H=1, HV=1, K=128, V=256, gate="raw")),
        # one chunk per sequence: the fp32 token recurrence (csrc/kda/recur/), GVA's group sums
        ("recurrence: varlen in one chunk, GVA, K=128 V=64", dict(T=60, H=1, HV=2, K=128, V=64, gate="unbounded",
                                                                  cu=torch.tensor([0, 0, 1, 30, 60], device="cuda",
                                                                                  dtype=torch.int32))),
        ("recurrence: bounded, K=64 V=128", dict(T=64, H=2, HV=2, K=64, V=128, gate="bounded")),
    ]
    with kernel_fun.strict():
        for what, shape in calls:
            args, kw, leaves = _inputs(**shape)
            _train(args, kw, leaves)
            # the forward alone (no saved factors): the fused kernel where KERNEL_FUN_KDA_FWD_FUSED=1
            with torch.no_grad():
                chunk_kda(*[a.detach() for a in args], **{k: (v.detach() if torch.is_tensor(v) else v) for k, v in kw.items()})
            torch.cuda.synchronize()
            print(f"ok: {what} (fused forward {os.environ.get('KERNEL_FUN_KDA_FWD_FUSED', '0')})", flush=True)
            del args, kw, leaves
        # the split scans (opt-in): pieces of one chunk, the forward's and both of the backward's scans
        split = [("split scans: varlen, empty and one-token documents, bounded, K=V=128",
                  dict(T=200, H=2, HV=2, K=128, V=128, gate="bounded", cu=cu)),
                 ("split scans: GVA, K=64 V=128, fp16", dict(T=300, H=1, HV=2, K=64, V=128, gate="unbounded",
                                                             dtype=torch.float16))]
        with _env(KERNEL_FUN_KDA_SPLIT="1", KERNEL_FUN_KDA_SPLIT_CHUNKS="1"):
            for what, shape in split:
                args, kw, leaves = _inputs(**shape)
                _train(args, kw, leaves)
                print(f"ok: {what}", flush=True)
                del args, kw, leaves
        # the context-parallel call of a document that began on an earlier rank (kda/_cp.py's
        # KernelEngine): K identity columns beside v's, kda_fwd_scan_id_kernel (slices of 64: K = V =
        # 64; of 128 or 64: K = V = 128, the policy's); its backward is the ordinary one, above
        from kernel_fun.kda import _kernel
        from kernel_fun.kda._options import KdaOptions
        for K, V in ((64, 64), (128, 128)):
            args, kw, _ = _inputs(T=200, H=1, HV=2, K=K, V=V, gate="unbounded")
            opts = KdaOptions.from_call(scale=K ** -0.5, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                                        A_log=kw["A_log"], state_v_first=False, chunk_size=64)
            A, D = _kernel.gate_params(opts, kw["A_log"], kw["dt_bias"])
            _kernel.forward_identity_columns(*args, A, D, opts.encode(), True)
            torch.cuda.synchronize()
            print(f"ok: identity columns, K={K} V={V}", flush=True)
            del args, kw
        # the streamed forward (forced): the scan's pass 1 waiting on the intra's chunk flags. Under a
        # sanitizer the launches run one after the other, so every chain stops after its 2 ms wait
        # and pass 2 resumes it: the flags, the done counter, the resume slots and scan_save all run.
        # A training call (64-token chunks), then the forward alone at 64 and at 32 tokens per chunk.
        shape = dict(T=300, H=2, HV=2, K=128, V=128, gate="bounded")
        for chunk in ("64", "32"):
            with _env(KERNEL_FUN_KDA_SPLIT="0", KERNEL_FUN_KDA_FWD_STREAMED="1", KERNEL_FUN_KDA_FWD_CHUNK=chunk):
                args, kw, leaves = _inputs(**shape)
                if chunk == "64":
                    _train(args, kw, leaves)
                with torch.no_grad():
                    chunk_kda(*args, **kw)
                torch.cuda.synchronize()
                print(f"ok: streamed forward, {chunk}-token chunks", flush=True)
                del args, kw, leaves
        # the streamed backward (kda_bwd_grads beside the dh scan, waiting on its counters; under a
        # sanitizer the launches run one after the other, so every count is final when grads starts):
        # the bounded-gate kernel, and the unbounded one with kda_bwd_grads_last_kernel (bf16, dht)
        from kernel_fun import _ext
        for what, shape in (("bounded, K=V=128", dict(T=1200, H=2, HV=2, K=128, V=128, gate="bounded")),
                            ("unbounded, K=64 V=128", dict(T=1100, H=2, HV=2, K=64, V=128, gate="unbounded"))):
            with _env(KERNEL_FUN_KDA_SPLIT="0"):
                args, kw, leaves = _inputs(**shape)
                before = _ext.op_calls()["kda_bwd_streamed"]
                _train(args, kw, leaves)
                assert _ext.op_calls()["kda_bwd_streamed"] == before + 1, "the backward did not stream"
                print(f"ok: streamed backward, {what}", flush=True)
                del args, kw, leaves


@contextlib.contextmanager
def _env(**values):
    """The KERNEL_FUN_* switches set for the block, restored after it."""
    keep = {n: os.environ.get(n) for n in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for n, v in keep.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


def _print_live_blocks() -> None:
    """The caching allocator's live blocks with the Python frames that allocated them (needs
    torch.cuda.memory._record_memory_history before the calls)."""
    snap = torch.cuda.memory._snapshot()
    for seg in snap.get("segments", []):
        for blk in seg.get("blocks", []):
            if blk.get("state") != "active_allocated":
                continue
            frames = [f for f in blk.get("frames", []) if f.get("filename", "").endswith(".py")]
            where = " <- ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in frames[:6])
            print(f"live block {blk.get('size')} bytes: {where or '(no Python frames)'}", flush=True)


def main() -> None:
    # KF_MEMHIST=1: record the allocations' stacks and print the blocks still live after the calls
    # and what holds them. Under compute-sanitizer the calls' tensors stay allocated (48.8 MB on
    # 2026-12-06, 0 bytes without it): the Python frames of the calls hold them, and those frames are
    # held outside the garbage collector's sight; torch's own custom ops do the same under the
    # sanitizer without kernel_fun (scripts/dev/sanitizer_frames.py,
    # bench/results/ab/2026-12-06-sanitizer-frames-h100.txt), so it is not a leak of ours.
    memhist = os.environ.get("KF_MEMHIST") == "1"
    if memhist:
        torch.cuda.memory._record_memory_history(max_entries=200000)
    run_calls()
    # memcheck's leak check counts the caching allocator's segments still held at exit (2 MiB blocks
    # from cudaMalloc inside c10's CUDACachingAllocator) as leaks: hand them back first, so that a
    # leak report means memory that is really lost. The calls run in their own function so that no
    # tensor of theirs is alive here (2026-12-03: emptying the cache inside the function that still
    # held cu_seqlens left two 2 MiB segments, the one holding cu_seqlens and one workspace's).
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    live = torch.cuda.memory_allocated()
    print(f"done (allocated after the calls: {live} bytes)", flush=True)
    if memhist and live:
        _print_holders()
        _print_live_blocks()


def _print_holders() -> None:
    """Whether Python still holds the live blocks: the CUDA tensors the garbage collector can reach,
    and what refers to a few of them (nothing here means the blocks are held outside Python)."""
    stats = torch.cuda.memory_stats()
    print(f"allocator {torch.cuda.get_allocator_backend()}: active blocks {stats.get('active.all.current')}, "
          f"segments {stats.get('segment.all.current')}, reserved {torch.cuda.memory_reserved()} bytes", flush=True)
    tensors = [o for o in gc.get_objects() if torch.is_tensor(o) and o.is_cuda]
    print(f"CUDA tensors the garbage collector reaches: {len(tensors)}", flush=True)
    for t in tensors[:3]:
        holders = [type(r).__name__ for r in gc.get_referrers(t) if r is not tensors]
        print(f"  {tuple(t.shape)} {t.dtype}: held by {holders[:6]}", flush=True)
    # the frames that hold them, and what holds those frames (a traceback, a thread, another frame)
    frames = [r for r in gc.get_referrers(tensors[0]) if isinstance(r, types.FrameType)] if tensors else []
    for i in range(min(6, len(frames))):  # (no slice or enumerate: their list / tuple would hold f too)
        f = frames[i]
        print(f"  frame {f.f_code.co_name} ({f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno})", flush=True)
        for r in gc.get_referrers(f):
            if r is frames:
                continue
            what = type(r).__name__
            if isinstance(r, types.FrameType):
                what += f" {r.f_code.co_name}"
            elif isinstance(r, types.TracebackType):
                tb_refs = [type(x).__name__ + (f" {x!r:.120}" if isinstance(x, BaseException) else "")
                           for x in gc.get_referrers(r)]
                what += f" <- {tb_refs[:4]}"
            print(f"    held by {what}", flush=True)
    del frames, tensors
    print(f"threads: {[t.name for t in threading.enumerate()]}; last_exc: {getattr(sys, 'last_exc', None)!r:.200}",
          flush=True)


if __name__ == "__main__":
    main()
