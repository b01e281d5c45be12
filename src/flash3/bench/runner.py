"""Runs every case on every contender, in one process, and never crashes.

For each case: random inputs and the reference program on its check slices
(one compiled program for all modes, shared by all contenders); then the
reference and every (mode, contender, variant) function are compiled,
``compile_jobs`` at a time in threads (XLA and Mosaic GPU compile in C++
without the GIL, and compiling is nearly all of a case's wall time), the
reference first as it is the longest; then the reference runs, then the
contenders one by one, alone on the GPU: run once, check against the reference
(a wrong result is reported and not timed), time with CUPTI. With
``compile_jobs=1`` each is compiled just before it runs. With ``interleave``
rounds, a mode's contenders are all checked first and then timed in turns
(``run_mode_interleaved``). A contender's best
variant (lowest median) is its result.
Whatever a contender raises (building, tracing, compiling or running) becomes
an "unsupported" row with the reason.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import gc
import sys
import time
from typing import Any, Callable, Iterable

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
  # Functions of a case compiled at once, in threads, before any is run;
  # 1 compiles each just before running it (one executable alive at a time).
  compile_jobs: int = 8
  # Rounds of interleaved timing (``run_mode_interleaved``; needs
  # compile_jobs > 1); 0 times each function's runs in one block.
  interleave: int = 0

  def __post_init__(self):
    if (self.interleave < 0 or self.interleave > self.iterations
        or (self.interleave and self.compile_jobs < 2)):
      raise ValueError(
          f"interleave={self.interleave} needs to be 0, or in [1, iterations="
          f"{self.iterations}] with compile_jobs >= 2 (all of a case compiled "
          f"first); got compile_jobs={self.compile_jobs}")


@dataclasses.dataclass
class CaseTimes:
  """Wall seconds of a case's phases. reference: inputs and running the
  reference (and compiling it, with compile_jobs=1); compile: the parallel
  phase's wall (the reference's compile included), or the sum of the
  contenders' compiles with compile_jobs=1; run: checks and timings."""

  reference: float = 0.0
  compile: float = 0.0
  run: float = 0.0


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
  if variant.compiler_options:
    return jax.jit(run, compiler_options=dict(variant.compiler_options))
  return jax.jit(run)


def compile_function(variant: impls.Variant, mode: str, args: tuple) -> Any:
  """timed_function compiled for ``args`` (only their shapes and placement
  matter): a ``jax.stages.Compiled``, called like the function."""
  return timed_function(variant, mode).lower(*args).compile()


def variant_args(variant: impls.Variant, inputs) -> tuple:
  """The arguments of the timed function: (q, k, v, do, *aux), q scaled by
  the variant's q_scale (a new device array only when it is not 1)."""
  q, k, v, do = inputs
  if variant.q_scale != 1.0:
    q = (q.astype(jnp.float32) * variant.q_scale).astype(q.dtype)
  return (q, k, v, do, *variant.aux)


def check_variant(case: Case, variant: impls.Variant, fn: Callable, args: tuple,
                  expected: reference.Expected) -> tuple[dict | None, float]:
  """Runs ``fn(*args)`` once and checks it: (None, error ratio) when it
  passes, else (the fields of a "wrong" Result, ratio). Raises what the run
  raised."""
  outputs = jax.block_until_ready(fn(*args))
  passed, ratio, detail = reference.check(case, expected, outputs,
                                          q_grad_scale=variant.q_scale)
  del outputs
  if not passed:
    return dict(status="wrong", reason=detail, check_ratio=ratio), ratio
  return None, ratio


def timed_fields(case: Case, mode: str, measured: timing.Timing,
                 ratio: float) -> dict:
  """The fields of an "ok" Result from a checked variant's timing."""
  flop_count = flops_lib.flops(case, mode)
  return dict(status="ok", check_ratio=ratio, median_ms=measured.median,
              min_ms=measured.min, max_ms=measured.max,
              times_ms=list(measured.times_ms),
              tflops=flops_lib.tflops_per_s(flop_count, measured.median))


def run_variant(case: Case, mode: str, variant: impls.Variant, inputs,
                expected: reference.Expected, options: Options,
                fn: Callable | None = None) -> dict:
  """Check then time one variant. Returns fields for a Result.

  Args:
    fn: its compiled function (compile_function); compiled here when None.
  """
  args = variant_args(variant, inputs)
  try:
    if fn is None:
      fn = compile_function(variant, mode, args)
    wrong, ratio = check_variant(case, variant, fn, args, expected)
    if wrong is not None:
      return wrong
    measured = timing.measure(fn, args, iterations=options.iterations,
                              warmup=options.warmup)
  except Exception as e:  # Any failure of a contender is a reported result.
    return dict(status="unsupported", reason=short_reason(e))
  return timed_fields(case, mode, measured, ratio)


def run_mode_interleaved(case: Case, mode: str, entries, inputs,
                         expected: reference.Expected,
                         options: Options) -> dict[str, list[dict]]:
  """Checks every compiled job of one mode, then times the ones that passed
  in ``options.interleave`` rounds: each round times every job once
  (``ceil(iterations / rounds)`` runs, plus the profiler's untimed warm-up
  run), in plan order on even rounds and reversed on odd ones, so a GPU whose
  clock drifts during a case slows every contender alike (an even number of
  rounds gives every job the same mean position).

  Args:
    entries: [(contender name, its compiled ``_Job``s)].
  Returns:
    {name: the fields of each of its jobs' Results, in job order}.
  """
  fields = {name: [None] * len(jobs) for name, jobs in entries}
  timed = []  # [name, index, fn, args, ratio, times]
  for name, jobs in entries:
    for i, job in enumerate(jobs):
      if job.error is not None:
        fields[name][i] = dict(status="unsupported", reason=job.error)
        continue
      args = variant_args(job.variant, inputs)
      try:
        wrong, ratio = check_variant(case, job.variant, job.compiled, args,
                                     expected)
      except Exception as e:  # Any failure of a contender is a reported result.
        fields[name][i] = dict(status="unsupported", reason=short_reason(e))
        continue
      if wrong is not None:
        fields[name][i] = wrong
        continue
      timed.append([name, i, job.compiled, args, ratio, []])
  rounds = options.interleave
  per_round = -(-options.iterations // rounds)
  for r in range(rounds):
    for entry in (timed if r % 2 == 0 else timed[::-1]):
      name, i, fn, args, ratio, times = entry
      if fields[name][i] is not None:  # Failed in an earlier round.
        continue
      try:
        measured = timing.measure(fn, args, iterations=per_round,
                                  warmup=options.warmup if r == 0 else 0)
      except Exception as e:  # Any failure of a contender is a reported result.
        fields[name][i] = dict(status="unsupported", reason=short_reason(e))
        continue
      times.extend(measured.times_ms)
  for name, i, _, _, ratio, times in timed:
    if fields[name][i] is None:
      fields[name][i] = timed_fields(case, mode, timing.Timing(tuple(times)),
                                     ratio)
  return fields


@dataclasses.dataclass
class _Job:
  """One (mode, contender, variant) function of a case, and its compilation:
  ``compiled`` or ``error`` (the short reason) once compiled."""

  mode: str
  variant: impls.Variant
  compiled: Any = None
  error: str | None = None


def _compile_job(job: _Job, inputs) -> None:
  """Compile ``job`` in place; an exception becomes its error. Lowers with
  the unscaled q, which has the scaled q's shape, dtype and device, so that
  no input is copied before it is run."""
  try:
    job.compiled = compile_function(job.variant, job.mode,
                                    (*inputs, *job.variant.aux))
  except Exception as e:  # Tracing or compiling failed: unsupported.
    job.error = short_reason(e)


def _compile_reference(program: reference.Program) -> Exception | None:
  """Compile the reference in place; returns what that raised, if anything."""
  try:
    reference.compile_program(program)
  except Exception as e:  # Reported by run_case as a failed reference.
    return e
  return None


def compile_all(jobs: list[_Job], inputs, workers: int,
                program: reference.Program | None = None
                ) -> Exception | None:
  """Compile every job, and the reference ``program`` when given (submitted
  first: it is the longest compile), ``workers`` at a time in threads. Each
  is a C++ compile (XLA, and Mosaic GPU kernels in its custom calls'
  instantiate stage) after a Python lowering that holds the GIL; nothing runs
  on the GPU but XLA's autotuning.

  Returns:
    What compiling the reference raised, or None.
  """
  tasks = [functools.partial(_compile_job, job, inputs) for job in jobs]
  if program is not None:
    tasks.insert(0, functools.partial(_compile_reference, program))
  if workers <= 1 or len(tasks) <= 1:
    done = [task() for task in tasks]
  else:
    with concurrent.futures.ThreadPoolExecutor(
        max_workers=min(workers, len(tasks)),
        thread_name_prefix="flash3-bench-compile") as pool:
      # The tasks catch what a compile raises; result() re-raises the rest
      # (KeyboardInterrupt in a worker, a bug here).
      done = [future.result()
              for future in [pool.submit(task) for task in tasks]]
  return done[0] if program is not None else None


def _plan(case: Case, implementations: list[impls.Implementation],
          options: Options, unavailable: dict[str, str]) -> tuple[dict, list]:
  """({name: its variants, or why it has none}, [(mode, name, jobs)]); jobs
  is None for a contender without variants."""
  # Each contender's variants once, for all modes (a dense mask is built once).
  variants = {}
  for impl in implementations:
    if impl.name in unavailable:
      continue
    try:
      variants[impl.name] = impl.variants(case, options.tune)
    except Exception as e:  # Unsupported, or anything else it raised.
      variants[impl.name] = short_reason(e)
  plan = []
  for mode in options.modes:
    for impl in implementations:
      found = variants.get(impl.name)
      jobs = ([_Job(mode, v) for v in found] if isinstance(found, list)
              else None)
      plan.append((mode, impl.name, jobs))
  return variants, plan


def run_case(case: Case, implementations: list[impls.Implementation],
             options: Options, unavailable: dict[str, str],
             on_step: Callable[[str], None] = lambda s: None,
             times: CaseTimes | None = None) -> list[Result]:
  """All contenders on one case, every mode of ``options``.

  Args:
    times: gets the wall time of each phase when given.
  """
  times = CaseTimes() if times is None else times

  def failed(e: BaseException) -> list[Result]:
    # Without a reference nothing can be checked.
    return [Result.for_case(case, impl.name, mode, "unsupported",
                            reason="reference failed: " + short_reason(e))
            for mode in options.modes for impl in implementations]

  t0 = time.monotonic()
  q, k, v, do, seg = reference.random_inputs(case)
  inputs = (q, k, v, do)
  on_step(f"reference {case.label()}")
  try:
    program = reference.program(case, options.modes, q, k, v, do, seg)
  except Exception as e:
    return failed(e)
  finally:
    times.reference += time.monotonic() - t0

  parallel = options.compile_jobs > 1
  if parallel:  # The reference compiles alongside the contenders.
    variants, plan = _plan(case, implementations, options, unavailable)
    on_step(f"compile {case.label()}")
    t0 = time.monotonic()
    error = compile_all([job for _, _, jobs in plan for job in jobs or ()],
                        inputs, options.compile_jobs, program)
    times.compile += time.monotonic() - t0
    if error is not None:
      return failed(error)
    on_step(f"reference {case.label()}")
  t0 = time.monotonic()
  try:
    expectations = reference.run_program(program)  # Compiles it if serial.
  except Exception as e:
    return failed(e)
  finally:
    times.reference += time.monotonic() - t0
  del program  # Its executable and input slices.
  if not parallel:  # Variants' arrays only once the reference is done.
    variants, plan = _plan(case, implementations, options, unavailable)

  interleaved = {}
  if parallel and options.interleave:
    for mode in options.modes:
      entries = [(name, jobs) for m, name, jobs in plan
                 if m == mode and jobs is not None]
      on_step(f"{case.label()} {mode}, interleaved")
      t0 = time.monotonic()
      interleaved[mode] = run_mode_interleaved(case, mode, entries, inputs,
                                               expectations[mode], options)
      for _, jobs in entries:  # Timed: free the executables before the next mode.
        for job in jobs:
          job.compiled = None
      gc.collect()
      times.run += time.monotonic() - t0
  out = []
  fwd_ms = {}  # (contender, variant) -> its forward median, for the fwd+bwd rows.
  for mode, name, jobs in plan:
    if jobs is None:
      status, reason = (("unavailable", unavailable[name])
                        if name in unavailable else
                        ("unsupported", variants[name]))
      out.append(Result.for_case(case, name, mode, status, reason=reason))
      continue
    on_step(f"{name} {case.label()} {mode}")
    best = None
    for i, job in enumerate(jobs):
      if mode in interleaved:  # Checked and timed above.
        fields = dict(interleaved[mode][name][i])
      else:
        if not parallel:  # Compiled just before its run, as it is dropped after.
          t0 = time.monotonic()
          _compile_job(job, inputs)
          times.compile += time.monotonic() - t0
        t0 = time.monotonic()
        if job.error is not None:
          fields = dict(status="unsupported", reason=job.error)
        else:
          fields = run_variant(case, mode, job.variant, inputs,
                               expectations[mode], options, fn=job.compiled)
        job.compiled = None  # Frees the executable before the next one runs.
        gc.collect()
        times.run += time.monotonic() - t0
      fields["variant"] = job.variant.label
      fields["config"] = job.variant.config
      if mode == "fwd" and fields["status"] == "ok":
        fwd_ms[name, job.variant.label] = fields["median_ms"]
      if best is None or _better(fields, best):
        best = fields
    out.append(Result.for_case(case, name, mode, **best))
  for r in out:  # The backward is derived within one variant (results.py).
    if r.mode == "fwd+bwd":
      r.fwd_ms = fwd_ms.get((r.impl, r.variant))
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
    log: gets one line per case done (its wall time, split into reference,
      compile and check+time phases), for runs without a progress bar.
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
    phases = CaseTimes()
    rows += run_case(case, implementations, options, unavailable,
                     on_step=lambda s: on_step(s[:60]), times=phases)
    if checkpoint is not None:
      checkpoint(rows)
    took = time.monotonic() - now
    longest = max(longest, took)
    if log is not None:
      log(f"flash3-bench: case {done + 1}/{len(cases)} {case.label()}: "
          f"{took:.1f} s (reference {phases.reference:.1f} s, compile "
          f"{phases.compile:.1f} s, run {phases.run:.1f} s; "
          f"{time.monotonic() - start:.0f} s in all)")
  rows += results_lib.derive_backward(rows)
  results_lib.add_ratios(rows, impls.BASELINE)
  return rows
