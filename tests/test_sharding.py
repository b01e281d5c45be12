"""Sharded inputs under jit (CPU, 4 virtual devices): results equal unsharded ones."""

import contextlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flash3
from flash3 import sharding
from flash3.context_parallel import context_parallel_attention, unzigzag, zigzag
from flash3.reference import attention_reference
from flash3.visibility import MaskSpec

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 4, reason="needs 4 devices (conftest sets 4 CPU devices)")


def _mesh(shape, names):
  # Auto axes: the classic jit + NamedSharding style, which custom_partitioning serves.
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


@pytest.fixture
def mesh():
  return _mesh((2, 2), ("data", "model"))


def _qkv(B=4, T=32, N=8, K=4, D=16, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (B, T, N, D)),
          jax.random.normal(ks[1], (B, T, K, D)),
          jax.random.normal(ks[2], (B, T, K, D)))


def _reference_forward(q5, k, v):
  """A stand-in for the forward kernel, with the kernel's operand kinds."""
  q = sharding.merge_heads(q5)
  o, lse = attention_reference(q, k, v, scale=0.25, spec=MaskSpec(causal=True))
  B, T, N, _ = q.shape
  K = k.shape[2]
  return sharding.split_heads(o, K), lse.transpose(0, 2, 1).reshape(B, K, N // K, T)


@pytest.mark.parametrize("spec", [P("data", None, "model"), P(None, None, "model")])
def test_partitioned_kernel_call_refuses_head_sharding(mesh, spec):
  """Heads-sharded kernel calls gave wrong values on two H200s: refused, not gathered."""
  q, k, v = _qkv()
  q5 = sharding.split_heads(q, 4)
  fn = sharding.partitioned(_reference_forward, ("q", "kv", "kv"), ("q", "row"))
  put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
  # Raised in the partitioner, so jax wraps it in a JaxRuntimeError carrying the text.
  with pytest.raises((NotImplementedError, jax.errors.JaxRuntimeError),
                     match="sharded over heads \\(mesh axis 'model'\\)"):
    jax.jit(fn)(put(q5), put(k), put(v))


@pytest.mark.parametrize("spec", [P("data"), P("data", None, None)])
def test_partitioned_kernel_call_keeps_shards_and_never_gathers(mesh, spec):
  q, k, v = _qkv()
  q5 = sharding.split_heads(q, 4)
  fn = sharding.partitioned(_reference_forward, ("q", "kv", "kv"), ("q", "row"))
  put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
  args = (put(q5), put(k), put(v))
  jitted = jax.jit(fn)
  o5, lse = jitted(*args)
  want_o5, want_lse = _reference_forward(q5, k, v)
  np.testing.assert_allclose(o5, want_o5, atol=1e-5)
  np.testing.assert_allclose(lse, want_lse, atol=1e-5)
  pad = lambda spec: (tuple(spec) + (None,) * 5)[:3]
  assert pad(o5.sharding.spec) == pad(spec)
  hlo = jitted.lower(*args).compile().as_text()
  assert not re.search(r"all-gather|all-to-all|collective-permute", hlo)


def test_partitioned_reshards_sequence_sharded_inputs_explicitly(mesh):
  """A sequence-sharded operand is resharded at the call; the result is still right."""
  q, k, v = _qkv()
  q5 = sharding.split_heads(q, 4)
  fn = sharding.partitioned(_reference_forward, ("q", "kv", "kv"), ("q", "row"))
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "model")))
  o5, _ = jax.jit(fn)(put(q5), put(k), put(v))
  np.testing.assert_allclose(o5, _reference_forward(q5, k, v)[0], atol=1e-5)


def test_zigzag_round_trip_and_order():
  x = jnp.arange(16).reshape(1, 16)
  z = zigzag(x, 2)
  # chunks of 4: device 0 holds chunks 0 and 3, device 1 holds 1 and 2.
  assert z[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
  assert (unzigzag(z, 2) == x).all()
  with pytest.raises(ValueError, match="multiple of 2 \\* num_shards"):
    zigzag(jnp.zeros((1, 6)), 2)


@pytest.mark.parametrize("fn", [zigzag, unzigzag])
@pytest.mark.parametrize("num_shards,axis,match", [
    (0, 1, "num_shards=0"), (-1, 1, "num_shards=-1"), (2.0, 1, "num_shards=2.0"),
    (True, 1, "num_shards=True"), (2, 5, "axis=5"), (2, -3, "axis=-3"),
    (2, 1.0, "axis=1.0")])
def test_zigzag_bad_arguments_name_themselves(fn, num_shards, axis, match):
  with pytest.raises(ValueError, match=match):
    fn(jnp.zeros((1, 8)), num_shards, axis=axis)


@pytest.mark.parametrize("fn", [zigzag, unzigzag])
def test_zigzag_takes_lists_as_arrays(fn):
  """Lists are arrays to jnp (and to dot_product_attention): the same result."""
  x = np.arange(16).reshape(2, 8)
  np.testing.assert_array_equal(fn(x.tolist(), 2), fn(jnp.asarray(x), 2))
  np.testing.assert_array_equal(fn(tuple(range(8)), 2, axis=0), fn(jnp.arange(8), 2, axis=0))
  with pytest.raises(TypeError, match="x is a list that is not a rectangular array"):
    fn([[1, 2], [3]], 1)


def test_zigzag_negative_axis_is_the_same_axis():
  x = jnp.arange(32).reshape(2, 16)
  np.testing.assert_array_equal(zigzag(x, 2, axis=-1), zigzag(x, 2, axis=1))


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 5), (True, (5, 0))])
def test_context_parallel_equals_unsharded(layout, causal, window):
  mesh = _mesh((2, 2), ("data", "ctx"))
  q, k, v = _qkv(B=2, T=32, N=4, K=2)
  win = window if window is None or isinstance(window, tuple) else (window, 0)
  kw = dict(is_causal=causal, local_window_size=win, implementation="xla")
  to = (lambda x: zigzag(x, 2)) if layout == "zigzag" else (lambda x: x)
  back = (lambda x: unzigzag(x, 2)) if layout == "zigzag" else (lambda x: x)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    put = lambda x: jax.device_put(to(x), NamedSharding(mesh, P("data", "ctx")))
    args = tuple(put(x) for x in (q, k, v))
    f = jax.jit(lambda q, k, v: context_parallel_attention(
        q, k, v, mesh=mesh, sequence_axis="ctx", batch_axis="data", layout=layout,
        is_causal=causal, local_window_size=window, implementation="xla"))
    loss = lambda f: lambda q, k, v: (f(q, k, v) ** 2).sum()
    got = back(f(*args))
    grads = jax.grad(loss(f), argnums=(0, 1, 2))(*args)
  want = flash3.dot_product_attention(q, k, v, **kw)
  want_grads = jax.grad(loss(lambda q, k, v: flash3.dot_product_attention(q, k, v, **kw)),
                        argnums=(0, 1, 2))(q, k, v)
  np.testing.assert_allclose(got, want, atol=2e-5)
  for g, w in zip(grads, want_grads):
    np.testing.assert_allclose(back(g), w, atol=5e-5)


def test_context_parallel_with_segments():
  mesh = _mesh((4,), ("ctx",))
  q, k, v = _qkv(B=1, T=32, N=2, K=2)
  seg = jnp.repeat(jnp.arange(4), 8)[None].at[0, 5:9].set(7)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    got = jax.jit(lambda q, k, v, s: context_parallel_attention(
        q, k, v, mesh=mesh, sequence_axis="ctx", is_causal=True,
        query_segment_ids=s, key_value_segment_ids=s, implementation="xla"))(
            *(zigzag(x, 4) for x in (q, k, v, seg)))
  want = flash3.dot_product_attention(q, k, v, is_causal=True, query_segment_ids=seg,
                                      key_value_segment_ids=seg, implementation="xla")
  np.testing.assert_allclose(unzigzag(got, 4), want, atol=2e-5)


def test_context_parallel_rejects_bad_arguments():
  mesh = _mesh((4,), ("ctx",))
  q, k, v = _qkv(B=1, T=20, N=2, K=2)
  with pytest.raises(ValueError, match="not a multiple of 8"):
    context_parallel_attention(q, k, v, mesh=mesh, sequence_axis="ctx")
  with pytest.raises(ValueError, match="sequence_axis='seq' is not an axis"):
    context_parallel_attention(q, k, v, mesh=mesh, sequence_axis="seq")
  with pytest.raises(ValueError, match="local_window_size"):
    context_parallel_attention(q, k, v, mesh=mesh, sequence_axis="ctx", local_window_size=3)
  with pytest.raises(ValueError, match="rank 4"):
    context_parallel_attention(q[0], k[0], v[0], mesh=mesh, sequence_axis="ctx")
  q3 = np.asarray(q[0]).tolist()  # A rank-3 list: refused as a rank-3 array is.
  with pytest.raises(ValueError, match="rank 4"):
    context_parallel_attention(q3, q3, q3, mesh=mesh, sequence_axis="ctx")
  with pytest.raises(ValueError, match="local_window_size"):  # Not a left window.
    context_parallel_attention(q, k, v, mesh=mesh, sequence_axis="ctx", is_causal=True,
                               local_window_size=(3, 2))


def test_context_parallel_takes_the_windows_dot_product_attention_takes():
  q, k, v = _qkv(B=1, T=32, N=2, K=2)
  want = flash3.dot_product_attention(q, k, v, is_causal=True, local_window_size=5,
                                      implementation="xla")
  for window in [5, (5, 0), jnp.array(5), (np.int64(5), jnp.array(0))]:
    got = _cp_call(q, k, v, is_causal=True, local_window_size=window, layout="contiguous")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("option", ["none", "lengths", "segments", "sinks"])
def test_gpu_kernel_calls_trace_with_every_option(option, softcap):
  """The GPU path (partitioned, not interpreted) traces forward and backward on the CPU.

  custom_partitioning rejects functions that close over constants; on the H200 this
  once broke the backward with segment ids, which interpret mode (unpartitioned)
  could not see.
  """
  from flash3._kernel_call import Extras, KernelArgs, mosaic_attention
  q = jnp.zeros((1, 192, 2, 64), jnp.bfloat16)
  k = jnp.zeros((1, 200, 1, 64), jnp.bfloat16)
  extras = {
      "none": Extras(),
      "lengths": Extras(q_lengths=jnp.array([150]), kv_lengths=jnp.array([170])),
      "segments": Extras(q_segment_ids=jnp.zeros((1, 192), jnp.int32),
                         kv_segment_ids=jnp.zeros((1, 200), jnp.int32)),
      "sinks": Extras(sinks=jnp.zeros((2,))),
  }[option]
  static = KernelArgs(scale=0.1, spec=MaskSpec(causal=True), interpret=False,
                      softcap=softcap)
  loss = lambda q, k, v: mosaic_attention(q, k, v, extras, static)[0].astype(jnp.float32).sum()
  jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, k)


# ------------------------- the kernel path inside a user's shard_map (check_vma)

def _varying(x):
  return jax.typeof(x).manual_axis_type.varying


@pytest.mark.parametrize("option", ["none", "sinks", "lengths", "segments"])
@pytest.mark.parametrize("interpret", [False, True], ids=["gpu_path", "interpret"])
def test_kernel_path_keeps_shard_maps_varying_axes(option, interpret, monkeypatch):
  """Inside shard_map with check_vma (its default), o varies over the axes q,
  k, v vary over, and jax.grad traces: each gradient is typed like its
  operand. The kernels' outputs carried no varying axes, so the custom_vjp's
  gradients did not match their inputs (a fresh-user report); sinks given
  whole (invariant) get a gradient summed over the devices."""
  mesh = _mesh((2,), ("data",))
  q = jnp.ones((2, 64, 2, 64), jnp.bfloat16)
  k = jnp.ones((2, 80, 1, 64), jnp.bfloat16)
  kw = {"none": {}, "sinks": {},
        "lengths": dict(query_seq_lengths=jnp.array([50, 64]),
                        key_value_seq_lengths=jnp.array([80, 7])),
        "segments": dict(query_segment_ids=jnp.zeros((2, 64), jnp.int32),
                         key_value_segment_ids=jnp.zeros((2, 80), jnp.int32))}[option]
  sinks = jnp.zeros((2,)) if option == "sinks" else None
  seen = {}

  def per_shard(q, k, v, kw, sinks):
    o = flash3.dot_product_attention(q, k, v, is_causal=True, sinks=sinks,
                                     implementation="mosaic", **kw)
    seen["o"] = _varying(o)
    return o

  f = jax.shard_map(per_shard, mesh=mesh, in_specs=(P("data"),) * 4 + (P(),),
                    out_specs=P("data"))
  loss = lambda q, k, v, sinks: f(q, k, v, kw, sinks).astype(jnp.float32).sum()
  argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
  if interpret:
    context = flash3.interpret_kernels()
  else:  # The compiled path's trace (no Hopper needed to trace it).
    from flash3 import _dispatch
    monkeypatch.setattr(_dispatch, "choose", lambda p, impl: "mosaic")
    context = contextlib.nullcontext()
  with context:  # Raised before the fix: the gradients' types did not match.
    jax.make_jaxpr(jax.grad(loss, argnums=argnums))(q, k, k, sinks)
  assert seen["o"] == {"data"}


_REFERENCE_NAMES = {"q_lengths": "query_seq_lengths", "kv_lengths": "key_value_seq_lengths",
                    "q_segment_ids": "query_segment_ids",
                    "kv_segment_ids": "key_value_segment_ids", "sinks": "sinks"}


def _stand_in_kernels(monkeypatch):
  """The kernel calls of flash3._kernel_call replaced by the float32 reference
  (same operands, shapes and residuals), so the kernel path's shard_map types
  run on CPU devices with numbers: forward (o5, lse) and backward (dq5, dk, dv)
  from the reference's vjp."""
  from flash3 import _dispatch, _kernel_call

  def reference(static, names, values, q, k, v):
    kw = {_REFERENCE_NAMES[n]: x for n, x in zip(names, values)}
    if "sinks" in kw:
      kw["sinks"] = kw["sinks"].reshape(-1)  # (K, G) -> (N,)
    o, lse = attention_reference(q, k, v, scale=static.scale, spec=static.spec,
                                 logits_soft_cap=static.softcap, **kw)
    return o, lse.transpose(0, 2, 1)  # lse (B, N, T)

  def forward_call(static, names):
    def forward(q5, k, v, *values):
      B, T, K, G, _ = q5.shape
      o, lse = reference(static, names, values, sharding.merge_heads(q5), k, v)
      return sharding.split_heads(o.astype(q5.dtype), K), lse.reshape(B, K, G, T)
    return forward

  def backward_call(static, names, shift):
    def backward(q5, k, v, o5, lse, do5, row, *values):
      B, T, K, G, _ = q5.shape
      q, o, do = map(sharding.merge_heads, (q5, o5, do5))
      row = row.reshape(B, K * G, T)
      # row is lse's cotangent, or delta = rowsum(o * do) - that cotangent.
      dlse = row if shift == "dlse" else jnp.einsum("btnd,btnd->bnt", o, do) - row
      _, vjp = jax.vjp(lambda q, k, v: reference(static, names, values, q, k, v), q, k, v)
      dq, dk, dv = vjp((do, dlse))
      return sharding.split_heads(dq, K), dk, dv
    return backward

  calls = []
  count = lambda make: lambda *a: calls.append(make.__name__) or make(*a)
  monkeypatch.setattr(_kernel_call, "_forward_call", count(forward_call))
  monkeypatch.setattr(_kernel_call, "_backward_call", count(backward_call))
  monkeypatch.setattr(_dispatch, "choose",
                      lambda p, impl: "xla" if impl == "xla" else "mosaic")
  return calls


@pytest.mark.parametrize("option", ["none", "sinks", "lengths", "segments", "whole_kv",
                                    "residual", "residual-sinks"])
def test_kernel_path_inside_shard_map_equals_the_unsharded_call(option, monkeypatch):
  """Numbers, not only types: o and every gradient of the kernel path inside a
  two-device shard_map (check_vma on) equal the unsharded call's, with the
  kernels stood in by the reference. Operands given whole (sinks; k and v in
  whole_kv, where each device holds half the queries) have gradients summed
  over the devices. With the residual in the loss lse's cotangent is not 0
  (the backward's dlse, or delta's shift with sinks)."""
  calls = _stand_in_kernels(monkeypatch)
  mesh = _mesh((2,), ("data",))
  q, k, v = _qkv(B=2, T=32, N=4, K=2, D=16, seed=3)
  kw = {"lengths": dict(query_seq_lengths=jnp.array([20, 32]),
                        key_value_seq_lengths=jnp.array([32, 9])),
        "segments": dict(query_segment_ids=jnp.arange(64).reshape(2, 32) // 12,
                         key_value_segment_ids=jnp.arange(64).reshape(2, 32) // 12),
        }.get(option, {})
  sinks = jax.random.normal(jax.random.key(4), (4,)) if "sinks" in option else None
  residual = option.startswith("residual")
  causal = option != "whole_kv"  # half the queries see all keys: no diagonal
  rows, kv = (P(None, "data"), P()) if option == "whole_kv" else (P("data"), P("data"))

  def attend(q, k, v, kw, sinks, implementation):
    return flash3.dot_product_attention(q, k, v, is_causal=causal, sinks=sinks,
                                        implementation=implementation,
                                        return_residual=residual, **kw)

  f = jax.shard_map(lambda *a: attend(*a, "mosaic"), mesh=mesh,
                    in_specs=(rows, kv, kv, P("data"), P()), out_specs=rows)
  loss = lambda f: lambda q, k, v, sinks: sum(
      jnp.sum(jnp.sin(x)) for x in jax.tree.leaves(f(q, k, v, kw, sinks)))
  argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
  got = jax.jit(jax.value_and_grad(loss(f), argnums=argnums))(q, k, v, sinks)
  want = jax.value_and_grad(loss(lambda *a: attend(*a, "xla")), argnums=argnums)(
      q, k, v, sinks)
  assert set(calls) == {"forward_call", "backward_call"}  # the kernel path ran
  for name, x, y in zip(("loss", "dq", "dk", "dv", "dsinks"),
                        jax.tree.leaves(got), jax.tree.leaves(want)):
    assert not np.isnan(np.asarray(x)).any(), name
    np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-5, err_msg=name)


def test_kernel_path_inside_shard_map_still_needs_the_psum():
  """check_vma still refuses a body that returns a per-device value as
  replicated: the kernel path's o varies, as the XLA path's does."""
  mesh = _mesh((2,), ("data",))
  q = jnp.ones((2, 64, 2, 64), jnp.bfloat16)

  def per_shard(q):
    return flash3.dot_product_attention(q, q, q, implementation="mosaic").sum()

  f = jax.shard_map(per_shard, mesh=mesh, in_specs=P("data"), out_specs=P())
  with flash3.interpret_kernels(), pytest.raises(ValueError, match="out_specs"):
    jax.make_jaxpr(f)(q)


def _cp_call(q, k, v, mesh=None, **kw):
  mesh = mesh or _mesh((4,), ("ctx",))
  kw.setdefault("sequence_axis", "ctx")
  return context_parallel_attention(q, k, v, mesh=mesh, implementation="xla", **kw)


def test_context_parallel_errors_match_dot_product_attention():
  """Errors the two APIs share come from the same checks, word for word."""
  q, k, v = _qkv(B=2, T=64, N=4, K=2)
  seg = jnp.zeros((2, 64), jnp.int32)
  cases = [
      (ValueError, (q, k, v), dict(query_segment_ids=seg)),
      (ValueError, (q, k, v), dict(query_segment_ids=seg[:, :10],
                                   key_value_segment_ids=seg[:, :10])),
      (TypeError, (q, k, v), dict(scale="0.5")),
      (TypeError, (q, k, v), dict(local_window_size=2.0)),
      (TypeError, (q.astype(jnp.int32), k, v), {}),
      (ValueError, (q, k, v), dict(sinks=jnp.zeros((3,)))),
      (ValueError, (q, k, v), dict(scale=float("nan"))),
  ]
  for error, args, kw in cases:
    with pytest.raises(error) as single:
      flash3.dot_product_attention(*args, implementation="xla", **kw)
    with pytest.raises(error) as parallel:
      _cp_call(*args, **kw)
    assert str(parallel.value) == str(single.value)
  # The messages name the argument.
  with pytest.raises(ValueError, match="only query_segment_ids was given"):
    _cp_call(q, k, v, query_segment_ids=seg)
  with pytest.raises(ValueError, match=re.escape(
      "query_segment_ids has shape (2, 10); allowed: (2, 64)")):
    _cp_call(q, k, v, query_segment_ids=seg[:, :10], key_value_segment_ids=seg[:, :10])
  with pytest.raises(TypeError, match="scale='0.5'; allowed: a finite Python or NumPy number"):
    _cp_call(q, k, v, scale="0.5")


def test_context_parallel_rejects_mesh_axes_that_do_not_fit():
  q, k, v = _qkv(B=2, T=64, N=4, K=2)
  mesh = _mesh((4,), ("ctx",))
  mesh2 = _mesh((2, 2), ("data", "ctx"))
  cases = [
      (dict(sequence_axis=None), "sequence_axis=None is not an axis of the mesh"),
      (dict(batch_axis="data"), "batch_axis='data' is not an axis of the mesh"),
      (dict(batch_axis="ctx"), "batch_axis='ctx' is also sequence_axis"),
      (dict(head_axis="ctx"), "head_axis='ctx' is also sequence_axis"),
      (dict(layout="striped"), "layout='striped'"),
  ]
  for kw, message in cases:
    with pytest.raises(ValueError, match=re.escape(message)):
      _cp_call(q, k, v, mesh=mesh, **kw)
  with pytest.raises(ValueError, match=re.escape("head_axis='data' is also batch_axis")):
    _cp_call(q, k, v, mesh=mesh2, batch_axis="data", head_axis="data")
  # K=2 key/value heads over a head axis of size 4.
  with pytest.raises(ValueError, match=re.escape(
      "key has K=2, which head_axis='ctx' of size 4 does not divide")):
    _cp_call(q, k, v, mesh=_mesh((1, 4), ("seq", "ctx")), sequence_axis="seq",
             head_axis="ctx")
  # B=2 over a batch axis of size 4.
  with pytest.raises(ValueError, match=re.escape(
      "query has B=2, which batch_axis='ctx' of size 4 does not divide")):
    _cp_call(q, k, v, mesh=_mesh((1, 4), ("seq", "ctx")), sequence_axis="seq",
             batch_axis="ctx")
  # T=36: a multiple of 4 (contiguous) but not of 8 (zigzag over 4 devices).
  q36, k36, v36 = _qkv(B=2, T=36, N=4, K=2)
  with pytest.raises(ValueError, match=re.escape(
      "query has T=36, which is not a multiple of 8 (layout='zigzag'")) as e:
    _cp_call(q36, k36, v36, mesh=mesh)
  assert "sequence_axis='ctx' of size 4" in str(e.value)
  assert _cp_call(q36, k36, v36, mesh=mesh, layout="contiguous").shape == q36.shape
  with pytest.raises(ValueError, match=re.escape("query has T=34, which is not a multiple of 4")):
    _cp_call(*_qkv(B=2, T=34, N=4, K=2), mesh=mesh, layout="contiguous")


@pytest.mark.parametrize("bad", [None, "ctx", ("ctx",)])
def test_context_parallel_refuses_a_mesh_that_is_not_a_mesh(bad):
  q, k, v = _qkv(B=2, T=64, N=4, K=2)
  with pytest.raises(TypeError, match=re.escape(
      f"mesh={bad!r}; allowed: a jax.sharding.Mesh (e.g. from jax.make_mesh)")):
    context_parallel_attention(q, k, v, mesh=bad, sequence_axis="ctx", implementation="xla")


def test_context_parallel_checks_before_tracing(monkeypatch):
  """A refused call never reaches shard_map."""
  def fail(*args, **kwargs):
    raise AssertionError("shard_map reached")
  monkeypatch.setattr(jax, "shard_map", fail)
  q, k, v = _qkv(B=2, T=64, N=4, K=2)
  with pytest.raises(ValueError, match="head_axis"):
    _cp_call(q, k, v, mesh=_mesh((1, 4), ("seq", "ctx")), sequence_axis="seq",
             head_axis="ctx")
  with pytest.raises(AssertionError, match="shard_map reached"):
    _cp_call(q, k, v)


def test_context_parallel_refuses_a_head_axis_on_the_kernels():
  """Head-split kernel calls were wrong on two H200s: refused; the XLA path still takes it."""
  mesh = _mesh((2, 2), ("heads", "ctx"))
  q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(B=1, T=32, N=4, K=2, D=64))
  call = lambda **kw: context_parallel_attention(
      q, k, v, mesh=mesh, sequence_axis="ctx", head_axis="heads", is_causal=True,
      layout="contiguous", **kw)
  with flash3.interpret_kernels():
    with pytest.raises(NotImplementedError, match="head_axis='heads'"):
      call()
  np.testing.assert_allclose(
      call(implementation="xla").astype(jnp.float32),
      flash3.dot_product_attention(q, k, v, is_causal=True, implementation="xla"
                                   ).astype(jnp.float32), atol=2e-2)


# ------------------------------------- the kernels' axis names and the mesh's

def _lowered_for_cuda_under_mesh(fn, mesh, specs, args):
  """``fn`` per shard (shard_map over ``mesh``), lowered for CUDA on this CPU machine."""
  f = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)
  return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# Mosaic GPU marks a kernel that reads the device's id (here: from a mesh axis)
# as a multi-device kernel; in the lowered text that shows as "xla_replica_ids".
_READS_DEVICE_ID = "xla_replica_ids"


def test_reads_device_id_marker_shows_a_mesh_axis_index():
  """The check below is live: a kernel's axis_index of a MESH axis reads the device id."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  mesh = _mesh((2,), ("x",))

  def per_shard(x):
    def body(x_ref, o_ref):
      o_ref[...] = x_ref[...] + jax.lax.axis_index("x").astype(jnp.float32)
    o = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    return o.sum()
  x = jax.ShapeDtypeStruct((2 * 128,), jnp.float32)
  assert _READS_DEVICE_ID in _lowered_for_cuda_under_mesh(per_shard, mesh, (P("x"),), (x,))


@pytest.mark.parametrize("case", ["grid", "persistent"])
@pytest.mark.parametrize("axis", ["heads", "batch", "q_tiles", "kv_tiles", "cta", "wg"])
def test_kernels_never_read_the_mesh_position(axis, case):
  """The H200 head-sharding bug (2026-11-30), on the CPU.

  Pallas Mosaic GPU resolves ``lax.axis_index(name)`` in a kernel against the
  JAX mesh axes first. The kernels' grid axis was named "heads": under a mesh
  axis "heads" every CTA took the device's position on that axis as its head,
  so device 0 computed only its local head 0 (written by every head CTA), device
  1 only its local head 1, and the other heads were left unwritten. This lowers
  forward and backward (the API's kernel path: custom_vjp, custom_partitioning)
  per shard under meshes named like the kernels' old axes; none may read the
  device id.
  """
  from flash3._kernel_call import Extras, KernelArgs, mosaic_attention
  if case == "grid":   # A window keeps the grid kernel (kernels/config.py).
    spec, D = MaskSpec(causal=True, window_left=64), 128
  else:                # Causal D=64 at short lengths runs persistent.
    spec, D = MaskSpec(causal=True), 64
  static = KernelArgs(scale=0.1, spec=spec, interpret=False)
  mesh = _mesh((2,), (axis,))

  def per_shard(q, k, v):
    loss = lambda q, k, v: mosaic_attention(q, k, v, Extras(), static)[0].astype(
        jnp.float32).sum()
    return sum(g.astype(jnp.float32).sum()
               for g in jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
  q = jax.ShapeDtypeStruct((2, 256, 4, D), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 256, 2, D), jnp.bfloat16)
  heads = P(None, None, axis, None)
  text = _lowered_for_cuda_under_mesh(per_shard, mesh, (heads,) * 3, (q, k, k))
  assert text.count("mosaic_gpu_v2") >= 2   # Forward and backward kernels.
  assert _READS_DEVICE_ID not in text


def test_kernel_axis_names_are_reserved(mesh):
  from flash3.kernels import common
  common.check_mesh_axis_names(("data", "model", "heads", "batch", "wg"))
  bad = _mesh((2, 2), ("data", common.HEADS_AXIS))
  with pytest.raises(ValueError, match="reserved for flash3's kernels"):
    common.check_mesh_axis_names(bad.axis_names)
  q, k, v = _qkv(B=2, T=64, N=4, K=2)
  with flash3.interpret_kernels():   # So that the kernel path is chosen here.
    with pytest.raises(ValueError, match="reserved for flash3's kernels"):
      context_parallel_attention(
          *(x.astype(jnp.bfloat16) for x in (q, k, v)),
          mesh=_mesh((4,), (common.CTA_AXIS,)), sequence_axis=common.CTA_AXIS,
          implementation="mosaic")
