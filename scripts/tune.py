"""Sweeps kernel configs against cuDNN on an H100/H200 (a tuning tool, not a test).

Each (shape, config) is compiled and run once in one of ``--jobs`` worker
processes at the same time (Mosaic GPU compiles take seconds of CPU each);
the timing itself is serialised by a lock, so one process at a time measures
(CUPTI kernel time, median of ``--iterations`` after warm-up) its config and,
in the same locked section, cuDNN on the same inputs: every row carries its
own cuDNN ratio. FLOPs: FlashAttention-3's convention.

  PYTHONPATH=src python3 scripts/tune.py --what fwd --out $OUT/tune --jobs 8
  # the persistent kernel (issue 3) next to the grid kernel, non-causal:
  PYTHONPATH=src python3 scripts/tune.py --what fwd --persistent 0 1 --causal 0
  # a sliding window of 1024 (issue 6's mask suite shape at T=16384, D=128):
  PYTHONPATH=src python3 scripts/tune.py --what fwd --D 128 --T 16384 --causal 1 --window 1024
  # packed rows of 8 documents (segment ids; cuDNN gets the same dense mask):
  PYTHONPATH=src python3 scripts/tune.py --what fwd --T 16384 --docs 8 --vary persistent=0,1

Writes one JSON line per measurement to ``<out>/tune_<what>.jsonl`` as it goes
and prints a markdown row per measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback

import numpy as np

_LOCK = None


def _init(lock):
  global _LOCK
  _LOCK = lock
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _register_pairs(values):
  """["232,40", "240,24"] -> ((232, 40), (240, 24)); exits on a malformed or
  invalid pair (ForwardConfig's register rules) before anything runs."""
  from flash3.kernels.config import ForwardConfig
  pairs = []
  for v in values:
    try:
      cr, pr = (int(x) for x in v.split(","))
      ForwardConfig(compute_registers=cr, producer_registers=pr)
    except ValueError as e:
      raise SystemExit(f"--registers {v!r}: {e}") from None
    pairs.append((cr, pr))
  return tuple(pairs)


def _fwd_candidates(D, causal, persistent=(False,), num_sms=132,
                    block_kvs=(64, 128, 192, 256), stages=(2, 3, 4),
                    overlap=(False,), registers=((232, 40),)):
  """Forward configs that fit; ``persistent`` lists the values of that field to sweep.

  Persistent variants stage o apart from q where shared memory allows
  (``config.persistent_separate_o``), in the q tile otherwise.
  """
  from flash3.kernels.config import ForwardConfig, check_fits
  out = []
  for bk, st, ov, (cr, pr) in itertools.product(block_kvs, stages, overlap, registers):
    c = ForwardConfig(block_kv=bk, num_stages=st, overlap_softmax=bool(ov),
                      compute_registers=cr, producer_registers=pr)
    try:
      check_fits(c, D, 2)
    except ValueError:
      continue
    for p in persistent:
      cp = dataclasses.replace(c, persistent=bool(p), num_sms=num_sms)
      out.append(cp)
      if causal:
        out.append(dataclasses.replace(cp, reverse_q_tiles=True))
  return out


def _bwd_candidates(D, causal, nondeterministic=False, window=None, T=4096,
                    registers=((232, 40),)):
  """The configs of ``_bwd_variants``, each with every (compute, producer)
  register pair of ``registers`` (setmaxnreg), in that order; configs with one
  compute warpgroup in both kernels set no registers, so they run once."""
  out = []
  for c in _bwd_variants(D, causal, nondeterministic, window, T):
    one_wg = c.compute_wgs_dq == 1 and c.compute_wgs_dkv == 1
    for cr, pr in registers[:1] if one_wg else registers:
      r = dataclasses.replace(c, compute_registers=cr, producer_registers=pr)
      if r not in out:
        out.append(r)
  return out


def _bwd_variants(D, causal, nondeterministic=False, window=None, T=4096):
  """Backward configs that fit; with ``nondeterministic`` only the single-kernel
  variants (BackwardConfig.deterministic=False: dq by TMA reduce-add), beside
  the heuristic's deterministic config for reference."""
  from flash3.kernels.backward import BackwardConfig
  from flash3.visibility import MaskSpec
  # The default for this mask (a window changes it), then variants of it.
  base = BackwardConfig.heuristic(D, T, T, MaskSpec(
      causal=causal, window_left=window,
      window_right=None if window is None or causal else window))
  if nondeterministic:
    if D > 128:  # dk and dv float32 (64, 256) tiles: no registers for dq too.
      return [base]
    fused = dataclasses.replace(base, split_dkv=False, block_q_dkv=64,
                                deterministic=False, fuse_delta=False)
    cands = [base]
    for kw in (dict(), dict(num_stages=3), dict(fuse_matmuls=True),
               dict(compute_wgs_dkv=1), dict(num_stages=1), dict(share_dq=True),
               dict(share_dq=True, num_stages=3), dict(share_dq=True, fuse_matmuls=True),
               dict(share_dq=True, pair_dq=True)):
      cands.append(dataclasses.replace(fused, **kw))
    return _fitting(cands, D)
  cands = [base, dataclasses.replace(base, fuse_matmuls=True)]
  if causal:
    cands.append(dataclasses.replace(base, reverse_q_tiles=True))
  if D <= 128:
    # Not role_split: 23-31% slower here with 64-key tiles, 0.76-0.88 of cuDNN
    # with 128 (fifteenth session); `--vary role_split=0,1` still runs it.
    for kw in (dict(num_stages=3), dict(block_q_dkv=128 if base.block_q_dkv == 64 else 64),
               dict(block_kv_dq=128 if base.block_kv_dq == 64 else 64), dict(compute_wgs_dq=1, block_q_dq=128, block_kv_dq=64)):
      cands.append(dataclasses.replace(base, **kw))
  else:
    for kw in (dict(num_stages=3),
               # dk and dv in two launches (the dk/dv default before
               # role_split; the dq kernel as in base).
               dict(compute_wgs_dkv=1, split_dkv=True, role_split=False),
               dict(num_stages_dkv=1),
               # The dq kernel's one warpgroup, the default above head_dim
               # 128 before the sixteenth session (the same as base at 256).
               dict(compute_wgs_dq=1)):
      cands.append(dataclasses.replace(base, **kw))
  return _fitting(cands, D)


def _replace(what, base, kw):
  """``base`` with ``kw``; a backward default's fuse_delta dropped where ``kw``
  cannot take it (the single kernel, or a dq grid whose rows do not cover the
  dk/dv kernel's tiles) unless ``kw`` names it."""
  try:
    return dataclasses.replace(base, **kw)
  except ValueError:
    if what != "bwd" or not base.fuse_delta or "fuse_delta" in kw:
      raise
    return dataclasses.replace(base, **kw, fuse_delta=False)


def _vary_candidates(what, D, T, causal, window, vary, docs=None):
  """The default config for this shape (packed rows when ``docs``) with every
  combination of ``vary`` ({field: [values]}) applied: an A/B of config
  fields at the defaults."""
  from flash3.kernels.backward import BackwardConfig
  from flash3.kernels.config import can_halve_tiles, check_fits
  from flash3.kernels.forward import default_config
  from flash3.visibility import MaskSpec
  mask = MaskSpec(causal=causal, alignment="bottom_right", window_left=window,
                  window_right=None if window is None or causal else window)
  base = (default_config(D, "bfloat16", mask, T, T, packed=docs is not None)
          if what == "fwd"
          else BackwardConfig.heuristic(D, T, T, mask, packed=docs is not None))
  names = list(vary)
  out = []
  for values in itertools.product(*(vary[n] for n in names)):
    kw = dict(zip(names, values))
    if (what == "fwd" and base.half_edge_tiles and "half_edge_tiles" not in kw
        and not can_halve_tiles(kw.get("block_kv", base.block_kv),
                                kw.get("overlap_softmax", base.overlap_softmax))):
      # A window's or causal mask's default takes half edge tiles, which
      # these cannot run.
      kw["half_edge_tiles"] = False
    try:
      c = _replace(what, base, kw)
    except ValueError as e:
      print(f"skipped {dict(zip(names, values))}: {e}", flush=True)
      continue
    try:  # Only configs that fit shared memory.
      check_fits(c, D, 2) if what == "fwd" else c.check_fits(D, 2)
    except ValueError as e:
      print(f"skipped {c}: {e}", flush=True)
      continue
    if c not in out:
      out.append(c)
  return out


def _variant_candidates(what, D, T, causal, window, vary, variants, docs=None):
  """``_vary_candidates`` (the default alone when ``vary`` is empty), then one
  candidate per ``variants`` entry ({field: [value]}: the default with all
  those fields set together), each once."""
  out = _vary_candidates(what, D, T, causal, window, vary, docs)
  for fields in variants:
    for c in _vary_candidates(what, D, T, causal, window, fields, docs):
      if c not in out:
        out.append(c)
  return out


def _parse_vary(items, what="fwd"):
  """["named_barriers=0,1", "num_stages=2,3", "pingpong=handoff,off"] ->
  {field: [values]} (ints; 0 / 1 become bools for bool fields; strings for
  str fields) for the config class of ``what``."""
  from flash3.kernels.backward import BackwardConfig
  from flash3.kernels.config import ForwardConfig
  cls = ForwardConfig if what == "fwd" else BackwardConfig
  fields = {f.name: f for f in dataclasses.fields(cls)}
  vary = {}
  for item in items:
    name, _, vals = item.partition("=")
    if name not in fields or not vals:
      raise SystemExit(f"--vary {item!r}: expected FIELD=V1,V2 with a field of "
                       f"{cls.__name__}")
    if fields[name].type in ("bool", bool):
      conv = lambda x: bool(int(x))
    elif fields[name].type in ("str", str):
      conv = str.strip
    else:
      conv = int
    vary[name] = [conv(v) for v in vals.split(",")]
    if conv is str.strip:  # A typo would only drop a candidate later: refuse it now.
      for v in vary[name]:
        try:
          cls(**{name: v})
        except ValueError as e:
          raise SystemExit(f"--vary {item!r}: {e}") from None
  return vary


def _fitting(cands, D):
  ok = []
  for c in cands:
    try:
      c.check_fits(D, 2)
    except ValueError:
      continue
    if c not in ok:
      ok.append(c)
  return ok


def _visible_pairs(T: int, causal: bool, window: int | None,
                   docs: int | None = None) -> float:
  """(Query, key) pairs counted for one (batch, head), Tq = Tk = T, as
  flash3-bench counts them: FA3's T * T / 2 for plain causal, else the
  visible pairs exactly; with ``docs``, T holds that many equal documents,
  each on its own."""
  if docs is not None:
    return docs * _exact_pairs(T // docs, causal, window)
  if causal and window is None:
    return T * T / 2
  return _exact_pairs(T, causal, window)


def _exact_pairs(T: int, causal: bool, window: int | None) -> float:
  pos = np.arange(T)
  lo = np.zeros(T) if window is None else np.maximum(0, pos - window)
  if causal:
    hi = pos + 1
  elif window is not None:
    hi = np.minimum(T, pos + window + 1)
  else:
    hi = np.full(T, T)
  return float(np.sum(hi - lo))


def _task(task):
  """Compile and warm one (shape, config); then time it and cuDNN under the lock."""
  what, dtype_name, D, T, causal, window, docs, softcap, config, iterations = task
  import jax
  import jax.numpy as jnp
  from jax.experimental.mosaic.gpu import profiler
  from flash3.bench import timing
  from flash3.kernels.backward import attention_backward
  from flash3.kernels.forward import attention_forward
  from flash3.visibility import MaskSpec
  row = dict(what=what, dtype=dtype_name, D=D, T=T, causal=causal, config=repr(config))
  if window is not None:
    row["window"] = window
  if docs is not None:
    row["docs"] = docs
  if softcap is not None:
    row["softcap"] = softcap
  try:
    dtype = jnp.dtype(dtype_name)
    B, N = max(1, 16384 // T), 2048 // D  # 16384 tokens a call (one row beyond)
    shape = jax.ShapeDtypeStruct((B, T, N, D), dtype)
    q = k = v = do = shape  # Real inputs are made under the lock (see below).
    scale = D ** -0.5
    mask = MaskSpec(causal=causal, alignment="bottom_right", window_left=window,
                    window_right=None if window is None or causal else window)
    nn_window = None if window is None else (window, 0 if causal else window)
    flops = 4 * B * N * D * _visible_pairs(T, causal, window, docs)
    seg, nn_mask = {}, None
    if docs is not None:  # Equal documents; cuDNN gets them as a dense mask.
      ids = jnp.broadcast_to(jnp.repeat(jnp.arange(docs, dtype=jnp.int32), T // docs),
                             (B, T))
      seg = dict(q_segment_ids=ids, kv_segment_ids=ids)
      nn_mask = (ids[:, None, :, None] == ids[:, None, None, :])
    if softcap is not None:  # Ours only: jax.nn has no soft cap, cuDNN runs without.
      seg["softcap"] = softcap
    if what == "fwd":
      ours = jax.jit(lambda q, k, v: attention_forward(
          q, k, v, scale=scale, mask=mask, config=config, **seg))
      theirs = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, scale=scale, is_causal=causal, local_window_size=nn_window,
          mask=nn_mask, implementation="cudnn"))
      args_ours = args_theirs = (q, k, v)
    else:
      flops *= 2.5
      forward = jax.jit(lambda q, k, v: attention_forward(
          q, k, v, scale=scale, mask=mask, **seg))
      ours = jax.jit(lambda q, k, v, o, lse, do: attention_backward(
          q, k, v, o, lse, do, scale=scale, mask=mask, config=config, **seg))
      args_ours = (q, k, v) + tuple(jax.eval_shape(forward, q, k, v)) + (do,)

      def cudnn_fwd(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                            local_window_size=nn_window,
                                            mask=nn_mask, implementation="cudnn")

      def cudnn_bwd(q, k, v, do):
        _, vjp = jax.vjp(cudnn_fwd, q, k, v)
        return vjp(do)
      # cuDNN's backward alone = its forward+backward minus its forward.
      theirs = (jax.jit(cudnn_bwd), jax.jit(cudnn_fwd))
      args_theirs = (q, k, v, do)
    # Compiling needs no GPU, so it runs beside other workers; everything that runs on
    # the GPU (inputs, the backward's forward, warm-up) waits for the lock, or it would
    # overlap another worker's timing (cuDNN's times spread by 10% before).
    ours = ours.lower(*args_ours).compile()

    def med(f, args):
      for _ in range(2):
        jax.block_until_ready(f(*args))
      _, ts = profiler.measure(f, iterations=iterations)(*args)
      return statistics.median(ts)

    with _LOCK:
      keys = jax.random.split(jax.random.key(0), 4)
      q, k, v, do = (jax.random.normal(kk, shape.shape, dtype) for kk in keys)
      if what == "fwd":
        args_ours = args_theirs = (q, k, v)
      else:
        args_ours = (q, k, v) + tuple(forward(q, k, v)) + (do,)
        args_theirs = (q, k, v, do)
      t_ours = med(ours, args_ours)
      if what == "fwd":
        t_ref = med(theirs, args_theirs)
      else:
        t_ref = med(theirs[0], args_theirs) - med(theirs[1], args_theirs[:3])
    row.update(ms=t_ours, cudnn_ms=t_ref, tflops=flops / t_ours / 1e9,
               cudnn_tflops=flops / t_ref / 1e9, ratio=t_ref / t_ours)
    if what == "bwd":
      try:  # One call, kernel by kernel: where the backward's time goes.
        with _LOCK:
          _, timings = profiler.measure(ours, aggregate=False)(*args_ours)
        row["kernels_ms"] = timing.by_kernel(timings)  # the dq / dk/dv split
      except Exception as e:  # noqa: BLE001 - the row's timing stands without it
        row["kernels_ms_error"] = f"{type(e).__name__}: {e}"[:200]
  except Exception as e:  # noqa: BLE001 - a failing config is a result too
    row.update(error=f"{type(e).__name__}: {e}"[:400],
               tb=traceback.format_exc()[-800:])
  return row


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--what", choices=("fwd", "bwd"), default="fwd")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--D", type=int, nargs="+", default=[64, 128, 256])
  ap.add_argument("--T", type=int, nargs="+", default=[4096, 16384])
  ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
  ap.add_argument("--window", type=int, default=None,
                  help="a local window: keys at most this far before (and, without "
                       "causal, after) the query; cuDNN gets the same window")
  ap.add_argument("--softcap", type=float, default=None,
                  help="logits soft cap c > 0 for flash3 (Gemma 2's tanh cap); cuDNN, "
                       "which jax.nn gives no cap, runs without it, so its ratio is "
                       "only a reference")
  ap.add_argument("--docs", type=int, default=None,
                  help="packed rows: this many equal documents per row (segment "
                       "ids; cuDNN gets them as a dense mask)")
  ap.add_argument("--persistent", type=int, nargs="+", default=[0],
                  help="fwd: values of ForwardConfig.persistent to sweep (0 1 for both)")
  ap.add_argument("--overlap", type=int, nargs="+", default=[0],
                  help="ForwardConfig.overlap_softmax values to sweep, e.g. 0 1")
  ap.add_argument("--registers", nargs="+", default=["232,40"],
                  help="COMPUTE,PRODUCER register counts (setmaxnreg) to sweep, "
                       "e.g. 232,40 240,24 (the defaults are 232,40, except the "
                       "forward's D=64 grid kernel with 256-key tiles: 240,24)")
  ap.add_argument("--num-sms", type=int, default=132,
                  help="fwd: CTAs of the persistent kernel (132 SMs on an H200)")
  ap.add_argument("--block-kv", type=int, nargs="+", default=[64, 128, 192, 256],
                  help="fwd: values of block_kv to sweep")
  ap.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4],
                  help="fwd: values of num_stages to sweep")
  ap.add_argument("--nondeterministic", action="store_true",
                  help="bwd: the single-kernel backward (dq by TMA reduce-add) "
                       "variants beside the default")
  ap.add_argument("--vary", nargs="+", default=None,
                  help="instead of a sweep: the default config of each shape "
                       "with these fields varied, e.g. named_barriers=0,1")
  ap.add_argument("--variant", nargs="+", action="append", default=None,
                  metavar="FIELD=VALUE",
                  help="one more candidate beside the default config (or the --vary "
                       "ones): the default with all these fields set together, e.g. "
                       "--variant compute_warpgroups=3 compute_registers=160 "
                       "producer_registers=24 block_kv=128 pingpong=handoff; repeat "
                       "--variant for more")
  ap.add_argument("--jobs", type=int, default=8)
  ap.add_argument("--iterations", type=int, default=10)
  ap.add_argument("--time-budget", type=float, default=300)
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp") + "/tune")
  args = ap.parse_args()
  if args.softcap is not None and not (math.isfinite(args.softcap) and args.softcap > 0):
    ap.error(f"--softcap {args.softcap}: must be a finite number > 0")
  if args.docs is not None and (args.docs < 1 or any(T % args.docs for T in args.T)):
    ap.error(f"--docs {args.docs}: needs a positive divisor of every --T {args.T}")
  os.makedirs(args.out, exist_ok=True)
  start = time.time()
  tasks = []
  vary = _parse_vary(args.vary, args.what) if args.vary else None
  variants = [_parse_vary(v, args.what) for v in args.variant or []]
  for fields in variants:
    if any(len(vals) != 1 for vals in fields.values()):
      ap.error(f"--variant {fields}: one value per field (--vary takes lists)")
  for D, T, causal in itertools.product(args.D, args.T, args.causal):
    if vary is not None or variants:
      cands = _variant_candidates(args.what, D, T, bool(causal), args.window,
                                  vary or {}, variants, args.docs)
    elif args.what == "fwd":
      cands = _fwd_candidates(D, bool(causal), tuple(args.persistent), args.num_sms,
                              tuple(args.block_kv), tuple(args.stages),
                              tuple(args.overlap),
                              _register_pairs(args.registers))
    else:
      cands = _bwd_candidates(D, bool(causal), args.nondeterministic, args.window, T,
                              _register_pairs(args.registers))
    tasks += [(args.what, args.dtype, D, T, bool(causal), args.window, args.docs,
               args.softcap, c, args.iterations) for c in cands]
  print(f"{len(tasks)} measurements, {args.jobs} workers", flush=True)
  path = os.path.join(args.out, f"tune_{args.what}.jsonl")
  ctx = mp.get_context("spawn")
  lock = ctx.Lock()
  print("| D | T | causal | config | ms | TFLOP/s | cudnn TFLOP/s | ratio |")
  print("|---|---|---|---|---|---|---|---|", flush=True)
  with ctx.Pool(args.jobs, initializer=_init, initargs=(lock,), maxtasksperchild=8) as pool, \
      open(path, "a") as f:
    results = pool.imap_unordered(_task, tasks)
    for _ in tasks:
      left = args.time_budget - (time.time() - start)
      if left <= 0:
        print("time budget spent; stopping", flush=True)
        pool.terminate()
        break
      try:
        row = results.next(timeout=left)
      except mp.TimeoutError:
        print("time budget spent; stopping", flush=True)
        pool.terminate()
        break
      f.write(json.dumps(row) + "\n")
      f.flush()
      if "error" in row:
        print(f"| {row['D']} | {row['T']} | {row['causal']} | {row['config']} | "
              f"ERROR {row['error'][:160]} |", flush=True)
      else:
        print(f"| {row['D']} | {row['T']} | {int(row['causal'])} | {row['config']} | "
              f"{row['ms']:.3f} | {row['tflops']:.0f} | {row['cudnn_tflops']:.0f} | "
              f"{row['ratio']:.3f} |", flush=True)
        if row.get("kernels_ms"):
          print("    kernels: " + ", ".join(f"{k} {ms:.3f} ms"
                                           for k, ms in row["kernels_ms"].items()),
                flush=True)
  print(f"done in {time.time() - start:.0f} s", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
