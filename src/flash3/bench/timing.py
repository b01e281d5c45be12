"""Kernel time with CUPTI: warm-up, then the median and spread of repeats.

``jax.experimental.mosaic.gpu.profiler.measure(f, iterations=n)`` runs ``f``
once as its own warm-up, then ``n`` times under CUPTI, and returns
``(result of the first run, [ms per run])``: each entry sums the GPU time of
every kernel the run launched (so a contender's extra transposes or mask
building count), with no host overhead or launch gaps. With ``n == 1`` it
returns a bare float instead of a list; ``None`` when no kernel ran.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable

import jax


@dataclasses.dataclass(frozen=True)
class Timing:
  """Milliseconds of repeated runs, with summary statistics."""

  times_ms: tuple[float, ...]

  @property
  def median(self) -> float:
    return statistics.median(self.times_ms)

  @property
  def min(self) -> float:
    return min(self.times_ms)

  @property
  def max(self) -> float:
    return max(self.times_ms)

  @property
  def spread(self) -> float:
    """(max - min) / median: 0.02 means the runs lie within 2% of each other."""
    return (self.max - self.min) / self.median if self.median > 0 else 0.0


def from_measurement(times: Any, iterations: int) -> Timing:
  """A Timing from what profiler.measure returned for ``iterations`` runs.

  Raises:
    RuntimeError: when CUPTI saw no kernel (the function ran nothing).
  """
  if times is None:
    raise RuntimeError("CUPTI recorded no kernel launch")
  if iterations == 1 or isinstance(times, (int, float)):
    times = [times]
  times = tuple(float(t) for t in times)
  if len(times) != iterations or any(t is None or t <= 0 for t in times):
    raise RuntimeError(f"unexpected CUPTI timings {times!r}")
  return Timing(times)


def by_kernel(timings, name_width: int = 60) -> dict[str, float]:
  """``profiler.measure(..., aggregate=False)``'s (kernel name, ms) pairs ->
  ms per kernel name (cut to ``name_width`` characters), largest first: where
  one call's time goes. None (no kernel ran) gives {}."""
  out: dict[str, float] = {}
  for name, ms in timings or []:
    out[name[:name_width]] = out.get(name[:name_width], 0.0) + ms
  return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def measure(fn: Callable, args: tuple, *, iterations: int = 10,
            warmup: int = 2) -> Timing:
  """Time ``fn(*args)`` with CUPTI.

  Args:
    fn: a ``jax.stages.Compiled`` (the runner's) or a jitted function already
      called once (compilation is not timed); profiler.measure calls either
      as it is (it would wrap anything else in jax.jit).
    warmup: extra untimed runs before measuring (profiler.measure adds one).
    iterations: timed runs.
  """
  from jax.experimental.mosaic.gpu import profiler  # Needs the CUDA plugin.
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  result, times = profiler.measure(fn, iterations=iterations)(*args)
  del result
  return from_measurement(times, iterations)
