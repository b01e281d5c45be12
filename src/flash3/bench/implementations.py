"""The contenders, each built for one case or refused with a reason.

* ``flash3``: ``flash3.dot_product_attention(implementation="mosaic")``.
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``.
* ``xla``: ``jax.nn.dot_product_attention(implementation="xla")``, only where
  its float32 logits fit in memory.
* ``jax-mgpu``: the FlashAttention-3 kernel shipped in jax 0.11.2,
  ``jax.experimental.pallas.ops.gpu.attention_mgpu``: float16 only, no causal
  backward, lengths multiples of its blocks, no softmax scale (it is fed
  ``q * scale``), best of a few block sizes.
* ``tokamax``: ``tokamax.dot_product_attention(implementation="mosaic")`` when
  ``import tokamax`` works.

Two more, only when named in ``--impls`` (not in the default set): backward
determinism differs between contenders. XLA runs cuDNN's flash-attention
backward in its non-deterministic form (dq by atomics) unless
``xla_gpu_deterministic_ops`` is set (openxla/xla#14125), while flash3's
default backward is deterministic.

* ``cudnn-det``: ``cudnn`` compiled with ``xla_gpu_deterministic_ops=True``
  (cuDNN's deterministic backward): the like-for-like rival of ``flash3``.
* ``flash3-nondet``: ``flash3`` with ``deterministic=False`` (the single-
  kernel backward with dq by float32 atomics where it is faster): the
  like-for-like rival of ``cudnn``.

Packed documents go to the contenders without segment ids as a dense boolean
mask (B, 1, T, T), the array built outside the timed function; jax.nn turns
it into a bias inside it, and cuDNN then computes every pair, so those rows
are not the same work (the headline leaves them out of its means). Padding lengths go to
each contender that takes them as query_seq_lengths and
key_value_seq_lengths: one int32 (B,) array (the same for both), also built
outside the timed function; jax-mgpu refuses them.

A contender says what it cannot do by raising ``Unsupported``; anything it
raises later (while tracing, compiling or running) is caught by the runner and
reported the same way.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from flash3.bench import results as results_lib


class Unsupported(Exception):
  """This contender cannot run this case; the message says why."""


@dataclasses.dataclass(frozen=True)
class Variant:
  """One way to run a contender on a case (e.g. one block size).

  Attributes:
    label: what distinguishes it ("" when there is one way).
    fn: ``fn(q, k, v, *aux) -> o``, BTNH, traceable and differentiable in
      q, k, v.
    aux: extra array arguments (segment ids, a dense mask, lengths).
    q_scale: the contender is fed ``q * q_scale`` (1.0 = plain q).
    config: the kernel configs it runs, recorded with its results (flash3:
      what its heuristics pick, ``flash3_configs``).
    compiler_options: XLA options its timed function is compiled with
      (``jax.jit(..., compiler_options=...)``), e.g. deterministic ops.
  """

  label: str
  fn: Callable[..., Any]
  aux: tuple = ()
  q_scale: float = 1.0
  config: str = ""  # The kernel config it runs, where the contender says.
  compiler_options: tuple[tuple[str, Any], ...] = ()  # (name, value) pairs


@dataclasses.dataclass(frozen=True)
class Implementation:
  name: str
  description: str
  unavailable: Callable[[], str | None]
  variants: Callable[..., list[Variant]]  # (case, tune: bool) -> variants
  default: bool = True  # In the set run when --impls is not given.


def _dense_mask(case):
  seg = jnp.asarray(case.segment_ids())
  return seg[:, None, :, None] == seg[:, None, None, :]


LENGTHS = ("query_seq_lengths", "key_value_seq_lengths")


def _with_aux(f, label: str, keywords: list[tuple[str, ...]], arrays: list
              ) -> Variant:
  """A Variant calling ``f(q, k, v, **kw)``, where aux array i is passed as
  each keyword of ``keywords[i]`` (segment ids and lengths serve queries and
  keys both)."""
  def fn(q, k, v, *aux):
    kwargs = {name: x for names, x in zip(keywords, aux) for name in names}
    return f(q, k, v, **kwargs)
  return Variant(label, fn, tuple(arrays))


def _lengths_aux(case, keywords, arrays) -> None:
  """Appends the case's lengths, if any, to a Variant's aux (in place)."""
  if case.seq_lengths is not None:
    keywords.append(LENGTHS)
    arrays.append(jnp.asarray(case.lengths()))


# ----- flash3 -----------------------------------------------------------------

def _flash3_unavailable():
  import flash3
  if not hasattr(flash3, "dot_product_attention"):
    return "flash3.dot_product_attention is not in this checkout yet"
  return None


def flash3_configs(case, deterministic: bool = True) -> str:
  """The kernel configs flash3's heuristics pick for ``case``, which is what
  ``dot_product_attention`` runs: "fwd ForwardConfig(...); bwd
  BackwardConfig(...)", every field. Host-side arithmetic only (no GPU
  needed)."""
  from flash3.kernels.backward import BackwardConfig
  from flash3.kernels.forward import default_config
  spec = case.mask_spec
  fwd = default_config(case.head_dim, jnp.dtype(case.dtype), spec, case.q_len,
                       case.kv_len, packed=case.num_docs is not None)
  # The backward runs D as given (only the forward pads it).
  bwd = BackwardConfig.heuristic(case.head_dim, case.q_len, case.kv_len, spec,
                                 deterministic=deterministic,
                                 packed=case.num_docs is not None)
  return f"fwd {fwd}; bwd {bwd}"


def _flash3_variants(case, tune, deterministic=True):
  del tune
  import flash3
  f = functools.partial(flash3.dot_product_attention, is_causal=case.causal,
                        local_window_size=case.window, implementation="mosaic",
                        deterministic=deterministic)
  keywords, arrays = [], []
  if case.num_docs is not None:
    keywords.append(("query_segment_ids", "key_value_segment_ids"))
    arrays.append(jnp.asarray(case.segment_ids()))
  _lengths_aux(case, keywords, arrays)
  config = flash3_configs(case, deterministic)
  return [dataclasses.replace(_with_aux(f, "", keywords, arrays), config=config)]


# ----- jax.nn: cuDNN and XLA --------------------------------------------------

def _jax_nn_variants(case, implementation):
  f = functools.partial(jax.nn.dot_product_attention, is_causal=case.causal,
                        local_window_size=case.window,
                        implementation=implementation)
  return [_jax_nn_like(f, case)]


def _jax_nn_like(f, case) -> Variant:
  """The Variant of a function with jax.nn's arguments: packed documents as
  a dense mask, lengths as both sequence lengths."""
  keywords, arrays = [], []
  if case.num_docs is not None:
    keywords.append(("mask",))
    arrays.append(_dense_mask(case))
  _lengths_aux(case, keywords, arrays)
  label = results_lib.DENSE_MASK if case.num_docs is not None else ""
  return _with_aux(f, label, keywords, arrays)


def _cudnn_variants(case, tune):
  del tune
  return _jax_nn_variants(case, "cudnn")


DETERMINISTIC_OPS = (("xla_gpu_deterministic_ops", True),)


def _cudnn_det_variants(case, tune):
  config = ", ".join(f"{k}={v}" for k, v in DETERMINISTIC_OPS)
  return [dataclasses.replace(v, compiler_options=DETERMINISTIC_OPS, config=config)
          for v in _cudnn_variants(case, tune)]


def device_memory_bytes() -> int:
  """The first device's memory limit; 80 GB when it does not say."""
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # Some backends do not implement memory_stats.
    stats = {}
  return int(stats.get("bytes_limit", 80 * 2**30))


def xla_bytes(case) -> int:
  """A rough peak of jax.nn's XLA path: a few float32 (B, N, Tq, Tk) arrays
  (logits, probabilities and their gradients in the backward)."""
  return 4 * 4 * case.batch * case.num_heads * case.q_len * case.kv_len


def _xla_variants(case, tune):
  del tune
  need, have = xla_bytes(case), device_memory_bytes()
  if need > 0.8 * have:
    raise Unsupported(f"needs about {need / 2**30:.0f} GiB for its dense "
                      f"logits, more than 80% of {have / 2**30:.0f} GiB")
  return _jax_nn_variants(case, "xla")


# ----- jax's FA3 in Mosaic GPU (attention_mgpu) -------------------------------

def _mgpu_unavailable():
  try:
    from jax.experimental.pallas.ops.gpu import attention_mgpu  # noqa: F401
  except Exception as e:  # ImportError, or a missing GPU dependency.
    return f"cannot import attention_mgpu: {e}"
  return None


MGPU_BLOCK_KV = (128, 64, 256)  # Forward candidates, all tried when tuning.
# Untuned, one per head_dim: the best of MGPU_BLOCK_KV in the fa3 grid on an
# H200 (2026-11-30, docs/benchmarks/h200), so --no-tune costs it little speed
# for a third of the compiles.
MGPU_UNTUNED_BLOCK_KV = {64: 256, 128: 128, 256: 64}


def _mgpu_variants(case, tune):
  if case.dtype != "float16":
    raise Unsupported("float16 only (its shared-memory scratch is float16)")
  if case.window is not None or case.num_docs is not None:
    raise Unsupported("no windows or segment ids")
  if case.seq_lengths is not None:
    raise Unsupported("no padding lengths")
  if case.causal and case.q_len != case.kv_len:
    raise Unsupported("causal needs Tq == Tk")
  from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu
  variants = []
  untuned = (MGPU_UNTUNED_BLOCK_KV.get(case.head_dim, MGPU_BLOCK_KV[0]),)
  for block_kv in (MGPU_BLOCK_KV if tune else untuned):
    config = mgpu.TuningConfig(
        block_q=64, block_kv=block_kv, max_concurrent_steps=2,
        causal=case.causal, block_q_dkv=64, block_kv_dkv=64, block_q_dq=64,
        block_kv_dq=64)

    # Its causal backward raises NotImplementedError by itself when traced.
    def fn(q, k, v, config=config):
      return mgpu.attention(q, k, v, config)

    variants.append(Variant(f"block_q=64 block_kv={block_kv}", fn,
                            q_scale=case.scale))
  return variants


# ----- tokamax ----------------------------------------------------------------

def _tokamax_unavailable():
  try:
    import tokamax  # noqa: F401
  except Exception as e:
    return f"import tokamax failed: {type(e).__name__}: {e}"
  return None


# tokamax 0.0.17's dot_product_attention takes jax.nn's arguments (BTNH, mask=,
# is_causal=, local_window_size=(left, right), and query_seq_lengths= and
# key_value_seq_lengths= as (B,) ints, which become its mask's q_end and
# k_end); "mosaic" picks its Mosaic GPU kernel on an NVIDIA device and raises
# NotImplementedError rather than fall back. The tests set "xla" to check
# these arguments on a CPU.
TOKAMAX_IMPLEMENTATION = "mosaic"


def _tokamax_variants(case, tune):
  del tune
  import tokamax
  f = functools.partial(tokamax.dot_product_attention, is_causal=case.causal,
                        local_window_size=case.window,
                        implementation=TOKAMAX_IMPLEMENTATION)
  return [_jax_nn_like(f, case)]


IMPLEMENTATIONS = {
    impl.name: impl for impl in (
        Implementation("flash3", "flash3 Mosaic GPU kernels",
                       _flash3_unavailable, _flash3_variants),
        Implementation("cudnn", "jax.nn.dot_product_attention, cuDNN",
                       lambda: None, _cudnn_variants),
        Implementation("xla", "jax.nn.dot_product_attention, XLA",
                       lambda: None, _xla_variants),
        Implementation("jax-mgpu", "jax's FA3 (pallas ops gpu attention_mgpu)",
                       _mgpu_unavailable, _mgpu_variants),
        Implementation("tokamax", "tokamax Mosaic GPU attention",
                       _tokamax_unavailable, _tokamax_variants),
        Implementation("cudnn-det", "cuDNN with XLA's deterministic ops (its "
                       "deterministic backward)", lambda: None, _cudnn_det_variants,
                       default=False),
        Implementation("flash3-nondet", "flash3 with deterministic=False (dq by "
                       "atomics where faster)", _flash3_unavailable,
                       functools.partial(_flash3_variants, deterministic=False),
                       default=False),
    )
}
BASELINE = "cudnn"  # Ratios in the table are to this one.


def select(names: list[str] | None) -> list[Implementation]:
  """The implementations named (the default set when None), in the
  registry's order.

  Raises:
    ValueError: for a name not in the registry.
  """
  if names is None:
    return [i for i in IMPLEMENTATIONS.values() if i.default]
  unknown = [n for n in names if n not in IMPLEMENTATIONS]
  if unknown:
    raise ValueError(f"unknown implementation(s) {unknown}; choose from "
                     f"{list(IMPLEMENTATIONS)}")
  return [IMPLEMENTATIONS[n] for n in IMPLEMENTATIONS if n in names]
