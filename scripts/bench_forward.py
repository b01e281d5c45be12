"""Forward kernel vs cuDNN (jax.nn.dot_product_attention) on the FA3 benchmark grid.

B * T = 16384 tokens, N * D = 2048; CUPTI kernel time via
jax.experimental.mosaic.gpu.profiler.measure (median of several). Prints one
markdown row per shape: TFLOP/s of ours and of cuDNN and the ratio.
Usage: PYTHONPATH=src python3 scripts/bench_forward.py [--quick] [--sweep]
"""
import argparse
import itertools
import statistics
import sys

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler

from flash3.kernels.config import ForwardConfig, forward_config
from flash3.kernels.forward import attention_forward
from flash3.visibility import MaskSpec


def measure(f, *args, reps=5):
  times = []
  for _ in range(reps):
    _, t = profiler.measure(f)(*args)
    times.append(t)
  return statistics.median(times)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--sweep", action="store_true")
  ap.add_argument("--T", type=int, nargs="*", help="sequence lengths to run")
  args = ap.parse_args()
  Ts = (1024, 4096, 16384) if args.quick else (512, 1024, 2048, 4096, 8192, 16384)
  Ts = tuple(args.T) if args.T else Ts
  dtypes = (jnp.bfloat16,) if args.quick else (jnp.float16, jnp.bfloat16)
  print("| dtype | D | T | causal | config | ours TFLOP/s | cudnn TFLOP/s | ratio |")
  print("|---|---|---|---|---|---|---|---|")
  ratios = []
  for dtype, D, T, causal in itertools.product(dtypes, (64, 128, 256), Ts, (False, True)):
    B, N = 16384 // T, 2048 // D
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, T, N, D), dtype) for kk in keys)
    mask = MaskSpec(causal=causal, alignment="bottom_right")
    flops = 4 * B * T * T * N * D / (2 if causal else 1)
    configs = [forward_config(D, dtype, mask, T, T)]
    if args.sweep and T == 4096:
      for bk, st in ((64, 2), (64, 4), (128, 2), (128, 3), (128, 4)):
        try:
          c = ForwardConfig(block_kv=bk, num_stages=st)
          from flash3.kernels.config import check_fits
          check_fits(c, D, 2)
          if c not in configs:
            configs.append(c)
        except ValueError:
          pass
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn"))
    try:
      t_cudnn = measure(cudnn, q, k, v)
    except Exception as e:  # noqa: BLE001
      t_cudnn = float("nan")
      print("cudnn failed", e, file=sys.stderr)
    for c in configs:
      ours = jax.jit(lambda q, k, v, c=c: attention_forward(
          q, k, v, scale=D ** -0.5, mask=mask, config=c)[0])
      try:
        t = measure(ours, q, k, v)
      except Exception as e:  # noqa: BLE001
        print("ours failed", c, repr(e)[:300], file=sys.stderr)
        continue
      r = t_cudnn / t
      if c is configs[0]:
        ratios.append(r)
      print(f"| {jnp.dtype(dtype).name} | {D} | {T} | {causal} | bkv{c.block_kv} st{c.num_stages} "
            f"| {flops / t / 1e9:.0f} | {flops / t_cudnn / 1e9:.0f} | {r:.3f} |", flush=True)
  if ratios:
    import math
    print("geomean ratio (default configs):",
          math.exp(sum(map(math.log, ratios)) / len(ratios)))


if __name__ == "__main__":
  main()
