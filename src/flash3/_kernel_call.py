"""The Mosaic GPU path of dot_product_attention: custom_vjp around the kernels.

Each kernel call is wrapped twice, so that the API keeps working under jax's
transformations:
* ``sharding.partitioned``: under jit on sharded arrays, each device runs the
  kernel on its own batch / key-value-head shard (no gather);
* ``_fold_vmap``: under vmap, the mapped axis is folded into the batch axis
  (every operand has its batch first).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from flash3 import sharding
from flash3.visibility import MaskSpec


@dataclasses.dataclass(frozen=True)
class KernelArgs:
  """Static (hashable) arguments of the kernels."""

  scale: float
  spec: MaskSpec
  interpret: Any


def _fold_vmap(fn):
  """``fn`` with a vmap rule that merges the mapped axis into axis 0."""
  wrapped = jax.custom_batching.custom_vmap(fn)

  @wrapped.def_vmap
  def _rule(axis_size, in_batched, *args):
    args = [x if b else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, b in zip(args, in_batched)]
    outs = wrapped(*(x.reshape(-1, *x.shape[2:]) for x in args))
    outs = tuple(o.reshape(axis_size, -1, *o.shape[1:]) for o in outs)
    return outs, (True,) * len(outs)

  return wrapped


@functools.cache
def _forward_call(static: KernelArgs):
  from flash3.kernels.forward import attention_forward

  def forward(q5, k, v):
    o, lse = attention_forward(sharding.merge_heads(q5), k, v, scale=static.scale,
                               mask=static.spec, interpret=static.interpret)
    B, K, G, T = q5.shape[0], q5.shape[2], q5.shape[3], q5.shape[1]
    return sharding.split_heads(o, K), lse.reshape(B, K, G, T)

  return _fold_vmap(sharding.partitioned(forward, ("q", "kv", "kv"), ("q", "row")))


@functools.cache
def _backward_call(static: KernelArgs):
  from flash3.kernels.backward import attention_backward

  def backward(q5, k, v, o5, lse, do5, delta):
    B, T, K, G, _ = q5.shape
    dq, dk, dv = attention_backward(
        sharding.merge_heads(q5), k, v, sharding.merge_heads(o5),
        lse.reshape(B, K * G, T), sharding.merge_heads(do5),
        scale=static.scale, mask=static.spec, interpret=static.interpret,
        delta=delta.reshape(B, K * G, T))
    return sharding.split_heads(dq, K), dk, dv

  return _fold_vmap(sharding.partitioned(
      backward, ("q", "kv", "kv", "q", "row", "q", "row"), ("q", "kv", "kv")))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def mosaic_attention(q, k, v, static: KernelArgs):
  """(o, lse): o (B, Tq, N, D) in q.dtype, lse (B, N, Tq) float32 natural log."""
  return _forward(q, k, v, static)[0]


def _forward(q, k, v, static: KernelArgs):
  K = k.shape[2]
  o5, lse = _forward_call(static)(sharding.split_heads(q, K), k, v)
  B, T, N = q.shape[0], q.shape[1], q.shape[2]
  o, lse = sharding.merge_heads(o5), lse.reshape(B, N, T)
  return (o, lse), (q, k, v, o, lse)


def _backward(static: KernelArgs, residuals, cotangents):
  q, k, v, o, lse = residuals
  do, dlse = cotangents
  B, T, N, _ = q.shape
  K = k.shape[2]
  # delta_i = rowsum(o * do), float32 (FlashAttention-2, section 3.1.2). The
  # lse cotangent enters as a shift of it: d lse_i / d s_ij = p_ij, so
  # ds_ij = p_ij * (dp_ij - (delta_i - dlse_i)).
  delta = jnp.einsum("btnd,btnd->bnt", o.astype(jnp.float32), do.astype(jnp.float32))
  delta = delta - dlse
  split = functools.partial(sharding.split_heads, num_kv_heads=K)
  dq5, dk, dv = _backward_call(static)(
      split(q), k, v, split(o), lse.reshape(B, K, N // K, T), split(do),
      delta.reshape(B, K, N // K, T))
  return sharding.merge_heads(dq5), dk, dv


mosaic_attention.defvjp(_forward, _backward)
