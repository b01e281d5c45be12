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

