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


def test_causal_items_are_balanced_and_longest_first():
  # FA3 grid, D=128, T=1024: B=16, N=16, 8 query tiles of 128 rows.
  costs = schedule.item_costs(CAUSAL, q_len=1024, kv_len=1024, num_heads=16,
                              batch=16, cta_rows=128, block_kv=128,
                              reverse_q_tiles=True)
  assert len(costs) == 16 * 8 * 16
  # Longest query tile first (reversed), heads fastest: tiles see 8..1 key tiles.
  assert list(costs[:17]) == [8 + 2] * 16 + [7 + 2]
  table = schedule.lpt_schedule(costs, 132)
  loads = _loads(table, costs)
  round_robin = [int(costs[c::132].sum()) for c in range(132)]
  assert max(loads) / min(loads) < 1.1 < max(round_robin) / min(round_robin)
  for items in _items(table):  # Each CTA runs its longest items first.
    assert list(costs[items]) == sorted(costs[items], reverse=True)


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


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_ctas", [1, 7, 100, 128])
def test_segment_schedule_runs_every_item_once_balanced_longest_first(causal, num_ctas):
  # Two rows of packed documents of unequal lengths, 4 heads, T=2048.
  T, N = 2048, 4
  rows = [[100, 900, 48, 1000], [2048]]
  ranges = np.stack([_doc_ranges(r, T=T) for r in rows])
  mask = MaskSpec(causal=causal)
  mask_ranges = schedule.cta_tile_ranges(mask, q_len=T, kv_len=T, cta_rows=128,
                                         block_kv=128)
  table = np.asarray(schedule.segment_schedule(
      ranges, mask_ranges, num_heads=N, reverse_q_tiles=causal, num_ctas=num_ctas))
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
  for items in _items(table):  # Each CTA runs its longest items first.
    assert list(costs[items]) == sorted(costs[items], reverse=True)
  # Within one item's cost of a perfect split (the snake deal's bound).
  loads = _loads(table, costs)
  assert max(loads) - min(loads) <= costs.max()
  # The documents matter: the first row's items cost less than whole causal rows.
  assert costs[:16 * N].sum() < costs[16 * N:].sum()


def test_segment_schedule_bad_num_ctas():
  ranges = np.zeros((1, 2, 4), np.int32)
  mask_ranges = np.zeros((1, 2), np.int64)
  with pytest.raises(ValueError, match="num_ctas"):
    schedule.segment_schedule(ranges, mask_ranges, num_heads=1,
                              reverse_q_tiles=False, num_ctas=2)
