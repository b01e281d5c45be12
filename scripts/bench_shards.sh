#!/usr/bin/env bash
# Shards of one flash3-bench run side by side, one per GPU, inside a deadline.
#
# Usage, from the repo root on the GPU machine (carry .whl for tokamax):
#   OUT=/some/dir SHARDS=4 FIRST=0 BUDGET=420 \
#     bash scripts/bench_shards.sh --suite fa3 --dtypes float16,bfloat16
# Runs shards FIRST, FIRST+1, ... of SHARDS (flash3-bench --shard I/SHARDS),
# shard FIRST+g on GPU g, as many as there are GPUs (GPUS=, default: all), each
# with --time-budget BUDGET (it starts no case that would end later), writing
# $OUT/shard-I/ (results.json after every case) and $OUT/shard-I.log, then
# merges the shards found in $OUT into $OUT/merged. With SHARDS larger than
# the GPUs, call it again with FIRST moved on; merge every call's shard-I
# directories with `flash3-bench --merge DIR... --out DIR` (no GPU needed).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# Install the tokamax wheels once, not once per shard (same --target).
[ -n "${WITH_TOKAMAX:-}" ] || exec bash scripts/with_tokamax.sh bash "$0" "$@"
OUT=${OUT:-/tmp/flash3-bench}
BUDGET=${BUDGET:-420}
GPUS=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
SHARDS=${SHARDS:-$GPUS}
FIRST=${FIRST:-0}
PY=${PYTHON:-python3}
[ "$GPUS" -ge 1 ] || { echo "bench_shards: no GPU found" >&2; exit 1; }
mkdir -p "$OUT"
START=$(date +%s)
for ((g = 0; g < GPUS && FIRST + g < SHARDS; g++)); do
  i=$((FIRST + g))
  echo "bench_shards: shard $i/$SHARDS on GPU $g"
  # The timeout is a backstop only: results.json is rewritten after each case.
  CUDA_VISIBLE_DEVICES=$g PYTHONUNBUFFERED=1 timeout $((BUDGET + 120)) \
    "$PY" -m flash3.bench "$@" --shard "$i/$SHARDS" --time-budget "$BUDGET" \
    --no-progress --out "$OUT/shard-$i" > "$OUT/shard-$i.log" 2>&1 &
done
wait
echo "bench_shards: shards done after $(( $(date +%s) - START )) s"
for log in "$OUT"/shard-*.log; do
  echo "== $log"
  grep -E "^flash3-bench: (case|time budget|cannot)" "$log" | tail -n 4
  grep -E "^wrote|Traceback|Error" "$log" | tail -n 3
done
shopt -s nullglob
dirs=("$OUT"/shard-*/)
if [ "${#dirs[@]}" -gt 0 ]; then
  "$PY" -m flash3.bench --merge "${dirs[@]}" --out "$OUT/merged" \
    > "$OUT/merged.log" 2>&1 && echo "bench_shards: merged into $OUT/merged" \
    || tail -n 5 "$OUT/merged.log"
fi
echo "bench_shards: total $(( $(date +%s) - START )) s"
