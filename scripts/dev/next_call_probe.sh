#!/usr/bin/env bash
# The probe of the next device call (scripts/dev/experiments/README.md, "The next call"), as one file so
# that the call's command line stays short: the split-chain patches (ab_alt, ab_alt2), the cp rank
# times, the 32-token forward beside the 64-token one, FlashKDA's stages. Each step goes on if one
# before it fails; results land in $OUT (the device's output folder).
#   KF_PREBUILT=1 ... KF_PROBE='bash scripts/dev/next_call_probe.sh [c32|chain|all]' bash scripts/gpu_run.sh $OUT
# c32: the cp rank times, the 32-token forward (harness, bench rows); rows: those bench rows alone;
# chain: the split-chain patches and FlashKDA's stages (carry ab_alt, ab_alt2, .flashkda); all
# (default): c32 and chain, in that order.
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
[ "$part" = c32 ] || [ "$part" = rows ] && exit 0

step "ab_alt2's split GPU tests"
if bash scripts/use_prebuilt.sh ab_alt2; then
  (cd ab_alt2 && PYTHONPATH=$PWD/src python3 -m pytest -q -m gpu -k split -p no:cacheprovider \
     tests/test_kda_fwd_gpu.py tests/test_kda_bwd_gpu.py 2>&1 | tail -3)
fi
step "ab_probe: this tree, ab_alt, ab_alt2"
bash scripts/ab_probe.sh ab_alt,ab_alt2 long_b1_t32k_h8 bounded_b1
step "the rebuilt chain's sweep (ab_alt)"
bash scripts/use_prebuilt.sh ab_alt && (cd ab_alt && PYTHONPATH=$PWD/src \
  bash scripts/dev/split_sweep.sh "long_b1_t32k_h8:16,32,64 bounded_b1:16,32")
step "our forward's kernels beside FlashKDA's"
python3 scripts/kda_stage_times.py --pass fwd --flashkda bounded_b16 long_b1_t32k bounded_b1
