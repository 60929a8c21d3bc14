"""Our kernels on the host emulator (tests/emu), on inputs stage_compare.py saved (on the GPU, or with
--emu on the CPU): dA_log / dg rel-RMS against the fp64 recurrence, beside the errors that run recorded
for ours and fla on the same inputs. The emulator reproduces the H200 (docs/notes/2026-12-02-dalog-
floor.md, fifth session), so a kernel change's accuracy on the GPU's own inputs is known before
device time is spent on it.

    python scripts/dev/emu_saved_inputs.py ROOT stages_<case>_s<seed>.pt ...

ROOT: the tree whose kernels the emulator is built from (this repository, or a git archive / an A/B
tree with a patch applied). The files: stage_compare.py's output (inputs, options, seeds and its
end-to-end errors), named for their case. Prints per file ours on the emulator against the recorded
errors and, where fla's are recorded, how many files are over the matrix's bound on dA_log
(kernel_fun.bench.accuracy.bound: max(fla's tolerance, 1.25 x fla)).
"""
from __future__ import annotations

import os
import re
import statistics
import sys


def main(argv: list[str]) -> None:
    root, files = argv[0], argv[1:]
    sys.path[:0] = [os.path.join(root, "tests", "emu"), os.path.join(root, "src")]
    import torch

    import kda_emu
    from kernel_fun.bench import accuracy as acc

    errs, over = [], 0
    for f in files:
        case = acc.BY_NAME[re.match(r"stages_(.+)_s\d+\.pt$", os.path.basename(f)).group(1)]
        d = torch.load(f, weights_only=False)
        inputs = tuple(x.cpu() for x in d["inputs"])
        kw = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in d["kw"].items()}
        seeds = {k: (v.cpu() if v is not None else None) for k, v in d["seeds"].items()}
        e = acc.errors(acc.reference(inputs, kw, seeds), kda_emu.chunk_kda_outputs(inputs, kw, seeds))
        rec = d.get("e2e", {})
        ours_rec, fla_rec = rec.get("ours", {}).get("dA_log"), (rec.get("fla") or {}).get("dA_log")
        errs.append(e["dA_log"])
        over += fla_rec is not None and e["dA_log"] > acc.bound(case, "dA_log", fla_rec)
        fmt = lambda x: "-" if x is None else f"{x:.2e}"  # noqa: E731
        print(f"{os.path.basename(f)} emu dA_log {e['dA_log']:.2e} dg {e['dg']:.2e} | recorded ours dA_log "
              f"{fmt(ours_rec)} | fla dA_log {fmt(fla_rec)}", flush=True)
    print(f"median emu dA_log {statistics.median(errs):.2e}, max {max(errs):.2e}; over the bound (files with "
          f"fla's error): {over}/{len(errs)}")


if __name__ == "__main__":
    main(sys.argv[1:])
