#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck and synccheck on the KDA kernels (scripts/sanitize_kda.py),
# with the two-kernel forward and with the fused forward (KERNEL_FUN_KDA_FWD_FUSED=1); only kernels
# whose name contains "kda_" are instrumented (torch's own are not ours to check). The three tools
# run at once, one process each. Prints one summary line per run; the six logs go, one after the
# other, to OUTDIR/sanitize.log (one file: the device call brings back only a few).
#   bash scripts/sanitize_kda.sh [OUTDIR]       (on the GPU machine, after the build; PYTHONPATH set)
#   KF_SANITIZE_FUSED="0"  only the two-kernel forward's round (default "0 1": both rounds)
#   KF_SANITIZE_TOOLS="racecheck"  a subset of the tools (default "memcheck racecheck synccheck")
#   KF_SANITIZE_TIMEOUT=S  stop each tool after S seconds (default 0: no bound), so that the summary
#                          lines and the partial logs still come back: a `timeout` around this script
#                          kills it before it writes either (2026-12-06: the three tools at once took
#                          more than 300 s on an H100)
set -u
out="${1:-${OUT:-/tmp}}"
mkdir -p "$out"  # a fresh subfolder of $OUT (2026-12-07: its log was lost to a missing folder)
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
[ -x "$cs" ] || { echo "sanitize_kda: no compute-sanitizer"; exit 1; }
rc=0
logs=$(mktemp -d)
tools=${KF_SANITIZE_TOOLS:-memcheck racecheck synccheck}
for fused in ${KF_SANITIZE_FUSED:-0 1}; do
  pids=()
  for tool in $tools; do
    extra=()
    [ "$tool" = memcheck ] && extra=(--leak-check full)
    KERNEL_FUN_KDA_FWD_FUSED=$fused timeout "${KF_SANITIZE_TIMEOUT:-0}" "$cs" --tool "$tool" "${extra[@]}" --kernel-name kns=kda_ \
      --error-exitcode 3 python3 scripts/sanitize_kda.py > "$logs/${tool}_fused$fused.log" 2>&1 &
    pids+=($!)
  done
  i=0
  for tool in $tools; do
    r=0; wait "${pids[$i]}" || r=$?
    i=$((i + 1))
    [ $r -ne 0 ] && rc=$r
    echo "[sanitize] $tool fused=$fused rc=$r: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY" "$logs/${tool}_fused$fused.log" | tr '\n' ' ')"
    grep -m3 -E "^=========  (Invalid|Race|Barrier|Error)" "$logs/${tool}_fused$fused.log"
    grep -q "^done" "$logs/${tool}_fused$fused.log" || { echo "  did not finish:"; tail -5 "$logs/${tool}_fused$fused.log"; }
  done
done
for f in "$logs"/*.log; do echo "==== $(basename "$f")"; cat "$f"; done > "$out/sanitize.log"
exit $rc
