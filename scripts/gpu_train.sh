#!/usr/bin/env bash
# On an H100/H200: train the byte-level GPT with flash3 and with cuDNN from the same seed,
# a few hundred steps at T=4096, and show both halves of the comparison. Run from the
# repository root (`make demo` does, on a Hopper GPU; or with the image's python3):
#   OUT=/some/dir STEPS=300 bash scripts/gpu_train.sh
# Writes under $OUT: flash3/ and cudnn/ (log.json, loss.png, train.txt); compare.png and
# compare.md (the two loss curves and their difference, tokens/s); crosscheck.md (flash3's
# final checkpoint evaluated with flash3, cuDNN and XLA: the exact loss check, since two
# runs drift apart); speed.md (the two train steps timed side by side, SPEED_ROUNDS rounds
# in flipped order: the per-step comparison separate runs are too noisy for).
# Checkpoints (about 1 GB each) go to $TRAIN_WORK (default: a temporary folder, removed
# at the end), not to $OUT.
#
# flash3 runs with implementation="mosaic" (--flash3-kernels-only) so that it fails rather
# than quietly timing the XLA path. A small probe first asks whether flash3's kernels and
# the other path both take packed documents (segment ids); if either does not, both runs go
# without segment ids, and compare.md says so. Takes about 5 minutes on an H200 (291-295
# s in two runs, 2026-12-02); lower STEPS if needed. EXTRA_ARGS (word-split) go last to every run, e.g. EXTRA_ARGS="--batch-size 4".
# PY picks the interpreter (default python3).
# For a dry run without a GPU (tests/test_gpu_train_script.py): PRESET=cpu OTHER=xla
# FLASH3_FLAGS="" (flash3 then takes its XLA path).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-runs/gpu_train}
STEPS=${STEPS:-300}
PRESET=${PRESET:-h200}
OTHER=${OTHER:-cudnn}
if [ "$OTHER" = flash3 ]; then echo "OTHER=flash3: pick cudnn or xla (flash3 is the first run)" >&2; exit 2; fi
FLASH3_FLAGS=${FLASH3_FLAGS---flash3-kernels-only}
if [ -z "${TRAIN_WORK:-}" ]; then
  TRAIN_WORK=$(mktemp -d)
  trap 'rm -rf "$TRAIN_WORK"' EXIT  # about 2 GB of checkpoints
fi
PY=${PY:-python3}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
# shellcheck disable=SC2206
f3=($FLASH3_FLAGS)
common=(--preset "$PRESET" --seed 0)

train() {  # train ATTENTION [flags...]
  local impl=$1; shift
  mkdir -p "$OUT/$impl"
  echo "== $impl: --attention $impl $*" | tee "$OUT/$impl/train.txt"
  # shellcheck disable=SC2086
  "$PY" -m examples.train_gpt "${common[@]}" --attention "$impl" --steps "$STEPS" \
      --out "$TRAIN_WORK/$impl" --no-progress "$@" ${EXTRA_ARGS:-} 2>&1 | tee -a "$OUT/$impl/train.txt"
  local rc=${PIPESTATUS[0]}
  cp "$TRAIN_WORK/$impl/log.json" "$TRAIN_WORK/$impl/loss.png" "$OUT/$impl/" 2>/dev/null
  return "$rc"
}

"$PY" -c 'import jax; print(jax.devices())' | tee "$OUT/devices.txt"
# Packed documents for both runs only if both kernels take segment ids (a small probe).
# The probes' exit status decides (a crash counts as "no"); their last lines say why.
probe_ok=1
probe=""
for impl in flash3 "$OTHER"; do
  # pipefail (set above) reaches into $(...): a failing probe fails the assignment.
  line=$("$PY" -m examples.train_gpt.probe "$impl" 2>&1 | tail -1) || probe_ok=0
  probe="$probe$line"$'\n'
done
echo -n "$probe" | tee "$OUT/probe.txt"
if [ "$probe_ok" = 1 ]; then
  note="both runs with packed documents (segment ids)"
  seg=()
else
  note="both runs WITHOUT segment ids (attention crosses document boundaries): $(echo "$probe" | grep -v ': yes' | cut -c1-200)"
  seg=(--no-segments)
fi
echo "== $note" >&2
train flash3 "${f3[@]}" "${seg[@]}" && train "$OTHER" "${seg[@]}" \
  || { echo "== training failed; see $OUT/*/train.txt" >&2; exit 1; }
"$PY" -m examples.train_gpt.compare "$OUT/flash3/log.json" "$OUT/$OTHER/log.json" --out "$OUT" \
  || exit 1
echo "$note" | tee -a "$OUT/compare.md"
impls=flash3,$OTHER
[ "$OTHER" = xla ] || impls=$impls,xla
# shellcheck disable=SC2086
"$PY" -m examples.train_gpt.crosscheck "${common[@]}" "${f3[@]}" "${seg[@]}" ${EXTRA_ARGS:-} \
    --out "$TRAIN_WORK/flash3" --impls "$impls" --json "$OUT/crosscheck.json" \
    | tee "$OUT/crosscheck.md" || exit 1
# shellcheck disable=SC2086
"$PY" -m examples.train_gpt.speed "${common[@]}" "${f3[@]}" "${seg[@]}" ${EXTRA_ARGS:-} \
    --impls "flash3,$OTHER" --steps "${SPEED_ROUNDS:-60}" --json "$OUT/speed.json" \
    | tee "$OUT/speed.md" || exit 1
echo "== wrote $OUT: compare.png, compare.md, crosscheck.md, speed.md" >&2
