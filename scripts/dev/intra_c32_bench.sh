#!/usr/bin/env bash
# Builds scripts/dev/intra_c32_bench.cu with setup.py's nvcc flags (sm_90a) and runs it (GPU only):
# the experimental 32-token forward intra beside the 64-token kernel, timed, and checked bitwise where
# the two must agree. ptxas' register and spill lines for both kernels come first.
#   bash scripts/dev/intra_c32_bench.sh [OUT_DIR]
set -eu
cd "$(dirname "$0")/../.."
out=${1:-/tmp}
mapfile -t flags < <(python3 -c '
import importlib.util
spec = importlib.util.spec_from_file_location("kf_setup", "setup.py")
setup = importlib.util.module_from_spec(spec)
spec.loader.exec_module(setup)
print("\n".join(setup.compile_flags(["90a"])[1] + ["-Icsrc"]))')  # no CUTLASS: the kernels do not use it
nvcc "${flags[@]}" -Xptxas -v scripts/dev/intra_c32_bench.cu -o "$out/intra_c32_bench" 2>&1 |
  grep -E "Compiling entry|registers|spill" | grep -B1 -A1 "intra" | grep -v "^--" | sed 's/^ptxas info    : //' || true
"$out/intra_c32_bench"
