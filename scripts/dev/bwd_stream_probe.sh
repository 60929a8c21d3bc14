#!/usr/bin/env bash
# The streamed backward (kda_policy.h's bwd_stream_wanted) against the two forms before it, in one device
# call, on the few-chain cases: per-kernel times (profiler; the launches then run one after another) and
# the training call's event-timed total, each form in its own process, AB_RUNS rounds alternating.
#   saved+streamed : the defaults (the forward saves its states, kda_bwd_grads beside the dh scan)
#   saved          : KERNEL_FUN_KDA_BWD_STREAMED=0 (the states saved, the two kernels one after the other)
#   paired         : KERNEL_FUN_KDA_SAVE_STATES=0 (the form before: the re-scan paired with the dh scan)
# The forward streams where its model says (KERNEL_FUN_KDA_FWD_STREAMED=2), as in production.
#   KF_PROBE='bash scripts/dev/bwd_stream_probe.sh long_b1_t32k bounded_b1' bash scripts/gpu_run.sh
set -u
quiet() { grep -v "UserWarning\|_warn_once"; }
export KERNEL_FUN_KDA_FWD_STREAMED=2
for i in $(seq "${AB_RUNS:-2}"); do
  echo "== saved+streamed, run $i"
  python3 scripts/kda_stage_times.py --pass fwd+bwd "$@" 2>&1 | quiet
  echo "== saved, run $i"
  KERNEL_FUN_KDA_BWD_STREAMED=0 python3 scripts/kda_stage_times.py --pass fwd+bwd "$@" 2>&1 | quiet
  echo "== paired, run $i"
  KERNEL_FUN_KDA_SAVE_STATES=0 python3 scripts/kda_stage_times.py --pass fwd+bwd "$@" 2>&1 | quiet
done
if [ -n "${CP_RANKS:-}" ]; then
  echo "== cp ranks (saved+streamed)"
  python3 scripts/cp_rank_times.py --case long_b1_t128k --world 2 2>&1 | quiet
  echo "== cp ranks (paired)"
  KERNEL_FUN_KDA_SAVE_STATES=0 python3 scripts/cp_rank_times.py --case long_b1_t128k --world 2 2>&1 | quiet
fi
