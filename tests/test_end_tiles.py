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


def _full_selects(jaxpr, T):
  """Shapes of the rank-4 selects outside kernels whose sequence axis is >= T."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      continue
    if eqn.primitive.name == "select_n":
      found += [o.aval.shape for o in eqn.outvars
                if len(o.aval.shape) == 4 and o.aval.shape[1] >= T]
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", None)
      if inner is not None:
        found += _full_selects(getattr(inner, "jaxpr", inner), T)
  return found


def test_lengths_add_no_whole_array_select():
  """With lengths the wrappers select only the end tiles, never a whole q, k,
  v or do (that select took 13% of the forward and 8% of the backward on an
  H200, docs/benchmarks/h200/2026-12-03-s20/). Traced, not run."""
  import jax
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from flash3.kernels.backward import attention_backward
  from flash3.kernels.forward import attention_forward
  from flash3.visibility import MaskSpec
  B, Tq, Tk = 2, 300, 333
  q = jnp.zeros((B, Tq, 2, 64), jnp.bfloat16)
  k = jnp.zeros((B, Tk, 1, 64), jnp.bfloat16)
  lse = jnp.zeros((B, 2, Tq), jnp.float32)
  lens = dict(q_lengths=jnp.array([100, 300], jnp.int32),
              kv_lengths=jnp.array([290, 201], jnp.int32))
  mask = MaskSpec(causal=True, alignment="bottom_right", window_left=30)
  ip = plgpu.InterpretGPUParams()
  fwd = jax.make_jaxpr(lambda q, k, v: attention_forward(
      q, k, v, scale=0.1, mask=mask, interpret=ip, **lens))(q, k, k)
  bwd = jax.make_jaxpr(lambda q, k, v, o, lse, do: attention_backward(
      q, k, v, o, lse, do, scale=0.1, mask=mask, interpret=ip, **lens))(q, k, k, q, lse, q)
  assert _full_selects(fwd.jaxpr, min(Tq, Tk)) == []
  assert _full_selects(bwd.jaxpr, min(Tq, Tk)) == []
