"""``BackwardConfig.fuse_delta``: the dq kernel forms delta = rowsum(o * do)
from o tiles and writes it for the dk/dv kernel (no XLA pass over o and do).

Interpret-mode tests run both kernels on the CPU: the gradients against the
float32 reference (FlashAttention-3's rule, as in test_backward_kernel.py), the
kernel's delta against XLA's (0 on rows that see nothing), NaN in o where no
row reads it, and races. GPU tests repeat the gradients on an H200.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax.experimental.pallas.mosaic_gpu as plgpu
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

from flash3.kernels import backward, backward_dq
from flash3.kernels.backward import BackwardConfig
from flash3.kernels.config import SMEM_LIMIT_BYTES
from flash3.visibility import MaskSpec

from smem_count import lowered_smem_totals
from test_backward_kernel import (BF16, CAUSAL_BR, CAUSAL_TL, F16, NO_MASK, _e07_lengths_case,
                                  _packed, check, check_opts, kernel_inputs, make_inputs)


def fused(D, Tq, Tk, mask, *, interpret=True, packed=False, **changes):
  """The heuristic's config with ``fuse_delta``; the dq ring shrunk until the
  o tile fits too (interpret mode stages ds in shared memory as well)."""
  base = BackwardConfig.heuristic(D, Tq, Tk, mask, interpret=interpret, packed=packed)
  config = dataclasses.replace(base, fuse_delta=True, num_stages_dkv=base.stages_dkv,
                               **changes)
  while (config.smem_bytes(D, 2, interpret=interpret)[0] > SMEM_LIMIT_BYTES
         and config.num_stages > 1):
    config = dataclasses.replace(config, num_stages=config.num_stages - 1)
  config.check_fits(D, 2, interpret=interpret)
  return config


def test_config_rules():
  assert not BackwardConfig().fuse_delta  # the heuristic's choice, not the field's
  with pytest.raises(ValueError, match="fuse_delta=True needs deterministic=True"):
    BackwardConfig(fuse_delta=True, deterministic=False, block_q_dkv=64)
  # A dk/dv query tile of 128 rows over a dq grid of 64 rows per CTA would
  # read delta rows no dq CTA writes.
  with pytest.raises(ValueError, match="block_q_dkv=128"):
    BackwardConfig(fuse_delta=True, compute_wgs_dq=1, block_q_dq=64, block_q_dkv=128)
  with pytest.raises(ValueError, match="fuse_delta"):
    BackwardConfig(fuse_delta=1)
  # One (block_q_dq, D) o tile per dq warpgroup (dlse loads into delta's row).
  plain, fuse = BackwardConfig(), BackwardConfig(fuse_delta=True)
  assert fuse.smem_bytes(128)[0] - plain.smem_bytes(128)[0] == 2 * 64 * 128 * 2
  assert fuse.smem_bytes(128)[1] == plain.smem_bytes(128)[1]
  # The GPU defaults still fit with it at every native head_dim.
  for D in (64, 128, 256):
    for mask in (NO_MASK, CAUSAL_BR):
      config = dataclasses.replace(BackwardConfig.heuristic(D, 4096, 4096, mask),
                                   fuse_delta=True)
      config.check_fits(D, 2)


CASES = [
    # B, Tq, Tk, N, K, D, dtype, mask, do_ones
    (1, 200, 150, 2, 1, 64, BF16, CAUSAL_BR, False),   # dead rows, GQA, ragged
    (2, 96, 130, 2, 1, 128, F16, CAUSAL_TL, False),    # D 128, batch 2
    (1, 77, 190, 3, 1, 64, BF16, CAUSAL_BR, True),     # GQA 3, do = ones
    (1, 72, 130, 2, 1, 256, F16, CAUSAL_BR, False),    # D 256: one dq warpgroup
    (1, 190, 210, 1, 1, 64, F16, MaskSpec(window_left=40, window_right=10), False),
    (1, 5, 3, 1, 1, 64, BF16, CAUSAL_BR, False),       # tiny
    (1, 70, 90, 2, 2, 40, F16, NO_MASK, False),        # D 40: padded to 64
]


@pytest.mark.interpret
@pytest.mark.parametrize("B,Tq,Tk,N,K,D,dtype,mask,do_ones", CASES)
def test_interpret_matches_reference(B, Tq, Tk, N, K, D, dtype, mask, do_ones):
  config = fused(max(D, 64), Tq, Tk, mask)
  check(B, Tq, Tk, N, K, D, dtype, mask, do_ones=do_ones, config=config,
        interpret=True, seed=Tq + 2 * Tk)


def _deltas(B, Tq, Tk, N, K, D, mask, config, *, o_fn=None, dlse=None):
  """(the dq kernel's delta, XLA's delta, lse2, dq fused, dq from XLA's delta);
  both deltas with ``dlse`` (B, N, Tq) subtracted when given."""
  q, k, v, do = make_inputs(jax.random.key(Tq), B, Tq, Tk, N, K, D, BF16)
  o, lse = kernel_inputs(q, k, v, do, scale=0.125, mask=mask)
  o = o if o_fn is None else o_fn(o, lse)
  pad_to = config.block_q_dq * config.compute_wgs_dq
  lse2, _ = backward.backward_residuals(o, lse, do, pad_to, fused=True)
  dlse2 = None if dlse is None else backward.pad_rows(dlse, lse2.shape[2], 0.0)
  _, delta = backward.backward_residuals(o, lse, do, pad_to, dlse=dlse)
  delta = jnp.where(jnp.isinf(lse2), 0.0, delta)  # as the kernel (and lengths) select
  kwargs = dict(q_len=Tq, kv_len=Tk, scale=0.125, mask=mask, config=config,
                interpret=plgpu.InterpretGPUParams(detect_races=True))
  dq, got = backward_dq.dq_call(q, k, v, do, lse2, None, o=o, dlse=dlse2, **kwargs)
  jax.block_until_ready(got)
  assert not interpret_pallas_call.get_races().races_found, "race in the dq kernel"
  dq_xla = backward_dq.dq_call(q, k, v, do, lse2, delta, **kwargs)
  return np.asarray(got), np.asarray(delta), np.asarray(lse2), dq, dq_xla


@pytest.mark.interpret
@pytest.mark.parametrize("mask,Tq,Tk,with_dlse", [(CAUSAL_BR, 200, 150, False),
                                                  (NO_MASK, 136, 72, False),
                                                  (CAUSAL_BR, 200, 150, True)])
def test_interpret_delta_equals_xla(mask, Tq, Tk, with_dlse):
  """The kernel's delta is XLA's rowsum(o * do) - dlse up to float32
  summation order, exactly 0 where lse2 is +inf (dead and padded rows), and
  dq is the same as from XLA's delta; no races between warpgroups and the
  TMA (interpret mode checks at warpgroup level; dlse loads into the row
  buffer that delta is stored from, whose ordering across the threads of one
  warpgroup is compute-sanitizer's part: scripts/racecheck.py --only delta)."""
  config = fused(64, Tq, Tk, mask)
  dlse = jax.random.normal(jax.random.key(9), (1, 2, Tq)) if with_dlse else None
  got, want, lse2, dq, dq_xla = _deltas(1, Tq, Tk, 2, 1, 64, mask, config, dlse=dlse)
  assert got.shape == lse2.shape == want.shape
  dead = np.isinf(lse2)
  assert dead[..., Tq:].all()
  if mask is CAUSAL_BR:  # Tq > Tk: the first Tq - Tk rows see no key
    assert dead[..., :Tq - Tk].all() and not dead[..., Tq - Tk:Tq].any()
  assert not got[dead].any()
  live = ~dead
  assert np.abs(got[live]).max() > 1.0  # a real delta, not zeros
  np.testing.assert_allclose(got[live], want[live], rtol=1e-5,
                             atol=1e-5 * np.abs(want).max())
  np.testing.assert_allclose(np.asarray(dq, np.float32), np.asarray(dq_xla, np.float32),
                             rtol=2e-2, atol=2e-2 * float(np.abs(np.asarray(
                                 dq_xla, np.float32)).max()))


@pytest.mark.interpret
def test_interpret_nan_in_o_of_dead_rows():
  """NaN in o on rows that see no key (they have lse = -inf) reaches no
  gradient: the kernel writes delta 0 there, and p = 0 keeps them out."""
  mask, Tq, Tk = CAUSAL_BR, 200, 150
  config = fused(64, Tq, Tk, mask)

  def poison(o, lse):
    dead = jnp.isneginf(lse).transpose(0, 2, 1)[..., None]  # (B, Tq, N, 1)
    return jnp.where(dead, jnp.nan, o)

  got, _, lse2, dq, _ = _deltas(1, Tq, Tk, 2, 1, 64, mask, config, o_fn=poison)
  assert np.isinf(lse2[..., :Tq - Tk]).all()
  assert np.isfinite(got).all() and not got[np.isinf(lse2)].any()
  assert np.isfinite(np.asarray(dq, np.float32)).all()


@pytest.mark.interpret
def test_interpret_e07_nan_past_lengths():
  """NaN/inf in o, q, do rows past q_len (and k, v past kv_len): the same
  gradients as with clean rows, through the fused delta."""
  config = fused(64, 150, 140, CAUSAL_BR)
  _e07_lengths_case(True, config=config)


@pytest.mark.interpret
def test_interpret_options():
  """Lengths, documents and a soft cap with the fused delta, and with it the
  packed default's 64-query dk/dv tiles."""
  ids = _packed(30, 1, 70, 29)
  config = fused(64, 130, 130, CAUSAL_TL, packed=True)
  assert config.block_q_dkv == 64
  check_opts(1, 130, 130, 2, 1, 64, F16, CAUSAL_TL, interpret=True, config=config,
             q_segment_ids=[ids], kv_segment_ids=[ids], q_lengths=[120],
             kv_lengths=[101], softcap=3.0, scale=0.4)


@pytest.mark.interpret
def test_interpret_given_delta_wins():
  """A caller's delta (rowsum(o * do) - dlse) is used as given: the fused
  path steps aside, so the lse cotangent still reaches the gradients."""
  B, Tq, Tk, N, K, D = 1, 100, 150, 2, 1, 64
  q, k, v, do = make_inputs(jax.random.key(4), B, Tq, Tk, N, K, D, F16)
  o, lse = kernel_inputs(q, k, v, do, scale=0.125, mask=CAUSAL_BR)
  config = fused(64, Tq, Tk, CAUSAL_BR)
  delta = jnp.einsum("bqnd,bqnd->bnq", o.astype(jnp.float32), do.astype(jnp.float32))
  run = lambda d: backward.attention_backward(
      q, k, v, o, lse, do, scale=0.125, mask=CAUSAL_BR, config=config,
      interpret=True, delta=d)
  shifted = run(delta - 1.0)
  plain = run(delta)
  # dq changes with delta (ds = p (dp - delta)); a fused delta would ignore it.
  assert not np.array_equal(np.asarray(shifted[0], np.float32),
                            np.asarray(plain[0], np.float32))


@pytest.mark.interpret
@pytest.mark.parametrize("fuse", [True, False])
def test_interpret_dlse_reaches_gradients(fuse):
  """lse's cotangent given as dlse: the fused dq kernel subtracts it from its
  delta (the unfused path in XLA); both match jax.grad of the reference
  with that cotangent. Passing delta and dlse together is an error."""
  from test_backward_kernel import FACTOR, reference_grads
  B, Tq, Tk, N, K, D = 1, 100, 150, 2, 1, 64
  q, k, v, do = make_inputs(jax.random.key(4), B, Tq, Tk, N, K, D, F16)
  mask, scale = CAUSAL_BR, 0.125
  dlse = jax.random.normal(jax.random.key(5), (B, N, Tq))
  o, lse = kernel_inputs(q, k, v, do, scale=scale, mask=mask)
  # The heuristic's config fuses at D = 64: turned off, XLA forms delta.
  config = dataclasses.replace(fused(64, Tq, Tk, mask), fuse_delta=fuse)
  grads = backward.attention_backward(q, k, v, o, lse, do, scale=scale, mask=mask,
                                      config=config, interpret=True, dlse=dlse)
  ref = reference_grads(q, k, v, do, scale=scale, mask=mask, dlse=dlse)[2:]
  low = reference_grads(q, k, v, do, scale=scale, mask=mask, dlse=dlse,
                        low_precision=True)[2:]
  without = reference_grads(q, k, v, do, scale=scale, mask=mask)[2]
  for name, got, r, lo in zip(("dq", "dk", "dv"), grads, ref, low):
    got, r = np.asarray(got, np.float32), np.asarray(r, np.float32)
    err = np.max(np.abs(got - r))
    low_err = np.max(np.abs(np.asarray(lo, np.float32) - r))
    assert err <= FACTOR * low_err + 1e-3 * max(1, np.max(np.abs(r))), (name, err)
  # The cotangent matters: dq without it is far from dq with it.
  assert np.max(np.abs(np.asarray(without) - np.asarray(ref[0]))) > 10 * np.max(
      np.abs(np.asarray(grads[0], np.float32) - np.asarray(ref[0])))
  with pytest.raises(ValueError, match="not both"):
    backward.attention_backward(q, k, v, o, lse, do, scale=scale, mask=mask,
                                config=config, interpret=True, dlse=dlse, delta=dlse)
  with pytest.raises(ValueError, match="dlse has shape"):
    backward.attention_backward(q, k, v, o, lse, do, scale=scale, mask=mask,
                                config=config, interpret=True, dlse=dlse[:, :, 1:])


@pytest.mark.parametrize("D,mask", [(64, CAUSAL_BR), (128, NO_MASK), (256, CAUSAL_BR)])
def test_lowers_for_cuda_within_its_estimate(monkeypatch, D, mask):
  """Both kernels lower for CUDA with the fused delta, and Mosaic GPU's own
  smem count of the dq kernel (o tile included) is within a KiB of the
  estimate and fits with the GPU default's two-slot ring."""
  q, k, v, do = make_inputs(jax.random.key(0), 1, 200, 136, 4, 2, D, BF16)
  lse = jnp.zeros((1, 4, 200), jnp.float32)
  config = fused(D, 200, 136, mask, interpret=False)
  assert config.num_stages == 2
  f = lambda *a: backward.attention_backward(*a, scale=0.1, mask=mask, config=config)
  dq, _ = lowered_smem_totals(monkeypatch, f, q, k, v, q, lse, do)
  assert abs(dq - config.smem_bytes(D)[0]) < 1024, (dq, config.smem_bytes(D))
  assert dq <= SMEM_LIMIT_BYTES


GPU_CASES = [
    (2, 1024, 1024, 4, 2, 64, BF16, CAUSAL_BR, False),
    (1, 4096, 4096, 4, 4, 128, BF16, NO_MASK, False),
    (2, 1000, 1333, 4, 1, 128, F16, CAUSAL_BR, False),
    (1, 1024, 1024, 2, 2, 256, BF16, CAUSAL_TL, False),
    (1, 799, 3, 2, 1, 128, BF16, CAUSAL_BR, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("B,Tq,Tk,N,K,D,dtype,mask,do_ones", GPU_CASES)
def test_gpu_matches_reference(B, Tq, Tk, N, K, D, dtype, mask, do_ones):
  config = fused(D, Tq, Tk, mask, interpret=False)
  check(B, Tq, Tk, N, K, D, dtype, mask, do_ones=do_ones, config=config, seed=Tq)


@pytest.mark.gpu
def test_gpu_options():
  ids = _packed(300, 1, 700, 23)
  config = fused(128, 1024, 1024, CAUSAL_BR, interpret=False, packed=True)
  check_opts(1, 1024, 1024, 4, 2, 128, BF16, CAUSAL_BR, interpret=False,
             config=config, q_segment_ids=[ids], kv_segment_ids=[ids],
             q_lengths=[1000], kv_lengths=[990], softcap=20.0)


@pytest.mark.gpu
def test_gpu_e07_nan_past_lengths():
  _e07_lengths_case(False, D=128, config=fused(128, 150, 140, CAUSAL_BR, interpret=False))
