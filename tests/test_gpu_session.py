"""scripts/gpu_session.sh's stage budgets, with a stand-in python3 (no GPU)."""

import os
import pathlib
import re
import shutil
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("stage,budget_var", [("tune_fwd", "TUNE_BUDGET"),
                                              ("bench", "BENCH_BUDGET")])
def test_a_script_time_budget_fits_its_stage_cut_to_the_deadline(
    tmp_path, stage, budget_var):
  """A stage whose budget the deadline cuts passes the script a time budget
  inside the cut one, so the script writes its tables before the timeout."""
  fake = tmp_path / "bin"
  fake.mkdir()
  (fake / "python3").write_text('#!/bin/bash\necho "ARGS: $*"\n')
  (fake / "python3").chmod(0o755)
  out = tmp_path / "out"
  env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", OUT=str(out),
             DEADLINE="100", A=stage, **{budget_var: "240"})
  subprocess.run(["bash", "scripts/gpu_session.sh"], cwd=REPO, env=env,
                 check=True, capture_output=True, timeout=120)
  stages = (out / "r" / "stages.txt").read_text()
  cut = int(re.search(rf"{stage}: start \(budget (\d+) s", stages).group(1))
  assert cut <= 100
  args = (out / "r" / f"{stage}.log").read_text()
  inner = int(re.search(r"--time-budget (\d+)", args).group(1))
  assert 10 <= inner < cut
