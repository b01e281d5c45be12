#!/usr/bin/env bash
# Everything one lease of the device machine should do, in one call, inside a deadline:
# GPU tests (a sample that covers every kernel path and option), compute-sanitizer
# racecheck on tiny shapes, the benchmark suite, and the training comparison.
# With two GPUs, lane A (GPU 0) and lane B (GPU 1) run side by side, and the
# two-device sharding test runs first on both.
#
# Usage, from the repo root on the device (the image's python3 has jax + CUDA):
#   OUT=/some/dir DEADLINE=560 bash scripts/gpu_session.sh
# Writes $OUT/r/* (logs, bench results, training logs and plots) and packs them into
# $OUT/results.tar.gz after every stage, so a cut-off run still returns what it did.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/flash3-gpu}
R="$OUT/r"
mkdir -p "$R"
START=$(date +%s)
DEADLINE=${DEADLINE:-560}
STEPS=${STEPS:-150}
TRAIN=${TRAIN:-1}  # 0: no training comparison
TESTS=${TESTS:-"(options and 128 and bfloat16) or (issue6 and D128 and not fp16) or deterministic or output_written"}
BENCH=${BENCH:-"--suite fa3 --seqlens 4096,16384 --dtypes float16 --impls flash3,cudnn,jax-mgpu"}

left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
pack() { tar czf "$OUT/results.tar.gz" --exclude='*.npz' -C "$OUT" r 2>/dev/null; }
stage() {  # stage NAME BUDGET_S GPU command...
  local name=$1 budget=$2 gpu=$3; shift 3
  local t; t=$(left)
  if [ "$t" -lt 30 ]; then echo "== $name: skipped, $t s left" | tee -a "$R/stages.txt"; return; fi
  [ "$budget" -gt "$t" ] && budget=$t
  echo "== $name: start (budget $budget s, GPU $gpu)" | tee -a "$R/stages.txt"
  local s=$(date +%s)
  CUDA_VISIBLE_DEVICES=$gpu timeout "$budget" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc after $(( $(date +%s) - s )) s" | tee -a "$R/stages.txt"
  pack
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/gpus.txt" 2>&1
python3 -c 'import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())' >> "$R/gpus.txt" 2>&1
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
cat "$R/gpus.txt"
if [ "$NGPU" -ge 2 ]; then
  B=1
  stage sharding 60 0,1 python3 -m pytest -q -p no:cacheprovider tests/test_mosaic_path.py \
    -k sharded -rA
else
  B=0
fi

lane_a() {
  stage tests_api 70 0 python3 -m pytest -q -p no:cacheprovider -rf tests/test_mosaic_path.py
  XLA_FLAGS=--xla_gpu_autotune_level=0 stage tests 240 0 python3 -m pytest -q -p no:cacheprovider \
    -m gpu -rf --maxfail=20 tests/test_forward_kernel.py tests/test_backward_kernel.py -k "$TESTS"
  [ "$TRAIN" = 1 ] && stage train_flash3 170 0 python3 -m examples.train_gpt --preset h200 --attention flash3 \
    --flash3-kernels-only --no-segments --seed 0 --steps "$STEPS" --no-progress --out "$R/train/flash3"
}
lane_b() {
  # shellcheck disable=SC2086
  stage bench 240 $B python3 -m flash3.bench $BENCH --iterations 5 --no-progress \
    --time-budget ${BENCH_BUDGET:-200} --out "$R/bench"
  stage racecheck 90 $B compute-sanitizer --tool racecheck --print-limit 20 \
    python3 scripts/racecheck.py
  [ "$TRAIN" = 1 ] && stage train_cudnn 170 $B python3 -m examples.train_gpt --preset h200 --attention cudnn \
    --no-segments --seed 0 --steps "$STEPS" --no-progress --out "$R/train/cudnn"
}

if [ "$B" = 1 ]; then
  lane_a & lane_b & wait
else
  lane_a; lane_b
fi
[ "$TRAIN" = 1 ] && python3 -m examples.train_gpt.compare "$R/train/flash3/log.json" \
  "$R/train/cudnn/log.json" --out "$R/train" > "$R/compare.log" 2>&1
pack
cat "$R/stages.txt"
tail -n 25 "$R/tests.log" 2>/dev/null
tail -n 30 "$R/bench.log" 2>/dev/null
cat "$R/train/compare.md" 2>/dev/null
echo "total $(( $(date +%s) - START )) s"
