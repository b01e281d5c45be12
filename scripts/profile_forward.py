"""Where the forward kernel's time goes, per warpgroup (a diagnostic, GPU only).

Runs ``attention_forward`` once with Mosaic GPU's in-kernel profiler
(``forward.PROFILE``): every named scope of the kernel ("qk", "signal",
"softmax", "turn", "pv", "k_wait", "skip", "epilogue", "setup", "q_wait",
"first_k"; the producer's "slot_wait") is stamped with the SM clock on entry
and exit, per warpgroup, into a Chrome trace (open it in Perfetto). This
script then summarises the trace: the time per scope, the steady step (one
key tile, "qk" start to "qk" start within a work item), and the gap at each
item boundary (the last "pv" of one item to the first "qk" of the next),
in units of steady steps. Times are SM clock cycles (``%clock``; the trace
labels them microseconds but they are thousands of cycles). The buffer lives in shared memory, so only the
first events of each warpgroup fit (the trace is truncated, not wrong).

  PYTHONPATH=src python3 scripts/profile_forward.py --D 128 --T 16384 --causal \\
      --window 1024 --out $OUT/profile
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics
import sys

COMPUTE_WGS = 2  # forward.NUM_COMPUTE_WARPGROUPS; warpgroup 2 is the producer.


def summarize(trace: dict, traces_per_block: int = COMPUTE_WGS + 1) -> str:
  """Markdown tables from a Mosaic GPU profiler trace of the forward kernel."""
  by_tid = collections.defaultdict(list)
  for e in trace["traceEvents"]:
    by_tid[e["tid"]].append(e)
  totals = collections.defaultdict(lambda: collections.defaultdict(float))
  counts = collections.defaultdict(lambda: collections.defaultdict(int))
  spans = collections.defaultdict(float)
  steps, gaps = [], []
  for tid, events in by_tid.items():
    wg = (tid - 1) % traces_per_block
    stack, qk_starts, item_qk = [], [], []
    last_pv_end = None
    events.sort(key=lambda e: e["ts"])  # stable: B before E at equal times
    spans[wg] += events[-1]["ts"] - events[0]["ts"]
    for e in events:
      if e["ph"] == "B":
        stack.append(e)
        if e["name"] == "setup" and wg < COMPUTE_WGS:
          if item_qk:
            qk_starts.append(item_qk)
          item_qk = []
        if e["name"] == "qk":
          if not item_qk and last_pv_end is not None:
            gaps.append(e["ts"] - last_pv_end)
          item_qk.append(e["ts"])
      else:
        b = stack.pop()
        dur = e["ts"] - b["ts"]
        totals[wg][b["name"]] += dur
        counts[wg][b["name"]] += 1
        if b["name"] == "pv":
          last_pv_end = e["ts"]
    if item_qk:
      qk_starts.append(item_qk)
    for starts in qk_starts:
      steps += [b - a for a, b in zip(starts, starts[1:])]
  step = statistics.median(steps) if steps else float("nan")
  lines = ["| warpgroup | scope | total (kcycles) | count | mean (kcycles) | share of span |",
           "|---|---|---|---|---|---|"]
  for wg in sorted(totals):
    who = f"compute {wg}" if wg < COMPUTE_WGS else "producer"
    for name, t in sorted(totals[wg].items(), key=lambda kv: -kv[1]):
      n = counts[wg][name]
      lines.append(f"| {who} | {name} | {t:.1f} | {n} | {t / n:.3f} | "
                   f"{t / spans[wg]:.1%} |")
  lines += ["", f"steady step (one key tile, qk to qk in an item): median "
                f"{step:.3f} kcycles over {len(steps)} steps"]
  if gaps:
    g = statistics.median(gaps)
    lines.append(f"item boundary (last pv end -> next item's first qk): median "
                 f"{g:.3f} kcycles = {g / step:.2f} steps, over {len(gaps)} boundaries")
  return "\n".join(lines)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--B", type=int, default=1)
  ap.add_argument("--T", type=int, default=16384)
  ap.add_argument("--N", type=int, default=16)
  ap.add_argument("--D", type=int, default=128)
  ap.add_argument("--causal", action="store_true")
  ap.add_argument("--window", type=int, default=None)
  ap.add_argument("--docs", type=int, default=None,
                  help="packed documents of equal length per row (segment ids)")
  ap.add_argument("--persistent", type=int, choices=(0, 1), default=None,
                  help="override the default config's persistent field")
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp") + "/profile")
  ap.add_argument("--summarize", default=None, metavar="TRACE",
                  help="only summarise an existing trace file")
  args = ap.parse_args()
  if args.summarize:
    with open(args.summarize) as f:
      print(summarize(json.load(f)))
    return 0

  import dataclasses
  import jax
  import jax.numpy as jnp
  from flash3.kernels import forward
  from flash3.visibility import MaskSpec

  os.makedirs(args.out, exist_ok=True)
  mask = MaskSpec(causal=args.causal, alignment="bottom_right",
                  window_left=args.window,
                  window_right=None if args.window is None or args.causal else args.window)
  config = forward.default_config(args.D, jnp.bfloat16, mask, args.T, args.T,
                                  packed=bool(args.docs))
  seg = {}
  if args.docs:
    ids = jnp.broadcast_to(jnp.arange(args.T, dtype=jnp.int32) // (args.T // args.docs),
                           (args.B, args.T))
    seg = dict(q_segment_ids=ids, kv_segment_ids=ids)
  if args.persistent is not None:
    config = dataclasses.replace(config, persistent=bool(args.persistent))
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(kk, (args.B, args.T, args.N, args.D), jnp.bfloat16)
             for kk in keys)
  # Scope ranges per warpgroup; each takes 16 bytes of shared memory per
  # warpgroup, so what the kernel leaves free bounds it.
  for space in (2048, 1024, 768, 700, 640, 576, 512, 384, 256, 128):
    forward.PROFILE = (space, args.out)
    try:
      f = jax.jit(lambda q, k, v: forward.attention_forward(
          q, k, v, scale=args.D ** -0.5, mask=mask, config=config, **seg))
      jax.block_until_ready(f(q, k, v))
      break
    except Exception as e:  # Too little shared memory left for this buffer.
      if "shared memory" not in str(e):
        raise
  else:
    raise SystemExit("no profile buffer fits in shared memory")
  forward.PROFILE = None
  traces = sorted(glob.glob(os.path.join(args.out, "*-trace.json")))
  with open(traces[-1]) as f:
    text = summarize(json.load(f))
  head = (f"B={args.B} T={args.T} N={args.N} D={args.D} causal={args.causal} "
          f"window={args.window} docs={args.docs}; {config}; profile buffer {space} scope ranges per "
          f"warpgroup; trace {os.path.basename(traces[-1])}\n\n")
  with open(os.path.join(args.out, "summary.md"), "w") as f:
    f.write(head + text + "\n")
  print(head + text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
