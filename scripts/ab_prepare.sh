#!/usr/bin/env bash
# Make the A/B trees of scripts/ab_probe.sh here and prebuild each (scripts/prebuild.sh, ~8 min per
# tree on a 2-core machine, no GPU), so the device call builds nothing. Each argument is
# NAME=COMMIT[+PATCH...]: a fresh `git archive COMMIT` in ./NAME with the patches applied in order.
#   bash scripts/ab_prepare.sh ab_base=c6a2f47 ab_alt=HEAD+scripts/dev/experiments/NAME.patch
#   AB_NO_BUILD=1 ... : the trees only
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
  if [ "${AB_NO_BUILD:-0}" != "1" ]; then
    bash scripts/prebuild.sh "$name"
    rm -rf "$name/build" "$name/src/kernel_fun/"_C*.so  # the carry keeps .prebuilt/ only (64 MiB in all)
  fi
done
