#!/bin/bash
# Forward kernel on an H100/H200: GPU tests, then the benchmark vs cuDNN.
# Usage (repo root): bash scripts/gpu_forward.sh [pytest -k expr]; OUT=dir for logs.
# The whole GPU suite takes about 25-30 min (about 8 s per test, mostly compiles;
# issue 6's option tests add 70 tests); -k "options or e07 or e11 or e12" runs those.
# FLASH3_FULL_GRID=1 runs issue 3's whole cross product (much longer).
set -o pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
timeout ${TEST_TIMEOUT:-2400} python3 -m pytest -q -m gpu tests/test_forward_kernel.py -p no:cacheprovider --maxfail=25 \
  ${1:+-k "$1"} 2>&1 | tee $OUT/gpu_tests.log | tail -40
python3 scripts/bench_forward.py ${BENCH_ARGS:---quick} 2>&1 | tee $OUT/bench.log
