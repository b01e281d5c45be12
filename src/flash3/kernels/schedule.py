"""Which work items each CTA of a persistent kernel runs, and in what order.

A work item is one (head, query CTA tile, batch) of the forward grid, numbered
in the grid's order (heads fastest, then query tiles, then batch). Items differ
in cost under causal or windowed masks: a query tile visits only the key tiles
it can see. Handing items out round-robin then gives some CTAs the long items
round after round (on the H200, persistent causal D=128 at T=1024-2048 lost
12-16% to the grid kernel that way).

``lpt_schedule`` is the classic longest-processing-time-first greedy rule
(Graham, "Bounds on multiprocessing timing anomalies", 1969): items sorted by
decreasing cost, each given to the CTA with the least work so far; its
makespan is within 4/3 of the optimum. Equal costs keep the grid's order and
go round-robin, so a non-causal kernel runs exactly the grid's items side by
side (neighbouring heads and query tiles share K/V in L2).

Locality (``rounds``): sorting all items by cost makes the CTAs run, at any
one time, items of equal cost from every batch row, head and document, so
the K/V they read at once spans the whole input (8 causal documents of 2048
at T=16384, D=128: about 125 MB of K/V in use against an L2 of 50 MB, in a
simulation of the schedule), and little of it is still in L2 when the next
item of the same head needs it. So the rule runs on consecutive chunks of
the grid's order, ``rounds * num_ctas`` items each: sorted longest first
within a chunk, the chunks in the grid's order (the same simulation: 25-30
MB in use, and a makespan within 1-3% of the global rule's). ``rounds=0``
sorts all items as one chunk (the schedule until the twenty-sixth session).

Costs are static: key tiles visited (from the MaskSpec and the buffer lengths;
per-batch lengths are runtime values and are not used) plus a fixed per-item
overhead for the prologue and epilogue. With segment ids (packed documents)
the key tiles an item visits depend on the ids, so ``segment_schedule``
builds the table on the device from the per-tile document ranges, once per
call: a static schedule there ran 12-51% slower than the grid kernel (tenth
session), its costs being wrong by up to the number of documents per row.
"""

from __future__ import annotations

import heapq

import jax.numpy as jnp
import numpy as np

from flash3.visibility import MaskSpec

# The prologue (q load, first K/V wait) and epilogue (normalise, store) of an
# item, in units of one key tile's work: a rough figure; only the order matters.
ITEM_OVERHEAD_TILES = 2
# ForwardConfig.schedule_rounds' default: chunks of two rounds, so the snake
# deal of ``segment_schedule`` pairs each CTA's longer item of a chunk with a
# shorter one (one round per chunk left its loads 25% apart in the simulation).
LOCALITY_ROUNDS = 2


def _check_rounds(rounds) -> None:
  if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 0:
    raise ValueError(f"rounds={rounds!r} must be an int >= 0 (0: one chunk)")


def _chunk_of(num_items: int, num_ctas: int, rounds: int):
  """Each item's chunk in the grid's order (all 0 when ``rounds`` is 0)."""
  pos = np.arange(num_items)
  return pos // (rounds * num_ctas) if rounds else np.zeros_like(pos)


def cta_tile_ranges(mask: MaskSpec, *, q_len: int, kv_len: int, cta_rows: int,
                    block_kv: int) -> np.ndarray:
  """int64 (num_q_ctas, 2): the key tiles ``[lo, hi)`` each query CTA tile
  (in position order) sees by the mask alone; ``[0, 0)`` when none."""
  num_q_ctas = -(-q_len // cta_rows)
  shift = mask.shift(q_len, kv_len)
  out = np.zeros((num_q_ctas, 2), np.int64)
  for q_cta in range(num_q_ctas):
    q_lo = q_cta * cta_rows
    k_lo, k_hi = mask.key_range(q_lo, min(q_lo + cta_rows, q_len), shift, kv_len)
    if k_hi > k_lo:
      out[q_cta] = k_lo // block_kv, -(-k_hi // block_kv)
  return out


def item_costs(mask: MaskSpec, *, q_len: int, kv_len: int, num_heads: int,
               batch: int, cta_rows: int, block_kv: int,
               reverse_q_tiles: bool) -> np.ndarray:
  """Static cost of every work item, in grid order (heads fastest)."""
  ranges = cta_tile_ranges(mask, q_len=q_len, kv_len=kv_len, cta_rows=cta_rows,
                           block_kv=block_kv)
  per_tile = ranges[:, 1] - ranges[:, 0] + ITEM_OVERHEAD_TILES
  if reverse_q_tiles:
    per_tile = per_tile[::-1]
  # Item i: head i % N, query tile (i // N) % num_q_ctas, batch i // (N * num_q_ctas).
  return np.tile(np.repeat(per_tile, num_heads), batch)


def segment_schedule(tile_ranges, mask_ranges: np.ndarray, *, num_heads: int,
                     reverse_q_tiles: bool, num_ctas: int,
                     rounds: int = LOCALITY_ROUNDS, warpgroups: int = 2):
  """``lpt_schedule``'s table for packed rows, built on the device (jnp).

  Args:
    tile_ranges: int32 (B, warpgroups * num_q_ctas, >= 2): per warpgroup
      query tile, the key tiles ``[lo, hi)`` its documents touch (column 0
      and 1 of ``forward._segment_tile_ranges``); a CTA streams the union
      of its ``warpgroups`` tiles.
    mask_ranges: ``cta_tile_ranges`` for the same shapes (the mask's bound).
    num_heads, reverse_q_tiles: as the kernel numbers its items.
    num_ctas: 1 <= num_ctas <= the item count.
    rounds: chunk length in rounds of ``num_ctas`` items (see the module
      docstring; 0: one chunk).
    warpgroups: compute warpgroups per CTA (``ForwardConfig.compute_warpgroups``).

  Within each chunk of the grid's order, items are sorted by decreasing cost
  (key tiles plus ITEM_OVERHEAD_TILES; equal costs keep the grid's order);
  the chunks follow each other, and the items are dealt to the CTAs in a
  snake (0 to C - 1, then C - 1 to 0, ...): vectorised, unlike the greedy
  rule. Each CTA runs its items chunk by chunk, longest first within one.
  Same table layout as ``lpt_schedule``.
  """
  _check_rounds(rounds)
  batch = tile_ranges.shape[0]
  num_q_ctas = mask_ranges.shape[0]
  num_items = batch * num_q_ctas * num_heads
  if not 1 <= num_ctas <= num_items:
    raise ValueError(f"num_ctas={num_ctas} must be in [1, {num_items}] (the items)")
  pairs = tile_ranges[:, :warpgroups * num_q_ctas, :2].reshape(
      batch, num_q_ctas, warpgroups, 2)
  lo = jnp.maximum(pairs[..., 0].min(-1), jnp.asarray(mask_ranges[:, 0], jnp.int32))
  hi = jnp.minimum(pairs[..., 1].max(-1), jnp.asarray(mask_ranges[:, 1], jnp.int32))
  cost = jnp.maximum(hi - lo, 0) + ITEM_OVERHEAD_TILES  # (B, num_q_ctas)
  if reverse_q_tiles:
    cost = cost[:, ::-1]
  # Grid order: heads fastest, then query tiles, then batch.
  cost = jnp.broadcast_to(cost[:, :, None], (batch, num_q_ctas, num_heads)).reshape(-1)
  chunk = jnp.asarray(_chunk_of(num_items, num_ctas, rounds), jnp.int32)
  # Chunk first, then cost descending, then the grid's order (lexsort is stable).
  order = jnp.lexsort((-cost, chunk)).astype(jnp.int32)
  pos = jnp.arange(num_items, dtype=jnp.int32)
  rnd, col = pos // num_ctas, pos % num_ctas
  cta = jnp.where(rnd % 2 == 0, col, num_ctas - 1 - col)
  per_cta = -(-num_items // num_ctas)
  table = jnp.zeros((num_ctas, 2 + per_cta), jnp.int32)
  table = table.at[cta, 1 + rnd].set(order)
  return table.at[:, 0].set(jnp.zeros((num_ctas,), jnp.int32).at[cta].add(1))


def lpt_schedule(costs: np.ndarray, num_ctas: int,
                 rounds: int = LOCALITY_ROUNDS) -> np.ndarray:
  """int32 (num_ctas, 2 + max items per CTA): column 0 the CTA's item count,
  then its items in the order it runs them (chunk by chunk of ``rounds *
  num_ctas`` items in the grid's order, longest first within one; 0: one
  chunk), zero-padded (one spare column, so reading one item past the end
  stays in bounds).

  Requires 1 <= num_ctas <= len(costs), so every CTA gets at least one item.
  """
  _check_rounds(rounds)
  num_items = len(costs)
  if not 1 <= num_ctas <= num_items:
    raise ValueError(f"num_ctas={num_ctas} must be in [1, {num_items}] (the items)")
  costs = np.asarray(costs)
  if (costs == costs[0]).all():
    # Equal costs (no causal mask or window): the greedy rule deals the items
    # round-robin in grid order; done with arrays, since a long non-causal
    # query can make millions of items.
    per_cta = -(-num_items // num_ctas)
    ids = np.arange(per_cta * num_ctas).reshape(per_cta, num_ctas).T
    counts = (ids < num_items).sum(axis=1)
    table = np.zeros((num_ctas, 2 + per_cta), np.int32)
    table[:, 0] = counts
    table[:, 1:1 + per_cta] = np.where(ids < num_items, ids, 0)
    return table
  chunk = _chunk_of(num_items, num_ctas, rounds)
  order = np.lexsort((np.arange(num_items), -costs, chunk))
  heap = [(0, cta) for cta in range(num_ctas)]  # (work so far, cta): ties -> lower cta
  lists = [[] for _ in range(num_ctas)]
  for i in order:
    load, cta = heapq.heappop(heap)
    lists[cta].append(i)
    heapq.heappush(heap, (load + int(costs[i]), cta))
  width = 2 + max(len(l) for l in lists)
  table = np.zeros((num_ctas, width), np.int32)
  for cta, items in enumerate(lists):
    table[cta, 0] = len(items)
    table[cta, 1:1 + len(items)] = items
  return table
