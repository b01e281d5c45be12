#!/usr/bin/env bash
# On an H200 (the device machine: python3 with jax, optax, matplotlib, tqdm; no .venv):
# train the byte-level GPT with flash3 and with cuDNN from the same seed, a few hundred steps
# at T=4096, and compare. Run from the repository root:
#   OUT=/some/dir STEPS=300 bash scripts/gpu_train.sh
# Writes under $OUT: flash3/ and cudnn/ (log.json, loss.png, train.txt), compare.png,
# compare.md. Checkpoints (about 1 GB each) stay in $WORK, not in $OUT.
#
# flash3 runs with implementation="mosaic" (--flash3-kernels-only) so that it fails rather
# than quietly timing the XLA path. If the kernels cannot take packed documents (segment
# ids) yet, or cuDNN rejects them, both runs are repeated without segment ids, and
# compare.md says so.
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
      --out "$WORK/$name" --no-progress "$@" 2>&1 | tee -a "$OUT/$name/train.txt"
  local rc=${PIPESTATUS[0]}
  cp "$WORK/$name/log.json" "$WORK/$name/loss.png" "$OUT/$name/" 2>/dev/null
  return "$rc"
}

"$PY" -c 'import jax; print(jax.devices())' | tee "$OUT/devices.txt"
note=""
if train flash3 flash3 --flash3-kernels-only && train cudnn cudnn; then
  note="both runs with packed documents (segment ids)"
else
  note="a run with segment ids failed (see */train.txt); both repeated without segment ids"
  echo "== $note" >&2
  mv "$OUT/flash3" "$OUT/flash3-segments-failed" 2>/dev/null
  mv "$OUT/cudnn" "$OUT/cudnn-segments-failed" 2>/dev/null
  train flash3 flash3 --flash3-kernels-only --no-segments && \
    train cudnn cudnn --no-segments || { echo "== training failed" >&2; exit 1; }
fi
"$PY" -m examples.train_gpt.compare "$OUT/flash3/log.json" "$OUT/cudnn/log.json" --out "$OUT"
echo "$note" | tee -a "$OUT/compare.md"
