"""The persistent forward's work schedule (flash3.kernels.schedule)."""

import numpy as np
import pytest

from flash3.kernels import schedule
from flash3.visibility import MaskSpec

CAUSAL = MaskSpec(causal=True, alignment="bottom_right")


def _items(table):
  return [list(row[1:1 + row[0]]) for row in table]


def _loads(table, costs):
  return [sum(int(costs[i]) for i in items) for items in _items(table)]


def _in_flight_chunks(table, costs, chunk_len):
  """Each CTA runs its items back to back, each taking its cost: the most
  chunks of the grid's order (``chunk_len`` items each) that items running
  at one time span (max chunk - min chunk + 1, over every item start)."""
  spans = []  # (start, end, chunk)
  for items in _items(table):
    t = 0
    for i in items:
      spans.append((t, t + int(costs[i]), i // chunk_len))
      t += int(costs[i])
  worst = 0
  for start, _, _ in spans:
    live = [c for a, b, c in spans if a <= start < b]
    worst = max(worst, max(live) - min(live) + 1)
  return worst


def _chunk_order_then_longest_first(items, costs, chunk_len):
  keys = [(i // chunk_len, -int(costs[i])) for i in items]
  return keys == sorted(keys)


@pytest.mark.parametrize("num_items, num_ctas", [(1, 1), (5, 5), (7, 3), (9, 2), (2048, 132)])
def test_every_item_runs_exactly_once(num_items, num_ctas):
  costs = np.random.default_rng(num_items).integers(1, 20, num_items)
  table = schedule.lpt_schedule(costs, num_ctas)
  assert table.dtype == np.int32 and table.shape[0] == num_ctas
  assert all(len(items) >= 1 for items in _items(table))
  assert sorted(i for items in _items(table) for i in items) == list(range(num_items))
  # A spare zero column: reading one item past a CTA's last stays in bounds.
  assert table.shape[1] == 2 + max(table[:, 0]) and (table[:, -1] == 0).all()


def test_equal_costs_are_round_robin_in_grid_order():
  table = schedule.lpt_schedule(np.full(10, 3), 4)
  assert _items(table) == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]


@pytest.mark.parametrize("rounds", [0, 1, 2])
def test_causal_items_are_balanced_and_longest_first(rounds):
  # FA3 grid, D=128, T=1024: B=16, N=16, 8 query tiles of 128 rows.
  costs = schedule.item_costs(CAUSAL, q_len=1024, kv_len=1024, num_heads=16,
                              batch=16, cta_rows=128, block_kv=128,
                              reverse_q_tiles=True)
  assert len(costs) == 16 * 8 * 16
  # Longest query tile first (reversed), heads fastest: tiles see 8..1 key tiles.
  assert list(costs[:17]) == [8 + 2] * 16 + [7 + 2]
  table = schedule.lpt_schedule(costs, 132, rounds)
  loads = _loads(table, costs)
  round_robin = [int(costs[c::132].sum()) for c in range(132)]
  assert max(loads) / min(loads) < 1.1 < max(round_robin) / min(round_robin)
  chunk_len = rounds * 132 if rounds else len(costs)
  for items in _items(table):  # Chunk by chunk, longest first within one.
    assert _chunk_order_then_longest_first(items, costs, chunk_len)
  if rounds:
    # Locality: what runs at one time lies within a few chunks of the grid's
    # order (one sort over all items mixes every batch row at once).
    assert _in_flight_chunks(table, costs, chunk_len) <= 3
    assert _in_flight_chunks(schedule.lpt_schedule(costs, 132, 0), costs,
                             chunk_len) > 6


def test_bad_rounds():
  with pytest.raises(ValueError, match="rounds"):
    schedule.lpt_schedule(np.ones(3), 2, -1)


def test_window_costs_count_the_visited_key_tiles():
  window = MaskSpec(window_left=100, window_right=0)
  costs = schedule.item_costs(window, q_len=512, kv_len=512, num_heads=1, batch=1,
                              cta_rows=128, block_kv=128, reverse_q_tiles=False)
  # Query tile 0 sees keys 0..127; later tiles keys [q_lo - 100, q_hi): 2 tiles.
  assert list(costs) == [1 + 2, 2 + 2, 2 + 2, 2 + 2]


def test_bad_num_ctas():
  with pytest.raises(ValueError, match="num_ctas"):
    schedule.lpt_schedule(np.ones(3), 4)


def _doc_ranges(doc_lens, *, T, block_q=64, block_kv=128):
  """Per 64-row query tile, the key tiles its documents touch (numpy, by hand)."""
  ids = np.repeat(np.arange(len(doc_lens)), doc_lens)
  assert len(ids) == T
  out = []
  for t in range(-(-T // block_q)):
    docs = set(ids[t * block_q:(t + 1) * block_q])
    keys = np.flatnonzero(np.isin(ids, list(docs)))
    out.append([keys[0] // block_kv, keys[-1] // block_kv + 1, 0, 0])
  return np.asarray(out, np.int32)


@pytest.mark.parametrize("rounds", [0, 2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_ctas", [1, 7, 100, 128])
def test_segment_schedule_runs_every_item_once_balanced_longest_first(
    causal, num_ctas, rounds):
  # Two rows of packed documents of unequal lengths, 4 heads, T=2048.
  T, N = 2048, 4
  rows = [[100, 900, 48, 1000], [2048]]
  ranges = np.stack([_doc_ranges(r, T=T) for r in rows])
  mask = MaskSpec(causal=causal)
  mask_ranges = schedule.cta_tile_ranges(mask, q_len=T, kv_len=T, cta_rows=128,
                                         block_kv=128)
  table = np.asarray(schedule.segment_schedule(
      ranges, mask_ranges, num_heads=N, reverse_q_tiles=causal, num_ctas=num_ctas,
      rounds=rounds))
  # The cost of each item in grid order (heads fastest), computed here by hand.
  costs = []
  for b in range(2):
    for q_idx in range(16):
      c = 15 - q_idx if causal else q_idx
      lo = max(min(ranges[b, 2 * c, 0], ranges[b, 2 * c + 1, 0]), mask_ranges[c, 0])
      hi = min(max(ranges[b, 2 * c, 1], ranges[b, 2 * c + 1, 1]), mask_ranges[c, 1])
      costs += [max(hi - lo, 0) + schedule.ITEM_OVERHEAD_TILES] * N
  costs = np.asarray(costs)
  assert table.dtype == np.int32 and table.shape[0] == num_ctas
  assert sorted(i for items in _items(table) for i in items) == list(range(len(costs)))
  assert all(len(items) >= 1 for items in _items(table))
  assert table.shape[1] == 2 + max(table[:, 0]) and (table[:, -1] == 0).all()
  chunk_len = rounds * num_ctas if rounds else len(costs)
  for items in _items(table):  # Chunk by chunk, longest first within one.
    assert _chunk_order_then_longest_first(items, costs, chunk_len)
  # The snake deal's bound: within one item's cost of a perfect split in one
  # chunk; over several, within two (each chunk's snake pairs a CTA's longer
  # item with a shorter one, so the chunks' imbalances do not pile up).
  loads = _loads(table, costs)
  chunks = -(-len(costs) // chunk_len)
  assert max(loads) - min(loads) <= costs.max() * (1 if chunks == 1 else 2)
  # The documents matter: the first row's items cost less than whole causal rows.
  assert costs[:16 * N].sum() < costs[16 * N:].sum()


def test_segment_schedule_bad_num_ctas():
  ranges = np.zeros((1, 2, 4), np.int32)
  mask_ranges = np.zeros((1, 2), np.int64)
  with pytest.raises(ValueError, match="num_ctas"):
    schedule.segment_schedule(ranges, mask_ranges, num_heads=1,
                              reverse_q_tiles=False, num_ctas=2)


def test_segment_schedule_keeps_documents_together():
  # Issue 6's packed rows: 8 causal documents of 2048 at T=16384, 16 heads,
  # 132 CTAs. One sort over all items runs every head of every document at
  # once (their K/V together far exceed L2); chunks of the grid's order keep
  # what runs at one time to a few documents, at a makespan as good.
  T, N, C = 16384, 16, 132
  ranges = _doc_ranges([2048] * 8, T=T)[None]
  mask_ranges = schedule.cta_tile_ranges(CAUSAL, q_len=T, kv_len=T, cta_rows=128,
                                         block_kv=128)
  nq = mask_ranges.shape[0]
  costs = []
  for q_idx in range(nq):  # Grid order, query tiles reversed, heads fastest.
    c = nq - 1 - q_idx
    lo = max(min(ranges[0, 2 * c, 0], ranges[0, 2 * c + 1, 0]), mask_ranges[c, 0])
    hi = min(max(ranges[0, 2 * c, 1], ranges[0, 2 * c + 1, 1]), mask_ranges[c, 1])
    costs += [hi - lo + schedule.ITEM_OVERHEAD_TILES] * N
  costs = np.asarray(costs)

  def run(rounds):
    table = np.asarray(schedule.segment_schedule(
        ranges, mask_ranges, num_heads=N, reverse_q_tiles=True, num_ctas=C,
        rounds=rounds))
    spans = []  # (start, end, (head, document))
    for items in _items(table):
      t = 0
      for i in items:
        q_cta = nq - 1 - (i // N)
        spans.append((t, t + costs[i], (i % N, q_cta * 128 // 2048)))
        t += costs[i]
    live = [len({key for a, b, key in spans if a <= s < b})
            for s, _, _ in spans]
    return max(_loads(table, costs)) / (costs.sum() / C), np.mean(live)

  global_makespan, global_live = run(0)
  makespan, live = run(schedule.LOCALITY_ROUNDS)
  assert global_live > 100 and live < 40  # (head, document) pairs in use
  assert makespan < 1.05 and makespan <= global_makespan + 0.02
