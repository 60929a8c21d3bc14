#!/usr/bin/env bash
# Build the extension HERE (no GPU needed) and pack it for a device call, so the call can skip its
# ~85 s build: writes .prebuilt/_C.abi3.so.xz (~5 MB; the .so is ~33 MB) and .prebuilt/SOURCES, the
# hash of what it was built from. scripts/gpu_run.sh with KF_PREBUILT=1 (carry [".whl", ".prebuilt"])
# unpacks it only if the hash matches the tree it runs in and the extension loads there; otherwise it
# builds as usual (scripts/use_prebuilt.sh decides). The extension is abi3 on torch's stable ABI, so this machine's Python 3.11 build
# serves the device's 3.12 when torch and CUDA are the same versions (2.11.0+cu130, 13.0).
# An A/B tree (ab_alt/, ab_base/: scripts/ab_probe.sh) gets its own .prebuilt/ the same way, which
# ab_probe.sh then unpacks instead of building that tree on the device.
#   bash scripts/prebuild.sh [TREE]     (default: this repository)
set -eu
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "${1:-$here}"
MAX_JOBS=${MAX_JOBS:-2} python setup.py -q build_ext --inplace
# A function of ours declared and called but defined nowhere links fine into a shared object and
# fails only when the device loads it ("Could not load this library"): a whole device call lost
# (2026-12-03). nm sees it here.
if undef=$(nm -C --undefined-only src/kernel_fun/_C.abi3.so | grep "kernel_fun::"); then
  echo "prebuild: the extension uses functions of ours that nothing defines:"; echo "$undef"; exit 1
fi
# and it must load here (this machine has torch's CUDA libraries, no GPU): what the device will do
ext=$(PYTHONPATH="$PWD/src" python -c "import kernel_fun; print(kernel_fun.versions()['extension'])" 2>&1 | tail -1)
case "$ext" in cuda=*) ;; *) echo "prebuild: the extension does not load: $ext"; exit 1 ;; esac
mkdir -p .prebuilt
xz -T0 -6 -c src/kernel_fun/_C.abi3.so > .prebuilt/_C.abi3.so.xz
bash "$here/scripts/source_hash.sh" "$PWD" > .prebuilt/SOURCES
echo "prebuilt $PWD: $(du -h .prebuilt/_C.abi3.so.xz | cut -f1), sources $(cat .prebuilt/SOURCES)"
