"""The per-row bounds that ``kernels/tile_mask`` masks score tiles with: a
one-row ``key_range`` holds exactly the keys that query sees by
``dense_mask``, the reference's pairwise rule, lengths included.

The kernels' use of them runs in the interpret-mode kernel tests; this checks
the rule itself over many masks, shifts and lengths."""

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np

from flash3.visibility import MaskSpec, dense_mask

windows = st.one_of(st.none(), st.integers(0, 40))


@hypothesis.settings(max_examples=80, deadline=None)
@hypothesis.given(
    causal=st.booleans(), alignment=st.sampled_from(["top_left", "bottom_right"]),
    left=windows, right=windows, Tq=st.integers(1, 70), Tk=st.integers(1, 70),
    q_cut=st.integers(0, 70), kv_cut=st.integers(0, 70))
def test_one_row_ranges_are_the_dense_mask(causal, alignment, left, right, Tq, Tk,
                                           q_cut, kv_cut):
  mask = MaskSpec(causal=causal, alignment=alignment, window_left=left,
                  window_right=right)
  q_len, kv_len = min(q_cut, Tq), min(kv_cut, Tk)
  keep = np.asarray(dense_mask(
      mask, Tq, Tk, query_seq_lengths=jnp.array([q_len], jnp.int32),
      key_value_seq_lengths=jnp.array([kv_len], jnp.int32))[0, 0])
  shift = mask.shift(q_len, kv_len)

  # Rows past q_len see none (the dq kernel's rule; the forward replaces them).
  q = np.arange(Tq, dtype=np.int32)
  lo, hi = mask.key_range(q, q + 1, shift, kv_len)
  hi = np.where(q < q_len, hi, 0)
  cols = np.arange(Tk)[None, :]
  got = (cols >= np.asarray(lo).reshape(-1, 1)) & (cols < np.asarray(hi).reshape(-1, 1))
  np.testing.assert_array_equal(got, keep)



@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(
    causal=st.booleans(), alignment=st.sampled_from(["top_left", "bottom_right"]),
    left=windows, right=windows, Tq=st.integers(1, 70), Tk=st.integers(1, 70),
    q_lo=st.integers(0, 69), rows=st.integers(1, 16), t=st.integers(0, 17),
    block=st.sampled_from([4, 8, 16]),
    edge_half=st.sampled_from([("lower", None), ("lower", 1), ("upper", None),
                               ("upper", 0)]))
def test_edge_tiles_name_exactly_the_tiles_the_other_bound_cuts(
    causal, alignment, left, right, Tq, Tk, q_lo, rows, t, block, edge_half):
  """``tile_mask.edge_tiles``, as the kernels' loops use it (``edge_loops``):
  a tile (or the half of one a warpgroup computes at that edge) on the rows'
  lower edge is cut by some row's upper bound just when ``t >= hi_cuts_from``,
  one on the upper edge by some row's lower bound just when ``t <
  lo_cut_below``. Where it is not, comparing only the edge's bound keeps
  exactly what comparing both keeps, for every row of the warpgroup's range
  (rows past Tq are dropped by the kernels)."""
  from flash3.kernels import tile_mask
  edge, half = edge_half
  mask = MaskSpec(causal=causal, alignment=alignment, window_left=left,
                  window_right=right)
  hypothesis.assume(q_lo < Tq)
  q_hi = min(q_lo + rows, Tq)
  shift = mask.shift(Tq, Tk)
  hi_cuts_from, lo_cut_below = (int(x) for x in tile_mask.edge_tiles(
      mask.full_key_range(q_lo, q_hi, shift, Tk), block))
  cuts = t >= hi_cuts_from if edge == "lower" else t < lo_cut_below
  col_lo = t * block + (0 if half is None else half * (block // 2))
  width = block if half is None else block // 2
  q = np.arange(q_lo, q_hi, dtype=np.int32)
  lo, hi = (np.broadcast_to(np.asarray(b), q.shape).reshape(-1, 1)
            for b in mask.key_range(q, q + 1, shift, Tk))
  cols = np.arange(col_lo, col_lo + width)[None, :]
  both = (cols >= lo) & (cols < hi)
  one = (cols >= lo) if edge == "lower" else (cols < hi)
  if not cuts:
    np.testing.assert_array_equal(one, both)
  # And it is exact: it flags a tile just when the other bound cuts it.
  other_keeps_all = (cols < hi).all() if edge == "lower" else (cols >= lo).all()
  assert cuts == (not other_keeps_all)
