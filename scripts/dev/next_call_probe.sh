#!/usr/bin/env bash
# The next session's device probe (written by the thirty-eighth, whose device calls never started:
# docs/notes/2026-12-05-device-refusals-and-bwd-stream-width.md), as one file so that a call's command
# line stays short. Each step goes on if one before it fails; results land in $OUT (the device's
# output folder). gpu_run.sh runs it on the quiet GPU after the build and before the GPU tests.
#   KF_PREBUILT=1 KF_FLA_TESTS=0 KF_PROBE='bash scripts/dev/next_call_probe.sh ab' \
#     KF_PYTEST="-n 2 tests/test_kda_fwd_gpu.py tests/test_kda_bwd_gpu.py" bash scripts/gpu_run.sh  # call 1
#   KF_PREBUILT=1 KF_FLA_TESTS=0 KF_TESTS=none KF_FLASHKDA=1 KF_PROBE='bash scripts/dev/next_call_probe.sh rows' \
#     bash scripts/gpu_run.sh          # call 2, carry [".whl", ".prebuilt", ".flashkda"]; on an H200 above all
# bsw: the streamed-backward GPU tests on ab_bsw (HEAD + bwd-stream-width.patch).
# ramp: dh-publish-ramp.patch (ab_alt) against this tree on the streamed backward's shapes.
# ab: the streamed backward wherever it is possible (=2) against the model (=1) on the shapes whose dh
# scan has 67-132 chains at 64 columns (small; gva has 128 at 128, a check of the threshold), with the
# forward streamed as in production; no build (scripts/dev/experiments/bwd-stream-width.patch is the
# policy change that would follow a gain). rows: the bench rows that wait (fla compiles each new
# shape: ~1 min a row), on an H200 the forward rows with FlashKDA first.
set -u
out=${OUT:-/tmp/next-call}
part=${1:-all}
mkdir -p "$out"
step() { echo "== $* ($(date +%T))"; }

if [ "$part" = ab ] || [ "$part" = all ]; then
step "the streamed backward forced (2) against the model (1): small (128 chains at 64), gva (128 at 128)"
KERNEL_FUN_KDA_FWD_STREAMED=2 AB_RUNS=2 bash scripts/ab_env.sh KERNEL_FUN_KDA_BWD_STREAMED "1 2" small gva
fi
if [ "$part" = ramp ]; then
# carry [".whl", ".prebuilt", "ab_alt"] (ab_alt = HEAD + dh-publish-ramp.patch, prebuilt here)
export KERNEL_FUN_KDA_FWD_STREAMED=2
bash scripts/use_prebuilt.sh ab_alt || exit 1  # ab_alt's own build, in place once
for i in 1 2; do
  step "the dh scan's publication ramp: training calls, this tree then ab_alt, run $i"
  python3 scripts/kda_stage_times.py --pass fwd+bwd long_b1_t32k long_b1_t128k bounded_b1 2>&1 | grep -v Warn
  PYTHONPATH="$PWD/ab_alt/src:${PYTHONPATH:-}" python3 ab_alt/scripts/kda_stage_times.py --pass fwd+bwd \
    long_b1_t32k long_b1_t128k bounded_b1 2>&1 | grep -v Warn
  step "bounded_b1 through a CUDA graph (the defaults' form), this tree then ab_alt, run $i"
  python3 scripts/dev/graph_step_times.py bounded_b1 2>&1 | grep -v Warn
  PYTHONPATH="$PWD/ab_alt/src:${PYTHONPATH:-}" python3 ab_alt/scripts/dev/graph_step_times.py bounded_b1 2>&1 \
    | grep -v Warn
done
fi
if [ "$part" = bsw ]; then
# carry [".whl", ".prebuilt", "ab_bsw"] (ab_bsw = HEAD + bwd-stream-width.patch, prebuilt here): the
# streamed-backward GPU tests on the patched tree (its new case among them), so that the patch can land
# on the ab part's timing without another call
bash scripts/use_prebuilt.sh ab_bsw || exit 1
step "ab_bsw: the streamed-backward GPU tests"
(cd ab_bsw && PYTHONPATH="$PWD/src:${PYTHONPATH:-}" timeout 240 python3 -m pytest -q -p no:cacheprovider \
  tests/test_kda_bwd_gpu.py -k "stream or save or pair" 2>&1 | tail -15)
fi
if [ "$part" = rows ] || [ "$part" = all ]; then
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
if echo "$gpu" | grep -q H200; then
  step "H200: the KDA forward rows, ours and FlashKDA's (fla's are older: its compile costs minutes)"
  python3 -m kernel_fun.bench --family kda --pass fwd --no-fla --budget-s 240 --out "$out/rows/h200-fwd" \
    > /dev/null 2>&1
  grep "^| " "$out/rows/h200-fwd"/*.md | head -40
fi
step "bench rows with fla: long_b1_t32k_h8 (its fla rows and fwd+bwd never ran), small"
for c in long_b1_t32k_h8 small; do
  python3 -m kernel_fun.bench --family kda --case "$c" --no-flashkda --out "$out/rows/$c" > /dev/null 2>&1
  grep "^| $c |" "$out/rows/$c"/*.md
done
fi
