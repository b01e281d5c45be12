"""Pieces the two backward kernels share: tile plans (which tiles a warpgroup
visits, which of them need an elementwise mask), the softmax probabilities
and the soft cap's chain rule, per-batch extras, register splits and the
drain of skipped ring slots (``flash3.kernels.backward``).
"""

from __future__ import annotations

import functools

import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from flash3.kernels import common, end_tiles, exp2


# Tile ranges. All arithmetic is on int32 scalars (traced or Python ints) and
# only on non-negative values where it divides, so lax.div is floor division.


def _div(x, m: int):
  return lax.div(x, jnp.int32(m))


def _cdiv(x, m: int):
  return lax.div(x + (m - 1), jnp.int32(m))


def _clamp(x, lo, hi):
  return jnp.minimum(jnp.maximum(x, lo), hi)


def tile_plan(lo, hi, span_lo, span_hi, full_lo, full_hi, block: int):
  """Tiles of size ``block`` for one warpgroup's row range.

  Args:
    lo, hi: the warpgroup's own rows (already clipped to the length).
    span_lo, span_hi: the other axis' positions any of those rows may see.
    full_lo, full_hi: the positions all of those rows see.
  Returns:
    (nonempty, t_lo, a, b, t_hi): tiles [t_lo, t_hi) are visited; those in
    [a, b) need no elementwise mask.
  """
  span_hi = jnp.maximum(span_hi, 0)
  nonempty = (hi > lo) & (span_hi > span_lo)
  t_lo = _div(span_lo, block)
  t_hi = jnp.maximum(_cdiv(span_hi, block), t_lo)
  a = _clamp(_cdiv(full_lo, block), t_lo, t_hi)
  b = _clamp(_div(jnp.maximum(full_hi, 0), block), a, t_hi)
  return nonempty, t_lo, a, b, t_hi


def rows_plan(lo, block: int, other_block: int, row_len, reach, full,
              seg_ranges=None):
  """``tile_plan`` for the rows [lo, lo + block) (clipped to ``row_len``)
  over the other axis' tiles of ``other_block``.

  ``reach`` and ``full`` map the rows (lo, hi) to the other axis' positions
  any of them / all of them see (the mask's key_range / full_key_range for
  the dq kernel, query_range / full_query_range for the dk/dv kernel).
  ``seg_ranges``: None, or the row tile index -> its segment tile ranges
  ``[lo, hi, full_lo, full_hi)`` (``limit_plan``).
  """
  hi = jnp.minimum(lo + block, row_len)
  plan = tile_plan(lo, hi, *reach(lo, hi), *full(lo, hi), other_block)
  if seg_ranges is not None:
    plan = limit_plan(plan, seg_ranges(lax.div(lo, jnp.int32(block))))
  return plan


def union(plans):
  """The CTA's tile range: the union of its warpgroups' nonempty ranges."""
  big = jnp.int32(2**30)
  lo = functools.reduce(jnp.minimum, [jnp.where(p[0], p[1], big) for p in plans])
  hi = functools.reduce(jnp.maximum, [jnp.where(p[0], p[4], 0) for p in plans])
  lo = jnp.where(hi > lo, lo, 0)
  hi = jnp.maximum(hi, lo)
  return lo, hi


def own_sections(plan, cta_lo, cta_hi):
  """[cta_lo, t_lo) drain, [t_lo, a) masked, [a, b) full, [b, t_hi) masked, [t_hi, cta_hi) drain."""
  nonempty, t_lo, a, b, t_hi = plan
  t_lo = jnp.where(nonempty, _clamp(t_lo, cta_lo, cta_hi), cta_lo)
  a = jnp.where(nonempty, _clamp(a, t_lo, cta_hi), t_lo)
  b = jnp.where(nonempty, _clamp(b, a, cta_hi), a)
  t_hi = jnp.where(nonempty, _clamp(t_hi, b, cta_hi), b)
  return t_lo, a, b, t_hi


def limit_plan(plan, seg):
  """Intersects a tile plan with segment tile ranges ``[lo, hi, full_lo, full_hi)``."""
  nonempty, t_lo, a, b, t_hi = plan
  s_lo, s_hi, f_lo, f_hi = seg
  t_lo = jnp.maximum(t_lo, s_lo)
  t_hi = jnp.maximum(jnp.minimum(t_hi, s_hi), t_lo)
  nonempty = nonempty & (t_hi > t_lo)
  a = _clamp(jnp.maximum(a, f_lo), t_lo, t_hi)
  b = _clamp(jnp.minimum(b, f_hi), a, t_hi)
  return nonempty, t_lo, a, b, t_hi


def probabilities(s, lse2, *, scale: float, softcap: float | None,
                  fma_cols: int = 0, guard: bool = True):
  """p = exp(scale s (soft-capped) - lse) via exp2, and tanh(scale s / c) or None.

  ``lse2`` is lse * log2(e), already broadcast to s's shape. The first
  ``fma_cols`` columns take exp2 on the FMA pipes (``exp2.split_exp2``;
  ``guard`` as there).
  """
  if softcap is None:
    x = s * (scale * common.LOG2_E) - lse2
    return exp2.split_exp2(x, fma_cols, guard=guard), None
  th = jnp.tanh(s * common.softcap_factor(scale, softcap))
  x = th * (softcap * common.LOG2_E) - lse2
  return exp2.split_exp2(x, fma_cols, guard=guard), th


def score_like(shape, softcap, p_dtype=None):
  """Initial values shaped like ``probabilities``' results (run_state outputs);
  ``p_dtype``: with a soft cap, p's dtype when p leaves in the input dtype
  (``BackwardConfig.fold_softcap`` in the dk/dv kernel)."""
  zeros = lambda dt=jnp.float32: plgpu.layout_cast(jnp.zeros(shape, dt),
                                                   plgpu.Layout.WGMMA)
  if softcap is None:
    return zeros(), None
  return zeros(jnp.float32 if p_dtype is None else p_dtype), zeros()


def through_softcap(ds, th):
  """d/ds of c tanh(s / c) is 1 - tanh^2: the chain rule through the soft cap."""
  return ds if th is None else ds * (1.0 - th * th)


def zero_where_unseen(ds, p):
  """ds with 0 wherever p is exactly 0: masked pairs (p was selected to 0),
  so NaN or inf in a V row that this query cannot see cannot leak into dq
  through 0 * (dp - delta). (The dq kernel's; the dk/dv kernel selects on its
  keep, see ``tile_mask``.)

  Selecting on p rather than on the tile's keep frees the keep's registers
  across the dp matmul. A visible pair whose p underflowed to 0 gets ds = 0
  too, which is its exact value whenever dp - delta is finite (and p = 0
  contributes nothing to o, so nothing of it to differentiate)."""
  return jnp.where(p == 0.0, 0.0, ds)


END_TILE_OPERANDS = ("q", "do", "k", "v")


def length_extras(q, k, v, do, lengths, bounds, *, block_q: int, block_kv: int):
  """A kernel's extra inputs for per-batch lengths: the two length arrays,
  then q, do, k and v's ``end_tiles.build`` pairs for its tile sizes
  (``bounds``: the kept query rows and keys, ``visibility.query_bounds`` and
  ``key_bounds``). Empty without lengths."""
  if lengths is None:
    return ()
  (q_lo, q_hi), (k_lo, k_hi) = bounds
  out = tuple(lengths)
  for x, lo, hi, block in ((q, q_lo, q_hi, block_q), (do, q_lo, q_hi, block_q),
                           (k, k_lo, k_hi, block_kv), (v, k_lo, k_hi, block_kv)):
    out += end_tiles.build(x, lo, hi, block)
  return out


def split_extras(refs, has_lengths: bool, has_segments: bool, b):
  """(q_len, kv_len) scalars (or None), the end tile refs (a dict of
  ``END_TILE_OPERANDS``, empty without lengths) and the segment refs (or
  None) of one batch row."""
  refs = list(refs)
  lens, edges = None, {}
  if has_lengths:
    # Per-batch scalars: scalar loads from global memory, kept in registers.
    q_len_ref, kv_len_ref = refs.pop(0), refs.pop(0)
    lens = (q_len_ref[b], kv_len_ref[b])
    for name in END_TILE_OPERANDS:
      edges[name] = (refs.pop(0), refs.pop(0))
  return lens, edges, (tuple(refs) if has_segments else None)


def set_registers(num_compute_wgs: int, compute: bool, config) -> None:
  # setmaxnreg: 64K registers shared by the compute warpgroups and the producer.
  if num_compute_wgs == 2:
    plgpu.set_max_registers(
        config.compute_registers if compute else config.producer_registers,
        action="increase" if compute else "decrease")


def drain_loop(lo, hi, slot_of, ready_barriers, consumed, then=None):
  """Wait for tiles this warpgroup skips and release them: every waiter sees
  every phase. ``then(step)``, if given, runs after each release."""
  def body(step, carry):
    slot = slot_of(step)
    for barrier in ready_barriers:
      plgpu.barrier_wait(barrier.at[slot])
    plgpu.barrier_arrive(consumed.at[slot])
    if then is not None:
      then(step)
    return carry
  lax.fori_loop(lo, hi, body, None)
