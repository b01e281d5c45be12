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
