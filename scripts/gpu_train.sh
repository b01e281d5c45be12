#!/usr/bin/env bash
# On an H200 (the device machine: python3 with jax, optax, matplotlib, tqdm; no .venv):
# train the byte-level GPT with flash3 and with cuDNN from the same seed, a few hundred steps
# at T=4096, and compare. Run from the repository root:
#   OUT=/some/dir STEPS=300 bash scripts/gpu_train.sh
# Writes under $OUT: flash3/ and cudnn/ (log.json, loss.png, train.txt), compare.png,
# compare.md; then crosscheck.md (flash3's final checkpoint evaluated with flash3, cuDNN
# and XLA: the exact loss check) and speed.md (the two train steps timed side by side,
# SPEED_ROUNDS rounds in flipped order: the per-step comparison separate runs are too
# noisy for). Checkpoints (about 1 GB each) stay in $WORK, not in $OUT.
#
# flash3 runs with implementation="mosaic" (--flash3-kernels-only) so that it fails rather
# than quietly timing the XLA path. A small probe first asks whether flash3's kernels and
# cuDNN both take packed documents (segment ids); if either does not, both runs go without
# segment ids, and compare.md says so. Takes about 6-9 minutes; lower STEPS if needed.
# EXTRA_ARGS (word-split) go last to both runs, e.g. EXTRA_ARGS="--batch-size 4".
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-runs/gpu_train}
STEPS=${STEPS:-300}
WORK=${WORK:-$(mktemp -d)}
PY=${PY:-python3}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"

train() {  # train NAME ATTENTION [flags...]
  local name=$1 impl=$2; shift 2
  mkdir -p "$OUT/$name"
  echo "== $name: --attention $impl $*" | tee "$OUT/$name/train.txt"
  "$PY" -m examples.train_gpt --preset h200 --attention "$impl" --seed 0 --steps "$STEPS" \
      --out "$WORK/$name" --no-progress "$@" ${EXTRA_ARGS:-} 2>&1 | tee -a "$OUT/$name/train.txt"
  local rc=${PIPESTATUS[0]}
  cp "$WORK/$name/log.json" "$WORK/$name/loss.png" "$OUT/$name/" 2>/dev/null
  return "$rc"
}

"$PY" -c 'import jax; print(jax.devices())' | tee "$OUT/devices.txt"
# Packed documents for both runs only if both kernels take segment ids (a small probe).
probe=$("$PY" -m examples.train_gpt.probe flash3 2>&1 | tail -1; "$PY" -m examples.train_gpt.probe cudnn 2>&1 | tail -1)
echo "$probe" | tee "$OUT/probe.txt"
if ! echo "$probe" | grep -q ": no"; then
  note="both runs with packed documents (segment ids)"
  seg=()
else
  note="both runs WITHOUT segment ids (attention crosses document boundaries): $(echo "$probe" | grep ': no' | cut -c1-200)"
  seg=(--no-segments)
fi
echo "== $note" >&2
train flash3 flash3 --flash3-kernels-only "${seg[@]}" && train cudnn cudnn "${seg[@]}" \
  || { echo "== training failed; see $OUT/*/train.txt" >&2; exit 1; }
"$PY" -m examples.train_gpt.compare "$OUT/flash3/log.json" "$OUT/cudnn/log.json" --out "$OUT"
echo "$note" | tee -a "$OUT/compare.md"
"$PY" -m examples.train_gpt.crosscheck --preset h200 --seed 0 --flash3-kernels-only \
    "${seg[@]}" ${EXTRA_ARGS:-} --out "$WORK/flash3" --impls flash3,cudnn,xla \
    --json "$OUT/crosscheck.json" | tee "$OUT/crosscheck.md"
"$PY" -m examples.train_gpt.speed --preset h200 --seed 0 --flash3-kernels-only \
    "${seg[@]}" ${EXTRA_ARGS:-} --impls flash3,cudnn --steps "${SPEED_ROUNDS:-60}" \
    --out "$OUT/speed.json" | tee "$OUT/speed.md"
