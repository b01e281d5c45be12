"""scripts/gpu_train.sh (what `make demo` runs on a Hopper GPU), dry-run on the CPU.

Its GPU form trains flash3's kernels and cuDNN; here PRESET=cpu OTHER=xla FLASH3_FLAGS=""
run the same steps at a tiny size: the probe, both trainings, the comparison, the
checkpoint under each path and the side-by-side timing.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("optax", reason="needs the examples extra: FLASH3_EXTRAS=examples")
ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ("--num-layers 1 --num-heads 2 --num-kv-heads 1 --head-dim 64 --mlp-dim 128 "
        "--seq-len 64 --batch-size 4 --eval-every 3 --eval-batches 2 "
        "--max-train-bytes 300000 --attention-share-steps 0")


def test_gpu_train_script_dry_run_on_cpu(tmp_path):
  out, work = tmp_path / "out", tmp_path / "work"
  env = {**os.environ, "OUT": str(out), "TRAIN_WORK": str(work), "PRESET": "cpu",
         "OTHER": "xla", "FLASH3_FLAGS": "", "STEPS": "3", "SPEED_ROUNDS": "2",
         "PY": sys.executable, "EXTRA_ARGS": TINY, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_train.sh")], env=env,
                        cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  for name in ("compare.md", "compare.png", "crosscheck.md", "speed.md",
               "flash3/log.json", "xla/log.json"):
    assert (out / name).stat().st_size > 0, name
  # Without a GPU flash3's kernels refuse segment ids, so both runs went without.
  assert "WITHOUT segment ids" in (out / "compare.md").read_text()
  logs = {i: json.loads((out / i / "log.json").read_text()) for i in ("flash3", "xla")}
  assert [len(log["steps"]) for log in logs.values()] == [3, 3]
  cross = json.loads((out / "crosscheck.json").read_text())
  rows = {r["attention"]: r for r in cross["results"]}
  assert list(rows) == ["flash3", "xla"] and cross["step"] == 3
  # The checkpoint's loss under flash3 is the flash3 run's own final held-out loss.
  final = logs["flash3"]["heldout"][-1]["heldout_loss"]
  assert rows["flash3"]["heldout_loss"] == pytest.approx(final, abs=1e-6)
  assert abs(rows["xla"]["diff_vs_first"]) < 1e-3
  speed = json.loads((out / "speed.json").read_text())
  assert [r["attention"] for r in speed["results"]] == ["flash3", "xla"]
  assert speed["timed_rounds"] == 2
  # The checkpoints stayed in TRAIN_WORK (given, so kept), not in OUT.
  assert (work / "flash3" / "checkpoint.npz").exists()
  assert not list(out.rglob("*.npz"))


def test_gpu_train_script_refuses_flash3_against_itself(tmp_path):
  env = {**os.environ, "OUT": str(tmp_path), "OTHER": "flash3"}
  proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_train.sh")], env=env,
                        cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 2 and "OTHER=flash3" in proc.stderr
