"""Self-checks of the tests' oracle (tests/numpy_reference.py).

The mask pictures here are the worked examples of docs/semantics.md: "x" is a
visible (query row, key column) pair, "." a hidden one.
"""

import numpy as np
import pytest

import numpy_reference as ref


def picture(*rows: str) -> np.ndarray:
  return np.array([[c == "x" for c in row] for row in rows], dtype=bool)


def mask_of(Tq, Tk, B=1, **kw):
  return ref.visibility(B, 1, Tq, Tk, **kw)[:, 0]


@pytest.mark.parametrize("kw, expected", [
    (dict(is_causal=True),
     picture("x....", "xx...", "xxx..")),
    (dict(is_causal=True, causal_alignment="bottom_right"),
     picture("xxx..", "xxxx.", "xxxxx")),
    (dict(local_window_size=(1, 1)),
     picture("xx...", "xxx..", ".xxx.")),
    (dict(local_window_size=1),
     picture("xx...", "xxx..", ".xxx.")),
    (dict(local_window_size=(0, 2)),
     picture("xxx..", ".xxx.", "..xxx")),
    # causal clamps the right edge of the window to 0
    (dict(local_window_size=(1, 2), is_causal=True),
     picture("x....", "xx...", ".xx..")),
    (dict(local_window_size=(1, 0), is_causal=True,
          causal_alignment="bottom_right"),
     picture(".xx..", "..xx.", "...xx")),
], ids=["causal_tl", "causal_br", "window11", "window_int", "window02",
        "window12_causal", "window10_causal_br"])
def test_structural_pictures_q3_k5(kw, expected):
  np.testing.assert_array_equal(mask_of(3, 5, **kw)[0], expected)


def test_bottom_right_with_more_queries_than_keys_hides_first_rows():
  got = mask_of(5, 3, is_causal=True, causal_alignment="bottom_right")[0]
  np.testing.assert_array_equal(
      got, picture("...", "...", "x..", "xx.", "xxx"))


def test_lengths_and_bottom_right_use_valid_lengths_per_row():
  got = mask_of(3, 4, B=2, is_causal=True, causal_alignment="bottom_right",
                query_seq_lengths=[2, 3], key_value_seq_lengths=[3, 4])
  # row 0: shift = 3 - 2 = 1; row 1: shift = 4 - 3 = 1
  np.testing.assert_array_equal(got[0], picture("xx..", "xxx.", "...."))
  np.testing.assert_array_equal(got[1], picture("xx..", "xxx.", "xxxx"))


def test_segments():
  got = mask_of(3, 4, query_segment_ids=[[0, 0, 1]],
                key_value_segment_ids=[[0, 1, 1, 2]])
  np.testing.assert_array_equal(got[0], picture("x...", "x...", ".xx."))


def test_user_mask_is_anded():
  m = picture("x.x..", "xxxxx", ".....")
  got = mask_of(3, 5, mask=m, is_causal=True)
  np.testing.assert_array_equal(got[0], picture("x....", "xx...", "....."))


def _rand(rng, *shape):
  return rng.standard_normal(shape)


def test_matches_dense_softmax_when_everything_visible():
  rng = np.random.default_rng(1)
  B, Tq, Tk, N, K, D = 2, 3, 4, 4, 2, 5
  q, k, v = _rand(rng, B, Tq, N, D), _rand(rng, B, Tk, K, D), _rand(rng, B, Tk, K, D)
  bias = _rand(rng, 1, N, Tq, Tk)
  out, lse = ref.attention(q, k, v, bias, scale=0.7)
  kk = np.repeat(k, N // K, axis=2)
  vv = np.repeat(v, N // K, axis=2)
  s = 0.7 * np.einsum("btnd,bsnd->bnts", q, kk) + bias
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  np.testing.assert_allclose(out, np.einsum("bnts,bsnd->btnd", p, vv), rtol=1e-12)
  np.testing.assert_allclose(
      lse, np.log(np.exp(s).sum(-1)).transpose(0, 2, 1), rtol=1e-12)


def test_gqa_head_n_reads_kv_head_n_div_group():
  rng = np.random.default_rng(2)
  q, k, v = _rand(rng, 1, 2, 4, 3), _rand(rng, 1, 5, 2, 3), _rand(rng, 1, 5, 2, 3)
  out, _ = ref.attention(q, k, v)
  for n, h in [(0, 0), (1, 0), (2, 1), (3, 1)]:
    one, _ = ref.attention(q[:, :, n:n + 1], k[:, :, h:h + 1], v[:, :, h:h + 1])
    np.testing.assert_allclose(out[:, :, n], one[:, :, 0], rtol=1e-13)


def test_uniform_logits_give_mean_of_visible_values():
  v = np.arange(8.0).reshape(1, 4, 1, 2)
  q = np.zeros((1, 3, 1, 2))
  out, lse = ref.attention(q, q[:, :1].repeat(4, 1), v, is_causal=True)
  np.testing.assert_allclose(out[0, :, 0], [[0, 1], [1, 2], [2, 3]])
  np.testing.assert_allclose(lse[0, :, 0], np.log([1, 2, 3]))


def test_sink_enters_denominator_only():
  v = np.full((1, 1, 1, 2), 3.0)
  q = np.zeros((1, 2, 1, 2))
  k = np.zeros((1, 1, 1, 2))
  seg_q, seg_k = [[0, 1]], [[0]]
  out, lse = ref.attention(q, k, v, sinks=[0.0], query_segment_ids=seg_q,
                           key_value_segment_ids=seg_k)
  # row 0: logits {0 (key), 0 (sink)} -> half the weight goes nowhere
  np.testing.assert_allclose(out[0, 0, 0], [1.5, 1.5])
  np.testing.assert_allclose(lse[0, 0, 0], np.log(2.0))
  # row 1 sees no key: output 0 and lse = the sink
  np.testing.assert_array_equal(out[0, 1, 0], [0.0, 0.0])
  assert lse[0, 1, 0] == 0.0


def test_fully_masked_row_without_sink():
  q = np.ones((1, 2, 1, 2))
  out, lse = ref.attention(q, q, q, query_seq_lengths=[1])
  np.testing.assert_array_equal(out[0, 1], 0.0)
  assert lse[0, 1, 0] == -np.inf and np.isfinite(lse[0, 0, 0])


def test_soft_cap_after_scale_and_bias():
  q = np.ones((1, 1, 1, 1))
  k = np.array([3.0, -1.0]).reshape(1, 2, 1, 1)
  v = np.array([1.0, 0.0]).reshape(1, 2, 1, 1)
  bias = np.array([1.0, 0.5]).reshape(1, 1, 1, 2)
  out, lse = ref.attention(q, k, v, bias, scale=2.0, logits_soft_cap=5.0)
  s = 5.0 * np.tanh(np.array([2 * 3.0 + 1.0, 2 * -1.0 + 0.5]) / 5.0)
  np.testing.assert_allclose(out.ravel(), [np.exp(s[0]) / np.exp(s).sum()])
  np.testing.assert_allclose(lse.ravel(), [np.log(np.exp(s).sum())])


def test_poison_in_hidden_keys_does_not_leak():
  rng = np.random.default_rng(3)
  q, k, v = _rand(rng, 1, 3, 2, 4), _rand(rng, 1, 6, 2, 4), _rand(rng, 1, 6, 2, 4)
  clean, _ = ref.attention(q, k, v, key_value_seq_lengths=[4])
  k[0, 4], v[0, 5] = np.nan, np.inf
  dirty, _ = ref.attention(q, k, v, key_value_seq_lengths=[4])
  np.testing.assert_array_equal(clean, dirty)


def test_unbatched_inputs():
  rng = np.random.default_rng(4)
  q, k, v = _rand(rng, 3, 2, 4), _rand(rng, 5, 1, 4), _rand(rng, 5, 1, 4)
  out, lse = ref.attention(q, k, v, is_causal=True)
  out4, lse4 = ref.attention(q[None], k[None], v[None], is_causal=True)
  assert out.shape == (3, 2, 4) and lse.shape == (3, 2)
  np.testing.assert_array_equal(out, out4[0])
  np.testing.assert_array_equal(lse, lse4[0])


def test_finite_differences_of_a_linear_function():
  cot = np.ones((1, 1, 1, 2))
  f = lambda query, key, value: ref.attention(query, key, value)[0]
  args = dict(query=np.zeros((1, 1, 1, 2)), key=np.zeros((1, 3, 1, 2)),
              value=np.arange(6.0).reshape(1, 3, 1, 2))
  (d, deriv), = ref.attention_grads_fd(f, args, ["value"], cot,
                                       directions=1)["value"]
  # out = mean of the 3 value rows, so d<1, out>/dv = 1/3 everywhere
  np.testing.assert_allclose(deriv, d.sum() / 3, rtol=1e-8)
