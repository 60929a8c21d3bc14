#!/usr/bin/env bash
# A/B of a launcher knob inside one build: scripts/kda_stage_times.py (fwd+bwd) with the environment
# variable VAR set to each of VALUES in turn, AB_RUNS times (default 2, so that drift shows). For the
# knobs the launchers read at every call (KERNEL_FUN_KDA_BWD_PAIR_SCANS, KERNEL_FUN_KDA_BWD_SLICE, KERNEL_FUN_KDA_BWD_BALANCE,
# KERNEL_FUN_KDA_SCAN_BV): no second build is needed.
#   KF_PROBE='bash scripts/ab_env.sh KERNEL_FUN_KDA_BWD_PAIR_SCANS "0 1" long_b1_t32k bounded_b1' \
#     KF_FLA_TESTS=0 bash scripts/gpu_run.sh
# AB_PASS=fwd times the forward alone (KERNEL_FUN_KDA_FWD_FUSED: the fused forward serves inference
# calls only, where no factors are saved for a backward).
set -u
var=$1
values=$2
shift 2
quiet() { grep -v "UserWarning\|_warn_once"; }
for i in $(seq "${AB_RUNS:-2}"); do
  for v in $values; do
    echo "== $var=$v, run $i"
    env "$var=$v" python3 scripts/kda_stage_times.py --pass "${AB_PASS:-fwd+bwd}" "$@" 2>&1 | quiet
  done
done
