#!/usr/bin/env bash
# fla's Triton cache (compiled kernels and autotune results, fla's FLA_CACHE_RESULTS being on by
# default) between device calls; gpu_run.sh and gpu_run_x2.sh point TRITON_CACHE_DIR at .triton-cache/.
#   bash scripts/triton_cache.sh save OUTDIR   # .triton-cache/ -> OUTDIR/triton-cache.tar.xz.part00, 01, ...
#   bash scripts/triton_cache.sh restore       # .triton-carry/triton-cache.tar.xz.part* -> .triton-cache/
# The parts are 15 MiB each (a returned file may be 16 MiB). To carry them into the next call:
#   mkdir -p .triton-carry && cp FILES_AT/triton-cache.tar.xz.part* .triton-carry/   # carry ".triton-carry"
# A carry is 64 MiB in all (with .whl and .prebuilt): save the cache of a call that compiled what later
# calls need (the bench cases), not every parity test's shapes (2026-12-03: 124 MB as .tgz).
set -u
case "${1:-}" in
  save)
    [ -d .triton-cache ] || exit 0
    tar -c .triton-cache | xz -T0 -6 | split -d -b 15M - "$2/triton-cache.tar.xz.part" || exit 1
    echo "triton cache: $(cat "$2"/triton-cache.tar.xz.part* | wc -c | awk '{printf "%.1f MiB", $1 / 1048576}')" \
         "in $(ls "$2"/triton-cache.tar.xz.part* | wc -l) part(s)"
    ;;
  restore)
    ls .triton-carry/triton-cache.tar.xz.part* > /dev/null 2>&1 || exit 0
    if cat .triton-carry/triton-cache.tar.xz.part* | xz -d | tar -x; then
      echo "triton cache from .triton-carry: $(du -sh .triton-cache | cut -f1)"
    else
      echo "triton cache from .triton-carry did not unpack: going on without it"
    fi
    ;;
  *) echo "usage: $0 save OUTDIR | restore"; exit 2 ;;
esac
