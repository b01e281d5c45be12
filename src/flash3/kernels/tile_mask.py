"""The elementwise mask of one score tile, from each row's key range.

In the forward and dq kernels a tile's rows are queries. By
``visibility.MaskSpec`` every query sees one contiguous range of keys (a
one-row ``key_range``), so a tile's keep is two compares per element of the
key index against its row's bounds (one without a window's left edge; Tk
and the right edge fold into one bound).

The pairwise rule (``MaskSpec.visible`` on a query and a key index tile, and
``key < Tk``) gives the same keep with one compare more per element. In the dq
kernel its keep (a boolean per element) also stayed live across the dP matmul,
where ptxas spilled 168 bytes at head_dim 128, causal; that kernel now selects
ds on p instead (``backward_tiles.zero_where_unseen``) and spills none (H200,
2026-12-03). The dk/dv kernel keeps the pairwise rule: the same change
there (its rows are keys: one-row ``query_range`` bounds, ds selected on p)
made the head_dim 64 causal backward 15-20% slower on the H200.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas.mosaic_gpu as plgpu

from flash3.visibility import MaskSpec

ROWS = plgpu.Layout.WGMMA.reduce(1)  # one value per tile row


def key_bounds(mask: MaskSpec, q_lo: Any, rows: int, shift: Any, kv_len: Any,
               q_len: Any = None):
  """Per query row ``q_lo + i`` (i < rows): the keys ``[lo, hi)`` it sees.

  ``lo`` is the int 0 when nothing bounds it below; rows ``>= q_len`` (when
  given) see nothing. Vectors in the ``ROWS`` layout, or scalars."""
  if not mask.is_structural and q_len is None:
    return 0, kv_len  # (No unused row iota: Mosaic GPU cannot lay it out.)
  q = q_lo + plgpu.broadcasted_iota(jnp.int32, (rows,), 0, layout=ROWS)
  lo, hi = mask.key_range(q, q + 1, shift, kv_len)
  if q_len is not None:
    hi = jnp.where(q < q_len, hi, 0)
  return lo, hi


def keep(bounds, col_lo: Any, shape: tuple[int, int]):
  """Boolean ``shape`` (WGMMA layout): column ``col_lo + j`` of row i lies in
  row i's ``[lo, hi)`` (``bounds``, from ``key_bounds``)."""
  lo, hi = bounds
  cols = col_lo + plgpu.broadcasted_iota(jnp.int32, shape, 1,
                                          layout=plgpu.Layout.WGMMA)

  def per_row(x):
    if jnp.ndim(x) == 0:
      return x
    return lax.broadcast_in_dim(x, shape, [0])

  ok = cols < per_row(hi)
  if not (isinstance(lo, int) and lo == 0):  # Column indices are >= 0.
    ok = ok & (cols >= per_row(lo))
  return ok
