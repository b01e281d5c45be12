#!/usr/bin/env bash
# One device call for tuning: lane A runs every kernel GPU test (pytest-xdist, the
# compiles in parallel), lane B sweeps forward then backward configs against cuDNN
# (scripts/tune.py). Two GPUs: one lane each; one GPU: lane B after lane A.
#   OUT=/some/dir bash scripts/gpu_tune.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/flash3-gpu}; R="$OUT/r"; mkdir -p "$R"
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
nvidia-smi --query-gpu=name,driver_version --format=csv > "$R/gpus.txt" 2>&1
pack() { tar czf "$OUT/results.tar.gz" -C "$OUT" r 2>/dev/null; }
lane_a() {
  CUDA_VISIBLE_DEVICES=0 timeout ${TESTS_BUDGET:-400} python3 -m pytest -q -p no:cacheprovider \
    -n ${TEST_JOBS:-12} -m gpu -rfE tests/test_forward_kernel.py tests/test_backward_kernel.py \
    ${TEST_ARGS:-} > "$R/tests.log" 2>&1
  echo "tests rc=$?" >> "$R/stages.txt"; pack
}
lane_b() {
  local gpu=$(( NGPU > 1 ? 1 : 0 ))
  CUDA_VISIBLE_DEVICES=$gpu timeout ${FWD_BUDGET:-230} python3 scripts/tune.py --what fwd \
    --jobs ${TUNE_JOBS:-10} --time-budget $(( ${FWD_BUDGET:-230} - 10 )) --out "$R" ${FWD_ARGS:-} > "$R/tune_fwd.log" 2>&1
  echo "tune fwd rc=$?" >> "$R/stages.txt"; pack
  CUDA_VISIBLE_DEVICES=$gpu timeout ${BWD_BUDGET:-200} python3 scripts/tune.py --what bwd \
    --jobs ${TUNE_JOBS:-10} --time-budget $(( ${BWD_BUDGET:-200} - 10 )) --out "$R" ${BWD_ARGS:-} > "$R/tune_bwd.log" 2>&1
  echo "tune bwd rc=$?" >> "$R/stages.txt"; pack
}
if [ "$NGPU" -ge 2 ]; then lane_a & lane_b & wait; else lane_a; lane_b; fi
pack
cat "$R/stages.txt"; tail -n 30 "$R/tests.log"
