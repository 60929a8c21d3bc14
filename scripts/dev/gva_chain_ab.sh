#!/usr/bin/env bash
# One device call (forty-fourth session): the GVA chain's compile-time form (ab_alt = HEAD +
# scripts/dev/experiments/gva-chain-ct.patch, prebuilt here by scripts/ab_prepare.sh) against this
# tree, training calls in one process per build, two rounds; the chain switched off inside the alt
# build; then the alt tree's backward GPU tests. Run as KF_PROBE of scripts/gpu_run.sh, carry
# [".whl", ".prebuilt", "ab_alt"].
# (KERNEL_FUN_KDA_GVA_CHAIN is gone since the forty-fifth session: the chain's workspace has no rows
# for the group sum. The script stays as the record of that call.)
set -u
bash scripts/use_prebuilt.sh ab_alt | tail -1 || exit 1
shape="--shape gva_long:B=1,T=32768,H=16,HV=32,K=128,V=128,gate=bounded"
cases="gva prod8192 long_b1_t32k small"
alt() { PYTHONPATH="$PWD/ab_alt/src:${PYTHONPATH:-}" python3 ab_alt/scripts/kda_stage_times.py --pass fwd+bwd "$@"; }
quiet() { grep -v "UserWarning\|_warn_once"; }
for i in 1 2; do
  echo "== this tree, run $i"
  python3 scripts/kda_stage_times.py --pass fwd+bwd $cases $shape 2>&1 | quiet
  echo "== ab_alt, run $i"
  alt $cases $shape 2>&1 | quiet
  echo "== ab_alt, KERNEL_FUN_KDA_GVA_CHAIN=0, run $i"
  KERNEL_FUN_KDA_GVA_CHAIN=0 alt gva $shape 2>&1 | quiet
done
echo "== ab_alt: tests/test_kda_bwd_gpu.py"
(cd ab_alt && PYTHONPATH="$PWD/src:/tmp/site" timeout 300 python3 -m pytest -q -n 2 -p no:cacheprovider tests/test_kda_bwd_gpu.py 2>&1 | tail -15)
