"""flash3-bench's output details: stable plot colours, a closed pipe."""

import os
import pathlib
import subprocess
import sys

from flash3.bench import plots


def test_each_contender_keeps_its_colour_in_every_panel_and_figure():
  everyone = ["cudnn", "flash3", "jax-mgpu", "tokamax", "xla"]
  some = ["flash3", "xla"]  # A figure where others are missing.
  for impl in some:
    assert plots.impl_color(impl, some) == plots.impl_color(impl, everyone)
  colours = [plots.impl_color(i, everyone + ["other"]) for i in everyone + ["other"]]
  assert len(set(colours)) == len(colours)


def test_list_into_a_closed_pipe_exits_quietly():
  src = str(pathlib.Path(__file__).resolve().parents[1] / "src")
  env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
  # `flash3-bench --list | head`: the reader is gone before the writer is done.
  # Closing our end at once (the child is still importing) makes every write
  # fail, buffered (at the final flush) or unbuffered (at the first print).
  for unbuffered in ("", "1"):
    bench = subprocess.Popen(
        [sys.executable, "-m", "flash3.bench", "--list", "--suite", "all"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=dict(env, PYTHONUNBUFFERED=unbuffered))
    bench.stdout.close()
    err = bench.stderr.read()
    bench.wait(timeout=120)
    assert bench.returncode == 0, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
