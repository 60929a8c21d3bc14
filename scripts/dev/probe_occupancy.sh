# The 32-token intra's time against its occupancy (scripts/dev/experiments/intra-c32-occupancy.patch,
# built as ab_alt): 4 CTAs per SM (HEAD's), 3 and 2 (unused dynamic shared memory per CTA).
bash scripts/use_prebuilt.sh ab_alt
for pad in 0 9400 28800 0; do
  echo "=== KF_DEV_INTRA_C32_SMEM_PAD=$pad"
  KF_DEV_INTRA_C32_SMEM_PAD=$pad PYTHONPATH=$PWD/ab_alt/src:$PYTHONPATH \
    python3 scripts/kda_stage_times.py --pass fwd --iters 5 bounded_b16 prod8192 varlen
done
