#!/usr/bin/env bash
# One device call for the gate-fold experiments (docs/notes/2026-12-06-gate-fold.md): where the
# compiled training step parts from the eager one (HEAD's build, gate-fold.patch's in ab_alt,
# gate-fold-v2.patch's in ab_alt2), the patched compile test, then the bench rows A/B and the
# per-kernel A/B. Trees from scripts/ab_prepare.sh; run as gpu_run.sh's probe:
#   KF_PREBUILT=1 KF_FLA_TESTS=0 KF_TESTS=none KF_PROBE='bash scripts/dev/gatefold_call.sh' bash scripts/gpu_run.sh
#   (carry [".whl", ".prebuilt", "ab_alt", "ab_alt2"])
set -u
step() { echo "== $* ($(date +%T))"; }
for t in ab_alt ab_alt2; do bash scripts/use_prebuilt.sh $t | tail -1; done
for t in . ab_alt ab_alt2; do
  step "compile diff, build of $t"
  PYTHONPATH=$PWD/$t/src:$PWD/$t/tests:/tmp/site timeout 150 python3 scripts/dev/compile_diff_gpu.py 2>&1 | grep -v Warning
done
step "the patched compile test, ab_alt2"
(cd ab_alt2 && PYTHONPATH=$PWD/src:/tmp/site timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_kda_bwd_gpu.py -k compile_fullgraph 2>&1 | tail -15)
step "ab_bench"
AB_RUNS=2 bash scripts/dev/ab_bench.sh ab_alt,ab_alt2 --family kda
step "ab_probe bounded_b16"
AB_RUNS=2 timeout 150 bash scripts/ab_probe.sh ab_alt,ab_alt2 bounded_b16
step done
