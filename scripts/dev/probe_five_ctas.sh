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
# the patch's own GPU tests (its kernels: ab_alt2 first on the path), the 32-token ones
echo "=== five CTAs: GPU tests 32_token / short_chunk / stream"
PYTHONPATH=$PWD/ab_alt2/src:$PYTHONPATH python3 -c "import kernel_fun, sys; print(kernel_fun.__file__)"
PYTHONPATH=$PWD/ab_alt2/src:$PYTHONPATH timeout 200 python3 -m pytest -q -m "gpu and not fla" -p no:cacheprovider \
  -k "32_token or short_chunk or stream" tests/test_kda_fwd_gpu.py 2>&1 | tail -5
