#!/usr/bin/env bash
# The bench rows that wait for a device call (the fortieth session ran this script's H100 part, the
# fla rows of long_b1_t32k_h8 and small: docs/notes/2026-12-06-stream-bounds-and-bench.md). What is
# left needs an H200; on any other card the script says so and times nothing. Each step goes on if
# one before it fails; results land in $OUT. gpu_run.sh runs it on the quiet GPU after the build:
#   KF_PREBUILT=1 KF_FLA_TESTS=0 KF_TESTS=none KF_FLASHKDA=1 KF_PROBE='bash scripts/dev/next_call_probe.sh rows' \
#     bash scripts/gpu_run.sh          # carry [".whl", ".prebuilt", ".flashkda"]
# rows: the forward rows of every KDA case, ours and FlashKDA's (no fla: its compile costs ~1 min a
# row; the H200 rows predate the 32-token default), then prod8192's rows with fla (its 3x target), or
# with KF_ROWS_FLA=0 (fla's compile on a fresh machine would not fit the call) every training row of ours.
# KF_ROWS_FWD_S / KF_ROWS_TRAIN_S: the two passes' --budget-s (default 240 / 200 s).
# bnd (any card): the bounded-gate grads kernel streamed at 128 chains at 128 columns unsliced, which
# the policy keeps unstreamed on the measurement of the same shape as bounded_b16's batch slices (1.4%
# slower streamed: docs/notes/2026-12-06-stream-bounds-and-bench.md), and the unbounded shape beside
# it as the control (ran on an H100 on 2026-12-06: equal within +-0.3%, the policy stays;
# docs/notes/2026-12-06-sanitizer-frames-and-rows.md):
#   KF_PREBUILT=1 KF_TESTS=none KF_PROBE='bash scripts/dev/next_call_probe.sh bnd' bash scripts/gpu_run.sh
# grads (any card): kda_bwd_grads' phase cycles at prod8192 and bounded_b16, then ncu of its first
# launch in prod8192's training call (per-instruction stall samples; split them per phase here with
# scripts/ncu_phases.py): where the kernel's ~74k cycles per CTA wait, on today's code (the last
# ncu of it predates the wgmma V phase).
# acc (any card): the two strong-unbounded draws whose dA_log of ours exceeded fla's tolerance on the
# H100 (2026-12-07: mix11 seed 1012 1.75e-2, mix29 seed 1032 4.2e-3) again with fla's errors beside
# them, which decide whether they are over the bound (docs/notes/2026-12-07-per-token-targets.md).
set -u
out=${OUT:-/tmp/next-call}
part=${1:-rows}  # rows, bnd, grads, acc, "grads rows", "acc rows"; "all" = bnd and rows
mkdir -p "$out"
step() { echo "== $* ($(date +%T))"; }

if [ "$part" = bnd ] || [ "$part" = all ]; then
step "the streamed backward at 128 chains at 128 columns, bounded and unbounded (0 = unstreamed)"
AB_RUNS=2 bash scripts/ab_env.sh KERNEL_FUN_KDA_BWD_STREAMED "0 1" \
  --shape bnd_b8_h16:B=8,T=8192,H=16,K=128,V=128,gate=bounded \
  --shape unb_b8_h16:B=8,T=8192,H=16,K=128,V=128,gate=unbounded
fi

if [ "$part" = grads ] || [ "$part" = "grads rows" ]; then
step "kda_bwd_grads: phase cycles per CTA"
PYTHONPATH=src python3 scripts/kda_phases.py --kernel grads prod8192 bounded_b16
step "kda_bwd_grads: ncu at prod8192"
bash scripts/ncu_kda.sh prod8192 kda_bwd_grads
python3 scripts/ncu_phases.py "$out/ncu_kda_bwd_grads_sass.csv.gz" --top 4 || true
fi

if [ "$part" = acc ] || [ "$part" = "acc rows" ]; then
step "bench.accuracy: mix11 and mix29 on five more seeds, with fla"
python3 -m kernel_fun.bench.accuracy --draws 5 --case mix11 --case mix29 --workers 2 --label draws-fla \
  --out "$out/acc" 2>&1 | tail -8
fi

if [ "$part" = rows ] || [ "$part" = all ] || [ "$part" = "grads rows" ] || [ "$part" = "acc rows" ]; then
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
if ! echo "$gpu" | grep -q H200; then
  echo "next_call_probe: $gpu is not an H200; the rows left are the H200's"
  exit 0
fi
step "H200: the KDA forward rows, ours and FlashKDA's"
python3 -m kernel_fun.bench --family kda --pass fwd --no-fla --budget-s "${KF_ROWS_FWD_S:-240}" \
  --out "$out/rows/h200-fwd" > /dev/null 2>&1
grep "^| " "$out/rows/h200-fwd"/*.md | head -40
if [ "${KF_ROWS_FLA:-1}" = 1 ]; then
  step "H200: prod8192 with fla (the training call's 3x target)"
  python3 -m kernel_fun.bench --family kda --case prod8192 --no-flashkda --out "$out/rows/prod8192" > /dev/null 2>&1
  grep "^| prod8192 |" "$out/rows/prod8192"/*.md
else  # ours only (fla's compile does not fit the call): fla's H200 rows are an earlier process's
  step "H200: the KDA training rows, ours (fla's are an earlier process's)"
  python3 -m kernel_fun.bench --family kda --pass fwd+bwd --no-fla --no-flashkda --budget-s "${KF_ROWS_TRAIN_S:-200}" \
    --out "$out/rows/h200-train" > /dev/null 2>&1
  grep "^| " "$out/rows/h200-train"/*.md | head -40
fi
fi
