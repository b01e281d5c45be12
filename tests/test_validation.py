"""Input checking of flash3.dot_product_attention (issue 2, item 6).

Every bad argument raises before anything is traced: ValueError for shapes
and values, TypeError for dtypes, NotImplementedError for an implementation
that cannot run here. The message names the argument and its value; the
raising frame is flash3's own code, not a frame deep inside jax.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flash3

B, TQ, TK, N, K, D = 2, 5, 6, 4, 2, 8


def qkv(dtype=np.float32, b=B, tq=TQ, tk=TK, n=N, kh=K, d=D):
  rng = np.random.default_rng(0)
  return (rng.standard_normal((b, tq, n, d)).astype(dtype),
          rng.standard_normal((b, tk, kh, d)).astype(dtype),
          rng.standard_normal((b, tk, kh, d)).astype(dtype))


def call(q=None, k=None, v=None, *args, **kw):
  dq, dk, dv = qkv()
  q = dq if q is None else q
  k = dk if k is None else k
  v = dv if v is None else v
  kw.setdefault("implementation", "xla")
  return flash3.dot_product_attention(q, k, v, *args, **kw)


def expect(exc, name, *fragments, **kw):
  """Calls with kw; asserts exc names `name` and each fragment (the value)."""
  with pytest.raises(exc, match=re.escape(name)) as info:
    call(**kw)
  message = str(info.value)
  for fragment in fragments:
    assert fragment in message, (fragment, message)
  raiser = info.traceback[-1].path
  assert "flash3" in str(raiser), f"raised from {raiser}, not from flash3"
  return message


# ------------------------------------------------------------ shapes


def test_query_rank():
  q = np.zeros((TQ, N * D), np.float32)
  expect(ValueError, "query", "2", q=q)
  q5 = np.zeros((1, B, TQ, N, D), np.float32)
  expect(ValueError, "query", "5", q=q5)


def test_key_rank_differs_from_query():
  _, k, v = qkv()
  expect(ValueError, "key", k=k[0], v=v[0])


@pytest.mark.parametrize("which, shape", [
    ("batch", (B + 1, TK, K, D)),
    ("head_dim", (B, TK, K, D + 1)),
])
@pytest.mark.parametrize("value_too", [True, False])
def test_key_mismatches_query(which, shape, value_too):
  # With value still matching query, the error names key, not value.
  k = np.zeros(shape, np.float32)
  expect(ValueError, "key has", str(shape[0] if which == "batch" else shape[3]),
         k=k, **(dict(v=k) if value_too else {}))


def test_value_shape_differs_from_key():
  v = np.zeros((B, TK + 1, K, D), np.float32)
  expect(ValueError, "value", str(TK + 1), v=v)


def test_heads_not_a_multiple_of_key_heads():
  q = np.zeros((B, TQ, 4, D), np.float32)
  k = np.zeros((B, TK, 3, D), np.float32)
  expect(ValueError, "key", "3", "4", q=q, k=k, v=k)


@pytest.mark.parametrize("name", ["bias", "mask"])
@pytest.mark.parametrize("shape", [(B, N, TQ, TK + 1), (3, N, TQ, TK),
                                   (B, 3, TQ, TK), (1, B, N, TQ, TK)])
def test_bias_and_mask_must_broadcast(name, shape):
  x = np.zeros(shape, bool if name == "mask" else np.float32)
  expect(ValueError, name, str(shape), **{name: x})


@pytest.mark.parametrize("name", ["query_seq_lengths", "key_value_seq_lengths"])
def test_lengths_shape(name):
  expect(ValueError, name, "(3,)", **{name: np.array([1, 1, 1], np.int32)})
  expect(ValueError, name, **{name: np.array([[1, 1]], np.int32)})


@pytest.mark.parametrize("name, bad", [
    ("query_seq_lengths", [2, -1]), ("query_seq_lengths", [TQ + 1, 0]),
    ("key_value_seq_lengths", [-3, 2]), ("key_value_seq_lengths", [1, TK + 1]),
])
def test_lengths_out_of_range(name, bad):
  wrong = [x for x in bad if x < 0 or x > (TQ if name[0] == "q" else TK)][0]
  expect(ValueError, name, str(wrong), **{name: np.array(bad, np.int32)})


@pytest.mark.parametrize("name", ["query_seq_lengths", "key_value_seq_lengths"])
def test_int64_lengths_past_int32_are_rejected_not_wrapped(name):
  # jnp.asarray would wrap 2**32 + 3 to 3 (x64 off): checked on the host first.
  expect(ValueError, name, str(2**32 + 3), **{name: np.array([2**32 + 3, 1], np.int64)})


@pytest.mark.parametrize("name", ["query_segment_ids", "key_value_segment_ids"])
def test_int64_segment_ids_past_int32_are_rejected_not_wrapped(name):
  ids = {"query_segment_ids": np.zeros((B, TQ), np.int64),
         "key_value_segment_ids": np.zeros((B, TK), np.int64)}
  ids[name] = ids[name] + 2**32 + 1  # Would wrap to 1: a different document.
  expect(ValueError, name, "int32", **ids)


@pytest.mark.parametrize("name", ["query_seq_lengths", "key_value_seq_lengths",
                                  "query_segment_ids", "key_value_segment_ids"])
def test_python_lists_past_int32_get_the_same_error(name):
  # Lists used to go through jnp.asarray first: an OverflowError naming nothing.
  big = 2**33
  if name.endswith("lengths"):
    kw = {name: [big, 1]}
  else:  # Both ids are needed; the named one holds the big value.
    kw = {"query_segment_ids": [[0] * TQ] * B, "key_value_segment_ids": [[0] * TK] * B}
    kw[name] = [[big] + [0] * (len(kw[name][0]) - 1)] * B
  expect(ValueError, name, str(big), **kw)


def test_lists_of_traced_lengths_and_ids_work_under_jit():
  q = jnp.ones((B, TQ, N, D))
  k = jnp.ones((B, TK, N, D))

  @jax.jit
  def f(a, ids):
    return flash3.dot_product_attention(
        q, k, k, query_seq_lengths=[a, a], key_value_seq_lengths=(a, TK),
        query_segment_ids=[ids[:TQ]] * B, key_value_segment_ids=[ids] * B,
        implementation="xla")
  ids = jnp.zeros((TK,), jnp.int32)
  out = f(jnp.int32(1), ids)
  want = flash3.dot_product_attention(
      q, k, k, query_seq_lengths=np.array([1, 1]), key_value_seq_lengths=np.array([1, TK]),
      query_segment_ids=np.zeros((B, TQ), np.int32),
      key_value_segment_ids=np.zeros((B, TK), np.int32), implementation="xla")
  np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("name", ["query_segment_ids", "key_value_segment_ids"])
def test_x64_jax_segment_ids_past_int32_are_rejected_not_wrapped(name):
  # Fresh-user review: with x64 on, a jax int64 array of ids [0, 2**32, ...]
  # was cast to int32 unchecked, merging two documents into one.
  with jax.enable_x64(True):
    ids = {"query_segment_ids": jnp.zeros((B, TQ), jnp.int64),
           "key_value_segment_ids": jnp.zeros((B, TK), jnp.int64)}
    ids[name] = ids[name].at[:, 1].set(2**32)
    expect(ValueError, name, str(2**32), **ids)


@pytest.mark.parametrize("length", [2**31, 2**32 - 1])
def test_traced_lengths_past_int32_mean_the_whole_row(length):
  # Traced lengths are clamped to [0, T]; clamped after an int32 cast, these
  # wrapped negative and became 0 (every row empty).
  q, k, v = qkv()
  f = jax.jit(lambda n: flash3.dot_product_attention(
      q, k, v, key_value_seq_lengths=n, implementation="xla"))
  out = f(jnp.array([length, 2], jnp.uint32))
  want = call(key_value_seq_lengths=np.array([TK, 2], np.int32))
  np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)  # jit vs eager rounding


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.int8, jnp.int16])
def test_traced_narrow_lengths_clamp_to_t_not_to_t_wrapped(dtype):
  # T = 300 does not fit uint8 or int8: clamped in their own width, the bound
  # wrapped (uint8: 44) and cut valid lengths short. int16 holds it (control).
  q, k, v = qkv(tk=300)
  f = jax.jit(lambda n: flash3.dot_product_attention(
      q, k, v, key_value_seq_lengths=n, implementation="xla"))
  out = f(jnp.array([100, 3], dtype))
  want = call(q, k, v, key_value_seq_lengths=np.array([100, 3], np.int32))
  np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


def test_int64_ids_within_int32_still_work():
  out = call(query_segment_ids=np.ones((B, TQ), np.int64),
             key_value_segment_ids=np.ones((B, TK), np.int64),
             query_seq_lengths=np.array([1, TQ], np.int64))
  assert out.shape == (B, TQ, N, D)


def test_lengths_at_the_bounds_are_legal():
  out = call(query_seq_lengths=np.array([0, TQ], np.int32),
             key_value_seq_lengths=np.array([TK, 0], np.int32))
  assert out.shape == (B, TQ, N, D)


@pytest.mark.parametrize("window", [-1, (-1, 2), (2, -5)])
def test_negative_window(window):
  bad = window if isinstance(window, int) else min(window)
  expect(ValueError, "local_window_size", str(bad), local_window_size=window)


def test_window_tuple_of_three():
  expect(ValueError, "local_window_size", "3 entries", local_window_size=(1, 2, 3))


@pytest.mark.parametrize("window", [2.0, True, "2", (1, 2.5), (None, 3)])
def test_window_of_non_ints_is_a_type_error(window):
  expect(TypeError, "local_window_size", repr(window), local_window_size=window)


def test_window_takes_concrete_integer_scalars():
  want = call(local_window_size=(2, 1))
  for window in [(np.int64(2), jnp.array(1)), (jnp.array(2, jnp.int32), 1),
                 (np.array(2), np.array(1, np.uint8))]:
    np.testing.assert_array_equal(np.asarray(call(local_window_size=window)),
                                  np.asarray(want))


def test_concrete_lengths_closed_over_in_jit_are_checked_on_the_host():
  # A jax array captured by a jitted function is concrete: checked, not traced
  # (jnp.min of it inside the trace used to raise ConcretizationTypeError).
  q, k, v = qkv()
  lengths = jnp.array([2, TQ])
  f = jax.jit(lambda q: call(q, k, v, query_seq_lengths=lengths))
  # (jit may round differently from the eager call: 1 ulp.)
  np.testing.assert_allclose(np.asarray(f(q)),
                             np.asarray(call(q, k, v, query_seq_lengths=lengths)),
                             rtol=1e-6, atol=1e-6)
  bad = jnp.array([2, TQ + 1])
  with pytest.raises(ValueError, match="query_seq_lengths has values in"):
    jax.jit(lambda q: call(q, k, v, query_seq_lengths=bad))(q)


def test_traced_lengths_out_of_range_are_clamped():
  # Traced lengths cannot be checked; values past [0, T] act as the nearest
  # bound (a length of 99 is the whole row), never as a shifted alignment.
  q, k, v = qkv()
  f = jax.jit(lambda lq, lk: call(q, k, v, is_causal=True, causal_alignment="bottom_right",
                                  query_seq_lengths=lq, key_value_seq_lengths=lk,
                                  return_residual=True))
  o, lse = f(jnp.array([99, -3]), jnp.array([99, TK]))
  full_o, full_lse = call(q, k, v, is_causal=True, causal_alignment="bottom_right",
                          return_residual=True)
  # (jit may round differently from the eager call: 1 ulp.)
  np.testing.assert_allclose(np.asarray(o[0]), np.asarray(full_o[0]), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(lse[0]), np.asarray(full_lse[0]), rtol=1e-6)
  # Query length -3 -> 0: every row is padding (unclamped, bottom_right's
  # shift Tk - (-3) would let every row see every key).
  assert np.all(np.asarray(lse[1]) == -np.inf)
  assert np.all(np.asarray(o[1]) == 0)


@pytest.mark.parametrize("name, shape", [
    ("query_segment_ids", (B, TQ + 1)), ("key_value_segment_ids", (B, TK - 1)),
    ("query_segment_ids", (B + 1, TQ)), ("key_value_segment_ids", (TK,)),
])
def test_segment_id_shapes(name, shape):
  ids = {"query_segment_ids": np.zeros((B, TQ), np.int32),
         "key_value_segment_ids": np.zeros((B, TK), np.int32)}
  ids[name] = np.zeros(shape, np.int32)
  expect(ValueError, name, str(shape), **ids)


@pytest.mark.parametrize("given", ["query_segment_ids", "key_value_segment_ids"])
def test_segment_ids_come_in_pairs(given):
  ids = np.zeros((B, TQ if given[0] == "q" else TK), np.int32)
  with pytest.raises(ValueError, match="segment_ids"):
    call(**{given: ids})


@pytest.mark.parametrize("shape", [(N - 1,), (1, N), ()])
def test_sinks_shape(shape):
  expect(ValueError, "sinks", str(shape), sinks=np.zeros(shape, np.float32))


# ------------------------------------------------------------ values


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_scale_not_finite(scale):
  expect(ValueError, "scale", str(scale), scale=scale)


@pytest.mark.parametrize("cap", [0.0, -1.0, float("nan")])
def test_soft_cap_must_be_positive(cap):
  expect(ValueError, "logits_soft_cap", str(cap), logits_soft_cap=cap)


@pytest.mark.parametrize("cap", [1e-300, 1e-38, 1e31, 1e37])
def test_soft_cap_outside_float32_safe_range(cap):
  # Fresh-user review: 1e-300 is 0 in float32, 1e-38 gave NaN gradients and
  # 1e37 a uniform softmax (s / cap underflows), all without an error.
  expect(ValueError, "logits_soft_cap", str(cap), "1e-30, 1e+30", logits_soft_cap=cap)


@pytest.mark.parametrize("cap", [1e-30, 1e-6, 1e6, 1e30])
def test_soft_cap_at_the_range_is_exact(cap):
  # The bounds themselves work: finite gradients, and the capped softmax
  # equals a float64 NumPy one (a huge cap is the identity).
  q, k, v = qkv()
  loss = lambda q: flash3.dot_product_attention(
      q, k, v, logits_soft_cap=cap, implementation="xla").sum()
  assert np.isfinite(np.asarray(jax.grad(loss)(jnp.asarray(q)))).all()
  s = np.einsum("bqnd,bknd->bnqk", q.astype(np.float64),
                np.repeat(k, N // K, axis=2)) / np.sqrt(D)
  s = cap * np.tanh(s / cap)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  want = np.einsum("bnqk,bknd->bqnd", p, np.repeat(v, N // K, axis=2).astype(np.float64))
  got = call(q, k, v, logits_soft_cap=cap)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)


# Finite in Python, inf in float32 (every output would be NaN): fresh-user review.
@pytest.mark.parametrize("name,value", [
    ("scale", 1e39), ("scale", 3.5e38), ("scale", -1e39),
    ("logits_soft_cap", 1e39), ("logits_soft_cap", 3.5e38)])
def test_beyond_float32_is_refused(name, value):
  expect(ValueError, name, "finite float32", **{name: value})



def test_causal_alignment_unknown():
  expect(ValueError, "causal_alignment", "'center'", causal_alignment="center")


@pytest.mark.parametrize("impl", ["cudnn", "pallas", ""])
def test_implementation_unknown(impl):
  expect(ValueError, "implementation", repr(impl), implementation=impl)


# ------------------------------------------------------------ dtypes


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.complex64])
def test_query_dtype(dtype):
  q, k, v = qkv(dtype=dtype)
  expect(TypeError, "query", np.dtype(dtype).name, q=q, k=k, v=v)


def test_integer_dtype_message_names_the_given_dtype():
  # Fresh-user review: float64 NumPy lengths were reported as "float32" (the
  # dtype jax would use with x64 off), not the dtype passed.
  expect(TypeError, "query_seq_lengths", "float64",
         query_seq_lengths=np.array([1.0, 2.0]))


def test_mask_and_mismatch_messages_name_the_given_dtype():
  # Docs-vs-code review: these two named jax's converted dtype (float32).
  expect(TypeError, "mask", "float64", mask=np.ones((1, 1, TQ, TK)))
  q, k, v = qkv(dtype=np.float16)
  expect(TypeError, "query, key and value", "float16, float64, float16",
         q=q, k=np.asarray(k, np.float64), v=v)


@pytest.mark.parametrize("name, ragged", [
    ("bias", [[1.0, 2.0], [1.0]]), ("mask", [[True], [True, False]]),
    ("sinks", [1.0, [2.0]]), ("query_seq_lengths", [[1, 2], [3]]),
    ("key_value_seq_lengths", [1, [2]]), ("query_segment_ids", [[0, 1], [0]])])
def test_ragged_list_arguments_are_a_type_error_naming_them(name, ragged):
  # Only query, key and value lists were checked; the others raised NumPy's
  # ValueError without the argument's name.
  kw = {name: ragged}
  if name == "query_segment_ids":
    kw["key_value_segment_ids"] = np.zeros((B, TK), np.int32)
  expect(TypeError, name, "rectangular", **kw)


@pytest.mark.parametrize("name, value, says", [
    ("bias", [["a"]], "<U1"), ("mask", [["a"]], "<U1"), ("mask", [[None]], "object"),
    ("sinks", ["a", "b"], "<U1"), ("query_seq_lengths", ["a"], "<U1"),
    ("query_seq_lengths", "3", "str"), ("key_value_seq_lengths", object(), "object")])
def test_non_numeric_arguments_are_a_type_error_naming_them(name, value, says):
  # Docs-vs-code review: these reached jnp.asarray or jax's dtype lookup and
  # raised jax's own TypeError, which names no argument.
  expect(TypeError, name, says, **{name: value})


def test_float64_rejected_under_x64():
  with jax.enable_x64(True):
    q, k, v = (jnp.asarray(x, jnp.float64) for x in qkv())
    expect(TypeError, "query", "float64", q=q, k=k, v=v)


@pytest.mark.parametrize("name", ["key", "value"])
def test_key_value_dtype_must_match_query(name):
  q, k, v = qkv()
  args = dict(q=q, k=k, v=v)
  args[name[0]] = args[name[0]].astype(jnp.bfloat16)
  expect(TypeError, name, "bfloat16", **args)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_accepted_dtypes(dtype):
  q, k, v = (jnp.asarray(x, dtype) for x in qkv())
  out = call(q, k, v, is_causal=True)
  assert out.dtype == dtype and out.shape == q.shape
  assert np.isfinite(np.asarray(out, np.float32)).all()


def test_mask_dtype():
  expect(TypeError, "mask", "float32",
         mask=np.ones((B, N, TQ, TK), np.float32))


@pytest.mark.parametrize("name", ["query_seq_lengths", "key_value_seq_lengths"])
def test_lengths_dtype(name):
  expect(TypeError, name, "float32", **{name: np.array([1.0, 2.0], np.float32)})


@pytest.mark.parametrize("name", ["query_segment_ids", "key_value_segment_ids"])
def test_segment_ids_dtype(name):
  ids = {"query_segment_ids": np.zeros((B, TQ), np.int32),
         "key_value_segment_ids": np.zeros((B, TK), np.int32)}
  ids[name] = ids[name].astype(np.float32)
  expect(TypeError, name, "float32", **ids)


# ------------------------------------------------------------ before tracing


def test_shape_errors_surface_unchanged_under_jit():
  q, k, v = qkv()
  f = jax.jit(lambda q, k, v: flash3.dot_product_attention(
      q, k, v, implementation="xla"))
  with pytest.raises(ValueError, match="key") as info:
    f(q, k[:, :, :1, :5], v[:, :, :1, :5])
  assert "flash3" in str(info.traceback[-1].path)


def test_validation_does_not_trace_the_computation():
  # A bad call must fail in the checks, before any jax primitive runs:
  # nothing reaches a jaxpr being traced around it.
  q, k, v = qkv()
  seen = []

  def f(q):
    seen.append(1)
    return flash3.dot_product_attention(q, k, v, implementation="xla",
                                        scale=float("nan"))

  with pytest.raises(ValueError, match="scale"):
    jax.make_jaxpr(f)(q)
  assert seen == [1]


# ------------------------------------------------------------ empty arrays


@pytest.mark.parametrize("b, tq, tk", [(B, 0, TK), (0, TQ, TK), (B, 0, 0),
                                       (0, 0, 0)])
def test_empty_inputs_give_empty_outputs(b, tq, tk):
  q, k, v = qkv(b=b, tq=tq, tk=tk)
  kw = {}
  if b:
    kw["key_value_seq_lengths"] = np.full((b,), tk, np.int32)
  out, lse = call(q, k, v, is_causal=True, return_residual=True, **kw)
  assert out.shape == (b, tq, N, D) and out.dtype == jnp.float32
  assert lse.shape == (b, tq, N) and lse.dtype == jnp.float32
  g = jax.grad(lambda q: jnp.sum(call(q, k, v)))(q)
  assert g.shape == q.shape


@pytest.mark.parametrize("implementation", [None, "mosaic", "xla"])
def test_head_dim_zero_sees_its_keys(implementation):
  # D = 0: every logit is 0, so each row's lse is the log of the keys it sees
  # (not -inf, which is for rows that see none); no kernel is launched.
  q, k, v = qkv(d=0)
  o, lse = call(q, k, v, is_causal=True, causal_alignment="bottom_right",
                key_value_seq_lengths=np.array([TK, 2], np.int32), return_residual=True,
                implementation=implementation)
  assert o.shape == (B, TQ, N, 0)
  shift = np.array([TK, 2]) - TQ
  seen = np.clip(np.arange(TQ)[None, :] + shift[:, None] + 1, 0, [[TK], [2]])
  want = np.where(seen > 0, np.log(np.maximum(seen, 1)), -np.inf)
  np.testing.assert_allclose(np.asarray(lse), np.broadcast_to(want[..., None], lse.shape),
                             rtol=1e-6)


def test_head_dim_zero_has_zero_gradients():
  q, k, v = qkv(d=0)
  sinks = np.array([0.5, 1.0, -1.0, 0.0], np.float32)
  def loss(q, k, v, sinks):
    o, lse = call(q, k, v, sinks=sinks, is_causal=True, return_residual=True)
    return jnp.sum(o) + jnp.sum(lse)
  dq, dk, dv, dsinks = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)
  assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
  # lse = log(n + exp(sink)) per row: d/dsink = exp(sink) / (n + exp(sink)).
  n = np.arange(TQ) + 1  # top_left causal: row i sees i + 1 keys
  want = B * (np.exp(sinks)[None] / (n[:, None] + np.exp(sinks)[None])).sum(0)
  np.testing.assert_allclose(np.asarray(dsinks), want, rtol=1e-5)


@pytest.mark.parametrize("bad, fragment", [
    ([[[[1.0, 2.0]], [[1.0]]]], "rectangular"),   # ragged
    ([[[["a"]]]], "dtype"),                        # strings
    ([[[[2 ** 40]]]], "query"),                    # integers (past int32 too)
])
def test_query_lists_that_are_not_float_arrays(bad, fragment):
  k = np.zeros((1, 1, 1, 1), np.float32)
  with pytest.raises(TypeError, match="query") as info:
    flash3.dot_product_attention(bad, k, k, implementation="xla")
  assert fragment in str(info.value)
  assert "flash3" in str(info.traceback[-1].path)


def test_query_key_value_as_python_lists():
  # jax.nn takes q, k, v as array-likes; so does flash3.
  q, k, v = qkv()
  want = call(q, k, v, is_causal=True)
  got = call(q.tolist(), k.tolist(), v.tolist(), is_causal=True)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ------------------------------------------------------------ implementation


def test_mosaic_on_cpu_is_not_implemented():
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is present")
  with pytest.raises(NotImplementedError, match=r"(?i)hopper|gpu|device") as info:
    call(implementation="mosaic")
  assert "flash3" in str(info.traceback[-1].path)


def test_implementation_none_on_cpu_warns_once_and_uses_xla():
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is present")
  # A fresh interpreter, so that no earlier test has used up the warning.
  script = textwrap.dedent("""
      import warnings
      import numpy as np
      import flash3
      rng = np.random.default_rng(0)
      q = rng.standard_normal((1, 3, 2, 4)).astype(np.float32)
      k = rng.standard_normal((1, 5, 1, 4)).astype(np.float32)
      with warnings.catch_warnings(record=True) as caught:
          warnings.simplefilter("always")
          a = flash3.dot_product_attention(q, k, k, is_causal=True)
          b = flash3.dot_product_attention(q[:, :2], k, k, is_causal=True)
      x = flash3.dot_product_attention(q, k, k, is_causal=True,
                                       implementation="xla")
      mine = [w for w in caught if issubclass(w.category, UserWarning)]
      print("COUNT", len(mine))
      for w in mine:
          print("MESSAGE", str(w.message).replace(chr(10), " "))
      print("EQUAL", bool((np.asarray(a) == np.asarray(x)).all()))
      """)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", script], capture_output=True,
                          text=True, env=env, timeout=120)
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  assert "COUNT 1" in lines, result.stdout
  message = [l for l in lines if l.startswith("MESSAGE")][0]
  assert re.search(r"(?i)xla", message) and re.search(r"(?i)gpu|hopper", message)
  assert "EQUAL True" in lines


# ------------------------------------------------------------ Python lists

LIST_ARGS = {
    "query_seq_lengths": np.array([3, 5], np.int32),
    "key_value_seq_lengths": np.array([6, 2], np.int32),
    "sinks": np.array([0.5, 1.0, -1.0, 0.0], np.float32),
    "bias": np.zeros((TQ, TK), np.float32),
    "mask": np.tril(np.ones((TQ, TK), bool)),
}


@pytest.mark.parametrize("name", list(LIST_ARGS))
def test_python_lists_work_like_arrays_or_fail_clearly(name):
  # jax.nn takes these through jnp.asarray, so lists work there; flash3 must
  # either do the same or reject them with a message naming the argument.
  array = LIST_ARGS[name]
  want = call(**{name: array})
  try:
    got = call(**{name: array.tolist()})
  except TypeError as e:
    assert name in str(e), f"TypeError does not name {name}: {e}"
    frames = [str(f.path) for f in pytest.ExceptionInfo.from_exception(e).traceback]
    assert "flash3" in frames[-1], f"raised from {frames[-1]}"
  else:
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_segment_ids_as_lists_work_or_fail_clearly():
  q_ids = [[0, 0, 1, 1, 1], [0] * TQ]
  kv_ids = [[0, 1, 1, 1, 1, 1], [0] * TK]
  want = call(query_segment_ids=np.array(q_ids, np.int32),
              key_value_segment_ids=np.array(kv_ids, np.int32))
  try:
    got = call(query_segment_ids=q_ids, key_value_segment_ids=kv_ids)
  except TypeError as e:
    assert "segment_ids" in str(e), str(e)
  else:
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ----- drop-in behaviour found by a first user ---------------------------------

def test_float64_numpy_inputs_become_float32_like_jax_nn():
  rng = np.random.default_rng(0)
  q, k = rng.standard_normal((1, 8, 2, 4)), rng.standard_normal((1, 8, 2, 4))
  got = flash3.dot_product_attention(q, k, k, is_causal=True, implementation="xla")
  want = jax.nn.dot_product_attention(q, k, k, is_causal=True, implementation="xla")
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("flag", [1, np.bool_(True), jnp.array(True)])
def test_is_causal_accepts_concrete_truthy_flags(flag):
  q = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
  got = flash3.dot_product_attention(q, q, q, is_causal=flag, implementation="xla")
  want = flash3.dot_product_attention(q, q, q, is_causal=True, implementation="xla")
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["is_causal", "return_residual", "deterministic"])
@pytest.mark.parametrize("value", ["yes", 2, None])
def test_flags_must_be_bools(name, value):
  expect(TypeError, f"{name}={value!r}", "True or False", **{name: value})


@pytest.mark.parametrize("window", [2**31, (2**40, 0), np.int64(10**12)])
def test_huge_windows_mean_no_limit(window):
  q = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
  left, right = (window, window) if not isinstance(window, tuple) else window
  got = flash3.dot_product_attention(q, q, q, local_window_size=window, implementation="xla")
  want = flash3.dot_product_attention(
      q, q, q, local_window_size=(min(left, 16), min(right, 16)), implementation="xla")
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("scale", ["abc", "0.5", True])
def test_scale_must_be_a_number(scale):
  # Not a number at all: a TypeError, like a wrong dtype.
  q = jnp.ones((1, 4, 1, 8))
  with pytest.raises(TypeError, match="scale="):
    flash3.dot_product_attention(q, q, q, scale=scale)


@pytest.mark.parametrize("name", ["scale", "logits_soft_cap"])
def test_traced_scale_and_cap_are_type_errors(name):
  # The kernels are compiled for these numbers: a traced one is refused
  # (jax.nn takes a traced scale; docs/semantics.md section 5 says so).
  q = jnp.ones((1, 4, 1, 8))
  f = jax.jit(lambda x: flash3.dot_product_attention(q, q, q, **{name: x}))
  with pytest.raises(TypeError, match=f"{name}=.*known at trace time"):
    f(0.5)


@pytest.mark.parametrize("cap", ["5", b"5"])
def test_soft_cap_must_be_a_number(cap):
  expect(TypeError, "logits_soft_cap", repr(cap), logits_soft_cap=cap)


def test_soft_cap_must_be_a_scalar():
  expect(ValueError, "logits_soft_cap", "(1,)", logits_soft_cap=jnp.array([5.0]))


@pytest.mark.parametrize("name", ["query_seq_lengths", "key_value_seq_lengths"])
def test_lengths_of_rank3_inputs_are_one_value(name):
  # Rank-3 inputs (T, N, D) have no batch axis: a scalar or one length.
  q3, k3 = np.zeros((TQ, N, D), np.float32), np.zeros((TK, N, D), np.float32)
  with pytest.raises(ValueError, match="no batch axis") as info:
    flash3.dot_product_attention(q3, k3, k3, **{name: np.array([1, 1], np.int32)})
  assert name in str(info.value) and "(2,)" in str(info.value)
  out = flash3.dot_product_attention(q3, k3, k3, **{name: np.int32(1)})
  assert out.shape == q3.shape


@pytest.mark.parametrize("window", [3, (5, 0), (2**40, 1)])
def test_export_with_a_symbolic_length_takes_a_window(window):
  """jax.export with a symbolic T: the window is clipped at a fixed bound
  (min(window, Tq + Tk) raised InconclusiveDimensionOperation)."""
  from jax import export
  T, = export.symbolic_shape("t")
  spec = jax.ShapeDtypeStruct((1, T, 2, 16), jnp.float32)
  f = jax.jit(lambda q, k, v: flash3.dot_product_attention(
      q, k, v, local_window_size=window, is_causal=True, implementation="xla"))
  exported = export.export(f)(spec, spec, spec)
  q, k, v = (jax.random.normal(jax.random.key(i), (1, 40, 2, 16)) for i in range(3))
  np.testing.assert_array_equal(exported.call(q, k, v), f(q, k, v))
