#!/usr/bin/env bash
# On the device: put TREE's build made here (scripts/prebuild.sh TREE: TREE/.prebuilt/) in place of
# building TREE, if it was built from TREE's sources (scripts/source_hash.sh) and loads. Exit 0 when
# it is in place, 1 (with the reason, and no extension left behind) when TREE must be built.
#   bash scripts/use_prebuilt.sh [TREE]      (default: this repository; run from its root)
set -u
tree="${1:-.}"
here="$(cd "$(dirname "$0")/.." && pwd)"
pre="$tree/.prebuilt"
if [ ! -f "$pre/_C.abi3.so.xz" ]; then echo "no $pre/_C.abi3.so.xz"; exit 1; fi
if [ "$(cat "$pre/SOURCES" 2>/dev/null)" != "$(bash "$here/scripts/source_hash.sh" "$tree")" ]; then
  echo "$pre was built from other sources"; exit 1
fi
so="$tree/src/kernel_fun/_C.abi3.so"
python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
  "$pre/_C.abi3.so.xz" "$so"
if PYTHONPATH="$(cd "$tree" && pwd)/src" python3 -c \
    "import sys, kernel_fun._ext as e; ok, why = e.status(); print(why); sys.exit(0 if ok else 1)"; then
  echo "using $pre (sources $(cat "$pre/SOURCES"))"; exit 0
fi
rm -f "$so"
echo "$pre does not load here"; exit 1
