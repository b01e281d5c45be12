#!/usr/bin/env bash
# The README's main command (make demo): set up, then train a byte-level GPT on the Python
# standard library's own source with flash3's attention.
#   - H200/H100 (Hopper): T=4096, a few hundred steps with flash3's kernels and the same with
#     cuDNN from the same seed, then one checkpoint under both and their steps side by side
#     (scripts/gpu_train.sh).
#   - No GPU: a tiny model on the XLA path (the same program), in under two minutes on 2 cores.
# Extra arguments go to the trainer (python -m examples.train_gpt --help); on a Hopper GPU
# to every command of scripts/gpu_train.sh (both runs, crosscheck, speed), word-split.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

extras=examples
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  extras=examples,cuda  # the CUDA plugin for jax, pinned with jax in pyproject.toml
fi
FLASH3_EXTRAS=$extras bash scripts/env.sh
py="$root/.venv/bin/python"

if "$py" -c 'from flash3._device import hopper_device_kind as h; raise SystemExit(h() is None)'; then
  # The full demo: flash3's kernels and cuDNN from the same seed, their loss curves, the
  # same checkpoint under both, their train steps side by side.
  echo "flash3 demo: Hopper GPU found: flash3's kernels and cuDNN, T=4096, a few hundred" \
       "steps each from the same seed, then the exact loss check and the step timing" \
       "(scripts/gpu_train.sh, about 5 minutes on an H200)" >&2
  out=runs/demo-h200
  rm -rf "$out"
  start=$(date +%s)
  # Only what the demo sets: the script's dry-run knobs must not leak in from the shell.
  env -u PRESET -u OTHER -u FLASH3_FLAGS -u TRAIN_WORK PY="$py" OUT="$out" \
    EXTRA_ARGS="$*" bash scripts/gpu_train.sh
  echo "flash3 demo: finished in $(( $(date +%s) - start )) s; see $out/compare.png," \
       "$out/compare.md, $out/crosscheck.md and $out/speed.md" >&2
  exit 0
fi
echo "flash3 demo: no Hopper GPU here, so a tiny model with attention on the XLA path" \
     "(flash3's fallback); the same command uses the kernels on an H100/H200" >&2
out=runs/demo-cpu
rm -rf "$out"  # a fresh run each time; use the trainer's --resume to continue one instead
start=$(date +%s)
"$py" -m examples.train_gpt --preset cpu --attention flash3 --out "$out" "$@"
echo "flash3 demo: finished in $(( $(date +%s) - start )) s; see $out/loss.png and $out/log.json" >&2
