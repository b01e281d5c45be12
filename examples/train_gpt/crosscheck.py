"""One trained checkpoint, evaluated with every attention implementation.

  python -m examples.train_gpt.crosscheck --preset h200 --out runs/flash3 --impls flash3,cudnn,xla

Two training runs that differ only in their attention kernel drift apart after a
few dozen steps (different rounding, then a different trajectory), so their loss
curves agree only statistically. This check is exact instead: it restores one
checkpoint (``OUT/checkpoint.npz``, written by the trainer with the same flags)
and computes the held-out loss of those same parameters on the same batches with
each implementation in ``--impls``, so only the attention arithmetic differs
(a kernel that let a query see a wrong key, across documents or past the causal
diagonal, would show here); then the gradient of the first batch's loss with
respect to every parameter (the backward kernels), compared as one vector with
the first implementation's: relative L2 difference and cosine. On the H200
(docs/training.md, 2026-12-02) the 300-step h200 checkpoint gave flash3, cuDNN
and XLA the same held-out loss to 3e-5 nats (per batch 7e-5), while two flash3
training runs from the same seed ended 0.009 apart (the gradients were added
after that run). Prints one row per implementation; --json writes them.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import numpy as np

from . import attention as attention_lib
from . import checkpoint
from . import data as data_lib
from . import model as model_lib
from . import train as train_lib


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog="python -m examples.train_gpt.crosscheck", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="Every other option is the trainer's (python -m examples.train_gpt --help): "
             "--preset, --out (the checkpoint's folder), --flash3-kernels-only, sizes, ...")
  p.add_argument("--impls", default="flash3,cudnn,xla",
                 help="comma-separated attention implementations, the first is the "
                      f"baseline (from {', '.join(attention_lib.IMPLEMENTATIONS)})")
  p.add_argument("--json", default=None, help="write the results to this JSON file")
  own, args, impls = train_lib.parse_with_impls(p, argv)
  args.impls, args.json_out = impls, own.json
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  say = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
  ckpt = pathlib.Path(args.out) / "checkpoint.npz"
  if not ckpt.exists():
    raise SystemExit(f"--out {args.out!r}: no checkpoint.npz there; train first with the "
                     f"same flags (python -m examples.train_gpt --out {args.out})")
  platform = jax.devices()[0].platform
  for impl in args.impls:
    train_lib.check_attention_device(impl, platform, args.flash3_kernels_only)
  _, heldout_stream = train_lib.load_data(args)
  heldout = [train_lib.to_device(b) for b in data_lib.heldout_batches(
      heldout_stream, args.eval_batches, args.batch_size, args.seq_len)]
  config = train_lib.model_config(args, args.impls[0])
  template = model_lib.init_params(config, jax.random.key(args.seed))
  optimizer = train_lib.make_optimizer(args)
  (params, _), step = checkpoint.restore(ckpt, (template, optimizer.init(template)))
  say(f"checkpoint {ckpt} after step {step}; {len(heldout)} held-out batches of "
      f"B={args.batch_size} T={args.seq_len}")
  losses, grads = {}, {}
  for impl in args.impls:
    cfg = train_lib.model_config(args, impl)
    loss = lambda p, b, cfg=cfg: model_lib.loss_fn(cfg, p, b)  # noqa: E731
    eval_fn = jax.jit(loss)
    losses[impl] = [float(eval_fn(params, b)) for b in heldout]
    # The backward too: the gradient of the first batch's loss, as one vector.
    g = jax.jit(jax.grad(loss))(params, heldout[0])
    grads[impl] = np.concatenate([np.asarray(x, np.float64).ravel()
                                  for x in jax.tree.leaves(g)])
    del g
  base = np.asarray(losses[args.impls[0]])
  g0 = grads[args.impls[0]]
  rows = []
  for impl in args.impls:
    per_batch, g = np.asarray(losses[impl]), grads[impl]
    rows.append({"attention": impl, "path": attention_lib.describe(impl),
                 "heldout_loss": float(per_batch.mean()),
                 "diff_vs_first": float(per_batch.mean() - base.mean()),
                 "max_batch_abs_diff": float(np.max(np.abs(per_batch - base))),
                 "per_batch": per_batch.tolist(),
                 "grad_rel_diff_vs_first": float(np.linalg.norm(g - g0) / np.linalg.norm(g0)),
                 "grad_cosine_vs_first": float(g @ g0 / (np.linalg.norm(g) * np.linalg.norm(g0)))})
  first = args.impls[0]
  print(f"| attention | held-out loss (nats/byte) | minus {first} "
        f"| largest per-batch difference | gradient: relative L2 difference from {first} "
        f"| gradient: cosine with {first} |\n|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['attention']} | {r['heldout_loss']:.5f} | {r['diff_vs_first']:+.2e} "
          f"| {r['max_batch_abs_diff']:.2e} | {r['grad_rel_diff_vs_first']:.2e} "
          f"| {r['grad_cosine_vs_first']:.6f} |")
  result = {"checkpoint": str(ckpt), "step": step, "batch_size": args.batch_size,
            "seq_len": args.seq_len, "segments": not args.no_segments, "results": rows}
  if args.json_out:
    train_lib.write_json(pathlib.Path(args.json_out), result)
  return result


if __name__ == "__main__":
  main()
