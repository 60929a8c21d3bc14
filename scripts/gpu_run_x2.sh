#!/usr/bin/env bash
# One call on the 2-GPU machine (kind nvidia-h200-x2): build once, then two processes side by side,
# one per GPU, so the slow parts (fla's Triton compile and autotune) overlap:
#   GPU 0: our GPU tests, then the benchmark on $KF_BENCH0 (default: the KDA target cases)
#   GPU 1: the fla-parity tests, then the benchmark on $KF_BENCH1 (default: the other KDA cases)
# Each benchmark writes its own JSON (b0.json, b1.json in $OUT); merge them here with
#   python -m kernel_fun.bench --merge bench/results/h200.json b0.json b1.json --out bench/results
# Up to 8 files come back: env.txt, tests.log, tests_fla.log, bench0.log, bench1.log, b0.json, b1.json,
# and the Triton cache in parts with KF_SAVE_TRITON_CACHE=1 (scripts/triton_cache.sh). See docs/gpu-workflow.md.
set -u
out="${1:-${OUT:-$PWD/gpu-out}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 FLA_TILELANG=0 TRITON_CACHE_DIR=$PWD/.triton-cache
t0=$(date +%s)
stamp() { echo "[gpu_run_x2 +$(( $(date +%s) - t0 ))s] $*"; }
why=$(bash scripts/triton_cache.sh restore) && [ -n "$why" ] && stamp "$why"
{ nvidia-smi; python3 -c "import torch;print(torch.__version__, torch.cuda.device_count())"; } > "$out/env.txt" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >> "$out/env.txt" 2>&1 || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/src
stamp "building"
rm -f src/kernel_fun/_C*.so
if ! MAX_JOBS=32 python3 setup.py -q build_ext --inplace > /tmp/build.log 2>&1; then tail -30 /tmp/build.log; exit 1; fi
stamp "built"
B0=${KF_BENCH0:---family kda --case prod8192 --case k3_h32 --case bounded_b16}
B1=${KF_BENCH1:---family kda --case small --case gva --case varlen --case bounded_b1 --case long_b1_t32k}
tests="${KF_PYTEST:-tests}"
(
  export CUDA_VISIBLE_DEVICES=0
  timeout "${KF_TEST_TIMEOUT:-240}" python3 -m pytest -q -m "gpu and not fla" -p no:cacheprovider -rfE $tests \
    > "$out/tests.log" 2>&1
  # shellcheck disable=SC2086
  timeout "${KF_BENCH_TIMEOUT:-480}" python3 -m kernel_fun.bench --out /tmp/b0 $B0 > "$out/bench0.log" 2>&1
  cp /tmp/b0/h200.json "$out/b0.json" 2>/dev/null
) &
(
  export CUDA_VISIBLE_DEVICES=1
  timeout "${KF_FLA_TEST_TIMEOUT:-240}" python3 -m pytest -q -s -m "gpu and fla" -p no:cacheprovider -rfE \
    ${KF_FLA_PYTEST:-tests/test_kda_bwd_gpu.py tests/test_kda_fwd_gpu.py} > "$out/tests_fla.log" 2>&1
  # shellcheck disable=SC2086
  timeout "${KF_BENCH_TIMEOUT:-480}" python3 -m kernel_fun.bench --out /tmp/b1 $B1 > "$out/bench1.log" 2>&1
  cp /tmp/b1/h200.json "$out/b1.json" 2>/dev/null
) &
wait
stamp "done"
echo "[tests] $(grep -E "passed|failed" "$out/tests.log" | tail -1)"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head
echo "[fla tests] $(grep -E "passed|failed" "$out/tests_fla.log" | tail -1)"; grep -E "^(FAILED|ERROR)|rel-RMS \(ours" "$out/tests_fla.log" | head -12
for f in bench0 bench1; do echo "== $f"; grep -vE "^\s*$|Warning|warn" "$out/$f.log" | tail -16; done
if [ "${KF_SAVE_TRITON_CACHE:-0}" = "1" ]; then stamp "$(bash scripts/triton_cache.sh save "$out")"; fi
