"""End tiles: rows outside a batch row's valid range reach the kernels as
zeros without a select over the whole array (E07).

With per-batch lengths, rows past a length (or outside what any valid query
or key reaches, ``visibility.key_bounds`` / ``query_bounds``) may hold NaN or
Inf, and a probability (or dS) of exactly 0 times NaN inside a matmul is NaN.
A kernel loads only the tiles that overlap a batch row's kept rows [lo, hi),
and of those only the first and the last can hold a row outside it. ``build``
gathers those two tiles per batch row, rows outside [lo, hi) selected to 0,
into a small side array; the kernel's loader (``copy_tile``) reads tile t
from it when t is one of the two, else from the array itself.

This replaces ``jnp.where`` over the whole array (one read and one write of
it): at B=4, T=4096, N=16, D=128, causal with lengths, the forward's select of
v took 13% of its time and the backward's of q, k, v and do 8% (H200,
2026-12-03, twentieth session, scripts/api_kernels.py); forward+backward
went from 0.86 to 0.94 of cuDNN's there.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp


def build(x, lo, hi, block: int):
  """The end tiles of ``x`` for tiles of ``block`` rows: the first and the
  last tile of each batch row's kept rows.

  Args:
    x: (B, T, H, D), the array a kernel loads in tiles of ``block`` rows
      along T (T may be padded past the lengths; rows at or past T count as 0).
    lo, hi: (B,) int32, each batch row's kept rows [lo, hi) (hi <= lo: none).
    block: the kernel's tile rows for ``x``.
  Returns:
    (edges, index): edges (B, 2 * block, H, D) in x's dtype, the first and
    the last tile of [lo, hi) with the rows outside it 0; index (B, 2)
    int32, those tiles' indices, (-1, -1) where the row keeps nothing.
  """
  T = x.shape[1]
  nonempty = hi > lo
  first = jnp.where(nonempty, lo // block, -1)
  last = jnp.where(nonempty, (hi - 1) // block, -1)
  index = jnp.stack([first, last], axis=1).astype(jnp.int32)
  rows = (jnp.maximum(index, 0)[:, :, None] * block
          + jnp.arange(block, dtype=jnp.int32)[None, None, :]).reshape(-1, 2 * block)
  keep = (rows >= lo[:, None]) & (rows < hi[:, None]) & (rows < T)
  tiles = jax.vmap(lambda xb, rb: xb[rb])(x, jnp.minimum(rows, T - 1))
  edges = jnp.where(keep[:, :, None, None], tiles, jnp.zeros((), x.dtype))
  return edges, index


def copy_tile(src, edges, batch, t, block: int, head, dst, barrier):
  """TMA of rows [t * block, (t + 1) * block) of ``src[batch, :, head]`` into
  ``dst`` (arriving on ``barrier``), from ``edges`` (``build``'s pair, refs;
  or None) when tile t is one of the batch row's two end tiles."""
  if edges is None:
    plgpu.copy_gmem_to_smem(src.at[batch, pl.ds(t * block, block), head], dst, barrier)
    return
  edge_ref, index_ref = edges
  is_first = t == index_ref[batch, 0]
  is_last = (t == index_ref[batch, 1]) & jnp.logical_not(is_first)

  def copy(ref, row0):
    plgpu.copy_gmem_to_smem(ref.at[batch, pl.ds(row0, block), head], dst, barrier)

  pl.when(is_first)(lambda: copy(edge_ref, 0))
  pl.when(is_last)(lambda: copy(edge_ref, block))
  pl.when(jnp.logical_not(is_first | is_last))(lambda: copy(src, t * block))
