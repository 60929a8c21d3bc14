#!/usr/bin/env bash
# Make the A/B trees of scripts/ab_probe.sh here and prebuild each (scripts/prebuild.sh, ~8 min per
# tree on a 2-core machine, no GPU), so the device call builds nothing. Each argument is
# NAME=COMMIT[+PATCH...]: a fresh `git archive COMMIT` in ./NAME with the patches applied in order.
#   bash scripts/ab_prepare.sh ab_base=c6a2f47 ab_alt=HEAD+scripts/dev/experiments/NAME.patch
#   AB_NO_BUILD=1 ... : the trees only
#   AB_FAST=1 ...     : for HEAD+PATCH specs, build in THIS tree instead (its build/ is incremental: a
#                       patch to one header rebuilds only what includes it, ~1 min instead of ~8): the
#                       patches are applied here, scripts/prebuild.sh packs the build, the tree gets a
#                       copy of .prebuilt/ (same sources, same hash), and this tree is restored (the
#                       patches reversed) and prebuilt again at the end. Needs no uncommitted changes
#                       to tracked files here.
# Then carry [".whl", ".prebuilt", NAME...] and run scripts/ab_probe.sh NAME,NAME2 CASES (its header).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
for spec in "$@"; do
  name=${spec%%=*}
  rest=${spec#*=}
  IFS=+ read -r -a parts <<< "$rest"
  case "$name" in ab_*) ;; *) echo "ab_prepare: $name: tree names start with ab_ (ignored by git)"; exit 2 ;; esac
  rm -rf "$name" && mkdir "$name"
  git archive "${parts[0]}" | tar -x -C "$name"
  for patch in "${parts[@]:1}"; do
    (cd "$name" && patch -p1 -s < "$here/$patch") || { echo "ab_prepare: $patch does not apply to ${parts[0]}"; exit 1; }
  done
  echo "ab_prepare: $name = ${parts[0]}${parts[1]:+ + ${parts[*]:1}}"
  if [ "${AB_NO_BUILD:-0}" = "1" ]; then
    continue
  elif [ "${AB_FAST:-0}" = "1" ]; then
    [ "$(git rev-parse "${parts[0]}")" = "$(git rev-parse HEAD)" ] \
      || { echo "ab_prepare: AB_FAST builds HEAD+PATCH only, not ${parts[0]}"; exit 2; }
    git diff --quiet HEAD -- \
      || { echo "ab_prepare: AB_FAST needs no uncommitted changes to tracked files here (git status)"; exit 2; }
    # the patches go on here and come off again (in reverse order) whatever the build does: a patch may
    # touch more than csrc/ (tests/emu, say)
    unpatch() { for ((i = ${#parts[@]} - 1; i >= 1; i--)); do patch -p1 -R -s < "$here/${parts[i]}"; done; }
    for patch in "${parts[@]:1}"; do patch -p1 -s < "$here/$patch"; done
    trap unpatch EXIT
    bash scripts/prebuild.sh
    mkdir -p "$name/.prebuilt" && cp .prebuilt/* "$name/.prebuilt/"
    trap - EXIT
    unpatch
    [ "$(cat "$name/.prebuilt/SOURCES")" = "$(bash scripts/source_hash.sh "$PWD/$name")" ] \
      || { echo "ab_prepare: $name's sources differ from the build (untracked files in csrc/?)"; exit 1; }
    fast_built=1
  else
    bash scripts/prebuild.sh "$name"
    rm -rf "$name/build" "$name/src/kernel_fun/"_C*.so  # the carry keeps .prebuilt/ only (64 MiB in all)
  fi
done
if [ "${fast_built:-0}" = "1" ]; then
  bash scripts/prebuild.sh  # this tree's own .prebuilt/ again
fi
