#!/usr/bin/env bash
# A/B of the benchmark's own rows (CUDA events, median of 20: the numbers the issues' targets use)
# between this tree's build and other prebuilt trees, inside one device call, the builds taking turns
# (each round in the reverse order of the one before), so that drift shows in every pair. Ours only
# (no fla, no FlashKDA).
# ALTS: one folder, or several joined by commas; each made by scripts/ab_prepare.sh (a tree with its
# own .prebuilt/ of its sources). The rest of the arguments go to `python3 -m kernel_fun.bench`.
#   AB_RUNS=2 bash scripts/dev/ab_bench.sh ab_base --family kda --case bounded_b16 --case prod8192
# Carry [".whl", ".prebuilt", ALT...]; gpu_run.sh runs it as the probe (KF_PREBUILT=1 KF_PROBE='...').
# Output: one table per build and round ("== NAME, run i" then the bench's rows:
# case, pass, ms and peak), and the .md / .json of each under $OUT/ab_bench/NAME-i/.
set -u
IFS=, read -r -a alts <<< "$1"
shift
runs=${AB_RUNS:-2}
out=${OUT:-/tmp/ab_bench}/ab_bench
for alt in "${alts[@]}"; do
  why=$(bash scripts/use_prebuilt.sh "$alt" 2>&1) || { echo "ab_bench: $alt has no usable prebuilt: $why"; exit 1; }
  echo "ab_bench: $alt: $(echo "$why" | tail -1)"
done
row() {  # NAME SRC-DIR ROUND [bench args]
  local dir="$out/$1-$3"
  PYTHONPATH="$2:${PYTHONPATH:-}" python3 -m kernel_fun.bench --no-fla --no-flashkda --out "$dir" "${@:4}" \
    > "$dir.log" 2>&1 || { echo "ab_bench: $1 run $3 failed"; tail -5 "$dir.log"; }
  echo "== $1, run $3"
  # the rows' case, pass, our ms and peak GiB (columns 1, 2, 3 and 14 of the results table)
  cat "$dir"/*.md 2>/dev/null | awk -F'|' 'NF >= 16 && $2 !~ /case|---/ {print $2 "|" $3 "|" $4 "|" $15}'
}
mkdir -p "$out"
# even rounds in the reverse order, so that a drift within a round (clocks, temperature) does not
# always favour the same build
for i in $(seq "$runs"); do
  if [ $((i % 2)) = 1 ]; then
    row this "$PWD/src" "$i" "$@"
    for alt in "${alts[@]}"; do row "$alt" "$PWD/$alt/src" "$i" "$@"; done
  else
    for ((a = ${#alts[@]} - 1; a >= 0; a--)); do row "${alts[a]}" "$PWD/${alts[a]}/src" "$i" "$@"; done
    row this "$PWD/src" "$i" "$@"
  fi
done
