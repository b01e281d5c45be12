"""The float32 XLA reference: flash3's semantics written plainly.

``implementation="xla"`` runs this, and every kernel test compares against it.
Memory is O(Tq * Tk) per head: it materialises the logits.

Fully masked rows return 0 with logsumexp -inf and zero gradients; keys and
queries that nothing sees are *selected* away (``jnp.where``), not multiplied
by zero, so NaN or Inf written into them can never reach a valid output or
gradient (case E07 of docs/edge_cases.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flash3.visibility import MaskSpec, dense_mask


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    spec: MaskSpec,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    query_segment_ids: jax.Array | None = None,
    key_value_segment_ids: jax.Array | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Attention in float32 on already-validated BTNH arrays.

  Args:
    q: (B, Tq, N, D). k, v: (B, Tk, K, D) with N % K == 0.
    scale: multiplies q.k before bias, soft-cap and masking.
    spec: causal / alignment / window (flash3.visibility.MaskSpec).
    bias, mask: broadcastable to (B, N, Tq, Tk); mask True = keep.
    query_seq_lengths, key_value_seq_lengths: (B,) int32 valid lengths.
    query_segment_ids, key_value_segment_ids: (B, Tq), (B, Tk) int32.
    logits_soft_cap: c, logits become c * tanh(logits / c).
    sinks: (N,) float32, an extra logit per head in the softmax denominator.

  Returns:
    o: (B, Tq, N, D) in q.dtype. lse: (B, Tq, N) float32, natural log of the
    softmax denominator (sink included); -inf for rows that see no key and
    have no sink.
  """
  B, Tq, N, D = q.shape
  Tk, K = k.shape[1], k.shape[2]
  G = N // K
  f32 = jnp.float32

  keep = dense_mask(
      spec, Tq, Tk,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      query_segment_ids=query_segment_ids,
      key_value_segment_ids=key_value_segment_ids)
  keep = jnp.broadcast_to(keep, (B, N, Tq, Tk))
  if mask is not None:
    keep = keep & jnp.broadcast_to(mask, (B, N, Tq, Tk))
  keep = keep.reshape(B, K, G, Tq, Tk)

  # Select away queries that see nothing and keys that nothing sees (E07).
  q_alive = keep.any(axis=-1)                       # (B, K, G, Tq)
  k_alive = keep.any(axis=(2, 3))                   # (B, K, Tk)
  q_alive_btn = q_alive.reshape(B, N, Tq).transpose(0, 2, 1)[..., None]
  k_alive_btk = k_alive.transpose(0, 2, 1)[..., None]
  qf = jnp.where(q_alive_btn, q.astype(f32), 0.0).reshape(B, Tq, K, G, D)
  kf = jnp.where(k_alive_btk, k.astype(f32), 0.0)
  vf = jnp.where(k_alive_btk, v.astype(f32), 0.0)

  s = jnp.einsum("bqkgd,btkd->bkgqt", qf, kf,
                 precision=jax.lax.Precision.HIGHEST) * f32(scale)
  if bias is not None:
    b = jnp.broadcast_to(bias.astype(f32), (B, N, Tq, Tk))
    s = s + jnp.where(keep, b.reshape(B, K, G, Tq, Tk), 0.0)
  if logits_soft_cap is not None:
    cap = f32(logits_soft_cap)
    s = cap * jnp.tanh(s / cap)
  s = jnp.where(keep, s, -jnp.inf)

  m = s.max(axis=-1)                                 # (B, K, G, Tq)
  if sinks is not None:
    sink = sinks.astype(f32).reshape(1, K, G, 1)
    m = jnp.maximum(m, sink)
  # Softmax is invariant to the shift, so m carries no gradient.
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  p = jnp.exp(s - m[..., None])
  l = p.sum(axis=-1)
  if sinks is not None:
    l = l + jnp.exp(sink - m)
  # l is 0 only for a row with nothing visible and no sink; NaN (a NaN sink
  # or logit) must reach o and lse, as it does in the kernels.
  has_mass = l != 0
  l_safe = jnp.where(has_mass, l, 1.0)
  o = jnp.einsum("bkgqt,btkd->bqkgd", p, vf,
                 precision=jax.lax.Precision.HIGHEST)
  o = o / l_safe.transpose(0, 3, 1, 2)[..., None]
  # A blind row's o is 0 whatever its cotangent: select, so a NaN there does
  # not reach dv, dq or dsinks as 0 * NaN (the kernels never read it).
  o = jnp.where(q_alive_btn.reshape(B, Tq, K, G, 1), o, 0.0)
  lse = jnp.where(has_mass, m + jnp.log(l_safe), -jnp.inf)
  return (o.reshape(B, Tq, N, D).astype(q.dtype),
          lse.reshape(B, N, Tq).transpose(0, 2, 1))
