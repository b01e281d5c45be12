"""The kernels lower for the GPU on a machine without one.

``jax.export`` with ``platforms=["cuda"]`` runs Pallas Mosaic GPU's lowering,
layout inference included, on the CPU; only ptxas and the run itself need the
GPU. Interpret mode skips that lowering, so a kernel that is right there can
still fail to compile on an H200: on 2026-12-03 an unused row iota
(``tile_mask.key_bounds`` without a mask) made layout inference fail for every
unmasked kernel, which only the GPU run showed. These cases cover each kind of
mask, the options, head_dims and the config variants the GPU tests run.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flash3.kernels import backward, forward
from flash3.kernels.backward_config import BackwardConfig
from flash3.kernels.config import ForwardConfig
from flash3.visibility import MaskSpec

BF16 = jnp.bfloat16
MASKS = {
    "none": MaskSpec(),
    "causal": MaskSpec(causal=True),
    "causal_br": MaskSpec(causal=True, alignment="bottom_right"),
    "window": MaskSpec(window_left=70, window_right=9),
}
B, T, N, K = 2, 320, 4, 2


def _extras(options):
  kw = {}
  if "lengths" in options:
    kw["q_lengths"] = jnp.array([T, 200], jnp.int32)
    kw["kv_lengths"] = jnp.array([150, T], jnp.int32)
  if "segments" in options:
    ids = jnp.asarray(np.repeat(np.arange(4), T // 4)[None].repeat(B, 0), jnp.int32)
    kw["q_segment_ids"] = kw["kv_segment_ids"] = ids
  if "softcap" in options:
    kw["softcap"] = 20.0
  return kw


def _lower(fn, *shapes):
  exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(*shapes)
  text = exported.mlir_module()
  assert "mosaic_gpu" in text  # The kernel itself, not an XLA fallback.


FORWARD_CASES = [
    (mask, D, options, None)
    for mask in MASKS for D in (64, 128, 256) for options in ((), ("lengths",))
] + [
    ("causal", 128, ("segments",), None),
    ("window", 64, ("softcap", "sinks"), None),
    ("none", 96, (), None),
    ("causal", 128, (), ForwardConfig(persistent=True, half_edge_tiles=True)),
    ("window", 128, ("lengths",), ForwardConfig(persistent=True)),
    ("causal", 64, (), ForwardConfig(block_kv=64, overlap_softmax=True)),
    ("none", 128, (), ForwardConfig(block_kv=192)),
    ("causal", 128, (), ForwardConfig(pingpong="handoff")),
    ("window", 128, (), ForwardConfig(lazy_rescale=False, scale_first=True)),
    ("none", 128, (), ForwardConfig(fuse_pv_qk=True)),
    ("causal", 128, ("lengths",), ForwardConfig(fuse_pv_qk=True, persistent=True)),
    ("window", 64, ("segments",), ForwardConfig(fuse_pv_qk=True, block_kv=256)),
]


@pytest.mark.parametrize("mask,D,options,config", FORWARD_CASES,
                         ids=lambda x: str(x) if not dataclasses.is_dataclass(x) else "cfg")
def test_forward_lowers_for_cuda(mask, D, options, config):
  q = jax.ShapeDtypeStruct((B, T, N, D), BF16)
  kv = jax.ShapeDtypeStruct((B, T, K, D), BF16)
  kw = _extras(options)
  sinks = jnp.zeros((N,), jnp.float32) if "sinks" in options else None

  def fn(q, k, v):
    return forward.attention_forward(q, k, v, scale=0.1, mask=MASKS[mask],
                                     config=config, sinks=sinks, **kw)
  _lower(fn, q, kv, kv)


BACKWARD_CASES = [
    (mask, D, options, None)
    for mask in MASKS for D in (64, 128, 256) for options in ((), ("lengths",))
] + [
    ("causal", 128, ("segments",), None),
    ("window", 64, ("softcap",), None),
    ("causal", 128, (), BackwardConfig(role_split=True)),
    ("window", 128, ("lengths",), BackwardConfig(role_split=True)),
    ("causal", 64, (), BackwardConfig(deterministic=False)),
    ("causal", 64, (), BackwardConfig(deterministic=False, pair_dq=True)),
    ("causal", 128, (), BackwardConfig(deterministic=False, share_dq=True)),
    ("none", 128, (), BackwardConfig(fuse_matmuls=True, overlap_matmuls=False)),
    ("causal", 128, (), BackwardConfig(split_dkv=True)),
    ("causal", 64, (), BackwardConfig(compute_wgs_dq=1, compute_wgs_dkv=1)),
]


@pytest.mark.parametrize("mask,D,options,config", BACKWARD_CASES,
                         ids=lambda x: str(x) if not dataclasses.is_dataclass(x) else "cfg")
def test_backward_lowers_for_cuda(mask, D, options, config):
  q = jax.ShapeDtypeStruct((B, T, N, D), BF16)
  kv = jax.ShapeDtypeStruct((B, T, K, D), BF16)
  lse = jax.ShapeDtypeStruct((B, N, T), jnp.float32)
  kw = _extras(options)
  deterministic = True if config is None else config.deterministic

  def fn(q, k, v, o, lse, do):
    return backward.attention_backward(q, k, v, o, lse, do, scale=0.1,
                                       mask=MASKS[mask], config=config,
                                       deterministic=deterministic, **kw)
  _lower(fn, q, kv, kv, q, lse, q)
