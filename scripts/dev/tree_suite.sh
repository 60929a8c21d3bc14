#!/usr/bin/env bash
# The GPU suite of an A/B tree (scripts/ab_prepare.sh: a whole tree with its own .prebuilt/), with
# memcheck of the two-kernel forward's round beside it: the tree's own scripts/gpu_run.sh, run inside
# the tree as the outer call's probe (the outer call's wheels stay on PYTHONPATH; its probe, benchmark
# and background settings do not pass in). Phase cycles of A/B trees: scripts/ab_probe.sh.
#   KF_PREBUILT=1 KF_FLA_TESTS=0 KF_TESTS=none KF_PROBE='bash scripts/dev/tree_suite.sh ab_alt' \
#     bash scripts/gpu_run.sh                 # carry [".whl", ".prebuilt", "ab_alt"]
# Logs (the inner call's: tests.log, sanitize.log, env.txt) under $OUT/TREE/. KF_TREE_SANITIZE_TOOLS: the
# sanitizer's tools (default memcheck; "memcheck racecheck synccheck" for all three, each bounded at 170 s).
# KF_TREE_TEST_TIMEOUT: the tests' bound (default 330 s; beside the three tools 290 s covered 516 of ~566
# tests on an H100, 2026-12-07).
set -u
tree=$1
out=${OUT:-/tmp/tree-suite}/$tree
cd "$tree" || exit 1
env -u KF_PROBE -u KF_BENCH -u KF_BG -u KF_FLASHKDA -u KF_NO_BUILD -u KF_SAVE_TRITON_CACHE \
  KF_PREBUILT=1 KF_TESTS= KF_FLA_TESTS=0 KF_PYTEST='-n 2 tests' KF_TEST_TIMEOUT=${KF_TREE_TEST_TIMEOUT:-330} \
  KF_BG="KF_SANITIZE_FUSED=0 KF_SANITIZE_TOOLS='${KF_TREE_SANITIZE_TOOLS:-memcheck}' KF_SANITIZE_TIMEOUT=170 bash scripts/sanitize_kda.sh $out" \
  bash scripts/gpu_run.sh "$out"
