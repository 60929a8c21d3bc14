#!/usr/bin/env bash
# The bench rows that wait for a device call (written by the thirty-eighth session, whose device calls
# never started; its ab, ramp and bsw parts ran in the thirty-ninth and are gone with the patches they
# timed: docs/notes/2026-12-06-streamed-backward-wider.md). Each step goes on if one before it fails;
# results land in $OUT. gpu_run.sh runs it on the quiet GPU after the build, before the GPU tests:
#   KF_PREBUILT=1 KF_FLA_TESTS=0 KF_TESTS=none KF_FLASHKDA=1 KF_PROBE='bash scripts/dev/next_call_probe.sh rows' \
#     bash scripts/gpu_run.sh          # carry [".whl", ".prebuilt", ".flashkda"]; on an H200 above all
# rows: on an H200 the forward rows with FlashKDA first (no fla: its compile costs ~1 min a row), then
# long_b1_t32k_h8's and small's rows with fla.
set -u
out=${OUT:-/tmp/next-call}
part=${1:-all}
mkdir -p "$out"
step() { echo "== $* ($(date +%T))"; }

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
