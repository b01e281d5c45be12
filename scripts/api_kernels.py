"""Where flash3's forward+backward time goes through the public API, kernel by kernel.

For each shape of the FlashAttention-3 grid given (B*T = 16384 tokens, N*D =
2048), times with CUPTI (jax.experimental.mosaic.gpu.profiler), on an H100/H200:

* ``api fwd``: ``flash3.dot_product_attention(implementation="mosaic")``;
* ``api fwd+bwd``: its jax.vjp with a cotangent, as flash3-bench times it;
* ``kernels bwd``: ``kernels.backward.attention_backward`` alone on the
  forward's o and lse, as scripts/tune.py times it;
* cuDNN's forward and forward+backward in the same run (ratios hold across
  machines, absolute times drift);

then one run of each flash3 function kernel by kernel (every GPU kernel it
launches, XLA's included), so a gap between "api fwd+bwd - api fwd" and
"kernels bwd" shows which launches it comes from.

Usage (on the GPU machine):
  PYTHONPATH=src python3 scripts/api_kernels.py --D 128 --T 16384 --causal 0 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--D", type=int, nargs="+", default=[128],
                  help="head dims (N = 2048 / D heads)")
  ap.add_argument("--T", type=int, nargs="+", default=[16384],
                  help="sequence lengths (B = 16384 / T rows)")
  ap.add_argument("--causal", type=int, nargs="+", default=[0], choices=(0, 1),
                  help="0 (no mask) and/or 1 (causal, bottom-right)")
  ap.add_argument("--lengths", default=None,
                  help="valid lengths per batch row, e.g. 4096,3072,2048,1024 "
                       "(then B is their count; queries and keys alike)")
  ap.add_argument("--docs", type=int, default=None,
                  help="packed documents of equal length per row (segment ids; "
                       "cuDNN then runs without them, as a dense yardstick)")
  ap.add_argument("--window", type=int, default=None,
                  help="local_window_size (W, 0) with --causal 1, else (W, W)")
  ap.add_argument("--iterations", type=int, default=10, help="timed runs per median")
  ap.add_argument("--out", default=None, help="folder for api_kernels.json")
  args = ap.parse_args()

  import jax
  import jax.numpy as jnp
  from jax.experimental.mosaic.gpu import profiler

  import flash3
  from flash3.bench import timing
  from flash3.kernels.backward import attention_backward
  from flash3.visibility import MaskSpec

  def median_ms(f, *xs):
    jax.block_until_ready(f(*xs))  # compiled outside the timing
    return timing.measure(f, xs, iterations=args.iterations).median

  def kernels(f, *xs):
    _, timings = profiler.measure(f, aggregate=False)(*xs)
    return timing.by_kernel(timings, name_width=70)

  rows = []
  for D in args.D:
    for T in args.T:
      for causal in args.causal:
        B, N = max(1, 16384 // T), 2048 // D
        lens = None
        if args.lengths:
          lens = jnp.asarray([int(x) for x in args.lengths.split(",")], jnp.int32)
          B = lens.shape[0]
        extra = {} if lens is None else dict(query_seq_lengths=lens,
                                             key_value_seq_lengths=lens)
        common = {}  # options cuDNN takes too
        if args.window is not None:
          common["local_window_size"] = (args.window, 0 if causal else args.window)
        ids = None
        if args.docs:
          ids = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) // (T // args.docs), (B, T))
          extra.update(query_segment_ids=ids, key_value_segment_ids=ids)
        keys = jax.random.split(jax.random.key(0), 4)
        q, k, v, do = (jax.random.normal(kk, (B, T, N, D), jnp.bfloat16) for kk in keys)
        mask = MaskSpec(causal=bool(causal), alignment="bottom_right",
                        window_left=args.window,
                        window_right=(None if args.window is None or causal
                                      else args.window))

        def api(impl, q, k, v):
          if impl == "flash3":
            return flash3.dot_product_attention(q, k, v, is_causal=bool(causal),
                                                implementation="mosaic", **extra,
                                                **common)
          cudnn_extra = {n: x for n, x in extra.items() if "segment" not in n}
          return jax.nn.dot_product_attention(q, k, v, is_causal=bool(causal),
                                              implementation="cudnn", **cudnn_extra,
                                              **common)

        def fwd_bwd(impl):
          def run(q, k, v, do):
            _, vjp = jax.vjp(lambda q, k, v: api(impl, q, k, v), q, k, v)
            return vjp(do)
          return jax.jit(run)

        fwd = {i: jax.jit(lambda q, k, v, i=i: api(i, q, k, v)) for i in ("flash3", "cudnn")}
        both = {i: fwd_bwd(i) for i in ("flash3", "cudnn")}
        o, lse = flash3.dot_product_attention(q, k, v, is_causal=bool(causal),
                                              implementation="mosaic",
                                              return_residual=True, **extra, **common)
        lse = lse.transpose(0, 2, 1)  # the API's (B, T, N); the kernel's (B, N, T)
        bwd = jax.jit(lambda q, k, v, o, lse, do: attention_backward(
            q, k, v, o, lse, do, scale=D ** -0.5, mask=mask,
            **({} if lens is None else dict(q_lengths=lens, kv_lengths=lens)),
            **({} if ids is None else dict(q_segment_ids=ids, kv_segment_ids=ids))))
        row = dict(D=D, T=T, B=B, N=N, causal=causal, lengths=args.lengths,
                   docs=args.docs, window=args.window)
        for impl in ("flash3", "cudnn"):
          row[f"{impl}_fwd_ms"] = median_ms(fwd[impl], q, k, v)
          row[f"{impl}_fwd_bwd_ms"] = median_ms(both[impl], q, k, v, do)
        row["kernels_bwd_ms"] = median_ms(bwd, q, k, v, o, lse, do)
        row["flash3_fwd_kernels"] = kernels(fwd["flash3"], q, k, v)
        row["flash3_fwd_bwd_kernels"] = kernels(both["flash3"], q, k, v, do)
        row["kernels_bwd_kernels"] = kernels(bwd, q, k, v, o, lse, do)
        api_bwd = row["flash3_fwd_bwd_ms"] - row["flash3_fwd_ms"]
        cudnn_bwd = row["cudnn_fwd_bwd_ms"] - row["cudnn_fwd_ms"]
        print(f"D={D} T={T} causal={causal}: api fwd {row['flash3_fwd_ms']:.3f} ms, "
              f"api fwd+bwd {row['flash3_fwd_bwd_ms']:.3f} (bwd {api_bwd:.3f}), "
              f"kernels bwd {row['kernels_bwd_ms']:.3f}; cuDNN fwd "
              f"{row['cudnn_fwd_ms']:.3f}, fwd+bwd {row['cudnn_fwd_bwd_ms']:.3f} "
              f"(bwd {cudnn_bwd:.3f})", flush=True)
        for what in ("flash3_fwd_kernels", "flash3_fwd_bwd_kernels", "kernels_bwd_kernels"):
          print(f"  {what}:", flush=True)
          for name, ms in row[what].items():
            print(f"    {ms:8.3f} ms  {name}", flush=True)
        rows.append(row)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "api_kernels.json"), "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
