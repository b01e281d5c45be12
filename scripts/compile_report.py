"""What ptxas made of each kernel: registers, spills, wgmma serialisation (an H100/H200 tool).

Compiles and runs once, in its own process, the forward and backward kernels of
the default configs for a few FlashAttention-3 grid shapes (16384 tokens,
N * D = 2048), with Mosaic GPU's dump switches on (``MOSAIC_GPU_DUMP_PTX``,
``MOSAIC_GPU_DUMP_PTXAS``, ``MOSAIC_GPU_DUMP_SASS``: they print the PTX, the
ptxas log and nvdisasm's SASS of every Mosaic GPU module compiled). Each case's
whole dump goes to ``<out>/<case>.log``; the summary lists, per case, ptxas's
register and spill lines and every "Performance Loss" warning (C7515, C7512:
wgmma serialised, which costs the pipelining of the tensor cores), and counts the
SASS's HGMMA instructions and local-memory accesses (LDL / STL: spills), or
says "no SASS" where the dump has none (the H200 image's jax finds no
nvdisasm; seen 2026-12-03).

  PYTHONPATH=src python3 scripts/compile_report.py --out $OUT/compile
  PYTHONPATH=src python3 scripts/compile_report.py --cases fwd:128:4096:0 bwd:128:4096:1

``--disassemble DIR`` (no GPU needed): the PTX of each ``DIR/*.log`` assembled
again with ptxas (``$PTXAS``, else ``ptxas`` on the PATH) for sm_90a and
disassembled with nvdisasm (``$NVDISASM``, else on the PATH; PyPI's
``nvidia-cuda-nvdisasm`` carries one), each module's SASS written beside its
log, with the same counts.

``--offline`` (no GPU needed): the same report on a machine without one.
Each case is lowered with ``jax.export`` for CUDA and every Mosaic GPU module
compiled by the CUDA plugin's own ``MosaicGpuCompile`` (MLIR -> PTX -> ptxas ->
cubin) against a stand-in driver that refuses only the final load
(scripts/ptxas/fake_libcuda.c). Run it inside ``scripts/ptxas/env.sh``, which
installs the plugin, ptxas 13.0.88 (the H200 image's) and nvdisasm::

  bash scripts/ptxas/env.sh python scripts/compile_report.py --offline --out /tmp/c

Its ptxas figures matched the H200's exactly where both were read (spill bytes
and local-memory instructions of three backward kernels; docs/ptxas.md).

A case is ``what:D:T:causal`` with ``what`` fwd, bwd (the backward's two
kernels, its forward beside them) or bwdnd (the single-kernel backward of
``BackwardConfig.heuristic(..., deterministic=False)``, dq by reduce-add),
and an optional fifth field of options joined by '+' (``OPTIONS``: window,
lengths, segments, softcap, sinks), e.g. ``bwd:64:4096:0:window+softcap``.
``--fwd field=value`` / ``--bwd field=value`` replace fields of the
heuristic's ForwardConfig / BackwardConfig in every case (A/B of a knob).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import os
import re
import subprocess
import sys
import tempfile

DEFAULT_CASES = (
    "fwd:64:4096:0", "fwd:64:4096:1", "fwd:128:4096:0", "fwd:128:16384:0",
    "fwd:128:4096:1", "fwd:256:4096:0", "fwd:256:4096:1",
    "bwd:64:4096:0", "bwd:128:4096:0", "bwd:128:4096:1", "bwd:256:4096:0",
)
DUMP_ENV = {"MOSAIC_GPU_DUMP_PTX": "1", "MOSAIC_GPU_DUMP_PTXAS": "1",
            "MOSAIC_GPU_DUMP_SASS": "1"}
# ptxas's report lines worth reading in the summary.
_PTXAS_KEEP = re.compile(r"registers|spill|Performance Loss|C75\d\d|warning|stack|"
                         r"entry function", re.IGNORECASE)


# A case's options (its fifth field, joined by '+'): a window of 1024 keys
# (left only when causal, both sides else), per-batch lengths, 8 packed
# documents, a soft cap of 30, sinks (the forward's only).
OPTIONS = ("window", "lengths", "segments", "softcap", "sinks")


def case_options(text: str) -> tuple[str, ...]:
  """'fwd:128:4096:1:lengths+segments' -> ('lengths', 'segments'); ValueError
  naming the case and the options there are."""
  parts = text.split(":")
  options = tuple(parts[4].split("+")) if len(parts) == 5 else ()
  unknown = [o for o in options if o not in OPTIONS]
  if unknown:
    raise ValueError(f"case {text!r}: option {unknown[0]!r} is not one of "
                     f"{', '.join(OPTIONS)}")
  return options


def parse_case(text: str) -> tuple[str, int, int, bool]:
  """'fwd:128:4096:1' -> ('fwd', 128, 4096, True) (a fifth field holds the
  options, ``case_options``); ValueError naming the case."""
  parts = text.split(":")
  if (len(parts) not in (4, 5) or parts[0] not in ("fwd", "bwd", "bwdnd")
      or parts[3] not in ("0", "1")):
    raise ValueError(f"case {text!r} must be what:D:T:causal[:options], what fwd, bwd "
                     f"or bwdnd, causal 0 or 1, options of {'+'.join(OPTIONS)}")
  case_options(text)
  what, d, t, causal = parts[:4]
  if not (d.isdigit() and t.isdigit() and int(d) > 0 and int(t) > 0):
    raise ValueError(f"case {text!r} must be what:D:T:causal with D and T positive "
                     f"integers")
  return what, int(d), int(t), causal == "1"


# An instruction line of nvdisasm's SASS: /*0a20*/ at its start (after the
# control codes, "-:-:1:Y:07", in the offline dump's .sass_ctrl).
_SASS_LINE = re.compile(r"^\s*(?:[-\w]+(?::[-\w]+)+\s+)?/\*[0-9a-f]{4,}\*/", re.MULTILINE)
_SPILLED = re.compile(r"Registers are spilled to local memory in function '(\w+)', "
                      r"(\d+) bytes spill stores")
_PTX_START = "//\n// Generated by LLVM NVPTX Back-End"


def summarize(log: str) -> dict:
  """The figures of one case's dump: ptxas lines kept, HGMMA and LDL/STL
  counts (None when the dump holds no SASS)."""
  kept = [line.strip() for line in log.splitlines()
          if line.lstrip().startswith("ptxas") and _PTXAS_KEEP.search(line)]
  has_sass = _SASS_LINE.search(log) is not None
  count = lambda pattern: len(re.findall(pattern, log)) if has_sass else None
  return dict(
      ptxas=kept,
      hgmma=count(r"\bHGMMA\."),
      local=count(r"\b(?:LDL|STL)(?:\.\w+)*\s"),
      serialized=[line for line in kept if "Performance Loss" in line or "C7515" in line],
      spills={name: int(n) for name, n in _SPILLED.findall(log)},
  )


_LABEL = re.compile(r"^\s*\.L_x_(\d+):")
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*$")
_BRANCH = re.compile(r"\bBRA\b.*\.L_x_(\d+)")


def matmul_loops(sass: str) -> list[dict]:
  """The loops of one kernel's SASS (``.text.<kernel>:`` onwards) that hold
  HGMMA and hold no other such loop (innermost: a barrier's retry branch
  that holds a matmul loop, or jumps back into one from past its end, is
  left out), in address order: each backward
  branch's span with its instruction, HGMMA and LDL/STL counts. Spill
  traffic inside the loop that runs every tile is what costs; the rest
  (prologue, epilogue, rare masked loops) is worth less."""
  body, labels, pending = [], {}, []
  for line in sass.splitlines():
    m = _LABEL.match(line)
    if m:
      pending.append(m.group(1))
      continue
    m = _INSTRUCTION.search(line)
    if m:
      addr = int(m.group(1), 16)
      labels.update((label, addr) for label in pending)
      pending = []
      body.append((addr, m.group(2)))
  loops = []
  for addr, text in body:
    m = _BRANCH.search(text)
    if m and labels.get(m.group(1), addr) < addr:
      span = [t for a, t in body if labels[m.group(1)] <= a <= addr]
      hgmma = sum("HGMMA" in t for t in span)
      if hgmma:
        loops.append(dict(start=labels[m.group(1)], end=addr, instructions=len(span),
                          hgmma=hgmma,
                          local=sum(bool(re.search(r"\b(?:LDL|STL)\b", t)) for t in span)))
  # Innermost: no other matmul loop inside, and not a span that starts inside
  # another and ends past it (a barrier's retry branch back into a loop).
  inner = [x for x in loops if not any(
      y is not x and (x["start"] <= y["start"] and y["end"] <= x["end"]
                      or y["start"] <= x["start"] <= y["end"] < x["end"])
      for y in loops)]
  return sorted(inner, key=lambda loop: loop["start"])


def kernel_sass(log: str) -> dict[str, str]:
  """Each kernel's SASS in a dump, by kernel name."""
  starts = [(m.start(), m.group(1)) for m in re.finditer(r"^\.text\.(\w+):", log, re.M)]
  return {name: log[a:(starts[i + 1][0] if i + 1 < len(starts) else len(log))]
          for i, (a, name) in enumerate(starts)}


def ptx_modules(log: str) -> list[str]:
  """The PTX modules of a dump, in order (each up to the next ptxas line)."""
  out = []
  for chunk in log.split(_PTX_START)[1:]:
    out.append(_PTX_START + re.split(r"\n(?=ptxas )", chunk, maxsplit=1)[0])
  return out


def disassemble(folder: str) -> list[str]:
  """``--disassemble``: SASS for each PTX module of ``folder/*.log``; table rows."""
  ptxas = os.environ.get("PTXAS", "ptxas")
  nvdisasm = os.environ.get("NVDISASM", "nvdisasm")
  rows = []
  for path in sorted(glob.glob(os.path.join(folder, "*.log"))):
    with open(path) as f:
      modules = ptx_modules(f.read())
    for i, ptx in enumerate(modules):
      stem = f"{path[:-4]}.{i}"
      with open(stem + ".ptx", "w") as f:
        f.write(ptx)
      subprocess.run([ptxas, "-arch=sm_90a", "-O3", "-o", stem + ".cubin", stem + ".ptx"],
                     check=True)
      sass = subprocess.run([nvdisasm, "-c", stem + ".cubin"], check=True,
                            capture_output=True, text=True).stdout
      with open(stem + ".sass", "w") as f:
        f.write(sass)
      entry = re.search(r"\.visible \.entry (\w+)", ptx)
      s = summarize(sass)
      rows.append(f"| {os.path.basename(stem)} | {entry.group(1) if entry else '?'} "
                  f"| {s['hgmma']} | {s['local']} |")
  return rows


def parse_overrides(items: list[str]) -> dict:
  """['block_q_dkv=128', 'pair_dq=True'] -> {'block_q_dkv': 128, 'pair_dq': True};
  ValueError naming an item without '='."""
  out = {}
  for item in items:
    name, sep, value = item.partition("=")
    if not sep or not name:
      raise ValueError(f"config override {item!r} must be field=value")
    if value in ("True", "False"):
      out[name] = value == "True"
    else:
      try:
        out[name] = int(value)
      except ValueError:
        out[name] = value
  return out


def case_configs(case: str, fwd_over: dict, bwd_over: dict):
  """The case's ForwardConfig and BackwardConfig (None for fwd cases): the
  heuristic's, with the overrides replaced. ValueError naming the case, the
  field and, for an unknown one, the fields there are."""
  import dataclasses

  import jax.numpy as jnp
  from flash3.kernels import forward
  from flash3.kernels.backward import BackwardConfig

  what, D, T, causal = parse_case(case)
  mask = case_mask(case)
  packed = "segments" in case_options(case)

  def replaced(config, over, flag):
    names = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(over) - names)
    if unknown:
      raise ValueError(f"{flag} {unknown[0]}: {type(config).__name__} has no such field; "
                       f"its fields are {', '.join(sorted(names))}")
    try:
      return dataclasses.replace(config, **over)
    except (TypeError, ValueError) as e:
      raise ValueError(f"case {case} with {flag} "
                       f"{' '.join(f'{k}={v}' for k, v in over.items())}: {e} (the "
                       f"heuristic's config there: {config})") from None

  fwd_config = replaced(forward.default_config(D, jnp.bfloat16, mask, T, T, packed=packed),
                        fwd_over, "--fwd")
  bwd_config = None
  if what in ("bwd", "bwdnd"):
    bwd_config = replaced(
        BackwardConfig.heuristic(D, T, T, mask, deterministic=what != "bwdnd",
                                 packed=packed),
        bwd_over, "--bwd")
  return fwd_config, bwd_config


def case_mask(case: str):
  """The case's MaskSpec: bottom-right causal or none, and its window."""
  from flash3.visibility import MaskSpec

  causal = parse_case(case)[3]
  if "window" not in case_options(case):
    return MaskSpec(causal=causal, alignment="bottom_right")
  return MaskSpec(causal=causal, alignment="bottom_right", window_left=1024,
                  window_right=None if causal else 1024)


def _case_fns(case: str, fwd_over: dict, bwd_over: dict):
  """The case's forward (and backward) as one function of (q, k, v, do), and
  its argument shapes; prints the configs (they go into the case's log)."""
  import jax
  import jax.numpy as jnp
  from flash3.kernels import forward
  from flash3.kernels.backward import attention_backward

  what, D, T, causal = parse_case(case)
  options = case_options(case)
  B, N = max(1, 16384 // T), 2048 // D
  mask = case_mask(case)
  scale = D ** -0.5
  fwd_config, bwd_config = case_configs(case, fwd_over, bwd_over)
  print(f"config {fwd_config}", flush=True)
  if bwd_config is not None:
    print(f"config {bwd_config}", flush=True)
  shapes = [jax.ShapeDtypeStruct((B, T, N, D), jnp.bfloat16)] * 4
  # The options' arrays follow q, k, v, do, in this order.
  arrays = [name for name in ("lengths", "segments", "sinks") if name in options]
  shapes += [{"lengths": jax.ShapeDtypeStruct((2, B), jnp.int32),
              "segments": jax.ShapeDtypeStruct((B, T), jnp.int32),
              "sinks": jax.ShapeDtypeStruct((N,), jnp.float32)}[name] for name in arrays]

  def fn(q, k, v, do, *extra):
    given = dict(zip(arrays, extra))
    kw = {}
    if "lengths" in given:
      kw.update(q_lengths=given["lengths"][0], kv_lengths=given["lengths"][1])
    if "segments" in given:
      kw.update(q_segment_ids=given["segments"], kv_segment_ids=given["segments"])
    if "softcap" in options:
      kw.update(softcap=30.0)
    o, lse = forward.attention_forward(q, k, v, scale=scale, mask=mask, config=fwd_config,
                                       sinks=given.get("sinks"), **kw)
    if bwd_config is None:
      return o, lse
    return attention_backward(q, k, v, o, lse, do, scale=scale, mask=mask,
                              config=bwd_config, **kw)

  return fn, shapes


def run_case(case: str, fwd_over: dict, bwd_over: dict) -> None:
  """In this process: compile and run the case's kernels once (the dumps print)."""
  import jax
  import jax.numpy as jnp

  fn, shapes = _case_fns(case, fwd_over, bwd_over)
  keys = jax.random.split(jax.random.key(0), 4)
  args = [jax.random.normal(kk, s.shape, s.dtype) for kk, s in zip(keys, shapes[:4])]
  B, T = shapes[0].shape[:2]
  for s in shapes[4:]:  # Valid values for the options' arrays.
    if s.shape == (2, B):  # Every query, three quarters of the keys.
      args.append(jnp.array([[T] * B, [max(1, T * 3 // 4)] * B], jnp.int32))
    elif s.dtype == jnp.int32:  # 8 documents of equal length.
      args.append(jnp.repeat(jnp.arange(8, dtype=jnp.int32), -(-T // 8))[None, :T]
                  .repeat(B, 0))
    else:  # Sinks.
      args.append(jnp.zeros(s.shape, s.dtype))
  jax.block_until_ready(jax.jit(fn)(*args))


def compile_case_offline(case: str, fwd_over: dict, bwd_over: dict) -> None:
  """In this process, without a GPU: lower the case for CUDA and compile every
  Mosaic GPU module through the plugin's MosaicGpuCompile into
  $MOSAIC_GPU_DUMP_TO (the stand-in driver on LD_LIBRARY_PATH refuses the
  load, so each compile reports failure after ptxas has run); then print
  the dump's ptxas reports and SASS, as the GPU run's log holds them."""
  import ctypes

  import jax
  from jax.experimental.mosaic.gpu import core
  import jax_plugins.xla_cuda13 as plugin

  fn, shapes = _case_fns(case, fwd_over, bwd_over)
  jax.export.export(jax.jit(fn), platforms=["cuda"])(*shapes)
  compile_fn = ctypes.CDLL(plugin._get_library_path()).MosaicGpuCompile
  compile_fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
  compile_fn.restype = ctypes.POINTER(ctypes.c_void_p)
  for module in core.KNOWN_KERNELS.values():
    compile_fn(ctypes.c_char_p(module), ctypes.c_int(len(module)))
  dump = os.environ["MOSAIC_GPU_DUMP_TO"]
  ptxas = sorted(glob.glob(os.path.join(dump, "*.ptxas")))
  if not ptxas:
    raise SystemExit(f"no ptxas report in {dump}: did the compile reach ptxas?")
  for path in ptxas:
    stem = path[:-len(".ptxas")]
    for suffix in (".ptxas", ".sass_ctrl"):
      if os.path.exists(stem + suffix):
        with open(stem + suffix) as f:
          print(f.read(), flush=True)


def build_parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--cases", nargs="*", default=list(DEFAULT_CASES),
                  help="what:D:T:causal, e.g. fwd:128:4096:0 (default: %(default)s)")
  ap.add_argument("--out", default="out/compile_report",
                  help="folder for each case's log and summary.md (default: %(default)s)")
  ap.add_argument("--jobs", type=int, default=8, help="cases compiled at once (>= 1)")
  ap.add_argument("--disassemble", default=None, metavar="DIR",
                  help="no GPU: assemble the PTX of DIR/*.log again and count its SASS")
  ap.add_argument("--offline", action="store_true",
                  help="no GPU: compile through ptxas only (inside scripts/ptxas/env.sh)")
  ap.add_argument("--fwd", nargs="+", action="extend", default=[], metavar="FIELD=VALUE",
                  help="ForwardConfig fields replaced in every case")
  ap.add_argument("--bwd", nargs="+", action="extend", default=[], metavar="FIELD=VALUE",
                  help="BackwardConfig fields replaced in every bwd/bwdnd case")
  ap.add_argument("--run-case", default=None, help=argparse.SUPPRESS)
  return ap


def case_command(case: str, args: argparse.Namespace) -> list[str]:
  """The command line of one case's own process: every override goes along."""
  return ([sys.executable, __file__, "--run-case", case]
          + [f"--fwd={x}" for x in args.fwd] + [f"--bwd={x}" for x in args.bwd]
          + (["--offline"] if args.offline else []))


def main() -> None:
  ap = build_parser()
  args = ap.parse_args()
  try:
    fwd_over, bwd_over = parse_overrides(args.fwd), parse_overrides(args.bwd)
  except ValueError as e:
    ap.error(str(e))
  if args.run_case is not None:
    (compile_case_offline if args.offline else run_case)(args.run_case, fwd_over, bwd_over)
    return
  if args.disassemble is not None:
    print("| module | kernel | HGMMA | LDL/STL |\n|---|---|---|---|")
    print("\n".join(disassemble(args.disassemble)))
    return
  if not args.cases:
    ap.error("--cases needs at least one case")
  if args.jobs < 1:
    ap.error(f"--jobs {args.jobs}: must be at least 1")
  for c in args.cases:
    try:
      case_configs(c, fwd_over, bwd_over)  # Every error before any compile.
    except ValueError as e:
      ap.error(str(e))
  if bwd_over and all(parse_case(c)[0] == "fwd" for c in args.cases):
    ap.error("--bwd applies to bwd and bwdnd cases; every case here is fwd")
  if args.offline and "FLASH3_FAKE_DRIVER" not in os.environ:
    ap.error("--offline runs inside scripts/ptxas/env.sh (it sets up the plugin, "
             "ptxas and the stand-in driver)")
  os.makedirs(args.out, exist_ok=True)

  def one(case):
    path = os.path.join(args.out, case.replace(":", "_") + ".log")
    env = dict(os.environ, **DUMP_ENV, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               XLA_PYTHON_CLIENT_MEM_FRACTION="0.1")
    with tempfile.TemporaryDirectory() as dump, open(path, "w") as f:
      if args.offline:
        # Mosaic GPU writes each module's reports (and 100+ MB of pass logs) here.
        env.update(MOSAIC_GPU_DUMP_TO=dump, LD_LIBRARY_PATH=os.pathsep.join(
            filter(None, [os.environ["FLASH3_FAKE_DRIVER"], os.environ.get("LD_LIBRARY_PATH")])))
      rc = subprocess.run(case_command(case, args), env=env,
                          stdout=f, stderr=subprocess.STDOUT).returncode
    with open(path) as f:
      log = f.read()
    return case, rc, summarize(log), log, path

  lines = ["| case | rc | HGMMA in SASS | LDL/STL in SASS | serialised wgmma warnings "
           "| spill stores (bytes) |", "|---|---|---|---|---|---|"]
  details = []
  failed = []
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    for case, rc, s, log, path in pool.map(one, args.cases):
      sass = (lambda n: "no SASS" if n is None else n)
      spills = ", ".join(f"{k}: {v}" for k, v in s["spills"].items()) or "0"
      if rc:
        failed.append(case)
        spills = "failed"
      lines.append(f"| {case} | {rc} | {sass(s['hgmma'])} | {sass(s['local'])} "
                   f"| {len(s['serialized'])} | {spills} |")
      details.append(f"\n## {case}\n")
      details += [f"    {line[len('config '):]}" for line in log.splitlines()
                  if line.startswith("config ")]
      if rc:
        # The exception's own line (JAX adds notes after its traceback).
        last = next((x for x in reversed(log.splitlines())
                     if re.match(r"[\w.]*(?:Error|Exception|Exit)\b", x.strip())),
                    next((x for x in reversed(log.splitlines()) if x.strip()), "(empty log)"))
        details.append(f"    FAILED (rc {rc}): {last.strip()}; the whole log: {path}")
      details += [f"    {line}" for line in s["ptxas"]]
      for kernel, kernel_text in kernel_sass(log).items():
        for loop in matmul_loops(kernel_text):
          details.append(f"    {kernel}: loop at {loop['start']:#x}: "
                         f"{loop['instructions']} instructions, {loop['hgmma']} HGMMA, "
                         f"{loop['local']} LDL/STL")
      print(lines[-1], flush=True)
  header = [f"`{' '.join(sys.argv)}`", ""]
  text = "\n".join(header + lines + details) + "\n"
  with open(os.path.join(args.out, "summary.md"), "w") as f:
    f.write(text)
  print(text)
  if failed:
    raise SystemExit(f"{len(failed)} of {len(args.cases)} cases failed: {', '.join(failed)} "
                     f"(their logs are in {args.out})")


if __name__ == "__main__":
  main()
