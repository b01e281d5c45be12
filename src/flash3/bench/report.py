"""The terminal table, the CSV and JSON files, and where the numbers came from.

Every file carries the environment: GPU name, driver, CUDA runtime, jax and
jaxlib, cuDNN, tokamax, flash3 and its git commit, the date (UTC) and the
command.
"""

from __future__ import annotations

import csv
import datetime
import importlib.metadata
import json
import math
import os
import subprocess
import sys
from typing import Iterable

from flash3.bench.results import DENSE_MASK, FIELDS, Result

ENV_FIELDS = ("gpu", "driver", "cuda_runtime", "jax", "jaxlib", "cudnn",
              "tokamax", "flash3", "git_commit", "source_tree", "date")


def source_tree_hash(path: str) -> str:
  """Git's tree hash of the files under ``path`` (``__pycache__``, ``.pyc`` and
  ``.egg-info`` left out): equal to ``git rev-parse <commit>:src/flash3`` when
  the package's files are that commit's. It names the code that ran even where
  a copy's git metadata lags behind its files (the GPU machines' copies)."""
  import hashlib

  def git_hash(kind: bytes, data: bytes) -> bytes:
    return hashlib.sha1(kind + b" %d\0" % len(data) + data).digest()

  def tree(d: str) -> bytes:
    entries = []
    for name in os.listdir(d):
      full = os.path.join(d, name)
      if name == "__pycache__" or name.endswith((".pyc", ".egg-info")):
        continue
      if os.path.isdir(full):
        sub = tree(full)
        if sub is not None:
          entries.append((name + "/", b"40000 " + name.encode() + b"\0" + sub))
      elif os.path.isfile(full):
        with open(full, "rb") as f:
          blob = git_hash(b"blob", f.read())
        mode = b"100755" if os.access(full, os.X_OK) else b"100644"
        entries.append((name, mode + b" " + name.encode() + b"\0" + blob))
    if not entries:
      return None
    # Git orders entries by name, a directory's name as if it ended in "/".
    body = b"".join(e for _, e in sorted(entries, key=lambda e: e[0].encode()))
    return git_hash(b"tree", body)

  digest = tree(path)
  return digest.hex()[:12] if digest is not None else "unknown"


def _run(cmd: list[str]) -> str | None:
  try:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=10,
                         check=True).stdout.strip()
  except Exception:  # Tool missing or failing: the field says "unknown".
    return None
  return out.splitlines()[0].strip() if out else None


def _version_int(v: int | None, scale: tuple[int, ...]) -> str | None:
  """90300 -> "9.3.0" (cuDNN's and CUDA's integer versions)."""
  if not v:
    return None
  parts = []
  for s in scale:
    parts.append(str(v // s))
    v %= s
  return ".".join(parts)


def environment(argv: list[str] | None = None) -> dict:
  """What the results were produced on, as a flat dict of strings."""
  import jax
  import jaxlib

  import flash3
  env = {name: "unknown" for name in ENV_FIELDS}
  devices = jax.devices()
  env["gpu"] = devices[0].device_kind if devices else "none"
  env["driver"] = _run(["nvidia-smi", "--query-gpu=driver_version",
                        "--format=csv,noheader"]) or "unknown"
  try:
    from jax._src.lib import cuda_versions
    if cuda_versions is not None:
      env["cudnn"] = _version_int(cuda_versions.cudnn_get_version(),
                                  (10000, 100, 1)) or "unknown"
      env["cuda_runtime"] = _version_int(
          cuda_versions.cuda_runtime_get_version(), (1000, 10)) or "unknown"
  except Exception:  # No CUDA plugin: leave "unknown".
    pass
  env["jax"] = jax.__version__
  env["jaxlib"] = jaxlib.__version__
  try:
    env["tokamax"] = importlib.metadata.version("tokamax")
  except importlib.metadata.PackageNotFoundError:
    env["tokamax"] = "not installed"
  env["flash3"] = flash3.__version__
  here = os.path.dirname(os.path.abspath(__file__))
  commit = _run(["git", "-C", here, "rev-parse", "--short=12", "HEAD"])
  if commit:
    # Uncommitted changes anywhere in the flash3 package (kernels included).
    dirty = _run(["git", "-C", here, "status", "--porcelain", "--", ".."])
    env["git_commit"] = commit + ("+dirty" if dirty else "")
  env["source_tree"] = source_tree_hash(os.path.dirname(here))
  env["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds")
  env["command"] = " ".join(["flash3-bench"] + list(
      sys.argv[1:] if argv is None else argv))
  return env


def _fmt(x: float | None, spec: str) -> str:
  return "-" if x is None else format(x, spec)


def table(results: Iterable[Result], baseline: str = "cudnn") -> str:
  """A fixed-width text table, one line per (case, mode, contender).

  Columns: TFLOP/s (median), ms (median), spread ((max - min) / median),
  ratio of TFLOP/s to the baseline, and the status or reason.
  """
  header = ["suite", "dtype", "B", "Tq", "Tk", "N", "K", "D", "mask", "mode",
            "impl", "TFLOP/s", "ms", "spread", f"vs {baseline}", "note"]
  rows = []
  for r in results:
    if r.status == "ok":
      spread = (None if r.min_ms is None or not r.median_ms
                else (r.max_ms - r.min_ms) / r.median_ms * 100)
      note = r.variant if r.mode != "bwd" else r.reason
    else:
      spread = None
      note = f"{r.status}: {r.reason}"
    rows.append([
        r.suite, r.dtype, str(r.batch), str(r.q_len), str(r.kv_len),
        str(r.num_heads), str(r.num_kv_heads), str(r.head_dim), r.mask, r.mode,
        r.impl, _fmt(r.tflops, ".1f"), _fmt(r.median_ms, ".3f"),
        "-" if spread is None else f"{spread:.1f}%",
        _fmt(r.ratio_to_baseline, ".2f"), note[:70]])
  widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
            for i, h in enumerate(header)]
  lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
  lines.append("  ".join("-" * w for w in widths))
  for row in rows:
    lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
  return "\n".join(lines)


def sort_key(r: Result):
  mode_order = {"fwd": 0, "fwd+bwd": 1, "bwd": 2}
  return (r.suite, r.dtype, r.head_dim, r.mask, r.num_heads, r.num_kv_heads,
          r.q_len, mode_order.get(r.mode, 3), r.impl)


def write_csv(path: str, results: Iterable[Result], env: dict) -> None:
  """One row per result; the environment repeated as columns on every row."""
  env_cols = list(env)
  with open(path, "w", newline="") as f:
    writer = csv.writer(f)
    fields = [x for x in FIELDS if x != "times_ms"]
    writer.writerow(fields + ["times_ms"] + env_cols)
    for r in results:
      d = r.to_dict()
      writer.writerow([("" if d[x] is None else d[x]) for x in fields]
                      + [" ".join(f"{t:.6g}" for t in r.times_ms)]
                      + [env[c] for c in env_cols])


def write_json(path: str, results: Iterable[Result], env: dict) -> None:
  with open(path, "w") as f:
    json.dump({"environment": env, "results": [r.to_dict() for r in results]},
              f, indent=1)
    f.write("\n")


def read_json(path: str) -> tuple[dict, list[Result]]:
  """The inverse of write_json (to re-plot or re-tabulate old results)."""
  with open(path) as f:
    data = json.load(f)
  return data["environment"], [Result(**d) for d in data["results"]]


def results_path(path: str) -> str:
  """``path`` itself, or ``path/results.json`` when it is a directory."""
  return os.path.join(path, "results.json") if os.path.isdir(path) else path


def merge_environments(envs: list[dict]) -> dict:
  """One environment for merged results: each field's distinct values, in
  order, joined by " ; " (one value when the runs agree, as the GPU, driver
  and versions should; dates and commands differ)."""
  merged = {}
  for env in envs:
    for key, value in env.items():
      values = merged.setdefault(key, [])
      if value not in values:
        values.append(value)
  return {key: " ; ".join(str(v) for v in values)
          for key, values in merged.items()}


def markdown(results: Iterable[Result], subject: str = "flash3",
             baseline: str = "cudnn") -> str:
  """A Markdown pivot for docs: one line per (case, mode), TFLOP/s per
  contender (a dash where it has no ok result) and subject/baseline; then,
  where the subject's rows record them, its kernel configs per case."""
  results = sorted(results, key=sort_key)
  impls = sorted({r.impl for r in results},
                 key=lambda n: (n != subject, n != baseline, n))
  lines, seen = [], {}
  for r in results:
    seen.setdefault((r.case_key(), r.mode), {})[r.impl] = r
  header = (["suite", "dtype", "D", "N/K", "T", "mask", "mode"]
            + [f"{i} TFLOP/s" for i in impls] + [f"{subject}/{baseline}"])
  lines.append("| " + " | ".join(header) + " |")
  lines.append("|" + "---|" * len(header))
  for (key, mode), by_impl in seen.items():
    first = next(iter(by_impl.values()))
    cells = [first.suite, first.dtype, str(first.head_dim),
             f"{first.num_heads}/{first.num_kv_heads}",
             str(first.q_len) if first.q_len == first.kv_len
             else f"{first.q_len}/{first.kv_len}", first.mask, mode]
    for i in impls:
      r = by_impl.get(i)
      cells.append(_fmt(r.tflops, ".0f") if r is not None
                   and r.status == "ok" else "-")
    s = by_impl.get(subject)
    cells.append(_fmt(s.ratio_to_baseline if s is not None else None, ".2f"))
    lines.append("| " + " | ".join(cells) + " |")
  configs = {}  # One line per case: the subject's kernel configs.
  for (key, _), by_impl in seen.items():
    s = by_impl.get(subject)
    if s is not None and s.config:
      configs.setdefault(key, s)
  if configs:
    lines += ["", f"{subject}'s kernel configs per case:", "",
              "| suite | dtype | D | N/K | T | mask | config |",
              "|---|---|---|---|---|---|---|"]
    for s in configs.values():
      lines.append(f"| {s.suite} | {s.dtype} | {s.head_dim} | "
                   f"{s.num_heads}/{s.num_kv_heads} | {s.q_len} | {s.mask} | "
                   f"{s.config} |")
  return "\n".join(lines)


def _geomean_cell(ratios: list[float]) -> str:
  if not ratios:
    return "-"
  g = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
  return f"{g:.2f} ({min(ratios):.2f}-{max(ratios):.2f}; {len(ratios)})"


def headline(results: Iterable[Result], subject: str = "flash3",
             baseline: str = "cudnn") -> str:
  """The headline figures, in Markdown: each contender's speed over the
  baseline's as a geometric mean (min-max; cases) per suite, dtype, head dim
  and mode, and over each suite; then on how many cases of each mode the
  subject is at least as fast as every other contender that ran.

  A contender given packed documents as a dense mask (``DENSE_MASK``
  variant: jax.nn turns it into a bias and computes every pair) is not the
  same work: those cases stay out of the means and tallies against it, and
  are listed apart."""
  ran = [r for r in results if r.status == "ok" and r.tflops]
  dense = {(r.case_key(), r.mode, r.impl) for r in ran if r.variant == DENSE_MASK}
  vs_dense = lambda r: (r.case_key(), r.mode, baseline) in dense  # noqa: E731
  apart = [r for r in ran if r.ratio_to_baseline and vs_dense(r)]
  ran = [r for r in ran if (r.case_key(), r.mode, r.impl) not in dense]
  results = [r for r in ran if r.ratio_to_baseline is not None
             and r.ratio_to_baseline > 0 and not vs_dense(r)]
  if not results:  # The baseline did not run: only the like-for-like pairs.
    return "\n".join(_like_for_like(ran, subject, baseline)
                     + _dense_apart(apart, subject, baseline)).strip("\n")
  others = sorted({r.impl for r in results} - {subject, baseline})
  impls = [i for i in [subject] + others if any(r.impl == i for r in results)]
  kinds: dict[str, set] = {}  # Suite -> its (dtype, D): "all" rows if several.
  for r in results:
    kinds.setdefault(r.suite, set()).add((r.dtype, r.head_dim))
  groups: dict[tuple, dict[str, list[float]]] = {}
  for r in sorted(results, key=sort_key):
    keys = [(r.suite, r.dtype, str(r.head_dim), r.mode)]
    if len(kinds[r.suite]) > 1:
      keys.append((r.suite, "all", "all", r.mode))
    for key in keys:
      groups.setdefault(key, {}).setdefault(r.impl, []).append(r.ratio_to_baseline)
  header = ["suite", "dtype", "D", "mode"] + [f"{i}/{baseline}" for i in impls]
  lines = [f"Speed over {baseline}'s, geometric mean (min-max; cases):", "",
           "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  order = sorted(groups, key=lambda k: (k[0], k[1] == "all", k[1],
                                        k[2] == "all", k[2].zfill(4), k[3]))
  for key in order:
    lines.append("| " + " | ".join(list(key) + [
        _geomean_cell(groups[key].get(i, [])) for i in impls]) + " |")
  by_case: dict[tuple, dict[str, float]] = {}
  for r in ran:  # Cases the baseline missed count here too.
    by_case.setdefault((r.suite, r.case_key(), r.mode), {})[r.impl] = r.tflops
  wins: dict[tuple, list[int]] = {}
  for (suite, _, mode), speeds in by_case.items():
    if subject not in speeds or len(speeds) < 2:
      continue
    # Rivals: the other contenders, not the subject's own variants
    # (flash3-nondet runs flash3's forward; its backward is flash3's too).
    rivals = [v for k, v in speeds.items() if not k.startswith(subject)]
    if not rivals:
      continue
    tally = wins.setdefault((suite, mode), [0, 0])
    tally[1] += 1
    tally[0] += speeds[subject] >= max(rivals)
  if wins:
    lines += ["", f"{subject} at least as fast as every other contender that ran "
                  f"(not counting {subject}'s own variants):"]
    lines += [f"- {suite} {mode}: {w} of {n} cases"
              for (suite, mode), (w, n) in sorted(wins.items())]
  lines += _like_for_like(ran, subject, baseline)
  lines += _dense_apart(apart, subject, baseline)
  return "\n".join(lines)


def _dense_apart(apart, subject: str, baseline: str) -> list[str]:
  """The cases left out of the means because the baseline ran a dense mask."""
  groups: dict[tuple, list[float]] = {}
  for r in apart:
    if r.impl == subject:
      groups.setdefault((r.suite, r.mode), []).append(r.ratio_to_baseline)
  if not groups:
    return []
  return ["", f"Not in the means above: {baseline} was given a dense mask "
              f"(it computes every pair), {subject}/{baseline}:"] + [
      f"- {suite} {mode}: {_geomean_cell(ratios)}"
      for (suite, mode), ratios in sorted(groups.items())]


# Pairs that run the backward the same way: (numerator, denominator, what).
LIKE_FOR_LIKE = (
    ("{subject}", "{baseline}-det", "both deterministic"),
    ("{subject}-nondet", "{baseline}", "both free to add with atomics"),
)


def _like_for_like(ran, subject: str, baseline: str) -> list[str]:
  """Where both of a pair of ``LIKE_FOR_LIKE`` ran: the numerator's speed
  over the denominator's, geometric mean (min-max; cases) per suite and mode.
  XLA runs cuDNN's backward non-deterministically unless asked (cudnn-det);
  flash3's default backward is deterministic: these are the fair ratios."""
  speeds: dict[tuple, dict[str, float]] = {}
  for r in ran:
    speeds.setdefault((r.suite, r.case_key(), r.mode), {})[r.impl] = r.tflops
  lines = []
  for num, den, what in LIKE_FOR_LIKE:
    num, den = (x.format(subject=subject, baseline=baseline) for x in (num, den))
    groups: dict[tuple, list[float]] = {}
    for (suite, _, mode), by_impl in speeds.items():
      if num in by_impl and den in by_impl:
        groups.setdefault((suite, mode), []).append(by_impl[num] / by_impl[den])
    if groups:
      lines += ["", f"Like for like, {num} over {den} ({what}), geometric mean "
                    "(min-max; cases):"]
      lines += [f"- {suite} {mode}: {_geomean_cell(ratios)}"
                for (suite, mode), ratios in sorted(groups.items())]
  return lines
