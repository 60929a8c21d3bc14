#!/usr/bin/env bash
# SASS instructions, registers and spills per kernel of some instantiation files, compiled here (no
# GPU) with setup.py's flags (compile_flags) for sm_90a. kda_fwd_intra and kda_bwd_grads are
# instruction-fetch bound: on the H200 +744 instructions in the intra's P2 were worth it, +1700 made
# the whole kernel 12% slower, and +850 in the grads kernel's V loop cost 8.5% in every chunk
# (docs/notes/2026-12-02-fused-forward-groundwork.md, seventh session). Check a hot-kernel change
# here before timing it.
#   bash scripts/sass_size.sh [FILE.cu ...]   (default: the bf16 K=128 intra and grads kernels)
#   SASS_OUT=DIR keeps each file's SASS as DIR/NAME.sass (scripts/dev/sass_phases.py reads it)
set -eu
cd "$(dirname "$0")/.."
files=("$@")
[ ${#files[@]} -eq 0 ] && files=(csrc/kda/fwd/instantiations/kda_fwd_intra_bf16_k128.cu
                                 csrc/kda/bwd/instantiations/kda_bwd_grads_bf16_k128.cu)
# setup.py's own nvcc flags (compile_flags) and CUTLASS include: the SASS the build makes
mapfile -t flags < <(python3 -c '
import importlib.util
spec = importlib.util.spec_from_file_location("kf_setup", "setup.py")
setup = importlib.util.module_from_spec(spec)
spec.loader.exec_module(setup)
print("\n".join(setup.compile_flags(["90a"])[1] + ["-Icsrc", "-I" + setup._cutlass_include()]))')
cuobjdump=$(command -v cuobjdump || python3 -c \
  "import triton, os; print(os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin', 'cuobjdump'))")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for f in "${files[@]}"; do
  cubin="$tmp/$(basename "$f" .cu).cubin"
  nvcc "${flags[@]}" -Xptxas -v -cubin "$f" -o "$cubin" 2> "$tmp/ptxas.txt"
  # ptxas prints "Compiling entry function 'NAME'", then its stack / spill line, then "Used N registers"
  awk '/Compiling entry function/{match($0, /'"'"'[^'"'"']+'"'"'/); fn=substr($0, RSTART+1, RLENGTH-2)}
       /spill stores/{sp[fn]=$5 "/" $9} /Used [0-9]+ registers/{for(i=1;i<=NF;i++) if($i=="Used") rg[fn]=$(i+1)}
       END{for(k in rg) print k, rg[k], sp[k]}' "$tmp/ptxas.txt" > "$tmp/regs.txt"
  "$cuobjdump" -sass "$cubin" > "$tmp/sass.txt" 2>/dev/null
  [ -n "${SASS_OUT:-}" ] && mkdir -p "$SASS_OUT" && cp "$tmp/sass.txt" "$SASS_OUT/$(basename "$f" .cu).sass"
  awk '/Function :/{fn=$3} /^[[:space:]]+\/\*[0-9a-f][0-9a-f][0-9a-f][0-9a-f]+\*\/ /{n[fn]++} END{for(k in n) print k, n[k]}' "$tmp/sass.txt" |
    sort > "$tmp/count.txt"
  echo "== $f"
  join <(sort "$tmp/count.txt") <(sort "$tmp/regs.txt") |
    awk '{printf "  %6d instructions  %3d registers  spills st/ld %-7s %s\n", $2, $3, $4, $1}'
done
