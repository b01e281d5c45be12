"""Custom calls in the GPT train step, before and after XLA's optimizations (on a GPU).

  python3 scripts/hlo_calls.py --preset h200 --impls flash3,cudnn --flash3-kernels-only

Prints, per attention implementation, the custom calls by target in the lowered
StableHLO (what JAX emits) and, on a GPU, in the optimized HLO (what XLA runs): a call
that XLA duplicates shows as a higher count after. flash3 should have 3 in both (the
forward, dq and dk/dv kernels); XLA's dynamic-slice fusion once cloned the forward into
the scan's residual update (docs/training.md). On a CPU only the StableHLO is counted,
and flash3 takes its XLA path there (no kernel calls to count; --flash3-kernels-only
fails without a Hopper GPU).

Arguments this tool does not know go to the trainer (see `python -m examples.train_gpt
--help`: --preset, --head-dim, --flash3-kernels-only, ...). --out DIR writes the
optimized HLO text; --where lists each --target call with the computation holding it (a
while body, the entry); --passes DIR dumps the HLO after every XLA pass into DIR and
prints the passes after which the count of --target changes.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

if "--passes" in sys.argv:  # XLA reads its flags once, when jax starts its backend
  _dump = sys.argv[sys.argv.index("--passes") + 1]
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={_dump}"
                             " --xla_dump_hlo_pass_re=.* --xla_dump_hlo_module_re=.*step.*")

import jax  # noqa: E402

from examples.train_gpt import attention as attention_lib  # noqa: E402
from examples.train_gpt import data as data_lib  # noqa: E402
from examples.train_gpt import model as model_lib  # noqa: E402
from examples.train_gpt import train as train_lib  # noqa: E402


def stablehlo_targets(text: str) -> collections.Counter:
  """custom_call targets in StableHLO text (``stablehlo.custom_call @name``)."""
  return collections.Counter(re.findall(r"custom_call @([\w$.]+)", text))


def hlo_targets(text: str) -> collections.Counter:
  """custom_call targets in optimized HLO text (``custom_call_target="name"``)."""
  return collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))


def calls_by_computation(text: str, target: str) -> list[tuple[str, str]]:
  """(computation, instruction) of every custom call to ``target`` in HLO text."""
  found, computation = [], "?"
  for line in text.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.-]+) .*\{$", line)
    if head and not line.startswith(" "):
      computation = head.group(1)
    elif f'custom_call_target="{target}"' in line:
      name = re.match(r"\s*(?:ROOT )?%?([\w.-]+) =", line)
      found.append((computation, name.group(1) if name else "?"))
  return found


def pass_changes(folder: pathlib.Path, target: str) -> list[tuple[str, int, int]]:
  """(pass, count before, count after) wherever the count of ``target`` calls changes
  from one dumped pass to the next, in the order XLA ran them."""
  dumped = []
  for f in folder.glob("*.txt"):
    m = re.search(r"\.(\d{4})\.[\w-]+\.after_(.+?)\.before_", f.name)
    if m:
      dumped.append((int(m.group(1)), m.group(2), f))
  changes, last = [], None
  for _, name, f in sorted(dumped):
    n = f.read_text().count(f'custom_call_target="{target}"')
    if last is not None and n != last:
      changes.append((name, last, n))
    last = n
  return changes


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--impls", default="flash3,cudnn",
                  help="comma-separated: flash3, cudnn, xla (default: %(default)s)")
  p.add_argument("--out", default=None, help="folder for the optimized HLO text")
  p.add_argument("--target", default="mosaic_gpu_v2", help="custom call for --where/--passes (default: %(default)s)")
  p.add_argument("--where", action="store_true", help="list where each --target call is")
  p.add_argument("--passes", default=None, metavar="DIR",
                 help="dump HLO after every pass into DIR; print where --target's count changes")
  own, rest = p.parse_known_args(argv)
  impls = attention_lib.parse_impls(own.impls)
  args = train_lib.parse_args(rest)
  train_stream, _ = train_lib.load_data(args)
  batch = train_lib.to_device(data_lib.train_batch(train_stream, 1, args.batch_size,
                                                   args.seq_len, args.seed))
  optimizer = train_lib.make_optimizer(args)
  result = {}
  for impl in impls:
    config = train_lib.model_config(args, impl)
    params = model_lib.init_params(config, jax.random.key(args.seed))
    state = (params, optimizer.init(params))
    lowered = train_lib.make_train_step(config, optimizer, donate=False).lower(state, batch)
    row = {"stablehlo": dict(stablehlo_targets(lowered.as_text()))}
    if jax.devices()[0].platform != "gpu":
      row["optimized"] = "not counted: no GPU"
    else:
      text = lowered.compile().as_text()
      row["optimized"] = dict(hlo_targets(text))
      row["while_loops"] = len(re.findall(r"\bwhile\(", text))
      if own.where:
        row["where"] = calls_by_computation(text, own.target)
      if own.out:
        out = pathlib.Path(own.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{impl}.hlo.txt").write_text(text)
    result[impl] = row
    print(f"{impl}: {row}", flush=True)
  if own.passes:
    for name, before, after in pass_changes(pathlib.Path(own.passes), own.target):
      print(f"after pass {name}: {own.target} {before} -> {after}", flush=True)
  return result


if __name__ == "__main__":
  main()
