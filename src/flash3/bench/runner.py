"""Runs every case on every contender, in one process, and never crashes.

For each case: random inputs, the reference on its check slices (one
compiled program for all modes, shared by all contenders), then for each
contender and each variant: compile and run once, check against the reference
(a wrong result is reported and not timed), time with CUPTI. A contender's
best variant (lowest median) is its result. Whatever a contender raises
becomes an "unsupported" row with the reason.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
from typing import Callable, Iterable

import jax
import jax.numpy as jnp

from flash3.bench import flops as flops_lib
from flash3.bench import implementations as impls
from flash3.bench import reference
from flash3.bench import results as results_lib
from flash3.bench import timing
from flash3.bench.cases import MODES, Case
from flash3.bench.results import Result


@dataclasses.dataclass(frozen=True)
class Options:
  iterations: int = 10
  warmup: int = 2
  tune: bool = True  # Try every variant (block sizes) of a contender.
  modes: tuple[str, ...] = MODES


def short_reason(e: BaseException, limit: int = 300) -> str:
  """The first line of an exception, prefixed by its type, at most ``limit``."""
  lines = [l.strip() for l in str(e).strip().splitlines() if l.strip()]
  text = f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")
  return text if len(text) <= limit else text[:limit - 3] + "..."


def timed_function(variant: impls.Variant, mode: str) -> Callable:
  """The jitted function to check and time: (q, k, v, do, *aux) -> outputs.

  "fwd" returns (o,); "fwd+bwd" runs the forward and the backward for the
  cotangent ``do`` and returns (dq, dk, dv).
  """
  fn = variant.fn
  if mode == "fwd":
    def run(q, k, v, do, *aux):
      del do
      return (fn(q, k, v, *aux),)
  else:
    def run(q, k, v, do, *aux):
      _, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, *aux), q, k, v)
      return tuple(vjp(do))
  return jax.jit(run)


def run_variant(case: Case, mode: str, variant: impls.Variant, inputs,
                expected: reference.Expected, options: Options) -> dict:
  """Check then time one variant. Returns fields for a Result."""
  q, k, v, do = inputs
  if variant.q_scale != 1.0:
    q = (q.astype(jnp.float32) * variant.q_scale).astype(q.dtype)
  args = (q, k, v, do, *variant.aux)
  fn = timed_function(variant, mode)
  try:
    outputs = jax.block_until_ready(fn(*args))
    passed, ratio, detail = reference.check(case, expected, outputs,
                                            q_grad_scale=variant.q_scale)
    del outputs
    if not passed:
      return dict(status="wrong", reason=detail, check_ratio=ratio)
    measured = timing.measure(fn, args, iterations=options.iterations,
                              warmup=options.warmup)
  except Exception as e:  # Any failure of a contender is a reported result.
    return dict(status="unsupported", reason=short_reason(e))
  flop_count = flops_lib.flops(case, mode)
  return dict(status="ok", check_ratio=ratio, median_ms=measured.median,
              min_ms=measured.min, max_ms=measured.max,
              times_ms=list(measured.times_ms),
              tflops=flops_lib.tflops_per_s(flop_count, measured.median))


def run_case(case: Case, implementations: list[impls.Implementation],
             options: Options, unavailable: dict[str, str],
             on_step: Callable[[str], None] = lambda s: None) -> list[Result]:
  """All contenders on one case, every mode of ``options``."""
  out = []
  q, k, v, do, seg = reference.random_inputs(case)
  on_step(f"reference {case.label()}")
  try:
    expectations = reference.expected_modes(case, options.modes, q, k, v, do,
                                            seg)
  except Exception as e:  # Without a reference nothing can be checked.
    return [Result.for_case(case, impl.name, mode, "unsupported",
                            reason="reference failed: " + short_reason(e))
            for mode in options.modes for impl in implementations]
  for mode in options.modes:
    exp = expectations[mode]
    for impl in implementations:
      on_step(f"{impl.name} {case.label()} {mode}")
      if impl.name in unavailable:
        out.append(Result.for_case(case, impl.name, mode, "unavailable",
                                   reason=unavailable[impl.name]))
        continue
      try:
        variants = impl.variants(case, options.tune)
      except Exception as e:  # Unsupported, or anything else it raised.
        out.append(Result.for_case(case, impl.name, mode, "unsupported",
                                   reason=short_reason(e)))
        continue
      best = None
      for variant in variants:
        fields = run_variant(case, mode, variant, (q, k, v, do), exp, options)
        fields["variant"] = variant.label
        if best is None or _better(fields, best):
          best = fields
        gc.collect()
      out.append(Result.for_case(case, impl.name, mode, **best))
    del exp
  return out


_RANK = {"ok": 0, "wrong": 1, "unsupported": 2}


def _better(a: dict, b: dict) -> bool:
  """Is variant result ``a`` better than ``b``? ok beats wrong beats refused;
  between two ok, the lower median wins."""
  if _RANK[a["status"]] != _RANK[b["status"]]:
    return _RANK[a["status"]] < _RANK[b["status"]]
  return a["status"] == "ok" and a["median_ms"] < b["median_ms"]


def run(cases: Iterable[Case], implementations: list[impls.Implementation],
        options: Options, progress: Callable | None = None,
        checkpoint: Callable[[list[Result]], None] | None = None,
        time_budget_s: float | None = None, start: float | None = None,
        log: Callable[[str], None] | None = None) -> list[Result]:
  """Every case on every contender; backward-alone rows and ratios added.

  Args:
    progress: wraps the list of cases (e.g. tqdm); gets ``set_postfix_str``
      calls when it has that method.
    checkpoint: called with the rows so far after each case, so a run that is
      cut off still leaves its results.
    time_budget_s: start no case that would not end within this many seconds
      of ``start``, judging by the longest case so far (the cases left are
      reported on stderr). A deadline for the whole run, whose cases take
      tens of seconds each, mostly compiling.
    start: ``time.monotonic()`` when the run began (default: now); the
      command line passes its own start, so imports count too.
    log: gets one line per case done (its wall time), for runs without a
      progress bar.
  """
  start = time.monotonic() if start is None else start
  cases = list(cases)
  unavailable = {}
  for impl in implementations:
    reason = impl.unavailable()
    if reason is not None:
      unavailable[impl.name] = reason
  iterator = progress(cases) if progress is not None else cases
  on_step = getattr(iterator, "set_postfix_str", None) or (lambda s: None)
  rows = []
  longest = 0.0
  for done, case in enumerate(iterator):
    now = time.monotonic()
    if time_budget_s is not None and now - start + longest > time_budget_s:
      print(f"flash3-bench: time budget of {time_budget_s:.0f} s: "
            f"{len(cases) - done} cases not run ({now - start:.0f} s gone, "
            f"the longest case took {longest:.0f} s)", file=sys.stderr)
      break
    rows += run_case(case, implementations, options, unavailable,
                     on_step=lambda s: on_step(s[:60]))
    if checkpoint is not None:
      checkpoint(rows)
    took = time.monotonic() - now
    longest = max(longest, took)
    if log is not None:
      log(f"flash3-bench: case {done + 1}/{len(cases)} {case.label()}: "
          f"{took:.1f} s ({time.monotonic() - start:.0f} s in all)")
  rows += results_lib.derive_backward(rows)
  results_lib.add_ratios(rows, impls.BASELINE)
  return rows
