"""exp2 on the FMA pipes (kernels/exp2.py) and ForwardConfig.exp2_fma_cols.

The polynomial against float64 exp2; the split's columns; the forward with
part of each tile's exponentials on the polynomial, in interpret mode against
the reference on the edge cases the exponent handling could break (E01 very
negative logits, E02 fully masked first tile, E03 equal extreme inputs, E06
rows that see nothing; E03 and E07 are parametrized in
tests/test_forward_kernel.py), in the CUDA lowering, and on the GPU.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from flash3.kernels.config import ForwardConfig
from flash3.kernels.exp2 import exp2_fma, split_exp2
from flash3.kernels.forward import attention_forward
from flash3.visibility import MaskSpec

from test_forward_kernel import assert_matches, make_qkv, run_interpret

NO_MASK = MaskSpec()
CAUSAL_TL = MaskSpec(causal=True, alignment="top_left")
CAUSAL_BR = MaskSpec(causal=True, alignment="bottom_right")
FMA = ForwardConfig(block_kv=64, num_stages=2, exp2_fma_cols=32)


def _rel_err(x):
  # Jitted: XLA folds (x + R) - R unless the code prevents it.
  got = np.asarray(jax.jit(exp2_fma)(jnp.asarray(x, jnp.float32)), np.float64)
  return np.abs(got / np.exp2(np.asarray(x, np.float64)) - 1), got


def test_exp2_fma_accuracy_on_a_dense_grid():
  x = -np.linspace(0, 125, 1_000_001, dtype=np.float32)
  rel, _ = _rel_err(x)
  assert rel.max() < 1.1e-4


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=-126.0, max_value=0.0, width=32))
def test_exp2_fma_accuracy_anywhere(x):
  rel, got = _rel_err(np.array([x], np.float32))
  assert np.isfinite(got).all()
  assert rel[0] < 2e-4  # near -126 the smallest normals lose a few bits


def test_exp2_fma_exact_values():
  x = jnp.array([0.0, -0.0, -1.0, -10.0, -126.0, -126.5, -127.0, -1e30,
                 -jnp.inf], jnp.float32)
  got = np.asarray(jax.jit(exp2_fma)(x))
  assert got[0] == 1.0 and got[1] == 1.0  # a row's maximum: exactly 1, as MUFU
  np.testing.assert_allclose(got[2:5], np.exp2([-1.0, -10.0, -126.0]), rtol=2e-4)
  np.testing.assert_array_equal(got[5:], 0.0)  # flush to zero, -inf -> 0, no NaN


@pytest.mark.parametrize("cols", [0, 16, 32, 64])
def test_split_exp2_columns(cols):
  x = -jnp.abs(jax.random.normal(jax.random.key(0), (64, 64), jnp.float32)) * 20
  got = np.asarray(split_exp2(x, cols))
  np.testing.assert_array_equal(got[:, :cols], np.asarray(exp2_fma(x[:, :cols])))
  np.testing.assert_array_equal(got[:, cols:], np.asarray(jnp.exp2(x[:, cols:])))


@pytest.mark.parametrize("bad", [8, 24, -16, 80, True])
def test_config_rejects_bad_exp2_fma_cols(bad):
  with pytest.raises(ValueError, match="exp2_fma_cols"):
    ForwardConfig(block_kv=64, exp2_fma_cols=bad)


@pytest.mark.parametrize("cols", [0, 16, 32, 64])
def test_exp2_fma_cols_lowers_for_cuda(cols):
  """Lowers for the GPU, with the polynomial (its exponent shift) in the
  kernel exactly when asked for, and no optimization barrier (interpret
  mode's guard) on the GPU path."""
  q = jnp.zeros((1, 512, 2, 64), jnp.bfloat16)
  for mask in (NO_MASK, CAUSAL_BR):
    def jaxpr_and_lowered(cols):
      config = ForwardConfig(block_kv=128, exp2_fma_cols=cols)
      f = lambda q, k, v: attention_forward(q, k, v, scale=0.125, mask=mask,
                                            config=config)
      lowered = jax.jit(f).trace(q, q, q).lower(lowering_platforms=("cuda",))
      return str(jax.make_jaxpr(f)(q, q, q)), lowered.as_text()
    jaxpr, text = jaxpr_and_lowered(cols)
    assert "mosaic_gpu" in text
    assert ("shift_left" in jaxpr) == (cols > 0)
    plain, _ = jaxpr_and_lowered(0)
    assert jaxpr.count("optimization_barrier") == plain.count("optimization_barrier")


# ----------------------------------------------------------------------------
# The forward with exp2_fma_cols in interpret mode
# ----------------------------------------------------------------------------

@pytest.mark.interpret
@pytest.mark.parametrize("B,Tq,Tk,N,K,D,dtype,mask", [
    (1, 200, 333, 2, 1, 64, jnp.bfloat16, CAUSAL_BR),
    (2, 130, 77, 2, 2, 64, jnp.float16, NO_MASK),
    (1, 96, 300, 1, 1, 128, jnp.float16, CAUSAL_TL),
    (1, 256, 100, 1, 1, 64, jnp.bfloat16, MaskSpec(window_left=0, window_right=0)),  # E06
])
def test_interpret_exp2_fma_matches_reference(B, Tq, Tk, N, K, D, dtype, mask):
  q, k, v = make_qkv(jax.random.key(Tq + Tk), B, Tq, Tk, N, K, D, dtype, scale=2.0)
  o, lse = run_interpret(q, k, v, scale=D ** -0.5, mask=mask, config=FMA)
  assert_matches(o, lse, q, k, v, scale=D ** -0.5, mask=mask)
  if mask.window_left == 0:
    return  # one key per row: x = 0 only, where both give exactly 1
  # The polynomial ran: lse (float32) differs from the all-MUFU kernel's.
  _, lse0 = run_interpret(q, k, v, scale=D ** -0.5, mask=mask,
                          config=ForwardConfig(block_kv=64, num_stages=2))
  assert not np.array_equal(np.asarray(lse), np.asarray(lse0))


def _very_negative_logits(Tk, D=64, seed=1):
  """E01 with a spread: scaled logits -120 * (1 + u), u uniform in [-0.5, 0.5]
  per key, so within a row s - max spans about [-120, 0] (the polynomial's
  whole range), every lse < -88.7 + log(Tk) + 1."""
  a = float(np.sqrt(120 * 8 / D))
  u = jax.random.uniform(jax.random.key(seed), (1, Tk, 1, 1), minval=-0.5, maxval=0.5)
  q = jnp.full((1, Tk, 1, D), a, jnp.float32).astype(jnp.bfloat16)
  k = jnp.broadcast_to(-a * (1 + u), (1, Tk, 1, D)).astype(jnp.bfloat16)
  v = jax.random.normal(jax.random.key(seed + 1), (1, Tk, 1, D), jnp.bfloat16)
  return q, k, v


@pytest.mark.interpret
def test_interpret_exp2_fma_very_negative_logits_e01():
  q, k, v = _very_negative_logits(192)
  o, lse = run_interpret(q, k, v, scale=0.125, mask=CAUSAL_TL, config=FMA)
  assert_matches(o, lse, q, k, v, scale=0.125, mask=CAUSAL_TL)


@pytest.mark.interpret
def test_interpret_exp2_fma_fully_masked_first_tile_e02():
  Tq, Tk, N, K, D = 88, 448, 14, 2, 64
  q = jnp.zeros((1, Tq, N, D), jnp.float32).at[..., 0].set(1.0)
  k0 = jax.random.uniform(jax.random.key(2), (1, Tk, K), minval=-60, maxval=-20)
  k = 0.1 * jax.random.normal(jax.random.key(3), (1, Tk, K, D)).at[..., 0].set(k0)
  v = jax.random.normal(jax.random.key(4), (1, Tk, K, D))
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  o, lse = run_interpret(q, k, v, scale=1.0, mask=CAUSAL_BR, config=FMA)
  assert_matches(o, lse, q, k, v, scale=1.0, mask=CAUSAL_BR)


# ----------------------------------------------------------------------------
# GPU (H100/H200)
# ----------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("cols", [32, 64])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("mask", [NO_MASK, CAUSAL_BR], ids=["none", "causal"])
def test_gpu_exp2_fma_matches_reference(mask, persistent, cols):
  q, k, v = make_qkv(jax.random.key(cols), 2, 1000, 1100, 4, 2, 64, jnp.bfloat16, scale=2.0)
  config = ForwardConfig(block_kv=128, exp2_fma_cols=cols, persistent=persistent)
  o, lse = attention_forward(q, k, v, scale=0.125, mask=mask, config=config)
  assert_matches(o, lse, q, k, v, scale=0.125, mask=mask)


@pytest.mark.gpu
def test_gpu_exp2_fma_edges_e01_e03_e07():
  config = ForwardConfig(block_kv=128, exp2_fma_cols=32)
  q, k, v = _very_negative_logits(704)
  o, lse = attention_forward(q, k, v, scale=0.125, mask=CAUSAL_TL, config=config)
  assert_matches(o, lse, q, k, v, scale=0.125, mask=CAUSAL_TL)
  x = jnp.full((1, 1, 1, 64), 133120.0, jnp.bfloat16)
  o, _ = attention_forward(x, x, x, scale=0.125, mask=NO_MASK, config=config)
  np.testing.assert_array_equal(np.asarray(o, np.float32), 133120.0)
  # E07 with the whole tile on the polynomial, so the bad keys meet it.
  config = ForwardConfig(block_kv=128, exp2_fma_cols=128)
  q, k, v = make_qkv(jax.random.key(3), 1, 100, 240, 1, 1, 64, jnp.bfloat16)
  idx = jnp.arange(240)
  bad = jnp.array([jnp.nan, jnp.inf, 1e30], jnp.bfloat16)
  k_bad = jnp.where((idx >= 100)[None, :, None, None], bad[idx % 3][None, :, None, None], k)
  o, lse = attention_forward(q, k, v, scale=0.125, mask=CAUSAL_TL, config=config)
  o_bad, lse_bad = attention_forward(q, k_bad, v, scale=0.125, mask=CAUSAL_TL, config=config)
  np.testing.assert_array_equal(np.asarray(o_bad, np.float32), np.asarray(o, np.float32))
  np.testing.assert_array_equal(np.asarray(lse_bad), np.asarray(lse))
  assert_matches(o, lse, q, k, v, scale=0.125, mask=CAUSAL_TL)
