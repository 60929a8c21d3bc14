# The intra's P3 shared by every warp and the 32-token merge split by columns
# (scripts/dev/experiments/intra-p3-balance.patch, built as ab_alt) against this tree: the training
# call's stage times and kda_fwd_intra's phase cycles (ab_probe.sh: the 64-token intra), the
# forward's per-kernel times (the 32-token intra) and its best-round medians (fwd_chunk_ab.py), then
# the patched tree's forward GPU tests.
AB_RUNS=2 bash scripts/ab_probe.sh ab_alt prod8192 bounded_b16 long_b1_t32k
S="python3 scripts/kda_stage_times.py --pass fwd --iters 5 bounded_b16 prod8192 varlen gva"
A="python3 scripts/fwd_chunk_ab.py --rounds 2 --iters 10 bounded_b16 prod8192 varlen gva long_b1_t32k"
q() { grep -v "UserWarning\|_warn_once"; }
for r in 1 2; do
  echo "=== HEAD fwd stages ($r)"; $S 2>&1 | q
  echo "=== balanced fwd stages ($r)"; PYTHONPATH=$PWD/ab_alt/src:$PYTHONPATH $S 2>&1 | q
done
echo "=== HEAD forward"; $A 2>&1 | q
echo "=== balanced forward"; PYTHONPATH=$PWD/ab_alt/src:$PYTHONPATH $A 2>&1 | q
echo "=== balanced: GPU tests of the forward"
PYTHONPATH=$PWD/ab_alt/src:$PYTHONPATH python3 -c "import kernel_fun; print(kernel_fun.__file__)"
PYTHONPATH=$PWD/ab_alt/src:$PYTHONPATH timeout 240 python3 -m pytest -q -n 2 -m "gpu and not fla" -p no:cacheprovider \
  tests/test_kda_fwd_gpu.py 2>&1 | tail -4
