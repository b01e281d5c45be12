"""Tests of ``ForwardConfig(overlap_softmax=True)``: each warpgroup runs tile t's
softmax while tile t-1's P @ V is in flight (FlashAttention-3, Section 3.2).

Interpret mode runs the same steps one matmul after the other. The results
match the reference and the plain kernel's to rounding: the plain kernel
rescales acc and then adds P_t V_t, where the overlapped one adds P_{t-1}
V_{t-1} and then rescales, which XLA on the CPU may contract into different
FMAs (a few elements differ in the last bit). The GPU path's asynchronous
wgmma is covered by lowering for CUDA here and by the GPU tests.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flash3.kernels.config import ForwardConfig, forward_smem_bytes
from flash3.kernels.forward import attention_forward
from flash3.visibility import MaskSpec

from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from test_forward_kernel import (CAUSAL_BR, CAUSAL_TL, NO_MASK, _packed,
                                 assert_matches, assert_matches_opts, _expand_opts,
                                 make_qkv, run_interpret_opts)

W = MaskSpec


def _cfg(**kw):
  return ForwardConfig(overlap_softmax=True, **kw)


def test_config_and_shared_memory():
  with pytest.raises(ValueError, match="overlap_softmax"):
    ForwardConfig(overlap_softmax=1)
  # One ring slot would deadlock the two warpgroups (found in review: a
  # 128 x 128 non-causal case with 64-key tiles hung in interpret mode).
  with pytest.raises(ValueError, match="num_stages=1"):
    ForwardConfig(overlap_softmax=True, num_stages=1)
  plain = ForwardConfig(block_kv=128)
  # One (64, block_kv) P tile per compute warpgroup, on the GPU path too.
  assert forward_smem_bytes(_cfg(block_kv=128), 128, 2) == (
      forward_smem_bytes(plain, 128, 2) + 2 * 64 * 128 * 2)
  assert forward_smem_bytes(_cfg(block_kv=128), 128, 2, interpret=True) == (
      forward_smem_bytes(plain, 128, 2, interpret=True))
  # P in registers (overlap_p_registers): no P tile on the GPU path; interpret
  # mode still stages it.
  regs = _cfg(block_kv=128, overlap_p_registers=True)
  assert forward_smem_bytes(regs, 128, 2) == forward_smem_bytes(plain, 128, 2)
  assert forward_smem_bytes(regs, 128, 2, interpret=True) == (
      forward_smem_bytes(plain, 128, 2, interpret=True))
  with pytest.raises(ValueError, match="overlap_p_registers"):
    ForwardConfig(overlap_p_registers=1)


CASES = [
    # id, B, Tq, Tk, N, K, D, dtype, mask, config, race detection
    ("causal-br-gqa", 1, 200, 333, 2, 1, 64, jnp.bfloat16, CAUSAL_BR,
     _cfg(block_kv=64), True),
    ("one-tile-ragged", 1, 130, 70, 2, 2, 64, jnp.float16, NO_MASK,
     _cfg(block_kv=64), True),
    ("window-persistent", 1, 200, 260, 2, 1, 64, jnp.bfloat16,
     W(window_left=40, window_right=10), _cfg(block_kv=64, persistent=True, num_sms=2),
     True),
    ("causal-tl-empty-rows", 2, 150, 64, 1, 1, 64, jnp.float16, CAUSAL_TL,
     _cfg(block_kv=64, num_stages=3), True),
    ("d128", 1, 64, 300, 1, 1, 128, jnp.bfloat16, CAUSAL_BR,
     _cfg(block_kv=128, num_stages=2), False),
    # The persistent kernel at D > 64 issues the next item's q in the item's
    # last step: the overlapped steps never did, and the kernel hung on the
    # next item's q (H200, twenty-fifth session; here in interpret mode too).
    ("d128-persistent-window", 1, 512, 512, 2, 2, 128, jnp.bfloat16,
     W(causal=True, window_left=128), _cfg(block_kv=64, persistent=True, num_sms=2),
     True),
    # Both warpgroups own two tiles, two ring slots.
    ("two-tiles-each", 1, 128, 128, 1, 1, 64, jnp.bfloat16, NO_MASK,
     _cfg(block_kv=64, num_stages=2), True),
]


@pytest.mark.interpret
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpret_overlap_matches_reference_and_plain_kernel(case):
  _, B, Tq, Tk, N, K, D, dtype, mask, config, races = case
  q, k, v = make_qkv(jax.random.key(Tq + 3 * Tk), B, Tq, Tk, N, K, D, dtype)
  o, lse = run_interpret_opts(q, k, v, scale=D ** -0.5, mask=mask, config=config,
                              detect_races=races)
  if races:
    assert not interpret_pallas_call.get_races().races_found
  assert_matches(o, lse, q, k, v, scale=D ** -0.5, mask=mask)
  o1, lse1 = run_interpret_opts(
      q, k, v, scale=D ** -0.5, mask=mask,
      config=dataclasses.replace(config, overlap_softmax=False))
  # A last-bit difference at most (one float16/bfloat16 ulp of the output).
  np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o1, np.float32),
                             rtol=2 ** -7, atol=1e-6)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse1), rtol=1e-6, atol=1e-6)


@pytest.mark.interpret
def test_interpret_overlap_with_options():
  opts = _expand_opts(dict(softcap=5.0, sinks=[0.5, -1.0], q_lengths=[100, 130],
                           kv_lengths=[150, 31]), 130, 200)
  q, k, v = make_qkv(jax.random.key(3), 2, 130, 200, 2, 2, 64, jnp.float16)
  o, lse = run_interpret_opts(q, k, v, scale=0.5, mask=CAUSAL_BR,
                              config=_cfg(block_kv=64), detect_races=True, **opts)
  assert not interpret_pallas_call.get_races().races_found
  assert_matches_opts(o, lse, q, k, v, scale=0.5, mask=CAUSAL_BR, **opts)


@pytest.mark.parametrize("D, config", [
    (64, _cfg(block_kv=128, num_stages=4)),
    (128, _cfg(block_kv=128, num_stages=2)),
    (256, _cfg(block_kv=64, num_stages=2)),
    (128, _cfg(block_kv=128, num_stages=2, persistent=True)),
    (128, _cfg(block_kv=128, num_stages=2, overlap_p_registers=True)),
    (256, _cfg(block_kv=64, num_stages=2, overlap_p_registers=True, persistent=True)),
])
def test_overlap_lowers_for_the_gpu(D, config):
  q, k, v = make_qkv(jax.random.key(0), 2, 300, 333, 4, 2, D, jnp.bfloat16)
  ids = _packed([[50, 250], [300]], 300), _packed([[80, 253], [333]], 333)
  f = lambda q, k, v: attention_forward(
      q, k, v, scale=0.1, mask=CAUSAL_BR, config=config, softcap=5.0,
      q_segment_ids=ids[0], kv_segment_ids=ids[1])
  text = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


GPU_CASES = [
    # B, Tq, Tk, N, K, D, dtype, mask, block_kv, num_stages, persistent
    (2, 4096, 4096, 16, 16, 128, jnp.bfloat16, CAUSAL_BR, 128, 2, False),
    (1, 1023, 1024, 8, 2, 128, jnp.float16, NO_MASK, 128, 2, False),
    (3, 777, 2049, 4, 1, 64, jnp.bfloat16, CAUSAL_TL, 128, 4, False),
    (2, 1000, 1100, 8, 8, 256, jnp.bfloat16, CAUSAL_BR, 64, 2, False),
    (1, 4096, 4096, 16, 16, 128, jnp.bfloat16, W(causal=True, window_left=1024), 128, 2,
     True),
    (1, 300, 5, 4, 4, 64, jnp.float16, NO_MASK, 128, 2, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("p_registers", [False, True], ids=["p-smem", "p-registers"])
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_overlap_matches_reference(case, p_registers):
  B, Tq, Tk, N, K, D, dtype, mask, bk, st, persistent = case
  q, k, v = make_qkv(jax.random.key(Tq + Tk + D), B, Tq, Tk, N, K, D, dtype)
  config = _cfg(block_kv=bk, num_stages=st, persistent=persistent,
                overlap_p_registers=p_registers)
  o, lse = attention_forward(q, k, v, scale=D ** -0.5, mask=mask, config=config)
  if B * Tq * Tk * N <= 2 * 1024 * 1024 * 8:
    assert_matches(o, lse, q, k, v, scale=D ** -0.5, mask=mask)
  else:  # Keep the float32 reference small: one batch row and head.
    sl = (slice(0, 1), slice(None), slice(0, 1))
    assert_matches(o[sl], lse[:1, :1], q[sl], k[sl[:2] + (slice(0, 1),)],
                   v[sl[:2] + (slice(0, 1),)], scale=D ** -0.5, mask=mask)
  if p_registers:
    # The same P values reach the same wgmmas: bitwise the shared-memory form.
    o1, lse1 = attention_forward(q, k, v, scale=D ** -0.5, mask=mask, config=dataclasses.replace(
        config, overlap_p_registers=False))
    assert bool(jnp.all(o == o1)), "o differs from P through shared memory"
    assert bool(jnp.all(lse == lse1)), "lse differs from P through shared memory"
