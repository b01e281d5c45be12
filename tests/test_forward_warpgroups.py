"""Three compute warpgroups in the forward (``ForwardConfig.compute_warpgroups=3``).

FlashAttention-3's head_dim 64 forward runs three compute warpgroups (192
query rows per CTA) whose turns on the tensor cores go round all three. Each
warpgroup's rows see the same key tiles, masked the same way, in the same
order as with two, so the output is bitwise the two-warpgroup kernel's; the
tests check that, the reference, races (interpret mode), the order of the
turns, and the GPU lowering.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flash3.kernels import sync
from flash3.kernels.config import ForwardConfig
from flash3.kernels.forward import attention_forward
from flash3.visibility import MaskSpec

from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from test_forward_kernel import (CAUSAL_BR, CAUSAL_TL, NO_MASK, _expand_opts,
                                 case_inputs,
                                 assert_matches, assert_matches_opts, make_qkv,
                                 run_interpret_opts)

W = MaskSpec
# What three warpgroups need besides the field: registers that fit 4 x 128
# threads, and the round-robin turns.
THREE = dict(compute_warpgroups=3, compute_registers=160, producer_registers=24,
             pingpong="handoff")


# ----------------------------------------------------------------------------
# Config and barrier ids (CPU, fast)
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("value", [1, 4, True, 2.0])
def test_config_rejects_other_warpgroup_counts(value):
  with pytest.raises(ValueError, match="compute_warpgroups"):
    ForwardConfig(**{**THREE, "compute_warpgroups": value})


def test_three_warpgroups_need_round_robin_turns_and_fewer_registers():
  with pytest.raises(ValueError, match="pingpong"):
    ForwardConfig(**{**THREE, "pingpong": "meeting"})
  # The default 232 registers per compute thread overflow 64K with three.
  with pytest.raises(ValueError, match="3 compute warpgroups"):
    ForwardConfig(compute_warpgroups=3, pingpong="handoff")
  ForwardConfig(**{**THREE, "pingpong": "off"})
  ForwardConfig(**{**THREE, "compute_registers": 160, "producer_registers": 24})


def test_named_barrier_ids_leave_room_for_the_turns():
  # Mosaic GPU takes ids 0 .. warpgroups (producer included); then one turn
  # id per compute warpgroup, then two ids per ring slot, of 16.
  assert sync.first_turn_id(2) == sync.FIRST_ID == 4
  assert sync.max_ring_slots(2) == sync.MAX_RING_SLOTS == 5
  assert sync.release_first_ids(5, 2) == (6, 11)
  assert sync.first_turn_id(3) == 5
  assert sync.max_ring_slots(3) == 4
  k0, v0 = sync.release_first_ids(4, 3)
  assert (k0, v0) == (8, 12) and v0 + 4 <= sync.NUM_IDS


# ----------------------------------------------------------------------------
# Interpret mode: bitwise the two-warpgroup kernel, race-free
# ----------------------------------------------------------------------------

CASES = [
    # id, B, Tq, Tk, N, K, D, mask, config fields (both kernels), options
    ("grid", 1, 250, 300, 2, 1, 64, NO_MASK, dict(block_kv=64), {}),
    # Tq of 1.5 CTAs of 192 rows: the last CTA's third warpgroup has no row.
    ("grid-causal-tail", 2, 300, 300, 2, 2, 64, CAUSAL_BR,
     dict(block_kv=128, half_edge_tiles=True, reverse_q_tiles=True), {}),
    ("persistent-causal", 1, 400, 333, 4, 2, 64, CAUSAL_TL,
     dict(persistent=True, num_sms=3, block_kv=64), {}),
    ("persistent-window-1-stage", 1, 384, 200, 2, 1, 64,
     W(window_left=40, window_right=10), dict(persistent=True, num_sms=2, num_stages=1),
     {}),
    ("persistent-segments", 1, 384, 384, 2, 1, 64, CAUSAL_BR,
     dict(persistent=True, num_sms=2),
     dict(segments=([[100, 60, 224]], [[100, 60, 224]]))),
    ("grid-segments-lengths-sinks-softcap", 2, 256, 300, 2, 1, 64, CAUSAL_BR, {},
     dict(q_lengths=[256, 70], kv_lengths=[300, 90], sinks=[0.5, -1.0], softcap=5.0,
          segments=([[128, 128], [256]], [[150, 150], [300]]))),
    ("defer", 1, 256, 300, 2, 1, 64, CAUSAL_BR,
     dict(persistent=True, num_sms=2, defer_epilogue=True), {}),
    ("fused", 1, 256, 300, 2, 1, 64, CAUSAL_BR, dict(fuse_pv_qk=True), {}),
    ("persistent-overlap", 1, 300, 260, 2, 1, 64, CAUSAL_BR,
     dict(persistent=True, num_sms=2, overlap_softmax=True), {}),
    ("turns-off-d128", 1, 200, 256, 2, 1, 128, NO_MASK,
     dict(block_kv=128, pingpong="off"), {}),
    # One query and one key, 7 query heads per kv head: two idle warpgroups.
    ("tiny-gqa7", 1, 1, 1, 7, 1, 64, CAUSAL_BR, dict(persistent=True, num_sms=3), {}),
    # head_dim 96 runs padded to 128.
    ("d96-ragged", 1, 130, 77, 2, 1, 96, CAUSAL_TL, dict(block_kv=64), {}),
]


@pytest.mark.interpret
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpret_three_warpgroups_are_bitwise_two(case):
  q, k, v, mask, fields, opts, scale = case_inputs(case, 5)
  fields = {"pingpong": "handoff", **fields}
  two = ForwardConfig(**fields)
  three = dataclasses.replace(two, **{**THREE, "pingpong": fields["pingpong"]})
  o, lse = run_interpret_opts(q, k, v, scale=scale, mask=mask, config=three,
                              detect_races=True, **opts)
  assert not interpret_pallas_call.get_races().races_found
  assert_matches_opts(o, lse, q, k, v, scale=scale, mask=mask, **opts)
  o2, lse2 = run_interpret_opts(q, k, v, scale=scale, mask=mask, config=two, **opts)
  np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o2, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse2))


# ----------------------------------------------------------------------------
# Lowering for the GPU (on the CPU)
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("D,mask,fields", [
    (64, NO_MASK, dict(block_kv=128)),
    (64, CAUSAL_BR, dict(block_kv=128, half_edge_tiles=True, persistent=True,
                         reverse_q_tiles=True)),
    (64, W(causal=True, window_left=300), dict(block_kv=128, num_stages=4,
                                               persistent=True, defer_epilogue=True)),
    (128, NO_MASK, dict(block_kv=128)),
])
def test_three_warpgroups_lower_for_the_gpu(D, mask, fields):
  q, k, v = make_qkv(jax.random.key(0), 2, 1000, 1100, 4, 2, D, jnp.bfloat16)
  config = ForwardConfig(num_sms=132, **THREE, **fields)
  f = lambda q, k, v: attention_forward(q, k, v, scale=0.1, mask=mask, config=config)
  text = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


# ----------------------------------------------------------------------------
# GPU (H100/H200)
# ----------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("mask,T,persistent", [
    (NO_MASK, 512, True), (NO_MASK, 4096, False), (CAUSAL_BR, 1000, True),
    (CAUSAL_BR, 4096, True), (W(causal=True, window_left=1024), 4096, True)],
    ids=["none-512-persistent", "none-4096-grid", "causal-1000", "causal-4096",
         "window-4096"])
def test_gpu_three_warpgroups_match_two(mask, T, persistent):
  B, N, K, D = 2, 8, 2, 64
  q, k, v = make_qkv(jax.random.key(T), B, T, T, N, K, D, jnp.bfloat16)
  two = ForwardConfig(block_kv=128, persistent=persistent, pingpong="handoff",
                      reverse_q_tiles=mask.causal, half_edge_tiles=mask.causal)
  three = dataclasses.replace(two, **THREE)
  o, lse = attention_forward(q, k, v, scale=D ** -0.5, mask=mask, config=three)
  o2, lse2 = attention_forward(q, k, v, scale=D ** -0.5, mask=mask, config=two)
  assert bool(jnp.all(o == o2)), "o differs from two warpgroups"
  assert bool(jnp.all(lse == lse2)), "lse differs from two warpgroups"
  sl = (slice(0, 1), slice(None), slice(0, 2))
  assert_matches(o[sl], lse[:1, :2], q[sl], k[sl[:2] + (slice(0, 1),)],
                 v[sl[:2] + (slice(0, 1),)], scale=D ** -0.5, mask=mask)
