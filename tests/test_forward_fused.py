"""Tests of ``ForwardConfig(fuse_pv_qk=True)``: each warpgroup issues tile t's
P @ V and tile t+1's Q K^T back to back and waits once.

The arithmetic is the plain kernel's, in the same order (softmax of tile t,
rescale, P_t V_t, then the scores of tile t+1), so the results are bitwise
equal to the plain kernel's with the same tiles, in interpret mode here and
on the GPU. Interpret mode runs the two matmuls one after the other; the GPU
path's back-to-back wgmmas are covered by lowering for CUDA
(tests/test_cuda_lowering.py) and by the GPU tests below.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flash3.kernels.config import ForwardConfig
from flash3.kernels.forward import attention_forward
from flash3.visibility import MaskSpec

from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from test_forward_kernel import (CAUSAL_BR, CAUSAL_TL, NO_MASK, _expand_opts,
                                 assert_matches, assert_matches_opts, make_qkv,
                                 run_interpret_opts)

W = MaskSpec


def _cfg(**kw):
  return ForwardConfig(fuse_pv_qk=True, **kw)


def _plain(config):
  return dataclasses.replace(config, fuse_pv_qk=False)


def assert_bitwise(a, b):
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize("kw", [dict(overlap_softmax=True),
                                dict(half_edge_tiles=True)])
def test_config_rejects_what_it_cannot_combine_with(kw):
  with pytest.raises(ValueError, match="fuse_pv_qk=True needs"):
    ForwardConfig(fuse_pv_qk=True, **kw)
  with pytest.raises(ValueError, match="fuse_pv_qk"):
    ForwardConfig(fuse_pv_qk=1)


CASES = [
    # id, B, Tq, Tk, N, K, D, dtype, mask, config, race detection
    ("causal-br-gqa", 1, 200, 333, 2, 1, 64, jnp.bfloat16, CAUSAL_BR,
     _cfg(block_kv=64), True),
    # One key tile: the first Q K^T, then P @ V alone.
    ("one-tile-ragged", 1, 130, 70, 2, 2, 64, jnp.float16, NO_MASK,
     _cfg(block_kv=128), True),
    ("window-persistent", 1, 200, 260, 2, 1, 64, jnp.bfloat16,
     W(window_left=40, window_right=10),
     _cfg(block_kv=64, persistent=True, num_sms=2), True),
    # Rows past Tk's reach (top-left) see nothing; a one-slot ring.
    ("causal-tl-empty-rows", 2, 150, 64, 1, 1, 64, jnp.float16, CAUSAL_TL,
     _cfg(block_kv=64, num_stages=1), True),
    ("d128-persistent", 1, 200, 300, 2, 2, 128, jnp.bfloat16, CAUSAL_BR,
     _cfg(block_kv=128, persistent=True, num_sms=1), False),
    ("three-stages", 1, 128, 400, 1, 1, 64, jnp.bfloat16, NO_MASK,
     _cfg(block_kv=64, num_stages=3), True),
]


@pytest.mark.interpret
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpret_fused_matches_reference_and_plain_kernel(case):
  _, B, Tq, Tk, N, K, D, dtype, mask, config, races = case
  q, k, v = make_qkv(jax.random.key(Tq + 5 * Tk), B, Tq, Tk, N, K, D, dtype)
  out = run_interpret_opts(q, k, v, scale=D ** -0.5, mask=mask, config=config,
                           detect_races=races)
  if races:
    assert not interpret_pallas_call.get_races().races_found
  assert_matches(*out, q, k, v, scale=D ** -0.5, mask=mask)
  plain = run_interpret_opts(q, k, v, scale=D ** -0.5, mask=mask, config=_plain(config))
  assert_bitwise(out, plain)


@pytest.mark.interpret
def test_interpret_fused_with_options():
  opts = _expand_opts(dict(softcap=5.0, sinks=[0.5, -1.0], q_lengths=[100, 130],
                           kv_lengths=[150, 31],
                           segments=([[60, 70]], [[90, 110]])), 130, 200)
  opts["q_segment_ids"] = jnp.concatenate([opts["q_segment_ids"]] * 2)
  opts["kv_segment_ids"] = jnp.concatenate([opts["kv_segment_ids"]] * 2)
  q, k, v = make_qkv(jax.random.key(7), 2, 130, 200, 2, 2, 64, jnp.float16)
  config = _cfg(block_kv=64)
  out = run_interpret_opts(q, k, v, scale=0.5, mask=CAUSAL_BR, config=config,
                           detect_races=True, **opts)
  assert not interpret_pallas_call.get_races().races_found
  assert_matches_opts(*out, q, k, v, scale=0.5, mask=CAUSAL_BR, **opts)
  assert_bitwise(out, run_interpret_opts(q, k, v, scale=0.5, mask=CAUSAL_BR,
                                         config=_plain(config), **opts))


GPU_CASES = [
    # B, Tq, Tk, N, K, D, dtype, mask, block_kv, num_stages, persistent
    (2, 4096, 4096, 16, 16, 128, jnp.bfloat16, NO_MASK, 128, 2, False),
    (1, 1023, 1024, 8, 2, 128, jnp.float16, CAUSAL_BR, 128, 2, False),
    (3, 777, 2049, 4, 1, 64, jnp.bfloat16, CAUSAL_TL, 256, 2, True),
    (2, 1000, 1100, 8, 8, 256, jnp.bfloat16, CAUSAL_BR, 64, 2, False),
    (8, 1024, 1024, 8, 4, 256, jnp.float16, NO_MASK, 64, 2, True),
    (1, 4096, 4096, 16, 16, 128, jnp.bfloat16, W(causal=True, window_left=1024), 128, 2,
     True),
    (1, 300, 5, 4, 4, 64, jnp.float16, NO_MASK, 128, 2, True),
    (4, 512, 512, 16, 16, 128, jnp.bfloat16, NO_MASK, 128, 2, True),
    (1, 2048, 2048, 8, 8, 128, jnp.float16, NO_MASK, 192, 2, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_fused_matches_reference_and_plain_kernel(case):
  B, Tq, Tk, N, K, D, dtype, mask, bk, st, persistent = case
  q, k, v = make_qkv(jax.random.key(Tq + Tk + D), B, Tq, Tk, N, K, D, dtype)
  config = _cfg(block_kv=bk, num_stages=st, persistent=persistent)
  o, lse = attention_forward(q, k, v, scale=D ** -0.5, mask=mask, config=config)
  sl = (slice(0, 1), slice(None), slice(0, 1))
  assert_matches(o[sl], lse[:1, :1], q[sl], k[sl[:2] + (slice(0, 1),)],
                 v[sl[:2] + (slice(0, 1),)], scale=D ** -0.5, mask=mask)
  assert_bitwise((o, lse), attention_forward(q, k, v, scale=D ** -0.5, mask=mask,
                                             config=_plain(config)))
