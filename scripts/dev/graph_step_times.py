"""The GPU time of one training call (forward + backward of chunk_kda) through a CUDA graph, so that
the host's launch time does not set it (bounded_b1's training call is ~1.2 ms, about what the host
needs to launch it): each form captured once and replayed, the forms' replays alternating, medians.
A form is a set of environment switches, read at capture (the front's and the launchers' per call).

    PYTHONPATH=src python3 scripts/dev/graph_step_times.py [--fwd] bounded_b1 long_b1_t32k

--fwd: the forward alone (no autograd), in graphs and eagerly (CUDA events, the same alternation).
--dh-bv: two forms instead, the defaults and KERNEL_FUN_KDA_SCAN_BV=64 (the streamed dh scan's width).
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

from kernel_fun.bench.cases import select
from kernel_fun.bench.run import make_inputs
from kernel_fun.kda import chunk_kda

FORMS = {  # the streamed backward (the defaults), its states without the streaming, the form before
    "saved+streamed": {},
    "saved": {"KERNEL_FUN_KDA_BWD_STREAMED": "0"},
    "paired": {"KERNEL_FUN_KDA_SAVE_STATES": "0"},
    # the defaults with the forward's streaming off: whether a captured streamed forward overlaps
    "fwd-unstreamed": {"KERNEL_FUN_KDA_FWD_STREAMED": "0"},
}


def _with_env(env, fn):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fn()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def capture(inputs, env):
    """(the step captured in a CUDA graph, the step run eagerly), both under env."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs["leaves"]]
    args, kw = leaves[:5], dict(inputs["kwargs"], A_log=leaves[5], dt_bias=leaves[6])
    do = torch.randn(inputs["out_shape"], device="cuda", dtype=torch.bfloat16)

    def step():
        if FWD_ONLY:
            with torch.no_grad():
                return chunk_kda(*args, **kw)[0]
        o, _ = chunk_kda(*args, **kw)
        return torch.autograd.grad((o.float() * do.float()).sum(), leaves)

    def record():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return graph

    return _with_env(env, record), lambda: _with_env(env, step)


FWD_ONLY = "--fwd" in sys.argv
# --dh-bv: the streamed backward's dh scan at its own width (the defaults) against 64 (the override)
if "--dh-bv" in sys.argv:
    FORMS = {"dh-stream-bv": {}, "dh-bv-64": {"KERNEL_FUN_KDA_SCAN_BV": "64"}}


def main() -> None:
    for case in select("kda", [a for a in sys.argv[1:] if not a.startswith("--")]):
        inputs = make_inputs(case, torch, "cuda", seed=0)
        forms = {name: capture(inputs, env) for name, env in FORMS.items()}
        graph_ms = {name: [] for name in FORMS}
        eager_ms = {name: [] for name in FORMS}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(15):
            for name, (graph, eager) in forms.items():
                for run, out in ((graph.replay, graph_ms), (eager, eager_ms)):
                    run()
                    start.record()
                    run()
                    end.record()
                    end.synchronize()
                    out[name].append(start.elapsed_time(end))
        what = "fwd" if FWD_ONLY else "fwd+bwd"
        for label, times in (("graph", graph_ms), ("eager", eager_ms)):
            print(f"{case.name:14s} {what} {label}  "
                  + "  ".join(f"{n} {statistics.median(t):.3f} ms" for n, t in times.items()), flush=True)
        del forms
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
