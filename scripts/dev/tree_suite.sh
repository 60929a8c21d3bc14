#!/usr/bin/env bash
# The GPU suite of an A/B tree (scripts/ab_prepare.sh: a tree with its own .prebuilt/), with memcheck
# of the two-kernel forward's round beside it, as gpu_run.sh's probe; then, where CASES are named, the
# intra's and the grads kernel's phase cycles of this tree and the A/B tree on them (scripts/kda_phases.py).
#   KF_PREBUILT=1 KF_FLA_TESTS=0 KF_TESTS=none KF_PROBE='bash scripts/dev/tree_suite.sh ab_alt prod8192' \
#     bash scripts/gpu_run.sh                 # carry [".whl", ".prebuilt", "ab_alt"]
# Logs: $OUT/TREE-tests.log (the suite, -n 2, 330 s at most), $OUT/TREE-sanitize.log (memcheck).
set -u
tree=$1; shift
out=${OUT:-/tmp/tree-suite}
mkdir -p "$out"
why=$(bash scripts/use_prebuilt.sh "$tree") || { echo "$why"; exit 1; }
echo "$why" | tail -1
here=$PWD
cd "$tree"
export PYTHONPATH=$PWD/src:/tmp/site
KF_SANITIZE_FUSED=0 KF_SANITIZE_TOOLS=memcheck KF_SANITIZE_TIMEOUT=170 bash scripts/sanitize_kda.sh "$out" \
  > "$out/$tree-sanitize-summary.log" 2>&1 &
san=$!
timeout 330 python3 -m pytest -q -n 2 -m "gpu and not fla" -p no:cacheprovider -rfEs tests > "$out/$tree-tests.log" 2>&1
echo "[$tree tests] $(grep -E "passed|failed|error" "$out/$tree-tests.log" | tail -1)"
grep -E "^(FAILED|ERROR)" "$out/$tree-tests.log" | head -20
wait $san
[ -f "$out/sanitize.log" ] && mv "$out/sanitize.log" "$out/$tree-sanitize.log"
echo "[$tree memcheck] $(cat "$out/$tree-sanitize-summary.log")"
cd "$here"
if [ $# -gt 0 ]; then
  echo "== this tree: phases"; PYTHONPATH=$here/src:/tmp/site python3 scripts/kda_phases.py "$@"
  echo "== $tree: phases"; PYTHONPATH=$PWD/$tree/src:/tmp/site python3 "$tree/scripts/kda_phases.py" "$@"
fi
