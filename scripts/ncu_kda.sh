#!/usr/bin/env bash
# Nsight Compute of one launch of each named KDA kernel on one benchmark case, with the
# per-instruction stall samples exported as text (only files under $OUT come back from the device).
#   bash scripts/ncu_kda.sh CASE KERNEL...     e.g. bash scripts/ncu_kda.sh bounded_b16 kda_bwd_grads kda_fwd_intra
# Writes $OUT/ncu_<kernel>_details.txt and $OUT/ncu_<kernel>_sass.csv.gz (two files per kernel: a
# device call returns at most 8). See docs/gpu-workflow.md.
#   KF_NCU_PASS=fwd   the forward without autograd (its 32-token kernels, kda_fwd_intra_c32 /
#                     kda_fwd_scan_c32, where the policy takes them); default fwd+bwd (a training call)
set -u
case_name=$1; shift
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
for kern in "$@"; do
  # ComputeWorkloadAnalysis: the pipes' utilisation (XU = the SFU's exp2 / lg2 / conversions, against
  # FMA, ALU and the tensor pipe); InstructionStats: the executed instruction mix.
  ncu --clock-control none -k "regex:$kern" -c 1 --section WarpStateStats --section SourceCounters \
      --section SpeedOfLight --section Occupancy --section ComputeWorkloadAnalysis --section InstructionStats \
      -o "/tmp/ncu_$kern" -f \
      python3 scripts/kda_stage_times.py --iters 1 --pass "${KF_NCU_PASS:-fwd+bwd}" "$case_name" > "/tmp/ncu_${kern}_run.log" 2>&1 || tail -5 "/tmp/ncu_${kern}_run.log"
  ncu --import "/tmp/ncu_$kern.ncu-rep" --page details > "$out/ncu_${kern}_details.txt" 2>&1
  ncu --import "/tmp/ncu_$kern.ncu-rep" --page source --csv --print-source sass | gzip > "$out/ncu_${kern}_sass.csv.gz"
  echo "[ncu] $kern: $(grep -m1 -E 'Duration' "$out/ncu_${kern}_details.txt")"
done
