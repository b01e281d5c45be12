"""Does an attention implementation take packed documents on this machine? Exit 0 if so.

  python -m examples.train_gpt.probe flash3|cudnn

Runs causal GQA attention with two and three documents in two rows, forward and backward,
at a small size (B=2, T=256, N=8, K=2, D=128, bfloat16); flash3 with implementation="mosaic", so a
fallback to XLA counts as "no". Used by scripts/gpu_train.sh to choose whether both runs
use segment ids before spending minutes on a run that would fail.
"""

import argparse
import sys

import jax
import jax.numpy as jnp

from . import attention as attention_lib


def main() -> int:
  p = argparse.ArgumentParser(prog="python -m examples.train_gpt.probe", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("implementation", choices=attention_lib.IMPLEMENTATIONS)
  impl = p.parse_args().implementation
  B, T, N, K, D = 2, 256, 8, 2, 128
  q, k, v = (jax.random.normal(jax.random.key(i), (B, T, h, D), jnp.bfloat16)
             for i, h in enumerate((N, K, K)))
  # Two rows with different splits: one row alone hides a packed-layout offset error.
  pos = jnp.arange(T)
  seg = jnp.stack([jnp.where(pos < 100, 1, 2),
                   1 + (pos >= 60) + (pos >= 180)]).astype(jnp.int32)

  def loss(q, k, v):
    o = attention_lib.attend(q, k, v, seg, impl, max_segments=4,
                             flash3_implementation="mosaic")
    return jnp.sum(o.astype(jnp.float32) ** 2)

  try:
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    jax.block_until_ready(grads)
  except Exception as e:  # noqa: BLE001 (any failure means "no")
    print(f"{impl} with segment ids: no ({type(e).__name__}: {str(e)[:300]})")
    return 1
  ok = bool(jnp.isfinite(value)) and all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
  print(f"{impl} with segment ids: {'yes' if ok else 'no (non-finite output)'}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
