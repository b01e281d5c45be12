"""``ForwardConfig.fma_exponent``: exp2's argument as s * c - round(m * c),
one FMA per score, with each row's rounding error carried
(kernels/exponent.py).

The exact product error (interpret mode's two-product) is checked against
float64; the kernel in interpret mode (race detection on) against the float32
reference and against the option off, over masks and options; rows whose
reference crosses the size where the exact form takes over, against float64
NumPy; the lowering for the GPU on the CPU; and on an H100/H200 the same
cases, where warps of normal rows take the one-FMA form. E03 runs with this
option in tests/test_forward_kernel.py (EDGE_CONFIGS, test_gpu_e03_...).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flash3.kernels import exponent
from flash3.kernels.config import ForwardConfig
from flash3.kernels.forward import attention_forward, default_config

from test_forward_kernel import (CAUSAL_BR, CAUSAL_TL, NO_MASK, _expand_opts, _forward_on,
                                 assert_interpret_knob_close, assert_matches_opts,
                                 make_qkv)
from flash3.visibility import MaskSpec as W
import numpy_reference

LOG2_E = 1.4426950408889634
FIELDS = dict(scale_first=False, fma_exponent=True)


def test_config_needs_raw_scores():
  with pytest.raises(ValueError, match="fma_exponent=True needs scale_first=False"):
    ForwardConfig(scale_first=True, fma_exponent=True)
  with pytest.raises(ValueError, match="fma_exponent"):
    ForwardConfig(fma_exponent=1)


@pytest.mark.parametrize("c", [0.125 * LOG2_E, 128 ** -0.5 * LOG2_E, LOG2_E, 3.7])
def test_product_error_is_exact(c):
  rng = np.random.default_rng(1)
  m = (rng.normal(size=4000) * 10.0 ** rng.integers(-4, 9, 4000)).astype(np.float32)
  ref = m * np.float32(c)
  err = np.asarray(jax.jit(lambda m, r: exponent._product_error(m, c, r))(m, ref))
  want = m.astype(np.float64) * np.float64(np.float32(c)) - ref.astype(np.float64)
  np.testing.assert_array_equal(err.astype(np.float64), want)
  # The error of round(m * c) is at most half its ulp: 1/8 below 2**22.
  small = np.abs(ref) < exponent.FMA_REFERENCE_LIMIT
  assert np.abs(err[small]).max() <= 0.125


def test_exact_form_is_zero_error_on_large_and_infinite_rows():
  c = LOG2_E
  # 2907269.25 * c is 4194302.88: below the limit, rounded 0.1235 away.
  m = jnp.array([2907269.25, 3e7, -jnp.inf, jnp.inf, jnp.nan, 0.0], jnp.float32)
  ref = m * np.float32(c)
  err = np.asarray(exponent._err_where_normal(m, c, ref))
  np.testing.assert_array_equal(err[1:], 0.0)
  want = np.float64(np.float32(2907269.25)) * np.float64(np.float32(c)) - np.float64(ref[0])
  assert abs(want) > 0.12 and err[0] == want


def test_product_error_of_a_huge_factor_is_finite():
  # Veltkamp's split (x * 4097) overflowed for |x| above 8.3e34.
  c = 1e35
  m = jnp.array([1e-30, -3e-31], jnp.float32)
  ref = m * np.float32(c)
  err = np.asarray(exponent._err_where_normal(m, c, ref))
  want = np.asarray(m, np.float64) * np.float64(np.float32(c)) - np.asarray(ref, np.float64)
  np.testing.assert_array_equal(err, want)


INTERPRET_CASES = [
    # id, B, Tq, Tk, N, K, D, dtype, mask, block_kv, fields, options
    ("no-mask-ragged", 2, 130, 300, 2, 2, 64, jnp.float16, NO_MASK, 64, {}, {}),
    ("causal-br-every-tile", 1, 200, 260, 2, 1, 64, jnp.bfloat16, CAUSAL_BR, 64,
     dict(lazy_rescale=False), {}),
    ("causal-tl-half-128", 1, 300, 300, 2, 1, 128, jnp.bfloat16, CAUSAL_TL, 128,
     dict(half_edge_tiles=True, reverse_q_tiles=True), {}),
    ("window-lengths-sinks", 2, 190, 250, 4, 2, 64, jnp.bfloat16,
     W(window_left=70, window_right=20), 64, {},
     dict(q_lengths=[190, 33], kv_lengths=[250, 0], sinks=[0.5, -2.0, 30.0, -jnp.inf])),
    ("causal-segments", 1, 256, 256, 2, 1, 64, jnp.float16, CAUSAL_BR, 64,
     dict(persistent=True, num_sms=2), dict(segments=([[100, 156]], [[100, 156]]))),
]


@pytest.mark.interpret
@pytest.mark.parametrize("case", INTERPRET_CASES, ids=[c[0] for c in INTERPRET_CASES])
def test_interpret_matches_reference_and_the_plain_form(case):
  _, B, Tq, Tk, N, K, D, dtype, mask, block_kv, fields, opts = case
  opts = _expand_opts(opts, Tq, Tk)
  q, k, v = make_qkv(jax.random.key(Tq + 3 * Tk), B, Tq, Tk, N, K, D, dtype, scale=2.0)
  config = ForwardConfig(block_kv=block_kv, num_stages=2, **FIELDS, **fields)
  assert_interpret_knob_close(q, k, v, scale=D ** -0.5, mask=mask, config=config,
                              field="fma_exponent", **opts)


# Raw scores (scale 1) per pattern and key tile. The limit in raw units is
# 2**22 / log2(e) = 2907270.3; 2907264 is a float32 just below it, 2916352 and
# 2981888 are above it. Lazy rescaling moves a reference past 8 / log2(e) =
# 5.55 only.
CROSSING_TILES = [
    [1.0, 2.0, 0.5],                                   # 0: normal throughout
    [2981888.0 - 2, 2981888.0 - 1, 2981888.0 - 0.5],   # 1: large, close moves
    # 2: normal -> large with a move of 1 (alpha 0.37) in the every-tile
    # rescale; round(m * c) is 0.12 off m * c at 2907269.25 and exact at
    # 2907270.25. (Lazy: no move at tile 2.)
    [2907264.0 - 20, 2907264.0 + 5.25, 2907264.0 + 6.25],
    # 3: normal, references 0.11-0.12 off: moves of 6.75 and 0.5.
    [2907264.0 - 1.5, 2907264.0 + 5.25, 2907264.0 + 5.75],
    [-2916352.0, 5.0, 4.0],                            # 4: large -> normal
    [2981888.0 + 40, -1.0, 2981888.0 + 41],            # 5: large, then a dip
    # 6: large -> normal (a move of 5.75, both modes), then 0.5 (kept lazily).
    [-2907275.0, -2907269.25, -2907268.75],
    # 7: lazily no move (5), then 5.75 across the limit, upwards.
    [2907264.5, 2907269.5, 2907270.25],
    # 8: normal; lazily no move (5), then a move of 5.75.
    [2907262.0, 2907267.0, 2907267.75],
]
# Query rows (16 per warp on the GPU). Warp 0 holds every pattern, pattern 1
# keeps it in the exact form. Warp 1 holds pattern 6 among normal rows: the
# exact form in tiles 0 and 1, the one-FMA form in tile 2. Warp 2 holds
# pattern 7: the one-FMA form in tiles 0 and 1, the exact one in tile 2 (lazy
# and every-tile alike). So P of one row comes from both forms, which must
# refer to the same reference. v is about 1 on tile 1's keys and -1 on tile
# 2's: o measures their weights (a mistake of 2**0.12 in alpha or P moves o by
# a few hundredths).
CROSSING_ROWS = (list(range(9)) + [0] * 7 + [6, 8, 0, 3] * 4 + [7, 8, 0, 3] * 4)


def _bf16(x):
  return float(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


def _crossing_inputs():
  """bfloat16 q, k, v, scale 1: query row r's score against the keys of
  tile t is CROSSING_TILES[p][t] (p = CROSSING_ROWS[r]) minus a small step
  per key (0 to 1.75, 0 on some key of every tile), each exactly a float32:
  k holds it in three bfloat16 columns per pattern (hi + mid + lo), which q
  sums with ones."""
  block_kv, D = 64, 64
  n_tiles = len(CROSSING_TILES[0])
  Tk = n_tiles * block_kv
  rng = np.random.default_rng(5)
  steps = rng.integers(0, 8, Tk) * 0.25
  k = np.zeros((1, Tk, 1, D))
  for p, row in enumerate(CROSSING_TILES):
    for t, score in enumerate(row):
      hi = _bf16(score)
      mid = _bf16(score - hi)
      lo = score - hi - mid
      keys = slice(t * block_kv, (t + 1) * block_kv)
      assert _bf16(lo) == lo and abs(lo) + 2 < 64 and lo * 4 == int(lo * 4)
      k[0, keys, 0, 3 * p] = hi
      k[0, keys, 0, 3 * p + 1] = mid
      k[0, keys, 0, 3 * p + 2] = lo - steps[keys]
  q = np.zeros((1, len(CROSSING_ROWS), 1, D))
  for r, p in enumerate(CROSSING_ROWS):
    q[0, r, 0, 3 * p:3 * p + 3] = 1.0
  v = np.repeat([0.5, 1.0, -1.0], block_kv)[None, :, None, None] + 0.05 * rng.normal(
      size=(1, Tk, 1, D))
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  return q, k, v, block_kv


def test_crossing_inputs_are_what_they_say():
  q, k, _, block_kv = _crossing_inputs()
  s = np.einsum("bqhd,bkhd->bhqk", *(np.asarray(x.astype(jnp.float32), np.float64)
                                     for x in (q, k)))[0, 0]
  # Exactly float32 values (the kernel's scores are exact too).
  np.testing.assert_array_equal(s, s.astype(np.float32))
  tile_max = s.reshape(s.shape[0], -1, block_kv).max(-1)
  np.testing.assert_array_equal(tile_max[:len(CROSSING_TILES)], CROSSING_TILES)
  # Whether each tile's running max (the every-tile reference) is large.
  large = np.abs(np.maximum.accumulate(tile_max, axis=1) * np.float32(LOG2_E)
                 ) >= exponent.FMA_REFERENCE_LIMIT
  assert [list(r) for r in large[:9]] == [
      [False] * 3, [True] * 3, [False, False, True], [False] * 3,
      [True, False, False], [True] * 3, [True, False, False],
      [False, False, True], [False] * 3]
  assert tile_max.shape[0] == 48 and len(CROSSING_ROWS) == 48


def _check_crossing(lazy, interpret):
  q, k, v, block_kv = _crossing_inputs()
  config = ForwardConfig(block_kv=block_kv, num_stages=2, lazy_rescale=lazy, **FIELDS)
  o, lse = _forward_on(interpret, q, k, v, scale=1.0, mask=NO_MASK, config=config)
  as64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)
  want_o, want_lse = numpy_reference.attention(as64(q), as64(k), as64(v), scale=1.0)
  want_lse = want_lse.transpose(0, 2, 1)  # (B, N, Tq) like the kernel's
  np.testing.assert_allclose(np.asarray(o, np.float32), want_o, atol=1e-2, rtol=0)
  # lse (up to 2.98e6 here) cannot show err: a float32 ulp there is 0.25.
  np.testing.assert_allclose(np.asarray(lse, np.float64), want_lse, rtol=0, atol=0.5)


@pytest.mark.interpret
@pytest.mark.parametrize("lazy", [False, True], ids=["every_tile", "lazy"])
def test_interpret_references_crossing_the_limit(lazy):
  _check_crossing(lazy, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("lazy", [False, True], ids=["every_tile", "lazy"])
def test_gpu_references_crossing_the_limit(lazy):
  """Rows of both kinds in one warp (that warp takes the exact form) and a
  warp of normal rows (the one-FMA form)."""
  _check_crossing(lazy, interpret=False)


@pytest.mark.parametrize("D, mask", [(64, NO_MASK), (128, CAUSAL_BR), (256, NO_MASK),
                                     (128, W(causal=True, window_left=300))])
def test_lowers_for_the_gpu(D, mask):
  q, k, v = make_qkv(jax.random.key(0), 1, 512, 1024, 4, 2, D, jnp.bfloat16)
  config = dataclasses.replace(default_config(D, q.dtype, mask, 512, 1024), **FIELDS)
  f = lambda q, k, v: attention_forward(q, k, v, scale=0.1, mask=mask, config=config)
  text = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


GPU_CASES = [
    # B, Tq, Tk, N, K, D, dtype, mask, options
    (2, 4096, 4096, 16, 16, 128, jnp.bfloat16, NO_MASK, {}),
    (2, 1000, 1111, 8, 2, 64, jnp.float16, CAUSAL_BR, {}),
    (1, 2048, 2048, 4, 1, 256, jnp.bfloat16, CAUSAL_TL, {}),
    (2, 777, 1025, 4, 1, 128, jnp.bfloat16, W(causal=True, window_left=300),
     dict(kv_lengths=[1025, 500], sinks=[0.5, -2.0, 30.0, -jnp.inf])),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"D{c[5]}-T{c[1]}x{c[2]}")
def test_gpu_fma_exponent_matches_reference(case):
  B, Tq, Tk, N, K, D, dtype, mask, opts = case
  opts = _expand_opts(opts, Tq, Tk)
  q, k, v = make_qkv(jax.random.key(Tq + Tk + D), B, Tq, Tk, N, K, D, dtype, scale=2.0)
  config = dataclasses.replace(default_config(D, dtype, mask, Tq, Tk), **FIELDS)
  o, lse = attention_forward(q, k, v, scale=D ** -0.5, mask=mask, config=config, **opts)
  assert_matches_opts(o, lse, q, k, v, scale=D ** -0.5, mask=mask, **opts)
