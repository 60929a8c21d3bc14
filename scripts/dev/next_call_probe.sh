#!/usr/bin/env bash
# The thirty-seventh session's device probe (written before a device was lent; its steps then ran as
# calls 2-6 of that session: docs/notes/2026-12-05-chunk-size-and-equal-documents.md), as one file so
# that a call's command line stays short. Each step goes on if one before it fails; results
# land in $OUT (the device's output folder). gpu_run.sh runs it on the quiet GPU after the build and
# before the GPU tests (KF_PYTEST).
# The GPU suite alone takes ~300 s of a call's 600, so the suite and the probe go in separate calls:
#   KF_PREBUILT=1 KF_FLA_TESTS=0 KF_PYTEST="-n 2 tests" bash scripts/gpu_run.sh               # call 1
#   KF_PREBUILT=1 KF_FLA_TESTS=0 KF_TESTS=none KF_PROBE='bash scripts/dev/next_call_probe.sh ab' \
#     bash scripts/gpu_run.sh                                                                  # call 2
#   ... KF_PROBE='bash scripts/dev/next_call_probe.sh rows' ...                                # call 3
# ab: same-process A/Bs of three launch switches (no build); rows: the two new bench cases, ours and
# fla's (fla compiles its kernels for each new shape: minutes); all (default): both.
set -u
out=${OUT:-/tmp/next-call}
part=${1:-all}
mkdir -p "$out"
step() { echo "== $* ($(date +%T))"; }

if [ "$part" = ab ] || [ "$part" = all ]; then
step "one 32k-token document in cu_seqlens: the varlen path (0) against the fixed-length batch (1)"
AB_RUNS=2 bash scripts/ab_env.sh KERNEL_FUN_KDA_VARLEN_AS_BATCH "0 1" long_b1_t32k_doc
step "24576 + 8192 tokens at 8 heads: unsplit (0) against the model's split from the longest document (2)"
AB_RUNS=2 bash scripts/ab_env.sh KERNEL_FUN_KDA_SPLIT "0 2" long_docs_h8
step "the streamed backward's dh scan at BV 64 against 128 (the forward streamed as in production)"
KERNEL_FUN_KDA_FWD_STREAMED=2 AB_RUNS=2 bash scripts/ab_env.sh KERNEL_FUN_KDA_SCAN_BV "64 128" long_b1_t32k \
  long_b1_t128k
fi
if [ "$part" = rows ] || [ "$part" = all ]; then
step "bench rows with fla: long_b1_t32k_doc, long_docs_h8 (and long_b1_t32k beside them)"
for c in long_b1_t32k long_b1_t32k_doc long_docs_h8; do
  python3 -m kernel_fun.bench --family kda --case "$c" --no-flashkda --out "$out/rows/$c" > /dev/null 2>&1
  grep "^| $c |" "$out/rows/$c"/*.md
done
fi
