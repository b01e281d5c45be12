#!/usr/bin/env bash
# One lease of the device machine, inside a deadline: named stages in two lanes.
# With two GPUs lane A runs on GPU 0 and lane B on GPU 1 side by side; the "both"
# stages (two-GPU tests and benchmark) run first, alone, on both GPUs. With one
# GPU the lanes run one after the other.
#
# Usage, from the repo root on the device (the image's python3 has jax + CUDA;
# carry .whl for tokamax in the bench stage):
#   OUT=/some/dir DEADLINE=560 BOTH="mgpu_bench" A="tests racecheck" B="drain bench" \
#     bash scripts/gpu_session.sh
# Stages: tests (kernel GPU tests of $TEST_ARGS, pytest-xdist; TEST_K="..." selects
# with -k), api (tests/test_mosaic_path.py, API_TESTS_BUDGET s),
# serial (the T=131072 memory test), racecheck (RACECHECK_ARGS="--only role_split"
# for that group alone), drain (scripts/bench_drain.py),
# bench (flash3-bench $BENCH, tokamax from .whl), bench2 (the same with $BENCH2, into
# $OUT/r/bench2: an A/B of two bench settings in one lease), train_flash3, train_cudnn
# (STEPS steps, packed documents), train_speed (their steps timed side by side),
# train_crosscheck (train_flash3's checkpoint evaluated with flash3, cuDNN and XLA),
# train_script (scripts/gpu_train.sh end to end: what make demo runs on a Hopper GPU),
# compile_report (scripts/compile_report.py $COMPILE_ARGS: ptxas's view of each kernel),
# api_kernels (scripts/api_kernels.py $API_ARGS: the API's fwd+bwd kernel by kernel),
# hlo_calls (custom calls in the train step before and after XLA's optimizations),
# mgpu_tests, mgpu_bench (both GPUs),
# testfile:PATH (the test ids listed in PATH), tune_fwd, tune_bwd, tune_fwd2, tune_bwd2, tune_fwd3, tune_bwd3
# (config sweeps, each into $OUT/r/<stage>/; TUNE_ARGS adds scripts/tune.py arguments,
# e.g. "--causal 0 --persistent 0 1"; TUNE_FWD_ARGS, TUNE_FWD2_ARGS, ..., when set,
# replace it for that stage), train_timeline (idle gaps in a traced train step); MGPU_ARGS adds
# scripts/bench_multi_gpu.py arguments, e.g. "--cases all --allow-head-sharding").
# Writes $OUT/r/<stage>.log and results, packed into $OUT/results.tar.gz after
# every stage, so a cut-off run still returns what it did.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/flash3-gpu}
R="$OUT/r"
mkdir -p "$R"
START=$(date +%s)
DEADLINE=${DEADLINE:-560}
STEPS=${STEPS:-300}
BENCH=${BENCH:-"--suite fa3 --seqlens 4096,16384 --dtypes bfloat16 --no-tune"}
TEST_ARGS=${TEST_ARGS:-"tests/test_forward_kernel.py tests/test_backward_kernel.py"}

left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
clamp() { local t; t=$(left); echo $(( $1 < t ? $1 : t )); }  # a budget cut to the deadline
pack() { tar czf "$OUT/results.tar.gz" --exclude='*.npz' --exclude='*.pb' -C "$OUT" r 2>/dev/null; }
stage() {  # stage NAME BUDGET_S GPUS command...
  local name=$1 budget=$2 gpu=$3; shift 3
  local t; t=$(left)
  if [ "$t" -lt 30 ]; then echo "== $name: skipped, $t s left" | tee -a "$R/stages.txt"; return; fi
  budget=$(clamp "$budget")
  echo "== $name: start (budget $budget s, GPU $gpu)" | tee -a "$R/stages.txt"
  local s=$(date +%s)
  CUDA_VISIBLE_DEVICES=$gpu timeout -k 5 "$budget" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc after $(( $(date +%s) - s )) s" | tee -a "$R/stages.txt"
  pack
}
inner() {  # inner BUDGET MARGIN: a script's own --time-budget inside its stage,
  # from the budget as `stage` will cut it to the deadline (else the timeout
  # kills the script mid-case, before it writes its tables)
  local b; b=$(( $(clamp "$1") - $2 )); [ "$b" -lt 10 ] && b=10; echo "$b"
}
shared() {  # Several processes on one GPU: memory on demand.
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 "$@"
}
tune_args() {  # TUNE_FWD_ARGS / TUNE_BWD_ARGS, else TUNE_ARGS
  local v="TUNE_${1#tune_}"; v="${v^^}_ARGS"; echo "${!v:-${TUNE_ARGS:-}}"
}
run_stage() {  # run_stage NAME GPU
  local g=$2
  case $1 in
    tests) shared stage tests ${TESTS_BUDGET:-420} "$g" python3 -m pytest -p no:cacheprovider \
             -v -n ${TEST_JOBS:-14} -m "gpu and not serial" -rfE --durations=15 \
             ${TEST_K:+-k "$TEST_K"} $TEST_ARGS ;;
    testfile:*)  # testfile:PATH runs the test ids listed in PATH (one per line)
      local f=${1#testfile:}
      # shellcheck disable=SC2046
      shared stage "tests-$(basename "$f" .txt)" ${TESTS_BUDGET:-420} "$g" python3 -m pytest \
        -p no:cacheprovider -v -n ${TEST_JOBS:-14} -rfE --durations=20 $(cat "$f") ;;
    api) shared stage api ${API_TESTS_BUDGET:-200} "$g" python3 -m pytest -q -p no:cacheprovider -n 4 -rfE \
           tests/test_mosaic_path.py ;;
    serial) FLASH3_RESULTS_DIR="$R" XLA_PYTHON_CLIENT_PREALLOCATE=false stage serial 150 "$g" \
              python3 -m pytest -q -s -p no:cacheprovider -m "gpu and serial" -rfE tests ;;
    racecheck) stage racecheck ${RACECHECK_BUDGET:-180} "$g" compute-sanitizer --tool racecheck --print-limit 20 \
                 python3 scripts/racecheck.py ${RACECHECK_ARGS:-} ;;
    drain) stage drain ${DRAIN_BUDGET:-200} "$g" python3 scripts/bench_drain.py \
             --time-budget $(inner ${DRAIN_BUDGET:-200} 20) --jobs 8 --out "$R/drain" ;;
    # shellcheck disable=SC2086
    bench) stage bench ${BENCH_BUDGET:-280} "$g" bash scripts/with_tokamax.sh python3 -m flash3.bench \
             $BENCH --no-progress --time-budget $(inner ${BENCH_BUDGET:-280} 20) --out "$R/bench" ;;
    bench2) stage bench2 ${BENCH_BUDGET:-280} "$g" bash scripts/with_tokamax.sh python3 -m flash3.bench \
              ${BENCH2:-$BENCH} --no-progress --time-budget $(inner ${BENCH_BUDGET:-280} 20) \
              --out "$R/bench2" ;;
    train_flash3|train_cudnn)
      local impl=${1#train_}
      local extra=""; [ "$impl" = flash3 ] && extra="--flash3-kernels-only"
      stage "$1" ${TRAIN_BUDGET:-260} "$g" python3 -m examples.train_gpt --preset h200 \
        --attention "$impl" $extra --seed 0 --steps "$STEPS" --no-progress --out "$R/train/$impl" ;;
    train_speed)  # flash3 vs cuDNN train steps timed alternately in one process
      stage train_speed ${SPEED_BUDGET:-200} "$g" python3 -m examples.train_gpt.speed \
        --preset h200 --impls flash3,cudnn --flash3-kernels-only --steps ${SPEED_STEPS:-30} \
        --json "$R/train/speed.json" ;;
    tune_fwd|tune_bwd|tune_fwd2|tune_bwd2|tune_fwd3|tune_bwd3)  # config sweeps against cuDNN (scripts/tune.py)
      local what=${1#tune_}; what=${what%[23]}
      stage "$1" ${TUNE_BUDGET:-240} "$g" python3 scripts/tune.py --what "$what" \
        --jobs ${TUNE_JOBS:-10} $(tune_args "$1") --time-budget $(inner ${TUNE_BUDGET:-240} 15) \
        --out "$R/$1" ;;
    train_script)  # make demo's GPU path end to end: scripts/gpu_train.sh (both runs,
      # compare, crosscheck, speed), into $OUT/r/train_script
      stage train_script ${TRAIN_SCRIPT_BUDGET:-420} "$g" env OUT="$R/train_script" \
        STEPS="$STEPS" PY=python3 bash scripts/gpu_train.sh ;;
    hlo_calls)  # custom calls in the h200 train step before / after XLA, and where (3 for flash3)
      stage hlo_calls ${HLO_BUDGET:-150} "$g" python3 scripts/hlo_calls.py --preset h200 \
        --impls flash3,cudnn --flash3-kernels-only --where ;;
    compile_report)  # ptxas's registers, spills, wgmma serialisation per kernel; the
      # whole dumps (PTX, ptxas log, SASS) go to $OUT/compile.tar.xz, apart from r/
      stage compile_report ${COMPILE_BUDGET:-180} "$g" python3 scripts/compile_report.py \
        ${COMPILE_ARGS:-} --out "$OUT/compile"
      cp "$OUT/compile/summary.md" "$R/compile_summary.md" 2>/dev/null
      tar cJf "$OUT/compile.tar.xz" -C "$OUT" compile && rm -rf "$OUT/compile" ;;
    api_kernels)  # the API's fwd+bwd kernel by kernel against the backward kernels alone
      stage api_kernels ${API_BUDGET:-90} "$g" python3 scripts/api_kernels.py \
        ${API_ARGS:-} --out "$R/api_kernels" ;;
    train_crosscheck)  # train_flash3's checkpoint: held-out loss under each attention path
      stage train_crosscheck ${CROSSCHECK_BUDGET:-150} "$g" python3 -m examples.train_gpt.crosscheck \
        --preset h200 --flash3-kernels-only --seed 0 --out "$R/train/flash3" \
        --impls flash3,cudnn,xla --json "$R/train/crosscheck.json" ;;
    train_timeline)  # where each step's wall time goes: kernels, idle gaps (traces)
      stage train_timeline ${TIMELINE_BUDGET:-150} "$g" python3 -m examples.train_gpt.timeline \
        --preset h200 --impls flash3,cudnn --flash3-kernels-only --steps 3 \
        --out "$R/timeline" ;;
    mgpu_tests) shared stage mgpu_tests 200 "$g" python3 -m pytest -v -p no:cacheprovider -n 4 -m gpu \
                  -rfE tests/test_multi_gpu.py ;;
    # shellcheck disable=SC2086
    mgpu_bench) stage mgpu_bench ${MGPU_BUDGET:-260} "$g" python3 scripts/bench_multi_gpu.py \
                  ${MGPU_ARGS:-} --out "$R/mgpu" --time-budget $(inner ${MGPU_BUDGET:-260} 40) ;;
    *) echo "unknown stage $1" | tee -a "$R/stages.txt" ;;
  esac
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())'
  date -u; } > "$R/gpus.txt" 2>&1
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
cat "$R/gpus.txt"
if [ "$NGPU" -ge 2 ]; then
  for s in ${BOTH:-}; do run_stage "$s" 0,1; done
  (for s in ${A:-}; do run_stage "$s" 0; done) &
  (for s in ${B:-}; do run_stage "$s" 1; done) &
  wait
else
  for s in ${A:-} ${B:-}; do run_stage "$s" 0; done
fi
if [ -f "$R/train/flash3/log.json" ] && [ -f "$R/train/cudnn/log.json" ]; then
  python3 -m examples.train_gpt.compare "$R/train/flash3/log.json" \
    "$R/train/cudnn/log.json" --out "$R/train" > "$R/compare.log" 2>&1
fi
pack
cat "$R/stages.txt"
grep -hE "^(FAILED|ERROR)|passed|failed" "$R"/tests*.log "$R"/api.log "$R"/serial.log "$R"/mgpu_tests.log 2>/dev/null | tail -n 40
grep -h "RACECHECK SUMMARY" "$R/racecheck.log" 2>/dev/null
cat "$R/train/compare.md" 2>/dev/null
echo "total $(( $(date +%s) - START )) s"
