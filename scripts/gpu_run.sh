#!/usr/bin/env bash
# One call on the GPU machine: install carried wheels, build the extension, run the GPU tests and
# the benchmark, and leave logs/results in one folder. See docs/gpu-workflow.md.
#
#   bash scripts/gpu_run.sh [OUTDIR]            # OUTDIR defaults to $OUT, then ./gpu-out
# Environment:
#   KF_TESTS     pytest selection passed to -k (default: all GPU tests); "none" skips tests
#   KF_PYTEST    extra pytest args (e.g. "-x tests/test_cconv_gpu.py"); "-n 3 tests" runs our GPU tests in 3
#                pytest-xdist workers (carried wheel): 209 s on an H100 on 2026-12-05, where one test ran out
#                of its 80 GB beside the other workers (the fp64 reference of B2 T16384): use -n 2 there
#   KF_BENCH     benchmark args, or "all" for every case (default: none, no benchmark: a whole benchmark
#                with fla does not fit one call on a fresh machine; name the cases and a --budget-s)
#   KF_NO_BUILD  1 = use a carried src/kernel_fun/_C.abi3.so instead of building here
#   KF_PREBUILT  1 = use the extension scripts/prebuild.sh packed into .prebuilt/ (carry it), if it was
#                built from this tree's sources (scripts/source_hash.sh) and loads here; else build
#   KF_TEST_TIMEOUT  seconds our GPU tests may take (default 540: the suite took ~320 s early on 2026-12-05,
#                    and was cut at 95% after 400 s on a fresh H100 later that day)
#   KF_OURS_TESTS    0 = skip our own GPU tests (a call for the fla-parity tests alone)
#   KF_FLA_TESTS     0 = skip the fla-parity GPU tests (slow on a fresh machine: fla's Triton
#                    compile); KF_FLA_TEST_TIMEOUT bounds them (default 300)
#   KF_FLA06     1 = also run the fla-parity tests against fla-core 0.6.0 (wheel in .whl/fla06/,
#                installed to /tmp/site06 ahead of 0.5.2), in parallel with the 0.5.2 run
#   KF_XDIST     N = run the fla-parity tests in N pytest-xdist workers (carried wheel): fla's
#                Triton compile is single-threaded CPU work, so N processes compile N tests at once
#   KF_PROBE     a shell command run on the quiet GPU after the build, before the tests (stage
#                timings, ncu); its output goes to probe.log
#   KF_BG        a shell command started in the background after the probe, beside the tests and the
#                benchmark (e.g. bench.accuracy's fla rows: minutes of fla's CPU-bound compile); its
#                output goes to bg.log, and the call waits for it (by PID) before it packs $OUT, so
#                bound it yourself (`timeout S ...`). Its CPU load slows the tests beside it.
#   KF_FLASHKDA  1 = also time FlashKDA (MoonshotAI/FlashKDA at 1ce47ea, forward only): a build carried
#                in .flashkda/ (scripts/prebuild_flashkda.sh, here) if it imports, else build it from the
#                source tree carried there (carry [".whl", ".flashkda"]; scripts/build_flashkda.sh's header)
#                after our extension, log appended to build.log (the 8 files that come back),
#                and put it on PYTHONPATH, so the benchmark times it too (its "flashkda" rows:
#                docs/benchmark.md). A failed build is reported and the run goes on without it.
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
if [ "${KF_FLA06:-0}" = "1" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site06 .whl/fla06/*.whl >> "$out/env.txt" 2>&1 || { echo "fla 0.6.0 wheel install failed"; exit 1; }
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
# fla's Triton kernels compile into .triton-cache/ in the tree; KF_SAVE_TRITON_CACHE=1 brings it
# back in parts, and a carried .triton-carry/ is unpacked here first (scripts/triton_cache.sh).
export TRITON_CACHE_DIR=$PWD/.triton-cache
why=$(bash scripts/triton_cache.sh restore) && [ -n "$why" ] && stamp "$why"
export FLA_TILELANG=0  # fla 0.5.2's Triton backward, not its optional TileLang one (docs/benchmark.md)
export FLA_FLASH_KDA=0  # fla stays on its own forward when flash_kda is importable (KF_FLASHKDA)

if [ "${KF_PREBUILT:-0}" = "1" ] && [ "${KF_NO_BUILD:-0}" != "1" ]; then
  if why=$(bash scripts/use_prebuilt.sh 2>&1); then
    stamp "$(echo "$why" | tail -1)"
    KF_NO_BUILD=1
  else
    stamp "KF_PREBUILT=1, building: $(echo "$why" | tail -1)"
  fi
  echo "$why" >> "$out/env.txt"
fi
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

if [ "${KF_FLASHKDA:-0}" = "1" ]; then
  if [ -f .flashkda/setup.py ] && PYTHONPATH=$PWD/.flashkda:$PYTHONPATH python3 -c "import flash_kda; flash_kda.fwd" 2> /dev/null; then
    export PYTHONPATH=$PWD/.flashkda:$PYTHONPATH  # built before the call (scripts/prebuild_flashkda.sh)
    stamp "FlashKDA: the carried build imports, on PYTHONPATH"
  elif [ -f .flashkda/setup.py ]; then
    stamp "building FlashKDA (.flashkda/, log appended to build.log)"
    echo "==== FlashKDA (scripts/build_flashkda.sh)" >> "$out/build.log"
    if bash scripts/build_flashkda.sh .flashkda >> "$out/build.log" 2>&1; then
      export PYTHONPATH=$PWD/.flashkda:$PYTHONPATH
      stamp "FlashKDA built, on PYTHONPATH"
    else
      tail -20 "$out/build.log"
      stamp "FlashKDA build FAILED (build.log): going on without it"
    fi
  else
    stamp "KF_FLASHKDA=1 but no .flashkda/setup.py (carry .flashkda): going on without FlashKDA"
  fi
fi

if [ -n "${KF_PROBE:-}" ]; then
  stamp "probe"
  bash -c "$KF_PROBE" > "$out/probe.log" 2>&1
  echo "[probe] rc=$? (probe.log)"; tail -40 "$out/probe.log"
fi

bg_pid=""
if [ -n "${KF_BG:-}" ]; then
  stamp "background job (bg.log)"
  bash -c "$KF_BG" > "$out/bg.log" 2>&1 &
  bg_pid=$!
fi

rc=0
# Separate pytest runs, each with its own time limit and log, so the fla-parity tests (fla's first
# Triton compile/autotune of its KDA kernels takes minutes on a fresh machine) can never cut off
# the summary of our own GPU tests: tests.log = -m "gpu and not fla", tests_fla*.log = -m "gpu and fla".
run_tests() {  # $1 marker expression, $2 log file, $3 time limit in seconds, $4 extra pytest args
  local sel=()
  [ -n "${KF_TESTS:-}" ] && sel=(-k "$KF_TESTS")
  # shellcheck disable=SC2206
  [ -n "${4:-}" ] && sel+=($4)
  # shellcheck disable=SC2086
  timeout "$3" python3 -m pytest -q -m "$1" -p no:cacheprovider -rfEs "${sel[@]}" \
    ${KF_PYTEST:-tests} > "$2" 2>&1
  local r=$?
  echo "[$1] $(grep -E "passed|failed|error|skipped|no tests ran" "$2" | tail -1)"
  [ $r -eq 124 ] && echo "[$1] TIMED OUT after $3 s (see $(basename "$2"))"
  grep -E "^(FAILED|ERROR)" "$2" | head -30
  return $r
}
if [ "${KF_TESTS:-}" != "none" ]; then
  # The fla-parity runs (fla 0.5.2, and 0.6.0 with KF_FLA06=1) start first, in the background: they
  # spend minutes in fla's single-threaded Triton compile, which our own tests do not wait for.
  pids=()
  if [ "${KF_FLA_TESTS:-1}" != "0" ]; then
    stamp "GPU fla-parity tests (background)"
    xd=""
    [ -n "${KF_XDIST:-}" ] && python3 -c "import xdist" 2>/dev/null && xd="-n ${KF_XDIST}"
    fla_run() {  # $1 label, $2 log; the subshell's status is run_tests' (pipefail: sed's is 0)
      ( set -o pipefail
        { python3 -c "import fla; print('fla', fla.__version__, 'from', fla.__file__)"
          run_tests "gpu and fla" "$2" "${KF_FLA_TEST_TIMEOUT:-300}" "$xd"; } | sed "s/^/[$1] /" ) &
      pids+=($!)
    }
    fla_run "fla 0.5.2" "$out/tests_fla.log"
    [ "${KF_FLA06:-0}" = "1" ] && PYTHONPATH=/tmp/site06:$PYTHONPATH fla_run "fla 0.6.0" "$out/tests_fla06.log"
  fi
  if [ "${KF_OURS_TESTS:-1}" != "0" ]; then
    stamp "GPU tests"
    run_tests "gpu and not fla" "$out/tests.log" "${KF_TEST_TIMEOUT:-540}" || rc=$?
  fi
  for pid in "${pids[@]}"; do
    r=0; wait "$pid" || r=$?
    [ $rc -eq 0 ] && rc=$r
  done
fi

bench_args=${KF_BENCH:-none}
if [ "$bench_args" != "none" ]; then
  [ "$bench_args" = "all" ] && bench_args=""
  stamp "benchmark"
  # shellcheck disable=SC2086
  python3 -m kernel_fun.bench --out "$out" $bench_args 2>&1 | tee "$out/bench.log" | tail -60
fi
if [ -n "$bg_pid" ]; then
  stamp "waiting for the background job"
  bg_rc=0; wait "$bg_pid" || bg_rc=$?
  stamp "background job done (rc=$bg_rc): $(tail -1 "$out/bg.log")"
fi
if [ "${KF_SAVE_TRITON_CACHE:-0}" = "1" ]; then
  stamp "$(bash scripts/triton_cache.sh save "$out")"
fi
# At most 8 files come back from a call (16 MiB each): when $out holds more, the small files of its
# subfolders (under 8 MiB each: stage_compare's inputs, accuracy JSONs, ...) travel as one archive,
# more.tgz (unpack: tar xzf more.tgz); larger files and the summary's logs stay as they are.
if [ "$(find "$out" -type f | wc -l)" -gt 8 ]; then
  # (with KF_BG's own logs the top level alone can pass 8: then its small files go too, but for the
  # logs this script's summary names)
  ( cd "$out" && find . -mindepth 2 -type f -size -8M -print0 > /tmp/gpu_run_more.lst
    if [ "$(find . -maxdepth 1 -type f | wc -l)" -gt 7 ]; then
      find . -maxdepth 1 -type f -size -8M ! -name tests.log ! -name tests_fla.log ! -name probe.log \
        ! -name bench.log ! -name bg.log ! -name 'triton-cache.tar.xz.part*' -print0 >> /tmp/gpu_run_more.lst
    fi
    if [ -s /tmp/gpu_run_more.lst ]; then
      tar czf more.tgz --null -T /tmp/gpu_run_more.lst && xargs -0 rm -f < /tmp/gpu_run_more.lst
      find . -mindepth 1 -type d -empty -delete
    fi )
  [ -f "$out/more.tgz" ] && stamp "over 8 files: subfolders' small files packed into more.tgz ($(du -sh "$out/more.tgz" | cut -f1))"
fi
stamp "done (tests rc=$rc)"
exit $rc
