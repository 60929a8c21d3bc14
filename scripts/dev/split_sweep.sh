#!/usr/bin/env bash
# The split scans' per-kernel times over piece lengths (the numbers the split model in
# csrc/kda/kda_policy.h is fitted to): for each case and each forced piece length L (and the
# unsplit call), scripts/kda_stage_times.py's per-kernel profiler times and the call's CUDA-event
# median, forward and training call.
#   bash scripts/dev/split_sweep.sh "long_b1_t32k_h8:16,32,64,128 bounded_b1:32,64" [BV ...]
set -u
specs=${1:-"long_b1_t32k_h8:16,32,64,128"}
bvs=${2:-128}
for spec in $specs; do
  case_=${spec%%:*}
  echo "== $case_ unsplit"
  KERNEL_FUN_KDA_SPLIT=0 python3 scripts/kda_stage_times.py --iters 3 "$case_" 2>&1 | grep -v Warning
  for bv in $bvs; do
    for L in $(echo "${spec#*:}" | tr ',' ' '); do
      echo "== $case_ L=$L BV=$bv"
      KERNEL_FUN_KDA_SPLIT=1 KERNEL_FUN_KDA_SPLIT_CHUNKS=$L KERNEL_FUN_KDA_SCAN_BV=$bv \
        python3 scripts/kda_stage_times.py --iters 3 "$case_" 2>&1 | grep -v Warning
    done
  done
done
