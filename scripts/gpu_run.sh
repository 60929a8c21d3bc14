#!/usr/bin/env bash
# One call on the GPU machine: install carried wheels, build the extension, run the GPU tests and
# the benchmark, and leave logs/results in one folder. See docs/gpu-workflow.md.
#
#   bash scripts/gpu_run.sh [OUTDIR]            # OUTDIR defaults to $OUT, then ./gpu-out
# Environment:
#   KF_TESTS     pytest selection passed to -k (default: all GPU tests); "none" skips tests
#   KF_PYTEST    extra pytest args (e.g. "-x tests/test_cconv_gpu.py")
#   KF_BENCH     benchmark args (default: all cases); "none" skips the benchmark
#   KF_NO_BUILD  1 = use a carried src/kernel_fun/_C.abi3.so instead of building here
#   KF_TEST_TIMEOUT  seconds the GPU tests may take (default 300)
set -u
out="${1:-${OUT:-$PWD/gpu-out}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "[gpu_run +$(( $(date +%s) - t0 ))s] $*"; }

{ nvidia-smi; python3 -c "import torch,sys;print(sys.version);print(torch.__version__, torch.version.cuda)"; nvcc --version | tail -1; } > "$out/env.txt" 2>&1

if ls .whl/*.whl >/dev/null 2>&1; then
  stamp "installing carried wheels"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >> "$out/env.txt" 2>&1 || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}

if [ "${KF_NO_BUILD:-0}" != "1" ]; then
  stamp "building the extension"
  rm -f src/kernel_fun/_C*.so
  if ! MAX_JOBS=${MAX_JOBS:-16} python3 setup.py -q build_ext --inplace > "$out/build.log" 2>&1; then
    tail -40 "$out/build.log"; echo "BUILD FAILED"; exit 1
  fi
  grep -E "spill|stack frame|registers" "$out/build.log" | sort | uniq | head -40
fi
python3 -c "import kernel_fun, json; print(json.dumps(kernel_fun.versions()))" | tee -a "$out/env.txt"
stamp "extension ready"

rc=0
if [ "${KF_TESTS:-}" != "none" ]; then
  stamp "GPU tests"
  sel=()
  [ -n "${KF_TESTS:-}" ] && sel=(-k "$KF_TESTS")
  # shellcheck disable=SC2086
  timeout "${KF_TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfE "${sel[@]}" \
    ${KF_PYTEST:-tests} > "$out/tests.log" 2>&1
  rc=$?
  grep -E "passed|failed|error" "$out/tests.log" | tail -3
  grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -30
fi

if [ "${KF_BENCH:-}" != "none" ]; then
  stamp "benchmark"
  # shellcheck disable=SC2086
  python3 -m kernel_fun.bench --out "$out" ${KF_BENCH:-} 2>&1 | tee "$out/bench.log" | tail -60
fi
stamp "done (tests rc=$rc)"
exit $rc
