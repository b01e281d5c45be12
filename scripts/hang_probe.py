"""Runs forward kernel cases one per subprocess with a timeout: which ones hang?

A diagnostic for kernel synchronisation changes (not a test): each case runs
in its own process (``--case i``) so a hung kernel costs only its timeout.

  PYTHONPATH=src python3 scripts/hang_probe.py --jobs 6 --timeout 90
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import subprocess
import sys
import time

# name, (B, Tq, Tk, N, K, D), mask kwargs, config kwargs
CASES = [
    ("grid-none-d128", (1, 1023, 1024, 8, 2, 128), {}, dict(block_kv=128)),
    ("grid-none-d128-overlap", (1, 1023, 1024, 8, 2, 128), {}, dict(block_kv=128, overlap_softmax=True)),
    ("grid-causal-d256", (2, 1000, 1100, 8, 8, 256), dict(causal=True), dict(block_kv=64)),
    ("grid-causal-tl-d64", (3, 777, 2049, 4, 1, 64), dict(causal=True, alignment="top_left"), dict(block_kv=128, num_stages=4)),
    ("grid-tiny-tk", (1, 300, 5, 4, 4, 64), {}, dict(block_kv=128)),
    ("pers-tiny-tk-7", (1, 300, 5, 4, 4, 64), {}, dict(block_kv=128, persistent=True, num_sms=7)),
    ("pers-none-d128-7", (1, 1000, 1100, 8, 2, 128), {}, dict(block_kv=128, persistent=True, num_sms=7)),
    ("pers-causal-d128-7", (1, 2048, 2048, 8, 2, 128), dict(causal=True), dict(block_kv=128, persistent=True, num_sms=7)),
    ("pers-causal-d128-132", (1, 2048, 2048, 8, 2, 128), dict(causal=True), dict(block_kv=128, persistent=True, num_sms=132)),
    ("pers-window-d128-7", (1, 4096, 4096, 16, 16, 128), dict(causal=True, window_left=1024), dict(block_kv=128, persistent=True, num_sms=7)),
    ("pers-d256-7", (2, 1023, 1024, 8, 8, 256), {}, dict(block_kv=64, persistent=True, num_sms=7)),
    ("pers-d64-s3-7", (2, 4096, 4096, 32, 8, 64), {}, dict(block_kv=256, num_stages=3, persistent=True, num_sms=7)),
]


def run_case(i: int, named: bool) -> str:
  import jax
  import jax.numpy as jnp
  from flash3.kernels.config import ForwardConfig
  from flash3.kernels.forward import attention_forward
  from flash3.visibility import MaskSpec
  name, (B, Tq, Tk, N, K, D), mkw, ckw = CASES[i]
  ks = jax.random.split(jax.random.key(i), 3)
  q = jax.random.normal(ks[0], (B, Tq, N, D), jnp.bfloat16)
  k = jax.random.normal(ks[1], (B, Tk, K, D), jnp.bfloat16)
  v = jax.random.normal(ks[2], (B, Tk, K, D), jnp.bfloat16)
  mkw = dict(mkw)
  if "alignment" not in mkw:
    mkw["alignment"] = "bottom_right"
  cfg = ForwardConfig(named_barriers=named, **ckw)
  o, lse = attention_forward(q, k, v, scale=D ** -0.5, mask=MaskSpec(**mkw), config=cfg)
  o.block_until_ready()
  return f"finite={bool(jnp.isfinite(o.astype(jnp.float32)).all())}"


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--case", type=int)
  ap.add_argument("--named", type=int, default=1)
  ap.add_argument("--jobs", type=int, default=6)
  ap.add_argument("--timeout", type=float, default=90)
  args = ap.parse_args()
  if args.case is not None:
    print(run_case(args.case, bool(args.named)), flush=True)
    return 0
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")

  def one(job):
    i, named = job
    t = time.time()
    try:
      r = subprocess.run([sys.executable, __file__, "--case", str(i), "--named", str(named)],
                         capture_output=True, text=True, timeout=args.timeout, env=env)
      out = (r.stdout.strip().splitlines() or [""])[-1] if r.returncode == 0 else \
          f"rc={r.returncode} {r.stderr.strip()[-300:]}"
    except subprocess.TimeoutExpired:
      out = "TIMEOUT (hang?)"
    return f"{CASES[i][0]:28s} named={named}: {out} ({time.time() - t:.0f} s)"

  jobs = [(i, n) for n in (1, 0) for i in range(len(CASES))]
  with cf.ThreadPoolExecutor(args.jobs) as ex:
    for line in ex.map(one, jobs):
      print(line, flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
