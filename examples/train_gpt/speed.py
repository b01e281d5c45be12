"""Train-step speed of attention implementations, side by side in one process.

  python -m examples.train_gpt.speed --preset h200 --impls flash3,cudnn --steps 30

Builds the model of a preset once per implementation (same seed, same batch: the
first training batch, packed documents included), compiles each train step, and
times them alternately, one step of each per round (the order flipped every
round), so that drifts in clocks or load hit all alike (separate training runs
differed by up to 8% in the same code on the H200). Prints the median step time, tokens per second and the ratio
to the first implementation; with --json, writes the numbers as JSON.

Timing is wall time of the whole jitted step (forward, backward, optimizer),
after one untimed step each; the ratio to the first implementation is also
given as the median of per-round ratios with a 95% bootstrap interval (the
rounds are paired). On a GPU the same rounds are then timed by CUPTI: the sum
of every kernel's time in a step (no host work or launch gaps; the median of
3 steps per round). Training-loss agreement is the training run's job
(python -m examples.train_gpt and compare.py); this measures speed only.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import numpy as np

from . import attention as attention_lib
from . import data as data_lib
from . import model as model_lib
from . import train as train_lib


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog="python -m examples.train_gpt.speed", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="Every other option is the trainer's (python -m examples.train_gpt --help): "
             "--preset, --seed, --flash3-kernels-only, --no-segments, model sizes, ...")
  p.add_argument("--impls", default="flash3,cudnn",
                 help="comma-separated attention implementations, the first is the "
                      f"baseline of the ratios (from {', '.join(attention_lib.IMPLEMENTATIONS)})")
  p.add_argument("--steps", type=int, default=20, help="timed rounds (one step of each)")
  p.add_argument("--json", default=None, help="write the results to this JSON file")
  _, rest = p.parse_known_args(argv)
  if any(a == "--out" or a.startswith("--out=") for a in rest):
    p.error("--out: speed writes no run folder; --json FILE writes its results")
  # --preset, --seed, --no-segments, sizes, ... are the trainer's.
  train_args, args, impls = train_lib.parse_with_impls(p, argv)
  if train_args.steps < 1:
    p.error(f"--steps {train_args.steps}: must be >= 1")
  args.impls, args.timed_steps, args.json_out = impls, train_args.steps, train_args.json
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  say = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
  device = jax.devices()[0]
  for impl in args.impls:
    train_lib.check_attention_device(impl, device.platform, args.flash3_kernels_only)
  train_stream, _ = train_lib.load_data(args)
  batch = train_lib.to_device(data_lib.train_batch(train_stream, 1, args.batch_size,
                                                   args.seq_len, args.seed))
  optimizer = train_lib.make_optimizer(args)
  fns, state = {}, None
  for impl in args.impls:
    config = train_lib.model_config(args, impl)
    if state is None:  # The parameters do not depend on the attention path.
      params = model_lib.init_params(config, jax.random.key(args.seed))
      state = (params, optimizer.init(params))
    fns[impl] = train_lib.make_train_step(config, optimizer, donate=False)
  say(f"device: {device.device_kind}; B={args.batch_size} T={args.seq_len}, "
      f"{model_lib.num_params(state[0]) / 1e6:.1f}M params; timing "
      f"{', '.join(args.impls)} alternately, {args.timed_steps} rounds")
  times = train_lib.time_alternately(fns, state, batch, args.timed_steps)
  kernel_ms = None
  if device.platform == "gpu":
    kernel_ms = train_lib.time_kernels_alternately(fns, state, batch, args.timed_steps)
  tokens = args.batch_size * args.seq_len
  first = args.impls[0]
  base = float(np.median(times[first]))
  rows = []
  for impl in args.impls:
    t = float(np.median(times[impl]))
    paired, lo, hi = train_lib.paired_speed(times[first], times[impl])
    row = {"attention": impl, "path": attention_lib.describe(impl), "median_step_s": t,
           "min_step_s": float(np.min(times[impl])),
           "max_step_s": float(np.max(times[impl])),
           "tokens_per_s": tokens / t, "speed_vs_first": base / t,
           "paired_speed_vs_first": paired, "paired_speed_ci95": [lo, hi]}
    if kernel_ms is not None:
      k_paired, k_lo, k_hi = train_lib.paired_speed(kernel_ms[first], kernel_ms[impl])
      row.update(kernel_ms_median=float(np.median(kernel_ms[impl])),
                 kernel_speed_vs_first=k_paired, kernel_speed_ci95=[k_lo, k_hi])
    rows.append(row)
  print(f"| attention | median step (s) | min-max (s) | tokens/s | speed vs {first} "
        f"| paired, 95% interval |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    lo, hi = r["paired_speed_ci95"]
    print(f"| {r['attention']} | {r['median_step_s']:.4f} | {r['min_step_s']:.4f}-"
          f"{r['max_step_s']:.4f} | {r['tokens_per_s']:,.0f} | {r['speed_vs_first']:.3f} "
          f"| {r['paired_speed_vs_first']:.3f} ({lo:.3f}-{hi:.3f}) |")
  if kernel_ms is not None:
    print(f"\nGPU kernel time per step (CUPTI):\n\n| attention | median (ms) "
          f"| speed vs {first}, paired, 95% interval |\n|---|---|---|")
    for r in rows:
      lo, hi = r["kernel_speed_ci95"]
      print(f"| {r['attention']} | {r['kernel_ms_median']:.2f} "
            f"| {r['kernel_speed_vs_first']:.3f} ({lo:.3f}-{hi:.3f}) |")
  else:
    say("GPU kernel time per step: not measured (CUPTI needs a GPU)")
  result = {"device": device.device_kind, "preset": args.preset, "batch_size": args.batch_size,
            "seq_len": args.seq_len, "segments": not args.no_segments,
            "timed_rounds": args.timed_steps, "results": rows}
  if args.json_out:
    path = pathlib.Path(args.json_out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    say(f"wrote {path}")
  return result


if __name__ == "__main__":
  main()
