#!/usr/bin/env bash
# A/B of this tree's build against another commit's, inside one device call: the other commit's
# tree is built beside this one, then both builds' per-kernel stage times are printed alternately
# (AB_RUNS times, default 2, so that drift shows) and kda_bwd_grads' phase cycles of each.
# Machines differ by ~5% (docs/notes/gpu-sessions.md): compare builds within one call only.
#
# Here (the alt tree is ignored by git and carried explicitly):
#   rm -rf ab_alt && mkdir ab_alt && git archive main | tar -x -C ab_alt
# The device call (carry [".whl", "ab_alt"]; ~3.5 min with the build, the probes and our tests):
#   KF_PROBE='bash scripts/ab_probe.sh ab_alt prod8192 bounded_b16' KF_FLA_TESTS=0 bash scripts/gpu_run.sh
set -u
alt=$1
shift
runs=${AB_RUNS:-2}
if ! (cd "$alt" && MAX_JOBS=${MAX_JOBS:-16} python3 setup.py -q build_ext --inplace > /tmp/ab_alt_build.log 2>&1); then
  tail -20 /tmp/ab_alt_build.log
  echo "ab_probe: the build of $alt failed"
  exit 1
fi
alt_path="$PWD/$alt/src:${PYTHONPATH:-}"
quiet() { grep -v "UserWarning\|_warn_once"; }
for i in $(seq "$runs"); do
  echo "== this tree, run $i"
  python3 scripts/kda_stage_times.py --pass fwd+bwd "$@" 2>&1 | quiet
  echo "== $alt, run $i"
  PYTHONPATH=$alt_path python3 "$alt/scripts/kda_stage_times.py" --pass fwd+bwd "$@" 2>&1 | quiet
done
echo "== this tree: kda_bwd_grads phases"
python3 scripts/kda_bwd_phases.py "$@"
echo "== $alt: kda_bwd_grads phases"
PYTHONPATH=$alt_path python3 "$alt/scripts/kda_bwd_phases.py" "$@"
