"""FlashAttention-3 forward on Hopper (sm90), in Pallas Mosaic GPU.

Algorithm: FlashAttention-3 (Shah et al., 2024), section 3: warp
specialisation (one TMA producer warpgroup, two compute warpgroups),
ping-pong scheduling of the two compute warpgroups (section 3.1) so one
warpgroup's softmax overlaps the other's matmuls, and a multi-stage K/V ring
in shared memory. The online softmax (FlashAttention-2, Dao 2023, algorithm 1)
runs in the exp2 domain: exp2((s - m) * scale * log2(e)) of the raw scores s and
their running max m, or, with ``ForwardConfig.scale_first``, exp2(s' - m) of
scores s' scaled (and rounded) before the max; either way exactly exp2(0) at a
row's max (E03). With ``ForwardConfig.lazy_rescale`` (FlashAttention-4, Dao et
al. 2025) a row's reference max moves only when a tile exceeds it by more
than 2**8, and a warp none of whose rows moved skips the accumulator's rescale.

Synchronisation (kernels/sync.py): at each ping-pong turn point (after a
warpgroup issues its matmuls, and after its softmax before the next ones)
the two warpgroups meet at one barrier (``ForwardConfig.pingpong="meeting"``,
the default at D=128) or hand the turn over one way, as FlashAttention-3's
CUTLASS kernel does ("handoff", D=256 and D=64's persistent kernel; H200 A/B:
docs/benchmarks/h200/2026-12-01-s9/tune.md, 2026-12-04-s25/); consumers
release ring slots to the producer. Above D=128 each step issues its tile's
P @ V and the next tile's Q K^T back to back and waits once
(``ForwardConfig.fuse_pv_qk``; docs/benchmarks/h200/2026-12-04-s24/). On the
GPU both run on hardware named barriers (``bar.arrive`` / ``bar.sync``,
``ForwardConfig.named_barriers``, the default), in interpret mode on
mbarriers with the same arrivals and waits (H200 A/B of the two, seventh
session: docs/benchmarks/h200/2026-12-01-s7/tune.md).

One CTA covers ``2 * block_q`` query rows of one (batch, head) (``3 *
block_q`` with ``ForwardConfig.compute_warpgroups=3``, FlashAttention-3's
head_dim 64 layout, whose turns go round the three); compute
warpgroup ``w`` owns rows ``[q0 + w * block_q, q0 + (w + 1) * block_q)``. The
CTA visits the key tiles that some of its rows can see
(``MaskSpec.key_range``); the producer streams exactly those. A warpgroup
skips (waits, releases, does no math on) tiles none of its own rows can see,
computes tiles every row sees in full (``MaskSpec.full_key_range``) without a
mask, and applies the elementwise mask (each row's key range by
``MaskSpec.key_range`` and Tk, against the column indices: ``tile_mask``) only
on the boundary tiles.

Ragged lengths: TMA zero-fills loads past Tq / Tk and drops stores past Tq,
so lengths that are multiples of 8 (any multiple, not of the blocks) need no
padded copy of q, k, v or o; the tail of the last key tile is masked to -inf
in-kernel. Mosaic GPU's swizzled TMA views a length T > 8 as (T / 8, 8) rows,
so a length that is not a multiple of 8 is zero-padded to one in device
memory first (one extra copy of q, or of k and v, and o sliced back); the
kernel still masks with the true lengths. Element offsets past 2**31 are safe because TMA
addresses by per-dimension coordinates from a 64-bit base.

Options (issue 6, semantics of docs/semantics.md): per-batch q/kv lengths
are read in-kernel as scalars from global memory; they bound the key tiles
streamed and, for bottom_right, give a per-batch shift. V rows past kv_len (or
no valid query reaches) must reach P @ V as 0 (E07: p = 0 times NaN is NaN):
the kernel loads each batch row's first and last key tile of V from a small
side array where they are (``end_tiles``), not a selected copy of v. Segment ids: per query tile of
64 rows, the first/last key tile its documents may touch and the run of tiles
holding only its one id (no per-element mask) are computed once per call in
XLA from per-tile min/max ids; boundary tiles compare ids loaded from global
memory. The soft cap acts on natural-unit scores before the exp2 conversion
(tanh.approx on the GPU); sinks enter the denominator at the end, as one more
logit. Limitation (as for causal before): NaN in a V row that no query sees
but that shares a key tile with visible keys (segments, windows) can still
reach the output; keys past kv_len and whole unseen tiles cannot (nor, with
``ForwardConfig.half_edge_tiles``, the unseen half of an edge tile).

Half edge tiles (``ForwardConfig.half_edge_tiles``, the default for windows and causal masks):
a warpgroup whose first key tile's lower half, or last tile's upper half, is
invisible to all its rows by the mask computes only the other half there.

Persistent kernel (``ForwardConfig.persistent``, issue 3; the default for short
sequences, ``config._prefers_persistent``): instead of
one CTA per (head, query tile, batch), ``min(num_sms, items)`` CTAs each loop
over the work items a schedule gives it (``schedule.lpt_schedule``:
longest first within chunks of the grid's order, to the least-loaded CTA
(``ForwardConfig.schedule_rounds``); round-robin in the grid's order when
all items cost the same; with segment ids ``schedule.segment_schedule``
builds it on the device from each item's documents). The K/V ring and its
barriers run on across items (a carried tile count places each tile's slot),
so the producer streams the next item's K/V while the compute warpgroups
finish the current one; when shared memory allows, o is staged apart from q
and the next item's q loads during the epilogue (else after the o store has
read the q tile).
Each item runs the same instructions as in the grid kernel, so the results
are bitwise equal. Every mask and option is supported.

``ForwardConfig(overlap_softmax=True)`` (opt-in, slower on an H200: see
the config's docstring) also overlaps, within each
compute warpgroup, tile t's softmax with tile t-1's P @ V (FlashAttention-3,
Section 3.2): S_t = Q K_t^T and the previous
P @ V are issued together and only S_t is waited for; P goes to P @ V
through shared memory, since a wgmma's register operand must not change
while it runs.

Head dims that are not a multiple of 64 are zero-padded to the next multiple
of 64 in device memory (q, k, v copied once, o sliced): this costs one extra
read+write of q, k, v and o and ``D_pad / D`` times the matmul work.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np

from flash3 import _device
from flash3.kernels import (common, end_tiles, exp2, exponent, schedule, sync,
                            tile_mask)
from flash3.kernels.config import (NUM_COMPUTE_WARPGROUPS,
                                   RESCALE_THRESHOLD, ForwardConfig,
                                   check_fits, forward_config,
                                   persistent_separate_o)
from flash3.visibility import MaskSpec, key_bounds

SUPPORTED_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
# Optional inputs of ``attention_forward`` that the kernel supports (issue 6);
# the API dispatches to the kernel only for these.
SUPPORTED_FEATURES = frozenset({"lengths", "softcap", "sinks", "segments"})
MAX_HEAD_DIM = 256
# CUDA grid limits: heads run on x (2**31 - 1), query tiles on y and batch on z.
MAX_GRID_YZ = 65535
HEAD_DIM_MULTIPLE = 64  # D is padded up to this (one 128-byte swizzle row).
ROW_TILE = 8  # Rows of one swizzled smem tile; TMA lengths must be multiples.
# Testing knob: None lets the persistent kernel stage o apart from q when
# shared memory allows (``config.persistent_separate_o``); True / False force
# one way (False is the only way at D=256). Read outside jit, passed static.
PERSISTENT_SEPARATE_O: bool | None = None
# Profiling knob (scripts/profile_forward.py): (events per warpgroup, directory)
# records the kernel's named scopes (``jax.named_scope``: "qk", "softmax",
# "turn", "pv", "epilogue", ...) per warpgroup with Mosaic GPU's profiler into
# a Chrome trace there. Read outside jit, passed static; GPU only.
PROFILE: tuple[int, str] | None = None


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def unsupported_reason(q_shape, kv_shape, dtype, mask: MaskSpec) -> str | None:
  """None if ``attention_forward`` supports these arguments, else why not.

  Args:
    q_shape: (B, Tq, N, D).
    kv_shape: (B, Tk, K, D), the shape of k and of v.
    dtype: the common dtype of q, k and v.
    mask: a MaskSpec.
  """
  if len(q_shape) != 4 or len(kv_shape) != 4:
    return f"q {tuple(q_shape)} and k/v {tuple(kv_shape)} must be 4D (B, T, N, D)"
  B, Tq, N, D = q_shape
  Bk, Tk, K, Dk = kv_shape
  if B != Bk:
    return f"q has batch {B} but k/v have batch {Bk}"
  if D != Dk:
    return f"q has head_dim {D} but k/v have head_dim {Dk}"
  if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
    return f"dtype {jnp.dtype(dtype).name} is not float16 or bfloat16"
  if D % 8 or not 8 <= D <= MAX_HEAD_DIM:
    return f"head_dim {D} must be a multiple of 8 in [8, {MAX_HEAD_DIM}]"
  if B < 1 or Tq < 1 or Tk < 1 or N < 1 or K < 1:
    return f"every dimension must be >= 1, got q {tuple(q_shape)} k/v {tuple(kv_shape)}"
  if N % K:
    return f"query heads {N} must be a multiple of key/value heads {K}"
  if not isinstance(mask, MaskSpec):
    return f"mask must be a flash3.visibility.MaskSpec, got {type(mask).__name__}"
  if B > MAX_GRID_YZ:
    return f"batch {B} exceeds the CUDA grid limit {MAX_GRID_YZ}"
  # (Checked for two compute warpgroups: three make fewer query tiles.)
  if -(-Tq // (NUM_COMPUTE_WARPGROUPS * 64)) > MAX_GRID_YZ:
    return f"Tq {Tq} needs more than {MAX_GRID_YZ} query tiles"
  return None


def default_config(head_dim: int, dtype, mask: MaskSpec, q_len: int,
                   kv_len: int, *, interpret: bool = False,
                   packed: bool = False) -> ForwardConfig:
  """The config ``attention_forward`` runs when given none: ``forward_config``
  for head_dim padded to a multiple of 64, sized to this GPU's SMs (packed:
  segment ids are given)."""
  return forward_config(_round_up(head_dim, HEAD_DIM_MULTIPLE), dtype, mask,
                        q_len, kv_len, interpret=interpret,
                        num_sms=_device.sm_count(), packed=packed)


def attention_forward(q, k, v, *, scale: float, mask: MaskSpec,
                      config: ForwardConfig | None = None,
                      interpret: bool | Any = False,
                      q_lengths=None, kv_lengths=None,
                      q_segment_ids=None, kv_segment_ids=None,
                      softcap: float | None = None, sinks=None,
                      ) -> tuple[jax.Array, jax.Array]:
  """Attention forward: softmax(scale * q k^T, masked) v, and its logsumexp.

  Args:
    q: (B, Tq, N, D) float16 or bfloat16.
    k, v: (B, Tk, K, D), same dtype, N % K == 0 (GQA / MQA when K < N).
    scale: the softmax scale (any finite float; callers default to 1/sqrt(D)).
    mask: causal / alignment / window (flash3.visibility.MaskSpec).
    config: tile sizes and pipeline depth; None picks ``default_config``
      (the persistent kernel sized to this GPU's SMs).
    interpret: False for the GPU; True or ``plgpu.InterpretGPUParams`` to run
      in GPU interpret mode on the CPU.
    q_lengths, kv_lengths: None or (B,) int32 valid query / key counts per
      batch row, in [0, Tq] and [0, Tk] (docs/semantics.md 2.4; with only one
      given the other is the full length). Rows i >= q_len return o = 0 and
      the lse of an empty row; bottom_right aligns on kv_len - q_len.
    q_segment_ids, kv_segment_ids: None or (B, Tq), (B, Tk) int32, both or
      neither: a query sees only keys with the same id (need not be sorted).
    softcap: None or a float c > 0: scores become c * tanh(scale q.k / c)
      before masking (Gemma 2).
    sinks: None or (N,) float32: one raw natural-log logit per query head
      added to the softmax denominator, with no value (gpt-oss).

  Returns:
    o: (B, Tq, N, D) in q.dtype; rows that see no key are 0.
    lse: (B, N, Tq) float32, the NATURAL log of the softmax denominator of
      the scaled scores (sink included); -inf for rows that see no key
      (the sink there when sinks are given).

  Raises:
    ValueError: unsupported shapes/dtypes (see ``unsupported_reason``), k and
      v of different shapes or dtypes, or a config that does not fit.
  """
  if k.shape != v.shape:
    raise ValueError(f"k {k.shape} and v {v.shape} must have the same shape")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
  reason = unsupported_reason(q.shape, k.shape, q.dtype, mask)
  if reason is not None:
    raise ValueError(reason)
  scale = float(scale)
  if not math.isfinite(scale):
    raise ValueError(f"scale={scale} must be finite")
  B, Tq, N, D = q.shape
  Tk = k.shape[1]
  extras = _check_extras(B, Tq, Tk, N, q_lengths, kv_lengths, q_segment_ids,
                         kv_segment_ids, softcap, sinks)
  d_pad = _round_up(D, HEAD_DIM_MULTIPLE)
  # Mosaic GPU's tiled TMA views a length T > 8 as (T / 8, 8) rows, so a T
  # that is not a multiple of 8 cannot be described; only then is the tensor
  # zero-padded to the next multiple of 8 (the kernel still masks with the
  # true Tk and the padded query rows are sliced off).
  tq_pad = Tq if Tq <= 8 else _round_up(Tq, ROW_TILE)
  tk_pad = Tk if Tk <= 8 else _round_up(Tk, ROW_TILE)
  if d_pad != D or tq_pad != Tq:
    q = jnp.pad(q, ((0, 0), (0, tq_pad - Tq), (0, 0), (0, d_pad - D)))
  if d_pad != D or tk_pad != Tk:
    pad = ((0, 0), (0, tk_pad - Tk), (0, 0), (0, d_pad - D))
    k, v = jnp.pad(k, pad), jnp.pad(v, pad)
  interpret_params = common.interpret_params(interpret)
  if config is None:
    config = default_config(D, q.dtype, mask, Tq, Tk,
                            interpret=interpret_params is not None,
                            packed=extras["segments"] is not None)
  check_fits(config, d_pad, q.dtype.itemsize,
             num_stages=_num_stages(config, Tk),
             interpret=interpret_params is not None)
  v_edges = None
  if extras["lengths"] is not None:
    # E07: keys past kv_len, or beyond every valid query's causal / window
    # reach, may hold NaN/Inf; p = 0 times NaN is NaN, so those V rows must
    # reach P @ V as 0. Only a batch row's first and last key tiles can hold
    # such rows; the kernel loads them from a side array where they are
    # (end_tiles.py). K needs nothing: its scores are selected to -inf
    # in-kernel.
    v_edges = end_tiles.build(v, *key_bounds(mask, *extras["lengths"]),
                               config.block_kv)
  separate_o = False
  if config.persistent:
    separate_o = persistent_separate_o(
        config, d_pad, q.dtype.itemsize, num_stages=_num_stages(config, Tk),
        interpret=interpret_params is not None)
    if PERSISTENT_SEPARATE_O is not None:
      separate_o = bool(PERSISTENT_SEPARATE_O)
  if config.defer_epilogue and not separate_o:
    # The deferred epilogue stages o while the next item's q is in its tile.
    raise ValueError(
        f"config={config} has defer_epilogue=True, which needs a separate o "
        f"tile; at head_dim={d_pad} (padded) and num_stages="
        f"{_num_stages(config, Tk)} shared memory has no room for one: lower "
        f"num_stages or block_kv, or set defer_epilogue=False")
  o, lse = _forward(q, k, v, extras["lengths"], v_edges, extras["sinks"],
                    extras["segments"], scale=scale,
                    mask=mask, config=config, interpret=interpret_params,
                    q_len=Tq, kv_len=Tk, softcap=extras["softcap"],
                    drain=common.drains_barriers(interpret_params),
                    separate_o=separate_o,
                    profile=None if interpret_params is not None else PROFILE)
  if d_pad != D or tq_pad != Tq:
    o = o[:, :Tq, :, :D]
  return o, lse[:, :, :Tq]


def _check_extras(B, Tq, Tk, N, q_lengths, kv_lengths, q_segment_ids,
                  kv_segment_ids, softcap, sinks) -> dict:
  """Checks the optional mask inputs; returns the kernel's form of them.

  ``lengths`` is None or a pair of (B,) int32 arrays (q_len, kv_len), the
  missing one filled with the full length; ``sinks`` None or (N,) float32;
  ``softcap`` None or a float.
  """
  def as_lengths(x, name, full):
    x = jnp.asarray(x)
    if x.shape != (B,) or not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name} must be an integer array of shape ({B},), got "
                       f"{x.dtype} {x.shape}")
    return x.astype(jnp.int32)

  lengths = None
  if q_lengths is not None or kv_lengths is not None:
    ql = (jnp.full((B,), Tq, jnp.int32) if q_lengths is None
          else as_lengths(q_lengths, "q_lengths", Tq))
    kl = (jnp.full((B,), Tk, jnp.int32) if kv_lengths is None
          else as_lengths(kv_lengths, "kv_lengths", Tk))
    lengths = (ql, kl)
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids must be given together")
  segments = None
  if q_segment_ids is not None:
    qs, ks = jnp.asarray(q_segment_ids), jnp.asarray(kv_segment_ids)
    for name, x, t in (("q_segment_ids", qs, Tq), ("kv_segment_ids", ks, Tk)):
      if x.shape != (B, t) or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array of shape ({B}, {t}),"
                         f" got {x.dtype} {x.shape}")
    segments = (qs.astype(jnp.int32), ks.astype(jnp.int32))
  if softcap is not None:
    softcap = float(softcap)
    if not (math.isfinite(softcap) and softcap > 0):
      raise ValueError(f"softcap={softcap} must be a finite float > 0")
  if sinks is not None:
    sinks = jnp.asarray(sinks)
    if sinks.shape != (N,):
      raise ValueError(f"sinks must have shape ({N},), got {sinks.shape}")
    sinks = sinks.astype(jnp.float32)
  return dict(lengths=lengths, segments=segments, softcap=softcap, sinks=sinks)


def _segment_tile_ranges(q_ids, kv_ids, *, block_q: int, block_kv: int,
                         num_q_tiles: int, num_kv_tiles: int):
  """Per query tile of ``block_q`` rows: the key tiles its documents may touch.

  Returns (B, num_q_tiles, 4) int32 ``[lo, hi, full_lo, full_hi]``: key tiles
  outside ``[lo, hi)`` hold no key with an id of the query tile (from per-tile
  min/max ids, so a superset, right for unsorted ids too); tiles in
  ``[full_lo, full_hi)`` and the query tile all hold one and the same id, so
  they need no per-element segment mask. Computed once per call in XLA:
  O(B * num_q_tiles * num_kv_tiles) int work, tiny next to the kernel.
  """
  def tile_min_max(ids, block, n):
    pad = n * block - ids.shape[1]
    ids = jnp.pad(ids, ((0, 0), (0, pad)), mode="edge").reshape(ids.shape[0], n, block)
    return ids.min(-1), ids.max(-1)

  nq_real = -(-q_ids.shape[1] // block_q)
  qmin, qmax = tile_min_max(q_ids, block_q, nq_real)
  kmin, kmax = tile_min_max(kv_ids, block_kv, num_kv_tiles)
  tiles = jnp.arange(num_kv_tiles, dtype=jnp.int32)

  def first_last(sel):  # sel (B, nq, nk) -> first index, last index + 1
    lo = jnp.min(jnp.where(sel, tiles, num_kv_tiles), axis=-1)
    hi = jnp.max(jnp.where(sel, tiles + 1, 0), axis=-1)
    return lo, hi

  overlap = ((kmax[:, None, :] >= qmin[:, :, None])
             & (kmin[:, None, :] <= qmax[:, :, None]))
  lo, hi = first_last(overlap)
  full = ((qmin == qmax)[:, :, None] & (kmin == kmax)[:, None, :]
          & (kmin[:, None, :] == qmin[:, :, None]))
  f_lo, f_hi = first_last(full)
  # Only a contiguous run of full tiles may skip the mask.
  contiguous = full.sum(-1) == f_hi - f_lo
  f_lo = jnp.where(contiguous, f_lo, 0)
  f_hi = jnp.where(contiguous, f_hi, 0)
  ranges = jnp.stack([lo, hi, f_lo, f_hi], axis=-1).astype(jnp.int32)
  # Query tiles past Tq (the second warpgroup of the last CTA): nothing.
  empty = jnp.array([num_kv_tiles, 0, 0, 0], jnp.int32)
  pad = num_q_tiles - nq_real
  return jnp.concatenate(
      [ranges, jnp.broadcast_to(empty, (ranges.shape[0], pad, 4))], axis=1)


def _num_stages(config: ForwardConfig, kv_len: int) -> int:
  return max(1, min(config.num_stages, -(-kv_len // config.block_kv)))


@functools.partial(jax.jit, static_argnames=(
    "scale", "mask", "config", "interpret", "q_len", "kv_len", "softcap",
    "drain", "separate_o", "profile"))
def _forward(q, k, v, lengths, v_edges, sinks, segments, *, scale: float, mask: MaskSpec,
             config: ForwardConfig, interpret: Any, q_len: int, kv_len: int,
             softcap: float | None, drain: bool = True,
             separate_o: bool = False, profile: tuple[int, str] | None = None):
  """The kernel launch; q_len/kv_len are the true lengths (q, k, v may be longer).

  ``lengths`` (None or (q_len, kv_len) (B,) int32) and ``sinks`` (None or
  (N,) float32) are extra kernel inputs, read as scalars from global memory;
  with lengths, ``v_edges`` is v's ``end_tiles.build`` pair for block_kv.
  ``segments`` (None or (q_ids, kv_ids)) adds the ids (padded to whole tiles)
  and the per-query-tile key tile ranges of ``_segment_tile_ranges``.
  ``drain``: ``common.drains_barriers`` (a static argument, so jit keys on it).
  """
  B, Tq_buf, N, D = q.shape
  _, Tk_buf, K, _ = k.shape
  Tq, Tk = q_len, kv_len
  dtype = q.dtype
  block_q, block_kv = config.block_q, config.block_kv
  stages = _num_stages(config, Tk)
  nwg = config.compute_warpgroups
  cta_rows = nwg * block_q
  num_q_ctas = -(-Tq // cta_rows)
  # lse rows are padded to whole CTAs: TMA needs 16-byte row strides.
  lse_len = num_q_ctas * cta_rows
  transforms = common.smem_swizzle_transforms(D, dtype.itemsize)
  staging = not common.uses_register_operands(interpret)
  # More ring slots than hardware barriers: the releases (and turns) stay
  # on mbarriers (ForwardConfig.named_barriers).
  named = (config.named_barriers and not staging
           and stages <= sync.max_ring_slots(nwg))

  body = functools.partial(
      _kernel_body, Tq=Tq, Tk=Tk, heads_per_kv=N // K, scale=scale, mask=mask,
      block_q=block_q, block_kv=block_kv, stages=stages, dtype=dtype,
      config=config, num_q_ctas=num_q_ctas, has_lengths=lengths is not None,
      has_sinks=sinks is not None, has_segments=segments is not None,
      softcap=softcap, drain=drain, num_heads=N, batch_size=B,
      separate_o=separate_o, named=named, staging=staging)
  extra_inputs = ((*lengths, *v_edges) if lengths is not None else ()) + (
      (sinks,) if sinks is not None else ())
  if segments is not None:
    q_ids, kv_ids = segments
    num_kv_tiles = -(-Tk // block_kv)
    ranges = _segment_tile_ranges(
        q_ids, kv_ids, block_q=block_q, block_kv=block_kv,
        num_q_tiles=num_q_ctas * nwg,
        num_kv_tiles=num_kv_tiles)
    # In-kernel loads read whole tiles: pad the ids (values there are masked).
    q_ids = jnp.pad(q_ids, ((0, 0), (0, lse_len - Tq)))
    kv_ids = jnp.pad(kv_ids, ((0, 0), (0, num_kv_tiles * block_kv - Tk)))
    extra_inputs += (q_ids, kv_ids, ranges)
  scratch = dict(
      qo=plgpu.SMEM((nwg, block_q, D), dtype,
                    transforms=transforms),
      k=plgpu.SMEM((stages, block_kv, D), dtype, transforms=transforms),
      v=plgpu.SMEM((stages, block_kv, D), dtype, transforms=transforms),
      lse=plgpu.SMEM((nwg, block_q), jnp.float32),
      q_loaded=plgpu.Barrier(num_barriers=nwg),
      k_loaded=plgpu.Barrier(num_barriers=stages),
      v_loaded=plgpu.Barrier(num_barriers=stages),
  )
  if not named:
    # Interpret mode (or named_barriers off): mbarriers for the ring's
    # releases and the ping-pong: one per warpgroup's turn, or one meeting
    # point (sync.py).
    scratch.update(
        k_free=plgpu.Barrier(num_arrivals=nwg, num_barriers=stages),
        v_free=plgpu.Barrier(num_arrivals=nwg, num_barriers=stages))
    turn_barrier = sync.turn_mbarriers(config.pingpong, nwg)
    if turn_barrier is not None:
      scratch["turns"] = plgpu.Barrier(**turn_barrier)
  if config.persistent and separate_o:
    scratch["o"] = plgpu.SMEM((nwg, block_q, D), dtype,
                              transforms=transforms)
  if staging or (config.overlap_softmax and not config.overlap_p_registers):
    # P goes to P @ V through shared memory (always in interpret mode).
    scratch["p"] = plgpu.SMEM(
        (nwg, block_q, block_kv), dtype,
        transforms=common.smem_swizzle_transforms(block_kv, dtype.itemsize))
  if config.persistent:
    # One CTA per SM (at most one per work item), each looping over the items
    # the schedule gives it (a table read as scalars in the kernel: static,
    # or built on the device from the documents when segment ids are given).
    num_ctas = min(config.num_sms, N * num_q_ctas * B)
    if segments is not None:
      # Each item's work depends on its documents: a table built on the device.
      table = schedule.segment_schedule(
          ranges, schedule.cta_tile_ranges(mask, q_len=Tq, kv_len=Tk,
                                           cta_rows=cta_rows, block_kv=block_kv),
          num_heads=N, reverse_q_tiles=config.reverse_q_tiles, num_ctas=num_ctas,
          rounds=config.schedule_rounds, warpgroups=nwg)
    else:
      costs = schedule.item_costs(
          mask, q_len=Tq, kv_len=Tk, num_heads=N, batch=B, cta_rows=cta_rows,
          block_kv=block_kv, reverse_q_tiles=config.reverse_q_tiles)
      table = jnp.asarray(schedule.lpt_schedule(costs, num_ctas,
                                                config.schedule_rounds))
    extra_inputs += (table,)
    body = functools.partial(body, num_ctas=num_ctas)
    grid, grid_names = (num_ctas,), (common.CTA_AXIS,)
  else:
    grid = (N, num_q_ctas, B)
    grid_names = (common.HEADS_AXIS, common.Q_TILES_AXIS, common.BATCH_AXIS)
  def forward_kernel(q_ref, k_ref, v_ref, *refs):  # (Its name names the CUDA kernel.)
    pl.run_scoped(lambda **s: body(q_ref, k_ref, v_ref, refs[-2], refs[-1], s,
                                   extra_refs=refs[:-2]),
                  **scratch, collective_axes=common.WG_AXIS)

  kernel = plgpu.kernel(
      forward_kernel,
      out_type=(jax.ShapeDtypeStruct((B, Tq_buf, N, D), dtype),
                jax.ShapeDtypeStruct((B, N, lse_len), jnp.float32)),
      grid=grid,
      grid_names=grid_names,
      num_threads=nwg + 1,
      thread_name=common.WG_AXIS,
      # No cross-warp reduction scratch: the kernel reduces only along rows,
      # within a warp (checked in tests/test_forward_kernel.py), and the 2 KB
      # Pallas reserves by default is what kept a third 128-key K/V slot or
      # 192-key tiles at D=128 out of shared memory.
      compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0,
                                           **_profile_params(profile)),
      interpret=interpret,
  )
  return kernel(q, k, v, *extra_inputs)


def _profile_params(profile: tuple[int, str] | None) -> dict:
  """CompilerParams fields for ``PROFILE`` (None: no profiling)."""
  if profile is None:
    return {}
  space, directory = profile
  # Bounds-checked: a full buffer truncates the trace instead of overrunning
  # shared memory.
  return dict(profile_space=space, profile_dir=directory, profile_bounds_check=True)


def _half_edges(mask: MaskSpec, q_lo, q_hi, shift, Tk, w_lo, w_hi, block_kv: int):
  """``ForwardConfig.half_edge_tiles``: ``(a, b)`` with ``w_lo <= a <= b <= w_hi``.

  ``a = w_lo + 1`` when no row of ``[q_lo, q_hi)`` may see a key in the lower
  half of tile ``w_lo`` (by the mask and Tk), so only its upper half is
  computed; ``b = w_hi - 1`` likewise for the upper half of tile ``w_hi - 1``
  (only its lower half is computed). Else ``a = w_lo``, ``b = w_hi``.
  """
  k_lo, k_hi = mask.key_range(q_lo, q_hi, shift, Tk)
  w_lo, w_hi = jnp.asarray(w_lo, jnp.int32), jnp.asarray(w_hi, jnp.int32)
  hw = block_kv // 2
  some = w_lo < w_hi
  a = w_lo + (some & (k_lo >= w_lo * block_kv + hw)).astype(jnp.int32)
  b = w_hi - (some & (k_hi <= (w_hi - 1) * block_kv + hw)).astype(jnp.int32)
  return a, jnp.maximum(b, a)


def _trimmed_end(Tk, block_kv: int) -> tuple[int, int] | None:
  """``ForwardConfig.trim_end_tile``: ``(t_end, w_end)``, the key tile that
  holds key ``Tk - 1`` and its keys rounded up to a whole number of 64 (the
  wgmma's granularity here), when that is fewer than ``block_kv``; None when
  Tk is traced (per-batch lengths) or the tile is whole.

  With Tk = 4096 and 192-key tiles the last tile holds 64 keys: 21 whole
  tiles and one of 64 instead of 22 whole (the 192-key tiles' loss at 4096
  keys, thirteenth session)."""
  if not isinstance(Tk, (int, np.integer)):
    return None
  rest = int(Tk) % block_kv
  width = -(-rest // 64) * 64
  if rest == 0 or width >= block_kv:
    return None
  return int(Tk) // block_kv, width


def key_part(part: tuple[int, int] | None, w_end: int,
             block_kv: int) -> tuple[int, int]:
  """The keys ``(offset, width)`` of a tile's ``part`` (None: the whole
  tile) that lie below ``w_end``, the trimmed end tile's width: a step's
  static sub-tile. ``part`` must start below ``w_end``."""
  offset, width = (0, block_kv) if part is None else part
  if offset >= w_end:
    raise ValueError(f"part={part!r} starts past the end tile's {w_end} keys")
  return offset, min(offset + width, w_end) - offset


def _tile_ranges(mask: MaskSpec, q_lo, q_hi, shift: int, Tk: int, block_kv: int):
  """Key tiles ``[t_lo, t_hi)`` some row of ``[q_lo, q_hi)`` sees (empty if q_hi <= q_lo)."""
  k_lo, k_hi = mask.key_range(q_lo, q_hi, shift, Tk)
  t_lo = lax.div(jnp.asarray(k_lo, jnp.int32), block_kv)
  t_hi = lax.div(jnp.asarray(k_hi, jnp.int32) + (block_kv - 1), block_kv)
  empty = (k_hi <= k_lo) | (q_hi <= q_lo)
  t_lo = jnp.where(empty, 0, t_lo)
  t_hi = jnp.where(empty, 0, t_hi)
  return t_lo, t_hi


def _kernel_body(q_ref, k_ref, v_ref, o_ref, lse_ref, smem, *, extra_refs,
                 Tq, Tk, heads_per_kv, scale, mask, block_q, block_kv, stages,
                 dtype, config, num_q_ctas, has_lengths, has_sinks,
                 has_segments, softcap, drain=True, num_heads=None,
                 batch_size=None, num_ctas=None, separate_o=False,
                 named=False, staging=False):
  """One CTA: one work item (the grid), or a loop over items (``config.persistent``).

  A work item is (head, query CTA tile, batch). The persistent kernel
  (``num_ctas`` CTAs on a 1D grid, axis ``common.CTA_AXIS``) takes the items of its row of
  the schedule table (the last extra input). The K/V
  ring runs on across items: ``g``, the count of tiles this CTA has streamed
  before the item, places the item's first tile in slot ``g % stages``, and
  each barrier sees one arrival and one wait per tile whatever item the tile
  belongs to; the ping-pong turns run on across items too.
  """
  wg = lax.axis_index(common.WG_AXIS)
  extra_refs = list(extra_refs)
  schedule_ref = extra_refs.pop() if num_ctas is not None else None
  len_refs = (extra_refs.pop(0), extra_refs.pop(0)) if has_lengths else None
  # V's end tiles and their indices (end_tiles.py), with the lengths.
  v_edge_refs = (extra_refs.pop(0), extra_refs.pop(0)) if has_lengths else None
  sink_ref = extra_refs.pop(0) if has_sinks else None
  seg_refs = tuple(extra_refs) if has_segments else None
  static_lengths = (Tq, Tk)
  nwg = config.compute_warpgroups
  cta_rows = nwg * block_q
  # Ping-pong turns and ring releases (sync.py): named barriers on the GPU
  # (ids: one turn per compute warpgroup, then k's slots, then v's),
  # mbarriers when interpreted.
  turns = sync.TURNS[config.pingpong](wg, None if named else smem.get("turns"),
                                      first_id=sync.first_turn_id(nwg), num=nwg)
  release = {
      name: sync.Release(nwg, None if named else smem[f"{name}_free"], first_id=first)
      for name, first in zip(("k", "v"), sync.release_first_ids(stages, nwg))}

  score_scale = scale * common.LOG2_E
  reduced = plgpu.Layout.WGMMA.reduce(1)
  # The online softmax's domain: exp2(x) with x = (s - m) * expo_scale,
  # s the scores as ``scores`` returns them and m their running max.
  # Unless ``scale_first`` (or a soft cap, or a scale <= 0), s stays raw
  # (the max needs no multiply first: scaling by c > 0 is monotone) and
  # expo_scale is scale * log2(e); else s is already in the exp2 domain
  # and expo_scale 1.
  # (A scale whose float32 is subnormal or 0 takes the scaled path: a raw
  # -inf times a zero expo_scale would be NaN.)
  raw_scores = (not config.scale_first and softcap is None
                and np.float32(score_scale) >= np.finfo(np.float32).tiny)
  expo_scale = score_scale if raw_scores else 1.0
  in_exp2 = lambda x: x * expo_scale if expo_scale != 1.0 else x
  # ``fma_exponent``: s * c - round(m * c) per score (kernels/exponent.py).
  fma_exponent = config.fma_exponent and raw_scores
  # A row's reference moves only when a tile's max exceeds it by more than
  # this (in s's units; clamped to stay finite for a tiny scale).
  threshold = min(RESCALE_THRESHOLD / expo_scale, 1e38)

  def setup(head, q_cta, batch):
    """The per-item scalars: lengths, shift, the key tiles the CTA streams."""
    kv_head = lax.div(head, jnp.asarray(heads_per_kv, head.dtype))
    Tq, Tk = static_lengths
    if has_lengths:
      # Per-batch scalars: plain scalar loads from global memory (every
      # thread loads the same two words; they stay in registers).
      Tq, Tk = len_refs[0][batch], len_refs[1][batch]
    sink = sink_ref[head] if has_sinks else None
    shift = mask.shift(Tq, Tk)
    cta_q_lo = q_cta * cta_rows
    cta_q_hi = jnp.minimum(cta_q_lo + cta_rows, Tq)
    # The key tiles this CTA streams; every compute warpgroup steps through all of them.
    t_lo, t_hi = _tile_ranges(mask, cta_q_lo, cta_q_hi, shift, Tk, block_kv)
    if has_segments:
      seg_ref = seg_refs[2]
      # Only the key tiles the CTA's documents touch (the union over its
      # warpgroups' query tiles).
      tile0 = q_cta * nwg
      seg_lo = functools.reduce(jnp.minimum, [seg_ref[batch, tile0 + w, 0]
                                              for w in range(nwg)])
      seg_hi = functools.reduce(jnp.maximum, [seg_ref[batch, tile0 + w, 1]
                                              for w in range(nwg)])
      t_lo = jnp.maximum(t_lo, seg_lo)
      t_hi = jnp.minimum(t_hi, seg_hi)
    t_hi = jnp.maximum(t_hi, t_lo)
    return dict(head=head, q_cta=q_cta, batch=batch, kv_head=kv_head, Tq=Tq,
                Tk=Tk, sink=sink, shift=shift, cta_q_lo=cta_q_lo, t_lo=t_lo,
                t_hi=t_hi)

  @jax.named_scope("epilogue")
  def finish(pend, *, persistent: bool):
    """An item's epilogue on warpgroup ``wg``: o = acc / l and the lse into
    shared memory, then their TMA stores (rows past Tq dropped).
    ``persistent``: the previous item's stores may still read the staging
    tiles."""
    acc, m, l, q_lo, batch, head = (pend[n] for n in (
        "acc", "m", "l", "q_lo", "batch", "head"))
    Tq, sink = pend.get("Tq"), pend.get("sink")
    # Carried across items the offset loses what the layout inference reads
    # from its arithmetic (a multiple of block_q), which the stores' tiling needs.
    q_lo = pl.multiple_of(q_lo, block_q)
    # The running max into the exp2 domain, rounded: the sink's alpha below
    # subtracts it, and a fused m * c - m_fin would be exp2 of a rounding
    # error at E03's magnitudes.
    if expo_scale != 1.0:
      m = common.scale_rounded(m, expo_scale, interpret=staging, layout=reduced)
    if has_sinks:
      # The sink joins the denominator as one more (raw, natural-log) logit.
      sink2 = sink * common.LOG2_E
      m_fin = jnp.maximum(m, sink2)
      m_fin = jnp.where(m_fin == -jnp.inf, 0.0, m_fin)
      saw_no_key = m == -jnp.inf
      alpha = jnp.exp2(m - m_fin)
      # A sink above float32's max / log2(e) (or +inf) is +inf here, and the
      # row's max: exp2(0) = 1, not exp2(inf - inf) = NaN.
      l = l * alpha + jnp.exp2(jnp.where(sink2 == m_fin, 0.0, sink2 - m_fin))
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      m = m_fin
    # l is 0 only where nothing was seen (and no sink); a NaN l (a NaN sink)
    # must reach lse as well as o.
    seen = l != 0
    inv_l = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
    o = acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])
    # (m + log2 l) ln 2, not m ln 2 + ln l: approximate ln is log2 times ln 2,
    # and with two products feeding one sum the compiler may fuse either into
    # an FMA, differently in kernel variants (E11: the lengths == T kernel's
    # lse differed from the no-lengths kernel's by rounding on the H200 until
    # this form; bitwise equal since, 2026-12-01).
    lse = jnp.where(seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) * common.LN_2,
                    -jnp.inf)
    if has_sinks:
      # The sink alone is the denominator of a row that saw no key, and
      # outweighs every finite score where it is +inf here: the lse is the
      # sink itself, as the reference's (the exp2 round trip was 1 ulp off;
      # an overflowed score alone keeps its NaN).
      lse = jnp.where(saw_no_key | ((m == jnp.inf) & (m == sink2)), sink, lse)
    if has_lengths:
      # Rows i >= q_len see nothing: they were computed like the others and
      # are replaced here (selected, so NaN in their q cannot leak). Without
      # lengths TMA drops the rows past Tq.
      row = q_lo + plgpu.broadcasted_iota(jnp.int32, acc.shape, 0,
                                          layout=plgpu.Layout.WGMMA)
      o = jnp.where(row < Tq, o, 0.0)
      row_ok = q_lo + plgpu.broadcasted_iota(
          jnp.int32, (block_q,), 0, layout=reduced) < Tq
      empty_lse = -jnp.inf if sink is None else sink
      lse = jnp.where(row_ok, lse, empty_lse)
    o_smem = smem["qo"].at[wg]
    if persistent:
      if separate_o:
        o_smem = smem["o"].at[wg]
      # The previous item's o / lse stores must have read the staging tiles.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    o_smem[...] = o.astype(dtype)
    lse_smem = smem["lse"].at[wg]
    lse_smem[...] = lse
    plgpu.commit_smem()
    # TMA drops the rows past Tq.
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[batch, pl.ds(q_lo, block_q), head])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, pl.ds(q_lo, block_q)])

  def slot_fn(it, g0):
    if g0 is None:  # One item per CTA: its first tile takes slot 0.
      return lambda t: lax.rem(t - it["t_lo"], stages)
    return lambda t: lax.rem(g0 + (t - it["t_lo"]), stages)

  def compute_item(it, slot_of, *, load_q, next_q=None, pending=None):
    """One item on compute warpgroup ``wg``.

    ``next_q``: None for the one-item kernel; else ``(has_next, issue)``,
    ``issue()`` starting the TMA of the next item's q into this warpgroup's
    q tile, done once nothing reads that tile any more.
    ``pending``: None, or (``ForwardConfig.defer_epilogue``) ``(valid, pend)``
    with the previous item's ``pend`` (see the end): its epilogue runs while
    this item's first Q K^T is in flight, after the turn's signal, and this
    item returns its own ``pend`` instead of storing it.
    """
    defer = pending is not None

    def run_pending():
      # The previous item's epilogue (none before the CTA's first item).
      pl.when(pending[0])(functools.partial(finish, pending[1], persistent=True))
    batch, head, Tq, Tk, shift = (it["batch"], it["head"], it["Tq"], it["Tk"],
                                  it["shift"])
    t_lo, t_hi, sink = it["t_lo"], it["t_hi"], it["sink"]
    if has_segments:
      q_ids_ref, kv_ids_ref, seg_ref = seg_refs
    q_smem = smem["qo"].at[wg]
    # Interpret mode stages P through smem for every P @ V; the GPU path only
    # for overlap_softmax, whose own branch below keeps its wgmmas in flight.
    p_stage = smem["p"].at[wg] if staging else None
    q_lo = it["cta_q_lo"] + wg * block_q
    q_hi = jnp.minimum(q_lo + block_q, Tq)
    if load_q:
      plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_lo, block_q), head],
                              q_smem, smem["q_loaded"].at[wg])
    # This warpgroup's own tiles, clamped into the CTA's.
    w_lo, w_hi = _tile_ranges(mask, q_lo, q_hi, shift, Tk, block_kv)
    if has_segments:
      my_tile = it["q_cta"] * nwg + wg
      w_lo = jnp.maximum(w_lo, seg_ref[batch, my_tile, 0])
      w_hi = jnp.minimum(w_hi, seg_ref[batch, my_tile, 1])
    w_lo = jnp.clip(w_lo, t_lo, t_hi)
    w_hi = jnp.clip(w_hi, w_lo, t_hi)
    # Tiles every row sees in full (and wholly below Tk) need no mask.
    f_lo, f_hi = mask.full_key_range(q_lo, q_hi, shift, Tk)
    ft_lo = lax.div(jnp.asarray(f_lo, jnp.int32) + (block_kv - 1), block_kv)
    ft_hi = lax.div(jnp.asarray(f_hi, jnp.int32), block_kv)
    if has_segments:
      ft_lo = jnp.maximum(ft_lo, seg_ref[batch, my_tile, 2])
      ft_hi = jnp.minimum(ft_hi, seg_ref[batch, my_tile, 3])
      # This warpgroup's query ids, one per row, kept in registers.
      q_ids = plgpu.load(q_ids_ref.at[batch, pl.ds(q_lo, block_q)],
                         layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
    m1 = jnp.clip(ft_lo, w_lo, w_hi)
    m2 = jnp.clip(ft_hi, m1, w_hi)

    def one_sided(lo, hi, edge: str):
      """``tile_mask.edge_loops`` of masked tiles [lo, hi) (for a window of
      1024, none compares both). Without a lower bound (no window's left
      edge) one loop, which compares the upper bound alone."""
      if mask.left is None or not config.one_sided_edges:
        return [(lo, hi, tile_mask.SIDES)]
      # By the mask and Tk alone (segment ids are compared in every masked tile).
      return tile_mask.edge_loops(
          lo, hi, edge, tile_mask.edge_tiles((f_lo, f_hi), block_kv))

    jax.named_scope("q_wait")(plgpu.barrier_wait)(smem["q_loaded"].at[wg])
    D = q_smem.shape[-1]
    # The persistent kernel's next q, issued in the item's last compute step
    # rather than after it: at D=128 the next item then waited 0.28 instead of
    # 0.72 thousand cycles for it (scripts/profile_forward.py) and a causal
    # window of 1024 ran 3% faster; at D=64, whose steps are shorter, the
    # per-step check cost 2-3% (H200, seventeenth session).
    early_next_q = next_q is not None and separate_o and D > 64

    def load_kv_ids(t, part, width):
      """The segment ids of tile t's keys (of ``part``), one per column."""
      k0 = t * block_kv + (0 if part is None else part[0])
      return plgpu.load(kv_ids_ref.at[batch, pl.ds(k0, width)],
                        layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)

    def scores(s, t, *, masked: bool, part: tuple[int, int] | None = None,
               sides=tile_mask.SIDES, kv_ids=None):
      """Raw Q K_t^T -> scores in the softmax's domain (see ``expo_scale``),
      -inf where tile t is masked; ``part`` (offset, width): s holds only
      those keys of the tile (``key_part``); ``sides``: the row bounds that
      may cut it; ``kv_ids``: the tile's segment ids when loaded already
      (``prefetch_segment_ids``), else loaded here."""
      # E03: exp2's argument must be exactly 0 at a row's max. Raw scores
      # give (s - m) * c; scaled ones must be rounded before the max and the
      # subtraction both see them (a plain s * c - m is fused into one FMA by
      # LLVM where nothing is masked: exp2 of a rounding error, which
      # overflows for |m| >= 2**31, as it did here until 2026-12-03).
      if not raw_scores and softcap is None:
        s = common.scale_rounded(s, score_scale, interpret=staging)
      elif not raw_scores:
        # The cap acts on natural-unit scores; then into the exp2 domain.
        s = jnp.tanh(s * common.softcap_factor(scale, softcap)) * (softcap * common.LOG2_E)
      if masked:
        k0 = t * block_kv + (0 if part is None else part[0])
        same_doc = None
        if has_segments:
          if kv_ids is None:
            kv_ids = load_kv_ids(t, part, s.shape[1])
          same_doc = (lax.broadcast_in_dim(q_ids, s.shape, [0])
                      == lax.broadcast_in_dim(kv_ids, s.shape, [1]))
        # Each row's key range (the mask's and Tk), against the columns: only
        # the bounds in ``sides`` (those that may cut this tile).
        s = tile_mask.mask_scores(
            s, tile_mask.key_bounds(mask, q_lo, s.shape[0], shift, Tk), k0,
            sides=sides, also=same_doc)
      return s

    def new_max(s, m, *, masked: bool):
      """(m_new, the max to subtract: m_new, or 0 where still -inf)."""
      m_new = jnp.maximum(m, s.max(axis=1))
      if masked:
        # A row with nothing visible so far keeps m = -inf; subtract 0 instead
        # so exp2 never sees -inf - -inf.
        return m_new, jnp.where(m_new == -jnp.inf, 0.0, m_new)
      return m_new, m_new

    def lazy_max(s, m, *, masked: bool):
      """``lazy_rescale``: (reference, the max to subtract, moves). A row
      keeps its reference m unless the tile's max exceeds it by more than
      ``threshold`` (always when m is still -inf and the row sees a key);
      its alpha is then exp2 of the move, else exactly 1. NaN scores leave m
      as it is and reach P."""
      m_cand = jnp.maximum(m, s.max(axis=1))
      # The difference, not m + threshold: that sum rounds (up by an ulp of m
      # for |m| >= 2**26), which would let P exceed 2**8 (float16's P
      # overflows at 2**16). m_cand - m is exact where it matters (Sterbenz).
      moves = m_cand - m > threshold
      m_new = jnp.where(moves, m_cand, m)
      m_sub = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
      return m_new, m_sub, moves

    def exponents(s, m, m_sub):
      """exp2's arguments: (the rescale's from reference m to m_sub, P's)."""
      if not fma_exponent:
        return (in_exp2(m - m_sub),
                in_exp2(s - lax.broadcast_in_dim(m_sub, s.shape, [0])))
      return exponent.exponents(s, m, m_sub, expo_scale, interpret=staging)

    def softmax(s, t, m, *, masked: bool, part: tuple[int, int] | None = None,
                sides=tile_mask.SIDES, kv_ids=None):
      """Tile t's raw scores -> (P_t float32, new row max, the rescale alpha)."""
      s = scores(s, t, masked=masked, part=part, sides=sides, kv_ids=kv_ids)
      if config.lazy_rescale:
        m_new, m_sub, moves = lazy_max(s, m, masked=masked)
      else:
        m_new, m_sub = new_max(s, m, masked=masked)
      shift, x = exponents(s, m, m_sub)
      alpha = jnp.exp2(shift)
      if config.lazy_rescale:
        alpha = jnp.where(moves, alpha, 1.0)
      p = exp2.split_exp2(x, min(config.exp2_fma_cols, s.shape[1]), guard=staging)
      return p, m_new, alpha

    def rescale(acc, alpha):
      # On the GPU a warp whose rows kept their reference skips the multiplies.
      return common.scale_rows(acc, alpha,
                               skip_ones=config.lazy_rescale and not staging)

    def issue_next_q_after(t):
      # Tile t's Q K^T has completed (its scores were read): in the item's
      # last tile the next item's q may land during this tile's softmax and
      # P @ V, not only after them. Every step kind calls this (the
      # overlapped steps once did not, and the persistent kernel hung).
      if early_next_q:
        pl.when(next_q[0] & (t == w_hi - 1))(next_q[1])

    def with_signal(also):
      """What runs while a Q K^T is in flight: the turn's signal, then
      ``also`` (the deferred epilogue, in an item's first step)."""
      signal = jax.named_scope("signal")(turns.signal)
      if also is None:
        return signal
      return lambda: (signal(), also())

    def compute_step(t, carry, *, masked: bool, part: tuple[int, int] | None = None,
                     sides=tile_mask.SIDES, also=None):
      # K of tile t was waited for already: by the previous compute step,
      # while its P @ V ran, or before the first compute step. ``part``
      # (offset, width), static: only those keys of the tile (a half edge
      # tile, the trimmed end tile; see ``key_part``).
      acc, m, l = carry
      slot = slot_of(t)
      k_tile, v_tile, width = smem["k"].at[slot], smem["v"].at[slot], block_kv
      if part is not None:
        offset, width = part
        k_tile = k_tile.at[pl.ds(offset, width)]
        v_tile = v_tile.at[pl.ds(offset, width)]
      kv_ids = None
      if masked and has_segments and config.prefetch_segment_ids:
        # Issued before Q K^T so that the load's latency (L2 at best) runs
        # under the matmul; loaded after it, it follows the scores' wait.
        kv_ids = load_kv_ids(t, part, width)
      s = jax.named_scope("qk")(common.matmul_smem)(
          q_smem, k_tile.transpose((1, 0)), (block_q, width),
          while_running=with_signal(also))
      release["k"].free(slot)
      issue_next_q_after(t)
      p, m_new, alpha = jax.named_scope("softmax")(softmax)(
          s, t, m, masked=masked, part=part, sides=sides, kv_ids=kv_ids)
      acc = rescale(acc, alpha)
      l = l * alpha

      @jax.named_scope("turn")
      def release_softmax():
        plgpu.barrier_wait(smem["v_loaded"].at[slot])
        turns.wait()

      p16 = p.astype(dtype)
      # Which of the row sum and the barriers goes first matters for register
      # pressure; at D=256 the accumulator leaves no room to hold p across.
      if D <= 128:
        l = l + p.sum(axis=1)
        acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
        release_softmax()
      else:
        release_softmax()
        l = l + p.sum(axis=1)
      @jax.named_scope("k_wait")
      def wait_next_k():
        @pl.when(t + 1 < w_hi)
        def _():
          plgpu.barrier_wait(smem["k_loaded"].at[slot_of(t + 1)])

      stage = p_stage
      if stage is not None and part is not None:
        stage = stage.at[:, pl.ds(0, width)]
      acc = jax.named_scope("pv")(common.accumulate_register_lhs)(
          acc, p16, v_tile, staging=stage, while_running=wait_next_k)
      release["v"].free(slot)
      return acc, m_new, l

    # config.overlap_softmax (FlashAttention-3, Section 3.2): step t issues
    # S_t = Q K_t^T and O += P_{t-1} V_{t-1} together and runs tile t's
    # softmax while the second matmul is in flight; P goes to P @ V through
    # this warpgroup's shared-memory tile (a register operand must not change
    # while its wgmma runs). first_step makes P of the first tile, last_pv
    # adds the last P @ V. Per tile one signal and one wait for the turn, as
    # in compute_step.
    # ``overlap_p_registers`` on the GPU: P_{t-1} is carried in registers
    # instead (the carry's fourth element), the register operand of the
    # P @ V that runs during tile t's softmax; ptxas keeps the operand's
    # registers until that wgmma's wait.
    p_regs = config.overlap_p_registers and p_stage is None
    p_tile = smem["p"].at[wg] if config.overlap_softmax and not p_regs else None

    def softmax_to_p(s, t, m, l, *, masked: bool):
      """Tile t's raw scores -> (P_t in the input dtype, m, alpha, l)."""
      p, m_new, alpha = softmax(s, t, m, masked=masked)
      return p.astype(dtype), m_new, alpha, l * alpha + p.sum(axis=1)

    def store_p(p16):
      p_tile[...] = p16
      plgpu.commit_smem()

    def first_step(t, carry, also=None):
      acc, m, l = carry[:3]  # acc is still 0: nothing to rescale.
      slot = slot_of(t)
      s = common.matmul_smem(q_smem, smem["k"].at[slot].transpose((1, 0)),
                             (block_q, block_kv), while_running=with_signal(also))
      release["k"].free(slot)
      issue_next_q_after(t)
      p16, m, _, l = softmax_to_p(s, t, m, l, masked=True)
      turns.wait()
      if p_regs:
        return acc, m, l, p16
      store_p(p16)
      return acc, m, l

    def overlap_step(t, carry, *, masked: bool):
      acc, m, l = carry[:3]
      p_prev = carry[3] if p_regs else p_tile
      slot, prev = slot_of(t), slot_of(t - 1)
      plgpu.barrier_wait(smem["k_loaded"].at[slot])
      plgpu.barrier_wait(smem["v_loaded"].at[prev])
      k_t = smem["k"].at[slot].transpose((1, 0))
      v_prev = smem["v"].at[prev]

      def after_scores(s):
        release["k"].free(slot)
        issue_next_q_after(t)
        out = softmax_to_p(s, t, m, l, masked=masked)
        turns.wait()  # Our turn on the tensor cores again.
        return out

      if p_stage is not None:  # Interpret mode: one matmul after the other.
        s = common.matmul_smem(q_smem, k_t, (block_q, block_kv),
                               while_running=turns.signal)
        p16, m, alpha, l = after_scores(s)
        acc = acc + common.matmul_smem(p_tile, v_prev, acc.shape)
      else:
        def body(refs):
          acc_ref, s_ref, p_ref, m_ref, alpha_ref, l_ref = refs
          plgpu.wgmma(s_ref, q_smem, k_t)
          plgpu.wgmma(acc_ref, p_prev, v_prev)
          turns.signal()
          s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # S_t only.
          p_ref[...], m_ref[...], alpha_ref[...], l_ref[...] = after_scores(s)
        zeros = lambda shape, dt: plgpu.layout_cast(jnp.zeros(shape, dt),
                                                    plgpu.Layout.WGMMA)
        # Leaving run_state waits for P_{t-1} V_{t-1} too.
        acc, _, p16, m, alpha, l = pl.run_state(body)((
            plgpu.ACC.init(acc), plgpu.ACC.init(zeros((block_q, block_kv), jnp.float32)),
            zeros((block_q, block_kv), dtype), m, m, l))
      release["v"].free(prev)
      if p_regs:
        return rescale(acc, alpha), m, l, p16
      store_p(p16)  # P_{t-1} V_{t-1} has read the tile.
      return rescale(acc, alpha), m, l

    def last_pv(t, carry):
      acc, m, l = carry[:3]
      p_prev = carry[3] if p_regs else p_tile
      slot = slot_of(t)
      plgpu.barrier_wait(smem["v_loaded"].at[slot])
      if p_stage is not None:
        acc = acc + common.matmul_smem(p_tile, smem["v"].at[slot], acc.shape)
      else:
        acc = pl.run_state(lambda acc_ref: plgpu.wgmma(
            acc_ref, p_prev, smem["v"].at[slot]))(plgpu.ACC.init(acc))
      release["v"].free(slot)
      return (acc, m, l) + carry[3:]

    # config.fuse_pv_qk: the scores of tile t are carried into step t, which
    # runs their softmax, then issues P_t @ V_t and Q K_{t+1}^T back to back
    # (one turn on the tensor cores with no gap between the two) and waits
    # once. The first tile's Q K^T is issued alone before the steps, the last
    # tile's P @ V alone in its step. Per tile one signal and one wait for the
    # turn, as in compute_step.
    def zero_scores():
      return plgpu.layout_cast(jnp.zeros((block_q, block_kv), jnp.float32),
                               plgpu.Layout.WGMMA)

    def fused_first(t, carry, also=None):
      acc, m, l, _ = carry
      slot = slot_of(t)
      s = jax.named_scope("qk")(common.matmul_smem)(
          q_smem, smem["k"].at[slot].transpose((1, 0)), (block_q, block_kv),
          while_running=with_signal(also))
      release["k"].free(slot)
      issue_next_q_after(t)
      return acc, m, l, s

    def fused_step(t, carry, *, masked: bool, sides=tile_mask.SIDES):
      acc, m, l, s = carry
      slot, nxt = slot_of(t), t + 1
      has_next = nxt < w_hi
      next_slot = slot_of(nxt)
      p, m_new, alpha = jax.named_scope("softmax")(softmax)(s, t, m, masked=masked,
                                                            sides=sides)
      acc = rescale(acc, alpha)
      l = l * alpha

      @jax.named_scope("turn")
      def release_softmax():
        plgpu.barrier_wait(smem["v_loaded"].at[slot])
        jax.named_scope("k_wait")(pl.when(has_next)(
            lambda: plgpu.barrier_wait(smem["k_loaded"].at[next_slot])))
        turns.wait()

      p16 = p.astype(dtype)
      if D <= 128:  # As in compute_step.
        l = l + p.sum(axis=1)
        acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
        release_softmax()
      else:
        release_softmax()
        l = l + p.sum(axis=1)
      v_tile = smem["v"].at[slot]

      def pv_and_qk():
        return jax.named_scope("pv_qk")(common.accumulate_then_matmul)(
            acc, p16, v_tile, q_smem, smem["k"].at[next_slot].transpose((1, 0)),
            (block_q, block_kv), staging=p_stage,
            while_running=jax.named_scope("signal")(turns.signal))

      def pv_only():
        return (jax.named_scope("pv")(common.accumulate_register_lhs)(
            acc, p16, v_tile, staging=p_stage), zero_scores())

      acc, s = lax.cond(has_next, pv_and_qk, pv_only)
      release["v"].free(slot)
      pl.when(has_next)(functools.partial(release["k"].free, next_slot))
      issue_next_q_after(nxt)
      return acc, m_new, l, s

    @jax.named_scope("skip")
    def skip_step(t, carry):
      # Keep every barrier's phases in step with the other warpgroup and the
      # producer: wait for and release the tile, signal and wait for the
      # turn like compute_step.
      slot = slot_of(t)
      plgpu.barrier_wait(smem["k_loaded"].at[slot])
      release["k"].free(slot)
      turns.signal()
      plgpu.barrier_wait(smem["v_loaded"].at[slot])
      release["v"].free(slot)
      turns.wait()
      return carry

    acc = plgpu.layout_cast(jnp.zeros((block_q, D), jnp.float32),
                            plgpu.Layout.WGMMA)
    m = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), reduced)
    l = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), reduced)
    lax.fori_loop(t_lo, w_lo, skip_step, None)
    if defer:
      # No tile of this item for this warpgroup: the previous epilogue runs
      # now (else in the first step, with ``also``).
      pl.when(w_lo == w_hi)(run_pending)
    also = run_pending if defer else None
    # With a deferred epilogue the item's first tile w_lo is peeled off the
    # loops: a step of its kind (one of the loops of 0 or 1 trips below)
    # carries the epilogue; the loops then start at w_lo + 1.
    after_first = w_lo + 1 if defer else w_lo

    def from_second(lo):
      return jnp.maximum(lo, after_first)

    @pl.when(w_lo < w_hi)
    @jax.named_scope("first_k")
    def _():
      plgpu.barrier_wait(smem["k_loaded"].at[slot_of(w_lo)])

    carry = (acc, m, l)
    if config.overlap_softmax:
      # Loops of 0 or 1 step: the first tile's softmax, the last tile's P @ V.
      start = jnp.minimum(w_lo + 1, w_hi)
      if p_regs:  # P_{t-1}'s place in the carry (a loop of 0 trips keeps it).
        carry += (plgpu.layout_cast(jnp.zeros((block_q, block_kv), dtype),
                                    plgpu.Layout.WGMMA),)
      carry = lax.fori_loop(w_lo, start, functools.partial(first_step, also=also),
                            carry)
      a1 = jnp.clip(m1, start, w_hi)
      a2 = jnp.clip(m2, a1, w_hi)
      carry = lax.fori_loop(start, a1, functools.partial(overlap_step, masked=True), carry)
      carry = lax.fori_loop(a1, a2, functools.partial(overlap_step, masked=False), carry)
      carry = lax.fori_loop(a2, w_hi, functools.partial(overlap_step, masked=True), carry)
      carry = lax.fori_loop(jnp.maximum(w_hi - 1, w_lo), w_hi, last_pv, carry)
      carry = carry[:3]
    elif config.fuse_pv_qk:
      carry = lax.fori_loop(w_lo, jnp.minimum(w_lo + 1, w_hi),
                            functools.partial(fused_first, also=also),
                            (*carry, zero_scores()))
      for lo, hi, sides in one_sided(w_lo, m1, "lower"):
        carry = lax.fori_loop(lo, hi, functools.partial(
            fused_step, masked=True, sides=sides), carry)
      carry = lax.fori_loop(m1, m2, functools.partial(fused_step, masked=False), carry)
      for lo, hi, sides in one_sided(m2, w_hi, "upper"):
        carry = lax.fori_loop(lo, hi, functools.partial(
            fused_step, masked=True, sides=sides), carry)
      carry = carry[:3]
    else:
      a, b = w_lo, w_hi
      if config.half_edge_tiles:
        # Such tiles lie outside [m1, m2): a fully visible tile has no
        # unseen half.
        a, b = _half_edges(mask, q_lo, q_hi, shift, Tk, w_lo, w_hi, block_kv)
      m1c = jnp.clip(m1, a, b)
      m2c = jnp.clip(m2, m1c, b)
      # The loops in key order: (first, end, masked, part, edge); each masked
      # one is split by the bounds that may cut its tiles (``one_sided``),
      # where it runs, so the split points are not live across other loops.
      loops = [(a, m1c, True, None, "lower"), (m1c, m2c, False, None, None),
               (m2c, b, True, None, "upper")]
      if config.half_edge_tiles:
        hw = block_kv // 2
        loops = ([(w_lo, a, True, (hw, hw), "lower")] + loops
                 + [(b, w_hi, True, (0, hw), "upper")])
      end = _trimmed_end(Tk, block_kv) if config.trim_end_tile else None
      if end is not None:
        # The tile holding key Tk - 1 comes last in key order, so it lies in
        # an upper-edge loop (the unmasked tiles [m1, m2) end below it), and
        # that loop's last trip is peeled off with fewer keys. Only where a
        # window narrower than a tile puts it in a lower-edge loop does it
        # keep all its keys (masked, so still exact).
        t_end, w_end = end
        split = []
        for lo, hi, masked, part, edge in loops:
          cut = key_part(part, w_end, block_kv) if edge == "upper" else part
          if cut == part:
            split.append((lo, hi, masked, part, edge))
            continue
          split += [(lo, jnp.minimum(hi, t_end), masked, part, edge),
                    (jnp.maximum(lo, t_end), hi, masked, cut, edge)]
        loops = split
      if defer:
        # One peeled step per kind of step (the two masked loops share one,
        # which compares both bounds).
        kinds = {}
        for lo, hi, masked, part, _ in loops:
          kinds.setdefault((masked, part), []).append((lo, hi))
        for (masked, part), ranges in kinds.items():
          hit = functools.reduce(lambda x, y: x | y,
                                 [(lo <= w_lo) & (w_lo < hi) for lo, hi in ranges])
          carry = lax.fori_loop(w_lo, w_lo + hit.astype(jnp.int32), functools.partial(
              compute_step, masked=masked, part=part, also=also), carry)
      for lo, hi, masked, part, edge in loops:
        if not masked:
          carry = lax.fori_loop(from_second(lo), hi, functools.partial(
              compute_step, masked=False), carry)
          continue
        for x, y, sides in one_sided(lo, hi, edge):
          carry = lax.fori_loop(from_second(x), y, functools.partial(
              compute_step, masked=True, part=part, sides=sides), carry)
    lax.fori_loop(w_hi, t_hi, skip_step, None)
    acc, m, l = carry
    if early_next_q:
      # A warpgroup without tiles in this item issues the next q here (the
      # others did in their last compute step).
      pl.when(next_q[0] & (w_lo == w_hi))(next_q[1])
    elif next_q is not None and separate_o:
      # Every QK^T of this item has completed (its scores were read), so the
      # next item's q may land while this one's epilogue runs.
      pl.when(next_q[0])(next_q[1])

    pend = dict(acc=acc, m=m, l=l, q_lo=q_lo, batch=batch, head=head)
    if has_lengths:
      pend["Tq"] = Tq
    if has_sinks:
      pend["sink"] = sink
    if defer:
      return pend
    if config.epilogue_off_turn:
      # The tensor cores go to the next warpgroup (its last P @ V) while
      # this one's epilogue runs; every warpgroup adds this signal and the
      # wait below at the same point of its sequence, so the turns still
      # alternate.
      jax.named_scope("signal")(turns.signal)()
    finish(pend, persistent=next_q is not None)
    if next_q is None:
      common.wait_final_stores()
    elif not separate_o:
      # o was staged in the q tile: the next q may land once the store read it.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      pl.when(next_q[0])(next_q[1])
    if config.epilogue_off_turn:
      jax.named_scope("turn")(turns.wait)()
    return None

  def produce_item(it, slot_of, g0):
    """The K/V tiles of one item; ``g0`` as in ``slot_fn`` (None: one item per CTA)."""
    batch, kv_head, t_lo, t_hi = it["batch"], it["kv_head"], it["t_lo"], it["t_hi"]

    def load(t, slot, wait_free=None):
      """K then V of tile t into ``slot``; each first waits for the slot's
      release when ``wait_free`` (a static True, or a traced condition) says so."""
      for name in ("k", "v"):
        slot_wait = jax.named_scope("slot_wait")(release[name].wait)
        if wait_free is True:
          slot_wait(slot)
        elif wait_free is not None:
          pl.when(wait_free)(functools.partial(slot_wait, slot))
        ref, edges = (k_ref, None) if name == "k" else (v_ref, v_edge_refs)
        end_tiles.copy_tile(ref, edges, batch, t, block_kv, kv_head,
                        smem[name].at[slot], smem[f"{name}_loaded"].at[slot])

    if g0 is None:
      for i in range(stages):
        pl.when(t_lo + i < t_hi)(functools.partial(load, t_lo + i, i))

      @pl.loop(t_lo + stages, t_hi)
      def _refill(t):
        load(t, slot_of(t), wait_free=True)
      return

    @pl.loop(t_lo, t_hi)
    def _stream(t):
      # The CTA's first ``stages`` tiles fill empty slots; every later one
      # waits for the release of the tile ``stages`` before it (which may
      # belong to the previous item).
      load(t, slot_of(t), wait_free=g0 + (t - t_lo) >= stages)

  def drain_ring(g_lo, g_hi, slot_of):
    # Observe the last release of every slot: the interpreter requires every
    # phase of a waited barrier to be waited on. Nothing on the GPU needs it
    # (``common.DRAIN_BARRIERS`` turns it off there, to time it).
    if drain:
      @pl.loop(jnp.maximum(g_hi - stages, g_lo), g_hi)
      def _drain(t):
        slot = slot_of(t)
        release["k"].wait(slot)
        release["v"].wait(slot)

  if not config.persistent:
    q_cta = common.grid_index(common.Q_TILES_AXIS, num_q_ctas, config.reverse_q_tiles)
    head = lax.axis_index(common.HEADS_AXIS)
    batch = lax.axis_index(common.BATCH_AXIS)
    it = setup(head, q_cta, batch)
    slot_of = slot_fn(it, None)

    @pl.when(wg < nwg)
    def _compute():
      plgpu.set_max_registers(config.compute_registers, action="increase")
      turns.start()
      compute_item(it, slot_of, load_q=True)
      turns.finish()

    @pl.when(wg == nwg)
    def _producer():
      plgpu.set_max_registers(config.producer_registers, action="decrease")
      produce_item(it, slot_of, None)
      drain_ring(it["t_lo"], it["t_hi"], slot_of)
    return

  # Persistent: this CTA's row of the schedule (``schedule.lpt_schedule``):
  # its item count, then its items (num_ctas <= items, so >= 1 each).
  cta = lax.axis_index(common.CTA_AXIS)
  n_local = schedule_ref[cta, 0]

  def item_of(i):
    # The grid's order: heads fastest, then query tiles, then batch.
    head = lax.rem(i, jnp.asarray(num_heads, i.dtype))
    rest = lax.div(i, jnp.asarray(num_heads, i.dtype))
    q_idx = lax.rem(rest, jnp.asarray(num_q_ctas, i.dtype))
    batch = lax.div(rest, jnp.asarray(num_q_ctas, i.dtype))
    q_cta = (num_q_ctas - 1 - q_idx) if config.reverse_q_tiles else q_idx
    return head, q_cta, batch

  def item_index(step):
    return schedule_ref[cta, 1 + step]

  @pl.when(wg < nwg)
  def _compute_persistent():
    plgpu.set_max_registers(config.compute_registers, action="increase")

    def issue_q(i):
      head, q_cta, batch = item_of(i)
      q_lo = q_cta * cta_rows + wg * block_q
      plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_lo, block_q), head],
                              smem["qo"].at[wg], smem["q_loaded"].at[wg])

    issue_q(item_index(0))

    defer = config.defer_epilogue

    def item(step, carry):
      g, pend = carry if defer else (carry, None)
      it = jax.named_scope("setup")(lambda: setup(*item_of(item_index(step))))()
      new_pend = compute_item(
          it, slot_fn(it, g), load_q=False,
          next_q=(step + 1 < n_local,
                  functools.partial(issue_q, item_index(step + 1))),
          pending=(step > 0, pend) if defer else None)
      g = g + (it["t_hi"] - it["t_lo"])
      return (g, new_pend) if defer else g

    # The turns run on across items: per item each warpgroup signals and
    # waits once per tile, so a start and a finish per item would let
    # warpgroup 0 signal twice in a row (its finish, then its next item's
    # first tile) before warpgroup 1 waits: a named barrier would then
    # complete on warpgroup 0's arrivals alone (seen as hangs on an H200).
    turns.start()
    if defer:
      # A placeholder for the item before the first (never stored: step 0
      # runs no pending epilogue).
      zero = jnp.int32(0)
      pend = dict(
          acc=plgpu.layout_cast(jnp.zeros((block_q, q_ref.shape[-1]), jnp.float32),
                                plgpu.Layout.WGMMA),
          m=plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), reduced),
          l=plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), reduced),
          q_lo=zero, batch=zero, head=zero)
      if has_lengths:
        pend["Tq"] = zero
      if has_sinks:
        pend["sink"] = jnp.float32(0)
      _, pend = lax.fori_loop(0, n_local, item, (zero, pend))
      turns.finish()
      # The last item's epilogue. The schedule gives every CTA an item; the
      # guard keeps a CTA without one from storing the placeholder.
      pl.when(n_local > 0)(functools.partial(finish, pend, persistent=True))
    else:
      lax.fori_loop(0, n_local, item, jnp.int32(0))
      turns.finish()
    common.wait_final_stores()

  @pl.when(wg == nwg)
  def _producer_persistent():
    plgpu.set_max_registers(config.producer_registers, action="decrease")

    def item(step, g):
      it = setup(*item_of(item_index(step)))
      produce_item(it, slot_fn(it, g), g)
      return g + (it["t_hi"] - it["t_lo"])

    g_end = lax.fori_loop(0, n_local, item, jnp.int32(0))
    drain_ring(0, g_end, lambda g: lax.rem(g, stages))
