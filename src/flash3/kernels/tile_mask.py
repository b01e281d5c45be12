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

At a tile on the edge of its rows' ranges one bound usually cannot cut it
(a window's far edge: the rows' upper bounds lie past its columns; a causal
diagonal with a window: their lower bounds lie before them). ``mask_scores``
then compares only the other bound: the kernels run such tiles in loops of
their own (``edge_tiles`` and ``edge_loops`` split their masked ranges). Offline (ptxas, D=128
causal window of 1024) the forward's masked loop held 861 instructions
against the unmasked loop's 568: per element two compares and two selects,
where one of each suffices on such a tile. (Choosing the side by a branch
inside one loop made it worse: LLVM merged the two selects after the branch
and kept the predicates in registers.)
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


SIDES = ("lo", "hi")


def query_bounds(mask: MaskSpec, k_lo: Any, rows: int, shift: Any, q_len: Any,
                 kv_len: Any = None):
  """Per key row ``k_lo + i`` (i < rows): the queries ``[lo, hi)`` that see it
  (the dk/dv kernel's rows are keys). Rows ``>= kv_len`` (when given) are
  seen by none. Vectors in the ``ROWS`` layout, or scalars."""
  if not mask.is_structural and kv_len is None:
    return 0, q_len
  k = k_lo + plgpu.broadcasted_iota(jnp.int32, (rows,), 0, layout=ROWS)
  lo, hi = mask.query_range(k, k + 1, shift, q_len)
  if kv_len is not None:
    hi = jnp.where(k < kv_len, hi, 0)
  return lo, hi


def keep(bounds, col_lo: Any, shape: tuple[int, int], sides: tuple[str, ...] = SIDES):
  """Boolean ``shape`` (WGMMA layout): column ``col_lo + j`` of row i lies in
  row i's ``[lo, hi)`` (``bounds``, from ``key_bounds``), comparing only the
  bounds named in ``sides`` (the caller knows the others cannot cut this
  tile: ``edge_tiles``). None when nothing is left to compare."""
  lo, hi = bounds
  cols = col_lo + plgpu.broadcasted_iota(jnp.int32, shape, 1,
                                          layout=plgpu.Layout.WGMMA)

  def per_row(x):
    if jnp.ndim(x) == 0:
      return x
    return lax.broadcast_in_dim(x, shape, [0])

  ok = cols < per_row(hi) if "hi" in sides else None
  if "lo" in sides and not (isinstance(lo, int) and lo == 0):  # Columns are >= 0.
    at_lo = cols >= per_row(lo)
    ok = at_lo if ok is None else ok & at_lo
  return ok


def mask_scores(s, bounds, col_lo: Any, *, sides: tuple[str, ...] = SIDES,
                also=None):
  """``s`` with -inf outside each row's key range (``keep`` with ``sides``)
  and where ``also`` (None or a boolean of s's shape) is False."""
  ok = keep(bounds, col_lo, s.shape, sides)
  if also is not None:
    ok = also if ok is None else ok & also
  return s if ok is None else jnp.where(ok, s, -jnp.inf)


def edge_tiles(full, block_kv: int):
  """``(hi_cuts_from, lo_cut_below)`` for tiles of ``block_kv`` columns, given
  ``full``, the columns ``(f_lo, f_hi)`` every row sees (``MaskSpec.
  full_key_range`` / ``full_query_range``: f_lo is the largest lower bound,
  f_hi the smallest upper one, the length included): tiles ``t >=
  hi_cuts_from`` (or the upper half of one) may be cut by some row's upper
  bound, tiles ``t < lo_cut_below`` (or the lower half of one) by some row's
  lower bound; exactly those."""
  f_lo, f_hi = full
  hi_cuts_from = lax.div(jnp.maximum(jnp.asarray(f_hi, jnp.int32), 0), block_kv)
  lo_cut_below = lax.div(jnp.asarray(f_lo, jnp.int32) + (block_kv - 1), block_kv)
  return hi_cuts_from, lo_cut_below


def edge_loops(lo: Any, hi: Any, edge: str, cuts):
  """Masked tiles ``[lo, hi)`` on the rows' lower / upper ``edge``, split in
  order into ``[(first, end, sides), ...]``: the tiles that only that edge's
  bound can cut compare it alone, the others both (``cuts``: ``edge_tiles``)."""
  hi_cuts_from, lo_cut_below = cuts
  if edge == "lower":
    at = jnp.clip(hi_cuts_from, lo, hi)
    return [(lo, at, ("lo",)), (at, hi, SIDES)]
  at = jnp.clip(lo_cut_below, lo, hi)
  return [(lo, at, SIDES), (at, hi, ("hi",))]
