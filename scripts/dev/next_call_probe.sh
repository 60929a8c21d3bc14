#!/usr/bin/env bash
# The thirtieth session's device probe, as one file so that a call's command line stays short: the cp
# rank times, the 32-token forward beside the 64-token one, FlashKDA's stages. Each step goes on if one
# before it fails; results land in $OUT (the device's output folder).
#   KF_PREBUILT=1 ... KF_PROBE='bash scripts/dev/next_call_probe.sh [c32|rows|all]' bash scripts/gpu_run.sh $OUT
# c32: the cp rank times, the 32-token forward (harness, bench rows); rows: those bench rows alone;
# all (default): c32, then FlashKDA's stages (carry .flashkda).
set -u
out=${OUT:-/tmp/next-call}
part=${1:-all}
mkdir -p "$out"
step() { echo "== $* ($(date +%T))"; }

if [ "$part" = c32 ] || [ "$part" = all ]; then
step "cp rank times (the backward at V columns)"
python3 scripts/cp_rank_times.py --case long_b1_t128k --world 2 --stages --out "$out/cp_rank.json"
step "the 32-token forward beside the 64-token one (torch-free harness)"
bash scripts/dev/intra_c32_bench.sh "$out"
fi
if [ "$part" = c32 ] || [ "$part" = rows ] || [ "$part" = all ]; then
step "the bench's forward rows at 64 and 32 tokens per chunk (KERNEL_FUN_KDA_FWD_CHUNK)"
for c in bounded_b16 prod8192 varlen long_b1_t32k bounded_b1; do
  for n in 64 32; do
    echo "-- $c, chunk $n"
    KERNEL_FUN_KDA_FWD_CHUNK=$n python3 -m kernel_fun.bench --family kda --case "$c" --pass fwd --no-fla \
      --no-flashkda --out "$out/c$n/$c" > /dev/null 2>&1
    grep "^| $c |" "$out/c$n/$c"/*.md
  done
done
fi
[ "$part" = all ] || exit 0
step "our forward's kernels beside FlashKDA's (carry .flashkda, KF_FLASHKDA=1)"
python3 scripts/kda_stage_times.py --pass fwd --flashkda bounded_b16 long_b1_t32k bounded_b1
