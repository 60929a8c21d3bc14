#!/usr/bin/env bash
# A/B of this tree's build against other commits', inside one device call: each other commit's
# tree is built beside this one, then every build's per-kernel stage times are printed in turn
# (AB_RUNS rounds, default 2, so that drift shows) and kda_fwd_intra's / kda_bwd_grads' phase cycles
# of each (scripts/kda_phases.py).
# ALTS: one folder, or several joined by commas (ab_alt,ab_base).
# Machines differ by ~5% (docs/notes/gpu-sessions.md): compare builds within one call only.
#
# Here (the alt trees are ignored by git and carried explicitly), made and prebuilt in one command:
#   bash scripts/ab_prepare.sh ab_base=c6a2f47 ab_alt=HEAD+scripts/dev/experiments/NAME.patch
# The device call (carry [".whl", "ab_alt"]; ~3.5 min with the build, the probes and our tests):
#   KF_PROBE='bash scripts/ab_probe.sh ab_alt prod8192 bounded_b16' KF_FLA_TESTS=0 bash scripts/gpu_run.sh
set -u
IFS=, read -r -a alts <<< "$1"
shift
runs=${AB_RUNS:-2}
for alt in "${alts[@]}"; do
  # a build made here (scripts/prebuild.sh ALT) when it matches the alt tree's sources and loads
  if why=$(bash scripts/use_prebuilt.sh "$alt" 2>&1); then
    echo "ab_probe: $alt: $(echo "$why" | tail -1)"
    continue
  fi
  if ! (cd "$alt" && MAX_JOBS=${MAX_JOBS:-16} python3 setup.py -q build_ext --inplace > "/tmp/ab_build_$alt.log" 2>&1); then
    tail -20 "/tmp/ab_build_$alt.log"
    echo "ab_probe: the build of $alt failed"
    exit 1
  fi
done
quiet() { grep -v "UserWarning\|_warn_once"; }
for i in $(seq "$runs"); do
  echo "== this tree, run $i"
  python3 scripts/kda_stage_times.py --pass fwd+bwd "$@" 2>&1 | quiet
  for alt in "${alts[@]}"; do
    echo "== $alt, run $i"
    PYTHONPATH="$PWD/$alt/src:${PYTHONPATH:-}" python3 "$alt/scripts/kda_stage_times.py" --pass fwd+bwd "$@" 2>&1 | quiet
  done
done
echo "== this tree: kda_fwd_intra and kda_bwd_grads phases"
python3 scripts/kda_phases.py "$@"
for alt in "${alts[@]}"; do
  # trees before 2026-12-02 afternoon have only the grads stamps (scripts/kda_bwd_phases.py)
  if [ -f "$alt/scripts/kda_phases.py" ]; then phases="$alt/scripts/kda_phases.py"; else phases="$alt/scripts/kda_bwd_phases.py"; fi
  echo "== $alt: phases ($phases)"
  PYTHONPATH="$PWD/$alt/src:${PYTHONPATH:-}" python3 "$phases" "$@"
done
