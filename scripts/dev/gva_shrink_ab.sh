#!/usr/bin/env bash
# One device call (forty-fifth session): the GVA chain's smaller workspace (dqhat / dkhat of the
# chain's rows only, this tree = HEAD 87308e7) against the commit before it (ab_base = d213d07), and
# one release per CTA: ab_alt = HEAD + scripts/dev/experiments/gva-chain-one-fence.patch (the chain's
# producer), ab_alt2 = HEAD + one-fence-everywhere.patch (also the streamed forward's publish_chunk
# and the streamed dh scan's publishes). Training calls in one process per build, two rounds, peak
# memory beside. Trees prebuilt here by scripts/ab_prepare.sh; run as KF_PROBE of
# scripts/gpu_run.sh, carry [".whl", ".prebuilt", "ab_base", "ab_alt", "ab_alt2"].
# (gva-chain-one-fence.patch landed in the forty-sixth session and is deleted: git show a7c031e has it.)
set -u
trees="ab_base ab_alt ab_alt2"
for t in $trees; do bash scripts/use_prebuilt.sh $t | tail -1 || exit 1; done
shape="--shape gva_long:B=1,T=32768,H=16,HV=32,K=128,V=128,gate=bounded"
cases="gva small long_b1_t32k prod8192"
run() { PYTHONPATH="$PWD/$1/src:${PYTHONPATH:-}" python3 $1/scripts/kda_stage_times.py --pass fwd+bwd $cases $shape; }
quiet() { grep -v "UserWarning\|_warn_once"; }
for i in 1 2; do
  echo "== this tree, run $i ($(date +%T))"
  python3 scripts/kda_stage_times.py --pass fwd+bwd $cases $shape 2>&1 | quiet
  for t in $trees; do
    echo "== $t, run $i"
    run $t 2>&1 | quiet
  done
done
echo "== done ($(date +%T))"
