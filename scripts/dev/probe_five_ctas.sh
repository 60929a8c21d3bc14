# The 32-token intra at five CTAs per SM (scripts/dev/experiments/intra-c32-five-ctas.patch, built as
# ab_alt2) against HEAD, one process per tree, each twice: per-kernel times (kda_stage_times.py, the
# forward without autograd: the 32-token kernels where the policy takes them) and the forward's
# best-round medians (fwd_chunk_ab.py).
bash scripts/use_prebuilt.sh ab_alt2
S="python3 scripts/kda_stage_times.py --pass fwd --iters 5 bounded_b16 prod8192 varlen gva"
A="python3 scripts/fwd_chunk_ab.py --rounds 2 --iters 10 bounded_b16 prod8192 varlen gva"
for r in 1 2; do
  echo "=== HEAD stages ($r)"; $S
  echo "=== five CTAs stages ($r)"; PYTHONPATH=$PWD/ab_alt2/src:$PYTHONPATH $S
done
echo "=== HEAD forward"; $A
echo "=== five CTAs forward"; PYTHONPATH=$PWD/ab_alt2/src:$PYTHONPATH $A
