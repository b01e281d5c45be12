"""Tests of the persistent forward kernel (``ForwardConfig(persistent=True)``).

The persistent kernel launches ``min(num_sms, work items)`` CTAs that loop over
work items (head, query tile, batch) with the K/V ring running on across
items. Interpret-mode tests force a small ``num_sms`` so every CTA does several
items, and check against the reference, for races, and bitwise against the
one-item-per-CTA kernel (the per-item math is the same instructions). The
output staging is tested both ways: apart from q (``separate o``) and in the
q tile (``o in q``), see ``forward.PERSISTENT_SEPARATE_O``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flash3.kernels import forward as fw
from flash3.kernels.config import (ForwardConfig, SMEM_LIMIT_BYTES, check_fits,
                                   forward_config, forward_smem_bytes,
                                   persistent_separate_o)
from flash3.kernels.forward import attention_forward
from flash3.visibility import MaskSpec

from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from test_forward_kernel import (CAUSAL_BR, CAUSAL_TL, NO_MASK, _expand_opts, _opts,
                                 case_inputs,
                                 _packed, assert_matches, assert_matches_opts,
                                 make_qkv, run_interpret_opts)

W = MaskSpec


def _cfg(block_kv=64, num_stages=2, num_sms=3, **kw):
  return ForwardConfig(block_kv=block_kv, num_stages=num_stages,
                       persistent=True, num_sms=num_sms, **kw)


def _run(q, k, v, *, mask, config, separate_o, detect_races=True, scale=None,
         **opts):
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  old = fw.PERSISTENT_SEPARATE_O
  fw.PERSISTENT_SEPARATE_O = separate_o
  try:
    return run_interpret_opts(q, k, v, scale=scale, mask=mask, config=config,
                              detect_races=detect_races, **opts)
  finally:
    fw.PERSISTENT_SEPARATE_O = old


# ----------------------------------------------------------------------------
# Config (CPU, fast)
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("persistent", 1), ("num_sms", 0),
                                         ("num_sms", 1.5), ("num_sms", 5000)])
def test_config_rejects_bad_persistent_fields(field, value):
  with pytest.raises(ValueError, match=field):
    ForwardConfig(**{field: value})


def test_separate_o_only_when_it_fits():
  # D=128, 128-key tiles, 2 stages: 160 KiB + 32 KiB more for o fits on the GPU.
  c = _cfg(block_kv=128, num_stages=2)
  assert persistent_separate_o(c, 128, 2)
  assert forward_smem_bytes(c, 128, 2) + 2 * 64 * 128 * 2 <= SMEM_LIMIT_BYTES
  # D=128 with 3 stages, or D=256, leave no room: o is staged in the q tile.
  assert not persistent_separate_o(_cfg(block_kv=128, num_stages=3), 128, 2)
  assert not persistent_separate_o(_cfg(block_kv=64, num_stages=2), 256, 2)


# ----------------------------------------------------------------------------
# Interpret mode: several work items per CTA
# ----------------------------------------------------------------------------

PERSISTENT_CASES = [
    # id, B, Tq, Tk, N, K, D, dtype, mask, config, separate_o
    ("gqa-ragged", 2, 200, 333, 4, 2, 64, jnp.bfloat16, NO_MASK, _cfg(), None),
    ("gqa-ragged-o-in-q", 2, 200, 333, 4, 2, 64, jnp.float16, NO_MASK, _cfg(), False),
    ("d128-f16", 1, 130, 250, 2, 1, 128, jnp.float16, NO_MASK,
     _cfg(block_kv=128, num_sms=2), True),
    ("d128-bf16-o-in-q", 1, 130, 250, 2, 1, 128, jnp.bfloat16, NO_MASK,
     _cfg(block_kv=128, num_sms=2), False),
    ("3-stages", 1, 250, 520, 3, 1, 64, jnp.bfloat16, NO_MASK,
     _cfg(num_stages=3, num_sms=2), None),
    ("1-stage", 2, 64, 200, 2, 2, 64, jnp.float16, NO_MASK,
     _cfg(num_stages=1, num_sms=2), None),
    ("one-key-tile", 3, 100, 8, 2, 1, 64, jnp.bfloat16, NO_MASK, _cfg(num_sms=2), None),
    ("d96-padded", 1, 129, 100, 3, 3, 96, jnp.float16, NO_MASK, _cfg(num_sms=2), None),
    ("causal-br-reverse", 1, 330, 333, 2, 1, 64, jnp.bfloat16, CAUSAL_BR,
     _cfg(reverse_q_tiles=True), None),
    ("causal-tl", 2, 200, 130, 1, 1, 64, jnp.float16, CAUSAL_TL, _cfg(num_sms=2), False),
    # Items of unequal cost (the first query tiles see fewer keys): LPT order.
    ("causal-window", 1, 330, 400, 2, 1, 64, jnp.bfloat16,
     W(causal=True, window_left=70, alignment="bottom_right"), _cfg(), None),
    # Rows >= 100 see nothing: items with no key tile at all in between.
    ("empty-items", 1, 384, 100, 2, 1, 64, jnp.bfloat16,
     W(window_left=0, window_right=0), _cfg(num_sms=2), None),
]


@pytest.mark.interpret
@pytest.mark.parametrize("case", PERSISTENT_CASES, ids=[c[0] for c in PERSISTENT_CASES])
def test_interpret_persistent_matches_reference_no_races(case):
  _, B, Tq, Tk, N, K, D, dtype, mask, config, separate_o = case
  q, k, v = make_qkv(jax.random.key(Tq * 7 + Tk), B, Tq, Tk, N, K, D, dtype)
  items = N * B * -(-Tq // 128)
  assert items >= 2 * min(config.num_sms, items), "want several items per CTA"
  o, lse = _run(q, k, v, mask=mask, config=config, separate_o=separate_o)
  assert not interpret_pallas_call.get_races().races_found
  assert o.shape == q.shape and lse.shape == (B, N, Tq)
  assert_matches(o, lse, q, k, v, scale=D ** -0.5, mask=mask)
  # Same per-item instructions as the one-item-per-CTA kernel: same bits.
  o1, lse1 = run_interpret_opts(q, k, v, scale=D ** -0.5, mask=mask,
                                config=dataclasses.replace(config, persistent=False))
  np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o1, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse1))


PERSISTENT_OPTION_CASES = [
    # id, B, Tq, Tk, N, K, D, dtype, mask, options
    ("len", 3, 150, 200, 2, 1, 64, jnp.bfloat16, NO_MASK,
     dict(q_lengths=[150, 37, 0], kv_lengths=[101, 200, 5])),
    ("cap-sinks-len-br", 2, 130, 200, 2, 2, 64, jnp.float16, CAUSAL_BR,
     dict(softcap=5.0, sinks=[0.5, -1.0], q_lengths=[100, 130], kv_lengths=[150, 31])),
    ("segments", 2, 200, 260, 2, 1, 64, jnp.bfloat16, NO_MASK,
     dict(segments=([[50, 150], [200]], [[80, 100, 80], [260]]))),
    # Items of unequal cost by their documents: the table built on the device.
    ("segments-causal", 2, 300, 300, 2, 1, 64, jnp.bfloat16, CAUSAL_BR,
     dict(segments=([[20, 200, 80], [300]], [[20, 200, 80], [300]]))),
]


@pytest.mark.interpret
@pytest.mark.parametrize("case", PERSISTENT_OPTION_CASES,
                         ids=[c[0] for c in PERSISTENT_OPTION_CASES])
def test_interpret_persistent_options(case):
  _, B, Tq, Tk, N, K, D, dtype, mask, opts = case
  opts = _expand_opts(opts, Tq, Tk)
  q, k, v = make_qkv(jax.random.key(Tq + 5 * Tk), B, Tq, Tk, N, K, D, dtype)
  scale = D ** -0.5 * (4.0 if "softcap" in opts else 1.0)
  config = _cfg(num_sms=2)
  o, lse = _run(q, k, v, mask=mask, config=config, separate_o=None, scale=scale,
                **opts)
  assert not interpret_pallas_call.get_races().races_found
  assert_matches_opts(o, lse, q, k, v, scale=scale, mask=mask, **opts)
  o1, lse1 = run_interpret_opts(q, k, v, scale=scale, mask=mask,
                                config=dataclasses.replace(config, persistent=False),
                                **opts)
  np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o1, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse1))


# ForwardConfig.defer_epilogue: an item's epilogue runs in the next item's
# first step (while its Q K^T is in flight), the last one after the loop.
# Same instructions on the same values: bitwise equal to the plain order.
DEFER_CASES = [
    # id, B, Tq, Tk, N, K, D, mask, config fields, options
    ("plain", 1, 256, 300, 2, 1, 64, NO_MASK, {}, {}),
    # D=128: the next q is issued in the item's last step (early_next_q).
    ("d128-causal-half-tiles", 1, 256, 256, 2, 1, 128, CAUSAL_BR,
     dict(block_kv=128, half_edge_tiles=True, reverse_q_tiles=True), {}),
    # Items whose warpgroup sees no key tile: its pending epilogue runs at once.
    ("empty-items", 1, 384, 100, 2, 1, 64, W(window_left=0, window_right=0), {}, {}),
    ("lengths-sinks", 2, 200, 256, 2, 1, 64, CAUSAL_BR, {},
     dict(q_lengths=[200, 37], kv_lengths=[256, 90], sinks=[0.5, -1.0])),
    ("segments-window", 1, 256, 256, 2, 1, 64,
     W(causal=True, window_left=70, alignment="bottom_right"), {},
     dict(segments=([[100, 60, 96]], [[100, 60, 96]]))),
    ("softcap-pingpong-off", 1, 200, 200, 2, 2, 64, CAUSAL_TL,
     dict(pingpong="off"), dict(softcap=5.0)),
    # The fused step (D=256's default elsewhere): fused_first carries it.
    ("fused", 1, 256, 300, 2, 1, 64, CAUSAL_BR, dict(fuse_pv_qk=True), {}),
    # A window's far edge in the lower half of the first tile: a half=1 step
    # is the peeled one.
    ("window-half-tiles", 1, 256, 300, 2, 1, 64,
     W(causal=True, window_left=100, alignment="bottom_right"),
     dict(block_kv=128, half_edge_tiles=True), {}),
]


@pytest.mark.interpret
@pytest.mark.parametrize("case", DEFER_CASES, ids=[c[0] for c in DEFER_CASES])
def test_interpret_deferred_epilogue_is_bitwise_the_plain_order(case):
  q, k, v, mask, fields, opts, scale = case_inputs(case, 3)
  config = _cfg(num_sms=2, **fields)
  o, lse = _run(q, k, v, mask=mask, separate_o=True, scale=scale,
                config=dataclasses.replace(config, defer_epilogue=True), **opts)
  assert not interpret_pallas_call.get_races().races_found
  assert_matches_opts(o, lse, q, k, v, scale=scale, mask=mask, **opts)
  o1, lse1 = _run(q, k, v, mask=mask, separate_o=True, scale=scale, config=config,
                  detect_races=False, **opts)
  np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o1, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse1))


# ForwardConfig.epilogue_off_turn: a warpgroup hands its turn on for the
# epilogue (one more signal and wait per item). Turns order the tensor cores'
# work, not the arithmetic: bitwise the plain order, in the persistent kernel
# (o apart from q or in it, either ping-pong, the overlapped softmax) and in
# the grid kernel.
OFF_TURN_CASES = DEFER_CASES + [
    ("meeting", 1, 256, 300, 2, 1, 64, CAUSAL_BR, dict(pingpong="meeting"), {}),
    ("overlap-softmax", 1, 330, 333, 2, 1, 64, CAUSAL_BR,
     dict(overlap_softmax=True), {}),
    ("three-warpgroups", 1, 400, 333, 2, 1, 64, CAUSAL_BR,
     dict(compute_warpgroups=3, compute_registers=160, producer_registers=24,
          pingpong="handoff"), {}),
]


@pytest.mark.interpret
@pytest.mark.parametrize("persistent,separate_o", [(True, True), (True, False),
                                                   (False, None)],
                         ids=["separate-o", "o-in-q", "grid"])
@pytest.mark.parametrize("case", OFF_TURN_CASES, ids=[c[0] for c in OFF_TURN_CASES])
def test_interpret_epilogue_off_turn_is_bitwise_the_plain_order(case, persistent,
                                                                separate_o):
  q, k, v, mask, fields, opts, scale = case_inputs(case, 3)
  fields = dict(dict(pingpong="handoff"), **fields)
  config = _cfg(num_sms=2, **fields)
  if not persistent:
    config = dataclasses.replace(config, persistent=False)
  o, lse = _run(q, k, v, mask=mask, separate_o=separate_o, scale=scale,
                config=dataclasses.replace(config, epilogue_off_turn=True), **opts)
  assert not interpret_pallas_call.get_races().races_found
  assert_matches_opts(o, lse, q, k, v, scale=scale, mask=mask, **opts)
  o1, lse1 = _run(q, k, v, mask=mask, separate_o=separate_o, scale=scale,
                  config=config, detect_races=False, **opts)
  np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o1, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse1))


def test_epilogue_off_turn_config_errors():
  with pytest.raises(ValueError, match="epilogue_off_turn=True needs defer_epilogue"):
    ForwardConfig(persistent=True, defer_epilogue=True, epilogue_off_turn=True)
  with pytest.raises(ValueError, match="epilogue_off_turn"):
    ForwardConfig(epilogue_off_turn="yes")


@pytest.mark.parametrize("fields", [dict(persistent=False),
                                    dict(persistent=True, overlap_softmax=True)])
def test_deferred_epilogue_config_errors(fields):
  with pytest.raises(ValueError, match="defer_epilogue"):
    ForwardConfig(defer_epilogue=True, **fields)
  with pytest.raises(ValueError, match="defer_epilogue"):
    ForwardConfig(persistent=True, defer_epilogue=1)


def test_deferred_epilogue_needs_the_separate_o_tile():
  # D=256 with two 64-key stages has no room for o apart from q.
  q, k, v = make_qkv(jax.random.key(0), 1, 128, 128, 2, 1, 256, jnp.bfloat16)
  config = _cfg(block_kv=64, num_stages=2, defer_epilogue=True)
  with pytest.raises(ValueError, match="separate o tile"):
    attention_forward(q, k, v, scale=0.1, mask=NO_MASK, config=config)


@pytest.mark.parametrize("D,mask,fields,opts", [
    (64, NO_MASK, dict(block_kv=256), {}),
    (128, CAUSAL_BR, dict(block_kv=128, half_edge_tiles=True, reverse_q_tiles=True), {}),
    (64, CAUSAL_BR, dict(block_kv=128, fuse_pv_qk=True), {}),
    # Tq and the sink carried through the item loop too.
    (128, CAUSAL_BR, dict(block_kv=128),
     dict(q_lengths=[1000, 700], kv_lengths=[1100, 64], sinks=[0.1, 0.2, 0.3, 0.4],
          softcap=5.0, segments=([[500, 500], [1000]], [[550, 550], [1100]]))),
])
def test_deferred_epilogue_lowers_for_the_gpu(D, mask, fields, opts):
  # The carried q offset needs pl.multiple_of for the stores' layouts (the
  # lowering failed in layout inference without it).
  q, k, v = make_qkv(jax.random.key(0), 2, 1000, 1100, 4, 2, D, jnp.bfloat16)
  opts = _expand_opts(opts, 1000, 1100)
  config = _cfg(num_sms=132, defer_epilogue=True, **fields)
  f = lambda q, k, v: attention_forward(q, k, v, scale=0.1, mask=mask, config=config,
                                        **opts)
  text = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


# ----------------------------------------------------------------------------
# Lowering for the GPU (on the CPU): catches Mosaic GPU lowering errors
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("D,dtype,config,separate_o", [
    (64, jnp.bfloat16, _cfg(block_kv=128, num_stages=4, num_sms=132), None),
    (128, jnp.bfloat16, _cfg(block_kv=128, num_stages=2, num_sms=132), None),
    (128, jnp.float16, _cfg(block_kv=128, num_stages=2, num_sms=132), False),
    (256, jnp.bfloat16, _cfg(block_kv=64, num_stages=2, num_sms=132), None),
])
def test_persistent_lowers_for_the_gpu(D, dtype, config, separate_o):
  q, k, v = make_qkv(jax.random.key(0), 2, 1000, 1100, 4, 2, D, dtype)
  old = fw.PERSISTENT_SEPARATE_O
  fw.PERSISTENT_SEPARATE_O = separate_o
  try:
    f = lambda q, k, v: attention_forward(q, k, v, scale=0.1, mask=NO_MASK,
                                          config=config)
    text = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  finally:
    fw.PERSISTENT_SEPARATE_O = old
  assert "mosaic_gpu" in text


def test_persistent_with_options_lowers_for_the_gpu():
  q, k, v = make_qkv(jax.random.key(0), 2, 200, 300, 2, 1, 128, jnp.bfloat16)
  ids = _packed([[50, 150], [200]], 200), _packed([[80, 220], [300]], 300)
  f = lambda q, k, v: attention_forward(
      q, k, v, scale=0.1, mask=CAUSAL_BR, config=_cfg(block_kv=128),
      q_segment_ids=ids[0], kv_segment_ids=ids[1], softcap=5.0,
      sinks=jnp.array([0.1, 0.2]), q_lengths=jnp.array([200, 100], jnp.int32))
  text = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


# ----------------------------------------------------------------------------
# GPU (H100/H200)
# ----------------------------------------------------------------------------

GPU_CASES = [
    # B, Tq, Tk, N, K, D, dtype, mask, block_kv, num_stages
    (2, 4096, 4096, 16, 16, 128, jnp.bfloat16, NO_MASK, 128, 2),
    (1, 1000, 1100, 8, 2, 128, jnp.float16, NO_MASK, 128, 2),
    (3, 777, 2049, 4, 1, 64, jnp.bfloat16, NO_MASK, 128, 4),
    (2, 4096, 4096, 32, 8, 64, jnp.float16, NO_MASK, 256, 3),
    (2, 1023, 1024, 8, 8, 256, jnp.bfloat16, NO_MASK, 64, 2),
    (1, 2048, 2048, 8, 2, 128, jnp.bfloat16, CAUSAL_BR, 128, 2),
    (1, 300, 5, 4, 4, 64, jnp.bfloat16, NO_MASK, 128, 2),
    # Windows (persistent by default since the fifth session's sweep).
    (1, 4096, 4096, 16, 16, 128, jnp.bfloat16, W(causal=True, window_left=1024), 128, 2),
    (2, 1000, 1200, 4, 2, 64, jnp.float16, W(window_left=100, window_right=50), 128, 2),
]


def _gpu_id(c):
  B, Tq, Tk, N, K, D, dt, mask, bk, st = c
  m = "causal" if mask.causal else "none"
  if mask.window_left is not None or mask.window_right is not None:
    m += f"-w{mask.window_left}x{mask.window_right}"
  return f"B{B}-T{Tq}x{Tk}-N{N}K{K}-D{D}-{jnp.dtype(dt).name}-{m}-bk{bk}s{st}"


@pytest.mark.gpu
@pytest.mark.parametrize("num_sms", [132, 7])
@pytest.mark.parametrize("case", GPU_CASES, ids=_gpu_id)
def test_gpu_persistent_matches_reference_and_grid_kernel(case, num_sms):
  B, Tq, Tk, N, K, D, dtype, mask, bk, st = case
  q, k, v = make_qkv(jax.random.key(Tq + Tk + D), B, Tq, Tk, N, K, D, dtype)
  config = _cfg(block_kv=bk, num_stages=st, num_sms=num_sms)
  o, lse = attention_forward(q, k, v, scale=D ** -0.5, mask=mask, config=config)
  o1, lse1 = attention_forward(q, k, v, scale=D ** -0.5, mask=mask,
                               config=dataclasses.replace(config, persistent=False))
  # The per-item instructions are the grid kernel's: bitwise equal.
  assert bool(jnp.all(o == o1)), "o differs from the grid kernel"
  assert bool(jnp.all(lse == lse1)), "lse differs from the grid kernel"
  if B * Tq * Tk * N <= 2 * 1024 * 1024 * 8:
    assert_matches(o, lse, q, k, v, scale=D ** -0.5, mask=mask)
  else:  # Keep the float32 reference small: check one batch row and head.
    sl = (slice(0, 1), slice(None), slice(0, 1))
    assert_matches(o[sl], lse[:1, :1], q[sl], k[sl[:2] + (slice(0, 1),)],
                   v[sl[:2] + (slice(0, 1),)], scale=D ** -0.5, mask=mask)


@pytest.mark.gpu
@pytest.mark.parametrize("D,mask,T", [(64, NO_MASK, 512), (128, NO_MASK, 1024),
                                      (128, CAUSAL_BR, 2048), (64, CAUSAL_BR, 1000)])
def test_gpu_deferred_epilogue_matches_the_plain_order(D, mask, T):
  base = forward_config(D, jnp.bfloat16, mask, T, T)
  assert base.persistent, base
  _assert_gpu_knob_is_the_plain_order(D, mask, T, 4, jax.random.key(T + D),
                                      dataclasses.replace(base, num_sms=132),
                                      defer_epilogue=True)


def _assert_gpu_knob_is_the_plain_order(D, mask, T, B, key, config, **knob):
  """``config`` with ``knob`` set gives bitwise its plain output, and matches
  the reference on one batch row (N=8, K=2)."""
  q, k, v = make_qkv(key, B, T, T, 8, 2, D, jnp.bfloat16)
  o, lse = attention_forward(q, k, v, scale=D ** -0.5, mask=mask,
                             config=dataclasses.replace(config, **knob))
  o1, lse1 = attention_forward(q, k, v, scale=D ** -0.5, mask=mask, config=config)
  assert bool(jnp.all(o == o1)), "o differs from the plain order"
  assert bool(jnp.all(lse == lse1)), "lse differs from the plain order"
  sl = (slice(0, 1), slice(None), slice(0, 2))
  assert_matches(o[sl], lse[:1, :2], q[sl], k[sl[:2] + (slice(0, 1),)],
                 v[sl[:2] + (slice(0, 1),)], scale=D ** -0.5, mask=mask)


@pytest.mark.gpu
@pytest.mark.parametrize("D,mask,T,fields", [
    (64, NO_MASK, 512, {}), (64, CAUSAL_BR, 2048, {}),  # hand-off; three warpgroups
    (128, CAUSAL_BR, 1024, dict(pingpong="handoff")), (128, CAUSAL_BR, 1024, {}),
    (128, W(causal=True, window_left=1024), 4096, dict(pingpong="handoff")),
    (128, NO_MASK, 4096, {}),  # the grid kernel
])
def test_gpu_epilogue_off_turn_matches_the_plain_order(D, mask, T, fields):
  config = dataclasses.replace(forward_config(D, jnp.bfloat16, mask, T, T),
                               num_sms=132, **fields)
  _assert_gpu_knob_is_the_plain_order(D, mask, T, 2, jax.random.key(T + D + 1),
                                      config, epilogue_off_turn=True)


@pytest.mark.gpu
def test_gpu_persistent_options():
  B, Tq, Tk, N, K, D = 3, 1000, 1200, 4, 2, 128
  q, k, v = make_qkv(jax.random.key(5), B, Tq, Tk, N, K, D, jnp.bfloat16)
  opts = _opts(dict(q_lengths=[1000, 333, 0], kv_lengths=[1200, 901, 64],
                    softcap=20.0, sinks=[0.5, -0.5, 1.0, 0.0]))
  config = _cfg(block_kv=128, num_stages=2, num_sms=132)
  o, lse = attention_forward(q, k, v, scale=D ** -0.5, mask=CAUSAL_BR,
                             config=config, **opts)
  assert_matches_opts(o, lse, q, k, v, scale=D ** -0.5, mask=CAUSAL_BR, **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("mask", [NO_MASK, CAUSAL_BR], ids=["none", "causal"])
def test_gpu_persistent_packed_rows_match_reference_and_grid_kernel(D, mask):
  # Documents of unequal lengths: the schedule is built on the device from
  # the segment ids (schedule.segment_schedule); every item must still run.
  B, T, N, K = 2, 4096, 8, 2
  q, k, v = make_qkv(jax.random.key(D + 3), B, T, T, N, K, D, jnp.bfloat16)
  opts = _expand_opts(dict(segments=([[300, 2000, 96, 1700], [4096]],) * 2), T, T)
  config = forward_config(D, jnp.bfloat16, mask, T, T, packed=True)
  config = dataclasses.replace(config, persistent=True, num_sms=132)
  o, lse = attention_forward(q, k, v, scale=D ** -0.5, mask=mask, config=config,
                             **opts)
  o1, lse1 = attention_forward(q, k, v, scale=D ** -0.5, mask=mask,
                               config=dataclasses.replace(config, persistent=False),
                               **opts)
  assert bool(jnp.all(o == o1)), "o differs from the grid kernel"
  assert bool(jnp.all(lse == lse1)), "lse differs from the grid kernel"
  assert_matches_opts(o, lse, q, k, v, scale=D ** -0.5, mask=mask, **opts)


@pytest.mark.parametrize("D, mask, kv_len, want", [
    (64, NO_MASK, 512, True), (128, NO_MASK, 2048, True), (64, NO_MASK, 4096, True),
    (128, NO_MASK, 4096, False), (256, NO_MASK, 512, True), (256, NO_MASK, 1024, True),
    (256, NO_MASK, 2048, False),
    (64, CAUSAL_BR, 2048, True), (128, CAUSAL_TL, 512, True),
    (128, CAUSAL_BR, 1024, True), (128, CAUSAL_BR, 4096, True),
    (128, CAUSAL_BR, 8192, False), (64, CAUSAL_BR, 4096, True),
    (64, CAUSAL_BR, 16384, True), (256, CAUSAL_BR, 1024, False),
    # Windows: judged by the keys a query tile can see, whatever T is.
    (128, MaskSpec(causal=True, window_left=1024), 16384, True),
    (64, MaskSpec(window_left=16, window_right=16), 512, True),
    (128, MaskSpec(causal=True, window_left=100), 512, True),
    (128, MaskSpec(window_left=1024, window_right=1024), 16384, False),
    (64, MaskSpec(window_left=1024, window_right=1024), 16384, True),
    (256, MaskSpec(causal=True, window_left=1024), 16384, False),
    (128, MaskSpec(causal=True, window_left=4096), 16384, False),
    # A window that does not bind is no window: the plain rules apply.
    (128, MaskSpec(causal=True, window_left=4096), 2048, True),
    (128, MaskSpec(causal=True, window_right=0), 8192, False),
    (128, MaskSpec(window_left=10**6, window_right=10**6), 1024, True),
    (128, MaskSpec(window_left=10**6, window_right=10**6), 4096, False),
])
def test_heuristic_uses_the_persistent_kernel_where_the_sweep_found_it_faster(
    D, mask, kv_len, want):
  # docs/benchmarks/h200/2026-12-01/tune.md: short non-causal sequences, and
  # causal ones up to 512 keys; -s9/tune.md: causal D=64 at any length;
  # 2026-12-04-s23: D=256 up to 1024 keys without a mask; -s26: causal D=128
  # up to 4096 keys (with the schedule's chunks of the grid's order).
  for interpret in (False, True):
    config = forward_config(D, jnp.bfloat16, mask, kv_len, kv_len, interpret=interpret)
    assert config.persistent is want
    check_fits(config, D, 2, interpret=interpret)


@pytest.mark.parametrize("D,causal", [(64, True), (64, False), (128, False)])
def test_packed_rows_take_the_grid_kernel(D, causal):
  # -s10/tune.md: with segment ids the persistent kernel's static schedule
  # ran up to 51% slower (it cannot see each item's documents); -s11: with
  # the schedule built from the documents, -13% to +2%.
  mask = MaskSpec(causal=causal)
  assert forward_config(D, jnp.bfloat16, mask, 1024, 1024).persistent
  config = forward_config(D, jnp.bfloat16, mask, 1024, 1024, packed=True)
  assert not config.persistent
  # Causal documents at D=64 ran 19% faster with 128-key tiles than 256.
  assert config.block_kv == (128 if causal or D > 64 else 256)
  check_fits(config, D, 2)


@pytest.mark.interpret
def test_attention_forward_with_segment_ids_picks_the_packed_config(monkeypatch):
  from flash3.kernels import forward
  seen = []
  real = forward.forward_config

  def spy(*args, **kwargs):
    seen.append(kwargs.get("packed"))
    return real(*args, **kwargs)
  monkeypatch.setattr(forward, "forward_config", spy)
  q, k, v = make_qkv(jax.random.key(2), 1, 64, 64, 1, 1, 64, jnp.bfloat16)
  ids = jnp.repeat(jnp.arange(2, dtype=jnp.int32), 32)[None]
  forward.attention_forward(q, k, v, scale=0.125, mask=NO_MASK, interpret=True,
                            q_segment_ids=ids, kv_segment_ids=ids)
  forward.attention_forward(q, k, v, scale=0.125, mask=NO_MASK, interpret=True)
  assert seen == [True, False]


@pytest.mark.interpret
def test_default_config_sizes_the_persistent_kernel_to_the_gpu(monkeypatch):
  # An H100 PCIe has 114 SMs: 132 CTAs there would run a second wave.
  from flash3 import _device
  from flash3.kernels import forward
  assert _device.sm_count() == _device.DEFAULT_SM_COUNT == 132  # No GPU here.
  assert forward_config(64, jnp.bfloat16, NO_MASK, 512, 512, num_sms=114).num_sms == 114
  seen = []
  real = forward.forward_config

  def spy(*args, **kwargs):
    config = real(*args, **kwargs)
    seen.append(config)
    return config
  monkeypatch.setattr(forward, "forward_config", spy)
  monkeypatch.setattr(_device, "sm_count", lambda: 3)
  q, k, v = make_qkv(jax.random.key(1), 1, 200, 200, 2, 2, 64, jnp.bfloat16)
  o, lse = forward.attention_forward(q, k, v, scale=0.125, mask=NO_MASK,
                                     interpret=True)
  assert [c.num_sms for c in seen] == [3] and seen[0].persistent
  assert_matches(o, lse, q, k, v, scale=0.125, mask=NO_MASK)
