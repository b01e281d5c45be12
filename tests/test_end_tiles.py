"""end_tiles.build: the first and last tile of each batch row's kept rows,
everything outside them 0 (E07's rows selected away without a whole-array select)."""

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np

from flash3.kernels import end_tiles


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
    T=st.integers(1, 300), block=st.sampled_from([8, 64, 128]),
    bounds=st.lists(st.tuples(st.integers(0, 320), st.integers(0, 320)),
                    min_size=1, max_size=3))
def test_end_tiles_hold_the_kept_rows_of_the_first_and_last_tile(T, block, bounds):
  B = len(bounds)
  x = np.arange(B * T * 2 * 8, dtype=np.float32).reshape(B, T, 2, 8) + 1.0
  x[:, ::3] = np.nan  # Rows outside [lo, hi) may be NaN: they must come out 0.
  lo = jnp.array([min(a, T) for a, _ in bounds], jnp.int32)
  hi = jnp.array([min(b, T) for _, b in bounds], jnp.int32)
  edges, index = end_tiles.build(jnp.asarray(x), lo, hi, block)
  edges, index = np.asarray(edges), np.asarray(index)
  assert edges.shape == (B, 2 * block, 2, 8) and index.shape == (B, 2)
  for b in range(B):
    l, h = int(lo[b]), int(hi[b])
    if h <= l:
      assert list(index[b]) == [-1, -1]
      continue
    assert list(index[b]) == [l // block, (h - 1) // block]
    for e, tile in enumerate(index[b]):
      for r in range(block):
        row = tile * block + r
        got = edges[b, e * block + r]
        if l <= row < h:
          np.testing.assert_array_equal(got, x[b, row])
        else:
          assert np.all(got == 0), (b, e, row)
