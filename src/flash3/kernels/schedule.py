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

Costs are static: key tiles visited (from the MaskSpec and the buffer lengths;
per-batch lengths and segment ids are runtime values and are not used) plus
a fixed per-item overhead for the prologue and epilogue.
"""

from __future__ import annotations

import heapq

import numpy as np

from flash3.visibility import MaskSpec

# The prologue (q load, first K/V wait) and epilogue (normalise, store) of an
# item, in units of one key tile's work: a rough figure; only the order matters.
ITEM_OVERHEAD_TILES = 2


def item_costs(mask: MaskSpec, *, q_len: int, kv_len: int, num_heads: int,
               batch: int, cta_rows: int, block_kv: int,
               reverse_q_tiles: bool) -> np.ndarray:
  """Static cost of every work item, in grid order (heads fastest)."""
  num_q_ctas = -(-q_len // cta_rows)
  shift = mask.shift(q_len, kv_len)
  per_tile = []
  for q_idx in range(num_q_ctas):
    q_cta = num_q_ctas - 1 - q_idx if reverse_q_tiles else q_idx
    q_lo = q_cta * cta_rows
    q_hi = min(q_lo + cta_rows, q_len)
    k_lo, k_hi = mask.key_range(q_lo, q_hi, shift, kv_len)
    tiles = 0 if k_hi <= k_lo else -(-k_hi // block_kv) - k_lo // block_kv
    per_tile.append(tiles + ITEM_OVERHEAD_TILES)
  # Item i: head i % N, query tile (i // N) % num_q_ctas, batch i // (N * num_q_ctas).
  return np.tile(np.repeat(np.asarray(per_tile, np.int64), num_heads), batch)


def lpt_schedule(costs: np.ndarray, num_ctas: int) -> np.ndarray:
  """int32 (num_ctas, 2 + max items per CTA): column 0 the CTA's item count,
  then its items in the order it runs them (longest first), zero-padded
  (one spare column, so reading one item past the end stays in bounds).

  Requires 1 <= num_ctas <= len(costs), so every CTA gets at least one item.
  """
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
  order = sorted(range(num_items), key=lambda i: (-int(costs[i]), i))
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
