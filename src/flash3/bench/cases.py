"""Benchmark shapes and the named suites.

A ``Case`` is one attention problem: shapes (BTNH layout, B batch, Tq/Tk query
and key lengths, N query heads, K key-value heads, D head_dim), dtype and mask.
Every case is measured forward ("fwd") and forward+backward ("fwd+bwd");
backward alone ("bwd") is derived as their difference.

Suites (FlashAttention-3 paper, section 4.1, for the "fa3" grid):

* ``fa3``: B*T = 16384 tokens, N*D = 2048, T in 512..16384, D in 64/128/256,
  causal and not, float16 and bfloat16.
* ``gqa``: 32 query heads over 8 key-value heads, D = 128 (Llama-3 8B's
  attention), B*T = 16384, causal and not.
* ``long``: B = 1, N = 16, D = 128, T = 32768, 65536, 131072.
* ``masks``: T = 16384, N = 16, D = 128: causal (the yardstick), a causal
  sliding window of 1024, and packed rows of 8 documents of 2048 tokens
  (segment ids), with and without causal; and batched inference with right
  padding: B = 4 rows of T = 4096, causal, valid lengths 4096, 3072, 2048
  and 1024 (query and key lengths alike).
* ``quick``: a handful of the above, for a run under two minutes.
* ``single``: one case from the command line (``single_case``).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

from flash3.bench import flops as flops_lib
from flash3.visibility import MaskSpec

DTYPES = ("float16", "bfloat16")
MODES = ("fwd", "fwd+bwd")  # measured; "bwd" is derived from both.


@dataclasses.dataclass(frozen=True)
class Case:
  """One benchmark problem.

  Attributes:
    suite: the suite it belongs to (a label for reports and plots).
    batch, q_len, kv_len: B, Tq, Tk.
    num_heads, num_kv_heads: N query heads and K key-value heads (N % K == 0).
    head_dim: D, the same for q, k and v.
    dtype: "float16" or "bfloat16".
    causal: top-left causal (query i sees keys j <= i).
    window: (left, right) local window, both ends inclusive, or None.
    num_docs: packed documents of equal length per row (segment ids, the
      same for queries and keys), or None.
    seq_lengths: one valid length per batch row, the same for queries and
      keys (right padding: query rows and keys at or past it are padding), or
      None. Needs q_len == kv_len.
  """

  suite: str
  batch: int
  q_len: int
  kv_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  dtype: str = "bfloat16"
  causal: bool = False
  window: tuple[int, int] | None = None
  num_docs: int | None = None
  seq_lengths: tuple[int, ...] | None = None

  def __post_init__(self):
    for name in ("batch", "q_len", "kv_len", "num_heads", "num_kv_heads",
                 "head_dim"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    if self.head_dim % 8 or self.head_dim > 256:
      raise ValueError(f"head_dim={self.head_dim}: flash3 takes head dims that "
                       f"are multiples of 8 up to 256")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    if self.dtype not in DTYPES:
      raise ValueError(f"dtype={self.dtype!r} is not one of {DTYPES}")
    if self.num_docs is not None:
      if self.q_len != self.kv_len or self.q_len % self.num_docs:
        raise ValueError(
            f"num_docs={self.num_docs} needs q_len == kv_len, a multiple of "
            f"num_docs; got q_len={self.q_len}, kv_len={self.kv_len}")
    if self.seq_lengths is not None:
      self._check_seq_lengths()

  def _check_seq_lengths(self):
    lengths = self.seq_lengths
    try:
      lengths = tuple(int(x) for x in lengths)
    except (TypeError, ValueError):
      raise ValueError(f"seq_lengths={lengths!r}: expected a tuple of ints "
                       f"(one per batch row)") from None
    # Stored as a tuple of ints so the frozen Case stays hashable.
    object.__setattr__(self, "seq_lengths", lengths)
    if self.q_len != self.kv_len:
      raise ValueError(f"seq_lengths needs q_len == kv_len (one length for "
                       f"queries and keys); got q_len={self.q_len}, "
                       f"kv_len={self.kv_len}")
    if len(lengths) != self.batch:
      raise ValueError(f"seq_lengths={lengths} has {len(lengths)} values for "
                       f"batch={self.batch} rows")
    bad = [x for x in lengths if not 1 <= x <= self.q_len]
    if bad:
      raise ValueError(f"seq_lengths={lengths}: each must be in "
                       f"[1, {self.q_len}], not {bad}")

  @property
  def mask_spec(self) -> MaskSpec:
    left, right = self.window if self.window is not None else (None, None)
    return MaskSpec(causal=self.causal, window_left=left, window_right=right)

  @property
  def mask(self) -> str:
    """A short label: "full", "causal", "causal+window(1024,0)", "docs8",
    "causal+lens(4096,3072,2048,1024)"... (also part of a result's key)."""
    parts = []
    if self.causal:
      parts.append("causal")
    if self.window is not None:
      parts.append(f"window({self.window[0]},{self.window[1]})")
    if self.num_docs is not None:
      parts.append(f"docs{self.num_docs}")
    if self.seq_lengths is not None:
      parts.append(_lengths_tag(self.seq_lengths))
    return "+".join(parts) if parts else "full"

  @property
  def scale(self) -> float:
    return float(self.head_dim) ** -0.5

  def segment_ids(self) -> np.ndarray | None:
    """(B, T) int32 ids of packed equal-length documents, or None."""
    if self.num_docs is None:
      return None
    doc_len = self.q_len // self.num_docs
    row = np.repeat(np.arange(self.num_docs, dtype=np.int32), doc_len)
    return np.broadcast_to(row, (self.batch, self.q_len)).copy()

  def lengths(self) -> np.ndarray | None:
    """(B,) int32 valid lengths of queries and keys, or None."""
    if self.seq_lengths is None:
      return None
    return np.asarray(self.seq_lengths, dtype=np.int32)

  def label(self) -> str:
    return (f"B={self.batch} Tq={self.q_len} Tk={self.kv_len} "
            f"N={self.num_heads} K={self.num_kv_heads} D={self.head_dim} "
            f"{self.dtype} {self.mask}")


def _lengths_tag(lengths: tuple[int, ...]) -> str:
  """Every length for up to 4 rows, else the range and the sum: the mask
  label keys results, so different lengths should read differently."""
  if len(lengths) <= 4:
    return f"lens({','.join(map(str, lengths))})"
  return f"lens({min(lengths)}..{max(lengths)},sum={sum(lengths)})"


def fa3_grid(dtypes: Iterable[str] = DTYPES,
             head_dims: Iterable[int] = (64, 128, 256),
             seq_lens: Iterable[int] = (512, 1024, 2048, 4096, 8192, 16384),
             suite: str = "fa3") -> list[Case]:
  """FlashAttention-3's grid: B*T = 16384 tokens and N*D = 2048."""
  cases = []
  for dtype in dtypes:
    for d in head_dims:
      for causal in (False, True):
        for t in seq_lens:
          n = 2048 // d
          cases.append(Case(suite, 16384 // t, t, t, n, n, d, dtype, causal))
  return cases


def gqa_suite(dtypes: Iterable[str] = ("bfloat16",),
              seq_lens: Iterable[int] = (1024, 2048, 4096, 8192, 16384),
              suite: str = "gqa") -> list[Case]:
  """32 query heads over 8 key-value heads, D = 128, B*T = 16384."""
  return [Case(suite, 16384 // t, t, t, 32, 8, 128, dtype, causal)
          for dtype in dtypes for causal in (False, True) for t in seq_lens]


def long_suite(dtypes: Iterable[str] = ("bfloat16",),
               seq_lens: Iterable[int] = (32768, 65536, 131072),
               suite: str = "long") -> list[Case]:
  """One row of long context, B = 1, N = 16, D = 128."""
  return [Case(suite, 1, t, t, 16, 16, 128, dtype, causal)
          for dtype in dtypes for causal in (False, True) for t in seq_lens]


def masks_suite(dtypes: Iterable[str] = ("bfloat16",), seq_len: int = 16384,
                window: int = 1024, num_docs: int = 8,
                suite: str = "masks") -> list[Case]:
  """Causal (the yardstick), a causal window, packed documents, padding.

  The padding case has the same tokens as the others in 4x the rows of a
  quarter of the length (B = 4, T = 4096 for seq_len = 16384), causal, with
  valid lengths T, 3T/4, T/2, T/4 (repeated when there are more rows):
  batched inference of prompts of unequal lengths.
  """
  cases = []
  batch = 16384 // seq_len if seq_len <= 16384 else 1
  t = seq_len // 4
  pattern = (t, 3 * t // 4, t // 2, t // 4)
  for dtype in dtypes:
    base = dict(suite=suite, batch=batch, q_len=seq_len, kv_len=seq_len,
                num_heads=16, num_kv_heads=16, head_dim=128, dtype=dtype)
    padded = dict(base, batch=4 * batch, q_len=t, kv_len=t)
    cases += [
        Case(**base, causal=True),
        Case(**base, causal=True, window=(window, 0)),
        Case(**base, causal=False, num_docs=num_docs),
        Case(**base, causal=True, num_docs=num_docs),
        Case(**padded, causal=True, seq_lengths=pattern * batch),
    ]
  return cases


def quick_suite(dtypes: Iterable[str] | None = None) -> list[Case]:
  """Four cases that cover full, causal, GQA and a window, in about a minute.

  float16 by default, the one dtype every contender (jax's FA3 too) takes.
  """
  dtypes = tuple(dtypes) if dtypes else ("float16",)
  cases = []
  for dtype in dtypes:
    cases += [
        Case("quick", 4, 4096, 4096, 16, 16, 128, dtype, causal=False),
        Case("quick", 4, 4096, 4096, 16, 16, 128, dtype, causal=True),
        Case("quick", 4, 4096, 4096, 32, 8, 128, dtype, causal=True),
        Case("quick", 2, 8192, 8192, 16, 16, 128, dtype, causal=True,
             window=(1024, 0)),
    ]
  return cases


SUITES = {
    "fa3": fa3_grid,
    "gqa": gqa_suite,
    "long": long_suite,
    "masks": masks_suite,
    "quick": quick_suite,
}
FULL = ("fa3", "gqa", "long", "masks")  # what "all" runs.


def suite_cases(name: str, dtypes: Iterable[str] | None = None) -> list[Case]:
  """The cases of suite ``name`` ("all" = fa3, gqa, long and masks).

  Raises:
    ValueError: for an unknown suite name.
  """
  if name == "all":
    return [c for n in FULL for c in suite_cases(n, dtypes)]
  if name not in SUITES:
    raise ValueError(f"unknown suite {name!r}; choose from "
                     f"{sorted(SUITES) + ['all', 'single']}")
  if dtypes is None:
    return SUITES[name]()
  return SUITES[name](dtypes=tuple(dtypes))


def estimated_cost(case: Case) -> float:
  """A relative guess of one case's wall time, to balance shards.

  Compiles dominate: about the same count for every case, more in float16
  (jax's FA3 runs only there, with a few block sizes). Execution adds with the
  FLOPs (the XLA contender and the long suite); 2e13 forward FLOPs is about as
  much again as the compiles.
  """
  compiles = 1.4 if case.dtype == "float16" else 1.0
  return compiles * (1.0 + flops_lib.forward_flops(case) / 2e13)


def shard(cases: list[Case], index: int, count: int) -> list[Case]:
  """Shard ``index`` (0-based) of ``count``: a similar share for each.

  The cases are grouped by suite, dtype, head_dim and heads, ranked by
  ``estimated_cost`` within a group, and dealt out in a snake (0, 1, ...,
  count-1, count-1, ..., 0, 0, 1, ...), so each shard gets about as many long
  and short cases of every dtype and head_dim as the others, and about the
  same total cost; a shard keeps the suite's order. The shards of one list
  partition it.

  Raises:
    ValueError: unless 0 <= index < count.
  """
  if count < 1 or not 0 <= index < count:
    raise ValueError(f"shard index={index}, count={count}: need "
                     f"0 <= index < count")

  def group_then_cost(i):
    c = cases[i]
    return (c.suite, c.dtype, c.head_dim, c.num_heads, c.num_kv_heads,
            -estimated_cost(c))

  ranked = sorted(range(len(cases)), key=group_then_cost)
  mine = set()
  for position, i in enumerate(ranked):
    lap, pos = divmod(position, count)
    if (pos if lap % 2 == 0 else count - 1 - pos) == index:
      mine.add(i)
  return [c for i, c in enumerate(cases) if i in mine]
