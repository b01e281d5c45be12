"""Tests of the forward kernel (flash3.kernels.forward).

Interpret-mode tests (``-m interpret``) run the kernel itself on the CPU in GPU
interpret mode, small shapes only. GPU tests (``-m gpu``) run on an H100/H200
and skip elsewhere. Every comparison follows FlashAttention-3's rule: the
kernel's error against a float32 reference is at most a small multiple of the
error of the same math done in the input dtype, plus a small atol; NaN fails.

Set FLASH3_FULL_GRID=1 to run issue 3's whole cross product on the GPU
(otherwise every factor is covered, cycled over the lengths).
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flash3
from flash3.kernels import common
from flash3.kernels.config import (PINGPONG_MODES, SMEM_LIMIT_BYTES, ForwardConfig,
                                   forward_config, forward_smem_bytes,
                                   persistent_separate_o, window_key_span)
from flash3.kernels.forward import attention_forward, default_config, unsupported_reason
from flash3.visibility import MaskSpec, dense_mask

import jax.experimental.pallas.mosaic_gpu as plgpu
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

NO_MASK = MaskSpec()
CAUSAL_TL = MaskSpec(causal=True, alignment="top_left")
CAUSAL_BR = MaskSpec(causal=True, alignment="bottom_right")


# ----------------------------------------------------------------------------
# Reference and checks
# ----------------------------------------------------------------------------

from kernel_reference import low_precision_o_with_options, reference  # noqa: E402
from smem_count import lowered_smem_totals  # noqa: E402


def assert_matches(o, lse, q, k, v, *, scale, mask, factor=3.0, atol=2e-3):
  """FlashAttention-3's tolerance rule for o, plus lse to 1e-3 (relative)."""
  o = np.asarray(o.astype(jnp.float32))
  lse = np.asarray(lse)
  assert not np.isnan(o).any(), "NaN in o"
  assert not np.isnan(lse).any(), "NaN in lse"
  ref_o, ref_lse = (np.asarray(x) for x in reference(q, k, v, scale=scale, mask=mask))
  low_o, _ = reference(q, k, v, scale=scale, mask=mask, low_precision=True)
  low_err = float(np.max(np.abs(np.asarray(low_o) - ref_o)))
  err = float(np.max(np.abs(o - ref_o)))
  assert err <= factor * low_err + atol, (
      f"o max error {err:.3g} > {factor} * {low_err:.3g} + {atol}")
  # Rows that see no key: lse -inf exactly there and nowhere else, o = 0.
  dead = np.isneginf(ref_lse)
  np.testing.assert_array_equal(np.isneginf(lse), dead)
  assert np.all(o.transpose(0, 2, 1, 3)[dead] == 0), "rows that see no key are not 0"
  live = ~dead
  np.testing.assert_allclose(lse[live], ref_lse[live], rtol=1e-4, atol=1e-3)
  return err, low_err


def make_qkv(key, B, Tq, Tk, N, K, D, dtype, scale=1.0):
  kq, kk, kv = jax.random.split(key, 3)
  q = (scale * jax.random.normal(kq, (B, Tq, N, D), jnp.float32)).astype(dtype)
  k = (scale * jax.random.normal(kk, (B, Tk, K, D), jnp.float32)).astype(dtype)
  v = jax.random.normal(kv, (B, Tk, K, D), jnp.float32).astype(dtype)
  return q, k, v


def interpret_params(detect_races=False):
  return plgpu.InterpretGPUParams(detect_races=detect_races)


def run_interpret(q, k, v, *, scale, mask, config=None, detect_races=False):
  try:
    out = attention_forward(q, k, v, scale=scale, mask=mask, config=config,
                            interpret=interpret_params(detect_races))
    jax.block_until_ready(out)
  except Exception:
    interpret_pallas_call.reset_gpu_interpret_mode_state()
    raise
  return out


# ----------------------------------------------------------------------------
# Config and argument checks (CPU, fast)
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("block_q", 96), ("block_kv", 96), ("block_kv", 512), ("num_stages", 0),
    ("compute_registers", 300), ("reverse_q_tiles", 1)])
def test_config_rejects_bad_values_naming_the_field(field, value):
  with pytest.raises(ValueError, match=field):
    ForwardConfig(**{field: value})


def test_config_named_barriers_field():
  with pytest.raises(ValueError, match="named_barriers"):
    ForwardConfig(named_barriers=1)
  # Two hardware barriers per ring slot, two for the turns, ids 4..15: a
  # deeper ring keeps mbarriers (checked in the lowering below).
  assert ForwardConfig(num_stages=6).num_stages == 6


@pytest.mark.parametrize("persistent", [False, True])
def test_named_barriers_reach_the_gpu_lowering(persistent):
  """named_barriers puts bar.arrive / bar.sync in the CUDA lowering (and
  nothing else does); interpret mode runs the same protocol on mbarriers."""
  q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
  texts = {}
  for named in (True, False):
    config = ForwardConfig(named_barriers=named, persistent=persistent, num_sms=2)
    f = lambda q, k, v, c=config: attention_forward(q, k, v, scale=0.1,
                                                      mask=CAUSAL_BR, config=c)
    texts[named] = jax.jit(f).trace(q, q, q).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "bar.sync $0, 256;" in texts[True]     # the turns (a meeting by default)
  assert "bar.arrive $0, 384;" in texts[True]   # the consumers' releases
  assert "bar.sync $0, 384;" in texts[True]     # the producer's release waits
  assert "mbarrier.arrive.release" not in texts[True]
  assert "bar.arrive" not in texts[False]
  assert "mbarrier.arrive.release" in texts[False]


def test_pingpong_modes_in_the_gpu_lowering():
  for bad in (False, "on", None):
    with pytest.raises(ValueError, match="pingpong"):
      ForwardConfig(pingpong=bad)
  q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
  texts = {}
  for mode in ("handoff", "meeting", "off"):
    config = ForwardConfig(pingpong=mode)
    f = lambda q, k, v, c=config: attention_forward(q, k, v, scale=0.1,
                                                      mask=CAUSAL_BR, config=c)
    texts[mode] = jax.jit(f).trace(q, q, q).lower(
        lowering_platforms=("cuda",)).as_text()
  # The turns: one-way arrivals of 2 warpgroups, or a meeting of both.
  assert "bar.arrive $0, 256;" in texts["handoff"]
  assert "bar.sync $0, 256;" in texts["handoff"]
  assert "bar.arrive $0, 256;" not in texts["meeting"]
  assert "bar.sync $0, 256;" in texts["meeting"]
  for turn in ("bar.arrive $0, 256;", "bar.sync $0, 256;"):
    assert turn not in texts["off"]
  for mode in texts:  # The ring's releases stay.
    assert "bar.sync $0, 384;" in texts[mode]
  # The mbarrier forms (named_barriers=False) lower too.
  for mode in ("handoff", "meeting", "off"):
    for persistent in (False, True):
      config = ForwardConfig(pingpong=mode, named_barriers=False,
                             persistent=persistent, num_sms=2)
      f = lambda q, k, v, c=config: attention_forward(q, k, v, scale=0.1,
                                                        mask=CAUSAL_BR, config=c)
      text = jax.jit(f).trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
      assert "bar.arrive" not in text


def test_deep_ring_keeps_mbarriers_in_the_gpu_lowering():
  q = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
  k = jnp.zeros((1, 64 * 8, 1, 64), jnp.bfloat16)
  f = lambda q, k, v: attention_forward(
      q, k, v, scale=0.1, mask=NO_MASK, config=ForwardConfig(block_kv=64, num_stages=6))
  text = jax.jit(f).trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()
  assert "bar.arrive" not in text and "mbarrier.arrive.release" in text


def test_overlap_softmax_keeps_its_wgmma_in_flight_on_the_gpu():
  """The overlapped branch (S_t and the previous P @ V issued together, only
  S_t waited for) is what the GPU lowering compiles; until the seventh
  session's review the GPU path took the interpret-mode sequential branch."""
  q = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
  k = jnp.zeros((1, 512, 1, 64), jnp.bfloat16)
  texts = {}
  for overlap in (False, True):
    cfg = ForwardConfig(block_kv=64, overlap_softmax=overlap)
    f = lambda q, k, v, c=cfg: attention_forward(q, k, v, scale=0.1, mask=NO_MASK, config=c)
    texts[overlap] = jax.jit(f).trace(q, k, k).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "wgmma.wait_group.sync.aligned 1" in texts[True]
  assert "wgmma.wait_group.sync.aligned 1" not in texts[False]


def test_config_rejects_too_many_registers():
  with pytest.raises(ValueError, match="65536"):
    ForwardConfig(compute_registers=256, producer_registers=248)
  with pytest.raises(ValueError, match="producer_registers=256 exceeds"):
    ForwardConfig(compute_registers=24, producer_registers=256)


@pytest.mark.parametrize("mask", [NO_MASK, CAUSAL_BR])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_heuristic_always_fits_shared_memory(mask, dtype):
  for d_pad, (q_len, kv_len) in itertools.product(
      (64, 128, 192, 256), [(1, 1), (128, 217), (4096, 4096), (1, 65536)]):
    for interpret in (False, True):
      config = forward_config(d_pad, dtype, mask, q_len, kv_len, interpret=interpret)
      need = forward_smem_bytes(config, d_pad, 2, interpret=interpret)
      assert need <= SMEM_LIMIT_BYTES, (d_pad, config, need)
      assert config.reverse_q_tiles == mask.causal


@pytest.mark.parametrize("d_pad,mask,kv_len,wide", [
    (64, NO_MASK, 16384, True),      # 64 x 256 score tiles, 3 stages
    (64, CAUSAL_BR, 1024, False),    # 256-key tiles, but persistent: not swept with 240
    (64, NO_MASK, 2048, False),      # persistent: not swept with 240
    (128, NO_MASK, 16384, False),
    (256, NO_MASK, 16384, False),    # 1% slower with 240 in the benchmark
    (256, CAUSAL_BR, 4096, False)])
def test_heuristic_registers(d_pad, mask, kv_len, wide):
  # The H200 runs of the sixth session: 240 compute registers (producer 24)
  # helped only the widest score tiles.
  config = forward_config(d_pad, jnp.bfloat16, mask, kv_len, kv_len)
  assert (config.compute_registers, config.producer_registers) == (
      (240, 24) if wide else (232, 40))


@pytest.mark.parametrize("d_pad,mask,kv_len,packed,three", [
    (64, CAUSAL_BR, 2048, False, True), (64, CAUSAL_BR, 16384, False, True),
    (64, CAUSAL_BR, 1024, False, False),   # 4-13% slower below 2048 keys
    (64, NO_MASK, 16384, False, False),    # -2% to +1%: not taken
    (64, CAUSAL_BR, 16384, True, False),   # packed rows: the grid kernel, unmeasured
    (64, MaskSpec(causal=True, window_left=1024), 16384, False, False),  # unmeasured
    (128, CAUSAL_BR, 16384, False, False)])  # slower everywhere at D=128
def test_heuristic_three_warpgroups(d_pad, mask, kv_len, packed, three):
  # The twenty-ninth session's H200 A/B (docs/benchmarks/h200/2026-12-06-s29/).
  config = forward_config(d_pad, jnp.bfloat16, mask, kv_len, kv_len, packed=packed)
  assert (config.compute_warpgroups == 3) == three
  if three:
    assert (config.block_kv, config.compute_registers, config.producer_registers,
            config.pingpong, config.persistent) == (128, 160, 24, "handoff", True)
  assert forward_smem_bytes(config, d_pad, 2) <= SMEM_LIMIT_BYTES


@pytest.mark.parametrize("mask", [NO_MASK, CAUSAL_BR], ids=["none", "causal"])
@pytest.mark.parametrize("d_pad,mode", [(128, "meeting"), (192, "handoff"),
                                        (256, "handoff")])
def test_heuristic_pingpong(d_pad, mode, mask):
  # The ninth session's H200 A/B: the meeting at D=128, the hand-off above.
  for kv_len in (1024, 16384):
    assert forward_config(d_pad, jnp.bfloat16, mask, kv_len, kv_len).pingpong == mode


def test_heuristic_pingpong_d64_follows_the_kernel():
  # The twenty-fifth session's H200 A/B at D=64: the hand-off in the
  # persistent kernel, the meeting in the grid kernel and with a window.
  for mask in (NO_MASK, CAUSAL_BR, MaskSpec(window_left=512),
               MaskSpec(causal=True, window_left=512)):
    for kv_len in (512, 1024, 4096, 16384, 65536):
      c = forward_config(64, jnp.bfloat16, mask, kv_len, kv_len)
      windowed = window_key_span(mask, kv_len) is not None  # One that binds.
      want = "handoff" if c.persistent and not windowed else "meeting"
      assert c.pingpong == want, (mask, kv_len, c)
  # Both kernels occur: causal is persistent, long non-causal keys are not.
  assert forward_config(64, jnp.bfloat16, CAUSAL_BR, 16384, 16384).pingpong == "handoff"
  assert forward_config(64, jnp.bfloat16, NO_MASK, 16384, 16384).pingpong == "meeting"
  assert forward_config(64, jnp.bfloat16, NO_MASK, 1024, 1024).pingpong == "handoff"


@pytest.mark.parametrize("mask", [NO_MASK, CAUSAL_BR, MaskSpec(window_left=512)],
                         ids=["none", "causal", "window"])
@pytest.mark.parametrize("d_pad,fused", [(64, False), (128, False), (192, True),
                                         (256, True)])
def test_heuristic_fuses_pv_and_qk_above_d128(d_pad, fused, mask):
  # The twenty-fourth session's H200 A/B: +0.6-3.0% at D=256, slower below.
  for kv_len in (512, 4096, 16384):
    config = forward_config(d_pad, jnp.bfloat16, mask, kv_len, kv_len)
    assert config.fuse_pv_qk == fused
    assert not (config.fuse_pv_qk and config.half_edge_tiles)


@pytest.mark.parametrize("d_pad,mask,kv_len,packed,block_kv", [
    (128, NO_MASK, 16384, False, 192),    # 2.6% faster than 128 on the H200
    (128, NO_MASK, 8192, False, 192),
    (128, NO_MASK, 4096, False, 128),     # 0.6-1.1% slower with 192
    (128, CAUSAL_BR, 16384, False, 128),  # a diagonal cuts 192-key tiles badly
    (128, MaskSpec(window_left=1024, window_right=1024), 16384, False, 128),
    (128, NO_MASK, 16384, True, 128),     # packed rows: unmeasured with 192
    (64, NO_MASK, 16384, False, 256),
    (256, NO_MASK, 16384, False, 64),
    # Causal D=64: 128-key tiles below 1024 keys (twenty-sixth session).
    (64, CAUSAL_BR, 512, False, 128), (64, CAUSAL_BR, 768, False, 128),
    (64, CAUSAL_BR, 1024, False, 256),
    # From 2048 keys three compute warpgroups with 128-key tiles (twenty-ninth).
    (64, CAUSAL_BR, 2048, False, 128), (64, CAUSAL_BR, 16384, False, 128)])
def test_heuristic_block_kv(d_pad, mask, kv_len, packed, block_kv):
  # The thirteenth session's H200 A/B (docs/benchmarks/h200/2026-12-02-s13/).
  config = forward_config(d_pad, jnp.bfloat16, mask, kv_len, kv_len, packed=packed)
  assert config.block_kv == block_kv
  assert forward_smem_bytes(config, d_pad, 2) <= SMEM_LIMIT_BYTES


def _spec(shape, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, dtype)


# (D, mask, config fields, options): every feature of the forward kernel once.
SMEM_CASES = [
    (64, CAUSAL_BR, dict(block_kv=256, persistent=True, half_edge_tiles=True), {}),
    (128, MaskSpec(causal=True, window_left=300), dict(half_edge_tiles=True),
     dict(lengths=True, softcap=20.0, sinks=True)),
    (128, CAUSAL_BR, dict(), dict(segments=True)),
    (256, NO_MASK, dict(block_kv=64, pingpong="handoff"), {}),
    (128, CAUSAL_BR, dict(block_kv=64, overlap_softmax=True), {}),
    (128, NO_MASK, dict(exp2_fma_cols=32, named_barriers=False, pingpong="off"), {}),
    (128, CAUSAL_BR, dict(persistent=True, num_sms=4), dict(sinks=True)),
    (64, CAUSAL_BR, dict(block_kv=128, persistent=True, num_sms=4, half_edge_tiles=True),
     dict(segments=True, lengths=True)),
    (64, NO_MASK, dict(block_kv=64, persistent=True, num_sms=4, overlap_softmax=True),
     dict(softcap=30.0)),
    # Fit only without Pallas's default 2 KB of reduction scratch:
    (128, NO_MASK, dict(block_kv=192, num_stages=2), {}),
    (128, NO_MASK, dict(block_kv=128, num_stages=3), {}),
]


@pytest.mark.parametrize("case", SMEM_CASES, ids=range(len(SMEM_CASES)))
def test_smem_estimate_bounds_mosaic_without_reduction_scratch(case, monkeypatch):
  """The forward runs without reduction scratch (reduction_scratch_bytes=0):
  every feature still lowers (a reduction across warps would raise, see the
  next test), and forward_smem_bytes bounds what Mosaic GPU allocates, tightly."""
  D, mask, fields, opts = case
  config = ForwardConfig(**fields)
  B, T, N, K = 2, 1000 + D, 4, 2  # odd T: a shape no other test lowers
  kw = {}
  if opts.get("lengths"):
    kw.update(q_lengths=_spec((B,), jnp.int32), kv_lengths=_spec((B,), jnp.int32))
  if opts.get("segments"):
    kw.update(q_segment_ids=_spec((B, T), jnp.int32), kv_segment_ids=_spec((B, T), jnp.int32))
  if opts.get("sinks"):
    kw.update(sinks=_spec((N,), jnp.float32))
  names = list(kw)

  def f(q, k, v, *extra):
    return attention_forward(q, k, v, scale=0.1, mask=mask, config=config,
                             softcap=opts.get("softcap"), **dict(zip(names, extra)))

  totals = lowered_smem_totals(
      monkeypatch, f, _spec((B, T, N, D)), _spec((B, T, K, D)), _spec((B, T, K, D)),
      *kw.values())
  assert totals, "nothing lowered (a cached lowering?)"
  need = forward_smem_bytes(config, D, 2)
  if config.persistent and persistent_separate_o(config, D, 2):
    need += 2 * 64 * D * 2  # the persistent kernel's own o tiles
  assert need <= SMEM_LIMIT_BYTES
  assert max(totals) <= need < max(totals) + 1024, (totals, need)


def test_cross_warp_reduction_without_scratch_fails_to_lower():
  """What makes reduction_scratch_bytes=0 safe in the forward: with no scratch,
  a reduction across warps (axis 0 of a WGMMA-layout tile) raises at lowering
  instead of writing past an empty buffer; along rows (axis 1) it needs none."""
  def lower(axis):
    def body(o_ref, o_smem):
      x = plgpu.layout_cast(jnp.full((64, 64), 1.0, jnp.float32), plgpu.Layout.WGMMA)
      o_smem[...] = x.sum(axis=axis)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem, o_ref)
      plgpu.wait_smem_to_gmem(0)
    f = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((64,), jnp.float32),
                     scratch_types=[plgpu.SMEM((64,), jnp.float32)],
                     compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=0))
    jax.jit(f).trace().lower(lowering_platforms=("cuda",))
  lower(1)
  with pytest.raises(ValueError, match="reduction scratch"):
    lower(0)


def test_unsupported_reasons():
  ok = unsupported_reason((2, 10, 4, 64), (2, 7, 2, 64), jnp.bfloat16, CAUSAL_BR)
  assert ok is None
  assert "float16" in unsupported_reason((1, 8, 1, 64), (1, 8, 1, 64), jnp.float32, NO_MASK)
  assert "multiple of 8" in unsupported_reason((1, 8, 1, 60), (1, 8, 1, 60), jnp.float16, NO_MASK)
  assert "multiple" in unsupported_reason((1, 8, 3, 64), (1, 8, 2, 64), jnp.float16, NO_MASK)
  assert "head_dim" in unsupported_reason((1, 8, 2, 64), (1, 8, 2, 128), jnp.float16, NO_MASK)
  assert "batch" in unsupported_reason((1, 8, 2, 64), (2, 8, 2, 64), jnp.float16, NO_MASK)
  with pytest.raises(ValueError, match="float16"):
    x = jnp.zeros((1, 8, 1, 64), jnp.float32)
    attention_forward(x, x, x, scale=1.0, mask=NO_MASK)


def test_static_switch():
  assert common.uses_register_operands(False)
  assert not common.uses_register_operands(True)
  assert not common.uses_register_operands(plgpu.InterpretGPUParams())


# ----------------------------------------------------------------------------
# Interpret mode: the kernel itself on the CPU (small shapes)
# ----------------------------------------------------------------------------

W = MaskSpec  # shorthand for windows below

INTERPRET_CASES = [
    # B, Tq, Tk, N, K, D, dtype, mask
    (1, 128, 128, 1, 1, 64, jnp.bfloat16, NO_MASK),
    (1, 113, 203, 2, 1, 64, jnp.float16, CAUSAL_BR),
    (1, 203, 113, 2, 1, 128, jnp.bfloat16, CAUSAL_BR),  # top rows see no key
    (1, 200, 333, 1, 1, 64, jnp.bfloat16, CAUSAL_TL),
    (1, 333, 200, 1, 1, 64, jnp.float16, CAUSAL_TL),
    (2, 239, 1, 2, 2, 64, jnp.float16, NO_MASK),
    (1, 1, 300, 1, 1, 128, jnp.bfloat16, CAUSAL_BR),
    (1, 130, 130, 4, 1, 64, jnp.bfloat16, CAUSAL_TL),  # GQA 4:1
    (1, 64, 128, 2, 2, 96, jnp.float16, NO_MASK),  # D padded to 128
    (1, 300, 260, 1, 1, 64, jnp.bfloat16, W(window_left=32, window_right=8)),
    (1, 260, 300, 1, 1, 64, jnp.float16,
     W(causal=True, alignment="bottom_right", window_left=40)),
    (1, 256, 100, 1, 1, 64, jnp.bfloat16, W(window_left=0, window_right=0)),  # rows >= 100 see nothing
    (1, 5, 3, 2, 1, 64, jnp.bfloat16, CAUSAL_BR),  # E11 tiny lengths
]


@pytest.mark.interpret
@pytest.mark.parametrize("B,Tq,Tk,N,K,D,dtype,mask", INTERPRET_CASES)
def test_interpret_matches_reference(B, Tq, Tk, N, K, D, dtype, mask):
  q, k, v = make_qkv(jax.random.key(Tq * 1000 + Tk), B, Tq, Tk, N, K, D, dtype)
  scale = D ** -0.5
  o, lse = run_interpret(q, k, v, scale=scale, mask=mask)
  assert o.shape == q.shape and o.dtype == q.dtype
  assert lse.shape == (B, N, Tq) and lse.dtype == jnp.float32
  assert_matches(o, lse, q, k, v, scale=scale, mask=mask)


@pytest.mark.interpret
@pytest.mark.parametrize("B,Tq,Tk,N,K,D,mask,config", [
    (1, 200, 333, 1, 1, 64, CAUSAL_BR, ForwardConfig(block_kv=64, num_stages=2)),
    (1, 330, 333, 1, 1, 64, CAUSAL_BR,
     ForwardConfig(block_kv=64, num_stages=2, reverse_q_tiles=True)),
    (1, 128, 512, 2, 1, 64, NO_MASK, ForwardConfig(block_kv=64, num_stages=3)),
    (1, 200, 333, 1, 1, 64, CAUSAL_BR,
     ForwardConfig(block_kv=64, num_stages=2, pingpong="off")),
    (1, 200, 333, 1, 1, 64, CAUSAL_BR,
     ForwardConfig(block_kv=64, num_stages=2, pingpong="handoff")),
    (1, 190, 300, 1, 1, 64, W(window_left=50, window_right=20),
     ForwardConfig(block_kv=64, num_stages=1)),
    # Causal D=64's default since the ninth session: 256-key tiles, a 2-slot
    # ring that wraps (3 key tiles), persistent CTAs with 2 items each.
    (1, 256, 600, 2, 1, 64, CAUSAL_BR,
     ForwardConfig(block_kv=256, num_stages=2, reverse_q_tiles=True, persistent=True,
                   num_sms=2)),
])
def test_interpret_no_races(B, Tq, Tk, N, K, D, mask, config):
  q, k, v = make_qkv(jax.random.key(7), B, Tq, Tk, N, K, D, jnp.bfloat16)
  o, lse = run_interpret(q, k, v, scale=0.125, mask=mask, config=config,
                         detect_races=True)
  assert not interpret_pallas_call.get_races().races_found
  assert_matches(o, lse, q, k, v, scale=0.125, mask=mask)


# The default config, and part of each tile's exp2 on the FMA pipes
# (tests/test_exp2.py): the edges its exponent handling could break.
EDGE_CONFIGS = [None, ForwardConfig(block_kv=64, num_stages=2, exp2_fma_cols=32),
                ForwardConfig(block_kv=64, num_stages=2, scale_first=True),
                ForwardConfig(block_kv=64, num_stages=2, lazy_rescale=False, scale_first=True),
                ForwardConfig(block_kv=64, num_stages=2, fma_exponent=True)]
EDGE_IDS = ["default", "exp2_fma", "scale_first", "every_tile", "fma_exponent"]


@pytest.mark.interpret
@pytest.mark.parametrize("config", EDGE_CONFIGS, ids=EDGE_IDS)
def test_interpret_extreme_equal_inputs_e03(config):
  """E03: q = k = v = 133120: o must equal v exactly, no NaN."""
  for Tk in (1, 2):
    x = jnp.full((1, 1, 1, 64), 133120.0, jnp.bfloat16)
    kv = jnp.full((1, Tk, 1, 64), 133120.0, jnp.bfloat16)
    o, lse = run_interpret(x, kv, kv, scale=0.125, mask=NO_MASK, config=config)
    np.testing.assert_array_equal(np.asarray(o, np.float32), 133120.0)
    assert np.isfinite(np.asarray(lse)).all()


@pytest.mark.interpret
@pytest.mark.parametrize("scale_first", [False, True], ids=["raw_max", "scale_first"])
@pytest.mark.parametrize("lazy", [True, False], ids=["lazy", "every_tile"])
def test_interpret_lazy_rescale_moves_only_past_the_threshold(lazy, scale_first):
  """ForwardConfig.lazy_rescale: rows whose later key tiles score higher by
  less than the threshold (row 0: +4 in log2 units, kept reference, P up to
  2**4) or by more (rows 1 and 2: +20 and +200, which would overflow a
  float16 P, resp. float32, unless the reference moves), and a row whose
  first tile holds its max (row 3), all against the float32 reference; the
  lazy and the every-tile kernels agree to rounding. (Whether a row moves
  below the threshold cannot show in o or lse: moving is always correct.)"""
  D, Tk, block_kv = 64, 192, 64
  log2e = 1.4426950408889634
  # Scores q.k * scale (natural units) chosen per (row, key tile) through
  # column 0 of q and k (q's other columns are 0).
  tile_scores = np.array([[1.0, 1.0 + 4 / log2e, 0.5],
                          [1.0, 2.0, 2.0 + 20 / log2e],
                          [1.0, 2.0, 2.0 + 200 / log2e],
                          [9.0, 1.0, -3.0]])
  rows = tile_scores.shape[0]
  noise = 0.05 * jax.random.normal(jax.random.key(7), (rows, Tk, D))
  # One query row per pattern, each its own head; q picks column 0 of k.
  q = jnp.zeros((1, 1, rows, D)).at[0, 0, :, 0].set(1.0)
  k_rows = np.repeat(tile_scores, block_kv, axis=1)  # (rows, Tk)
  k = noise.transpose(1, 0, 2).at[:, :, 0].set(k_rows.T)[None]
  v = jax.random.normal(jax.random.key(8), (1, Tk, rows, D))
  q, k, v = (x.astype(jnp.float16) for x in (q, k, v))
  config = ForwardConfig(block_kv=block_kv, num_stages=2, lazy_rescale=lazy,
                         scale_first=scale_first)
  o, lse = run_interpret(q, k, v, scale=1.0, mask=NO_MASK, config=config)
  assert_matches(o, lse, q, k, v, scale=1.0, mask=NO_MASK)
  other = ForwardConfig(block_kv=block_kv, num_stages=2, lazy_rescale=not lazy,
                        scale_first=not scale_first)
  o2, lse2 = run_interpret(q, k, v, scale=1.0, mask=NO_MASK, config=other)
  np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o2, np.float32),
                             atol=1e-2, rtol=1e-2)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse2), rtol=1e-6, atol=1e-5)


@pytest.mark.interpret
@pytest.mark.parametrize("config", EDGE_CONFIGS, ids=EDGE_IDS)
def test_interpret_masked_keys_with_nan_e07(config):
  """E07 (forward): NaN/Inf/1e30 in keys that are masked away change nothing.
  (Keys 70..95 sit in the first 32 columns of a 64-key tile rows 64..69 see:
  where exp2_fma_cols puts the polynomial.)"""
  Tq, Tk = 70, 240
  q, k, v = make_qkv(jax.random.key(3), 1, Tq, Tk, 1, 1, 64, jnp.bfloat16)
  mask = CAUSAL_TL  # query i sees keys <= i < 70
  bad = jnp.array([jnp.nan, jnp.inf, 1e30], jnp.bfloat16)
  idx = jnp.arange(Tk)
  k_bad = jnp.where((idx >= Tq)[None, :, None, None],
                    bad[idx % 3][None, :, None, None], k)
  o, lse = run_interpret(q, k, v, scale=0.125, mask=mask, config=config)
  o_bad, lse_bad = run_interpret(q, k_bad, v, scale=0.125, mask=mask, config=config)
  np.testing.assert_array_equal(np.asarray(o_bad, np.float32), np.asarray(o, np.float32))
  np.testing.assert_array_equal(np.asarray(lse_bad), np.asarray(lse))
  assert_matches(o, lse, q, k, v, scale=0.125, mask=mask)


@pytest.mark.interpret
@pytest.mark.parametrize("mask", [NO_MASK, CAUSAL_BR], ids=["none", "causal"])
def test_interpret_192_key_tiles(mask):
  """192-key tiles (P @ V over three 64-key groups), which D=128 can take with
  a 2-slot ring since the forward dropped Pallas's reduction scratch; run here
  at D=64, where interpret mode's P staging fits as well. Ragged 300 x 450."""
  q, k, v = make_qkv(jax.random.key(11), 1, 300, 450, 2, 1, 64, jnp.bfloat16)
  config = ForwardConfig(block_kv=192, num_stages=2)
  o, lse = run_interpret(q, k, v, scale=0.125, mask=mask, config=config,
                         detect_races=mask.causal)
  assert_matches(o, lse, q, k, v, scale=0.125, mask=mask)


# ----------------------------------------------------------------------------
# GPU tests (H100/H200)
# ----------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("mask", [NO_MASK, CAUSAL_BR], ids=["none", "causal"])
@pytest.mark.parametrize("fields", [dict(block_kv=192, num_stages=2),
                                    dict(block_kv=128, num_stages=3)],
                         ids=["bk192", "stages3"])
def test_gpu_d128_configs_that_fit_without_reduction_scratch(fields, mask):
  """D=128 configs that fit shared memory only without Pallas's 2 KB of
  reduction scratch (twelfth session): candidates for the non-causal forward."""
  q, k, v = make_qkv(jax.random.key(5), 2, 1000, 1100, 8, 2, 128, jnp.bfloat16)
  config = ForwardConfig(**fields)
  o, lse = attention_forward(q, k, v, scale=128 ** -0.5, mask=mask, config=config)
  assert_matches(o, lse, q, k, v, scale=128 ** -0.5, mask=mask)

@pytest.mark.gpu
@pytest.mark.parametrize("D,dtype,lengths", [(128, jnp.bfloat16, False),
                                             (96, jnp.float16, True)])
def test_gpu_default_192_key_tiles(D, dtype, lengths):
  """The default for long non-causal keys at D=128 (and D=96, padded): 192-key
  tiles, with a ragged last tile (8300 = 43 * 192 + 44) and GQA."""
  B, Tq, Tk, N, K = 2, 300, 8300, 4, 2
  assert default_config(D, dtype, NO_MASK, Tq, Tk).block_kv == 192  # D=96 padded
  q, k, v = make_qkv(jax.random.key(13), B, Tq, Tk, N, K, D, dtype)
  opts = dict(kv_lengths=jnp.array([Tk, 5000], jnp.int32)) if lengths else {}
  o, lse = attention_forward(q, k, v, scale=D ** -0.5, mask=NO_MASK, **opts)
  assert_matches_opts(o, lse, q, k, v, scale=D ** -0.5, mask=NO_MASK, **opts)


GRID_D = (64, 128, 256, 96)
GRID_DTYPES = (jnp.float16, jnp.bfloat16)
GRID_MASKS = (NO_MASK, CAUSAL_TL, CAUSAL_BR)
GRID_GQA = (1, 2, 7, 8)
GRID_LENGTHS = ((1, 1), (64, 128), (113, 203), (128, 217), (239, 1), (256, 512),
                (384, 256), (640, 128), (799, 3), (1023, 1024), (1024, 1023),
                (4092, 4092), (4224, 4224))


def _grid_cases():
  if os.environ.get("FLASH3_FULL_GRID"):
    return list(itertools.product(GRID_LENGTHS, GRID_MASKS, GRID_D, GRID_DTYPES, GRID_GQA))
  cases = []
  # Every length x mask, with D, dtype and GQA ratio cycled (coprime strides).
  for i, (lengths, mask) in enumerate(itertools.product(GRID_LENGTHS, GRID_MASKS)):
    cases.append((lengths, mask, GRID_D[i % 4], GRID_DTYPES[(i // 4) % 2],
                  GRID_GQA[(i // 3) % 4]))
  # Every D x dtype x GQA on one ragged causal shape.
  for d, dt, g in itertools.product(GRID_D, GRID_DTYPES, GRID_GQA):
    cases.append(((113, 203), CAUSAL_BR, d, dt, g))
  return cases


def _case_id(case):
  (tq, tk), mask, d, dt, g = case
  m = "none" if not mask.causal else ("tl" if mask.alignment == "top_left" else "br")
  return f"T{tq}x{tk}-{m}-D{d}-{jnp.dtype(dt).name}-gqa{g}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", _grid_cases(), ids=_case_id)
def test_gpu_grid(case):
  (Tq, Tk), mask, D, dtype, ratio = case
  K = 1
  N = ratio * K
  B = 2 if Tq * Tk <= 1024 * 1024 else 1
  q, k, v = make_qkv(jax.random.key(Tq + 7 * Tk), B, Tq, Tk, N, K, D, dtype)
  scale = D ** -0.5
  o, lse = attention_forward(q, k, v, scale=scale, mask=mask)
  assert_matches(o, lse, q, k, v, scale=scale, mask=mask)


def _gpu_check(B, Tq, Tk, N, K, D, dtype, mask, *, scale=None, qkv=None, seed=0):
  if qkv is None:
    qkv = make_qkv(jax.random.key(seed), B, Tq, Tk, N, K, D, dtype)
  q, k, v = qkv
  scale = D ** -0.5 if scale is None else scale
  o, lse = attention_forward(q, k, v, scale=scale, mask=mask)
  assert_matches(o, lse, q, k, v, scale=scale, mask=mask)
  return o, lse


@pytest.mark.gpu
@pytest.mark.parametrize("Tk", [64, 192, 704, 1088])
def test_gpu_e01_tail_tile_very_negative_logits(Tk):
  """E01: every scaled logit about -120 (lse < -88.7); the padded tail is -inf."""
  D = 64
  a = float(np.sqrt(120 * 8 / D))  # scale 1/8: a * a * D / 8 = 120
  q = jnp.full((1, Tk, 1, D), a, jnp.bfloat16)
  k = jnp.full((1, Tk, 1, D), -a, jnp.bfloat16)
  v = jax.random.normal(jax.random.key(Tk), (1, Tk, 1, D), jnp.bfloat16)
  _, lse = _gpu_check(1, Tk, Tk, 1, 1, D, jnp.bfloat16, CAUSAL_TL, qkv=(q, k, v))
  assert float(jnp.max(lse)) < -88.7 + np.log(Tk) + 1


@pytest.mark.gpu
@pytest.mark.parametrize("mask", [CAUSAL_TL, CAUSAL_BR], ids=["tl", "br"])
def test_gpu_e02_fully_masked_first_tile_keeps_max(mask):
  """E02: causal Tq=88 < Tk=448, GQA 7:1, scaled logits in [-60, -20]."""
  Tq, Tk, N, K, D = 88, 448, 14, 2, 64
  q = jnp.zeros((1, Tq, N, D), jnp.float32).at[..., 0].set(1.0)
  k0 = jax.random.uniform(jax.random.key(2), (1, Tk, K), minval=-60, maxval=-20)
  k = 0.1 * jax.random.normal(jax.random.key(3), (1, Tk, K, D)).at[..., 0].set(k0)
  v = jax.random.normal(jax.random.key(4), (1, Tk, K, D))
  qkv = tuple(x.astype(jnp.bfloat16) for x in (q, k, v))
  _gpu_check(1, Tq, Tk, N, K, D, jnp.bfloat16, mask, scale=1.0, qkv=qkv)


@pytest.mark.gpu
@pytest.mark.parametrize("fields", [{}, dict(scale_first=True),
                                    dict(scale_first=True, lazy_rescale=False),
                                    dict(scale_first=False, fma_exponent=True)],
                         ids=["default", "scale_first", "every_tile", "fma_exponent"])
@pytest.mark.parametrize("Tq,Tk,D", [(1, 1, 64), (1, 2, 64), (64, 256, 64), (130, 1000, 128),
                                     (128, 512, 256)])
def test_gpu_e03_equal_extreme_inputs(Tq, Tk, D, fields):
  """E03 in masked tiles (Tk 1, 2: the tail of one tile) and in whole tiles,
  which take the unmasked path (where LLVM fuses a scale and a subtraction
  into one FMA: before lazy_rescale a row's max got exp2 of that FMA's
  rounding error, which overflows at these magnitudes)."""
  x = jnp.full((1, Tq, 1, D), 133120.0, jnp.bfloat16)
  kv = jnp.full((1, Tk, 1, D), 133120.0, jnp.bfloat16)
  config = dataclasses.replace(default_config(D, x.dtype, NO_MASK, Tq, Tk), **fields)
  o, lse = attention_forward(x, kv, kv, scale=D ** -0.5, mask=NO_MASK, config=config)
  np.testing.assert_array_equal(np.asarray(o, np.float32), 133120.0)
  assert np.isfinite(np.asarray(lse)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 17, 1024])
@pytest.mark.parametrize("mult", [1.0, 3.0, 10.0])
def test_gpu_e04_causal_scaled_randn(T, mult):
  q, k, v = make_qkv(jax.random.key(T), 1, T, T, 1, 1, 128, jnp.float16, scale=mult)
  _gpu_check(1, T, T, 1, 1, 128, jnp.float16, CAUSAL_TL, qkv=(q, k, v))


@pytest.mark.gpu
@pytest.mark.parametrize("mask", [CAUSAL_TL, CAUSAL_BR], ids=["tl", "br"])
@pytest.mark.parametrize("Tq", [255, 257, 512, 64])
def test_gpu_e05_causal_unequal_lengths_gqa(mask, Tq):
  _gpu_check(2, Tq, 256, 4, 2, 128, jnp.bfloat16, mask)


@pytest.mark.gpu
@pytest.mark.parametrize("mask", [
    CAUSAL_BR, MaskSpec(window_left=0, window_right=0),
    MaskSpec(causal=True, alignment="bottom_right", window_left=3)],
    ids=["causal-br", "window00", "causal-window3"])
def test_gpu_e06_rows_that_see_no_key(mask):
  o, lse = _gpu_check(1, 700, 300, 2, 1, 64, jnp.bfloat16, mask)
  assert bool(jnp.isneginf(lse).any())


@pytest.mark.gpu
def test_gpu_e07_masked_keys_hold_nan_inf():
  Tq, Tk = 100, 512
  q, k, v = make_qkv(jax.random.key(3), 1, Tq, Tk, 2, 1, 128, jnp.bfloat16)
  idx = jnp.arange(Tk)
  bad = jnp.array([jnp.nan, jnp.inf, 1e30], jnp.bfloat16)[idx % 3][None, :, None, None]
  # Keys j >= Tq are invisible to every query (causal, top-left): K may hold
  # anything there; V only where whole key tiles are invisible (j >= 256).
  k_bad = jnp.where((idx >= Tq)[None, :, None, None], bad, k)
  v_bad = jnp.where((idx >= 256)[None, :, None, None], bad, v)
  o, lse = attention_forward(q, k, v, scale=0.1, mask=CAUSAL_TL)
  o2, lse2 = attention_forward(q, k_bad, v_bad, scale=0.1, mask=CAUSAL_TL)
  np.testing.assert_array_equal(np.asarray(o2, np.float32), np.asarray(o, np.float32))
  np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))


@pytest.mark.gpu
@pytest.mark.parametrize("D", [32, 64])
def test_gpu_e08_t4092_bitwise_repeatable(D):
  q, k, v = make_qkv(jax.random.key(8), 1, 4092, 4092, 24, 24, D, jnp.bfloat16)
  o, lse = _gpu_check(1, 4092, 4092, 24, 24, D, jnp.bfloat16, NO_MASK, qkv=(q, k, v))
  for _ in range(9):
    o2, lse2 = attention_forward(q, k, v, scale=D ** -0.5, mask=NO_MASK)
    assert bool(jnp.all(o2 == o)) and bool(jnp.all(lse2 == lse))


@pytest.mark.gpu
@pytest.mark.parametrize("Tq,Tk", [(512, 2048), (2048, 512), (1, 4096), (4096, 1), (500, 2050)])
def test_gpu_e09_unequal_lengths(Tq, Tk):
  _gpu_check(1, Tq, Tk, 2, 2, 64, jnp.float16, NO_MASK)


@pytest.mark.gpu
@pytest.mark.parametrize("Tk", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("extra", [1, 3, 17])
def test_gpu_e10_uniform_ones(Tk, extra):
  Tq = Tk + extra
  q = jnp.ones((1, Tq, 1, 64), jnp.float16)
  kv = jnp.ones((1, Tk, 1, 64), jnp.float16)
  o, lse = attention_forward(q, kv, kv, scale=0.125, mask=NO_MASK)
  np.testing.assert_array_equal(np.asarray(o, np.float32), 1.0)
  np.testing.assert_allclose(np.asarray(lse), 8.0 + np.log(Tk), rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 3, 5])
@pytest.mark.parametrize("mask", [NO_MASK, CAUSAL_TL], ids=["none", "causal"])
def test_gpu_e11_tiny_lengths(T, mask):
  _gpu_check(1, T, T, 2, 1, 64, jnp.bfloat16, mask)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Tq,Tk", [(200, 150), (150, 200)])
def test_gpu_e12_window_edges(causal, Tq, Tk):
  q, k, v = make_qkv(jax.random.key(12), 1, Tq, Tk, 1, 1, 64, jnp.bfloat16)
  edges = ((0, 0), (1, 1), (0, Tk + 1), (Tk - 1, 0), (Tk, 1), (Tk + 1, Tk))
  for left, right in edges:
    for alignment in ("top_left", "bottom_right"):
      mask = MaskSpec(causal=causal, alignment=alignment, window_left=left,
                      window_right=right)
      _gpu_check(1, Tq, Tk, 1, 1, 64, jnp.bfloat16, mask, qkv=(q, k, v))
  # Window (Tk - 1, 0) is causal with bottom_right; with top_left only when
  # Tq <= Tk (else (Tq - 1, 0) is): docs/semantics.md 2.3.
  for alignment, left in (("bottom_right", Tk - 1), ("top_left", max(Tq, Tk) - 1)):
    o1, _ = attention_forward(q, k, v, scale=0.125, mask=MaskSpec(
        alignment=alignment, window_left=left, window_right=0))
    o2, _ = attention_forward(q, k, v, scale=0.125, mask=MaskSpec(
        causal=True, alignment=alignment))
    np.testing.assert_allclose(np.asarray(o1, np.float32), np.asarray(o2, np.float32),
                               atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("mask", [NO_MASK, CAUSAL_BR], ids=["none", "causal"])
@pytest.mark.parametrize("mode", [m for m in PINGPONG_MODES if m != ForwardConfig().pingpong])
def test_gpu_pingpong_modes(mode, mask, persistent):
  """The ping-pong modes other than the default (A/B knobs): right, and
  bitwise equal to the default: turns only order the matmuls' issue."""
  q, k, v = make_qkv(jax.random.key(5), 2, 1000, 1100, 4, 2, 64, jnp.bfloat16)
  on = attention_forward(q, k, v, scale=0.125, mask=mask,
                         config=ForwardConfig(persistent=persistent))
  o, lse = attention_forward(q, k, v, scale=0.125, mask=mask,
                             config=ForwardConfig(pingpong=mode, persistent=persistent))
  assert_matches(o, lse, q, k, v, scale=0.125, mask=mask)
  np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(on[0], np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(on[1]))


@pytest.mark.gpu
def test_gpu_output_written_everywhere():
  """Poison the allocator's memory with NaN first; every output element must be written."""
  B, Tq, Tk, N, K, D = 2, 1000, 777, 4, 2, 128
  q, k, v = make_qkv(jax.random.key(9), B, Tq, Tk, N, K, D, jnp.bfloat16)
  for mask in (NO_MASK, CAUSAL_BR):
    poison = [jnp.full((B, Tq, N, D), jnp.nan, jnp.bfloat16),
              jnp.full((B, N, 2048), jnp.nan, jnp.float32)]
    jax.block_until_ready(poison)
    del poison
    o, lse = attention_forward(q, k, v, scale=0.1, mask=mask)
    assert not bool(jnp.isnan(o).any()) and not bool(jnp.isnan(lse).any())


@pytest.mark.gpu
@pytest.mark.parametrize("mask", [NO_MASK, CAUSAL_BR], ids=["none", "causal"])
def test_gpu_offsets_beyond_2_pow_31(mask):
  """q, k, v, o hold more than 2**31 elements: the last batch rows must be right."""
  B, T, N, K, D = 1025, 1024, 16, 16, 128  # q, k, v: 1025 * 1024 * 16 * 128 > 2**31
  assert B * T * N * D > 2 ** 31
  key = jax.random.key(31)
  q = jax.random.normal(key, (B, T, N, D), jnp.bfloat16)
  k = jax.random.normal(jax.random.fold_in(key, 1), (B, T, K, D), jnp.bfloat16)
  v = jax.random.normal(jax.random.fold_in(key, 2), (B, T, K, D), jnp.bfloat16)
  o, lse = attention_forward(q, k, v, scale=D ** -0.5, mask=mask)
  for b in (0, B - 1):
    sl = slice(b, b + 1)
    assert_matches(o[sl], lse[sl], q[sl], k[sl], v[sl], scale=D ** -0.5, mask=mask)


# ----------------------------------------------------------------------------
# Issue 6: lengths, soft cap, sinks (against flash3.reference)
# ----------------------------------------------------------------------------

from flash3.kernels.forward import SUPPORTED_FEATURES  # noqa: E402
from flash3.reference import attention_reference  # noqa: E402


def assert_matches_opts(o, lse, q, k, v, *, scale, mask, factor=3.0, atol=2e-3,
                        **opts):
  """FlashAttention-3's rule against ``flash3.reference.attention_reference``."""
  o = np.asarray(o.astype(jnp.float32))
  lse = np.asarray(lse)
  assert not np.isnan(o).any(), "NaN in o"
  assert not np.isnan(lse).any(), "NaN in lse"
  ref_o, ref_lse = attention_reference(
      q, k, v, scale=scale, spec=mask,
      query_seq_lengths=opts.get("q_lengths"),
      key_value_seq_lengths=opts.get("kv_lengths"),
      query_segment_ids=opts.get("q_segment_ids"),
      key_value_segment_ids=opts.get("kv_segment_ids"),
      logits_soft_cap=opts.get("softcap"), sinks=opts.get("sinks"))
  # The reference returns o in q.dtype: recompute its float32 o for the yardstick.
  ref_o32, _ = attention_reference(
      q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
      scale=scale, spec=mask,
      query_seq_lengths=opts.get("q_lengths"),
      key_value_seq_lengths=opts.get("kv_lengths"),
      query_segment_ids=opts.get("q_segment_ids"),
      key_value_segment_ids=opts.get("kv_segment_ids"),
      logits_soft_cap=opts.get("softcap"), sinks=opts.get("sinks"))
  ref_o32 = np.asarray(ref_o32)
  ref_lse = np.asarray(ref_lse).transpose(0, 2, 1)  # (B, N, Tq) like the kernel
  low_o = np.asarray(low_precision_o_with_options(q, k, v, scale=scale, mask=mask, opts=opts))
  low_err = float(np.max(np.abs(low_o - ref_o32))) if o.size else 0.0
  err = float(np.max(np.abs(o - ref_o32))) if o.size else 0.0
  assert err <= factor * low_err + atol, (
      f"o max error {err:.3g} > {factor} * {low_err:.3g} + {atol}")
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  live = np.isfinite(ref_lse)
  np.testing.assert_allclose(lse[live], ref_lse[live], rtol=1e-4, atol=1e-3)
  # Rows that see no key: o exactly 0.
  B, Tq, N, _ = q.shape
  keep = dense_mask(mask, Tq, k.shape[1],
                    query_seq_lengths=opts.get("q_lengths"),
                    key_value_seq_lengths=opts.get("kv_lengths"),
                    query_segment_ids=opts.get("q_segment_ids"),
                    key_value_segment_ids=opts.get("kv_segment_ids"))
  dead = ~np.asarray(jnp.broadcast_to(keep, (B, 1, Tq, k.shape[1])).any(-1))[:, 0]
  assert np.all(o[dead] == 0), "rows that see no key are not 0"
  return err, low_err


def run_interpret_opts(q, k, v, *, scale, mask, config=None, detect_races=False,
                       **opts):
  try:
    out = attention_forward(q, k, v, scale=scale, mask=mask, config=config,
                            interpret=interpret_params(detect_races), **opts)
    jax.block_until_ready(out)
  except Exception:
    interpret_pallas_call.reset_gpu_interpret_mode_state()
    raise
  return out


def assert_interpret_knob_close(q, k, v, *, scale, mask, config, field, **opts):
  """Interpret mode with ``config`` (whose bool ``field`` is on), race
  detection on: no race, the reference's rule, and the same config with
  ``field`` off within float32 summation order (o to 2e-2, lse to 1e-5): for
  knobs that skip only work on invisible keys."""
  o, lse = run_interpret_opts(q, k, v, scale=scale, mask=mask, config=config,
                              detect_races=True, **opts)
  assert not interpret_pallas_call.get_races().races_found
  assert_matches_opts(o, lse, q, k, v, scale=scale, mask=mask, **opts)
  o1, lse1 = run_interpret_opts(
      q, k, v, scale=scale, mask=mask,
      config=dataclasses.replace(config, **{field: False}), **opts)
  np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o1, np.float32),
                             atol=2e-2, rtol=0)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse1), atol=1e-5, rtol=0)


def _lengths(seed, B, T, lo=0):
  return jax.random.randint(jax.random.key(seed), (B,), lo, T + 1, jnp.int32)


def test_supported_features_names():
  assert SUPPORTED_FEATURES <= {"lengths", "segments", "softcap", "sinks"}
  assert {"lengths", "softcap", "sinks"} <= SUPPORTED_FEATURES


def test_option_argument_errors():
  x = jnp.zeros((2, 8, 2, 64), jnp.bfloat16)
  call = lambda **kw: attention_forward(x, x, x, scale=1.0, mask=NO_MASK,
                                        interpret=True, **kw)
  with pytest.raises(ValueError, match="q_lengths"):
    call(q_lengths=jnp.array([1, 2, 3], jnp.int32))
  with pytest.raises(ValueError, match="kv_lengths"):
    call(kv_lengths=jnp.array([1.0, 2.0]))
  with pytest.raises(ValueError, match="softcap"):
    call(softcap=0.0)
  with pytest.raises(ValueError, match="sinks"):
    call(sinks=jnp.zeros((3,)))
  with pytest.raises(ValueError, match="together"):
    call(q_segment_ids=jnp.zeros((2, 8), jnp.int32))


WL = MaskSpec(window_left=20, window_right=5)
WBR = MaskSpec(causal=True, alignment="bottom_right", window_left=30)

OPTION_CASES = [
    # id, B, Tq, Tk, N, K, D, dtype, mask, options (lengths as (q, kv) lists)
    ("len-none", 2, 150, 200, 1, 1, 64, jnp.bfloat16, NO_MASK,
     dict(q_lengths=[150, 37], kv_lengths=[101, 200])),
    ("len-tl", 2, 130, 200, 1, 1, 64, jnp.float16, CAUSAL_TL,
     dict(q_lengths=[90, 130], kv_lengths=[200, 65])),
    ("len-br-gqa", 2, 130, 200, 2, 1, 64, jnp.bfloat16, CAUSAL_BR,
     dict(q_lengths=[100, 7], kv_lengths=[150, 60])),
    ("len-br-q>kv", 1, 200, 130, 2, 1, 128, jnp.bfloat16, CAUSAL_BR,
     dict(q_lengths=[190], kv_lengths=[70])),
    ("kvlen-only", 2, 128, 256, 2, 2, 64, jnp.float16, CAUSAL_BR,
     dict(kv_lengths=[129, 64])),
    ("qlen-only", 2, 200, 128, 1, 1, 64, jnp.bfloat16, CAUSAL_BR,
     dict(q_lengths=[1, 199])),
    ("len-window", 2, 180, 220, 1, 1, 64, jnp.bfloat16, WL,
     dict(q_lengths=[170, 60], kv_lengths=[219, 100])),
    ("len-window-br", 2, 180, 220, 1, 1, 64, jnp.float16, WBR,
     dict(q_lengths=[170, 60], kv_lengths=[100, 219])),
    ("cap", 1, 130, 200, 2, 1, 64, jnp.bfloat16, NO_MASK, dict(softcap=2.0)),
    ("cap-br-len", 2, 130, 200, 2, 2, 64, jnp.float16, CAUSAL_BR,
     dict(softcap=5.0, q_lengths=[100, 130], kv_lengths=[150, 31])),
    ("cap-tl-window", 1, 200, 150, 1, 1, 128, jnp.bfloat16,
     MaskSpec(causal=True, window_left=40), dict(softcap=1.5)),
    ("sinks", 1, 130, 200, 4, 2, 64, jnp.bfloat16, NO_MASK,
     dict(sinks=[0.5, -1.0, 3.0, -jnp.inf])),
    ("sinks-br", 1, 200, 130, 2, 1, 64, jnp.float16, CAUSAL_BR,  # empty rows: lse = sink
     dict(sinks=[1.0, -2.0])),
    ("sinks-tl-len", 2, 130, 200, 2, 1, 64, jnp.bfloat16, CAUSAL_TL,
     dict(sinks=[4.0, 0.0], q_lengths=[120, 5], kv_lengths=[200, 0])),
    ("all", 2, 150, 190, 2, 1, 64, jnp.bfloat16, WBR,
     dict(softcap=3.0, sinks=[0.25, -0.5], q_lengths=[150, 40], kv_lengths=[77, 190])),
]


def _opts(opts):
  out = {}
  for name, val in opts.items():
    if name.endswith("lengths"):
      out[name] = jnp.asarray(val, jnp.int32)
    elif name == "sinks":
      out[name] = jnp.asarray(val, jnp.float32)
    else:
      out[name] = val
  return out


@pytest.mark.interpret
@pytest.mark.parametrize("case", OPTION_CASES, ids=[c[0] for c in OPTION_CASES])
def test_interpret_options_match_reference(case):
  _, B, Tq, Tk, N, K, D, dtype, mask, opts = case
  opts = _opts(opts)
  q, k, v = make_qkv(jax.random.key(Tq + 3 * Tk), B, Tq, Tk, N, K, D, dtype)
  scale = D ** -0.5 * (4.0 if "softcap" in opts else 1.0)  # make the cap bite
  o, lse = run_interpret_opts(q, k, v, scale=scale, mask=mask, **opts)
  assert o.shape == q.shape and lse.shape == (B, N, Tq)
  assert_matches_opts(o, lse, q, k, v, scale=scale, mask=mask, **opts)


SOFTMAX_FORMS = {"lazy-raw": dict(lazy_rescale=True, scale_first=False),
                 "lazy-scaled": dict(lazy_rescale=True, scale_first=True),
                 "every-tile-raw": dict(lazy_rescale=False, scale_first=False)}


@pytest.mark.interpret
@pytest.mark.parametrize("form", list(SOFTMAX_FORMS))
@pytest.mark.parametrize("case", [c for c in OPTION_CASES
                                  if c[0] in ("len-br-gqa", "sinks-br", "all")],
                         ids=lambda c: c[0])
def test_interpret_options_under_each_softmax_form(case, form):
  """The options of OPTION_CASES (lengths, empty rows with sinks, all at once)
  under the softmax forms forward_config does not pick at D=64."""
  _, B, Tq, Tk, N, K, D, dtype, mask, opts = case
  opts = _opts(opts)
  q, k, v = make_qkv(jax.random.key(Tq + 3 * Tk), B, Tq, Tk, N, K, D, dtype)
  scale = D ** -0.5 * (4.0 if "softcap" in opts else 1.0)
  config = dataclasses.replace(default_config(D, dtype, mask, Tq, Tk, interpret=True),
                               **SOFTMAX_FORMS[form])
  o, lse = run_interpret_opts(q, k, v, scale=scale, mask=mask, config=config, **opts)
  assert_matches_opts(o, lse, q, k, v, scale=scale, mask=mask, **opts)


@pytest.mark.interpret
def test_interpret_lengths_equal_to_t_are_bitwise_no_lengths_e11():
  """E11: lengths equal to T give bitwise the result of no lengths."""
  for T, mask in ((5, CAUSAL_BR), (130, CAUSAL_TL)):
    q, k, v = make_qkv(jax.random.key(T), 1, T, T, 2, 1, 64, jnp.bfloat16)
    o, lse = run_interpret(q, k, v, scale=0.125, mask=mask)
    full = jnp.array([T], jnp.int32)
    o2, lse2 = run_interpret_opts(q, k, v, scale=0.125, mask=mask,
                                  q_lengths=full, kv_lengths=full)
    np.testing.assert_array_equal(np.asarray(o2, np.float32), np.asarray(o, np.float32))
    np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))


@pytest.mark.interpret
# Float16 values whose exp2 round trip (sink * log2(e), then * ln 2) was 1
# ulp off in float32: the fresh-user fuzz's (thirty-eighth session).
@pytest.mark.parametrize("sinks", [None, [0.7, -0.3], [-3.939, 0.4426]],
                         ids=["plain", "sinks", "sinks_off_by_an_ulp"])
def test_interpret_rows_that_see_no_key_e06(sinks):
  _check_rows_that_see_no_key(sinks, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("sinks", [None, [-3.939, 0.4426]], ids=["plain", "sinks"])
def test_gpu_rows_that_see_no_key_lengths_e06(sinks):
  _check_rows_that_see_no_key(sinks, interpret=False)


def _check_rows_that_see_no_key(sinks, interpret):
  """E06 (lengths): padded rows and rows of a zero-length key row: o 0, lse
  -inf (or exactly the sink)."""
  q, k, v = make_qkv(jax.random.key(6), 2, 140, 96, 2, 1, 64, jnp.bfloat16)
  opts = _opts(dict(q_lengths=[70, 140], kv_lengths=[96, 0]))
  if sinks is not None:
    opts["sinks"] = jnp.asarray(np.float16(sinks), jnp.float32)
  o, lse = _forward_on(interpret, q, k, v, scale=0.125, mask=CAUSAL_BR, **opts)
  o, lse = np.asarray(o, np.float32), np.asarray(lse)
  assert np.all(o[0, 70:] == 0) and np.all(o[1] == 0)
  expect = -np.inf if sinks is None else np.asarray(opts["sinks"])[:, None]
  np.testing.assert_array_equal(lse[0, :, 70:], np.broadcast_to(expect, (2, 70)))
  np.testing.assert_array_equal(lse[1], np.broadcast_to(expect, (2, 140)))
  assert_matches_opts(o, lse, q, k, v, scale=0.125, mask=CAUSAL_BR, **opts)


def _forward_on(interpret, *args, **kw):
  """The forward kernel in GPU interpret mode on the CPU, or compiled on the GPU."""
  run = run_interpret_opts if interpret else attention_forward
  return run(*args, **kw)


def _check_nan_sink(T, D, interpret):
  """A NaN sink is data: its head's o and lse are NaN on the kernel and the
  XLA path alike; the other head is untouched."""
  q, k, v = make_qkv(jax.random.key(9), 1, T, T, 2, 1, D, jnp.bfloat16)
  sinks = jnp.asarray([0.5, jnp.nan], jnp.float32)
  o, lse = _forward_on(interpret, q, k, v, scale=0.125, mask=NO_MASK, sinks=sinks)
  o, lse = np.asarray(o, np.float32), np.asarray(lse)
  assert np.isnan(o[:, :, 1]).all() and np.isnan(lse[:, 1]).all()
  assert np.isfinite(o[:, :, 0]).all() and np.isfinite(lse[:, 0]).all()
  ref_o, ref_lse = flash3.dot_product_attention(
      q, k, v, scale=0.125, sinks=sinks, implementation="xla", return_residual=True)
  assert np.isnan(np.asarray(ref_o, np.float32)[:, :, 1]).all()
  assert np.isnan(np.asarray(ref_lse)[:, :, 1]).all()


@pytest.mark.interpret
def test_interpret_nan_sink_poisons_its_head_like_the_xla_path():
  _check_nan_sink(64, 64, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("T,D", [(64, 64), (4096, 128)])  # persistent, grid
def test_gpu_nan_sink_poisons_its_head_like_the_xla_path(T, D):
  _check_nan_sink(T, D, interpret=False)


def _check_huge_sinks(T, D, interpret):
  """Sinks past float32's max / log2(e) (about 2.36e38) overflow the exp2
  domain to +inf: o is 0 and the lse is the sink, as on the XLA path, not
  NaN (exp2(inf - inf)); the rows past q_len too. A sink of 1e38 stays
  finite there and must give the same."""
  q, k, v = make_qkv(jax.random.key(19), 2, T, T, 4, 2, D, jnp.bfloat16)
  sinks = jnp.asarray([3.4e38, jnp.inf, 1e38, 0.5], jnp.float32)
  lengths = dict(q_lengths=jnp.asarray([T, T // 2], jnp.int32))
  o, lse = _forward_on(interpret, q, k, v, scale=0.125, mask=CAUSAL_BR, sinks=sinks,
                       **lengths)
  o, lse = np.asarray(o, np.float32), np.asarray(lse)
  ref_o, ref_lse = flash3.dot_product_attention(
      q, k, v, scale=0.125, sinks=sinks, is_causal=True,
      causal_alignment="bottom_right", query_seq_lengths=lengths["q_lengths"],
      implementation="xla", return_residual=True)
  ref_o, ref_lse = np.asarray(ref_o, np.float32), np.asarray(ref_lse).transpose(0, 2, 1)
  assert not np.isnan(o).any() and not np.isnan(lse).any()
  np.testing.assert_array_equal(o[:, :, :3], 0.0)
  np.testing.assert_array_equal(lse[:, :3], ref_lse[:, :3])
  np.testing.assert_array_equal(lse[:, :3], np.broadcast_to(
      np.asarray(sinks[:3])[None, :, None], lse[:, :3].shape))
  np.testing.assert_allclose(o[:, :, 3], ref_o[:, :, 3], atol=2e-2)
  np.testing.assert_allclose(lse[:, 3], ref_lse[:, 3], atol=1e-3)


@pytest.mark.interpret
def test_interpret_sinks_past_exp2_range_give_the_sink_not_nan():
  _check_huge_sinks(64, 64, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("T,D", [(64, 64), (4096, 128)])  # persistent, grid
def test_gpu_sinks_past_exp2_range_give_the_sink_not_nan(T, D):
  _check_huge_sinks(T, D, interpret=False)


def _poison_past(x, lengths):
  """x with NaN, Inf and 1e30 (in turn) in the rows at or past each batch row's length."""
  bad = jnp.array([jnp.nan, jnp.inf, 1e30], x.dtype)
  idx = jnp.arange(x.shape[1])
  past = (idx[None, :] >= lengths[:, None])[:, :, None, None]
  return jnp.where(past, bad[idx % 3][None, :, None, None], x)


@pytest.mark.interpret
def test_interpret_nan_past_lengths_changes_nothing_e07():
  """E07 (lengths): NaN/Inf/1e30 in q rows past q_len and k/v rows past kv_len."""
  B, Tq, Tk = 2, 130, 200
  q, k, v = make_qkv(jax.random.key(70), B, Tq, Tk, 2, 1, 64, jnp.bfloat16)
  opts = _opts(dict(q_lengths=[100, 61], kv_lengths=[150, 37], softcap=4.0,
                    sinks=[0.5, 1.5]))

  o, lse = run_interpret_opts(q, k, v, scale=0.125, mask=CAUSAL_BR, **opts)
  o2, lse2 = run_interpret_opts(
      _poison_past(q, opts["q_lengths"]), _poison_past(k, opts["kv_lengths"]),
      _poison_past(v, opts["kv_lengths"]), scale=0.125, mask=CAUSAL_BR, **opts)
  np.testing.assert_array_equal(np.asarray(o2, np.float32), np.asarray(o, np.float32))
  np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))
  assert_matches_opts(o, lse, q, k, v, scale=0.125, mask=CAUSAL_BR, **opts)


def _poison_outside(x, kept):
  """x with NaN, Inf and 1e30 (in turn) in the rows where ``kept`` (B, T) is False."""
  bad = jnp.array([jnp.nan, jnp.inf, 1e30], x.dtype)
  idx = jnp.arange(x.shape[1])
  return jnp.where(kept[:, :, None, None], x, bad[idx % 3][None, :, None, None])


@pytest.mark.interpret
def test_interpret_nan_outside_reach_changes_nothing_e07():
  """E07 at both ends of the kept keys: with a window under the per-batch
  bottom_right shift, keys before the first valid query's reach (inside
  kv_len) and past kv_len hold NaN/Inf/1e30; the kernel's first and last key
  tiles (end_tiles.py) must bring both to P @ V as 0."""
  from flash3.visibility import keys_in_reach
  B, Tq, Tk = 2, 64, 300
  q, k, v = make_qkv(jax.random.key(71), B, Tq, Tk, 2, 1, 64, jnp.bfloat16)
  opts = _opts(dict(q_lengths=[40, 64], kv_lengths=[290, 201]))
  mask = MaskSpec(causal=True, alignment="bottom_right", window_left=30)
  kept = keys_in_reach(mask, opts["q_lengths"], opts["kv_lengths"], Tk)
  # Both ends cut inside a tile of 64 keys (lo = 220 and 107, hi = 290 and 201).
  lo = np.argmax(np.asarray(kept), axis=1)
  assert list(lo) == [220, 107], lo
  o, lse = run_interpret_opts(q, k, v, scale=0.125, mask=mask, **opts)
  o2, lse2 = run_interpret_opts(q, _poison_outside(k, kept), _poison_outside(v, kept),
                                scale=0.125, mask=mask, **opts)
  np.testing.assert_array_equal(np.asarray(o2, np.float32), np.asarray(o, np.float32))
  np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))
  assert_matches_opts(o, lse, q, k, v, scale=0.125, mask=mask, **opts)


@pytest.mark.interpret
def test_interpret_kv_lengths_only_e13():
  """E13: key_value_seq_lengths only, B=8, T=128."""
  kl = jnp.array([24, 125, 53, 28, 77, 96, 13, 114], jnp.int32)
  q, k, v = make_qkv(jax.random.key(13), 8, 128, 128, 1, 1, 64, jnp.bfloat16)
  for mask in (NO_MASK, CAUSAL_BR):
    o, lse = run_interpret_opts(q, k, v, scale=0.125, mask=mask, kv_lengths=kl)
    assert_matches_opts(o, lse, q, k, v, scale=0.125, mask=mask, kv_lengths=kl)


@pytest.mark.interpret
def test_interpret_zero_lengths_e15():
  """E15: zero-length queries and keys in a batch: no hang, no NaN, empty-row convention."""
  q, k, v = make_qkv(jax.random.key(15), 3, 64, 72, 1, 1, 64, jnp.float16)
  opts = _opts(dict(q_lengths=[0, 64, 10], kv_lengths=[72, 0, 1]))
  o, lse = run_interpret_opts(q, k, v, scale=0.125, mask=NO_MASK, **opts)
  assert np.all(np.asarray(o[:2], np.float32) == 0)
  assert np.all(np.isneginf(np.asarray(lse[:2])))
  assert_matches_opts(o, lse, q, k, v, scale=0.125, mask=NO_MASK, **opts)


@pytest.mark.interpret
def test_interpret_window_edges_with_lengths_e12():
  """E12 with lengths: window edges under the per-batch bottom_right shift."""
  Tq, Tk = 100, 150
  q, k, v = make_qkv(jax.random.key(12), 2, Tq, Tk, 1, 1, 64, jnp.bfloat16)
  opts = _opts(dict(q_lengths=[100, 60], kv_lengths=[90, 150]))
  for left, right, causal in ((0, 0, False), (1, 1, True), (89, 0, False), (150, 151, True)):
    mask = MaskSpec(causal=causal, alignment="bottom_right", window_left=left,
                    window_right=right)
    o, lse = run_interpret_opts(q, k, v, scale=0.125, mask=mask, **opts)
    assert_matches_opts(o, lse, q, k, v, scale=0.125, mask=mask, **opts)


@pytest.mark.interpret
def test_interpret_options_no_races():
  q, k, v = make_qkv(jax.random.key(5), 2, 130, 300, 1, 1, 64, jnp.bfloat16)
  opts = _opts(dict(q_lengths=[130, 70], kv_lengths=[200, 300], softcap=3.0,
                    sinks=[0.5]))
  o, lse = run_interpret_opts(q, k, v, scale=0.125, mask=CAUSAL_BR,
                              config=ForwardConfig(block_kv=64, num_stages=2),
                              detect_races=True, **opts)
  assert not interpret_pallas_call.get_races().races_found
  assert_matches_opts(o, lse, q, k, v, scale=0.125, mask=CAUSAL_BR, **opts)


def test_options_lower_for_the_gpu():
  """Cross-lowers the GPU (register-operand) path on any machine: catches
  Mosaic GPU lowering errors the interpreter cannot see."""
  for D, dtype in ((64, jnp.bfloat16), (256, jnp.float16)):
    q, k, v = make_qkv(jax.random.key(0), 2, 200, 300, 2, 1, D, dtype)
    opts = _opts(dict(q_lengths=[200, 7], kv_lengths=[150, 300], softcap=5.0,
                      sinks=[0.1, 0.2]))
    f = lambda q, k, v, o=opts: attention_forward(q, k, v, scale=0.1, mask=WBR, **o)
    text = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


# ----------------------------------------------------------------------------
# Issue 6: segment ids (packed documents)
# ----------------------------------------------------------------------------

from flash3.kernels.forward import _segment_tile_ranges  # noqa: E402


def _packed(lengths_per_row, T):
  """(B, T) int32 ids from document lengths; the rest of a row is one more id."""
  rows = []
  for lens in lengths_per_row:
    ids = np.concatenate([np.full(n, i) for i, n in enumerate(lens)] + [np.zeros(0)])
    ids = np.concatenate([ids, np.full(T - len(ids), len(lens))])[:T]
    rows.append(ids)
  return jnp.asarray(np.stack(rows), jnp.int32)


@pytest.mark.parametrize("sorted_ids", [True, False])
def test_segment_tile_ranges_are_a_superset(sorted_ids):
  """Every visible (query, key) pair lies in [lo, hi); every pair of a "full" tile is visible."""
  rng = np.random.default_rng(0)
  B, Tq, Tk, bq, bk = 3, 300, 520, 64, 128
  if sorted_ids:
    q_ids = np.sort(rng.integers(0, 6, (B, Tq)), axis=1)
    k_ids = np.sort(rng.integers(0, 6, (B, Tk)), axis=1)
    q_ids[0], k_ids[0] = 0, 0  # one document: every tile full
  else:
    q_ids, k_ids = rng.integers(0, 4, (B, Tq)), rng.integers(0, 4, (B, Tk))
  nq, nk = 2 * -(-Tq // (2 * bq)), -(-Tk // bk)
  r = np.asarray(_segment_tile_ranges(jnp.asarray(q_ids, jnp.int32), jnp.asarray(k_ids, jnp.int32),
                                      block_q=bq, block_kv=bk, num_q_tiles=nq, num_kv_tiles=nk))
  assert r.shape == (B, nq, 4)
  n_full = 0
  for b in range(B):
    for i in range(nq):
      qi = q_ids[b, i * bq:(i + 1) * bq]
      for j in range(nk):
        kj = k_ids[b, j * bk:(j + 1) * bk]
        vis = (qi[:, None] == kj[None, :])
        if vis.any():
          assert r[b, i, 0] <= j < r[b, i, 1], (b, i, j)
        if r[b, i, 2] <= j < r[b, i, 3]:
          assert vis.all(), (b, i, j)
          n_full += 1
  if sorted_ids:
    assert n_full >= (Tq // bq) * (Tk // bk)  # batch row 0 is all full
  # The tiles skipped by [lo, hi) are many for sorted documents.


SEGMENT_CASES = [
    # id, B, Tq, Tk, N, K, D, dtype, mask, q docs, kv docs (per batch row), extra opts
    ("one-doc", 1, 130, 130, 1, 1, 64, jnp.bfloat16, CAUSAL_TL, [[130]], [[130]], {}),
    ("two-docs-across-blocks", 2, 200, 200, 2, 1, 64, jnp.float16, CAUSAL_TL,
     [[70, 130], [150, 50]], [[70, 130], [150, 50]], {}),
    ("many-len1-docs", 1, 140, 140, 2, 2, 64, jnp.bfloat16, CAUSAL_BR,
     [[1] * 20 + [3, 60, 1, 1]], [[1] * 20 + [3, 60, 1, 1]], {}),
    ("trailing-pad-gqa", 2, 256, 256, 4, 1, 64, jnp.bfloat16, NO_MASK,
     [[100, 100], [30, 30, 30]], [[100, 100], [30, 30, 30]], {}),
    ("cross-q!=kv-br", 1, 130, 250, 2, 1, 128, jnp.bfloat16, CAUSAL_BR,
     [[40, 90]], [[100, 150]], {}),
    ("window-len", 2, 200, 220, 1, 1, 64, jnp.float16, WBR,
     [[64, 64, 72], [200]], [[70, 70, 80], [220]],
     dict(q_lengths=[190, 100], kv_lengths=[220, 150])),
    ("all", 2, 150, 190, 2, 1, 64, jnp.bfloat16, CAUSAL_BR,
     [[50, 100], [10, 140]], [[60, 130], [20, 170]],
     dict(softcap=3.0, sinks=[0.25, -0.5], q_lengths=[150, 40], kv_lengths=[150, 190])),
]


@pytest.mark.interpret
@pytest.mark.parametrize("case", SEGMENT_CASES, ids=[c[0] for c in SEGMENT_CASES])
def test_interpret_segments_match_reference_e14(case):
  """E14: packed rows of 1, 2 and many documents, length-1 documents, documents
  across tile boundaries, a trailing padding id, causal, GQA, with the other options."""
  _, B, Tq, Tk, N, K, D, dtype, mask, qdocs, kdocs, opts = case
  opts = _opts(opts)
  opts["q_segment_ids"] = _packed(qdocs, Tq)
  opts["kv_segment_ids"] = _packed(kdocs, Tk)
  q, k, v = make_qkv(jax.random.key(Tq + 5 * Tk), B, Tq, Tk, N, K, D, dtype)
  scale = D ** -0.5
  o, lse = run_interpret_opts(q, k, v, scale=scale, mask=mask, **opts)
  assert_matches_opts(o, lse, q, k, v, scale=scale, mask=mask, **opts)


@pytest.mark.interpret
def test_interpret_segments_unsorted_and_empty_e06_e15():
  """Unsorted ids; a query document with no keys (E15): o 0, lse -inf (E06)."""
  Tq, Tk = 130, 200
  q, k, v = make_qkv(jax.random.key(16), 1, Tq, Tk, 2, 1, 64, jnp.bfloat16)
  qs = jnp.asarray(np.arange(Tq) % 4, jnp.int32)[None]  # id 3: no key has it
  ks = jnp.asarray(np.arange(Tk) % 3, jnp.int32)[None]
  o, lse = run_interpret_opts(q, k, v, scale=0.125, mask=CAUSAL_TL,
                              q_segment_ids=qs, kv_segment_ids=ks)
  assert np.all(np.isneginf(np.asarray(lse)[0, :, 3::4]))
  assert np.all(np.asarray(o, np.float32)[0, 3::4] == 0)
  assert_matches_opts(o, lse, q, k, v, scale=0.125, mask=CAUSAL_TL,
                      q_segment_ids=qs, kv_segment_ids=ks)


@pytest.mark.interpret
def test_interpret_segments_nan_in_unseen_key_tiles_e07():
  """E07 (segments): NaN/Inf in key tiles no query document touches change nothing."""
  Tq, Tk = 128, 384
  q, k, v = make_qkv(jax.random.key(17), 1, Tq, Tk, 1, 1, 64, jnp.bfloat16)
  qs = _packed([[60, 68]], Tq)
  ks = _packed([[60, 68, 256]], Tk)  # keys 128..383: id 2, seen by no query
  bad = jnp.where((jnp.arange(Tk) >= 128)[None, :, None, None], jnp.nan, 1.0)
  # 128-key tiles: keys 128..383 fill whole tiles that no query's document
  # touches (a NaN sharing a tile with seen keys is the documented limitation).
  config = ForwardConfig(block_kv=128, num_stages=2)
  o, lse = run_interpret_opts(q, k, v, scale=0.125, mask=NO_MASK, config=config,
                              q_segment_ids=qs, kv_segment_ids=ks)
  o2, lse2 = run_interpret_opts(q, (k * bad).astype(k.dtype), (v * bad).astype(v.dtype),
                                scale=0.125, mask=NO_MASK, config=config,
                                q_segment_ids=qs, kv_segment_ids=ks)
  np.testing.assert_array_equal(np.asarray(o2, np.float32), np.asarray(o, np.float32))
  np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))


def test_segments_lower_for_the_gpu():
  for D, dtype in ((128, jnp.bfloat16), (256, jnp.float16)):
    q, k, v = make_qkv(jax.random.key(0), 2, 200, 300, 2, 1, D, dtype)
    ids = _packed([[50, 150], [200]], 200), _packed([[80, 220], [300]], 300)
    f = lambda q, k, v: attention_forward(
        q, k, v, scale=0.1, mask=CAUSAL_BR, q_segment_ids=ids[0],
        kv_segment_ids=ids[1], q_lengths=jnp.array([200, 100], jnp.int32))
    text = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


# ----------------------------------------------------------------------------
# Issue 6 on the GPU (H100/H200): every option at larger shapes
# ----------------------------------------------------------------------------

GPU_OPTION_CASES = [
    # id, B, Tq, Tk, N, K, mask, options (segments as document lengths)
    ("len-br", 3, 1000, 1200, 4, 2, CAUSAL_BR,
     dict(q_lengths=[1000, 333, 0], kv_lengths=[1200, 901, 64])),
    ("len-tl-window", 2, 777, 1500, 2, 1, MaskSpec(causal=True, window_left=256),
     dict(q_lengths=[700, 777], kv_lengths=[1500, 129])),
    ("kvlen-e13", 8, 128, 128, 2, 1, NO_MASK,
     dict(kv_lengths=[24, 125, 53, 28, 77, 96, 13, 114])),
    ("cap", 1, 1024, 1024, 4, 4, CAUSAL_TL, dict(softcap=30.0)),
    ("cap-len", 2, 513, 2049, 2, 1, CAUSAL_BR,
     dict(softcap=5.0, q_lengths=[513, 200], kv_lengths=[2049, 300])),
    ("sinks", 1, 1024, 1500, 8, 2, NO_MASK,
     dict(sinks=[0.0, 1.0, -1.0, 5.0, -jnp.inf, 2.0, 3.0, -3.0])),
    ("sinks-br-len", 2, 900, 600, 2, 1, CAUSAL_BR,
     dict(sinks=[1.0, -2.0], q_lengths=[900, 300], kv_lengths=[600, 10])),
    ("segments", 2, 2048, 2048, 4, 2, CAUSAL_TL,
     dict(segments=([[512] * 4, [1000, 1, 1, 46, 1000]],) * 2)),
    ("segments-unequal", 1, 1000, 3000, 2, 1, CAUSAL_BR,
     dict(segments=([[300, 300, 400]], [[1000, 1000, 1000]]))),
    ("all", 2, 1500, 1500, 4, 1, MaskSpec(causal=True, alignment="bottom_right", window_left=300),
     dict(segments=([[700, 800], [64] * 23],) * 2, softcap=10.0,
          sinks=[0.5, -0.5, 1.0, 0.0], q_lengths=[1500, 1000], kv_lengths=[1400, 1500])),
]


def _expand_opts(opts, Tq, Tk):
  opts = dict(opts)
  segs = opts.pop("segments", None)
  opts = _opts(opts)
  if segs is not None:
    opts["q_segment_ids"] = _packed(segs[0], Tq)
    opts["kv_segment_ids"] = _packed(segs[1], Tk)
  return opts


def case_inputs(case, seed_k):
  """A bitwise-comparison case's (q, k, v, mask, fields, opts, scale), bfloat16.

  case is (id, B, Tq, Tk, N, K, D, mask, config fields, options); seed_k spreads the
  key's seed over Tk so that two test files draw different inputs. A soft cap gets
  scores 4x larger so that the tanh bends.
  """
  _, B, Tq, Tk, N, K, D, mask, fields, opts = case
  opts = _expand_opts(opts, Tq, Tk)
  q, k, v = make_qkv(jax.random.key(Tq + seed_k * Tk + D), B, Tq, Tk, N, K, D,
                     jnp.bfloat16)
  scale = D ** -0.5 * (4.0 if "softcap" in opts else 1.0)
  return q, k, v, mask, fields, opts, scale


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("case", GPU_OPTION_CASES, ids=[c[0] for c in GPU_OPTION_CASES])
def test_gpu_options_match_reference(case, dtype, D):
  _, B, Tq, Tk, N, K, mask, opts = case
  opts = _expand_opts(opts, Tq, Tk)
  q, k, v = make_qkv(jax.random.key(Tq + Tk + D), B, Tq, Tk, N, K, D, dtype)
  scale = D ** -0.5 * (4.0 if "softcap" in opts else 1.0)
  o, lse = attention_forward(q, k, v, scale=scale, mask=mask, **opts)
  assert_matches_opts(o, lse, q, k, v, scale=scale, mask=mask, **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("persistent", [False, True])
def test_gpu_nan_outside_reach_changes_nothing_e07(D, persistent):
  """The interpret test's case on the GPU: both boundary tiles of V cut
  through poisoned keys (default tiles, grid and persistent)."""
  from flash3.visibility import keys_in_reach
  B, Tq, Tk = 2, 64, 300
  q, k, v = make_qkv(jax.random.key(72), B, Tq, Tk, 2, 1, D, jnp.bfloat16)
  opts = _opts(dict(q_lengths=[40, 64], kv_lengths=[290, 201]))
  mask = MaskSpec(causal=True, alignment="bottom_right", window_left=30)
  config = dataclasses.replace(default_config(D, jnp.bfloat16, mask, Tq, Tk),
                               persistent=persistent)
  kept = keys_in_reach(mask, opts["q_lengths"], opts["kv_lengths"], Tk)
  o, lse = attention_forward(q, k, v, scale=0.125, mask=mask, config=config, **opts)
  o2, lse2 = attention_forward(q, _poison_outside(k, kept), _poison_outside(v, kept),
                               scale=0.125, mask=mask, config=config, **opts)
  np.testing.assert_array_equal(np.asarray(o2, np.float32), np.asarray(o, np.float32))
  np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))
  assert_matches_opts(o, lse, q, k, v, scale=0.125, mask=mask, **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128, 256])
def test_gpu_nan_past_lengths_and_unseen_tiles_e07(D):
  """E07: NaN/Inf/1e30 in q/k/v past the lengths change no valid output."""
  B, Tq, Tk = 2, 700, 1100
  q, k, v = make_qkv(jax.random.key(77), B, Tq, Tk, 2, 1, D, jnp.bfloat16)
  opts = _opts(dict(q_lengths=[650, 129], kv_lengths=[1000, 65], softcap=20.0,
                    sinks=[0.5, 1.5]))

  o, lse = attention_forward(q, k, v, scale=0.1, mask=CAUSAL_BR, **opts)
  o2, lse2 = attention_forward(_poison_past(q, opts["q_lengths"]), _poison_past(k, opts["kv_lengths"]),
                               _poison_past(v, opts["kv_lengths"]), scale=0.1, mask=CAUSAL_BR, **opts)
  np.testing.assert_array_equal(np.asarray(o2, np.float32), np.asarray(o, np.float32))
  np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 3, 5, 1000])
def test_gpu_lengths_equal_to_t_bitwise_e11(T):
  q, k, v = make_qkv(jax.random.key(T), 1, T, T, 2, 1, 64, jnp.bfloat16)
  full = jnp.array([T], jnp.int32)
  o, lse = attention_forward(q, k, v, scale=0.125, mask=CAUSAL_BR)
  o2, lse2 = attention_forward(q, k, v, scale=0.125, mask=CAUSAL_BR,
                               q_lengths=full, kv_lengths=full)
  assert bool(jnp.all(o2 == o)), "o differs"
  assert bool(jnp.all(lse2 == lse)), "lse differs"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_window_edges_with_lengths_e12(causal):
  Tq, Tk = 200, 150
  q, k, v = make_qkv(jax.random.key(12), 2, Tq, Tk, 1, 1, 64, jnp.bfloat16)
  opts = _opts(dict(q_lengths=[200, 90], kv_lengths=[100, 150]))
  for left, right in ((0, 0), (1, 1), (0, Tk + 1), (Tk - 1, 0), (Tk, 1), (Tk + 1, Tk)):
    mask = MaskSpec(causal=causal, alignment="bottom_right", window_left=left,
                    window_right=right)
    o, lse = attention_forward(q, k, v, scale=0.125, mask=mask, **opts)
    assert_matches_opts(o, lse, q, k, v, scale=0.125, mask=mask, **opts)
