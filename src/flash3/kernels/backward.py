"""FlashAttention-3 backward on Hopper: the dq kernel and the dk/dv kernel.

Algorithm: FlashAttention-2 (Dao, 2023), Algorithm 2, split as in
FlashAttention-3 (Shah et al., 2024), Section 3 and Appendix B.1, into two
warp-specialised Mosaic GPU kernels that never write atomics (so gradients are
bitwise deterministic):

* delta = rowsum(o * do) in float32 (XLA; one fused pass over o and do; or,
  with ``BackwardConfig.fuse_delta``, formed in the dq kernel from o tiles
  loaded beside q and do, and written there for the dk/dv kernel).
* dq kernel, one CTA per (query head, ``compute_wgs * block_q`` queries, batch):
  each compute warpgroup holds its q, do, lse, delta tile and walks the key
  tiles its queries can see while a producer warpgroup streams K and V through
  a ring of ``num_stages`` shared-memory slots (TMA).
  s = q k^T, p = exp(scale s - lse), dp = do v^T, ds = p (dp - delta),
  dq += ds k; finally dq *= scale.
* dk/dv kernel, one CTA per (KV head, ``compute_wgs * block_kv`` keys, batch):
  each compute warpgroup holds its K and V tile and walks, for every query
  head of its GQA group in turn, the query tiles that can see it, while the
  producer streams q, do, lse and delta. sT = k q^T, pT = exp(scale sT - lse),
  dv += pT do, dpT = v do^T, dsT = pT (dpT - delta), dk += dsT q; finally
  dk *= scale. dk, dv are accumulated per KV head in registers, never per
  query head in memory. Above head_dim 128 (``BackwardConfig.role_split``)
  the two warpgroups share one key tile instead, one forming pT and dv, the
  other dpT, dsT and dk, with pT handed over through shared memory.

Masks come from ``flash3.visibility.MaskSpec``: ``key_range`` /
``query_range`` skip tiles nobody sees, ``full_key_range`` /
``full_query_range`` find the tiles that need no elementwise mask, and
``visible`` on iotas masks the boundary tiles. Sequence tails need no padding:
TMA reads past the end as zeros and drops writes past the end, and the tiles
that hold a tail are masked (lse and delta, which XLA prepares here anyway,
are padded with +inf and 0, so padded query rows get p = 0).

Units: ``lse`` is the NATURAL log of the softmax denominator; inside the
kernels it is carried as ``lse * log2(e)`` to use exp2. Rows with lse = -inf
(they see no key) get p = 0 and so dq = 0 and no contribution to dk, dv.

GPU interpret mode: the only difference is ``common.uses_register_operands``
(register-operand wgmma on the GPU, staging through shared memory when
interpreted).

Options (issue 6, semantics of docs/semantics.md; ``SUPPORTED_FEATURES``
lists those tested):
* q/kv lengths (B,) int32: read in-kernel as per-batch scalars from global
  memory; they bound the tiles visited (so work scales with the valid part),
  give bottom_right its per-batch shift kv_len - q_len, and mask boundary
  tiles. E07: q, do rows past q_len (or seeing no key) and k, v rows past
  kv_len (or no valid query reaches) reach the matmuls as 0: each kernel
  loads a batch row's first and last tile of each from small side arrays
  where they are (``end_tiles``), not selected copies of the whole arrays;
  lse/delta of those query rows are set to +inf/0 (p = 0 whatever the
  forward wrote there, sinks included). dq rows past q_len and dk, dv rows
  past kv_len are selected to exactly 0 at the end.
* soft cap c: s_c = c tanh(scale s / c), p = exp(s_c - lse) and
  ds = p (dp - delta) (1 - tanh^2), with tanh recomputed in the kernel. By
  default (``BackwardConfig.fold_softcap``) 1 - tanh^2 is folded into p as
  soon as p is formed, so tanh is not held across the dp matmul.
* segment ids: per row tile, the other axis' tile range its documents may
  touch and the run of tiles that need no per-element id mask are computed
  once per call in XLA (``forward._segment_tile_ranges``; for the dk/dv
  kernel with queries and keys swapped); boundary tiles compare ids loaded
  from global memory.

Limitations (today):
* Mosaic's tiled TMA views the sequence axis in rows of 8, so Tq or Tk that
  is not a multiple of 8 costs one zero-padded copy of q, o, do (or k, v).
* dq = ds @ k multiplies a key row nobody sees by 0 when it shares a key tile
  with seen keys, so NaN/inf written there reaches dq (case E07; the keys'
  own dk, dv are exactly 0). Rows past the lengths are safe (zeroed in
  XLA); rows hidden by causal, a window or segment ids are not.
* Two kernels recompute s and dp (7 matmuls per tile pair against
  FlashAttention-3's 5 with atomic dq): the price of bitwise determinism.
  ``BackwardConfig(deterministic=False)`` (D 64 and 128) is the 5-matmul
  variant: the dk/dv kernel alone, adding dq += ds k with TMA reduce-add;
  ``BackwardConfig(share_dq=True)`` (D = 128) has the two warpgroups share
  each query tile's dq, one reduce-add per CTA instead of one per warpgroup;
  ``pair_dq`` issues dq's matmul beside dk's (FlashAttention-3's order),
  with or without ``share_dq``.
  ``dot_product_attention(deterministic=False)`` takes the paired form at
  D = 64 only, where H200 sweeps found it faster than the two kernels (at
  D = 128 the best single-kernel form ran 0.78 of cuDNN, the two kernels
  0.955).

Modules: this one is the entry point (checks, padding, delta, the two
launches); ``backward_config`` holds ``BackwardConfig`` and its heuristic,
``backward_dq`` and ``backward_dkv`` the two kernels, ``backward_tiles`` the
tile plans and per-tile math they share.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from flash3.kernels import common
from flash3.kernels.backward_config import BackwardConfig
from flash3.kernels.backward_dkv import dkv_call
from flash3.kernels.backward_dq import dq_call
from flash3.kernels.config import SMEM_LIMIT_BYTES
from flash3.kernels.forward import _check_extras, _segment_tile_ranges
from flash3.visibility import MaskSpec, key_bounds, query_bounds

__all__ = ["BackwardConfig", "SMEM_LIMIT_BYTES", "SUPPORTED_FEATURES",
           "attention_backward", "backward_residuals", "unsupported_reason"]

_SUPPORTED_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
# Optional inputs of ``attention_backward`` that pass the tests (issue 6); the
# API runs the XLA reference backward for the others. Sinks need nothing here.
SUPPORTED_FEATURES = frozenset({"lengths", "segments", "softcap"})


def unsupported_reason(q_shape, kv_shape, dtype, mask: MaskSpec) -> str | None:
  """None if the backward kernels support these arguments, else a sentence why not."""
  del mask  # Every MaskSpec (causal, both alignments, windows) is supported.
  if len(q_shape) != 4 or len(kv_shape) != 4:
    return f"q {tuple(q_shape)} and k/v {tuple(kv_shape)} must both be 4D (B, T, heads, D)"
  b, tq, n, d = q_shape
  bk, tk, k, dk = kv_shape
  if b != bk or d != dk:
    return f"q {tuple(q_shape)} and k/v {tuple(kv_shape)} disagree on batch or head_dim"
  if jnp.dtype(dtype) not in _SUPPORTED_DTYPES:
    return f"dtype {jnp.dtype(dtype)} is not float16 or bfloat16"
  if n % k:
    return f"{n} query heads are not a multiple of {k} key/value heads"
  if tq < 1 or tk < 1:
    return f"sequence lengths Tq={tq}, Tk={tk} must be at least 1"
  if d % 8 or not 8 <= d <= 256:
    return (f"head_dim {d} is not a multiple of 8 in [8, 256] (one that is not "
            "a multiple of 16 is zero-padded to a multiple of 64)")
  return None


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def pad_rows(x, length: int, fill: float):
  """(B, N, T) float32, padded along T to ``length`` with ``fill``."""
  x = x.astype(jnp.float32)
  return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2])), constant_values=fill)


def backward_residuals(o, lse, do, pad_to: int, delta=None, fused: bool = False,
                       dlse=None):
  """lse * log2(e) (+inf where lse = -inf) and delta = rowsum(o * do) - dlse,
  float32.

  Both (B, N, Tq padded to a multiple of ``pad_to``); padded rows get lse +inf
  (p = 0) and delta 0. The padding is of these small vectors only. A given
  ``delta`` (B, N, <= Tq) is used instead of rowsum(o * do) - dlse; ``dlse``
  (lse's cotangent, same shape) is 0 when None. ``fused``: delta is left to
  the dq kernel (``BackwardConfig.fuse_delta``) and returned None.
  """
  length = _round_up(o.shape[1], pad_to)
  pad = functools.partial(pad_rows, length=length)
  lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(jnp.float32) * common.LOG2_E)
  if fused:
    return pad(lse2, fill=jnp.inf), None
  if delta is None:
    delta = jnp.einsum("bqnd,bqnd->bnq", o.astype(jnp.float32),
                       do.astype(jnp.float32))
    if dlse is not None:  # (o may have rows of padding that dlse lacks)
      delta = pad(delta, fill=0.0) - pad(dlse, fill=0.0)
  return pad(lse2, fill=jnp.inf), pad(delta, fill=0.0)


def _segment_inputs(q_ids, kv_ids, config: BackwardConfig):
  """Per-call segment inputs of (the dq kernel, the dk/dv kernel).

  Each is (q_ids, kv_ids, ranges): the ids padded to whole tiles of both
  kernels (padded positions are masked by length), and per row tile the
  other axis' tile ranges ``[lo, hi, full_lo, full_hi)`` of
  ``forward._segment_tile_ranges`` (for the dk/dv kernel with the roles of
  queries and keys swapped: per key tile, the query tiles it may see).
  Computed once per call in XLA: O(B * tiles_q * tiles_kv) int work.
  """
  tq, tk = q_ids.shape[1], kv_ids.shape[1]
  wq, bq, bk = config.compute_wgs_dq, config.block_q_dq, config.block_kv_dq
  dq_ranges = _segment_tile_ranges(
      q_ids, kv_ids, block_q=bq, block_kv=bk,
      num_q_tiles=pl.cdiv(tq, wq * bq) * wq, num_kv_tiles=pl.cdiv(tk, bk))
  wk, bk2, bq2 = config.compute_wgs_dkv, config.block_kv_dkv, config.block_q_dkv
  dkv_ranges = _segment_tile_ranges(
      kv_ids, q_ids, block_q=bk2, block_kv=bq2,
      num_q_tiles=pl.cdiv(tk, wk * bk2) * wk, num_kv_tiles=pl.cdiv(tq, bq2))
  lq = max(pl.cdiv(tq, wq * bq) * wq * bq, pl.cdiv(tq, bq2) * bq2)
  lk = max(pl.cdiv(tk, bk) * bk, pl.cdiv(tk, wk * bk2) * wk * bk2)
  q_ids = jnp.pad(q_ids, ((0, 0), (0, lq - tq)))
  kv_ids = jnp.pad(kv_ids, ((0, 0), (0, lk - tk)))
  return (q_ids, kv_ids, dq_ranges), (q_ids, kv_ids, dkv_ranges)


def attention_backward(q, k, v, o, lse, do, *, scale: float, mask: MaskSpec,
                       config: BackwardConfig | None = None,
                       interpret: bool | plgpu.InterpretGPUParams = False,
                       delta: jax.Array | None = None,
                       dlse: jax.Array | None = None,
                       q_lengths=None, kv_lengths=None,
                       q_segment_ids=None, kv_segment_ids=None,
                       softcap: float | None = None, deterministic: bool = True):
  """Gradients of softmax attention (FlashAttention-3 backward, Section 3).

  Args:
    q, o, do: (B, Tq, N, D) float16 or bfloat16.
    k, v: (B, Tk, K, D), same dtype; N % K == 0 (GQA/MQA).
    lse: (B, N, Tq) float32, NATURAL log of the softmax denominator of the
      scaled logits; -inf for rows that see no key.
    scale: the softmax scale applied to q.k.
    mask: the static MaskSpec (causal, alignment, window).
    config: tile sizes; None picks ``BackwardConfig.heuristic`` (given
      ``deterministic``; a config's own ``deterministic`` field rules).
    interpret: False for the GPU, True or ``plgpu.InterpretGPUParams`` to run
      in GPU interpret mode on the CPU.
    delta: optional (B, N, Tq) float32 to use in ds = p * (dp - delta);
      None computes rowsum(o * do) - dlse in float32 (in XLA, or in the dq
      kernel with ``BackwardConfig.fuse_delta``).
    dlse: optional (B, N, Tq) float32 cotangent of lse (0 when None); not
      together with ``delta``.
    q_lengths, kv_lengths: None or (B,) int32 valid lengths (one alone: the
      other is full), as in ``attention_forward``: rows i >= q_len get dq = 0,
      keys j >= kv_len get dk = dv = 0, neither contributes anything, and
      bottom_right aligns on kv_len - q_len per batch row.
    q_segment_ids, kv_segment_ids: None or (B, Tq), (B, Tk) int32, both or
      neither: a query sees only keys with the same id.
    softcap: None or c > 0: the forward's scores were c * tanh(scale q.k / c)
      (Gemma 2); the chain rule multiplies ds by 1 - tanh^2.

  Returns:
    dq (B, Tq, N, D), dk, dv (B, Tk, K, D) in the input dtype. With the
    config's ``deterministic`` True (the default): no atomics, a fixed
    accumulation order, bitwise reproducible; False: dq is summed by atomic
    reduce-adds (dk, dv still reproducible).

  Raises:
    ValueError: unsupported shapes or dtypes (see ``unsupported_reason``), a
      config that does not fit shared memory, malformed lengths, segment
      ids or soft cap, a delta or dlse of the wrong shape, or both given.
  """
  if (reason := unsupported_reason(q.shape, k.shape, q.dtype, mask)) is not None:
    raise ValueError(f"attention_backward: {reason}")
  if (d := q.shape[-1]) % 16:
    # A head_dim that is a multiple of 8 but not of 16 does not lower: zero
    # columns up to the next multiple of 64, as the forward does (exact: they
    # add 0 to every score and delta; their gradients are sliced off).
    padded = lambda x: jnp.pad(x, ((0, 0),) * 3 + ((0, _round_up(d, 64) - d),))
    grads = attention_backward(
        padded(q), padded(k), padded(v), padded(o), lse, padded(do), scale=scale,
        mask=mask, config=config, interpret=interpret, delta=delta, dlse=dlse,
        q_lengths=q_lengths, kv_lengths=kv_lengths, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, softcap=softcap, deterministic=deterministic)
    return tuple(g[..., :d] for g in grads)
  if k.shape != v.shape or k.dtype != q.dtype or v.dtype != q.dtype:
    raise ValueError(f"k {k.shape} {k.dtype} and v {v.shape} {v.dtype} must match "
                     f"each other and q's dtype {q.dtype}")
  if o.shape != q.shape or do.shape != q.shape:
    raise ValueError(f"o {o.shape} and do {do.shape} must have q's shape {q.shape}")
  b, q_len, n, head_dim = q.shape
  if lse.shape != (b, n, q_len):
    raise ValueError(f"lse has shape {lse.shape}; expected {(b, n, q_len)}")
  for name, x in (("delta", delta), ("dlse", dlse)):
    if x is not None and x.shape != (b, n, q_len):
      raise ValueError(f"{name} has shape {x.shape}; expected {(b, n, q_len)}")
  if delta is not None and dlse is not None:
    raise ValueError("attention_backward: pass delta (which includes -dlse) or "
                     "dlse, not both")
  if config is None:
    config = BackwardConfig.heuristic(head_dim, q_len, k.shape[1], mask,
                                      interpret=common.is_interpret(interpret),
                                      deterministic=deterministic,
                                      packed=q_segment_ids is not None)
  config.check_fits(head_dim, q.dtype.itemsize,
                    interpret=common.is_interpret(interpret))
  do = do.astype(q.dtype)
  kv_len = k.shape[1]
  extras = _check_extras(b, q_len, kv_len, n, q_lengths, kv_lengths,
                         q_segment_ids, kv_segment_ids, softcap, None)
  lengths = extras["lengths"]
  zero = lambda x, ok: jnp.where(ok[:, :, None, None], x, jnp.zeros((), x.dtype))
  bounds = None
  if lengths is not None:
    # E06, E07: q, do rows past q_len or seeing no key, and k, v rows past
    # kv_len or beyond every valid query's causal / window reach, may hold
    # NaN/Inf; 0 * NaN is NaN, so they must reach the matmuls as 0. Only a
    # batch row's first and last tile of each can hold such rows: the
    # kernels load those from small side arrays where they are
    # (end_tiles.py), not from a selected copy of the whole array.
    bounds = (query_bounds(mask, *lengths), key_bounds(mask, *lengths))
  else:
    # The same for query rows that see no key by the mask alone (causal
    # bottom_right with Tq > Tk, windows): static, so only then a select.
    lo, hi = mask.query_range(0, kv_len, mask.shift(q_len, kv_len), q_len)
    if (lo, hi) != (0, q_len):
      rows = jnp.arange(q_len, dtype=jnp.int32)[None, :]
      q_ok = (rows >= lo) & (rows < hi)
      q, do = zero(q, q_ok), zero(do, q_ok)
  # Mosaic's tiled TMA views a sequence axis in rows of 8, so a length that is
  # not a multiple of 8 is zero-padded up to one (a copy of q, do or k, v
  # only then; the masks use the true lengths and the results are sliced).
  q8, kv8 = _round_up(q_len, 8), _round_up(kv_len, 8)
  if q8 != q_len:
    pad = ((0, 0), (0, q8 - q_len), (0, 0), (0, 0))
    q, do, o = jnp.pad(q, pad), jnp.pad(do, pad), jnp.pad(o, pad)
    lse = jnp.pad(lse, ((0, 0), (0, 0), (0, q8 - q_len)), constant_values=-jnp.inf)
  if kv8 != kv_len:
    pad = ((0, 0), (0, kv8 - kv_len), (0, 0), (0, 0))
    k, v = jnp.pad(k, pad), jnp.pad(v, pad)
  pad_to = math.lcm(config.block_q_dq * config.compute_wgs_dq, config.block_q_dkv)
  # The dq kernel forms delta itself when asked (and none is given).
  fused = config.fuse_delta and delta is None
  lse2, delta = backward_residuals(o, lse, do, pad_to, delta, fused=fused, dlse=dlse)
  if fused and dlse is not None:  # The dq kernel subtracts it (padded rows: 0).
    dlse = pad_rows(dlse, lse2.shape[2], 0.0)
  if lengths is not None:
    # Rows past q_len or seeing no key: p = 0 (lse +inf) and delta 0,
    # whatever o, do (NaN there makes delta NaN) or lse hold.
    rows = jnp.arange(lse2.shape[2], dtype=jnp.int32)[None, None, :]
    (q_lo, q_hi), _ = bounds
    ok = (rows >= q_lo[:, None, None]) & (rows < q_hi[:, None, None])
    lse2 = jnp.where(ok, lse2, jnp.inf)
    if not fused:  # The fused delta is 0 wherever lse2 is +inf.
      delta = jnp.where(ok, delta, 0.0)
  scale = float(scale)
  kwargs = dict(q_len=q_len, kv_len=kv_len, scale=scale, mask=mask,
                config=config, interpret=interpret, lengths=lengths, bounds=bounds,
                softcap=extras["softcap"])
  dq_segments = dkv_segments = None
  if extras["segments"] is not None:
    dq_segments, dkv_segments = _segment_inputs(*extras["segments"], config)
  if not config.deterministic:
    kwargs["segments"] = dkv_segments
    mode = "partials" if common.is_interpret(interpret) else "atomic"
    dk, dv, dq = dkv_call(q, k, v, do, lse2, delta, outputs=("dk", "dv"),
                          dq_mode=mode, **kwargs)
    dq = (dq * scale).astype(q.dtype)
    return dq[:, :q_len], dk[:, :kv_len], dv[:, :kv_len]
  if fused:
    dq, delta = dq_call(q, k, v, do, lse2, None, segments=dq_segments, o=o,
                        dlse=dlse, **kwargs)
  else:
    dq = dq_call(q, k, v, do, lse2, delta, segments=dq_segments, **kwargs)
  kwargs["segments"] = dkv_segments
  if config.split_dkv:
    (dk,) = dkv_call(q, k, v, do, lse2, delta, outputs=("dk",), **kwargs)
    (dv,) = dkv_call(q, k, v, do, lse2, delta, outputs=("dv",), **kwargs)
  else:
    dk, dv = dkv_call(q, k, v, do, lse2, delta, outputs=("dk", "dv"), **kwargs)
  return dq[:, :q_len], dk[:, :kv_len], dv[:, :kv_len]
