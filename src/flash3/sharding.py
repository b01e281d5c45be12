"""Running the kernels on sharded arrays under jit, with no gather.

A Pallas kernel does not partition itself: left alone, XLA's partitioner would
gather sharded operands onto every device. ``partitioned`` wraps a kernel call
in ``jax.experimental.custom_partitioning`` with a Shardy rule that says which
dimensions may stay sharded (batch; key/value heads only with
``ALLOW_HEAD_SHARDING``, see ``partition``) and which each device needs whole
(sequence, head_dim, and the query heads of one GQA group). Each
device then runs the kernel on its own shard; a different input sharding is
resharded by XLA at the call, never gathered silently inside it.

Operands are described by their kind:

* ``"q"``: (B, T, K, G, D), query-like (q, o, do, dq) with the N = K * G query
  heads split into key/value heads and their groups,
* ``"kv"``: (B, S, K, D), key-like (k, v, dk, dv),
* ``"row"``: (B, K, G, T), per query row (lse, delta),
* ``"len"``: (B,) sequence lengths; ``"qseg"``, ``"kvseg"``: (B, T) segment
  ids; ``"sink"``: (K, G) sinks.

With one device (or inside shard_map) the wrapper is just the function.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

_FACTORS = {"q": "b t h g d", "kv": "b s h d", "row": "b h g t",
            "len": "b", "qseg": "b t", "kvseg": "b s", "sink": "h g"}
# Dimensions each device needs whole: the sequences and head_dim; group too,
# so that dk/dv of a key/value head are summed inside one kernel (no all-reduce).
_REPLICATED = ("t", "s", "d", "g")

# Head-sharded kernel calls are refused unless this is True. On two H200s
# (2026-11-30) they returned wrong heads: the kernels' grid axis was named
# "heads", like the mesh axis, and inside a kernel lowered under a mesh
# ``lax.axis_index`` resolves mesh axes first, so each CTA took the device's
# mesh position for its head (kernels/common.py). The kernel axes are renamed
# since; this stays off until a two-GPU run confirms the fix
# (tests/test_multi_gpu.py::test_heads_sharded_equals_one_gpu_when_allowed).
ALLOW_HEAD_SHARDING = False


def _spec(kind: str, batch_axis, head_axis) -> P:
  return {"q": P(batch_axis, None, head_axis, None, None),
          "kv": P(batch_axis, None, head_axis, None),
          "row": P(batch_axis, head_axis, None, None),
          "len": P(batch_axis),
          "qseg": P(batch_axis, None),
          "kvseg": P(batch_axis, None),
          "sink": P(head_axis, None)}[kind]


def _axes(sharding, kind: str):
  """(batch axis, head axis) of a NamedSharding of an operand of this kind."""
  spec = tuple(getattr(sharding, "spec", ())) + (None,) * 5
  head_dim = {"q": 2, "kv": 2, "row": 1}[kind]
  return spec[0], spec[head_dim]


def partitioned(fn: Callable, in_kinds: Sequence[str], out_kinds: Sequence[str]):
  """``fn`` wrapped so that a sharded batch dim stays sharded (key/value
  heads too only with ``ALLOW_HEAD_SHARDING``; otherwise NotImplementedError).

  Args:
    fn: takes arrays of ``in_kinds`` and returns a tuple of ``out_kinds``;
      it must be correct on any batch / head slice (attention is).
    in_kinds, out_kinds: one of the module docstring's kinds ("q", "kv",
      "row", "len", "qseg", "kvseg", "sink") for each operand and result.
  """
  # custom_partitioning refuses functions whose jaxpr closes over constants
  # (any jnp.array([...]) inside); under jit those stay in the inner jaxpr.
  fn = jax.jit(fn)
  wrapped = custom_partitioning(fn)

  def partition(mesh, arg_shapes, result_shape):
    from flash3.kernels import common  # Only the GPU kernel path gets here.
    common.check_mesh_axis_names(mesh.axis_names)
    batch_axis, head_axis = _axes(arg_shapes[0].sharding, in_kinds[0])
    if head_axis is not None and not ALLOW_HEAD_SHARDING:
      # Wrong heads on two H200s (2026-11-30); see ALLOW_HEAD_SHARDING.
      raise NotImplementedError(
          f"flash3: inputs sharded over heads (mesh axis {head_axis!r}) are not "
          "supported on the Mosaic GPU kernels yet; shard the batch axis, use "
          "flash3.context_parallel_attention for the sequence, or "
          "implementation='xla'")
    arg_shardings = tuple(
        NamedSharding(mesh, _spec(kind, batch_axis, head_axis)) for kind in in_kinds)
    out_shardings = tuple(
        NamedSharding(mesh, _spec(kind, batch_axis, head_axis)) for kind in out_kinds)
    return mesh, fn, out_shardings, arg_shardings

  rule = (", ".join(_FACTORS[k] for k in in_kinds) + " -> "
          + ", ".join(_FACTORS[k] for k in out_kinds))
  # Shardy wants these in the order the factors first appear in the rule.
  order = list(dict.fromkeys(rule.replace(",", " ").replace("->", " ").split()))
  replicated = tuple(f for f in order if f in _REPLICATED)
  wrapped.def_partition(
      partition=partition,
      sharding_rule=rule,
      need_replication_factors=replicated)
  return wrapped


def split_heads(x: jax.Array, num_kv_heads: int) -> jax.Array:
  """(B, T, N, D) -> (B, T, K, G, D)."""
  B, T, N, D = x.shape
  return x.reshape(B, T, num_kv_heads, N // num_kv_heads, D)


def merge_heads(x: jax.Array) -> jax.Array:
  """(B, T, K, G, D) -> (B, T, N, D)."""
  B, T, K, G, D = x.shape
  return x.reshape(B, T, K * G, D)
