"""flash3's XLA reference (implementation="xla") against the float64 NumPy oracle.

Covers every option of issue 2 alone and combined (hypothesis), the T sweep,
GQA ratios 1, 2, 7, 8, fully masked rows, the semantic edge cases E05, E06,
E07, E11, E12, E13, E14, E15 of docs/edge_cases.md, agreement with
jax.nn.dot_product_attention, gradients against finite differences and the
jax transformations (jit, grad, vmap, checkpoint).
"""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flash3
import numpy_reference as ref

# float32 math vs a float64 oracle on O(1) data.
RTOL = ATOL = 2e-5
GRAD_TOL = 2e-4

SETTINGS = dict(deadline=None, derandomize=True, print_blob=True,
                suppress_health_check=[hypothesis.HealthCheck.too_slow])


# ----------------------------------------------------------------- helpers


def rand_qkv(rng, B, Tq, Tk, N, K, D, dtype=np.float32):
  q = rng.standard_normal((B, Tq, N, D)).astype(dtype)
  k = rng.standard_normal((B, Tk, K, D)).astype(dtype)
  v = rng.standard_normal((B, Tk, K, D)).astype(dtype)
  return q, k, v


INT_ARGS = ("query_seq_lengths", "key_value_seq_lengths", "query_segment_ids",
            "key_value_segment_ids")
STATIC_ARGS = ("scale", "is_causal", "causal_alignment", "local_window_size",
               "logits_soft_cap")


def to_jax(kw: dict) -> dict:
  """Integer arrays (lengths, segment ids) become int32 jax arrays."""
  out = {}
  for name, x in kw.items():
    if name in INT_ARGS and x is not None:
      x = jnp.asarray(np.asarray(x), jnp.int32)
    elif name == "sinks" and x is not None:
      x = jnp.asarray(x, jnp.float32)
    elif name == "mask" and x is not None:
      x = jnp.asarray(x)
    out[name] = x
  return out


def _split(kw):
  static = tuple(sorted((n, x) for n, x in kw.items() if n in STATIC_ARGS))
  dynamic = to_jax({n: x for n, x in kw.items() if n not in STATIC_ARGS})
  return static, dynamic


# One jitted function per static configuration, so that tests sharing shapes
# and options share a compilation (eager dispatch compiles every op anew and
# costs seconds per call on the shared CPU).
@functools.lru_cache(maxsize=None)
def _jitted_forward(static):
  def f(q, k, v, bias, dynamic):
    return flash3.dot_product_attention(
        q, k, v, bias, implementation="xla", return_residual=True,
        **dict(static), **dynamic)
  return jax.jit(f)


@functools.lru_cache(maxsize=None)
def _jitted_grads(static):
  def loss(diff, cot, dynamic):
    dyn = dict(dynamic)
    if "sinks" in diff:
      dyn["sinks"] = diff["sinks"]
    out = flash3.dot_product_attention(
        diff["query"], diff["key"], diff["value"], diff.get("bias"),
        implementation="xla", **dict(static), **dyn)
    return jnp.sum(out * cot)
  return jax.jit(jax.grad(loss))


def flash(q, k, v, bias=None, mask=None, **kw):
  """flash3's XLA path (jitted), returning float64 NumPy (out, lse)."""
  static, dynamic = _split(dict(kw, mask=mask))
  out, lse = _jitted_forward(static)(
      jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
      None if bias is None else jnp.asarray(bias), dynamic)
  assert out.dtype == jnp.asarray(q).dtype, out.dtype
  assert lse.dtype == jnp.float32, lse.dtype
  assert out.shape == np.shape(q) and lse.shape == np.shape(q)[:-1]
  return np.asarray(out, np.float64), np.asarray(lse, np.float64)


def assert_matches_oracle(q, k, v, bias=None, mask=None, *, rtol=RTOL,
                          atol=ATOL, **kw):
  got_o, got_lse = flash(q, k, v, bias, mask, **kw)
  want_o, want_lse = ref.attention(q, k, v, bias, mask, **kw)
  assert not np.isnan(got_o).any() and not np.isnan(got_lse).any()
  np.testing.assert_allclose(got_o, want_o, rtol=rtol, atol=atol)
  # -inf (rows that see nothing) must sit in the same places.
  np.testing.assert_array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
  np.testing.assert_allclose(got_lse, want_lse, rtol=rtol, atol=atol)
  return got_o, got_lse, want_o, want_lse


def blind_rows(q, k, **kw):
  """(B, Tq, N) True where the oracle's query row sees no key."""
  B, Tq, N, _ = np.shape(q)
  Tk = np.shape(k)[1]
  vis = ref.visibility(B, N, Tq, Tk, **{
      n: x for n, x in kw.items()
      if n in ("mask", "is_causal", "causal_alignment", "local_window_size",
               "query_seq_lengths", "key_value_seq_lengths",
               "query_segment_ids", "key_value_segment_ids")})
  return ~vis.any(-1).transpose(0, 2, 1)


def flash_grads(q, k, v, bias, sinks, cot, **kw):
  """jax.grad of <cot, out> for query, key, value (and bias, sinks if given)."""
  diff = dict(query=q, key=k, value=v)
  if bias is not None:
    diff["bias"] = bias
  if sinks is not None:
    diff["sinks"] = sinks
  diff = {n: jnp.asarray(x, jnp.float32) for n, x in diff.items()}
  static, dynamic = _split(kw)
  grads = _jitted_grads(static)(diff, jnp.asarray(cot, jnp.float32), dynamic)
  return {n: np.asarray(g, np.float64) for n, g in grads.items()}


def check_grads_fd(q, k, v, bias=None, sinks=None, *, seed=0, **kw):
  """Gradients of flash3 (float32) vs central differences of the float64 oracle.

  The oracle runs in float64 NumPy, so its differences are accurate to ~1e-9
  and the comparison measures flash3's float32 gradient alone.
  """
  rng = np.random.default_rng(seed)
  names = ["query", "key", "value"]
  if bias is not None:
    names.append("bias")
  if sinks is not None:
    names.append("sinks")
  cot = rng.standard_normal(np.shape(q))
  grads = flash_grads(q, k, v, bias, sinks, cot, **kw)

  def f(query, key, value, bias, sinks):
    return ref.attention(query, key, value, bias, sinks=sinks, **kw)[0]

  args = dict(query=q, key=k, value=v, bias=bias, sinks=sinks)
  fd = ref.attention_grads_fd(f, args, names, cot, rng=rng)
  for name in names:
    g = grads[name]
    assert np.isfinite(g).all(), name
    assert g.shape == np.shape(args[name]), (name, g.shape)
    for d, deriv in fd[name]:
      got = float(np.sum(g * d))
      # float32 rounding of an O(1) problem: relative to |g||d|, with a
      # floor for gradients that are 0 in exact arithmetic.
      scale = np.linalg.norm(g) * np.linalg.norm(d) + 0.1 * np.linalg.norm(d)
      assert abs(got - deriv) <= GRAD_TOL * scale, (name, got, deriv)
  return grads


# -------------------------------------------------------- random options


@st.composite
def attention_cases(draw, jax_nn_only=False, max_t=9):
  B = draw(st.sampled_from([1, 2]))
  Tq = draw(st.integers(1, max_t))
  Tk = draw(st.integers(1, max_t))
  K = draw(st.sampled_from([1, 2]))
  N = K * draw(st.sampled_from([1, 2, 7, 8]))
  D = draw(st.sampled_from([2, 8]))
  kw = {}
  kw["is_causal"] = draw(st.booleans())
  if not jax_nn_only:
    kw["causal_alignment"] = draw(st.sampled_from(["top_left", "bottom_right"]))
  edges = [0, 1, 2, Tk - 1, Tk, Tk + 1]
  kw["local_window_size"] = draw(st.one_of(
      st.none(), st.sampled_from(edges),
      st.tuples(st.sampled_from(edges), st.sampled_from(edges))))
  if draw(st.booleans()):
    kw["scale"] = draw(st.sampled_from([0.1, 0.5, 2.0]))
  if draw(st.booleans()):
    kw["query_seq_lengths"] = draw(
        st.lists(st.integers(0, Tq), min_size=B, max_size=B))
  if draw(st.booleans()):
    kw["key_value_seq_lengths"] = draw(
        st.lists(st.integers(0, Tk), min_size=B, max_size=B))
  bcast = [(B, N, Tq, Tk), (1, N, Tq, Tk), (B, 1, Tq, Tk), (1, 1, Tq, Tk),
           (1, 1, 1, Tk), (B, N, Tq, 1)]
  bias_shape = draw(st.one_of(st.none(), st.sampled_from(bcast)))
  mask_shape = draw(st.one_of(st.none(), st.sampled_from(bcast)))
  if not jax_nn_only:
    if draw(st.booleans()):
      nseg = draw(st.integers(1, 3))
      kw["query_segment_ids"] = np.sort(
          draw(st.lists(st.integers(0, nseg), min_size=B * Tq,
                        max_size=B * Tq))).reshape(B, Tq)
      kw["key_value_segment_ids"] = np.sort(
          draw(st.lists(st.integers(0, nseg), min_size=B * Tk,
                        max_size=B * Tk))).reshape(B, Tk)
    kw["logits_soft_cap"] = draw(st.sampled_from([None, 1.0, 5.0, 30.0]))
    kw["sinks"] = draw(st.sampled_from([None, "random"]))
  seed = draw(st.integers(0, 2**31 - 1))
  return (B, Tq, Tk, N, K, D), bias_shape, mask_shape, kw, seed


def build(case):
  (B, Tq, Tk, N, K, D), bias_shape, mask_shape, kw, seed = case
  rng = np.random.default_rng(seed)
  q, k, v = rand_qkv(rng, B, Tq, Tk, N, K, D)
  bias = None if bias_shape is None else rng.standard_normal(bias_shape).astype(np.float32)
  mask = None if mask_shape is None else rng.random(mask_shape) < 0.8
  kw = dict(kw)
  if kw.get("sinks") == "random":
    kw["sinks"] = (2 * rng.standard_normal(N)).astype(np.float32)
  return q, k, v, bias, mask, kw


@hypothesis.settings(max_examples=35, **SETTINGS)
@hypothesis.given(attention_cases())
def test_random_options_match_oracle(case):
  q, k, v, bias, mask, kw = build(case)
  assert_matches_oracle(q, k, v, bias, mask, **kw)


@hypothesis.settings(max_examples=12, **SETTINGS)
@hypothesis.given(attention_cases(max_t=4))
def test_random_options_gradients_match_finite_differences(case):
  q, k, v, bias, mask, kw = build(case)
  if mask is not None:
    kw["mask"] = mask
  sinks = kw.pop("sinks", None)
  check_grads_fd(q, k, v, bias, sinks, seed=case[-1], **kw)


# ---------------------------------------------- sweeps named by the issue

T_VALUES = [1, 2, 3, 63, 64, 65, 127, 129]
T_PAIRS = ([(t, t) for t in T_VALUES]
           + list(zip(T_VALUES, T_VALUES[1:] + T_VALUES[:1]))
           + list(zip(T_VALUES[1:] + T_VALUES[:1], T_VALUES)))


@pytest.mark.parametrize("Tq, Tk", T_PAIRS, ids=lambda t: str(t))
def test_sequence_length_sweep(Tq, Tk):
  rng = np.random.default_rng(Tq * 1000 + Tk)
  i = T_PAIRS.index((Tq, Tk))
  ratio = [1, 2, 7, 8][i % 4]
  alignment = ["top_left", "bottom_right"][i % 2]
  q, k, v = rand_qkv(rng, 1, Tq, Tk, ratio, 1, 8)
  if i % 3 == 2:
    assert_matches_oracle(q, k, v, local_window_size=(5, 3 * (i % 2)),
                          key_value_seq_lengths=[max(1, Tk - 2)])
  else:
    assert_matches_oracle(q, k, v, is_causal=True, causal_alignment=alignment)


@pytest.mark.parametrize("ratio", [1, 2, 7, 8])
@pytest.mark.parametrize("K", [1, 3])
def test_gqa_ratios(ratio, K):
  rng = np.random.default_rng(ratio * 10 + K)
  q, k, v = rand_qkv(rng, 2, 5, 7, K * ratio, K, 4)
  bias = rng.standard_normal((1, K * ratio, 5, 7)).astype(np.float32)
  assert_matches_oracle(q, k, v, bias, is_causal=True,
                        sinks=rng.standard_normal(K * ratio).astype(np.float32))


def test_unbatched_query_key_value():
  rng = np.random.default_rng(5)
  q, k, v = rand_qkv(rng, 1, 4, 6, 4, 2, 8)
  got_o, got_lse = flash(q[0], k[0], v[0], is_causal=True)
  assert got_o.shape == (4, 4, 8) and got_lse.shape == (4, 4)
  want_o, want_lse = ref.attention(q, k, v, is_causal=True)
  np.testing.assert_allclose(got_o, want_o[0], rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(got_lse, want_lse[0], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("dtype, tol", [(jnp.bfloat16, 2e-2), (jnp.float16, 4e-3)])
def test_16_bit_inputs(dtype, tol):
  rng = np.random.default_rng(6)
  q, k, v = (jnp.asarray(x, dtype) for x in rand_qkv(rng, 2, 9, 11, 4, 2, 16))
  got_o, got_lse = flash(q, k, v, is_causal=True)
  # The oracle sees the same rounded inputs; what is left is output rounding.
  want_o, want_lse = ref.attention(*(np.asarray(x, np.float64) for x in (q, k, v)),
                                   is_causal=True)
  np.testing.assert_allclose(got_o, want_o, rtol=tol, atol=tol)
  np.testing.assert_allclose(got_lse, want_lse, rtol=1e-3, atol=1e-3)


def test_default_scale_is_inverse_sqrt_head_dim():
  rng = np.random.default_rng(7)
  q, k, v = rand_qkv(rng, 1, 3, 3, 1, 1, 16)
  default, _ = flash(q, k, v)
  explicit, _ = flash(q, k, v, scale=0.25)
  np.testing.assert_allclose(default, explicit, rtol=1e-6, atol=1e-6)
  other, _ = flash(q, k, v, scale=1.0)
  assert np.abs(other - default).max() > 1e-3


def test_soft_cap_is_applied_after_bias_and_before_masking():
  rng = np.random.default_rng(8)
  q, k, v = rand_qkv(rng, 1, 4, 5, 2, 1, 8)
  q *= 4  # logits well beyond the cap, so the cap matters
  bias = 3 * rng.standard_normal((1, 2, 4, 5)).astype(np.float32)
  capped, _, _, _ = assert_matches_oracle(q, k, v, bias, is_causal=True,
                                          logits_soft_cap=2.0)
  uncapped, _ = flash(q, k, v, bias, is_causal=True)
  assert np.abs(capped - uncapped).max() > 1e-2


def test_sinks_take_weight_from_values():
  # One key, q = 0 so its logit is 0; a sink of log(3) takes 3/4 of the weight.
  q = np.zeros((1, 1, 1, 4), np.float32)
  k = np.zeros((1, 1, 1, 4), np.float32)
  v = np.full((1, 1, 1, 4), 2.0, np.float32)
  out, lse = flash(q, k, v, sinks=np.array([np.log(3.0)], np.float32))
  np.testing.assert_allclose(out.ravel(), [0.5] * 4, rtol=1e-6)
  np.testing.assert_allclose(lse.ravel(), [np.log(4.0)], rtol=1e-6)


def test_nan_sink_poisons_its_head_only():
  # A NaN sink makes its head's o and lse NaN (as the kernels do), not a
  # finite unnormalised sum with lse -inf; the other heads are untouched.
  rng = np.random.default_rng(3)
  q, k, v = rand_qkv(rng, 1, 5, 7, 2, 2, 8)
  sinks = np.array([0.5, np.nan], np.float32)
  out, lse = flash(q, k, v, sinks=sinks)
  good, good_lse = flash(q, k, v, sinks=np.array([0.5, 0.0], np.float32))
  assert np.isnan(out[:, :, 1]).all() and np.isnan(lse[:, :, 1]).all()
  np.testing.assert_array_equal(out[:, :, 0], good[:, :, 0])
  np.testing.assert_array_equal(lse[:, :, 0], good_lse[:, :, 0])


# ------------------------------------------------------ fully masked rows


def _masked_row_sources(rng):
  """(name, q, k, v, kwargs) with some query rows that see no key."""
  q, k, v = rand_qkv(rng, 2, 6, 4, 4, 2, 8)
  mask = np.ones((2, 4, 6, 4), bool)
  mask[0, :, 2] = False
  mask[1, 1, 5] = False
  return [
      ("causal_bottom_right_tq_gt_tk", q, k, v,
       dict(is_causal=True, causal_alignment="bottom_right")),
      ("query_lengths", q, k, v, dict(query_seq_lengths=[3, 0])),
      ("key_lengths_zero", q, k, v, dict(key_value_seq_lengths=[0, 2])),
      ("segments", q, k, v,
       dict(query_segment_ids=[[0, 0, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0]],
            key_value_segment_ids=[[0, 0, 1, 1], [1, 1, 1, 1]])),
      ("window_top_left_tq_gt_tk", q, k, v, dict(local_window_size=(0, 0))),
      ("window_after_clamp", q, k, v,
       dict(is_causal=True, local_window_size=(1, 3),
            causal_alignment="bottom_right")),
      ("mask", q, k, v, dict(mask=mask)),
  ]


SOURCES = [s[0] for s in _masked_row_sources(np.random.default_rng(0))]


@pytest.mark.parametrize("source, with_sinks", [
    (s, False) for s in SOURCES] + [(s, True) for s in SOURCES[:3]])
def test_e06_fully_masked_rows_are_zero_with_lse_minus_inf(source, with_sinks):
  cases = {s[0]: s[1:] for s in _masked_row_sources(np.random.default_rng(9))}
  q, k, v, kw = cases[source]
  kw = dict(kw)
  mask = kw.pop("mask", None)
  sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
  if with_sinks:
    kw["sinks"] = sinks
  blind = blind_rows(q, k, mask=mask, **kw)
  assert blind.any() and not blind.all(), "the case must mix blind and seeing rows"
  out, lse, _, _ = assert_matches_oracle(q, k, v, None, mask, **kw)
  assert (out[blind] == 0).all()
  if with_sinks:
    want = np.broadcast_to(sinks, blind.shape)[blind]
    np.testing.assert_allclose(lse[blind], want, rtol=1e-6)
  else:
    assert np.isneginf(lse[blind]).all()
  assert np.isfinite(lse[~blind]).all()

  # Zero gradients: a blind row's dq is 0, and a cotangent on blind rows only
  # reaches no k, v (or sinks).
  cot = np.where(blind[..., None], 1.0, 0.0).astype(np.float32)
  names = ["query", "key", "value"] + (["sinks"] if with_sinks else [])
  kw_grad = dict(kw, mask=mask) if mask is not None else kw
  sinks_arg = kw_grad.pop("sinks", None)
  g = flash_grads(q, k, v, None, sinks_arg, cot, **kw_grad)
  for name in names:
    assert np.isfinite(g[name]).all(), name
    assert (g[name] == 0).all(), name
  # Nor does a NaN one: the kernels never read it (was 0 * NaN in every dv).
  nan_cot = np.where(blind[..., None], np.nan, 1.0).astype(np.float32)
  g_nan = flash_grads(q, k, v, None, sinks_arg, nan_cot, **kw_grad)
  g_one = flash_grads(q, k, v, None, sinks_arg, np.where(blind[..., None], 0.0, 1.0)
                      .astype(np.float32), **kw_grad)
  for name in names:
    np.testing.assert_array_equal(g_nan[name], g_one[name], err_msg=name)
  g_all = flash_grads(q, k, v, None, sinks_arg, np.ones_like(q), **kw_grad)
  assert np.isfinite(g_all["query"]).all()
  assert (g_all["query"][blind] == 0).all()


def test_fully_masked_rows_differ_from_jax_nn_as_documented():
  # jax.nn's XLA path averages v over a row whose mask is all False; flash3
  # returns 0 there (docs/semantics.md).
  rng = np.random.default_rng(10)
  q, k, v = rand_qkv(rng, 1, 2, 3, 1, 1, 4)
  mask = np.array([[True, False, True], [False, False, False]])[None, None]
  ours = flash3.dot_product_attention(q, k, v, mask=mask, implementation="xla")
  theirs = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
  np.testing.assert_array_equal(np.asarray(ours)[0, 1], 0.0)
  np.testing.assert_allclose(np.asarray(theirs)[0, 1, 0], v[0, :, 0].mean(0),
                             rtol=1e-5)
  np.testing.assert_allclose(np.asarray(ours)[0, 0], np.asarray(theirs)[0, 0],
                             rtol=1e-5, atol=1e-6)


# ------------------------------------------------------ agreement with jax.nn


@functools.lru_cache(maxsize=None)
def _jitted_jax_nn(static):
  def f(q, k, v, bias, dynamic):
    return jax.nn.dot_product_attention(
        q, k, v, bias, implementation="xla", return_residual=True,
        **dict(static), **dynamic)
  return jax.jit(f)


@hypothesis.settings(max_examples=25, **SETTINGS)
@hypothesis.given(attention_cases(jax_nn_only=True))
def test_equal_to_jax_nn_with_jax_nn_options(case):
  q, k, v, bias, mask, kw = build(case)
  static, dynamic = _split(dict(kw, mask=mask))
  args = (q, k, v, None if bias is None else jnp.asarray(bias), dynamic)
  ours, our_lse = _jitted_forward(static)(*args)
  theirs, their_lse = _jitted_jax_nn(static)(*args)
  seeing = ~blind_rows(q, k, mask=mask, **kw)
  np.testing.assert_allclose(np.asarray(ours)[seeing], np.asarray(theirs)[seeing],
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(our_lse)[seeing],
                             np.asarray(their_lse)[seeing], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------ named edge cases


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("Tk, Tq", [(8, 7), (8, 9), (8, 16), (8, 2), (64, 65),
                                    (64, 16)])
def test_e05_causal_with_unequal_lengths(Tq, Tk, alignment):
  rng = np.random.default_rng(Tq + 100 * Tk)
  q, k, v = rand_qkv(rng, 2, Tq, Tk, 4, 2, 8)
  out, lse, _, _ = assert_matches_oracle(q, k, v, is_causal=True,
                                         causal_alignment=alignment)
  blind = blind_rows(q, k, is_causal=True, causal_alignment=alignment)
  # The diagonal: top_left shows row i keys 0..i; bottom_right shows keys
  # 0..i + Tk - Tq, so with Tq > Tk the first Tq - Tk rows are blind.
  first_blind = 0 if alignment == "top_left" else max(0, Tq - Tk)
  assert blind[:, :first_blind].all() and not blind[:, first_blind:].any()
  assert (out[blind] == 0).all() and np.isneginf(lse[blind]).all()
  check_grads_fd(q[:1, :3, :2], k[:1, :4, :1], v[:1, :4, :1], is_causal=True,
                 causal_alignment=alignment)


E07_CASES = ([(s, p, False) for s in ["lengths", "mask", "segments", "causal"]
              for p in [np.nan, np.inf, 1e30]]
             + [(s, np.nan, True) for s in ["lengths", "mask", "segments", "causal"]])


@pytest.mark.parametrize("source, poison, extras", E07_CASES)
def test_e07_poisoned_hidden_keys_and_values(source, poison, extras):
  """extras: also a soft cap, a bias and sinks (tanh must not see the poison)."""
  rng = np.random.default_rng(11)
  B, Tq, Tk, N, K, D = 2, 5, 7, 4, 2, 8
  q, k, v = rand_qkv(rng, B, Tq, Tk, N, K, D)
  kw, hidden_q = {}, np.zeros((B, Tq), bool)
  hidden_k = np.zeros((B, Tk), bool)
  if source == "lengths":
    kw = dict(query_seq_lengths=[4, 5], key_value_seq_lengths=[3, 6])
    hidden_k[0, 3:], hidden_k[1, 6:] = True, True
    hidden_q[0, 4:] = True
  elif source == "mask":
    m = rng.random((B, 1, Tq, Tk)) < 0.7
    m[:, :, :, 2] = False
    m[:, :, :, 0] = True
    kw = dict(mask=m)
    hidden_k[:, 2] = True
  elif source == "segments":
    kw = dict(query_segment_ids=[[0, 0, 1, 1, 1], [3, 3, 3, 3, 3]],
              key_value_segment_ids=[[0, 1, 1, 1, 2, 2, 2], [3, 3, 3, 3, 3, 7, 7]])
    hidden_k[0, 4:], hidden_k[1, 5:] = True, True
  else:  # top_left causal with Tq < Tk: keys j >= Tq are never visible
    kw = dict(is_causal=True)
    hidden_k[:, Tq:] = True
  cot = rng.standard_normal(q.shape).astype(np.float32)
  cot[hidden_q] = 0
  bias = sinks = None
  if extras:
    kw["logits_soft_cap"] = 2.0
    bias = rng.standard_normal((1, N, Tq, Tk)).astype(np.float32)
    sinks = rng.standard_normal(N).astype(np.float32)
  clean_o, clean_lse = flash(q, k, v, bias, sinks=sinks, **kw)
  clean_g = flash_grads(q, k, v, bias, sinks, cot, **kw)

  kp, vp, qp = k.copy(), v.copy(), q.copy()
  kp[hidden_k], vp[hidden_k], qp[hidden_q] = poison, poison, poison
  dirty_o, dirty_lse = flash(qp, kp, vp, bias, sinks=sinks, **kw)
  dirty_g = flash_grads(qp, kp, vp, bias, sinks, cot, **kw)

  np.testing.assert_allclose(dirty_o, clean_o, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(dirty_lse, clean_lse, rtol=1e-6, atol=1e-7)
  assert np.isfinite(dirty_o).all()
  valid_q = ~hidden_q
  np.testing.assert_allclose(dirty_g["query"][valid_q], clean_g["query"][valid_q],
                             rtol=1e-5, atol=1e-6)
  for name in ("key", "value"):
    np.testing.assert_allclose(dirty_g[name][~hidden_k], clean_g[name][~hidden_k],
                               rtol=1e-5, atol=1e-6)
    assert np.isfinite(dirty_g[name][~hidden_k]).all()
  if extras:
    for name in ("sinks", "bias"):
      assert np.isfinite(dirty_g[name]).all(), name
      np.testing.assert_allclose(dirty_g[name], clean_g[name], rtol=1e-5,
                                 atol=1e-6)


@pytest.mark.parametrize("T, is_causal", [(1, False), (2, True), (3, False),
                                          (5, True)])
def test_e11_tiny_lengths(T, is_causal):
  rng = np.random.default_rng(T)
  q, k, v = rand_qkv(rng, 2, T, T, 2, 1, 4)
  full = [T, T]
  plain = assert_matches_oracle(q, k, v, is_causal=is_causal)[:2]
  padded = flash(q, k, v, is_causal=is_causal, query_seq_lengths=full,
                 key_value_seq_lengths=full)
  np.testing.assert_array_equal(plain[0], padded[0])
  np.testing.assert_array_equal(plain[1], padded[1])
  check_grads_fd(q, k, v, is_causal=is_causal)
  check_grads_fd(q, k, v, is_causal=is_causal, query_seq_lengths=full,
                 key_value_seq_lengths=[T, max(T - 1, 1)])
  cot = np.ones(q.shape, np.float32)
  g_plain = flash_grads(q, k, v, None, None, cot, is_causal=is_causal)
  g_len = flash_grads(q, k, v, None, None, cot,
                      is_causal=is_causal, query_seq_lengths=full,
                      key_value_seq_lengths=full)
  for name in g_plain:
    np.testing.assert_array_equal(g_plain[name], g_len[name])


@pytest.mark.parametrize("Tq, Tk, is_causal, alignment", [
    (5, 7, False, "top_left"), (7, 5, False, "bottom_right"),
    (7, 5, True, "top_left"), (5, 7, True, "bottom_right")])
def test_e12_window_edges(Tq, Tk, is_causal, alignment):
  rng = np.random.default_rng(Tq * Tk)
  q, k, v = rand_qkv(rng, 1, Tq, Tk, 2, 1, 4)
  edges = [0, 1, Tk - 1, Tk, Tk + 1]
  # Every edge value on each side at least once, and both sides at 0.
  pairs = set(zip(edges, edges[1:] + edges[:1])) | {(0, 0), (Tk - 1, 0)}
  for left, right in sorted(pairs):
    assert_matches_oracle(q, k, v, is_causal=is_causal,
                          causal_alignment=alignment,
                          local_window_size=(left, right))
  check_grads_fd(q[:, :3], k[:, :4], v[:, :4], is_causal=is_causal,
                 causal_alignment=alignment, local_window_size=(1, 0))
  check_grads_fd(q[:, :3], k[:, :4], v[:, :4], is_causal=is_causal,
                 causal_alignment=alignment, local_window_size=(0, 2))


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_e12_full_left_window_equals_causal(alignment):
  rng = np.random.default_rng(12)
  q, k, v = rand_qkv(rng, 1, 6, 9, 2, 2, 4)
  w = flash(q, k, v, local_window_size=(8, 0), causal_alignment=alignment)
  c = flash(q, k, v, is_causal=True, causal_alignment=alignment)
  np.testing.assert_allclose(w[0], c[0], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(w[1], c[1], rtol=1e-6, atol=1e-7)


def test_e12_int_window_is_symmetric():
  rng = np.random.default_rng(13)
  q, k, v = rand_qkv(rng, 1, 6, 6, 1, 1, 4)
  a = flash(q, k, v, local_window_size=2)
  b = flash(q, k, v, local_window_size=(2, 2))
  np.testing.assert_array_equal(a[0], b[0])


def test_e13_key_lengths_only():
  rng = np.random.default_rng(13)
  lengths = [24, 125, 53, 28, 77, 96, 13, 114]
  q, k, v = rand_qkv(rng, 8, 128, 128, 2, 1, 8)
  assert_matches_oracle(q, k, v, key_value_seq_lengths=lengths)
  cot = rng.standard_normal(q.shape).astype(np.float32)
  g = flash_grads(q, k, v, None, None, cot, key_value_seq_lengths=lengths)
  for b, n in enumerate(lengths):
    for name in ("key", "value"):
      assert (g[name][b, n:] == 0).all(), (name, b)
      assert np.abs(g[name][b, :n]).sum(-1).min() > 0, (name, b)


def _packed(lengths_of_segments, pad_to):
  """Segment ids 0, 1, ... of the given lengths, then a padding segment 99."""
  ids = np.concatenate([np.full(n, s) for s, n in enumerate(lengths_of_segments)])
  return np.concatenate([ids, np.full(pad_to - ids.size, 99)]).astype(np.int32)


@pytest.mark.parametrize("is_causal", [False, True])
def test_e14_packed_segments(is_causal):
  rng = np.random.default_rng(14)
  T = 130
  segs = np.stack([
      _packed([T], T),                       # one segment
      _packed([64, 66], T),                  # two, boundary at a block edge
      _packed([1, 1, 3, 60, 1, 40, 21], T),  # many, length 1, trailing pad
  ])
  q, k, v = rand_qkv(rng, 3, T, T, 4, 2, 8)
  kw = dict(is_causal=is_causal, query_segment_ids=segs,
            key_value_segment_ids=segs)
  assert_matches_oracle(q, k, v, **kw)
  # Cross-segment gradients are exactly 0: a cotangent on segment 1 of row 2
  # reaches only keys of segment 1 and queries of segment 1.
  cot = np.zeros(q.shape, np.float32)
  in_seg = segs[2] == 3
  cot[2, in_seg] = 1.0
  g = flash_grads(q, k, v, None, None, cot, **kw)
  outside = np.ones(segs.shape, bool)
  outside[2, in_seg] = False
  for name in ("query", "key", "value"):
    assert (g[name][outside] == 0).all(), name
    assert np.abs(g[name][2, in_seg]).sum() > 0, name


def test_e14_segments_gradients_small():
  rng = np.random.default_rng(15)
  q, k, v = rand_qkv(rng, 1, 4, 4, 2, 1, 3)
  seg = [[0, 1, 1, 2]]
  check_grads_fd(q, k, v, is_causal=True, query_segment_ids=seg,
                 key_value_segment_ids=seg)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_e15_zero_length_sequences_and_segments(with_sinks):
  rng = np.random.default_rng(16)
  q, k, v = rand_qkv(rng, 3, 5, 6, 2, 2, 4)
  kw = dict(query_seq_lengths=[0, 5, 3], key_value_seq_lengths=[6, 0, 2],
            is_causal=True, causal_alignment="bottom_right",
            # segment 4 has queries but no keys; segment 9 keys but no queries
            query_segment_ids=[[0, 0, 4, 4, 4], [0] * 5, [1, 1, 1, 2, 2]],
            key_value_segment_ids=[[0, 0, 0, 9, 9, 9], [0] * 6, [1, 1, 1, 1, 2, 2]])
  if with_sinks:
    kw["sinks"] = np.array([0.3, -0.2], np.float32)
  out, lse, _, _ = assert_matches_oracle(q, k, v, **kw)
  kw_mask = {n: x for n, x in kw.items() if n != "sinks"}
  blind = blind_rows(q, k, **kw_mask)
  assert blind[0].all() and blind[1].all() and blind[2, 3:].all()
  assert (out[blind] == 0).all()
  sinks = kw.pop("sinks", None)
  g = flash_grads(q, k, v, None, sinks, np.ones(q.shape, np.float32), **kw)
  for name in g:
    assert np.isfinite(g[name]).all()
  assert (g["query"][blind] == 0).all()


def test_e15_no_keys_at_all():
  rng = np.random.default_rng(17)
  q = rng.standard_normal((2, 3, 2, 4)).astype(np.float32)
  k = np.zeros((2, 0, 1, 4), np.float32)
  out, lse = flash(q, k, k)
  assert (out == 0).all() and np.isneginf(lse).all()


# ----------------------------------------------- gradients, small and exact


@pytest.mark.parametrize("options", [
    dict(),
    dict(is_causal=True),
    dict(is_causal=True, causal_alignment="bottom_right"),
    dict(local_window_size=(1, 1)),
    dict(logits_soft_cap=1.5),
    dict(query_seq_lengths=[2], key_value_seq_lengths=[3]),
    dict(scale=0.9, logits_soft_cap=3.0, is_causal=True),
], ids=lambda o: "-".join(o) or "plain")
def test_gradients_with_bias_and_sinks(options):
  rng = np.random.default_rng(18)
  q, k, v = rand_qkv(rng, 1, 3, 4, 4, 2, 3)
  bias = rng.standard_normal((1, 4, 3, 4)).astype(np.float32)
  sinks = rng.standard_normal(4).astype(np.float32)
  check_grads_fd(q, k, v, bias, sinks, **options)


def test_bias_gradient_broadcasts_and_is_zero_where_masked():
  rng = np.random.default_rng(19)
  q, k, v = rand_qkv(rng, 2, 3, 4, 2, 1, 3)
  bias = rng.standard_normal((1, 1, 3, 4)).astype(np.float32)
  g = check_grads_fd(q, k, v, bias, is_causal=True)
  assert g["bias"].shape == (1, 1, 3, 4)
  hidden = np.triu(np.ones((3, 4), bool), 1)
  assert (g["bias"][0, 0][hidden] == 0).all()


def test_gradients_in_x64_mode():
  # Under jax_enable_x64 the float32 path must stay float32 and still agree.
  with jax.enable_x64(True):
    rng = np.random.default_rng(20)
    q, k, v = rand_qkv(rng, 1, 3, 3, 2, 1, 4)
    out, lse = flash(q, k, v, is_causal=True, logits_soft_cap=2.0)
    want_o, want_lse = ref.attention(q, k, v, is_causal=True, logits_soft_cap=2.0)
    np.testing.assert_allclose(out, want_o, rtol=RTOL, atol=ATOL)
    check_grads_fd(q, k, v, sinks=np.ones(2, np.float32), is_causal=True)


# --------------------------------------------------- jax transformations


def _call(**static):
  return functools.partial(flash3.dot_product_attention, implementation="xla",
                           **static)


def test_jit_with_traced_lengths_segments_and_sinks():
  rng = np.random.default_rng(21)
  q, k, v = rand_qkv(rng, 2, 5, 6, 4, 2, 4)
  qs, ks = np.array([5, 2], np.int32), np.array([3, 6], np.int32)
  sq = np.array([[0, 0, 1, 1, 1], [0] * 5], np.int32)
  sk = np.array([[0, 1, 1, 1, 1, 1], [0] * 6], np.int32)
  sinks = rng.standard_normal(4).astype(np.float32)

  @jax.jit
  def f(q, k, v, qs, ks, sq, sk, sinks):
    return _call(is_causal=True, causal_alignment="bottom_right",
                 return_residual=True)(
        q, k, v, query_seq_lengths=qs, key_value_seq_lengths=ks,
        query_segment_ids=sq, key_value_segment_ids=sk, sinks=sinks)

  out, lse = f(q, k, v, qs, ks, sq, sk, sinks)
  want_o, want_lse = ref.attention(
      q, k, v, is_causal=True, causal_alignment="bottom_right",
      query_seq_lengths=qs, key_value_seq_lengths=ks, query_segment_ids=sq,
      key_value_segment_ids=sk, sinks=sinks)
  np.testing.assert_allclose(np.asarray(out), want_o, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=RTOL, atol=ATOL)


def test_vmap_over_an_extra_axis():
  rng = np.random.default_rng(22)
  q, k, v = (np.stack([x, x[::-1] * 0.5]) for x in rand_qkv(rng, 2, 4, 5, 2, 1, 4))
  bias = rng.standard_normal((2, 1, 2, 4, 5)).astype(np.float32)
  f = _call(is_causal=True, logits_soft_cap=4.0)
  batched = jax.vmap(f)(q, k, v, bias)
  for i in range(2):
    np.testing.assert_allclose(np.asarray(batched[i]),
                               np.asarray(f(q[i], k[i], v[i], bias[i])),
                               rtol=1e-6, atol=1e-6)
  # and over the batch of unbatched (T, N, D) inputs
  per_row = jax.vmap(f)(q[0], k[0], v[0])
  np.testing.assert_allclose(np.asarray(per_row), np.asarray(f(q[0], k[0], v[0])),
                             rtol=1e-6, atol=1e-6)


def test_grad_under_jit_and_checkpoint_agree():
  rng = np.random.default_rng(23)
  q, k, v = rand_qkv(rng, 1, 4, 4, 2, 1, 4)
  sinks = rng.standard_normal(2).astype(np.float32)
  f = _call(is_causal=True, local_window_size=(2, 0))

  def loss(q, k, v, sinks):
    return jnp.sum(f(q, k, v, sinks=sinks) ** 2)

  plain = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)
  jitted = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)
  remat = jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2, 3))(q, k, v, sinks)
  for a, b, c in zip(plain, jitted, remat):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(a)).sum() > 0
