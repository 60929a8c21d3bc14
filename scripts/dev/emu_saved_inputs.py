"""Our kernels on the host emulator (tests/emu), on inputs stage_compare.py saved (on the GPU, or with
--emu on the CPU): dA_log / dg rel-RMS against the fp64 recurrence, beside the errors that run recorded
for ours and fla on the same inputs.
The emulator reproduces the H200 (docs/notes/2026-12-02-dalog-floor.md, fifth session), so a kernel
change's accuracy on the GPU's own inputs is known before device time is spent on it.

    python scripts/dev/emu_saved_inputs.py ROOT stages_<case>_s<seed>.pt ...

ROOT: the tree whose kernels to build the emulator from (this repository, or a git archive / an A/B
tree with a patch applied). The files: scripts/dev/stage_compare.py's output (inputs, options, seeds
and its e2e errors). Prints per file ours-on-the-emulator vs the recorded GPU errors, and with fla's
errors present how many files are over max(3e-3, 1.25 x fla) on dA_log (the matrix's bound on the
strong_bounded_T200 row, whose tolerance is 3e-3).
"""
import os, sys, statistics
root = sys.argv[1]
sys.path[:0] = [os.path.join(root, "tests", "emu"), os.path.join(root, "src")]
import torch
from kernel_fun.bench import accuracy as acc
import kda_emu
files = sys.argv[2:]
rows = []
for f in files:
    d = torch.load(f, weights_only=False)
    inputs = tuple(x.cpu() for x in d["inputs"])
    kw = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in d["kw"].items()}
    seeds = {k: (v.cpu() if v is not None else None) for k, v in d["seeds"].items()}
    scale = kw.get("scale") or inputs[0].shape[-1] ** -0.5
    o, ht, grads, _ = kda_emu.training_call(*inputs, seeds["o"], seeds["ht"], scale=scale, **{n: kw.get(n) for n in kda_emu.CALL_KEYS})
    got = {k: v for k, v in grads.items() if v is not None}
    if kw.get("A_log") is not None and "dA_log" in got:
        got["dA_log"] = got["dA_log"].reshape(kw["A_log"].shape)
    e = acc.errors(acc.reference(inputs, kw, seeds), got)
    fla = d["e2e"]["fla"] if "e2e" in d and d["e2e"].get("fla") else None
    gpu = d["e2e"]["ours"] if "e2e" in d else None
    rows.append((e["dA_log"], e["dg"], fla["dA_log"] if fla else None, gpu["dA_log"] if gpu else None))
    print(os.path.basename(f), "emu dA_log %.2e dg %.2e | recorded ours dA_log %s | fla dA_log %s" % (
        e["dA_log"], e["dg"], "%.2e" % rows[-1][3] if gpu else "-", "%.2e" % rows[-1][2] if fla else "-"), flush=True)
if all(r[2] is not None for r in rows):
    over = sum(r[0] > max(3e-3, 1.25 * r[2]) for r in rows)
    print("median emu %.2e max %.2e; over max(3e-3, 1.25 fla): %d/%d" % (statistics.median(r[0] for r in rows), max(r[0] for r in rows), over, len(rows)))
