# The 32-token scan at BV = 64 with __launch_bounds__(128, 3) (168 registers, 160 / 152 bytes of
# spills: three CTAs per SM instead of two; scripts/dev/experiments/scan-c32-three-ctas.patch, built
# as ab_alt) against this tree: per-kernel times and the forward's best-round medians.
S="python3 scripts/kda_stage_times.py --pass fwd --iters 5 bounded_b16 prod8192 varlen gva small"
A="python3 scripts/fwd_chunk_ab.py --rounds 2 --iters 10 bounded_b16 prod8192 varlen gva small"
q() { grep -v "UserWarning\|_warn_once"; }
bash scripts/use_prebuilt.sh ab_alt | tail -1
for r in 1 2; do
  echo "=== HEAD stages ($r)"; $S 2>&1 | q
  echo "=== three CTAs stages ($r)"; PYTHONPATH=$PWD/ab_alt/src:$PYTHONPATH $S 2>&1 | q
done
echo "=== HEAD forward"; $A 2>&1 | q | tail -6
echo "=== three CTAs forward"; PYTHONPATH=$PWD/ab_alt/src:$PYTHONPATH $A 2>&1 | q | tail -6
echo "=== three CTAs: GPU tests 32_token / short_chunk"
PYTHONPATH=$PWD/ab_alt/src:$PYTHONPATH timeout 120 python3 -m pytest -q -n 2 -m "gpu and not fla" -p no:cacheprovider \
  -k "32_token or short_chunk" tests/test_kda_fwd_gpu.py 2>&1 | tail -2
