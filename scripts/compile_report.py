"""What ptxas made of each kernel: registers, spills, wgmma serialisation (an H100/H200 tool).

Compiles and runs once, in its own process, the forward and backward kernels of
the default configs for a few FlashAttention-3 grid shapes (16384 tokens,
N * D = 2048), with Mosaic GPU's dump switches on (``MOSAIC_GPU_DUMP_PTX``,
``MOSAIC_GPU_DUMP_PTXAS``, ``MOSAIC_GPU_DUMP_SASS``: they print the PTX, the
ptxas log and nvdisasm's SASS of every Mosaic GPU module compiled). Each case's
whole dump goes to ``<out>/<case>.log``; the summary lists, per case, ptxas's
register and spill lines and every "Performance Loss" warning (C7515: wgmma
serialised, which costs the pipelining of the tensor cores), and counts the
SASS's HGMMA instructions and local-memory accesses (LDL / STL: spills).

  PYTHONPATH=src python3 scripts/compile_report.py --out $OUT/compile
  PYTHONPATH=src python3 scripts/compile_report.py --cases fwd:128:4096:0 bwd:128:4096:1

A case is ``what:D:T:causal`` with ``what`` fwd or bwd (the backward's two
kernels, its forward beside them).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys

DEFAULT_CASES = (
    "fwd:64:4096:0", "fwd:64:4096:1", "fwd:128:4096:0", "fwd:128:16384:0",
    "fwd:128:4096:1", "fwd:256:4096:0", "fwd:256:4096:1",
    "bwd:64:4096:0", "bwd:128:4096:0", "bwd:128:4096:1", "bwd:256:4096:0",
)
DUMP_ENV = {"MOSAIC_GPU_DUMP_PTX": "1", "MOSAIC_GPU_DUMP_PTXAS": "1",
            "MOSAIC_GPU_DUMP_SASS": "1"}
# ptxas's report lines worth reading in the summary.
_PTXAS_KEEP = re.compile(r"registers|spill|Performance Loss|C75\d\d|warning|stack",
                         re.IGNORECASE)


def parse_case(text: str) -> tuple[str, int, int, bool]:
  """'fwd:128:4096:1' -> ('fwd', 128, 4096, True); ValueError naming the case."""
  parts = text.split(":")
  if len(parts) != 4 or parts[0] not in ("fwd", "bwd") or parts[3] not in ("0", "1"):
    raise ValueError(f"case {text!r} must be what:D:T:causal, what fwd or bwd, causal 0 or 1")
  what, d, t, causal = parts
  return what, int(d), int(t), causal == "1"


def summarize(log: str) -> dict:
  """The figures of one case's dump: ptxas lines kept, HGMMA and LDL/STL counts."""
  kept = [line.strip() for line in log.splitlines()
          if line.lstrip().startswith("ptxas") and _PTXAS_KEEP.search(line)]
  return dict(
      ptxas=kept,
      hgmma=len(re.findall(r"\bHGMMA\.", log)),
      local=len(re.findall(r"\b(?:LDL|STL)(?:\.\w+)*\s", log)),
      serialized=[line for line in kept if "Performance Loss" in line or "C7515" in line],
  )


def run_case(case: str) -> None:
  """In this process: compile and run the case's kernels once (the dumps print)."""
  import jax
  import jax.numpy as jnp
  from flash3.kernels.backward import attention_backward
  from flash3.kernels.forward import attention_forward
  from flash3.visibility import MaskSpec

  what, D, T, causal = parse_case(case)
  B, N = max(1, 16384 // T), 2048 // D
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(kk, (B, T, N, D), jnp.bfloat16) for kk in keys)
  mask = MaskSpec(causal=causal, alignment="bottom_right")
  scale = D ** -0.5
  o, lse = jax.jit(lambda q, k, v: attention_forward(q, k, v, scale=scale, mask=mask))(q, k, v)
  if what == "bwd":
    grads = jax.jit(lambda *a: attention_backward(*a, scale=scale, mask=mask))(
        q, k, v, o, lse, do)
    jax.block_until_ready(grads)
  jax.block_until_ready(o)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--cases", nargs="*", default=list(DEFAULT_CASES),
                  help="what:D:T:causal, e.g. fwd:128:4096:0 (default: %(default)s)")
  ap.add_argument("--out", default="compile_report", help="folder for the dumps and summary.md")
  ap.add_argument("--jobs", type=int, default=8, help="cases compiled at once")
  ap.add_argument("--run-case", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.run_case is not None:
    run_case(args.run_case)
    return
  for c in args.cases:
    try:
      parse_case(c)
    except ValueError as e:
      ap.error(str(e))
  os.makedirs(args.out, exist_ok=True)

  def one(case):
    path = os.path.join(args.out, case.replace(":", "_") + ".log")
    env = dict(os.environ, **DUMP_ENV, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               XLA_PYTHON_CLIENT_MEM_FRACTION="0.1")
    with open(path, "w") as f:
      rc = subprocess.run([sys.executable, __file__, "--run-case", case], env=env,
                          stdout=f, stderr=subprocess.STDOUT).returncode
    with open(path) as f:
      return case, rc, summarize(f.read())

  lines = ["| case | rc | HGMMA in SASS | LDL/STL in SASS | serialised wgmma warnings |",
           "|---|---|---|---|---|"]
  details = []
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    for case, rc, s in pool.map(one, args.cases):
      lines.append(f"| {case} | {rc} | {s['hgmma']} | {s['local']} | {len(s['serialized'])} |")
      details += [f"\n## {case}\n"] + [f"    {line}" for line in s["ptxas"]]
      print(lines[-1], flush=True)
  text = "\n".join(lines + details) + "\n"
  with open(os.path.join(args.out, "summary.md"), "w") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  main()
