"""A tiny forward for compute-sanitizer: B=1, T=512, N=2, D=64, causal and not."""
import jax
import jax.numpy as jnp

from flash3.kernels.forward import attention_forward
from flash3.visibility import MaskSpec

q, k, v = (jax.random.normal(jax.random.key(i), (1, 300, 2, 64), jnp.bfloat16) for i in range(3))
for mask in (MaskSpec(), MaskSpec(causal=True, alignment="bottom_right")):
  o, lse = attention_forward(q, k, v, scale=0.125, mask=mask)
  print(mask, float(jnp.abs(o.astype(jnp.float32)).sum()), bool(jnp.isnan(o).any()))
