"""flash3.dot_product_attention: jax.nn's signature, FlashAttention-3 underneath."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from flash3 import _dispatch, _validate
from flash3._kernel_call import Extras, KernelArgs, mosaic_attention
from flash3.reference import attention_reference
from flash3.visibility import MaskSpec


def dot_product_attention(
    query: jax.typing.ArrayLike,
    key: jax.typing.ArrayLike,
    value: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    mask: jax.typing.ArrayLike | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.typing.ArrayLike | None = None,
    key_value_seq_lengths: jax.typing.ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Literal["mosaic", "xla"] | None = None,
    return_residual: bool = False,
    causal_alignment: Literal["top_left", "bottom_right"] = "top_left",
    query_segment_ids: jax.typing.ArrayLike | None = None,
    key_value_segment_ids: jax.typing.ArrayLike | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.typing.ArrayLike | None = None,
    deterministic: bool = True,
):
  r"""Scaled dot-product attention, exact, with FlashAttention-3 kernels on Hopper.

  A drop-in for ``jax.nn.dot_product_attention``: the same layout, names and
  defaults, plus masks real models use. For each head,
  ``o = softmax(mask(softcap(scale * q k^T + bias))) v``; the algorithm of the
  kernels is FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608, sections 3.1
  and 3.2: warp specialisation and ping-pong scheduling), the online softmax of
  FlashAttention-2 (Dao 2023, section 3.1). docs/semantics.md defines every
  rule below with examples.

  Shapes (B batch, Tq/Tk query/key length, N query heads, K key/value heads,
  D head_dim; K must divide N: GQA, and MQA for K = 1):

  Args:
    query: (B, Tq, N, D) or (Tq, N, D); float16, bfloat16 or float32.
    key: (B, Tk, K, D) or (Tk, K, D), query's dtype.
    value: key's shape and dtype.
    bias: optional float array broadcastable to (B, N, Tq, Tk), added to the
      scaled logits.
    mask: optional bool array broadcastable to (B, N, Tq, Tk); True = keep.
    scale: multiplies q.k; default 1/sqrt(D). A finite Python float.
    is_causal: keep key j only if j <= i', the aligned query position.
    query_seq_lengths: optional (B,) int: queries at index >= length are padding.
    key_value_seq_lengths: optional (B,) int: keys at index >= length are padding.
    local_window_size: optional int w or (left, right): keep keys with
      i' - left <= j <= i' + right, both ends inclusive.
    implementation: None picks the Mosaic GPU kernels on a Hopper GPU when
      they support the call, else the XLA path (with a one-time warning that
      says why); "mosaic" insists on the kernels; "xla" is the float32
      reference (memory O(Tq * Tk)).
    return_residual: also return the logsumexp.
    causal_alignment: "top_left" (jax.nn: i' = i) or "bottom_right"
      (FlashAttention, cuDNN: i' = i + Tk - Tq, using the valid lengths when
      sequence lengths are given). Applies to is_causal and the window.
    query_segment_ids, key_value_segment_ids: optional (B, Tq) and (B, Tk) int
      (or (Tq,), (Tk,) for rank-3 inputs): a query sees only keys with the
      same id (packed documents). Give both or neither.
    logits_soft_cap: optional c > 0: logits become c * tanh(logits / c), after
      scale and bias, before masking (Gemma 2).
    sinks: optional (N,) float: one extra logit per head in the softmax
      denominator, with no value attached (gpt-oss).
    deterministic: True (default): gradients are bitwise reproducible run to
      run (two backward kernels, no atomics: FlashAttention-3's backward with
      s and dp recomputed for dq). False lets the backward use its
      single-kernel variant, which adds dq with float32 reduce-add atomics
      (dq's last bits then vary run to run; dk, dv stay reproducible), where
      it was faster on an H200: head_dim 64, also 8 to 56 when not a multiple
      of 16 (the backward zero-pads those to 64) (0.98 of cuDNN's default
      backward against 0.92, FlashAttention-3 grid, bfloat16, 2026-12-01,
      docs/benchmarks/h200/2026-12-01-s10/tune.md); elsewhere the
      deterministic kernels, faster there, run anyway. (cuDNN's own
      backward is non-deterministic under XLA's defaults; its deterministic
      form ran at 0.79 of that speed in the same run.) The forward and the XLA
      path are deterministic either way.

  Returns:
    The output, query's shape and dtype; with return_residual, also the
    logsumexp of the softmax denominator (sink included), shape (B, Tq, N) or
    (Tq, N), float32, NATURAL log. A query row that sees no key gets output 0,
    logsumexp -inf (the sink's logit if sinks are given, whose gradient a
    loss on that logsumexp reaches), and zero gradients through the output;
    jax.nn's XLA path instead returns the mean of v there.

  Raises:
    ValueError: a shape or value is not allowed (the message names the
      argument, its value and what is allowed).
    TypeError: a dtype is not allowed, or an argument is of the wrong kind
      (a non-number or traced scale or soft cap, a window that is not ints,
      a list that is not a rectangular array of numbers, for any argument).
    NotImplementedError: implementation="mosaic" cannot run this call (not a
      Hopper GPU, or an option the kernels do not support yet); says which.
      Also a second derivative (grad of grad) through the kernels, and
      inputs sharded over key/value heads under jit (docs/multi_gpu.md).
  """
  p = _validate.check(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths,
      local_window_size=local_window_size, implementation=implementation,
      return_residual=return_residual, causal_alignment=causal_alignment,
      query_segment_ids=query_segment_ids,
      key_value_segment_ids=key_value_segment_ids,
      logits_soft_cap=logits_soft_cap, sinks=sinks, deterministic=deterministic)

  B, Tq, N, D = p.q.shape
  if B * Tq * N == 0 or p.k.shape[1] == 0:
    # Nothing to launch: every row sees no key (or there are no rows).
    o, lse = _empty(p)
  elif D > 0 and _dispatch.choose(p, implementation) == "mosaic":
    static = KernelArgs(scale=p.scale, spec=p.spec,
                        interpret=_dispatch.interpret_params(),
                        softcap=p.logits_soft_cap, deterministic=p.deterministic)
    k, v, kv_ids = p.k, p.v, p.key_value_segment_ids
    if p.query_seq_lengths is None and p.key_value_seq_lengths is None:
      if (cut := _seen_keys(p.spec, p.q.shape[1], k.shape[1])) is not None:
        lo, hi = cut
        k, v = k[:, lo:hi], v[:, lo:hi]
        kv_ids = None if kv_ids is None else kv_ids[:, lo:hi]
    extras = Extras(p.query_seq_lengths, p.key_value_seq_lengths,
                    p.query_segment_ids, kv_ids, p.sinks)
    o, lse = mosaic_attention(p.q, k, v, extras, static)
    lse = lse.transpose(0, 2, 1)
  else:  # The XLA path; also head_dim 0 (all logits 0, no kernel to launch).
    o, lse = attention_reference(
        p.q, p.k, p.v, scale=p.scale, spec=p.spec, bias=p.bias, mask=p.mask,
        query_seq_lengths=p.query_seq_lengths,
        key_value_seq_lengths=p.key_value_seq_lengths,
        query_segment_ids=p.query_segment_ids,
        key_value_segment_ids=p.key_value_segment_ids,
        logits_soft_cap=p.logits_soft_cap, sinks=p.sinks)

  if p.unbatched:
    o, lse = o[0], lse[0]
  return (o, lse) if return_residual else o


def _seen_keys(spec: MaskSpec, q_len: int, kv_len: int) -> tuple[int, int] | None:
  """The keys [lo, hi) that some query sees, when that is fewer than all.

  E07: the kernels compute whole key tiles and multiply the masked scores'
  zero probabilities by k and v rows, so NaN or Inf in a row no query sees
  would reach the result (0 * NaN) when it shares a tile with seen keys.
  Cutting k and v to the keys some query sees (a static slice: the causal
  mask's and the window's reach) leaves no such row to read. None when every
  key is seen, when no key is, or when the cut would move the mask's
  alignment (it never does for causal masks and windows: top_left only cuts
  the end, bottom_right only the start).
  """
  if not spec.is_structural:
    return None
  lo, hi = spec.key_range(0, q_len, spec.shift(q_len, kv_len), kv_len)
  lo, hi = max(int(lo), 0), min(int(hi), kv_len)
  if lo >= hi or (lo == 0 and hi == kv_len):
    return None
  if spec.shift(q_len, hi - lo) != spec.shift(q_len, kv_len) - lo:
    return None
  return lo, hi


def _empty(p: _validate.Problem):
  """Output and logsumexp when Tq, Tk, B or N is zero (no kernel launch)."""
  B, Tq, N, _ = p.q.shape
  o = jnp.zeros(p.q.shape, p.q.dtype)
  lse = jnp.full((B, Tq, N), -jnp.inf, jnp.float32)
  if p.sinks is not None:
    lse = jnp.broadcast_to(p.sinks.astype(jnp.float32), (B, Tq, N))
  return o, lse
