#!/usr/bin/env bash
# Build FlashKDA here (no GPU needed: nvcc and torch's headers) for the device's Python (3.12) and
# torch (2.11.0+cu130), so that a device call carrying .flashkda/ only imports it (KF_FLASHKDA=1 in
# scripts/gpu_run.sh uses a carried build that imports and builds only when none does). ~2 min here
# on 2 cores, against minutes of device time.
#   bash scripts/prebuild_flashkda.sh    # then carry [".whl", ".prebuilt", ".flashkda"]
# Steps: .flashkda/ from the FlashKDA mirror at 1ce47ea (scripts/build_flashkda.sh's header: fetch
# github:MoonshotAI/FlashKDA first); a Python 3.12 venv in $KF_PY312_VENV (default /work/venv312) with
# torch 2.11.0 without its CUDA wheels (their libraries come from this machine's venv with the full
# torch, $KF_TORCH_VENV, default /work/venv: the same torch build) and the nvidia-cutlass wheel;
# scripts/build_flashkda.sh; then the build folder and the cutlass link are removed (the carry holds
# the sources and the 15 MB extension only).
set -eu
cd "$(dirname "$0")/.."
venv=${KF_PY312_VENV:-/work/venv312}
torch_venv=${KF_TORCH_VENV:-/work/venv}
mirror=${KF_FLASHKDA_MIRROR:-/work/.mirror/MoonshotAI+FlashKDA/repo}
py312=$(command -v python3.12) || { echo "prebuild_flashkda: no python3.12 here"; exit 1; }
if [ ! -f .flashkda/setup.py ]; then
  [ -d "$mirror" ] || { echo "prebuild_flashkda: no FlashKDA mirror at $mirror"; exit 1; }
  mkdir -p .flashkda && git -C "$mirror" archive 1ce47ea | tar -x -C .flashkda
fi
if [ ! -x "$venv/bin/python" ]; then
  "$py312" -m venv "$venv"
  "$venv/bin/pip" install -q --no-deps torch==2.11.0
  "$venv/bin/pip" install -q nvidia-cutlass==4.2.0.0 "setuptools<82" ninja numpy typing_extensions sympy \
    filelock jinja2 networkx fsspec
fi
LD_LIBRARY_PATH=$(ls -d "$torch_venv"/lib/python3.*/site-packages/nvidia/*/lib | tr '\n' ':')${LD_LIBRARY_PATH:-}
export LD_LIBRARY_PATH
PATH="$venv/bin:$PATH" MAX_JOBS=${MAX_JOBS:-2} NVCC_THREADS=${NVCC_THREADS:-2} bash scripts/build_flashkda.sh .flashkda
rm -rf .flashkda/build .flashkda/cutlass
ls -la .flashkda/flash_kda_C.*.so
