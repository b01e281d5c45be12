"""The one switch between attention implementations: flash3, cuDNN or XLA.

All three compute causal attention within documents (segment ids) with GQA, on
q: [B, T, N, D], k and v: [B, T, K, D] (N % K == 0), segment_ids: int32[B, T] or None,
and return o: [B, T, N, D] in q's dtype.

- "flash3": flash3.dot_product_attention (its implementation=None picks the Mosaic GPU
  kernel on Hopper and warns once and runs the XLA path elsewhere). Until that API exists
  in this checkout, jax.nn.dot_product_attention stands in, with a warning.
- "cudnn": cuDNN's fused flash attention. The public jax.nn.dot_product_attention has no
  segment ids, so packed documents go through jax's cuDNN wrapper's packed layout
  (per-row segment lengths and offsets), the same kernel jax.nn calls.
- "xla": jax.nn.dot_product_attention(implementation="xla") with a [B, 1, T, T] mask.
- "identity": o = q + k + v (k, v repeated over the GQA groups), an elementwise stand-in
  that keeps every projection live; only for measuring the share of step time in attention.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("flash3", "cudnn", "xla")


def parse_impls(text: str) -> list[str]:
  """"flash3,cudnn" -> ["flash3", "cudnn"] (the tools' --impls); ValueError when
  empty or naming an implementation not in IMPLEMENTATIONS."""
  impls = [s.strip() for s in text.split(",") if s.strip()]
  if not impls or any(s not in IMPLEMENTATIONS for s in impls):
    raise ValueError(f"--impls {text!r}: allowed: {', '.join(IMPLEMENTATIONS)}")
  return impls


@functools.cache
def flash3_api():
  """flash3.dot_product_attention, or None while the API has not landed."""
  try:
    import flash3
  except ImportError:
    return None
  return getattr(flash3, "dot_product_attention", None)


def describe(implementation: str) -> str:
  """One line saying which kernel will really run, for the training log."""
  from flash3._device import why_not_hopper  # noqa: PLC0415 (keeps import cheap for tests)
  reason = why_not_hopper()
  if implementation == "flash3":
    if flash3_api() is None:
      return "flash3 API not available yet: jax.nn.dot_product_attention (XLA/cuDNN) stands in"
    if reason is not None:
      return f"flash3 on the XLA path: {reason}"
    return "flash3 Mosaic GPU kernels (FlashAttention-3)"
  if implementation == "cudnn":
    return "cuDNN fused attention (jax.nn / jax cuDNN wrapper)"
  if implementation == "xla":
    return "XLA (jax.nn.dot_product_attention, implementation='xla')"
  return implementation


def _segment_mask(segment_ids):
  """bool[B, 1, T, T]: query and key in the same document."""
  return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def _xla(q, k, v, segment_ids):
  mask = None if segment_ids is None else _segment_mask(segment_ids)
  return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")


def _packed_lengths_offsets(segment_ids, max_segments: int):
  """cuDNN's packed layout from segment ids numbered 1..m, contiguous within each row.

  Returns seqlen int32[B, M] and offsets int32[B, M + 1]: the lengths and the start of
  each of a row's m segments, padded with -1 (no end marker: jax's wrapper flattens the
  non-negative entries of all rows into one list that must pair with the lengths, so an
  end marker would shift every later row's segments; B = 8 gave NaN on the H200).
  """
  B, T = segment_ids.shape
  ids = jnp.arange(1, max_segments + 1, dtype=jnp.int32)
  counts = jnp.sum(segment_ids[:, :, None] == ids[None, None, :], axis=1, dtype=jnp.int32)
  num = jnp.max(segment_ids, axis=1, keepdims=True)
  seqlen = jnp.where(ids[None, :] <= num, counts, -1)
  starts = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), jnp.cumsum(counts, axis=1)], axis=1)
  offsets = jnp.where(jnp.arange(max_segments + 1)[None, :] < num, starts, -1)
  return seqlen, offsets


def _cudnn(q, k, v, segment_ids, max_segments):
  if segment_ids is None:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
  # Private module: the only way to give cuDNN packed documents from JAX 0.11.2.
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa  # noqa: PLC0415
  seqlen, offsets = _packed_lengths_offsets(segment_ids, max_segments)
  scale = 1.0 / float(q.shape[-1]) ** 0.5
  return cudnn_fa.dot_product_attention(
      q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets, kv_offsets=offsets,
      scale=scale, mask_type=cudnn_fa.MaskType.PADDING_CAUSAL, qkv_layout="BTNH")


_warned_standin = False


def _flash3(q, k, v, segment_ids, implementation):
  api = flash3_api()
  if api is None:
    global _warned_standin
    if not _warned_standin:
      warnings.warn("flash3.dot_product_attention not found; using jax.nn.dot_product_attention",
                    stacklevel=2)
      _warned_standin = True
    return _xla(q, k, v, segment_ids)
  return api(q, k, v, is_causal=True, query_segment_ids=segment_ids,
             key_value_segment_ids=segment_ids, implementation=implementation)


def attend(q, k, v, segment_ids, implementation: str, max_segments: int = 0,
           flash3_implementation: str | None = None):
  """Causal GQA attention within documents; see the module docstring for shapes.

  max_segments: static bound on documents per row, for cuDNN's packed layout.
  flash3_implementation: passed to flash3 ("mosaic" raises where the kernels cannot run).
  """
  if implementation == "flash3":
    return _flash3(q, k, v, segment_ids, flash3_implementation)
  if implementation == "cudnn":
    return _cudnn(q, k, v, segment_ids, max_segments)
  if implementation == "xla":
    return _xla(q, k, v, segment_ids)
  if implementation == "identity":
    # Uses q, k and v so no projection becomes dead code; costs one elementwise pass.
    groups = q.shape[2] // k.shape[2]
    return q + jnp.repeat(k, groups, axis=2) + jnp.repeat(v, groups, axis=2)
  raise ValueError(f"attention implementation must be one of {IMPLEMENTATIONS}, "
                   f"got {implementation!r}")
