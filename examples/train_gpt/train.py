"""Train the byte-level GPT on the Python standard library's source; see README.md here.

Usage (from the repository root):
  python -m examples.train_gpt --preset cpu              # tiny, XLA path, < 2 min on 2 cores
  python -m examples.train_gpt --preset h200 --attention flash3 --out runs/flash3

Writes under --out: log.json (config, one record per step, held-out losses, summary),
loss.png (loss curves) and checkpoint.npz (saved every --checkpoint-every steps and at the
end). Run again with the same --out and --resume to continue from the checkpoint; batches
are a pure function of (seed, step), so a resumed run takes exactly the steps an
uninterrupted run would have taken.

Share of step time in attention: after training, the same jitted train step is built a
second time with attention replaced by an elementwise stand-in (o = q + k + v, see
attention.py); both are timed alternately on the same batch and state;
share = 1 - median t(stand-in) / median t(real). This counts attention's forward and backward, and is an
estimate: XLA may fuse differently around the stand-in.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import textwrap
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import attention as attention_lib
from . import checkpoint
from . import data as data_lib
from . import model as model_lib

PRESETS = {
    # A few hundred steps of a ~90M-parameter model at T=4096 on one H200.
    "h200": dict(num_layers=8, num_heads=8, num_kv_heads=2, head_dim=128, mlp_dim=2816,
                 seq_len=4096, batch_size=8, steps=300, lr=1e-3, warmup=30,
                 eval_every=50, eval_batches=4, checkpoint_every=100,
                 max_train_bytes=None, attention_share_steps=10),
    # Tiny: trains in well under two minutes on 2 CPU cores, and the loss visibly drops.
    "cpu": dict(num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64, mlp_dim=384,
                seq_len=128, batch_size=8, steps=100, lr=3e-3, warmup=10,
                eval_every=25, eval_batches=2, checkpoint_every=50,
                max_train_bytes=4_000_000, attention_share_steps=5),
}


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m examples.train_gpt", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
  p.add_argument("--attention", choices=attention_lib.IMPLEMENTATIONS, default="flash3")
  p.add_argument("--out", default="runs/train_gpt", help="folder for log, plot, checkpoint")
  p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.npz")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--head-dim", type=int, choices=(64, 128), dest="head_dim")
  p.add_argument("--no-segments", action="store_true",
                 help="let attention cross document boundaries (no segment ids)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.add_argument("--flash3-kernels-only", action="store_true",
                 help="flash3 with implementation='mosaic': fail instead of using the XLA path")
  p.add_argument("--stop-at", type=int, default=None,
                 help="end the process after this step, as an interruption would (tests resume)")
  for name in ("num_layers", "num_heads", "num_kv_heads", "mlp_dim", "seq_len", "batch_size",
               "steps", "warmup", "eval_every", "eval_batches", "checkpoint_every",
               "max_train_bytes", "attention_share_steps"):
    p.add_argument("--" + name.replace("_", "-"), type=int, dest=name)
  p.add_argument("--lr", type=float)
  args = p.parse_args(argv)
  for k, v in PRESETS[args.preset].items():
    if getattr(args, k, None) is None:
      setattr(args, k, v)
  if args.head_dim is None:
    args.head_dim = PRESETS[args.preset]["head_dim"]
  # Sizes argparse cannot check alone (a zero T "trained" to a loss of 0).
  for name in ("num_layers", "num_heads", "num_kv_heads", "mlp_dim", "seq_len",
               "batch_size", "steps", "eval_every", "eval_batches", "checkpoint_every"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')}={getattr(args, name)}; allowed: an int >= 1")
  for name in ("warmup", "attention_share_steps"):
    if getattr(args, name) < 0:
      p.error(f"--{name.replace('_', '-')}={getattr(args, name)}; allowed: an int >= 0")
  if args.max_train_bytes is not None and args.max_train_bytes < 1:
    p.error(f"--max-train-bytes={args.max_train_bytes}; allowed: an int >= 1")
  if not args.lr > 0:
    p.error(f"--lr={args.lr}; allowed: a number > 0")
  if args.num_heads % args.num_kv_heads:
    p.error(f"--num-heads={args.num_heads} is not a multiple of --num-kv-heads="
            f"{args.num_kv_heads}; allowed: a multiple (grouped-query attention)")
  return args


def parse_with_impls(p: argparse.ArgumentParser, argv=None):
  """A tool's own flags (``p``, which has --impls) and the trainer's (the rest):
  (own, trainer args, implementations); a bad --impls ends in ``p.error``."""
  own, rest = p.parse_known_args(argv)
  args = parse_args(rest)
  try:
    impls = attention_lib.parse_impls(own.impls)
  except ValueError as e:
    p.error(str(e))
  return own, args, impls


MIN_DOC_BYTES = 256  # Shorter files are skipped (see data.stdlib_files).


def load_data(args):
  """(train stream, held-out stream) of the standard library's files, split by file."""
  return data_lib.load_splits(
      min_bytes=MIN_DOC_BYTES, max_train_bytes=args.max_train_bytes,
      max_heldout_bytes=None if args.max_train_bytes is None else args.max_train_bytes // 10)


def model_config(args, attention: str) -> model_lib.Config:
  return model_lib.Config(
      num_layers=args.num_layers, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
      head_dim=args.head_dim, mlp_dim=args.mlp_dim, attention=attention,
      flash3_implementation="mosaic" if args.flash3_kernels_only else None,
      segments=not args.no_segments,
      max_segments=data_lib.max_segments_per_row(args.seq_len, MIN_DOC_BYTES))


def make_optimizer(args) -> optax.GradientTransformation:
  """AdamW, linear warmup then cosine decay to 10%, global-norm clipping at 1.0.

  Weight decay applies to matrices only (not norms' scales)."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, args.lr, args.warmup, max(args.steps, args.warmup + 1), end_value=args.lr * 0.1)
  decay_mask = lambda params: jax.tree.map_with_path(  # noqa: E731
      lambda path, _: "norm" not in jax.tree_util.keystr(path), params)
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask))


def make_train_step(config: model_lib.Config, optimizer, donate: bool = True):
  def step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(lambda p: model_lib.loss_fn(config, p, batch))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return (params, opt_state), loss
  return jax.jit(step, donate_argnums=(0,) if donate else ())


def to_device(batch: data_lib.Batch) -> dict:
  return {k: jnp.asarray(v) for k, v in dataclasses.asdict(batch).items()}


def round_order(fns: dict, r: int) -> list:
  """The (name, fn) pairs in round ``r``'s order: as given, reversed on odd rounds."""
  items = list(fns.items())
  return items if r % 2 == 0 else items[::-1]


def time_alternately(fns: dict, state, batch, steps: int) -> dict[str, list[float]]:
  """Wall seconds of each jitted train step, one step of each in turn, `steps` rounds.

  Alternating makes slow drifts (clocks, other processes) hit every function alike,
  and the order flips every round (A B, B A, ...) so that none always runs right
  after the same other one. Each is compiled and run once first, untimed.
  """
  for fn in fns.values():
    jax.block_until_ready(fn(state, batch))
  times = {name: [] for name in fns}
  for r in range(steps):
    for name, fn in round_order(fns, r):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(state, batch))
      times[name].append(time.perf_counter() - t0)
  return times


def time_kernels_alternately(fns: dict, state, batch, rounds: int,
                             per_round: int = 3) -> dict[str, list[float]]:
  """GPU milliseconds per train step by CUPTI (the sum of every kernel's time,
  no host work or launch gaps): ``per_round`` steps of each function in turn,
  their median, for ``rounds`` rounds. Needs a GPU; the functions must have
  run once already (``time_alternately`` does that).
  """
  from flash3.bench import timing  # noqa: PLC0415
  times = {name: [] for name in fns}
  for r in range(rounds):
    for name, fn in round_order(fns, r):
      times[name].append(timing.measure(fn, (state, batch), iterations=per_round,
                                        warmup=0).median)
  return times


def paired_speed(base: list[float], other: list[float], *, seed: int = 0,
                 resamples: int = 2000) -> tuple[float, float, float]:
  """Speed of ``other`` relative to ``base`` (> 1: faster) from rounds timed in
  pairs: the median of the per-round ratios base / other, and a 95% bootstrap
  interval of that median (resampling rounds)."""
  ratios = np.asarray(base, np.float64) / np.asarray(other, np.float64)
  rng = np.random.default_rng(seed)
  boot = np.median(rng.choice(ratios, (resamples, len(ratios))), axis=1)
  lo, hi = np.percentile(boot, [2.5, 97.5])
  return float(np.median(ratios)), float(lo), float(hi)


def measure_attention_share(config, optimizer, state, batch, steps: int) -> dict:
  """Time the real train step against one with attention replaced by a stand-in.

  The two are timed alternately, one step each, `steps` times, and compared by their
  medians, so that load from other processes hits both alike; the share's 95%
  interval comes from the per-round ratios (``paired_speed``): where it reaches 0
  the share is below timing noise.
  """
  variants = {"with_attention": config,
              "attention_replaced": dataclasses.replace(config, attention="identity")}
  fns = {name: make_train_step(cfg, optimizer, donate=False) for name, cfg in variants.items()}
  times = time_alternately(fns, state, batch, steps)
  share, lo, hi = attention_share(times["with_attention"], times["attention_replaced"])
  return {"method": "1 - median over rounds of t(step, attention replaced by o=q+k+v) / "
          "t(step), timed alternately",
          "step_s": float(np.median(times["with_attention"])),
          "step_s_attention_replaced": float(np.median(times["attention_replaced"])),
          "attention_share": share, "attention_share_ci95": [lo, hi], "timed_steps": steps}


def attention_share(full: list[float], replaced: list[float]) -> tuple[float, float, float]:
  """(share, 95% low, 95% high) of a step's time in attention, from rounds timed
  in pairs: per round replaced / full = 1 - share (``paired_speed``'s ratio
  base / other with base = replaced)."""
  paired, lo, hi = paired_speed(replaced, full)
  return 1.0 - paired, 1.0 - hi, 1.0 - lo


def evaluate(eval_fn, params, batches) -> float:
  return float(np.mean([float(eval_fn(params, b)) for b in batches]))


def plot(log: dict, path: pathlib.Path) -> None:
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, ax = plt.subplots(figsize=(7, 4.5))
  steps = [r["step"] for r in log["steps"]]
  ax.plot(steps, [r["train_loss"] for r in log["steps"]], lw=0.8, alpha=0.6, label="train")
  if log["heldout"]:
    ax.plot([r["step"] for r in log["heldout"]], [r["heldout_loss"] for r in log["heldout"]],
            "o-", label="held-out (other files)")
  ax.set_xlabel("step")
  ax.set_ylabel("next-byte loss (nats)")
  ax.set_title("byte-level GPT on the Python stdlib\n" + textwrap.fill(
      f"attention: {log['attention']}", 90), fontsize=8)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_json(path: pathlib.Path, obj) -> None:
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(obj, indent=1))
  os.replace(tmp, path)


def check_attention_device(attention: str, platform: str,
                           kernels_only: bool = False) -> None:
  """cuDNN needs an NVIDIA GPU and --flash3-kernels-only a Hopper one: say so up
  front, not deep inside the first step."""
  if attention == "cudnn" and platform != "gpu":
    raise SystemExit(f"--attention cudnn needs an NVIDIA GPU; the default device is a "
                     f"{platform}: use --attention flash3 or xla here")
  if attention == "flash3" and kernels_only:
    from flash3._device import why_not_hopper  # noqa: PLC0415
    if (reason := why_not_hopper()) is not None:
      raise SystemExit(f"--flash3-kernels-only needs a Hopper GPU (H100/H200); here: {reason}; "
                       f"without the flag flash3 takes its XLA path here and says so")


def main(argv=None) -> dict:
  """Parse flags, train, and return the log (also written to OUT/log.json)."""
  args = parse_args(argv)
  caught: list[str] = []
  with warnings.catch_warnings():
    # Keep flash3's "using the XLA path because ..." in the log, not only on stderr.
    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
      caught.append(f"{category.__name__}: {message}")
      show(message, category, filename, lineno, file, line)

    warnings.showwarning = record
    return run(args, caught)


def run(args, caught_warnings: list[str]) -> dict:
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  say = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731

  train_stream, heldout_stream = load_data(args)
  config = model_config(args, args.attention)
  device = jax.devices()[0]
  check_attention_device(args.attention, device.platform, args.flash3_kernels_only)
  if args.preset != "cpu" and device.platform == "cpu":
    say(f"warning: --preset {args.preset} on a CPU: a ~90M-parameter model at T="
        f"{args.seq_len}, hours per hundred steps if memory lasts; --preset cpu is "
        f"the size for this machine")
  path_line = attention_lib.describe(args.attention)
  say(f"device: {device.device_kind} ({device.platform}); attention: {path_line}")
  say(f"data: {len(train_stream.files)} train files ({len(train_stream) / 1e6:.1f} MB), "
      f"{len(heldout_stream.files)} held-out files ({len(heldout_stream) / 1e6:.1f} MB) "
      f"from {data_lib.stdlib_root()}")

  optimizer = make_optimizer(args)
  params = model_lib.init_params(config, jax.random.key(args.seed))
  state = (params, optimizer.init(params))
  say(f"model: {model_lib.num_params(params) / 1e6:.2f}M params, {config.num_layers} layers, "
      f"N={config.num_heads} K={config.num_kv_heads} D={config.head_dim}; "
      f"B={args.batch_size} T={args.seq_len}, {args.steps} steps")

  ckpt_path = out / "checkpoint.npz"
  log_path = out / "log.json"
  start = 0
  log = {"args": vars(args), "config": dataclasses.asdict(config), "attention": path_line,
         "device": f"{device.device_kind} ({device.platform})", "steps": [], "heldout": [],
         "warnings": caught_warnings}
  if args.resume and not ckpt_path.exists():
    say(f"--resume: no checkpoint at {ckpt_path}; starting from step 0")
  if args.resume and ckpt_path.exists():
    state, start = checkpoint.restore(ckpt_path, state)
    if log_path.exists():
      old = json.loads(log_path.read_text())
      # Steps after the checkpoint will be taken again; keep the log consistent with it.
      log["steps"] = [r for r in old["steps"] if r["step"] <= start]
      log["heldout"] = [r for r in old["heldout"] if r["step"] <= start]
    say(f"resumed from {ckpt_path} after step {start}")

  train_step = make_train_step(config, optimizer)
  eval_fn = jax.jit(lambda p, b: model_lib.loss_fn(config, p, b))
  heldout = [to_device(b) for b in data_lib.heldout_batches(
      heldout_stream, args.eval_batches, args.batch_size, args.seq_len)]

  def batch_for(step: int) -> dict:
    return to_device(data_lib.train_batch(train_stream, step, args.batch_size, args.seq_len,
                                          args.seed))

  if start == 0:
    log["heldout"].append({"step": 0, "heldout_loss": evaluate(eval_fn, state[0], heldout)})
  tokens_per_step = args.batch_size * args.seq_len
  progress = None
  if not args.no_progress:
    from tqdm import tqdm  # noqa: PLC0415
    progress = tqdm(total=args.steps, initial=start, desc=args.attention, unit="step",
                    file=sys.stderr, dynamic_ncols=True, mininterval=1.0)
  t_start = time.perf_counter()
  for step in range(start + 1, args.steps + 1):  # step s consumes batch s; checkpoint at s
    batch = batch_for(step)
    t0 = time.perf_counter()
    state, loss = train_step(state, batch)
    loss = float(loss)  # waits for the step: the timing below is the real step time
    dt = time.perf_counter() - t0
    if not math.isfinite(loss):
      raise FloatingPointError(f"train loss is {loss} at step {step}")
    log["steps"].append({"step": step, "train_loss": loss, "step_s": dt,
                         "tokens_per_s": tokens_per_step / dt})
    postfix = {"loss": f"{loss:.3f}", "tok/s": f"{tokens_per_step / dt:,.0f}"}
    if step % args.eval_every == 0 or step == args.steps:
      log["heldout"].append({"step": step, "heldout_loss": evaluate(eval_fn, state[0], heldout)})
      postfix["heldout"] = f"{log['heldout'][-1]['heldout_loss']:.3f}"
    if step % args.checkpoint_every == 0 or step == args.steps:
      checkpoint.save(ckpt_path, state, step)
      write_json(log_path, log)
    if progress is not None:
      progress.set_postfix(postfix, refresh=False)
      progress.update(1)
    elif step % max(1, args.eval_every // 5) == 0:
      say(f"step {step}: " + ", ".join(f"{k} {v}" for k, v in postfix.items()))
    if args.stop_at is not None and step >= args.stop_at:
      say(f"stopping after step {step} (--stop-at); the last checkpoint is kept")
      if progress is not None:
        progress.close()
      return log
  if progress is not None:
    progress.close()
  wall = time.perf_counter() - t_start

  # Steady state: skip the first steps of this process (compilation, warm-up).
  timed = [r for r in log["steps"] if r["step"] > start + min(5, (args.steps - start) // 4)]
  summary = {"wall_s": wall, "final_train_loss": log["steps"][-1]["train_loss"] if log["steps"]
             else None, "final_heldout_loss": log["heldout"][-1]["heldout_loss"],
             "first_heldout_loss": log["heldout"][0]["heldout_loss"]}
  if timed:
    step_s = float(np.median([r["step_s"] for r in timed]))
    summary.update(median_step_s=step_s, tokens_per_s=tokens_per_step / step_s)
  if args.attention_share_steps > 0:
    share = measure_attention_share(config, optimizer, state, batch_for(args.steps),
                                    args.attention_share_steps)
    summary["attention_time"] = share
  log["summary"] = summary
  write_json(log_path, log)
  plot(log, out / "loss.png")
  msg = (f"done: held-out loss {summary['first_heldout_loss']:.3f} -> "
         f"{summary['final_heldout_loss']:.3f} nats/byte")
  if "tokens_per_s" in summary:
    msg += f"; {summary['tokens_per_s']:,.0f} tokens/s"
  if "attention_time" in summary:
    at = summary["attention_time"]
    lo, hi = at["attention_share_ci95"]
    msg += (f"; attention {100 * at['attention_share']:.0f}% of step time (95% interval "
            f"{100 * lo:.0f}-{100 * hi:.0f}%)" if lo > 0 else
            "; attention's share of step time is below timing noise at this size")
  say(msg + f"; wrote {log_path}, {out / 'loss.png'}, {ckpt_path}")
  return log


if __name__ == "__main__":
  main()
