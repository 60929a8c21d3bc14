#!/usr/bin/env bash
# One hash of everything the extension is built from (csrc/, setup.py, the build requirements), for
# scripts/prebuild.sh, scripts/gpu_run.sh and scripts/ab_probe.sh to tell whether a prebuilt extension
# matches a tree.   bash scripts/source_hash.sh [TREE]   (default: this repository)
set -eu
cd "${1:-$(dirname "$0")/..}"
{ find csrc -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' -o -name '*.cpp' \) | LC_ALL=C sort; \
  echo setup.py; echo requirements-build.txt; } | xargs sha256sum | sha256sum | cut -c1-16
