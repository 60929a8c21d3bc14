#!/usr/bin/env bash
# The alt tree's backward GPU tests, each test's name as it ends, tracebacks of any test still running
# after 100 s (pytest's faulthandler_timeout), the 15 slowest. KF_PROBE of scripts/gpu_run.sh; carry
# [".whl", ".prebuilt", "ab_alt"].
set -u
bash scripts/use_prebuilt.sh ab_alt | tail -1 || exit 1
cd ab_alt && PYTHONPATH="$PWD/src:/tmp/site" timeout 330 python3 -m pytest -v -n 2 -p no:cacheprovider \
  -o faulthandler_timeout=100 --durations=15 tests/test_kda_bwd_gpu.py 2>&1 | grep -v "Warning\|warner" | tail -150
