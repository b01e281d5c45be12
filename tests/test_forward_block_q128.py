"""``ForwardConfig.block_q=128``: 128 query rows per compute warpgroup (two
wgmma M tiles per matmul) for head_dim <= 64.

Config errors; the kernel in interpret mode (with race detection) against the
float32 reference over masks, options and ragged shapes; the lowering for the
GPU on the CPU; and on an H100/H200 against the reference.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from flash3.kernels.config import ForwardConfig
from flash3.kernels.forward import attention_forward
from flash3.visibility import MaskSpec

from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from test_forward_kernel import (CAUSAL_BR, CAUSAL_TL, NO_MASK, _expand_opts,
                                 assert_matches_opts, make_qkv, run_interpret_opts)

W = MaskSpec

# The A/B candidate: 64-key tiles (no spill offline at D = 64).
BQ128 = dict(block_q=128, block_kv=64, num_stages=2)


@pytest.mark.parametrize("kw, match", [
    (dict(block_q=32), "block_q=32"),
    (dict(block_q=128.0), "block_q=128.0"),
    (dict(block_q=128, compute_warpgroups=3, compute_registers=160,
          producer_registers=24, pingpong="handoff"), "compute_warpgroups=2"),
])
def test_config_rejects_block_q(kw, match):
  with pytest.raises(ValueError, match=match):
    ForwardConfig(**kw)


def test_block_q128_needs_head_dim_64_before_tracing():
  q, k, v = make_qkv(jax.random.key(0), 1, 256, 256, 2, 1, 128, jnp.bfloat16)
  with pytest.raises(ValueError, match="block_q=128 needs head_dim <= 64"):
    attention_forward(q, k, v, scale=0.1, mask=NO_MASK,
                      config=ForwardConfig(**BQ128))


INTERPRET_CASES = [
    # id, B, Tq, Tk, N, K, D, dtype, mask, fields, options
    ("causal-br-ragged", 1, 600, 600, 2, 1, 64, jnp.bfloat16, CAUSAL_BR,
     dict(reverse_q_tiles=True), {}),
    ("no-mask-persistent-gqa", 2, 300, 520, 4, 2, 64, jnp.float16, NO_MASK,
     dict(persistent=True, num_sms=2), {}),
    ("causal-tl-options", 2, 280, 200, 2, 1, 64, jnp.bfloat16, CAUSAL_TL, {},
     dict(q_lengths=[280, 97], kv_lengths=[200, 130], softcap=20.0, sinks=[0.5, -1.0])),
    ("window-documents", 1, 512, 512, 2, 1, 64, jnp.bfloat16,
     W(causal=True, window_left=150), dict(persistent=True, num_sms=2),
     dict(segments=([[100, 300, 112]], [[100, 300, 112]]))),
    ("head-dim-40-tq-1", 1, 1, 333, 3, 1, 40, jnp.bfloat16, CAUSAL_BR, {}, {}),
    ("128-key-tiles-overlap", 1, 384, 384, 2, 2, 64, jnp.bfloat16, CAUSAL_BR,
     dict(block_kv=128, overlap_softmax=True, persistent=True, num_sms=2), {}),
]


@pytest.mark.interpret
@pytest.mark.parametrize("case", INTERPRET_CASES, ids=[c[0] for c in INTERPRET_CASES])
def test_interpret_block_q128_matches_reference_no_races(case):
  _, B, Tq, Tk, N, K, D, dtype, mask, fields, opts = case
  opts = _expand_opts(opts, Tq, Tk)
  q, k, v = make_qkv(jax.random.key(Tq + 5 * Tk + D), B, Tq, Tk, N, K, D, dtype)
  scale = D ** -0.5 * (4.0 if "softcap" in opts else 1.0)
  config = ForwardConfig(**dict(BQ128, **fields))
  o, lse = run_interpret_opts(q, k, v, scale=scale, mask=mask, config=config,
                              detect_races=True, **opts)
  assert not interpret_pallas_call.get_races().races_found
  assert_matches_opts(o, lse, q, k, v, scale=scale, mask=mask, **opts)


@pytest.mark.parametrize("mask, fields", [
    (CAUSAL_BR, {}), (NO_MASK, dict(persistent=True)),
    (W(causal=True, window_left=300), dict(pingpong="handoff")),
    (NO_MASK, dict(block_kv=128, compute_registers=240, producer_registers=24))])
def test_block_q128_lowers_for_the_gpu(mask, fields):
  q, k, v = make_qkv(jax.random.key(0), 2, 1000, 1000, 4, 2, 64, jnp.bfloat16)
  config = ForwardConfig(**dict(BQ128, **fields))
  f = lambda q, k, v: attention_forward(q, k, v, scale=0.1, mask=mask, config=config)
  text = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


GPU_CASES = [
    # B, Tq, Tk, N, K, D, dtype, mask, fields
    (32, 512, 512, 32, 32, 64, jnp.bfloat16, CAUSAL_BR, dict(persistent=True)),
    (16, 1024, 1024, 32, 8, 64, jnp.float16, NO_MASK, dict(persistent=True)),
    (2, 4096, 4096, 8, 8, 64, jnp.bfloat16, CAUSAL_BR, dict(reverse_q_tiles=True)),
    (2, 777, 1025, 4, 1, 64, jnp.bfloat16, W(causal=True, window_left=300), {}),
    (1, 2048, 2048, 8, 2, 64, jnp.bfloat16, NO_MASK,
     dict(block_kv=128, compute_registers=240, producer_registers=24)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"B{c[0]}-T{c[1]}x{c[2]}-{c[7]}")
def test_gpu_block_q128_matches_reference(case):
  B, Tq, Tk, N, K, D, dtype, mask, fields = case
  q, k, v = make_qkv(jax.random.key(Tq + Tk + B), B, Tq, Tk, N, K, D, dtype)
  config = ForwardConfig(**dict(BQ128, **fields))
  o, lse = attention_forward(q, k, v, scale=D ** -0.5, mask=mask, config=config)
  # The reference on two batch rows (it is float32 and dense).
  o, lse, q, k, v = o[:2], lse[:2], q[:2], k[:2], v[:2]
  assert_matches_opts(o, lse, q, k, v, scale=D ** -0.5, mask=mask)


@pytest.mark.gpu
def test_gpu_block_q128_with_options():
  B, T, D = 2, 1500, 64
  mask = W(causal=True, window_left=400)
  q, k, v = make_qkv(jax.random.key(9), B, T, T, 4, 2, D, jnp.bfloat16)
  opts = _expand_opts(dict(segments=([[20, 900, 580], [700, 800]],) * 2, softcap=30.0,
                           q_lengths=[1500, 1100], kv_lengths=[1500, 1300],
                           sinks=[0.1, 0.2, -0.3, 1.0]), T, T)
  config = dataclasses.replace(ForwardConfig(**BQ128), persistent=True)
  o, lse = attention_forward(q, k, v, scale=D ** -0.5 * 4, mask=mask, config=config,
                             **opts)
  assert_matches_opts(o, lse, q, k, v, scale=D ** -0.5 * 4, mask=mask, **opts)
