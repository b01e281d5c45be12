"""Times flash3's backward kernels against cuDNN through jax.nn (H100/H200 only).

Prints one row per shape of the FlashAttention-3 grid (B*T = 16384 tokens,
N*D = 2048): CUPTI kernel time (jax.experimental.mosaic.gpu.profiler.measure,
median of ``--iters``) of cuDNN forward, cuDNN forward+backward, flash3
forward (if the forward kernel is importable) and flash3 backward, in TFLOP/s
(forward 4*B*T*T*N*D, halved when causal; backward 2.5x that), and the ratios.

  PYTHONPATH=src python scripts/bench_backward.py [--T 2048 8192] [--D 64 128 256]
"""

from __future__ import annotations

import argparse
import functools
import statistics

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler

import dataclasses

from flash3.kernels.backward import BackwardConfig, attention_backward
from flash3.visibility import MaskSpec


def timed(f, *args, iters):
  f = jax.jit(f)
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(iters):
    _, t = profiler.measure(f)(*args)
    times.append(t)
  return statistics.median(times)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--T", type=int, nargs="+", default=[2048, 8192])
  parser.add_argument("--D", type=int, nargs="+", default=[64, 128, 256])
  parser.add_argument("--dtype", default="float16")
  parser.add_argument("--iters", type=int, default=5)
  parser.add_argument("--fuse", action="store_true",
                      help="BackwardConfig.fuse_matmuls=True (heuristic otherwise)")
  args = parser.parse_args()
  dtype = jnp.dtype(args.dtype)
  try:
    from flash3.kernels.forward import attention_forward
  except ImportError:
    attention_forward = None
  print("D T causal | cudnn fwd, f+b, bwd (TFLOP/s) | flash3 fwd, bwd | bwd ratio, f+b ratio")
  for D in args.D:
    for T in args.T:
      for causal in (False, True):
        B, N = 16384 // T, 2048 // D
        keys = jax.random.split(jax.random.key(0), 4)
        q, k, v, do = (jax.random.normal(kk, (B, T, N, D), dtype) for kk in keys)
        scale = D ** -0.5
        mask = MaskSpec(causal=causal, alignment="bottom_right")

        def cudnn_fwd(q, k, v):
          return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                              implementation="cudnn")

        def cudnn_fb(q, k, v, do):
          o, vjp = jax.vjp(cudnn_fwd, q, k, v)
          return vjp(do)

        flops = 4 * B * T * T * N * D / (2 if causal else 1)
        tf = lambda ms, mult=1.0: mult * flops / (ms * 1e-3) / 1e12
        c_f = timed(cudnn_fwd, q, k, v, iters=args.iters)
        c_fb = timed(cudnn_fb, q, k, v, do, iters=args.iters)
        c_b = c_fb - c_f
        if attention_forward is not None:
          fwd = functools.partial(attention_forward, scale=scale, mask=mask)
          o, lse = jax.jit(fwd)(q, k, v)
          m_f = timed(fwd, q, k, v, iters=args.iters)
        else:
          from flash3.reference import attention_reference
          o, lse = attention_reference(q, k, v, scale=scale, spec=mask)
          lse = jnp.swapaxes(lse, 1, 2)
          o = o.astype(dtype)
          m_f = float("nan")
        config = BackwardConfig.heuristic(D, T, T, mask)
        if args.fuse:
          config = dataclasses.replace(config, fuse_matmuls=True)
        bwd = functools.partial(attention_backward, scale=scale, mask=mask,
                                config=config)
        m_b = timed(bwd, q, k, v, o, lse, do, iters=args.iters)
        print(f"{D} {T} {int(causal)} | {tf(c_f):.0f} {tf(c_fb, 3.5):.0f} "
              f"{tf(c_b, 2.5):.0f} | {tf(m_f):.0f} {tf(m_b, 2.5):.0f} | "
              f"{c_b / m_b:.2f} {c_fb / (m_f + m_b):.2f}   "
              f"(ms: cudnn f {c_f:.3f} fb {c_fb:.3f}; flash3 f {m_f:.3f} b {m_b:.3f})",
              flush=True)


if __name__ == "__main__":
  main()
