"""Context parallelism: the sequence axis of self-attention split across devices.

Each device holds a slice of the queries, keys and values. It all-gathers the
keys and values over the sequence mesh axis (cheap next to the attention
itself: at T = 131072, D = 128 the gather moves about 1 GB against tens of
TFLOPs of work) and runs flash3's kernel on its own queries against all keys.
The gradient of the gather is a reduce-scatter, so dk and dv come back sharded.

With a causal mask, a contiguous split gives the last device all the work.
The "zigzag" layout (Brandon et al. 2023, "Striped attention"; the zig-zag
order of Llama 3's context parallelism) cuts the sequence into 2P chunks and
gives device r chunks r and 2P-1-r, so every device has the same share of
visible pairs. Put your sequence in that order once with ``zigzag`` (and build
positions, e.g. for rotary embeddings, from ``zigzag(positions)``); undo with
``unzigzag``.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, PartitionSpec as P

from flash3 import _dispatch, _validate, sharding
from flash3.attention import dot_product_attention

LAYOUTS = ("zigzag", "contiguous")


def _chunk_order(num_shards: int) -> list[int]:
  """The natural-order chunk index stored at each of the 2P zigzag positions."""
  order = []
  for r in range(num_shards):
    order += [r, 2 * num_shards - 1 - r]
  return order


def zigzag(x: jax.Array, num_shards: int, axis: int = 1) -> jax.Array:
  """Reorders the sequence ``axis`` of x into the zigzag layout for P shards.

  x is an array, or nested lists of numbers (taken as ``jnp.asarray`` would).

  Raises:
    ValueError: if num_shards is not an int >= 1, axis is not an axis of x, or
      the axis length is not a multiple of 2 * num_shards.
    TypeError: if x is a ragged or non-numeric list.
  """
  x = _as_array(x)
  axis = _check_layout_args(x, num_shards, axis)
  return _permute_chunks(x, num_shards, axis, _chunk_order(num_shards))


def unzigzag(x: jax.Array, num_shards: int, axis: int = 1) -> jax.Array:
  """Inverse of ``zigzag``; the same errors."""
  x = _as_array(x)
  axis = _check_layout_args(x, num_shards, axis)
  order = _chunk_order(num_shards)
  inverse = [order.index(i) for i in range(len(order))]
  return _permute_chunks(x, num_shards, axis, inverse)


def _as_array(x):
  """x as a jax array: lists and tuples are arrays to jnp, so take them too
  (a ragged or non-numeric one is a TypeError naming ``x``)."""
  if isinstance(x, (list, tuple)):
    x = _validate._array_from_list("x", x, "numbers")
  return jnp.asarray(x)


def _check_layout_args(x, num_shards, axis) -> int:
  """``axis`` normalised; ValueError for a bad ``num_shards`` or ``axis``."""
  if (isinstance(num_shards, bool) or not isinstance(num_shards, (int, np.integer))
      or num_shards < 1):
    raise ValueError(f"num_shards={num_shards!r}; allowed: an int >= 1 (the devices "
                     "on the sequence axis)")
  ndim = np.ndim(x)
  if (isinstance(axis, bool) or not isinstance(axis, (int, np.integer))
      or not -ndim <= axis < ndim):
    raise ValueError(f"axis={axis!r} for an array of rank {ndim}; allowed: an int in "
                     f"[{-ndim}, {ndim - 1}]")
  return int(axis) % ndim


def _permute_chunks(x, num_shards, axis, order):
  """``order`` of x's 2 * num_shards chunks along ``axis`` (checked, >= 0)."""
  length = x.shape[axis]
  if length % (2 * num_shards):
    raise ValueError(
        f"sequence length {length} (axis {axis}) is not a multiple of "
        f"2 * num_shards = {2 * num_shards}; allowed: multiples of it")
  chunks = jnp.split(x, 2 * num_shards, axis=axis)
  return jnp.concatenate([chunks[i] for i in order], axis=axis)


def context_parallel_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    mesh: Mesh,
    sequence_axis: str,
    batch_axis: str | None = None,
    head_axis: str | None = None,
    layout: Literal["zigzag", "contiguous"] = "zigzag",
    is_causal: bool = False,
    scale: float | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    query_segment_ids: jax.Array | None = None,
    key_value_segment_ids: jax.Array | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    implementation: Literal["mosaic", "xla"] | None = None,
    return_residual: bool = False,
):
  """Self-attention with the sequence sharded over ``sequence_axis`` of ``mesh``.

  Call it under jit on global arrays; their sharding is
  ``P(batch_axis, sequence_axis, head_axis, None)`` (XLA reshards others at the
  call). The result has the same sharding and, for layout="zigzag", the same
  zigzag order as the inputs.

  Args:
    query: (B, T, N, D); key, value: (B, T, K, D); float16/bfloat16/float32.
    mesh: the device mesh; sequence_axis, batch_axis, head_axis name its axes
      (batch and head axes are optional; heads are split by key/value head).
    layout: "zigzag" (inputs already in ``zigzag`` order; balanced for causal)
      or "contiguous" (device r holds the r-th slice).
    is_causal: causal self-attention on global positions.
    local_window_size: with is_causal, an int ``left`` or ``(left, 0)``: keys
      at most ``left`` before the query are kept (a causal sliding window).
    query_segment_ids, key_value_segment_ids: (B, T) int32 in the same layout.
    scale, logits_soft_cap, sinks, implementation, return_residual: as in
      ``flash3.dot_product_attention``.

  Returns:
    o (B, T, N, D); with return_residual also lse (B, T, N) float32, natural log.

  Raises:
    ValueError: anything ``flash3.dot_product_attention`` refuses (same
      messages), plus: rank 3 inputs, query and key lengths differ, a window
      without is_causal, an unknown layout, mesh axes that are not distinct
      axes of the mesh, or T, B, K or N not divisible by the size of the mesh
      axis (2 * size for zigzag T) that splits it.
    TypeError: a dtype or argument ``flash3.dot_product_attention`` refuses
      (q, k, v that are neither arrays nor rectangular lists of numbers), or a
      mesh that is not a jax.sharding.Mesh.
    NotImplementedError: a head_axis when the Mosaic GPU kernels would run
      (head-split kernel calls are refused for now; docs/multi_gpu.md).
  """
  p = _check(query, key, value, mesh=mesh, sequence_axis=sequence_axis,
             batch_axis=batch_axis, head_axis=head_axis, layout=layout,
             is_causal=is_causal, scale=scale, local_window_size=local_window_size,
             query_segment_ids=query_segment_ids,
             key_value_segment_ids=key_value_segment_ids,
             logits_soft_cap=logits_soft_cap, sinks=sinks,
             implementation=implementation, return_residual=return_residual)
  kernels = implementation != "xla" and _dispatch.forward_reason(p) is None
  if kernels:
    from flash3.kernels import common
    common.check_mesh_axis_names(mesh.axis_names)
  if head_axis is not None and kernels and not sharding.ALLOW_HEAD_SHARDING:
    # Head-split kernel calls gave wrong values for some heads on two H200s
    # (docs/multi_gpu.md); refused until a GPU run confirms the fix, like in
    # sharding.py.
    raise NotImplementedError(
        f"flash3: context_parallel_attention with head_axis={head_axis!r} is not "
        "supported on the Mosaic GPU kernels yet; use head_axis=None (heads "
        "whole on each device) or implementation='xla'")
  is_causal = p.spec.causal
  local_window_size = p.spec.window_left  # None, or the causal left window.
  num_shards = mesh.shape[sequence_axis]
  query, key, value, sinks = p.q, p.k, p.v, p.sinks
  query_segment_ids, key_value_segment_ids = p.query_segment_ids, p.key_value_segment_ids

  seq_spec = P(batch_axis, sequence_axis, head_axis, None)
  row_spec = P(batch_axis, sequence_axis)
  lse_spec = P(batch_axis, sequence_axis, head_axis)
  has_segments = query_segment_ids is not None
  local = functools.partial(
      _local_attention, sequence_axis=sequence_axis, num_shards=num_shards,
      layout=layout, is_causal=is_causal, scale=scale,
      window=local_window_size, logits_soft_cap=logits_soft_cap,
      implementation=implementation, has_segments=has_segments)
  operands = [query, key, value]
  in_specs = [seq_spec, seq_spec, seq_spec]
  if has_segments:
    operands += [query_segment_ids, key_value_segment_ids]
    in_specs += [row_spec, row_spec]
  if sinks is not None:
    operands.append(sinks)
    in_specs.append(P(head_axis))
  o, lse = jax.shard_map(
      lambda *args: local(*args, has_sinks=sinks is not None),
      mesh=mesh, in_specs=tuple(in_specs), out_specs=(seq_spec, lse_spec),
      check_vma=False)(*operands)
  return (o, lse) if return_residual else o


def _check(query, key, value, *, mesh, sequence_axis, batch_axis, head_axis,
           layout, is_causal, local_window_size, **kwargs) -> _validate.Problem:
  """Every argument checked before shard_map traces anything.

  The single-device checks run first, so errors the two APIs share read the
  same; then what only context parallelism needs: the mesh axes and whether
  they divide the dimensions they split.
  """
  for name, x in (("query", query), ("key", key), ("value", value)):
    if hasattr(x, "shape") and len(np.shape(x)) != 4:
      raise ValueError(
          f"{name} has shape {np.shape(x)} (rank {len(np.shape(x))}); allowed: rank 4 "
          "(B, T, heads, D) (context parallelism shards the batch and sequence axes)")
  p = _validate.check(
      query, key, value, None, None, is_causal=is_causal,
      local_window_size=local_window_size, causal_alignment="top_left",
      query_seq_lengths=None, key_value_seq_lengths=None, **kwargs)
  if layout not in LAYOUTS:
    raise ValueError(f"layout={layout!r}; allowed: {LAYOUTS}")
  # An AbstractMesh has the same axis names and sizes, and shard_map takes it.
  if not isinstance(mesh, (Mesh, AbstractMesh)):
    raise TypeError(f"mesh={mesh!r}; allowed: a jax.sharding.Mesh (e.g. from "
                    "jax.make_mesh) with sequence_axis among its axes")
  names = tuple(mesh.axis_names)
  axes = (("sequence_axis", sequence_axis), ("batch_axis", batch_axis),
          ("head_axis", head_axis))
  for name, axis in axes:
    if (axis is not None or name == "sequence_axis") and axis not in names:
      optional = "" if name == "sequence_axis" else "None or "
      raise ValueError(
          f"{name}={axis!r} is not an axis of the mesh; allowed: {optional}one of {names}")
  given = [(name, axis) for name, axis in axes if axis is not None]
  for i, (name, axis) in enumerate(given):
    for other, other_axis in given[:i]:
      if axis == other_axis:
        raise ValueError(
            f"{name}={axis!r} is also {other}; allowed: distinct mesh axes "
            "(one mesh axis cannot split two dimensions)")
  B, Tq, N, _ = p.q.shape
  Tk, K = p.k.shape[1], p.k.shape[2]
  if Tq != Tk:
    raise ValueError(
        f"query has T={Tq} and key T={Tk}; allowed: equal lengths (context "
        "parallelism here is for self-attention)")
  if p.unbatched:  # A rank-3 list (arrays were refused above).
    raise ValueError(
        f"query has shape {p.q.shape[1:]} (rank 3); allowed: rank 4 (B, T, heads, D) "
        "(context parallelism shards the batch and sequence axes)")
  # Only a causal left window: an int w (the causal mask clips its right side)
  # or (left, 0), as validated above.
  pair = isinstance(local_window_size, (tuple, list))
  if local_window_size is not None and (
      not p.spec.causal or (pair and p.spec.window_right != 0)):
    raise ValueError(
        f"local_window_size={local_window_size!r}; allowed: None, or an int left "
        "window (or (left, 0)) together with is_causal=True")
  num_shards = mesh.shape[sequence_axis]
  chunks = 2 * num_shards if layout == "zigzag" else num_shards
  if Tq % chunks:
    how = f"2 * {num_shards}" if layout == "zigzag" else f"{num_shards}"
    raise ValueError(
        f"query has T={Tq}, which is not a multiple of {chunks} (layout={layout!r} "
        f"cuts it into {how} chunks over sequence_axis={sequence_axis!r} of size "
        f"{num_shards}); allowed: T a multiple of {chunks}")
  for name, axis, dim, size in (("batch_axis", batch_axis, "B", B),
                                ("head_axis", head_axis, "K", K),
                                ("head_axis", head_axis, "N", N)):
    if axis is not None and size % mesh.shape[axis]:
      whose = "key" if dim == "K" else "query"
      raise ValueError(
          f"{whose} has {dim}={size}, which {name}={axis!r} of size "
          f"{mesh.shape[axis]} does not divide; allowed: {dim} a multiple of "
          f"{mesh.shape[axis]}, or another {name}")
  return p


def _local_attention(q, k, v, *rest, sequence_axis, num_shards, layout, is_causal,
                     scale, window, logits_soft_cap, implementation, has_segments,
                     has_sinks):
  """One device: its query chunks against all keys, on global positions."""
  rest = list(rest)
  q_seg = kv_seg = sinks = None
  if has_segments:
    q_seg, kv_seg = rest.pop(0), rest.pop(0)
  if has_sinks:
    sinks = rest.pop(0)

  def gather(x):
    x = jax.lax.all_gather(x, sequence_axis, axis=1, tiled=True)
    return unzigzag(x, num_shards) if layout == "zigzag" else x

  k_all, v_all = gather(k), gather(v)
  kv_seg_all = gather(kv_seg) if has_segments else None
  rank = jax.lax.axis_index(sequence_axis)
  if layout == "zigzag":
    c = q.shape[1] // 2
    starts = [rank * c, (2 * num_shards - 1 - rank) * c]
  else:
    c = q.shape[1]
    starts = [rank * c]

  outs, lses = [], []
  for i, start in enumerate(starts):
    q_i = q[:, i * c:(i + 1) * c]
    kwargs = {}
    if is_causal:
      # Bottom-right alignment with the keys cut at start + c places query
      # row i at global position start + i: exactly causal on global positions.
      kv_len = jnp.full((q.shape[0],), start + c, jnp.int32)
      kwargs = dict(is_causal=True, causal_alignment="bottom_right",
                    key_value_seq_lengths=kv_len,
                    local_window_size=None if window is None else (window, 0))
    if has_segments:
      kwargs.update(query_segment_ids=q_seg[:, i * c:(i + 1) * c],
                    key_value_segment_ids=kv_seg_all)
    o_i, lse_i = dot_product_attention(
        q_i, k_all, v_all, scale=scale, logits_soft_cap=logits_soft_cap,
        sinks=sinks, implementation=implementation, return_residual=True, **kwargs)
    outs.append(o_i)
    lses.append(lse_i)
  return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)
