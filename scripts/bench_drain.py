"""What the interpreter-only barrier drains cost on the GPU (issue 5): a benchmark.

The producer warpgroups of the forward, dq and dk/dv kernels end by waiting
for the last release of every ring slot ("drains"): GPU interpret mode needs
it, the GPU does not. ``flash3.kernels.common.DRAIN_BARRIERS = False`` omits
them on the GPU path. For each shape this script compiles every kernel both
ways (fresh traces: the flag is read at trace time), checks the two variants
are different programs with bitwise equal results, and times them alternately
(A B, B A, A B) with CUPTI (median of ``--iterations`` per round after
warm-up; all kernels of the call, so the XLA prologue of the backward is in
both). Compiles run in ``--jobs`` worker processes at once; the GPU work
(inputs, runs, timing) is serialised by a lock so no two timings overlap.

Shapes: the FlashAttention-3 grid at one length (B*T = 16384, N*D = 2048),
T = 4096, D = 64/128/256, causal (bottom-right) and not, bfloat16.

  cd <repo>; PYTHONPATH=src python3 scripts/bench_drain.py [--time-budget 170]

Prints a markdown table and rewrites $OUT/drain.md (and drain.jsonl) after
every row, so a cut-off run keeps what it measured.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback

_LOCK = None


def _init(lock):
  global _LOCK
  _LOCK = lock
  # Several processes share the GPU: allocate on demand. XLA's autotuner
  # would run kernels on the GPU while another process is timing.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_gpu_autotune_level=0").strip()


def _compile_both(make_fn, avals):
  """({drain: compiled}, whether the two lowered programs differ).

  The flag is set while tracing; jax's caches are cleared in between so
  nothing traced with the other setting is reused.
  """
  import jax
  from flash3.kernels import common
  compiled, texts = {}, {}
  try:
    for drain in (True, False):
      common.DRAIN_BARRIERS = drain
      jax.clear_caches()
      lowered = jax.jit(make_fn()).lower(*avals)
      texts[drain] = lowered.as_text()
      compiled[drain] = lowered.compile()
  finally:
    common.DRAIN_BARRIERS = True
  return compiled, texts[True] != texts[False]


def _task(task):
  """Compiles one kernel (fwd or bwd) at one shape both ways, then times it."""
  what, D, T, causal, iterations, rounds = task
  row = dict(kernel=what, D=D, T=T, causal=causal)
  try:
    import jax
    import jax.numpy as jnp
    from flash3.bench import timing
    from flash3.kernels.backward import attention_backward
    from flash3.kernels.forward import attention_forward
    from flash3.visibility import MaskSpec

    dtype = jnp.bfloat16
    B, N = 16384 // T, 2048 // D
    row.update(B=B, N=N)
    scale = D ** -0.5
    mask = MaskSpec(causal=causal, alignment="bottom_right")
    x = jax.ShapeDtypeStruct((B, T, N, D), dtype)
    lse_aval = jax.ShapeDtypeStruct((B, N, T), jnp.float32)
    fwd = lambda: (lambda q, k, v: attention_forward(q, k, v, scale=scale, mask=mask))
    bwd = lambda: (lambda q, k, v, o, lse, do: attention_backward(
        q, k, v, o, lse, do, scale=scale, mask=mask))
    t0 = time.time()
    if what == "fwd":
      compiled, differ = _compile_both(fwd, (x, x, x))
    else:
      compiled, differ = _compile_both(bwd, (x, x, x, x, lse_aval, x))
      forward = jax.jit(fwd()).lower(x, x, x).compile()
    row["compile_s"] = round(time.time() - t0, 1)
    # The flag must change the program, or the comparison is of one program.
    row["programs_differ"] = differ

    with _LOCK:  # All GPU work of this task, alone on the GPU.
      keys = jax.random.split(jax.random.key(0), 4)
      q, k, v, do = (jax.random.normal(kk, (B, T, N, D), dtype) for kk in keys)
      args = (q, k, v)
      if what == "bwd":
        o, lse = forward(q, k, v)
        args = (q, k, v, o, lse, do)
      outs = {d: jax.block_until_ready(compiled[d](*args)) for d in (True, False)}
      row["same_output"] = all(
          bool(jnp.array_equal(a, b)) for a, b in
          zip(jax.tree.leaves(outs[True]), jax.tree.leaves(outs[False])))
      times = {True: [], False: []}
      round_medians = {True: [], False: []}
      for r in range(rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        for drain in order:
          t = timing.measure(compiled[drain], args, iterations=iterations)
          times[drain] += t.times_ms
          round_medians[drain].append(t.median)
    with_ms, without_ms = (statistics.median(times[d]) for d in (True, False))
    # How far the medians of repeated rounds of the same program lie apart:
    # differences below this are noise.
    noise = max((max(m) - min(m)) / statistics.median(m)
                for m in round_medians.values())
    row.update(ms_with=with_ms, ms_without=without_ms,
               diff_pct=100.0 * (with_ms - without_ms) / without_ms,
               noise_pct=100.0 * noise, runs=len(times[True]))
  except Exception as e:  # noqa: BLE001 - a failing case is a result too
    row.update(error=f"{type(e).__name__}: {e}"[:400],
               tb=traceback.format_exc()[-1500:])
  return row


HEADER = ("| kernel | D | T | causal | ms with drains | ms without | difference | "
          "round-to-round noise | same output | programs differ |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def _line(row) -> str:
  head = f"| {row['kernel']} | {row['D']} | {row['T']} | {int(row['causal'])} |"
  if "error" in row:
    return f"{head} ERROR: {row['error'][:200]} | | | | | |"
  return (f"{head} {row['ms_with']:.4f} | {row['ms_without']:.4f} | "
          f"{row['diff_pct']:+.2f}% | {row['noise_pct']:.2f}% | "
          f"{'yes' if row['same_output'] else 'NO'} | "
          f"{'yes' if row['programs_differ'] else 'NO'} |")


def _write_md(path, rows, preamble):
  order = {"fwd": 0, "bwd": 1}
  rows = sorted(rows, key=lambda r: (order[r["kernel"]], r["D"], r["causal"]))
  ok = [r for r in rows if "error" not in r]
  lines = [preamble, "", HEADER] + [_line(r) for r in rows]
  if ok:
    worst = max(ok, key=lambda r: abs(r["diff_pct"]))
    lines += ["", f"{len(ok)} of {len(rows)} cases measured; largest difference "
              f"{worst['diff_pct']:+.2f}% ({worst['kernel']} D={worst['D']} "
              f"causal={int(worst['causal'])}); difference = (with - without) / "
              "without; positive means the drains cost time."]
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--D", type=int, nargs="+", default=[64, 128, 256])
  ap.add_argument("--T", type=int, default=4096)
  ap.add_argument("--what", nargs="+", default=["fwd", "bwd"], choices=("fwd", "bwd"))
  ap.add_argument("--iterations", type=int, default=10,
                  help="timed runs per round (>= 10 for the issue's method)")
  ap.add_argument("--rounds", type=int, default=3,
                  help="alternating rounds per variant (A B, B A, A B, ...)")
  ap.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1))
  ap.add_argument("--time-budget", type=float, default=170.0, help="seconds")
  ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/flash3-drain"))
  args = ap.parse_args()
  if args.iterations < 1 or args.rounds < 1 or args.jobs < 1:
    ap.error(f"--iterations={args.iterations}, --rounds={args.rounds} and "
             f"--jobs={args.jobs} must all be >= 1")
  if 16384 % args.T or any(2048 % d for d in args.D):
    ap.error(f"--T={args.T} must divide 16384 and every --D {args.D} must divide 2048 "
             "(the FlashAttention-3 grid)")
  start = time.time()
  os.makedirs(args.out, exist_ok=True)
  md_path = os.path.join(args.out, "drain.md")
  jsonl_path = os.path.join(args.out, "drain.jsonl")
  tasks = [(w, D, args.T, bool(c), args.iterations, args.rounds)
           for w, D, c in itertools.product(args.what, args.D, (0, 1))]
  preamble = (f"# Barrier drains on the GPU: with and without\n\n"
              f"bfloat16, B*T = 16384, N*D = 2048, causal = bottom-right; CUPTI time "
              f"of all kernels of one call, median of {args.rounds} x "
              f"{args.iterations} runs per variant, variants alternated. "
              f"`scripts/bench_drain.py`.")
  try:
    import subprocess
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                          "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=30).stdout.strip()
    preamble += f" GPU: {gpu or 'unknown'}."
  except Exception:  # noqa: BLE001 - the table is still useful without it
    pass
  print(f"{len(tasks)} cases, {args.jobs} workers, budget {args.time_budget:.0f} s",
        flush=True)
  print(HEADER, flush=True)
  rows = []
  ctx = mp.get_context("spawn")
  lock = ctx.Lock()
  pool = ctx.Pool(min(args.jobs, len(tasks)), initializer=_init, initargs=(lock,))
  try:
    results = pool.imap_unordered(_task, tasks)
    with open(jsonl_path, "a") as f:
      for _ in tasks:
        left = args.time_budget - (time.time() - start)
        try:
          if left <= 0:
            raise mp.TimeoutError
          row = results.next(timeout=left)
        except mp.TimeoutError:
          print(f"time budget of {args.time_budget:.0f} s spent; "
                f"{len(tasks) - len(rows)} cases not measured", flush=True)
          break
        rows.append(row)
        f.write(json.dumps(row) + "\n")
        f.flush()
        print(_line(row), flush=True)
        if "error" in row:
          print(row.get("tb", ""), file=sys.stderr, flush=True)
        _write_md(md_path, rows, preamble)
  finally:
    pool.terminate()
    pool.join()
  _write_md(md_path, rows, preamble)
  print(f"wrote {md_path} ({len(rows)} of {len(tasks)} cases) in "
        f"{time.time() - start:.0f} s", flush=True)
  return 0 if rows and all("error" not in r for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
