"""One row of results, and what is derived from the measured rows.

Status of a row:

* "ok": checked against the reference, then timed.
* "wrong": failed the check (not timed); ``reason`` gives the worst error.
* "unsupported": the contender refused the case or raised; ``reason`` says why.
* "unavailable": the contender is not installed or not in this checkout.
"""

from __future__ import annotations

import dataclasses

from flash3.bench import flops as flops_lib

STATUSES = ("ok", "wrong", "unsupported", "unavailable")

# The variant label of a contender given packed documents as a dense
# (B, 1, T, T) mask: not the same work (every pair is computed).
DENSE_MASK = "dense mask"


@dataclasses.dataclass
class Result:
  suite: str
  impl: str
  mode: str  # "fwd", "fwd+bwd" or "bwd" (derived).
  batch: int
  q_len: int
  kv_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  dtype: str
  mask: str
  status: str
  reason: str = ""
  variant: str = ""
  config: str = ""  # The kernel configs run, where the contender says (flash3).
  flops: float = 0.0
  median_ms: float | None = None
  min_ms: float | None = None
  max_ms: float | None = None
  tflops: float | None = None
  ratio_to_baseline: float | None = None
  check_ratio: float | None = None  # worst error / allowed error.
  times_ms: list[float] = dataclasses.field(default_factory=list)
  # fwd+bwd rows: the forward's median of this same variant, which the
  # derived backward subtracts (the fwd row's best variant may be another).
  fwd_ms: float | None = None

  @classmethod
  def for_case(cls, case, impl: str, mode: str, status: str, **kwargs):
    return cls(suite=case.suite, impl=impl, mode=mode, batch=case.batch,
               q_len=case.q_len, kv_len=case.kv_len,
               num_heads=case.num_heads, num_kv_heads=case.num_kv_heads,
               head_dim=case.head_dim, dtype=case.dtype, mask=case.mask,
               status=status, flops=flops_lib.flops(case, mode), **kwargs)

  def case_key(self) -> tuple:
    """Identifies the problem (not the contender, not the mode)."""
    return (self.suite, self.batch, self.q_len, self.kv_len, self.num_heads,
            self.num_kv_heads, self.head_dim, self.dtype, self.mask)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


FIELDS = [f.name for f in dataclasses.fields(Result)]


def derive_backward(results: list[Result]) -> list[Result]:
  """Backward-alone rows: fwd+bwd time minus fwd time, per case and contender.

  Only where both were measured, and of one variant: the fwd+bwd row's own
  (its ``fwd_ms``, or the fwd row when that is the same variant). The FLOPs
  are 2.5x the forward's.
  """
  by_key = {(r.case_key(), r.impl, r.mode): r for r in results}
  derived = []
  for r in results:
    if r.mode != "fwd+bwd":
      continue
    fwd = by_key.get((r.case_key(), r.impl, "fwd"))
    row = dataclasses.replace(r, mode="bwd", times_ms=[], min_ms=None,
                              max_ms=None, median_ms=None, tflops=None,
                              ratio_to_baseline=None, check_ratio=None,
                              fwd_ms=None,
                              flops=r.flops / (1 + flops_lib.BACKWARD_FACTOR)
                              * flops_lib.BACKWARD_FACTOR)
    if fwd is None or fwd.status != "ok" or r.status != "ok":
      row.status = r.status if r.status != "ok" else (
          fwd.status if fwd is not None else "unsupported")
      row.reason = r.reason or (fwd.reason if fwd is not None else
                                "no forward measurement")
      derived.append(row)
      continue
    fwd_ms = r.fwd_ms if r.fwd_ms is not None else (
        fwd.median_ms if fwd.variant == r.variant else None)
    if fwd_ms is None:  # fwd+bwd of one variant minus fwd of another: no.
      row.status = "unsupported"
      row.reason = (f"no forward measurement of variant {r.variant!r} (the "
                    f"fastest forward was {fwd.variant!r})")
      derived.append(row)
      continue
    row.median_ms = r.median_ms - fwd_ms
    row.tflops = flops_lib.tflops_per_s(row.flops, row.median_ms)
    row.reason = "fwd+bwd minus fwd"
    derived.append(row)
  return derived


def add_ratios(results: list[Result], baseline: str) -> None:
  """Fill ratio_to_baseline: TFLOP/s over the baseline's, same case and mode."""
  base = {(r.case_key(), r.mode): r.tflops for r in results
          if r.impl == baseline and r.status == "ok"}
  for r in results:
    b = base.get((r.case_key(), r.mode))
    if r.tflops is not None and b:
      r.ratio_to_baseline = r.tflops / b


def case_key_of(case) -> tuple:
  """``Result.case_key()`` of the rows that ``case`` (a cases.Case) produces."""
  return (case.suite, case.batch, case.q_len, case.kv_len, case.num_heads,
          case.num_kv_heads, case.head_dim, case.dtype, case.mask)


def merge(row_lists: list[list[Result]], baseline: str) -> list[Result]:
  """One set of results from several runs: the shards of a suite, or a run
  and a re-run of some of its cases.

  The measured rows ("fwd", "fwd+bwd") are kept, a case's rows all from one
  run: a later list that has a case replaces every row of that case (each
  contender, each mode), so a ratio or a derived backward never pairs rows of
  two runs (cuDNN is measured in the same run as what it is compared with).
  Backward-alone rows and ratios are derived again from the kept rows, so the
  checkpoint of a run that was cut off (which has neither) merges like a
  finished run's results.
  """
  kept: dict[tuple, list[Result]] = {}
  for rows in row_lists:
    cases: dict[tuple, list[Result]] = {}
    for r in rows:
      if r.mode != "bwd":
        cases.setdefault(r.case_key(), []).append(
            dataclasses.replace(r, ratio_to_baseline=None))
    kept.update(cases)
  merged = [r for rows in kept.values() for r in rows]
  merged += derive_backward(merged)
  add_ratios(merged, baseline)
  return merged
