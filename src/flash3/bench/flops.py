"""FLOPs of attention by FlashAttention-3's convention (paper, section 4.1).

Forward: two matmuls (q k^T and p v) of 2 FLOPs per multiply-add each, so
``4 * D`` FLOPs per (query, key) pair per head, counted only for the pairs
that are visible. Backward: 2.5x the forward (five matmuls instead of two);
forward+backward: 3.5x. Softmax, masking and rescaling are not counted.

For plain causal attention with Tq == Tk the convention counts exactly half
of the Tq*Tk pairs (not T(T+1)/2), as FlashAttention-3's and jax's benchmarks
do, so numbers compare with theirs. Every other mask (windows, packed
documents, padding lengths, Tq != Tk) counts the visible pairs exactly: with
lengths, query rows and keys past a batch row's length count nothing.
"""

from __future__ import annotations

import numpy as np

from flash3.visibility import MaskSpec

BACKWARD_FACTOR = 2.5
FACTORS = {"fwd": 1.0, "bwd": BACKWARD_FACTOR, "fwd+bwd": 1.0 + BACKWARD_FACTOR}


def visible_pairs(q_len: int, kv_len: int, spec: MaskSpec,
                  q_segment_ids: np.ndarray | None = None,
                  kv_segment_ids: np.ndarray | None = None,
                  q_valid: int | None = None,
                  kv_valid: int | None = None) -> int:
  """How many (query, key) pairs of one batch row and head are visible.

  Uses ``spec`` (causal, window, alignment) as flash3.visibility defines it,
  intersected with "same segment id" when segment ids are given, and with
  "query i < q_valid and key j < kv_valid" when lengths are given.

  Args:
    q_len, kv_len: Tq and Tk.
    spec: the structural mask.
    q_segment_ids: (Tq,) ints, or None.
    kv_segment_ids: (Tk,) ints, non-decreasing (packed documents lie in
      contiguous runs), or None. Given together with q_segment_ids.
    q_valid, kv_valid: this row's valid query and key lengths (right
      padding), or None for all of Tq, Tk. Either may be given alone; they
      also set the bottom-right alignment's shift, as in flash3.

  Returns:
    The exact count, a Python int. O(Tq log Tk) time, no Tq x Tk array.

  Raises:
    ValueError: when only one of the segment id arrays is given, or the key
      segment ids are not sorted.
  """
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("give both q_segment_ids and kv_segment_ids, or neither")
  q_valid = q_len if q_valid is None else int(q_valid)
  kv_valid = kv_len if kv_valid is None else int(kv_valid)
  if not (0 <= q_valid <= q_len and 0 <= kv_valid <= kv_len):
    raise ValueError(f"q_valid={q_valid}, kv_valid={kv_valid} must lie in "
                     f"[0, {q_len}] and [0, {kv_len}]")
  q = np.arange(q_len, dtype=np.int64)
  shift = spec.shift(q_valid, kv_valid)
  # Each query sees one contiguous interval [lo, hi) of keys; padding
  # queries (i >= q_valid) an empty one.
  lo = np.zeros(q_len, np.int64)
  hi = np.where(q < q_valid, kv_valid, 0).astype(np.int64)
  if spec.left is not None:
    lo = np.maximum(lo, q + shift - spec.left)
  if spec.right is not None:
    hi = np.minimum(hi, q + shift + spec.right + 1)
  if q_segment_ids is not None:
    q_ids = np.asarray(q_segment_ids).reshape(-1)
    kv_ids = np.asarray(kv_segment_ids).reshape(-1)
    if q_ids.shape != (q_len,) or kv_ids.shape != (kv_len,):
      raise ValueError(f"segment ids of shapes {q_ids.shape}, {kv_ids.shape} "
                       f"do not match q_len={q_len}, kv_len={kv_len}")
    if np.any(np.diff(kv_ids) < 0):
      raise ValueError("kv_segment_ids must be non-decreasing (packed rows)")
    lo = np.maximum(lo, np.searchsorted(kv_ids, q_ids, side="left"))
    hi = np.minimum(hi, np.searchsorted(kv_ids, q_ids, side="right"))
  return int(np.maximum(hi - lo, 0).sum())


def forward_flops(case) -> float:
  """Forward FLOPs of a ``cases.Case``: 4 * D * visible pairs * B * N."""
  spec = case.mask_spec
  plain_causal_square = (case.causal and case.window is None
                         and case.num_docs is None
                         and case.seq_lengths is None
                         and case.q_len == case.kv_len)
  if plain_causal_square:
    pairs_per_head = case.q_len * case.kv_len / 2
    return 4.0 * case.batch * case.num_heads * case.head_dim * pairs_per_head
  segment_ids = case.segment_ids()
  lengths = case.lengths()
  if segment_ids is None and lengths is None:
    pairs = visible_pairs(case.q_len, case.kv_len, spec) * case.batch
  else:
    pairs = 0
    for b in range(case.batch):  # Rows differ: count each.
      row = None if segment_ids is None else segment_ids[b]
      valid = None if lengths is None else int(lengths[b])
      pairs += visible_pairs(case.q_len, case.kv_len, spec, row, row,
                             q_valid=valid, kv_valid=valid)
  return 4.0 * case.num_heads * case.head_dim * pairs


def flops(case, mode: str) -> float:
  """FLOPs of ``mode`` ("fwd", "bwd" or "fwd+bwd") for ``case``."""
  if mode not in FACTORS:
    raise ValueError(f"mode={mode!r} is not one of {tuple(FACTORS)}")
  return FACTORS[mode] * forward_flops(case)


def tflops_per_s(flop_count: float, ms: float | None) -> float | None:
  """TFLOP/s from a FLOP count and milliseconds (None when ms is not > 0)."""
  if ms is None or not ms > 0:
    return None
  return flop_count / (ms * 1e-3) / 1e12
