"""A brute-force float64 NumPy attention: the tests' independent oracle.

Written from the rules in docs/semantics.md (issue 2), deliberately without
importing flash3: it builds its own boolean mask from query and key positions
with explicit loops, and computes each output row by selecting the visible
keys (never by multiplying masked values by zero, so NaN or Inf in a masked
key or value row cannot leak in).

Rules, query i in [0, Tq), key j in [0, Tk), batch row b:

* aligned position i' = i + shift; shift = 0 for "top_left", and
  kv_len[b] - q_len[b] for "bottom_right" (Tk - Tq when no lengths are given).
* causal keeps j <= i'. A window (left, right) keeps i' - left <= j <= i' + right.
* lengths keep i < q_len[b] and j < kv_len[b]; segment ids keep
  q_seg[b, i] == kv_seg[b, j]; a boolean mask (broadcast to (B, N, Tq, Tk))
  keeps True.
* logits = scale * q.k + bias, then c * tanh(logits / c) with a soft cap c,
  then masking. A sink s[n] is one more logit in the denominator with no value.
* lse = log(sum over visible keys of exp(logit) + exp(sink)), natural log.
  A row that sees no key: output 0, lse = -inf (or = sink with sinks).
"""

from __future__ import annotations

import math

import numpy as np


def _to_4d(x):
  """jax.nn's rule: prepend size-1 axes up to rank 4."""
  x = np.asarray(x)
  return x.reshape((1,) * (4 - x.ndim) + x.shape)


def visibility(
    B: int,
    N: int,
    Tq: int,
    Tk: int,
    *,
    mask=None,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    local_window_size=None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    query_segment_ids=None,
    key_value_segment_ids=None,
) -> np.ndarray:
  """The explicit boolean mask, shape (B, N, Tq, Tk): True = key visible."""
  if causal_alignment not in ("top_left", "bottom_right"):
    raise ValueError(causal_alignment)
  if isinstance(local_window_size, (int, np.integer)):
    local_window_size = (int(local_window_size), int(local_window_size))
  keep = np.zeros((B, N, Tq, Tk), dtype=bool)
  for b in range(B):
    q_len = Tq if query_seq_lengths is None else int(query_seq_lengths[b])
    kv_len = Tk if key_value_seq_lengths is None else int(key_value_seq_lengths[b])
    shift = 0 if causal_alignment == "top_left" else kv_len - q_len
    for i in range(Tq):
      pos = i + shift
      for j in range(Tk):
        ok = i < q_len and j < kv_len
        if is_causal:
          ok = ok and j <= pos
        if local_window_size is not None:
          left, right = local_window_size
          ok = ok and pos - left <= j <= pos + right
        if query_segment_ids is not None:
          ok = ok and query_segment_ids[b][i] == key_value_segment_ids[b][j]
        keep[b, :, i, j] = ok
  if mask is not None:
    keep &= np.broadcast_to(_to_4d(mask).astype(bool), keep.shape)
  return keep


def attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    causal_alignment: str = "top_left",
    query_segment_ids=None,
    key_value_segment_ids=None,
    logits_soft_cap=None,
    sinks=None,
):
  """Returns (out, lse) in float64: out like query, lse (B, Tq, N) or (Tq, N)."""
  q = np.asarray(query, dtype=np.float64)
  k = np.asarray(key, dtype=np.float64)
  v = np.asarray(value, dtype=np.float64)
  unbatched = q.ndim == 3
  if unbatched:
    q, k, v = q[None], k[None], v[None]
  B, Tq, N, D = q.shape
  _, Tk, K, _ = k.shape
  assert N % K == 0, (N, K)
  group = N // K
  scale = 1.0 / math.sqrt(D) if scale is None else float(scale)

  keep = visibility(
      B, N, Tq, Tk, mask=mask, is_causal=is_causal,
      causal_alignment=causal_alignment, local_window_size=local_window_size,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      query_segment_ids=query_segment_ids,
      key_value_segment_ids=key_value_segment_ids)
  if bias is not None:
    bias = np.broadcast_to(_to_4d(np.asarray(bias, np.float64)), (B, N, Tq, Tk))
  sinks = None if sinks is None else np.asarray(sinks, np.float64)

  out = np.zeros((B, Tq, N, D))
  lse = np.full((B, Tq, N), -np.inf)
  for b in range(B):
    for n in range(N):
      h = n // group  # query head n reads kv head n // (N // K), as jax.nn
      for i in range(Tq):
        cols = np.nonzero(keep[b, n, i])[0]
        # Only the visible keys enter: masked rows of k, v are never read.
        s = scale * (k[b, cols, h, :] @ q[b, i, n, :])
        if bias is not None:
          s = s + bias[b, n, i, cols]
        if logits_soft_cap is not None:
          c = float(logits_soft_cap)
          s = c * np.tanh(s / c)
        extra = [] if sinks is None else [sinks[n]]
        all_logits = np.concatenate([s, extra])
        if all_logits.size == 0:
          continue  # sees nothing, no sink: out 0, lse -inf
        m = all_logits.max()
        p = np.exp(s - m)
        denom = np.exp(all_logits - m).sum()
        lse[b, i, n] = m + np.log(denom)
        if cols.size:
          out[b, i, n, :] = (p @ v[b, cols, h, :]) / denom
  if unbatched:
    return out[0], lse[0]
  return out, lse


def attention_grads_fd(f, args: dict, names, cotangent, *, eps=1e-6,
                       directions=3, rng=None):
  """Directional derivatives of <cotangent, f(**args)> by central differences.

  Returns {name: [(direction, derivative), ...]} so that a test can compare
  <grad[name], direction> with derivative. f returns the output array.
  """
  rng = np.random.default_rng(0) if rng is None else rng
  result = {}
  for name in names:
    x = np.asarray(args[name], np.float64)
    pairs = []
    for _ in range(directions):
      d = rng.standard_normal(x.shape)
      plus = dict(args, **{name: x + eps * d})
      minus = dict(args, **{name: x - eps * d})
      deriv = (np.sum(cotangent * f(**plus)) - np.sum(cotangent * f(**minus))) / (2 * eps)
      pairs.append((d, deriv))
    result[name] = pairs
  return result
