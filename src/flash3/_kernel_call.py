"""The Mosaic GPU path of dot_product_attention: custom_vjp around the kernels.

Each kernel call is wrapped twice, so that the API keeps working under jax's
transformations:
* ``sharding.partitioned``: under jit on sharded arrays, each device runs the
  kernel on its own batch shard (no gather; head-sharded inputs are refused, see sharding.py);
* ``_fold_vmap``: under vmap, the mapped axis is folded into the batch axis.

Sinks need no backward kernel of their own: with the sink inside the
logsumexp, the kernels' ds = p (dp - delta) is already right for q, k, v, and
d sink = -sum_i exp(sink - lse_i) (delta_i - dlse_i) is a reduction in XLA.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from flash3 import _dispatch, sharding
from flash3.reference import attention_reference
from flash3.visibility import MaskSpec


@dataclasses.dataclass(frozen=True)
class KernelArgs:
  """Static (hashable) arguments of the kernels."""

  scale: float
  spec: MaskSpec
  interpret: Any
  softcap: float | None = None
  deterministic: bool = True  # False allows the single-kernel backward.


class Extras(NamedTuple):
  """The optional array arguments; None where not given."""

  q_lengths: jax.Array | None = None
  kv_lengths: jax.Array | None = None
  q_segment_ids: jax.Array | None = None
  kv_segment_ids: jax.Array | None = None
  sinks: jax.Array | None = None


# Operand kinds of the extras, for sharding.partitioned.
_EXTRA_KINDS = {"q_lengths": "len", "kv_lengths": "len", "q_segment_ids": "qseg",
                "kv_segment_ids": "kvseg", "sinks": "sink"}


def features(extras: Extras, static: KernelArgs) -> frozenset[str]:
  """The kernel features a call needs (names as in the kernels' SUPPORTED_FEATURES)."""
  needed = set()
  if extras.q_lengths is not None or extras.kv_lengths is not None:
    needed.add("lengths")
  if extras.q_segment_ids is not None:
    needed.add("segments")
  if extras.sinks is not None:
    needed.add("sinks")
  if static.softcap is not None:
    needed.add("softcap")
  return frozenset(needed)


def _fold_vmap(fn, batch_leading: tuple[bool, ...]):
  """``fn`` with a vmap rule that merges the mapped axis into axis 0.

  ``batch_leading[i]`` says whether operand i has the batch axis first. The
  others (sinks: one per head, shared by every batch row) cannot take the
  mapped axis into the batch; when one of them is mapped, the members run
  one after another (``lax.map``), each a kernel call of its own.
  """
  wrapped = jax.custom_batching.custom_vmap(fn)

  @wrapped.def_vmap
  def _rule(axis_size, in_batched, *args):
    if any(b and not lead for b, lead in zip(in_batched, batch_leading)):
      mapped = [x for x, b in zip(args, in_batched) if b]

      def member(xs):
        it = iter(xs)
        return wrapped(*(next(it) if b else x for x, b in zip(args, in_batched)))

      outs = jax.lax.map(member, mapped)
      return outs, (True,) * len(outs)
    merged = []
    for x, batched, leading in zip(args, in_batched, batch_leading):
      if not leading:
        merged.append(x)
        continue
      x = x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
      merged.append(x.reshape(-1, *x.shape[2:]))
    outs = wrapped(*merged)
    outs = tuple(o.reshape(axis_size, -1, *o.shape[1:]) for o in outs)
    return outs, (True,) * len(outs)

  return wrapped


def _first_order_only(fn):
  """``fn`` (a kernel call) with a derivative that raises a clear error.

  The API's custom_vjp gives the first derivative. A second one (grad of
  grad, a Hessian) differentiates its forward and backward rules themselves,
  and the kernels have no derivative rule: jax's own error would name its
  internal primitive, not flash3 or what to do instead.
  """
  wrapped = jax.custom_jvp(fn)

  @wrapped.defjvp
  def _jvp(primals, tangents):
    del primals, tangents
    raise NotImplementedError(
        "flash3: the Mosaic GPU kernels are differentiable once, in reverse mode "
        "(jax.grad, jax.vjp); second derivatives (grad of grad, jax.hessian) "
        "need implementation='xla'")

  return wrapped


def _partitioned(fn, in_kinds, out_kinds, static: KernelArgs):
  # Interpreted kernels carry ordered IO effects, which custom_partitioning
  # cannot lower per shard: in interpret mode XLA's default (gathering)
  # partitioning applies instead. The GPU path is always partitioned.
  if static.interpret:
    return fn
  return sharding.partitioned(fn, in_kinds, out_kinds)


def _present(extras: Extras) -> tuple[str, ...]:
  return tuple(name for name, x in extras._asdict().items() if x is not None)


def _kernel_extras(names, values):
  """Keyword arguments for the kernels from the flat extras."""
  kwargs = dict(zip(names, values))
  if "sinks" in kwargs:
    kwargs["sinks"] = kwargs["sinks"].reshape(-1).astype(jnp.float32)  # (K, G) -> (N,)
  return kwargs


@functools.cache
def _forward_call(static: KernelArgs, names: tuple[str, ...]):
  from flash3.kernels.forward import attention_forward

  def forward(q5, k, v, *extra_values):
    B, T, K, G, _ = q5.shape
    o, lse = attention_forward(
        sharding.merge_heads(q5), k, v, scale=static.scale, mask=static.spec,
        interpret=static.interpret, softcap=static.softcap,
        **_kernel_extras(names, extra_values))
    return sharding.split_heads(o, K), lse.reshape(B, K, G, T)

  kinds = ("q", "kv", "kv") + tuple(_EXTRA_KINDS[n] for n in names)
  leading = tuple(kind != "sink" for kind in kinds)
  return _first_order_only(
      _fold_vmap(_partitioned(forward, kinds, ("q", "row"), static), leading))


@functools.cache
def _backward_call(static: KernelArgs, names: tuple[str, ...], shift: str):
  """``shift``: what the seventh argument is, "delta" (rowsum(o * do) - dlse,
  formed in XLA) or "dlse" (lse's cotangent: the backward forms delta, in
  the dq kernel with ``BackwardConfig.fuse_delta``)."""
  from flash3.kernels.backward import attention_backward

  def backward(q5, k, v, o5, lse, do5, row, *extra_values):
    B, T, K, G, _ = q5.shape
    extra = _kernel_extras(names, extra_values)
    extra.pop("sinks", None)  # Inside lse already; its gradient is done in XLA.
    if static.softcap is not None:
      extra["softcap"] = static.softcap
    dq, dk, dv = attention_backward(
        sharding.merge_heads(q5), k, v, sharding.merge_heads(o5),
        lse.reshape(B, K * G, T), sharding.merge_heads(do5),
        scale=static.scale, mask=static.spec, interpret=static.interpret,
        deterministic=static.deterministic, **{shift: row.reshape(B, K * G, T)},
        **extra)
    return sharding.split_heads(dq, K), dk, dv

  kinds = (("q", "kv", "kv", "q", "row", "q", "row")
           + tuple(_EXTRA_KINDS[n] for n in names))
  leading = tuple(kind != "sink" for kind in kinds)
  return _first_order_only(
      _fold_vmap(_partitioned(backward, kinds, ("q", "kv", "kv"), static), leading))


def _flat_extras(extras: Extras, num_kv_heads: int):
  names = _present(extras)
  values = []
  for name in names:
    x = getattr(extras, name)
    values.append(x.reshape(num_kv_heads, -1) if name == "sinks" else x)
  return names, values


def _vma(x) -> frozenset:
  """The mesh axes x varies over inside shard_map (empty elsewhere)."""
  axis_type = getattr(jax.typeof(x), "manual_axis_type", None)  # jax 0.11.2
  return frozenset(getattr(axis_type, "varying", None) or ())


def _varying(x, axes: frozenset):
  """x marked as varying over ``axes`` too (shard_map's check_vma types)."""
  missing = tuple(sorted(axes - _vma(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def mosaic_attention(q, k, v, extras: Extras, static: KernelArgs):
  """(o, lse): o (B, Tq, N, D) in q.dtype, lse (B, N, Tq) float32 natural log.

  Inside ``shard_map`` (check_vma on) the kernels' outputs would carry no
  varying axes: every operand is first marked varying over the union of
  theirs (an invariant operand's gradient is then summed over those axes, as
  jax does for its own ops), and outputs and gradients get their operands'.
  """
  axes = frozenset().union(*map(_vma, jax.tree.leaves((q, k, v, extras))))
  q, k, v, extras = jax.tree.map(lambda x: _varying(x, axes), (q, k, v, extras))
  return _attention(q, k, v, extras, static)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, extras: Extras, static: KernelArgs):
  return _forward(q, k, v, extras, static)[0]


def _forward(q, k, v, extras: Extras, static: KernelArgs):
  K = k.shape[2]
  names, values = _flat_extras(extras, K)
  o5, lse = _forward_call(static, names)(sharding.split_heads(q, K), k, v, *values)
  # Under a scan over layers, o and lse are also stacked as residuals with a
  # dynamic-update-slice. XLA's dynamic-slice fusion (jax 0.11.2) then fuses a copy of
  # the kernel call into that update and keeps the original for o's other users: the
  # forward ran twice per layer (docs/training.md). The barrier hides the call from
  # that pattern; it costs nothing at run time.
  o5, lse = jax.lax.optimization_barrier((o5, lse))
  B, T, N = q.shape[0], q.shape[1], q.shape[2]
  o, lse = sharding.merge_heads(o5), lse.reshape(B, N, T)
  o, lse = _varying(o, _vma(q)), _varying(lse, _vma(q))
  return (o, lse), (q, k, v, extras, o, lse)


def _backward_kernel_lacks(extras: Extras, static: KernelArgs) -> frozenset[str]:
  try:
    from flash3.kernels import backward
  except ImportError:
    return frozenset({"the backward kernels"})
  supported = getattr(backward, "SUPPORTED_FEATURES", frozenset()) | {"sinks"}
  return features(extras, static) - supported


def _backward(static: KernelArgs, residuals, cotangents):
  q, k, v, extras, o, lse = residuals
  do, dlse = cotangents
  no_grads = Extras(*(None,) * 4, sinks=None)
  if missing := _backward_kernel_lacks(extras, static):
    return _reference_backward(static, residuals, cotangents, missing)
  B, T, N, _ = q.shape
  K = k.shape[2]
  # delta_i = rowsum(o * do), float32 (FlashAttention-2, section 3.1.2). The
  # lse cotangent enters as a shift of it: d lse_i / d s_ij = p_ij, so
  # ds_ij = p_ij * (dp_ij - (delta_i - dlse_i)). The sinks' gradient needs
  # delta here; otherwise the backward forms it from dlse (in its dq kernel
  # when the config fuses it, without a pass over o and do in XLA).
  if extras.sinks is not None:
    delta = jnp.einsum("btnd,btnd->bnt", o.astype(jnp.float32), do.astype(jnp.float32))
    delta = delta - dlse
    shift, row = "delta", delta
  else:
    shift, row = "dlse", dlse.astype(jnp.float32)
  split = functools.partial(sharding.split_heads, num_kv_heads=K)
  names, values = _flat_extras(extras, K)
  dq5, dk, dv = _backward_call(static, names, shift)(
      split(q), k, v, split(o), lse.reshape(B, K, N // K, T), split(do),
      row.reshape(B, K, N // K, T), *values)
  if extras.sinks is not None:
    # d sink_n = -sum_{b,i} exp(sink_n - lse_bni) * (delta_bni - dlse_bni).
    sink = extras.sinks.astype(jnp.float32)[None, :, None]
    p_sink = jnp.where(lse == -jnp.inf, 0.0, jnp.exp(sink - lse))
    no_grads = no_grads._replace(
        sinks=(-(p_sink * delta).sum(axis=(0, 2))).astype(extras.sinks.dtype))
  # mosaic_attention made every operand vary over the same axes: so does each
  # gradient (the kernels' outputs carry none).
  vary = functools.partial(_varying, axes=_vma(q))
  return (vary(sharding.merge_heads(dq5)), vary(dk), vary(dv),
          jax.tree.map(vary, no_grads))


def _reference_backward(static, residuals, cotangents, missing):
  """The backward through the XLA reference, for options the kernels lack."""
  q, k, v, extras, _, _ = residuals
  do, dlse = cotangents
  _dispatch.warn_once(
      "flash3: the backward of this call runs on the XLA reference path "
      f"(the backward kernels do not take {', '.join(sorted(missing))} yet)")

  def reference(q, k, v, sinks):
    o, lse = attention_reference(
        q, k, v, scale=static.scale, spec=static.spec,
        query_seq_lengths=extras.q_lengths, key_value_seq_lengths=extras.kv_lengths,
        query_segment_ids=extras.q_segment_ids,
        key_value_segment_ids=extras.kv_segment_ids,
        logits_soft_cap=static.softcap, sinks=sinks)
    return o, lse.transpose(0, 2, 1)

  _, vjp = jax.vjp(reference, q, k, v, extras.sinks)
  dq, dk, dv, dsinks = vjp((do, dlse))
  return dq, dk, dv, Extras(*(None,) * 4, sinks=dsinks)


_attention.defvjp(_forward, _backward)
