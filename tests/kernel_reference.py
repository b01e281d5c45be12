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
