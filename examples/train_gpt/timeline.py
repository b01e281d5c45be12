"""Where a train step's wall time goes: GPU busy time, idle gaps, and what sits at them.

  python -m examples.train_gpt.timeline --preset h200 --impls flash3,cudnn --steps 3

Builds each implementation's train step like ``speed`` (same seed, same batch),
runs it once untimed, then traces ``--steps`` single steps with
``jax.profiler.trace`` and reads each trace back (``jax.profiler.ProfileData``).
Per step it reports the span from the first kernel's start to the last kernel's
end, the union of kernel time (busy), the idle time inside the span, the number
of kernels and streams, and the largest idle gaps with the kernels on either
side. A step whose kernels sum to less than a rival's but whose wall time does
not is losing time in these gaps (launch overhead, host work between kernels).
The traces land under ``--out`` for TensorBoard or Perfetto.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import numpy as np

from . import data as data_lib
from . import model as model_lib
from . import train as train_lib


def kernel_events(xspace_path: pathlib.Path) -> list[tuple[int, int, str, str]]:
  """(start_ns, end_ns, kernel name, stream) of every event on the GPU planes."""
  data = jax.profiler.ProfileData.from_file(str(xspace_path))
  events = []
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      # Streams carry kernels and copies; skip XLA's op/module summary lines.
      if not line.name.startswith("Stream"):
        continue
      for e in line.events:
        events.append((int(e.start_ns), int(e.end_ns), e.name, line.name))
  events.sort()
  return events


def by_name(timings, top: int) -> list[dict]:
  """(name, ms) pairs -> the ``top`` names by total time: name (80 chars), ms, count."""
  totals: dict[str, list[float]] = {}
  for name, ms in timings:
    entry = totals.setdefault(name[:80], [0.0, 0])
    entry[0] += ms
    entry[1] += 1
  ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
  return [{"name": k, "ms": v[0], "count": v[1]} for k, v in ranked[:top]]


def is_copy(name: str) -> bool:
  """Whether a GPU event is a copy or memset (streams carry them beside kernels)."""
  name = name.lower()
  return "memcpy" in name or "memset" in name


def summarize(events: list[tuple[int, int, str, str]], top: int = 8,
              top_names: int = 25) -> dict:
  """Span, busy time (union of intervals), idle gaps of one step's GPU events;
  "kernels" counts the events that are not copies or memsets ("copies")."""
  if not events:
    return {"kernels": 0, "copies": 0}
  busy, gaps = 0, []
  cur_start, cur_end, cur_name = events[0][0], events[0][1], events[0][2]
  for start, end, name, _ in events[1:]:
    if start > cur_end:
      busy += cur_end - cur_start
      gaps.append((start - cur_end, cur_name, name))
      cur_start = start
    if end > cur_end:
      cur_end, cur_name = end, name
  busy += cur_end - cur_start
  span = cur_end - events[0][0]
  gaps.sort(reverse=True)
  sizes = np.array([g[0] for g in gaps], dtype=np.float64) if gaps else np.zeros(1)
  return {
      "kernels": sum(not is_copy(e[2]) for e in events),
      "copies": sum(is_copy(e[2]) for e in events), "streams": len({e[3] for e in events}),
      "span_ms": span / 1e6, "busy_ms": busy / 1e6, "idle_ms": (span - busy) / 1e6,
      "gaps": len(gaps), "gaps_over_10us": int((sizes > 1e4).sum()),
      "idle_in_gaps_over_10us_ms": float(sizes[sizes > 1e4].sum() / 1e6),
      "kernel_ms_by_name": by_name(((name, (end - start) / 1e6)
                                    for start, end, name, _ in events), top_names),
      "largest_gaps": [{"us": g[0] / 1e3, "after": g[1][:90], "before": g[2][:90]}
                       for g in gaps[:top]],
  }


def cupti_by_name(fn, state, batch, top: int = 25) -> dict:
  """One step under ``profiler.measure``, the benchmarks' timer, kernel by kernel
  (to check it against the trace: both are CUPTI, read differently)."""
  from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415
  _, timings = profiler.measure(fn, aggregate=False)(state, batch)
  timings = timings or []
  return {"total_ms": sum(ms for _, ms in timings),
          "kernels": sum(not is_copy(name) for name, _ in timings),
          "copies": sum(is_copy(name) for name, _ in timings),
          "kernel_ms_by_name": by_name(timings, top)}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(prog="python -m examples.train_gpt.timeline",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--impls", default="flash3,cudnn")
  p.add_argument("--steps", type=int, default=3, help="traced steps per implementation")
  p.add_argument("--out", default="timeline", help="directory for traces and summary.json")
  own, args, impls = train_lib.parse_with_impls(p, argv)
  platform = jax.devices()[0].platform
  for impl in impls:
    train_lib.check_attention_device(impl, platform, args.flash3_kernels_only)
  say = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
  out = pathlib.Path(own.out)
  train_stream, _ = train_lib.load_data(args)
  batch = train_lib.to_device(data_lib.train_batch(train_stream, 1, args.batch_size,
                                                   args.seq_len, args.seed))
  optimizer = train_lib.make_optimizer(args)
  fns, state, result = {}, None, {}
  for impl in impls:
    config = train_lib.model_config(args, impl)
    if state is None:
      params = model_lib.init_params(config, jax.random.key(args.seed))
      state = (params, optimizer.init(params))
    fns[impl] = train_lib.make_train_step(config, optimizer, donate=False)
    jax.block_until_ready(fns[impl](state, batch))
  # profiler.measure first: its CUPTI session fails ("activity records were
  # dropped") once jax.profiler.trace has subscribed to CUPTI in the process.
  on_gpu = jax.devices()[0].platform == "gpu"
  cupti = {impl: cupti_by_name(fn, state, batch) if on_gpu else None
           for impl, fn in fns.items()}
  for impl, fn in fns.items():
    steps = []
    for i in range(own.steps):
      trace_dir = out / impl / f"step{i}"
      with jax.profiler.trace(str(trace_dir)):
        jax.block_until_ready(fn(state, batch))
      found = sorted(trace_dir.rglob("*.xplane.pb"))
      if not found:
        raise RuntimeError(f"no trace written under {trace_dir}")
      steps.append(summarize(kernel_events(found[-1])))
    result[impl] = {"traced_steps": steps, "cupti_measure": cupti[impl]}
    s = steps[-1]
    if s["kernels"] or s["copies"]:
      say(f"{impl}: {s['kernels']} kernels, {s['copies']} copies / memsets on "
          f"{s['streams']} streams; span "
          f"{s['span_ms']:.2f} ms, busy {s['busy_ms']:.2f}, idle {s['idle_ms']:.2f} "
          f"({s['gaps_over_10us']} gaps > 10 us hold {s['idle_in_gaps_over_10us_ms']:.2f} ms)")
      for g in s["largest_gaps"][:3]:
        say(f"    gap {g['us']:9.1f} us  after {g['after']}  before {g['before']}")
      for k in s["kernel_ms_by_name"][:12]:
        say(f"    {k['ms']:8.3f} ms {k['count']:5d}x  {k['name']}")
    else:
      say(f"{impl}: no GPU kernel events in the trace (no GPU?)")
    c = cupti[impl]
    if c:
      say(f"  profiler.measure (CUPTI) of one step: {c['total_ms']:.2f} ms in "
          f"{c['kernels']} kernels and {c['copies']} copies / memsets")
      for k in c["kernel_ms_by_name"][:12]:
        say(f"    {k['ms']:8.3f} ms {k['count']:5d}x  {k['name']}")
  out.mkdir(parents=True, exist_ok=True)
  (out / "summary.json").write_text(json.dumps(result, indent=1))
  say(f"wrote {out / 'summary.json'}")
  return result


if __name__ == "__main__":
  main()
