"""Which (query, key) pairs are visible: the one definition of flash3's masks.

The reference, the forward kernel and the backward kernels all ask this module,
so they can never disagree about a mask. Everything here works on Python ints,
NumPy arrays and traced jax values alike (the kernels call it on iotas and on
tile bounds), and is written only with ``+ - <= >= & |`` and min/max.

Positions and alignment (docs/semantics.md has worked examples):

* Query ``i`` in ``[0, Tq)``, key ``j`` in ``[0, Tk)``.
* ``shift`` aligns the query axis on the key axis: query ``i`` stands at key
  position ``i' = i + shift``. "top_left" (jax.nn's rule) has ``shift = 0``;
  "bottom_right" (FlashAttention's and cuDNN's) has ``shift = Tk - Tq``, with
  the valid lengths in place of Tq, Tk when sequence lengths are given (per
  batch row, as FlashAttention's varlen does).
* causal keeps ``j <= i'``.
* a window ``(left, right)`` keeps ``i' - left <= j <= i' + right`` (both ends
  inclusive). With causal as well, the right edge becomes ``min(right, 0)``.
* lengths keep ``i < q_len`` and ``j < kv_len``; segment ids keep
  ``q_segment_ids[i] == kv_segment_ids[j]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

Alignment = Literal["top_left", "bottom_right"]
ALIGNMENTS = ("top_left", "bottom_right")


def _is_static(*xs) -> bool:
  return all(isinstance(x, (int, np.integer)) for x in xs)


def _max(a, b):
  return max(a, b) if _is_static(a, b) else jnp.maximum(a, b)


def _min(a, b):
  return min(a, b) if _is_static(a, b) else jnp.minimum(a, b)


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """The static part of a mask: causal, alignment and window.

  Hashable, so kernels take it as a static argument. Lengths and segment ids
  are data and travel separately.

  Attributes:
    causal: keep keys at or before the aligned query position.
    alignment: "top_left" or "bottom_right" (see the module docstring).
    window_left: keys at most this far before the aligned query position are
      kept; None means no limit. An int >= 0.
    window_right: keys at most this far after the aligned query position are
      kept; None means no limit. An int >= 0.
  """

  causal: bool = False
  alignment: Alignment = "top_left"
  window_left: int | None = None
  window_right: int | None = None

  def __post_init__(self):
    if self.alignment not in ALIGNMENTS:
      raise ValueError(
          f"causal_alignment={self.alignment!r} is not one of {ALIGNMENTS}")
    for name in ("window_left", "window_right"):
      value = getattr(self, name)
      if value is not None and (not _is_static(value) or value < 0):
        raise ValueError(f"{name}={value!r} must be None or an int >= 0")

  @property
  def right(self) -> int | None:
    """The effective right edge: causal clamps it to 0."""
    if self.causal:
      return 0 if self.window_right is None else min(self.window_right, 0)
    return self.window_right

  @property
  def left(self) -> int | None:
    return self.window_left

  @property
  def is_structural(self) -> bool:
    """True when causal or a window restricts visibility."""
    return self.right is not None or self.left is not None

  def shift(self, q_len: Any, kv_len: Any) -> Any:
    """Offset added to a query index to place it on the key axis.

    Args:
      q_len, kv_len: the (valid) query and key lengths: ints, or (B,) arrays
        when sequence lengths are given.
    """
    if self.alignment == "top_left":
      return 0
    return kv_len - q_len

  def visible(self, q_idx: Any, k_idx: Any, shift: Any = 0) -> Any:
    """Elementwise: is key ``k_idx`` visible from query ``q_idx``?

    Only the structural part (causal and window); broadcasting rules apply.
    Returns a boolean of the broadcast shape (a Python bool for ints).
    """
    q_pos = q_idx + shift
    keep = True
    if self.right is not None:
      keep = (k_idx <= q_pos + self.right) & keep
    if self.left is not None:
      keep = (k_idx >= q_pos - self.left) & keep
    if keep is True:  # Nothing restricts: broadcast a True of the right shape.
      return (q_idx == q_idx) & (k_idx == k_idx)
    return keep

  def key_range(self, q_lo: Any, q_hi: Any, shift: Any, kv_len: Any):
    """Keys ``[k_lo, k_hi)`` that some query in ``[q_lo, q_hi)`` may see.

    Every key outside is invisible to every query of the range, so a kernel
    can skip it. May return ``k_lo >= k_hi`` (nothing visible).
    """
    k_lo = 0 if self.left is None else _max(0, q_lo + shift - self.left)
    k_hi = kv_len
    if self.right is not None:
      k_hi = _min(kv_len, q_hi - 1 + shift + self.right + 1)
    return k_lo, k_hi

  def query_range(self, k_lo: Any, k_hi: Any, shift: Any, q_len: Any):
    """Queries ``[q_lo, q_hi)`` that may see some key in ``[k_lo, k_hi)``."""
    q_lo = 0 if self.right is None else _max(0, k_lo - shift - self.right)
    q_hi = q_len
    if self.left is not None:
      q_hi = _min(q_len, k_hi - 1 - shift + self.left + 1)
    return q_lo, q_hi

  def full_key_range(self, q_lo: Any, q_hi: Any, shift: Any, kv_len: Any):
    """Keys ``[k_lo, k_hi)`` that EVERY query in ``[q_lo, q_hi)`` sees.

    A key tile inside this range needs no elementwise structural mask.
    """
    k_lo = 0 if self.left is None else _max(0, q_hi - 1 + shift - self.left)
    k_hi = kv_len
    if self.right is not None:
      k_hi = _min(kv_len, q_lo + shift + self.right + 1)
    return k_lo, k_hi

  def full_query_range(self, k_lo: Any, k_hi: Any, shift: Any, q_len: Any):
    """Queries ``[q_lo, q_hi)`` that see EVERY key in ``[k_lo, k_hi)``.

    A query tile inside this range needs no elementwise structural mask
    against that key tile (the backward's dk/dv kernel walks query tiles).
    """
    q_lo = 0 if self.right is None else _max(0, k_hi - 1 - shift - self.right)
    q_hi = q_len
    if self.left is not None:
      q_hi = _min(q_len, k_lo - shift + self.left + 1)
    return q_lo, q_hi


def keys_in_reach(spec: MaskSpec, q_lengths, kv_lengths, kv_len_static: int):
  """(B, Tk) bool: key j is below kv_len and some query below q_len may see it.

  By the causal mask's and the window's reach alone (``MaskSpec.key_range``
  over each batch row's valid queries); segment ids are not considered.
  Keys outside are seen by no query, so a caller may select them to 0 (E07).

  Args:
    spec: the MaskSpec.
    q_lengths, kv_lengths: (B,) int32 valid lengths.
    kv_len_static: Tk, the key axis' size.
  """
  return _rows_within(key_bounds(spec, q_lengths, kv_lengths), kv_len_static)


def key_bounds(spec: MaskSpec, q_lengths, kv_lengths):
  """((B,), (B,)) int32 [lo, hi): the keys ``keys_in_reach`` keeps, per batch
  row (hi <= lo where none)."""
  q_len = jnp.asarray(q_lengths, jnp.int32)
  kv_len = jnp.asarray(kv_lengths, jnp.int32)
  bounds = spec.key_range(0, q_len, spec.shift(q_len, kv_len), kv_len)
  return _clip_bounds(bounds, kv_len)


def queries_in_reach(spec: MaskSpec, q_lengths, kv_lengths, q_len_static: int):
  """(B, Tq) bool: query i is below q_len and may see some key below kv_len.

  The mirror of ``keys_in_reach`` (``MaskSpec.query_range``); rows outside
  see no key, so their q (and do) may be selected to 0 (E06, E07).
  """
  return _rows_within(query_bounds(spec, q_lengths, kv_lengths), q_len_static)


def query_bounds(spec: MaskSpec, q_lengths, kv_lengths):
  """The mirror of ``key_bounds``: the query rows ``queries_in_reach`` keeps."""
  q_len = jnp.asarray(q_lengths, jnp.int32)
  kv_len = jnp.asarray(kv_lengths, jnp.int32)
  bounds = spec.query_range(0, kv_len, spec.shift(q_len, kv_len), q_len)
  return _clip_bounds(bounds, q_len)


def _clip_bounds(bounds, length):
  """(lo, hi) as (B,) int32 arrays within [0, length] (bounds may be ints)."""
  lo, hi = (jnp.broadcast_to(jnp.asarray(x, jnp.int32), length.shape) for x in bounds)
  return jnp.maximum(lo, 0), jnp.minimum(hi, length)


def _rows_within(bounds, size: int):
  """(B, size) bool: lo[b] <= i < hi[b]."""
  lo, hi = (x[:, None] for x in bounds)
  i = jnp.arange(size, dtype=jnp.int32)[None, :]
  return (i >= lo) & (i < hi)


def dense_mask(
    spec: MaskSpec,
    q_len_static: int,
    kv_len_static: int,
    *,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    query_segment_ids=None,
    key_value_segment_ids=None,
):
  """The full boolean visibility, shape (B or 1, 1, Tq, Tk): True = visible.

  Used by the reference; the kernels evaluate the same rules tile by tile.
  """
  q_idx = jnp.arange(q_len_static, dtype=jnp.int32)[:, None]
  k_idx = jnp.arange(kv_len_static, dtype=jnp.int32)[None, :]
  q_len = q_len_static if query_seq_lengths is None else query_seq_lengths
  kv_len = kv_len_static if key_value_seq_lengths is None else key_value_seq_lengths
  q_len = jnp.asarray(q_len, jnp.int32).reshape(-1, 1, 1, 1)
  kv_len = jnp.asarray(kv_len, jnp.int32).reshape(-1, 1, 1, 1)
  shift = spec.shift(q_len, kv_len)
  keep = spec.visible(q_idx, k_idx, shift) & (q_idx < q_len) & (k_idx < kv_len)
  if query_segment_ids is not None:
    keep = keep & (query_segment_ids[:, None, :, None]
                   == key_value_segment_ids[:, None, None, :])
  return keep
