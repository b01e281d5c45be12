"""The A/B table of a `scripts/tune.py --vary` run: one row per shape, one
column group per value of the varied config fields, flash3 / cuDNN per value,
each value's speed against the first one's, and geometric means.

  python scripts/tune_ab.py r/tune_bwd/tune_bwd.jsonl --field overlap_matmuls
  python scripts/tune_ab.py r/tune_fwd/tune_fwd.jsonl --field pingpong --field exp2_fma_cols

Reads the JSON lines tune.py writes (one per measurement; rows with an
"error" are listed under the table). Prints Markdown.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys


def field_value(config: str, field: str) -> str:
  """The value of ``field`` in a config's repr, e.g. "True" or "'handoff'"."""
  m = re.search(rf"\b{re.escape(field)}=('[^']*'|[^,)]+)", config)
  if m is None:
    raise SystemExit(f"field {field!r} is not in config {config}")
  return m.group(1).strip("'")


def shape_key(row: dict) -> tuple:
  return (row["what"], row["dtype"], row["D"], row["T"], bool(row["causal"]),
          row.get("window"), row.get("docs"))


def ab_table(rows: list[dict], fields: list[str]) -> str:
  """Markdown: per shape the TFLOP/s and flash3 / cuDNN of each value of
  ``fields`` (in order of first appearance), the time ratio against the
  first value, and geometric means over the shapes that have every value."""
  table: dict[tuple, dict[str, dict]] = {}
  values: list[str] = []
  errors = []
  for row in rows:
    value = "/".join(field_value(row["config"], f) for f in fields)
    if "error" in row:
      errors.append((shape_key(row), value, row["error"]))
      continue
    if value not in values:
      values.append(value)
    table.setdefault(shape_key(row), {})[value] = row
  name = "/".join(fields)
  head = ["what", "dtype", "D", "T", "causal", "window", "docs"]
  head += [f"{name}={v} TFLOP/s" for v in values] + ["cuDNN TFLOP/s"]
  head += [f"{v} / cuDNN" for v in values]
  head += [f"{v} / {values[0]} (time)" for v in values[1:]]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  logs = {v: [] for v in values}
  for key in sorted(table, key=lambda k: (*k[:5], *(-1 if x is None else x for x in k[5:]))):
    got = table[key]
    cells = [str(x) if x is not None else "-" for x in key[:4]]
    cells += [str(int(key[4]))] + ["-" if x is None else str(x) for x in key[5:]]
    cells += [f"{got[v]['tflops']:.0f}" if v in got else "-" for v in values]
    # cuDNN is timed after every row: the first value's run.
    cudnn = (got.get(values[0]) or next(iter(got.values())))["cudnn_tflops"]
    cells.append(f"{cudnn:.0f}")
    cells += [f"{got[v]['ratio']:.3f}" if v in got else "-" for v in values]
    first = got.get(values[0])
    cells += [f"{first['ms'] / got[v]['ms']:.3f}" if first and v in got else "-"
              for v in values[1:]]
    lines.append("| " + " | ".join(cells) + " |")
    if all(v in got for v in values):
      for v in values:
        logs[v].append(math.log(got[v]["ratio"]))
  n = len(logs[values[0]]) if values else 0
  if n:
    means = ", ".join(f"{name}={v}: {math.exp(sum(logs[v]) / n):.3f}" for v in values)
    lines.append(f"\nflash3 / cuDNN, geometric mean over {n} shapes: {means}")
  for key, value, err in errors:
    lines.append(f"\nerror at {key} {name}={value}: {err}")
  return "\n".join(lines)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("jsonl", nargs="+", help="tune.py's result files")
  ap.add_argument("--field", action="append", required=True,
                  help="a varied config field (repeat for several)")
  args = ap.parse_args(argv)
  rows = []
  for path in args.jsonl:
    with open(path) as f:
      rows += [json.loads(line) for line in f if line.strip()]
  sys.stdout.write(ab_table(rows, args.field) + "\n")


if __name__ == "__main__":
  main()
