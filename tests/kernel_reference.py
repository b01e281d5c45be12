"""The kernel tests' reference: attention with an explicit dense mask.

Shared by the forward and backward kernel tests. ``low_precision=True`` runs the
same math with the scores, P and P @ V in the input dtype: the yardstick of
FlashAttention-3's error rule (a kernel's error may be a small multiple of it).
"""

import jax
import jax.numpy as jnp

from flash3.visibility import dense_mask


def reference(q, k, v, *, scale, mask, low_precision=False):
  """Attention with an explicit dense mask: (o float32, lse natural log).

  float32 throughout, or (low_precision) the scores, P and P @ V in the input
  dtype: the yardstick of FlashAttention-3's error rule.
  """
  B, Tq, N, D = q.shape
  Tk, K = k.shape[1], k.shape[2]
  dt = q.dtype if low_precision else jnp.float32
  q, k, v = q.astype(dt), k.astype(dt), v.astype(dt)
  k = jnp.repeat(k, N // K, axis=2)
  v = jnp.repeat(v, N // K, axis=2)
  s = jnp.einsum("bqnd,bknd->bnqk", q, k,
                 precision=jax.lax.Precision.HIGHEST).astype(jnp.float32) * scale
  keep = dense_mask(mask, Tq, Tk)
  s = jnp.where(keep, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(keep, jnp.exp(s - m), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(l > 0, l, 1.0)
  o = jnp.einsum("bnqk,bknd->bqnd", p.astype(dt), v,
                 precision=jax.lax.Precision.HIGHEST).astype(jnp.float32)
  l = l[..., 0]
  lse = jnp.where(l > 0, jnp.log(jnp.where(l > 0, l, 1.0)) + m[..., 0], -jnp.inf)
  return o, lse


def low_precision_o_with_options(q, k, v, *, scale, mask, opts):
  """o by the reference's math with scores, soft cap, P and P @ V in the input dtype.

  The yardstick for the kernels' options (issue 6): ``opts`` may hold
  q_lengths, kv_lengths, q_segment_ids, kv_segment_ids (arrays), softcap (a
  float) and sinks ((N,) float32). Differentiable (the row max is a constant),
  so the backward tests take its gradients as their yardstick too. V rows no
  query sees are zeroed, as the reference selects them away (E07).
  """
  B, Tq, N, D = q.shape
  Tk, K = k.shape[1], k.shape[2]
  dt = q.dtype
  kr = jnp.repeat(k, N // K, axis=2)
  vr = jnp.repeat(v, N // K, axis=2)
  keep = dense_mask(mask, Tq, Tk,
                    query_seq_lengths=opts.get("q_lengths"),
                    key_value_seq_lengths=opts.get("kv_lengths"),
                    query_segment_ids=opts.get("q_segment_ids"),
                    key_value_segment_ids=opts.get("kv_segment_ids"))
  k_alive = jnp.broadcast_to(keep, (B, 1, Tq, Tk)).any(axis=(1, 2))
  vr = jnp.where(k_alive[:, :, None, None], vr, 0)
  s = (jnp.einsum("bqnd,bknd->bnqk", q, kr).astype(dt) * scale).astype(jnp.float32)
  if opts.get("softcap") is not None:
    c = opts["softcap"]
    s = (c * jnp.tanh(s / c)).astype(dt).astype(jnp.float32)
  s = jnp.where(keep, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  sinks = opts.get("sinks")
  if sinks is not None:
    m = jnp.maximum(m, sinks[None, :, None, None])
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  p = jnp.where(keep, jnp.exp(s - m), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  if sinks is not None:
    l = l + jnp.exp(sinks[None, :, None, None] - m)
  p = p / jnp.where(l > 0, l, 1.0)
  return jnp.einsum("bnqk,bknd->bqnd", p.astype(dt), vr).astype(jnp.float32)

