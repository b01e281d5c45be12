"""FlashAttention-3 backward on Hopper: the dq kernel and the dk/dv kernel.

Algorithm: FlashAttention-2 (Dao, 2023), Algorithm 2, split as in
FlashAttention-3 (Shah et al., 2024), Section 3 and Appendix B.1, into two
warp-specialised Mosaic GPU kernels that never write atomics (so gradients are
bitwise deterministic):

* delta = rowsum(o * do) in float32 (XLA; one fused pass over o and do).
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
  tiles. E07: q, do rows past q_len and k, v rows past kv_len are selected to
  0 in XLA first (one extra read+write of q, do, k and v, only with lengths),
  and lse/delta of rows past q_len are set to +inf/0 (p = 0 whatever the
  forward wrote there, sinks included). dq rows past q_len and dk, dv rows
  past kv_len are selected to exactly 0 at the end.
* soft cap c: s_c = c tanh(scale s / c), p = exp(s_c - lse) and
  ds = p (dp - delta) (1 - tanh^2), with tanh recomputed in the kernel (held
  in registers for the tile: one more (block_q, block_kv) float32 array).
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
  ``pair_dq`` issues dq's matmul beside dk's (FlashAttention-3's order).
  ``dot_product_attention(deterministic=False)`` takes the paired form at
  D = 64 only, where H200 sweeps found it faster than the two kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from flash3.kernels import common, exp2
from flash3.kernels.config import (SMEM_LIMIT_BYTES, check_bool, check_multiple,
                                   check_registers,
                                   window_key_span)
from flash3.kernels.forward import _check_extras, _segment_tile_ranges
from flash3.visibility import MaskSpec, keys_in_reach, queries_in_reach

_SMEM_RESERVED_BYTES = 1024
_SUPPORTED_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
# Optional inputs of ``attention_backward`` that pass the tests (issue 6); the
# API runs the XLA reference backward for the others. Sinks need nothing here.
SUPPORTED_FEATURES = frozenset({"lengths", "segments", "softcap"})


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
  """Static tuning of the two backward kernels; validates itself.

  Attributes:
    block_q_dq: query rows per compute warpgroup in the dq kernel (wgmma M).
    block_kv_dq: keys per streamed K/V tile in the dq kernel.
    compute_wgs_dq: compute warpgroups per CTA of the dq kernel (1 or 2);
      they share the K/V stream.
    block_kv_dkv: keys per compute warpgroup in the dk/dv kernel (wgmma M).
    block_q_dkv: query rows per streamed q/do tile in the dk/dv kernel.
    compute_wgs_dkv: compute warpgroups per CTA of the dk/dv kernel (1 or 2).
    num_stages: depth of the shared-memory ring of streamed tiles (the dq
      kernel's K/V ring; the dk/dv kernel's q/do ring too unless
      ``num_stages_dkv`` is set).
    split_dkv: compute dk and dv in two launches of the dk/dv kernel, each
      holding one float32 accumulator (a warpgroup has no registers for two at
      head_dim 256). The head_dim 256 default until the fifteenth session,
      when ``role_split`` replaced it.
    fuse_matmuls: in the dk/dv kernel, issue dv += pT do and dpT = v do^T
      before one wgmma wait (GPU path only; interpret mode runs them apart).
      Off by default: within a few percent either way in the H200 sweeps.
    reverse_q_tiles: launch the dq kernel's query tiles last-first (see
      ``common.grid_index``).
    deterministic: True (default): the two-kernel backward, bitwise
      reproducible. False: no dq kernel; the dk/dv kernel also forms
      dq += ds k per tile and adds it into a float32 dq with TMA reduce-add
      stores (FlashAttention-3's 5 matmuls per tile pair instead of 7), whose
      float32 sums depend on the order CTAs arrive in, so dq is not bitwise
      reproducible (dk, dv still are). Needs ``split_dkv`` off and
      ``block_q_dkv`` 64. Interpret mode writes per-CTA partial sums instead
      and adds them in XLA (its TMA has no reduce-add). Its GPU tests passed
      on an H200 (2026-12-01); with one dq tile per warpgroup it was 8-22%
      slower than the default at D=128 and 2-13% faster on three of four D=64
      shapes; see ``share_dq`` for D=128.
    share_dq: with ``deterministic`` False and two compute warpgroups, the
      warpgroups share each query tile's dq: both put their dsT tile in shared
      memory and each forms half of dq's columns from both (two wgmmas), so a
      CTA sends one float32 (64, D) dq tile per query tile by reduce-add
      instead of one per warpgroup (half the atomic traffic, half the dq
      registers), as FlashAttention-3 does. Needs head_dim a multiple of 128.
      Its GPU tests passed on an H200 (2026-12-01, sixth session); no
      heuristic takes it since the tenth session (0.70-0.79 of cuDNN, the
      two deterministic kernels 0.93-0.95 on the same shapes).
    overlap_matmuls: issue the two score-shaped matmuls of a tile (s = q k^T
      and dp = do v^T; in the dk/dv kernel their transposes) back to back and
      compute p while dp's runs, then issue dv += pT do and compute dsT while
      it runs before dk += dsT q (FlashAttention-3's backward order; two wgmma
      waits per tile instead of three or four). The dk/dv kernel's second pair
      needs dk and dv in one launch (split_dkv off); GPU path only, interpret
      mode runs the plain order. Default since the eighth session: on an H200
      (2026-12-01, bfloat16, docs/benchmarks/h200/2026-12-01-s8/tune.md) it
      was faster or even on 27 of 30 sweep rows (3-13% at head_dim 64 and
      128; within 1% at 256, where only the dq kernel changes), flash3 /
      cuDNN backward 0.902 -> 0.945 over 18 shapes; its GPU tests and
      racecheck passed.
    exp2_fma_cols: columns of each score tile (the dq kernel's (block_q_dq,
      block_kv_dq) s, the dk/dv kernel's (block_kv_dkv, block_q_dkv) s^T)
      whose exp2 runs as a polynomial on the FMA pipes instead of the MUFU
      unit (kernels/exp2.py): 0 (default) or a multiple of 16 up to both
      tiles' widths. An A/B knob: on an H200 (ninth session) 16 and 32
      columns were 1.5-12% slower at head_dim 64 and 128; its GPU tests pass.
    pair_dq: with ``deterministic`` False (one dq tile per warpgroup, not
      ``share_dq``) and the overlapped order, issue dq = ds k before dk +=
      dsT q and send dq's tile while dk's matmul runs, as FlashAttention-3's
      backward does, instead of a separate matmul and wait after dk's
      (``_dq_product``). GPU path only (interpret mode runs the unpaired
      order, as for ``overlap_matmuls``). Its GPU tests and racecheck passed
      on an H200 (tenth session); 3-7% faster than the unpaired order on
      three of four head_dim 64 shapes, 1% slower on one: the heuristic takes
      it for deterministic=False at head_dim 64.
    compute_registers, producer_registers: registers per thread (setmaxnreg)
      of each compute warpgroup and of the producer when there are two
      compute warpgroups; 128 * (2 * compute + producer) <= 65536.
    num_stages_dkv: the dk/dv kernel's own ring depth (0, the default: the
      same as ``num_stages``). A slot of its q / do ring is half a slot of
      the dq kernel's K/V ring at head_dim 128 (the kernel takes 130 KiB of
      227 with two slots), so it has room for more slots than the dq kernel.
      On an H200 (thirteenth session, docs/benchmarks/h200/2026-12-02-s13/
      tune.md) 3 and 4 slots were slower or even on 8 shapes (head_dim 64,
      128): the kernel is not waiting on its loads. Kept as an A/B knob.
    role_split: the dk/dv kernel's two compute warpgroups share one tile of
      ``block_kv_dkv`` keys and split the work by role instead of by keys:
      warpgroup 0 forms sT = k q^T, pT and dv += pT do; warpgroup 1 forms
      dpT = v do^T, dsT = pT (dpT - delta) and dk += dsT q, with pT (times
      1 - tanh^2 under a soft cap) handed over in float32 through shared
      memory, one tile per ring slot. Each warpgroup holds one float32
      (block_kv_dkv, D) accumulator, so head_dim 256 computes dk and dv in
      one launch (4 matmuls per tile pair) where ``split_dkv`` launches the
      kernel twice (5 matmuls, q and do read twice). Needs compute_wgs_dkv 2,
      deterministic, split_dkv off. The role split has its own matmul order:
      ``fuse_matmuls`` does not apply to it, and ``overlap_matmuls`` only to
      the dq kernel. The head_dim 256 default: on an H200
      (fifteenth session, docs/benchmarks/h200/2026-12-02-s15/README.md,
      bfloat16, T 4096 and 16384, causal and not) the backward ran at 419-446
      TFLOP/s against split_dkv's 324-365 (the dk/dv kernel 3.4 ms against
      5.0 at T = 16384 causal), 1.10-1.22 of cuDNN's (0.86-0.96 before). At
      head_dim 64 and 128, where a warpgroup holds both accumulators, it took
      23-31% longer than
      the default (a CTA covers half as many keys, so q and do stream twice
      as often per key).
  """

  block_q_dq: int = 64
  block_kv_dq: int = 128
  compute_wgs_dq: int = 2
  block_kv_dkv: int = 64
  block_q_dkv: int = 64
  compute_wgs_dkv: int = 2
  num_stages: int = 2
  split_dkv: bool = False
  fuse_matmuls: bool = False
  reverse_q_tiles: bool = False
  deterministic: bool = True
  share_dq: bool = False
  overlap_matmuls: bool = True
  exp2_fma_cols: int = 0
  pair_dq: bool = False
  compute_registers: int = 232
  producer_registers: int = 40
  num_stages_dkv: int = 0
  role_split: bool = False

  @property
  def stages_dkv(self) -> int:
    """The dk/dv kernel's ring depth: ``num_stages_dkv``, or ``num_stages`` when 0."""
    return self.num_stages_dkv or self.num_stages

  def __post_init__(self):
    check_multiple("num_stages_dkv", self.num_stages_dkv, 1, 0, 8)
    for name in ("block_q_dq", "block_kv_dq", "block_kv_dkv", "block_q_dkv"):
      check_multiple(name, getattr(self, name), 64, 64, 256)
    check_multiple("compute_wgs_dq", self.compute_wgs_dq, 1, 1, 2)
    check_multiple("compute_wgs_dkv", self.compute_wgs_dkv, 1, 1, 2)
    check_multiple("num_stages", self.num_stages, 1, 1, 8)
    check_registers(self.compute_registers, self.producer_registers)
    check_multiple("exp2_fma_cols", self.exp2_fma_cols, 16, 0,
                   min(self.block_kv_dq, self.block_q_dkv))
    for name in ("split_dkv", "fuse_matmuls", "reverse_q_tiles", "deterministic",
                 "share_dq", "overlap_matmuls", "pair_dq", "role_split"):
      check_bool(name, getattr(self, name))
    if self.role_split and (self.compute_wgs_dkv != 2 or not self.deterministic
                            or self.split_dkv):
      raise ValueError(
          f"role_split=True needs compute_wgs_dkv=2, deterministic=True and "
          f"split_dkv=False; got compute_wgs_dkv={self.compute_wgs_dkv}, "
          f"deterministic={self.deterministic}, split_dkv={self.split_dkv}")
    if self.pair_dq and (self.deterministic or self.share_dq or not self.overlap_matmuls):
      raise ValueError(
          f"pair_dq=True needs deterministic=False, share_dq=False and "
          f"overlap_matmuls=True; got deterministic={self.deterministic}, "
          f"share_dq={self.share_dq}, overlap_matmuls={self.overlap_matmuls}")
    if self.share_dq and (self.deterministic or self.compute_wgs_dkv != 2):
      raise ValueError(
          f"share_dq=True needs deterministic=False and compute_wgs_dkv=2 (two "
          f"warpgroups that share dq); got deterministic={self.deterministic}, "
          f"compute_wgs_dkv={self.compute_wgs_dkv}")
    if not self.deterministic and (self.split_dkv or self.block_q_dkv != 64):
      raise ValueError(
          f"deterministic=False needs split_dkv=False and block_q_dkv=64 (one "
          f"float32 (64, D) dq tile per warpgroup); got split_dkv={self.split_dkv}, "
          f"block_q_dkv={self.block_q_dkv}")

  def smem_bytes(self, head_dim: int, itemsize: int = 2,
                 interpret: bool = False) -> tuple[int, int]:
    """Shared memory per CTA of (the dq kernel, the dk/dv kernel), in bytes."""
    w, s = self.compute_wgs_dq, self.num_stages
    bq, bk = self.block_q_dq, self.block_kv_dq
    dq = w * (2 * bq * head_dim * itemsize + 2 * bq * 4)  # q, do, lse, delta
    dq += s * 2 * bk * head_dim * itemsize  # K, V ring
    if interpret:
      dq += w * bq * bk * itemsize  # ds staging
    w, s = self.compute_wgs_dkv, self.stages_dkv
    bq, bk = self.block_q_dkv, self.block_kv_dkv
    # K, V (reused for dk, dv): one tile per warpgroup, one in all with roles.
    dkv = (1 if self.role_split else w) * 2 * bk * head_dim * itemsize
    dkv += s * (2 * bq * head_dim * itemsize + 2 * bq * 4)  # q, do, lse, delta
    if self.role_split:
      dkv += s * bk * bq * 4  # pT handed from warpgroup 0 to 1, per slot
    if interpret:
      dkv += w * bk * bq * itemsize  # pT / dsT staging
    if self.share_dq:  # dsT double-buffered, each warpgroup's half dq tile
      dkv += 2 * w * bk * bq * itemsize + bq * head_dim * 4
    elif not self.deterministic:
      dkv += w * (bk * bq * itemsize + bq * head_dim * 4)  # dsT, float32 dq tile
    return (dq + _SMEM_RESERVED_BYTES, dkv + _SMEM_RESERVED_BYTES)

  def check_fits(self, head_dim: int, itemsize: int = 2,
                 interpret: bool = False) -> None:
    """Raises ValueError if either kernel needs more than 227 KiB of smem, or
    for ``share_dq`` with a head_dim that does not split into two halves of
    whole 64-column tiles."""
    if self.share_dq and head_dim % 128:
      raise ValueError(f"share_dq=True needs head_dim a multiple of 128; got "
                       f"head_dim={head_dim}")
    for kernel, need in zip(("dq", "dk/dv"),
                            self.smem_bytes(head_dim, itemsize, interpret)):
      if need > SMEM_LIMIT_BYTES:
        raise ValueError(
            f"{self} needs {need} bytes of shared memory in the {kernel} kernel "
            f"at head_dim={head_dim}; at most {SMEM_LIMIT_BYTES} are allowed")

  @classmethod
  def heuristic(cls, head_dim: int, q_len: int, kv_len: int,
                mask: MaskSpec | None = None, *,
                interpret: bool = False,
                deterministic: bool = True,
                packed: bool = False) -> "BackwardConfig":
    """A config that fits shared memory for head_dim (and interpret mode's staging).

    From a sweep on an H200 (scripts/tune.py, 2026-11-30, bfloat16, T 4096
    and 16384, against cuDNN in the same run): causal masks launch the dq
    kernel's longest query tiles first (2-5% faster). ``deterministic=False``
    allows the single-kernel backward, taken where it was faster: head_dim
    64 (2-13% on three of four shapes, docs/benchmarks/h200/2026-12-01-s4/
    tune.md), in FlashAttention-3's order (``pair_dq``: 3-7% more on three
    of four shapes, 1% less on one; tenth session, docs/benchmarks/h200/
    2026-12-01-s10/tune.md). At head_dim 128 the two deterministic kernels
    run either way: in the same session's sweep the single kernel ran at
    0.61-0.73 of cuDNN, the two kernels at 0.85-0.98, and in its benchmark
    the ``share_dq`` form at 0.70-0.79 against 0.93-0.95 (the sixth
    session's 1-6% win of ``share_dq`` did not survive the later gains of
    the two-kernel path). Not
    below 64: the backward runs D as given (the forward pads it) and the
    single kernel's dq tile does not lower for D < 64. A short window (at
    most 2048 keys per 128 queries) takes 64-key tiles in the dq kernel,
    less work outside the window: 12% faster for a causal window of 1024 at
    T=16384, D=128 (sweep of 2026-12-01, fifth session,
    docs/benchmarks/h200/2026-12-01-s5/tune.md). ``packed`` (segment ids
    given) with a causal mask: 64-key dq tiles and, at head_dim 64, 64-query
    dk/dv tiles, so less of each tile lies past a document's diagonal: with 8
    causal documents per row (eleventh session, docs/benchmarks/h200/
    2026-12-02-s11/tune.md) D=64 T=16384 ran 274 TFLOP/s against the old
    default's 239 (tenth session; 241 with 64-key dq tiles alone), D=128 376
    against 354 at T=16384 and 201 against 173 at T=4096. Packed rows without
    causal keep the other defaults (D=128 ran even either way).
    """
    del q_len  # Same choice for all query lengths today.
    causal = bool(mask is not None and mask.causal)
    span = None if mask is None else window_key_span(mask, kv_len)
    short_window = span is not None and span <= 2048
    if head_dim <= 64:
      config = cls(block_kv_dq=64 if short_window else 128, block_q_dkv=128,
                   num_stages=2)
    elif head_dim <= 128:
      config = cls(block_kv_dq=64 if short_window else 128, block_q_dkv=64,
                   num_stages=2)
    else:
      # Two float32 (64, 256) accumulators do not fit one warpgroup's
      # registers: the dk/dv kernel's warpgroups hold one each (role_split;
      # fifteenth session: 1.10-1.22 of cuDNN's backward at T 4096 and 16384,
      # against 0.86-0.96 with the dk and dv launches of split_dkv; head dims
      # between 128 and 256 follow, D = 160 and 192 timed in the sixteenth).
      # The dq kernel takes two compute warpgroups where their q/do tiles and
      # a two-slot ring fit (up to D = 200): at D = 160 and 192 its time fell
      # 25-37% and the backward went from 1.15-1.49 to 1.33-1.76 of cuDNN's
      # (sixteenth session, docs/benchmarks/h200/2026-12-02-s16/README.md).
      # At D = 256 only one fits with two slots (one slot was 76% slower).
      config = cls(block_kv_dq=64, compute_wgs_dq=2, block_q_dkv=64,
                   compute_wgs_dkv=2, num_stages=2, role_split=True)
      if config.smem_bytes(head_dim, 2, interpret=interpret)[0] > SMEM_LIMIT_BYTES:
        config = dataclasses.replace(config, compute_wgs_dq=1)
    config = dataclasses.replace(config, reverse_q_tiles=causal)
    if packed and causal and head_dim <= 128:
      config = dataclasses.replace(config, block_kv_dq=64, block_q_dkv=64)
    if not deterministic and head_dim == 64:
      config = dataclasses.replace(config, block_q_dkv=64, deterministic=False,
                                   pair_dq=True)
    # Interpret mode stages register operands in smem too: shallower rings,
    # each kernel's on its own (the dk/dv kernel's with role_split at D=256).
    fits = lambda i: config.smem_bytes(head_dim, 2, interpret=interpret)[i] <= SMEM_LIMIT_BYTES
    while not fits(1) and config.stages_dkv > 1:
      config = dataclasses.replace(config, num_stages_dkv=config.stages_dkv - 1)
    while not fits(0) and config.num_stages > 1:
      config = dataclasses.replace(config, num_stages=config.num_stages - 1)
    config.check_fits(head_dim, 2, interpret=interpret)
    return config


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


# ---------------------------------------------------------------------------
# Tile ranges. All arithmetic is on int32 scalars (traced or Python ints) and
# only on non-negative values where it divides, so lax.div is floor division.


def _div(x, m: int):
  return lax.div(x, jnp.int32(m))


def _cdiv(x, m: int):
  return lax.div(x + (m - 1), jnp.int32(m))


def _clamp(x, lo, hi):
  return jnp.minimum(jnp.maximum(x, lo), hi)


def _tile_plan(lo, hi, span_lo, span_hi, full_lo, full_hi, block: int):
  """Tiles of size ``block`` for one warpgroup's row range.

  Args:
    lo, hi: the warpgroup's own rows (already clipped to the length).
    span_lo, span_hi: the other axis' positions any of those rows may see.
    full_lo, full_hi: the positions all of those rows see.
  Returns:
    (nonempty, t_lo, a, b, t_hi): tiles [t_lo, t_hi) are visited; those in
    [a, b) need no elementwise mask.
  """
  span_hi = jnp.maximum(span_hi, 0)
  nonempty = (hi > lo) & (span_hi > span_lo)
  t_lo = _div(span_lo, block)
  t_hi = jnp.maximum(_cdiv(span_hi, block), t_lo)
  a = _clamp(_cdiv(full_lo, block), t_lo, t_hi)
  b = _clamp(_div(jnp.maximum(full_hi, 0), block), a, t_hi)
  return nonempty, t_lo, a, b, t_hi


def _union(plans):
  """The CTA's tile range: the union of its warpgroups' nonempty ranges."""
  big = jnp.int32(2**30)
  lo = functools.reduce(jnp.minimum, [jnp.where(p[0], p[1], big) for p in plans])
  hi = functools.reduce(jnp.maximum, [jnp.where(p[0], p[4], 0) for p in plans])
  lo = jnp.where(hi > lo, lo, 0)
  hi = jnp.maximum(hi, lo)
  return lo, hi


def _own_sections(plan, cta_lo, cta_hi):
  """[cta_lo, t_lo) drain, [t_lo, a) masked, [a, b) full, [b, t_hi) masked, [t_hi, cta_hi) drain."""
  nonempty, t_lo, a, b, t_hi = plan
  t_lo = jnp.where(nonempty, _clamp(t_lo, cta_lo, cta_hi), cta_lo)
  a = jnp.where(nonempty, _clamp(a, t_lo, cta_hi), t_lo)
  b = jnp.where(nonempty, _clamp(b, a, cta_hi), a)
  t_hi = jnp.where(nonempty, _clamp(t_hi, b, cta_hi), b)
  return t_lo, a, b, t_hi


def _limit_plan(plan, seg):
  """Intersects a tile plan with segment tile ranges ``[lo, hi, full_lo, full_hi)``."""
  nonempty, t_lo, a, b, t_hi = plan
  s_lo, s_hi, f_lo, f_hi = seg
  t_lo = jnp.maximum(t_lo, s_lo)
  t_hi = jnp.maximum(jnp.minimum(t_hi, s_hi), t_lo)
  nonempty = nonempty & (t_hi > t_lo)
  a = _clamp(jnp.maximum(a, f_lo), t_lo, t_hi)
  b = _clamp(jnp.minimum(b, f_hi), a, t_hi)
  return nonempty, t_lo, a, b, t_hi


def _probabilities(s, lse2, *, scale: float, softcap: float | None,
                   fma_cols: int = 0, guard: bool = True):
  """p = exp(scale s (soft-capped) - lse) via exp2, and tanh(scale s / c) or None.

  ``lse2`` is lse * log2(e), already broadcast to s's shape. The first
  ``fma_cols`` columns take exp2 on the FMA pipes (``exp2.split_exp2``;
  ``guard`` as there).
  """
  if softcap is None:
    x = s * (scale * common.LOG2_E) - lse2
    return exp2.split_exp2(x, fma_cols, guard=guard), None
  th = jnp.tanh(s * (scale / softcap))
  x = th * (softcap * common.LOG2_E) - lse2
  return exp2.split_exp2(x, fma_cols, guard=guard), th


def _score_like(shape, softcap):
  """Initial values shaped like ``_probabilities``' results (run_state outputs)."""
  zeros = lambda: plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
  return zeros(), (None if softcap is None else zeros())


def _through_softcap(ds, th):
  """d/ds of c tanh(s / c) is 1 - tanh^2: the chain rule through the soft cap."""
  return ds if th is None else ds * (1.0 - th * th)


def _split_extras(refs, has_lengths: bool, has_segments: bool, b):
  """(q_len, kv_len) scalars (or None) and the segment refs (or None) of one batch row."""
  refs = list(refs)
  lens = None
  if has_lengths:
    # Per-batch scalars: scalar loads from global memory, kept in registers.
    q_len_ref, kv_len_ref = refs.pop(0), refs.pop(0)
    lens = (q_len_ref[b], kv_len_ref[b])
  return lens, (tuple(refs) if has_segments else None)


def _set_registers(num_compute_wgs: int, compute: bool, config) -> None:
  # setmaxnreg: 64K registers shared by the compute warpgroups and the producer.
  if num_compute_wgs == 2:
    plgpu.set_max_registers(
        config.compute_registers if compute else config.producer_registers,
        action="increase" if compute else "decrease")


def _drain_loop(lo, hi, slot_of, ready_barriers, consumed, then=None):
  """Wait for tiles this warpgroup skips and release them: every waiter sees
  every phase. ``then(step)``, if given, runs after each release."""
  def body(step, carry):
    slot = slot_of(step)
    for barrier in ready_barriers:
      plgpu.barrier_wait(barrier.at[slot])
    plgpu.barrier_arrive(consumed.at[slot])
    if then is not None:
      then(step)
    return carry
  lax.fori_loop(lo, hi, body, None)


# ---------------------------------------------------------------------------
# The dq kernel.


def _dq_call(q, k, v, do, lse2, delta, *, q_len, kv_len, scale, mask, config,
             interpret, lengths=None, segments=None, softcap=None):
  """dq in the input dtype; q_len, kv_len are the true (buffer) lengths.

  ``lengths``: None or (q_len, kv_len) (B,) int32 per-batch valid lengths.
  ``segments``: None or (q_ids, kv_ids, ranges): ids padded to whole tiles and
  the (B, query tiles, 4) key tile ranges of ``_segment_tile_ranges``.
  """
  batch, _, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  group = num_heads // num_kv_heads
  dtype = q.dtype
  wgs, stages = config.compute_wgs_dq, config.num_stages
  bq, bk = config.block_q_dq, config.block_kv_dq
  staged = not common.uses_register_operands(interpret)
  overlap = config.overlap_matmuls and not staged
  num_q_tiles = pl.cdiv(q_len, wgs * bq)
  extra = ((*lengths,) if lengths is not None else ()) + (
      (*segments,) if segments is not None else ())

  def dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest):
    extra_refs, rest = rest[:len(extra)], rest[len(extra):]
    (dq_ref, q_smem2, do_smem2, lse_smem2, delta_smem2, k_ring, v_ring,
     staging2, q_bars, do_bars, lse_bars, delta_bars,
     k_bars, v_bars, consumed) = rest
    b = lax.axis_index(common.BATCH_AXIS)
    lens, seg_refs = _split_extras(extra_refs, lengths is not None,
                                   segments is not None, b)
    ql, kl = (q_len, kv_len) if lens is None else lens
    shift = mask.shift(ql, kl)

    def plan_of(q_lo):
      q_hi = jnp.minimum(q_lo + bq, ql)
      k_lo, k_hi = mask.key_range(q_lo, q_hi, shift, kl)
      f_lo, f_hi = mask.full_key_range(q_lo, q_hi, shift, kl)
      plan = _tile_plan(q_lo, q_hi, k_lo, k_hi, f_lo, f_hi, bk)
      if seg_refs is not None:
        tile = lax.div(q_lo, jnp.int32(bq))
        plan = _limit_plan(plan, [seg_refs[2][b, tile, i] for i in range(4)])
      return plan

    h = lax.axis_index(common.HEADS_AXIS)
    wg = lax.axis_index(common.WG_AXIS)
    kv_head = lax.div(h, jnp.int32(group))
    cta_q_lo = common.grid_index(common.Q_TILES_AXIS, num_q_tiles,
                                 config.reverse_q_tiles) * (wgs * bq)
    cta_lo, cta_hi = _union([plan_of(cta_q_lo + w * bq) for w in range(wgs)])
    num_steps = cta_hi - cta_lo
    slot_of = lambda t: lax.rem(t - cta_lo, jnp.int32(stages))

    @pl.when(wg < wgs)
    def _compute():
      _set_registers(wgs, compute=True, config=config)
      q_lo = cta_q_lo + wg * bq
      q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
      lse_smem, delta_smem = lse_smem2.at[wg], delta_smem2.at[wg]
      staging = staging2.at[wg] if staged else None
      rows = (b, pl.ds(q_lo, bq), h)
      plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, q_bars.at[wg])
      plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem, do_bars.at[wg])
      vec = (b, h, pl.ds(q_lo, bq))
      plgpu.copy_gmem_to_smem(lse_ref.at[vec], lse_smem, lse_bars.at[wg])
      plgpu.copy_gmem_to_smem(delta_ref.at[vec], delta_smem, delta_bars.at[wg])
      for bars in (q_bars, do_bars, lse_bars, delta_bars):
        plgpu.barrier_wait(bars.at[wg])
      row = plgpu.Layout.WGMMA.reduce(1)
      lse2_row = plgpu.load(lse_smem, layout=row)
      delta_row = plgpu.load(delta_smem, layout=row)
      t_lo, a, b_full, t_hi = _own_sections(plan_of(q_lo), cta_lo, cta_hi)
      if seg_refs is not None:  # This warpgroup's query ids, one per row.
        q_seg = plgpu.load(seg_refs[0].at[b, pl.ds(q_lo, bq)], layout=row,
                           optimized=False)

      def step(t, dq, masked: bool):
        slot = slot_of(t)
        k_smem, v_smem = k_ring.at[slot], v_ring.at[slot]
        plgpu.barrier_wait(k_bars.at[slot])
        shape = (bq, bk)
        keep = None
        if masked:
          q_ids = q_lo + plgpu.broadcasted_iota(jnp.int32, shape, 0,
                                                layout=plgpu.Layout.WGMMA)
          k_ids = t * bk + plgpu.broadcasted_iota(jnp.int32, shape, 1,
                                                  layout=plgpu.Layout.WGMMA)
          keep = mask.visible(q_ids, k_ids, shift) & (k_ids < kl)
          if lens is not None:
            keep = keep & (q_ids < ql)
          if seg_refs is not None:
            k_seg = plgpu.load(seg_refs[1].at[b, pl.ds(t * bk, bk)],
                               layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
            keep = keep & (lax.broadcast_in_dim(q_seg, shape, [0])
                           == lax.broadcast_in_dim(k_seg, shape, [1]))

        def probabilities(s):
          p, th = _probabilities(s, lax.broadcast_in_dim(lse2_row, shape, [0]),
                                 scale=scale, softcap=softcap,
                                 fma_cols=config.exp2_fma_cols, guard=staged)
          return (p if keep is None else jnp.where(keep, p, 0.0)), th

        if overlap:  # GPU: s and dp issued together, p formed while dp runs.
          plgpu.barrier_wait(v_bars.at[slot])
          (p, th), dp = common.matmul_pair_first_then(
              (q_smem, k_smem.transpose((1, 0)), shape),
              (do_smem, v_smem.transpose((1, 0)), shape), probabilities,
              _score_like(shape, softcap))
        else:
          p, th = probabilities(common.matmul_smem(
              q_smem, k_smem.transpose((1, 0)), shape))
          plgpu.barrier_wait(v_bars.at[slot])
          dp = common.matmul_smem(do_smem, v_smem.transpose((1, 0)), shape)
        ds = _through_softcap(
            p * (dp - lax.broadcast_in_dim(delta_row, dp.shape, [0])), th)
        if masked:  # Select, so NaN/inf in masked V rows cannot leak.
          ds = jnp.where(keep, ds, 0.0)
        dq = common.accumulate_register_lhs(dq, ds.astype(dtype), k_smem,
                                            staging=staging)
        plgpu.barrier_arrive(consumed.at[slot])
        return dq

      dq = plgpu.layout_cast(jnp.zeros((bq, head_dim), jnp.float32),
                             plgpu.Layout.WGMMA)
      _drain_loop(cta_lo, t_lo, slot_of, (k_bars, v_bars), consumed)
      dq = lax.fori_loop(t_lo, a, functools.partial(step, masked=True), dq)
      dq = lax.fori_loop(a, b_full, functools.partial(step, masked=False), dq)
      dq = lax.fori_loop(b_full, t_hi, functools.partial(step, masked=True), dq)
      _drain_loop(t_hi, cta_hi, slot_of, (k_bars, v_bars), consumed)
      dq = dq * scale
      if lens is not None:  # Rows past q_len: exactly 0 (selected).
        q_row = q_lo + plgpu.broadcasted_iota(jnp.int32, dq.shape, 0,
                                              layout=plgpu.Layout.WGMMA)
        dq = jnp.where(q_row < ql, dq, 0.0)
      q_smem[...] = dq.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
      common.wait_final_stores()

    @pl.when(wg == wgs)
    def _producer():
      _set_registers(wgs, compute=False, config=config)

      def load(t):
        slot = slot_of(t)
        keys = (b, pl.ds(t * bk, bk), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[keys], k_ring.at[slot], k_bars.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[keys], v_ring.at[slot], v_bars.at[slot])

      for i in range(stages):
        pl.when(i < num_steps)(lambda i=i: load(cta_lo + i))

      def refill(t, carry):
        plgpu.barrier_wait(consumed.at[slot_of(t)])
        load(t)
        return carry
      lax.fori_loop(cta_lo + stages, cta_hi, refill, None)
      # Observe the last phases too: the interpreter checks it; nothing on the
      # GPU needs it (``common.DRAIN_BARRIERS`` turns it off there, to time it).
      if common.drains_barriers(interpret):
        def drain(t, carry):
          plgpu.barrier_wait(consumed.at[slot_of(t)])
          return carry
        lax.fori_loop(jnp.maximum(cta_hi - stages, cta_lo), cta_hi, drain, None)

  swizzle = common.smem_swizzle_transforms(head_dim, dtype.itemsize)
  tile = lambda *shape: plgpu.SMEM(shape, dtype, transforms=swizzle)
  staging = (plgpu.SMEM((wgs, bq, bk), dtype,
                        transforms=common.smem_swizzle_transforms(bk, dtype.itemsize))
             if staged else None)
  scratch = [
      tile(wgs, bq, head_dim), tile(wgs, bq, head_dim),
      plgpu.SMEM((wgs, bq), jnp.float32), plgpu.SMEM((wgs, bq), jnp.float32),
      tile(stages, bk, head_dim), tile(stages, bk, head_dim),
      staging,
      plgpu.Barrier(num_barriers=wgs), plgpu.Barrier(num_barriers=wgs),
      plgpu.Barrier(num_barriers=wgs), plgpu.Barrier(num_barriers=wgs),
      plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
  ]
  return plgpu.kernel(
      dq_kernel,
      out_type=jax.ShapeDtypeStruct(q.shape, dtype),
      scratch_types=scratch,
      grid=(num_heads, num_q_tiles, batch),
      grid_names=(common.HEADS_AXIS, common.Q_TILES_AXIS, common.BATCH_AXIS),
      num_threads=wgs + 1,
      thread_name=common.WG_AXIS,
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=common.interpret_params(interpret),
  )(q, k, v, do, lse2, delta, *extra)


# ---------------------------------------------------------------------------
# The dk/dv kernel.


def _dkv_call(q, k, v, do, lse2, delta, *, q_len, kv_len, scale, mask, config,
              interpret, outputs: tuple[str, ...], release_early: bool = False,
              lengths=None, segments=None, softcap=None, dq_mode=None):
  """Returns dk and/or dv (``outputs`` names which) in the input dtype.

  ``dq_mode`` (``BackwardConfig.deterministic`` False): also returns the
  unscaled float32 sum of ds @ k over all keys, (B, Tq buffer, N, D): "atomic"
  adds each tile's part into one zeroed float32 array with TMA reduce-add
  stores (GPU); "partials" stores each warpgroup's part (each CTA's, with
  ``config.share_dq``) into its own slice of a zeroed (B, kv tiles *
  warpgroups, Tq, N, D) and sums those in XLA (interpret mode, whose TMA has
  no reduce-add).

  q_len, kv_len are the true lengths; the arrays may be longer (padded).
  ``lengths``, ``segments`` as in ``_dq_call``, the segment ranges here being
  per key tile of ``block_kv_dkv`` rows: the query tiles it may see.
  ``release_early`` is for tests only: it releases each streamed slot before
  its last read (the delta load), a deliberate race that race detection in
  interpret mode must report.
  """
  batch, _, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  group = num_heads // num_kv_heads
  dtype = q.dtype
  wgs, stages = config.compute_wgs_dkv, config.stages_dkv
  bq, bk = config.block_q_dkv, config.block_kv_dkv
  staged = not common.uses_register_operands(interpret)
  roles = config.role_split
  if roles and (dq_mode is not None or set(outputs) != {"dk", "dv"}):
    raise ValueError(
        f"role_split computes dk and dv together without dq: outputs={outputs!r} "
        f"must be ('dk', 'dv') and dq_mode={dq_mode!r} None")
  # Keys per CTA: a tile per warpgroup, or one tile both share (role_split).
  cta_keys = bk if roles else wgs * bk
  num_kv_tiles = pl.cdiv(kv_len, cta_keys)
  want_dk, want_dv = "dk" in outputs, "dv" in outputs
  overlap = config.overlap_matmuls and not staged and want_dk and want_dv
  # config.pair_dq (validated: deterministic=False without share_dq, so
  # dq_mode is set): dq's product is issued beside dk's.
  pair = overlap and config.pair_dq
  # config.share_dq: warpgroup w forms columns [w * half, (w + 1) * half) of
  # each query tile's dq from every warpgroup's dsT (double-buffered by step
  # parity in ds_smem2[parity * wgs + warpgroup]).
  share = dq_mode is not None and config.share_dq
  half = head_dim // wgs if share else head_dim
  extra = ((*lengths,) if lengths is not None else ()) + (
      (*segments,) if segments is not None else ())
  # dq's float32 accumulator: a zeroed mutable array the kernel closes over
  # (Pallas passes it in and aliases it to an output), made inside ``run``
  # below so it is a traced value under jit. "atomic": every CTA adds into one
  # (B, Tq, N, D); "partials": each warpgroup writes its own slice of
  # (B, kv tiles * warpgroups, Tq, N, D) (tiles it skips stay 0).
  dq_refs = {}

  def dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest):
    extra_refs, rest = rest[:len(extra)], rest[len(extra):]
    out_refs, rest = rest[:len(outputs)], rest[len(outputs):]
    (k_smem2, v_smem2, q_ring, do_ring, lse_ring, delta_ring, staging2,
     ds_smem2, dq_stage2, p_ring,
     k_bars, v_bars, q_bars, do_bars, lse_bars, delta_bars, consumed,
     ds_ready, all_done, p_ready) = rest
    b = lax.axis_index(common.BATCH_AXIS)
    lens, seg_refs = _split_extras(extra_refs, lengths is not None,
                                   segments is not None, b)
    ql, kl = (q_len, kv_len) if lens is None else lens
    shift = mask.shift(ql, kl)

    def plan_of(k_lo):
      k_hi = jnp.minimum(k_lo + bk, kl)
      q_lo, q_hi = mask.query_range(k_lo, k_hi, shift, ql)
      f_lo, f_hi = mask.full_query_range(k_lo, k_hi, shift, ql)
      plan = _tile_plan(k_lo, k_hi, q_lo, q_hi, f_lo, f_hi, bq)
      if seg_refs is not None:
        tile = lax.div(k_lo, jnp.int32(bk))
        plan = _limit_plan(plan, [seg_refs[2][b, tile, i] for i in range(4)])
      return plan

    kv_head = lax.axis_index(common.HEADS_AXIS)
    wg = lax.axis_index(common.WG_AXIS)
    cta_k_lo = lax.axis_index(common.KV_TILES_AXIS) * cta_keys
    cta_lo, cta_hi = _union([plan_of(cta_k_lo + w * bk)
                             for w in range(1 if roles else wgs)])
    tiles_per_head = cta_hi - cta_lo
    # Step i walks query head (i // tiles_per_head) of the group, query tile
    # cta_lo + i % tiles_per_head; all heads see the same tiles.
    num_steps = group * tiles_per_head
    slot_of = lambda i: lax.rem(i, jnp.int32(stages))

    def keep_of(t, k_lo, k_seg):
      """Which (key, query) pairs of key tile k_lo, query tile t are visible."""
      shape = (bk, bq)
      k_ids = k_lo + plgpu.broadcasted_iota(jnp.int32, shape, 0,
                                            layout=plgpu.Layout.WGMMA)
      q_ids = t * bq + plgpu.broadcasted_iota(jnp.int32, shape, 1,
                                              layout=plgpu.Layout.WGMMA)
      keep = mask.visible(q_ids, k_ids, shift) & (q_ids < ql) & (k_ids < kl)
      if seg_refs is not None:
        q_seg = plgpu.load(seg_refs[0].at[b, pl.ds(t * bq, bq)],
                           layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
        keep = keep & (lax.broadcast_in_dim(k_seg, shape, [0])
                       == lax.broadcast_in_dim(q_seg, shape, [1]))
      return keep

    def zero_past_kv_len(k_lo, *accs):
      """The accumulators of key tile k_lo (None passes through), rows past
      kv_len selected to exactly 0: a query tile that sees all of a tile's
      valid keys runs unmasked over the rest."""
      k_row = k_lo + plgpu.broadcasted_iota(jnp.int32, (bk, head_dim), 0,
                                            layout=plgpu.Layout.WGMMA)
      return tuple(None if x is None else jnp.where(k_row < kl, x, 0.0) for x in accs)

    def role_compute():
      """config.role_split: warpgroup 0 forms pT and dv, warpgroup 1 dpT, dsT
      and dk, on the same key tile. Warpgroup 0 hands pT (through the soft
      cap's 1 - tanh^2) over in p_ring[slot]; that tile is rewritten only
      once the slot is refilled, which waits for warpgroup 1's release."""
      k_lo = cta_k_lo
      k_smem, v_smem = k_smem2.at[0], v_smem2.at[0]
      staging = staging2.at[wg] if staged else None
      keys = (b, pl.ds(k_lo, bk), kv_head)
      col = plgpu.Layout.WGMMA.reduce(0)
      shape = (bk, bq)
      t_lo, a, b_full, t_hi = _own_sections(plan_of(k_lo), cta_lo, cta_hi)
      k_seg = None
      if seg_refs is not None:
        k_seg = plgpu.load(seg_refs[1].at[b, pl.ds(k_lo, bk)],
                           layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)

      def dv_step(t, dv, head_base, masked: bool):
        slot = slot_of(head_base + t - cta_lo)
        q_smem, do_smem = q_ring.at[slot], do_ring.at[slot]
        plgpu.barrier_wait(q_bars.at[slot])
        plgpu.barrier_wait(lse_bars.at[slot])
        sT = common.matmul_smem(k_smem, q_smem.transpose((1, 0)), shape)
        lse2_col = plgpu.load(lse_ring.at[slot], layout=col)
        pT, th = _probabilities(sT, lax.broadcast_in_dim(lse2_col, shape, [1]),
                                scale=scale, softcap=softcap,
                                fma_cols=config.exp2_fma_cols, guard=staged)
        if masked:
          pT = jnp.where(keep_of(t, k_lo, k_seg), pT, 0.0)
        p_ring.at[slot][...] = _through_softcap(pT, th)
        plgpu.commit_smem()
        plgpu.barrier_arrive(p_ready.at[slot])
        plgpu.barrier_wait(do_bars.at[slot])
        dv = common.accumulate_register_lhs(dv, pT.astype(dtype), do_smem,
                                            staging=staging)
        plgpu.barrier_arrive(consumed.at[slot])
        return dv

      def dk_step(t, dk, head_base, masked: bool):
        slot = slot_of(head_base + t - cta_lo)
        q_smem, do_smem = q_ring.at[slot], do_ring.at[slot]
        plgpu.barrier_wait(do_bars.at[slot])
        plgpu.barrier_wait(delta_bars.at[slot])
        dpT = common.matmul_smem(
            v_smem, do_smem.transpose((1, 0)), shape,
            while_running=lambda: plgpu.barrier_wait(p_ready.at[slot]))
        pT = plgpu.load(p_ring.at[slot], layout=plgpu.Layout.WGMMA)
        delta_col = plgpu.load(delta_ring.at[slot], layout=col)
        dsT = pT * (dpT - lax.broadcast_in_dim(delta_col, shape, [1]))
        if masked:  # Select, so NaN/inf in masked rows cannot leak.
          dsT = jnp.where(keep_of(t, k_lo, k_seg), dsT, 0.0)
        plgpu.barrier_wait(q_bars.at[slot])
        dk = common.accumulate_register_lhs(dk, dsT.astype(dtype), q_smem,
                                            staging=staging)
        plgpu.barrier_arrive(consumed.at[slot])
        return dk

      def walk(step, acc):
        def head(g, acc):
          base = g * tiles_per_head
          # Both warpgroups see the CTA's whole range: no tile to skip.
          for lo, hi, masked in ((t_lo, a, True), (a, b_full, False),
                                 (b_full, t_hi, True)):
            acc = lax.fori_loop(lo, hi, functools.partial(
                step, head_base=base, masked=masked), acc)
          return acc
        return lax.fori_loop(0, group, head, acc)

      zeros = plgpu.layout_cast(jnp.zeros((bk, head_dim), jnp.float32),
                                plgpu.Layout.WGMMA)
      for role, (step, tile, bars, out) in enumerate((
          (dv_step, k_smem, k_bars, "dv"), (dk_step, v_smem, v_bars, "dk"))):
        @pl.when(wg == role)
        def _():
          # Each warpgroup loads the one K or V tile it reads, and stages its
          # result there once its last matmul has read it.
          src = k_ref if role == 0 else v_ref
          plgpu.copy_gmem_to_smem(src.at[keys], tile, bars.at[0])
          plgpu.barrier_wait(bars.at[0])
          acc = walk(step, zeros)
          if out == "dk":
            acc = acc * scale
          if lens is not None:
            (acc,) = zero_past_kv_len(k_lo, acc)
          tile[...] = acc.astype(dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(tile, out_refs[outputs.index(out)].at[keys])
          common.wait_final_stores()

    @pl.when(wg < wgs)
    def _compute():
      _set_registers(wgs, compute=True, config=config)
      if roles:
        role_compute()
        return
      k_lo = cta_k_lo + wg * bk
      k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
      staging = staging2.at[wg] if staged else None
      keys = (b, pl.ds(k_lo, bk), kv_head)
      plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem, k_bars.at[wg])
      plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem, v_bars.at[wg])
      plgpu.barrier_wait(k_bars.at[wg])
      plgpu.barrier_wait(v_bars.at[wg])
      t_lo, a, b_full, t_hi = _own_sections(plan_of(k_lo), cta_lo, cta_hi)
      col = plgpu.Layout.WGMMA.reduce(0)
      ready = (q_bars, do_bars, lse_bars, delta_bars)
      k_seg = None
      if seg_refs is not None:  # This warpgroup's key ids, one per row.
        k_seg = plgpu.load(seg_refs[1].at[b, pl.ds(k_lo, bk)],
                           layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)

      def share_dq_tile(ds, i, rows):
        """Step i's dq for query rows ``rows``: this warpgroup's columns."""
        parity = lax.rem(i, jnp.int32(2))
        ds_smem2.at[parity * wgs + wg][...] = ds
        plgpu.commit_smem()
        # Both warpgroups wait for both dsT tiles. A warpgroup rewrites its
        # buffer of this parity two steps on, after the next step's wait,
        # which the other warpgroup passes only once its reads here are done.
        plgpu.barrier_arrive(ds_ready.at[parity])
        plgpu.barrier_wait(ds_ready.at[parity])
        for w in range(wgs):  # Static column slices: one branch per warpgroup.
          @pl.when(wg == w)
          def _():
            cols = pl.ds(w * half, half)
            part = common.matmul_smem_sum(
                [(ds_smem2.at[parity * wgs + u].transpose((1, 0)),
                  k_smem2.at[u].at[:, cols]) for u in range(wgs)], (bq, half))
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            dq_stage2.at[w][...] = part
            plgpu.commit_smem()
            bb, q_rows, h = rows
            if "atomic" in dq_refs:
              plgpu.copy_smem_to_gmem(dq_stage2.at[w],
                                      dq_refs["atomic"].at[bb, q_rows, h, cols],
                                      reduction_op="add")
            else:
              tile = lax.axis_index(common.KV_TILES_AXIS)
              plgpu.copy_smem_to_gmem(
                  dq_stage2.at[w], dq_refs["partials"].at[bb, tile, q_rows, h, cols])

      def step(t, carry, head_base, g, masked: bool):
        dk, dv = carry
        slot = slot_of(head_base + t - cta_lo)
        q_smem, do_smem = q_ring.at[slot], do_ring.at[slot]
        plgpu.barrier_wait(q_bars.at[slot])
        plgpu.barrier_wait(lse_bars.at[slot])
        shape = (bk, bq)
        keep = keep_of(t, k_lo, k_seg) if masked else None
        lse2_col = plgpu.load(lse_ring.at[slot], layout=col)

        def probabilities(sT):
          pT, th = _probabilities(sT, lax.broadcast_in_dim(lse2_col, shape, [1]),
                                  scale=scale, softcap=softcap,
                                  fma_cols=config.exp2_fma_cols, guard=staged)
          return (pT if keep is None else jnp.where(keep, pT, 0.0)), th

        dq_rows = lambda: (b, pl.ds(t * bq, bq), kv_head * group + g)

        def dq_sender():
          """Sends this warpgroup's float32 dq tile of step t (deterministic=False)."""
          rows = dq_rows()
          part_slot = lax.axis_index(common.KV_TILES_AXIS) * wgs + wg
          return lambda part: _store_dq_tile(
              part, dq_stage2.at[wg], rows, dq_acc=dq_refs.get("atomic"),
              dq_parts=dq_refs.get("partials"), slot=part_slot)

        def add_dq(ds16):
          """dq += ds k (deterministic=False); reads only k and dsT, so it
          runs after the slot's release."""
          if share:
            rows = dq_rows()
            share_dq_tile(ds16, head_base + t - cta_lo, rows)
          elif dq_mode is not None:
            send = dq_sender()
            send(_dq_product(ds16, ds_smem2.at[wg], k_smem))

        def ds_of(pT, dpT, th):
          delta_col = plgpu.load(delta_ring.at[slot], layout=col)
          dsT = _through_softcap(
              pT * (dpT - lax.broadcast_in_dim(delta_col, shape, [1])), th)
          # Select, so NaN/inf in masked rows cannot leak.
          return dsT if keep is None else jnp.where(keep, dsT, 0.0)

        if overlap:
          # GPU, FlashAttention-3's order: sT and dpT issued together, pT
          # formed while dpT runs; dv += pT do issued, dsT formed while it
          # runs, then dk += dsT q; the slot is read until the last wait.
          plgpu.barrier_wait(do_bars.at[slot])
          plgpu.barrier_wait(delta_bars.at[slot])
          (pT, th), dpT = common.matmul_pair_first_then(
              (k_smem, q_smem.transpose((1, 0)), shape),
              (v_smem, do_smem.transpose((1, 0)), shape), probabilities,
              _score_like(shape, softcap))
          make_ds = lambda: ds_of(pT, dpT, th).astype(dtype)
          if pair:
            # dq = ds k issued before dk += dsT q, and stored while dk runs.
            dv, dk, _ = common.accumulate_pair(
                dv, pT.astype(dtype), do_smem, dk, make_ds, q_smem,
                product=(ds_smem2.at[wg], k_smem, dq_sender()))
            plgpu.barrier_arrive(consumed.at[slot])
            return dk, dv
          dv, dk, dsT16 = common.accumulate_pair(
              dv, pT.astype(dtype), do_smem, dk, make_ds, q_smem)
          plgpu.barrier_arrive(consumed.at[slot])
          add_dq(dsT16)
          return dk, dv
        sT = common.matmul_smem(k_smem, q_smem.transpose((1, 0)), shape)
        pT, th = probabilities(sT)
        plgpu.barrier_wait(do_bars.at[slot])
        plgpu.barrier_wait(delta_bars.at[slot])
        fused = config.fuse_matmuls and want_dk and want_dv and not staged
        if fused:  # GPU path: dv += pT @ do and dpT = v @ do^T, one wait.
          def both(refs):
            plgpu.wgmma(refs[0], pT.astype(dtype), do_smem)
            plgpu.wgmma(refs[1], v_smem, do_smem.transpose((1, 0)))
          zeros_t = plgpu.layout_cast(jnp.zeros((bk, bq), jnp.float32),
                                      plgpu.Layout.WGMMA)
          dv, dpT = pl.run_state(both)((plgpu.ACC.init(dv), plgpu.ACC.init(zeros_t)))
        elif want_dv:
          dv = common.accumulate_register_lhs(dv, pT.astype(dtype), do_smem,
                                              staging=staging)
        if want_dk:
          if not fused:
            dpT = common.matmul_smem(v_smem, do_smem.transpose((1, 0)), (bk, bq))
          if release_early:
            plgpu.barrier_arrive(consumed.at[slot])
          dsT = ds_of(pT, dpT, th)
          dk = common.accumulate_register_lhs(dk, dsT.astype(dtype), q_smem,
                                              staging=staging)
        if not (release_early and want_dk):
          plgpu.barrier_arrive(consumed.at[slot])
        if dq_mode is not None:
          add_dq(dsT.astype(dtype))
        return dk, dv

      def skip(lo, hi, base, g):
        """Tiles this warpgroup's keys do not see: release their slots; with
        share_dq still take part in their dq with a zero dsT."""
        def zero_dq(t):
          zero = plgpu.layout_cast(jnp.zeros((bk, bq), dtype), plgpu.Layout.WGMMA)
          share_dq_tile(zero, base + t - cta_lo,
                        (b, pl.ds(t * bq, bq), kv_head * group + g))
        _drain_loop(lo, hi, lambda t: slot_of(base + t - cta_lo), ready, consumed,
                    then=zero_dq if share else None)

      def head(g, carry):
        base = g * tiles_per_head
        skip(cta_lo, t_lo, base, g)
        carry = lax.fori_loop(t_lo, a, functools.partial(
            step, head_base=base, g=g, masked=True), carry)
        carry = lax.fori_loop(a, b_full, functools.partial(
            step, head_base=base, g=g, masked=False), carry)
        carry = lax.fori_loop(b_full, t_hi, functools.partial(
            step, head_base=base, g=g, masked=True), carry)
        skip(t_hi, cta_hi, base, g)
        return carry

      zeros = lambda: plgpu.layout_cast(jnp.zeros((bk, head_dim), jnp.float32),
                                        plgpu.Layout.WGMMA)
      dk = zeros() if want_dk else None
      dv = zeros() if want_dv else None
      dk, dv = lax.fori_loop(0, group, head, (dk, dv))
      if share:  # The other warpgroup's last dq reads our K tile: wait for it.
        plgpu.barrier_arrive(all_done.at[0])
        plgpu.barrier_wait(all_done.at[0])
      # K and V are no longer read: reuse their tiles to stage the results.
      if dk is not None:
        dk = dk * scale
      if lens is not None:
        dk, dv = zero_past_kv_len(k_lo, dk, dv)
      results = {"dk": (k_smem, dk), "dv": (v_smem, dv)}
      for name in outputs:
        smem, value = results[name]
        smem[...] = value.astype(dtype)
      plgpu.commit_smem()
      for name, out_ref in zip(outputs, out_refs):
        plgpu.copy_smem_to_gmem(results[name][0], out_ref.at[keys])
      common.wait_final_stores()

    @pl.when(wg == wgs)
    def _producer():
      _set_registers(wgs, compute=False, config=config)

      def load(i):
        slot = slot_of(i)
        g = lax.div(i, jnp.maximum(tiles_per_head, 1))
        t = cta_lo + i - g * tiles_per_head
        h = kv_head * group + g
        rows = (b, pl.ds(t * bq, bq), h)
        vec = (b, h, pl.ds(t * bq, bq))
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_ring.at[slot], q_bars.at[slot])
        plgpu.copy_gmem_to_smem(lse_ref.at[vec], lse_ring.at[slot], lse_bars.at[slot])
        plgpu.copy_gmem_to_smem(do_ref.at[rows], do_ring.at[slot], do_bars.at[slot])
        plgpu.copy_gmem_to_smem(delta_ref.at[vec], delta_ring.at[slot],
                                delta_bars.at[slot])

      for i in range(stages):
        pl.when(i < num_steps)(lambda i=i: load(jnp.int32(i)))

      def refill(i, carry):
        plgpu.barrier_wait(consumed.at[slot_of(i)])
        load(i)
        return carry
      lax.fori_loop(jnp.int32(stages), num_steps, refill, None)

      if common.drains_barriers(interpret):  # As in the dq kernel.
        def drain(i, carry):
          plgpu.barrier_wait(consumed.at[slot_of(i)])
          return carry
        lax.fori_loop(jnp.maximum(num_steps - stages, 0), num_steps, drain, None)

  swizzle = common.smem_swizzle_transforms(head_dim, dtype.itemsize)
  tile = lambda *shape: plgpu.SMEM(shape, dtype, transforms=swizzle)
  staging = (plgpu.SMEM((wgs, bk, bq), dtype,
                        transforms=common.smem_swizzle_transforms(bq, dtype.itemsize))
             if staged else None)
  with_dq = dq_mode is not None
  kv_tiles = 1 if roles else wgs
  scratch = [
      tile(kv_tiles, bk, head_dim), tile(kv_tiles, bk, head_dim),
      tile(stages, bq, head_dim), tile(stages, bq, head_dim),
      plgpu.SMEM((stages, bq), jnp.float32), plgpu.SMEM((stages, bq), jnp.float32),
      staging,
      # dsT, the left operand (transposed) of dq += ds @ k, and the float32
      # dq tile a TMA store reads.
      plgpu.SMEM(((2 if share else 1) * wgs, bk, bq), dtype,
                 transforms=common.smem_swizzle_transforms(bq, dtype.itemsize))
      if with_dq else None,
      plgpu.SMEM((wgs, bq, half), jnp.float32) if with_dq else None,
      # role_split: pT from warpgroup 0 to warpgroup 1, one tile per slot.
      plgpu.SMEM((stages, bk, bq), jnp.float32,
                 transforms=common.smem_swizzle_transforms(bq, 4)) if roles else None,
      plgpu.Barrier(num_barriers=wgs), plgpu.Barrier(num_barriers=wgs),
      plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
      # share_dq: both dsT tiles of a step written (per parity); all dq done.
      plgpu.Barrier(num_arrivals=wgs, num_barriers=2) if share else None,
      plgpu.Barrier(num_arrivals=wgs, num_barriers=1) if share else None,
      plgpu.Barrier(num_barriers=stages) if roles else None,
  ]
  out_type = [jax.ShapeDtypeStruct(k.shape, dtype) for _ in outputs]
  call = plgpu.kernel(
      dkv_kernel,
      out_type=out_type,
      scratch_types=scratch,
      grid=(num_kv_heads, num_kv_tiles, batch),
      grid_names=(common.HEADS_AXIS, common.KV_TILES_AXIS, common.BATCH_AXIS),
      num_threads=wgs + 1,
      thread_name=common.WG_AXIS,
      # role_split at head_dim 256 fills shared memory to within a KiB; it
      # has no cross-warp reductions, so it needs no reduction scratch.
      compiler_params=plgpu.CompilerParams(
          approx_math=True, **({"reduction_scratch_bytes": 0} if roles else {})),
      interpret=common.interpret_params(interpret),
  )
  if dq_mode is None:
    return call(q, k, v, do, lse2, delta, *extra)

  def run(*args):
    rows = (batch, q.shape[1], num_heads, head_dim)
    if dq_mode == "partials":  # One slice per warpgroup, or per CTA if shared.
      rows = (batch, num_kv_tiles * (1 if share else wgs)) + rows[1:]
    dq_refs[dq_mode] = jax.new_ref(jnp.zeros(rows, jnp.float32))
    results = call(*args)
    dq = dq_refs.pop(dq_mode)[...]
    return (*results, dq if dq_mode == "atomic" else dq.sum(axis=1))
  return jax.jit(run)(q, k, v, do, lse2, delta, *extra)


def _dq_product(ds, ds_smem, k_smem):
  """ds^T @ k for one (key tile, query tile) pair, float32 (queries x D).

  ``ds`` is dsT (keys x queries) in registers; it goes through shared memory
  to be the transposed left operand. ``_store_dq_tile`` sends the result.
  """
  ds_smem[...] = ds
  plgpu.commit_smem()
  return common.matmul_smem(ds_smem.transpose((1, 0)), k_smem,
                            (ds.shape[1], k_smem.shape[1]))


def _store_dq_tile(part, dq_stage, rows, *, dq_acc, dq_parts, slot):
  """Sends one float32 dq tile ``part`` (query rows x D) by TMA through
  ``dq_stage``: a reduce-add into ``dq_acc`` (GPU), or a plain store into
  slice ``slot`` of ``dq_parts`` (interpret mode). The previous tile's store
  must have read ``dq_stage`` first."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  dq_stage[...] = part
  plgpu.commit_smem()
  if dq_acc is not None:
    plgpu.copy_smem_to_gmem(dq_stage, dq_acc.at[rows], reduction_op="add")
  else:
    b, q_rows, h = rows
    plgpu.copy_smem_to_gmem(dq_stage, dq_parts.at[b, slot, q_rows, h])


# ---------------------------------------------------------------------------
# Entry point.


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def backward_residuals(o, lse, do, pad_to: int, delta=None):
  """lse * log2(e) (+inf where lse = -inf) and delta = rowsum(o * do), float32.

  Both (B, N, Tq padded to a multiple of ``pad_to``); padded rows get lse +inf
  (p = 0) and delta 0. The padding is of these small vectors only. A given
  ``delta`` (B, N, <= Tq) is used instead of rowsum(o * do).
  """
  length = _round_up(o.shape[1], pad_to)
  if delta is None:
    delta = jnp.einsum("bqnd,bqnd->bnq", o.astype(jnp.float32),
                       do.astype(jnp.float32))
  delta = delta.astype(jnp.float32)
  lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(jnp.float32) * common.LOG2_E)
  pad = lambda x, fill: jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2])),
                                constant_values=fill)
  return pad(lse2, jnp.inf), pad(delta, 0.0)


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
      None computes rowsum(o * do) in float32. (Pass rowsum(o * do) - dlse
      to include a cotangent of lse.)
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
      config that does not fit shared memory, or malformed lengths, segment
      ids or soft cap.
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
        mask=mask, config=config, interpret=interpret, delta=delta,
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
  if delta is not None and delta.shape != (b, n, q_len):
    raise ValueError(f"delta has shape {delta.shape}; expected {(b, n, q_len)}")
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
  if lengths is not None:
    # E06, E07: q, do rows past q_len or seeing no key, and k, v rows past
    # kv_len or beyond every valid query's causal / window reach, may hold
    # NaN/Inf; 0 * NaN is NaN, so they are selected to 0 here (one extra
    # read+write of q, do, k and v; only when lengths are given).
    q_ok = queries_in_reach(mask, lengths[0], lengths[1], q_len)
    k_ok = keys_in_reach(mask, lengths[0], lengths[1], kv_len)
    q, do = zero(q, q_ok), zero(do, q_ok)
    k, v = zero(k, k_ok), zero(v, k_ok)
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
  lse2, delta = backward_residuals(o, lse, do, pad_to, delta)
  if lengths is not None:
    # Rows past q_len: p = 0 (lse +inf) and delta 0, whatever o or lse hold.
    rows = jnp.arange(lse2.shape[2], dtype=jnp.int32)[None, None, :]
    ok = rows < lengths[0][:, None, None]
    lse2 = jnp.where(ok, lse2, jnp.inf)
    delta = jnp.where(ok, delta, 0.0)
  scale = float(scale)
  kwargs = dict(q_len=q_len, kv_len=kv_len, scale=scale, mask=mask,
                config=config, interpret=interpret, lengths=lengths,
                softcap=extras["softcap"])
  dq_segments = dkv_segments = None
  if extras["segments"] is not None:
    dq_segments, dkv_segments = _segment_inputs(*extras["segments"], config)
  if not config.deterministic:
    kwargs["segments"] = dkv_segments
    mode = "partials" if common.is_interpret(interpret) else "atomic"
    dk, dv, dq = _dkv_call(q, k, v, do, lse2, delta, outputs=("dk", "dv"),
                           dq_mode=mode, **kwargs)
    dq = (dq * scale).astype(q.dtype)
    return dq[:, :q_len], dk[:, :kv_len], dv[:, :kv_len]
  dq = _dq_call(q, k, v, do, lse2, delta, segments=dq_segments, **kwargs)
  kwargs["segments"] = dkv_segments
  if config.split_dkv:
    (dk,) = _dkv_call(q, k, v, do, lse2, delta, outputs=("dk",), **kwargs)
    (dv,) = _dkv_call(q, k, v, do, lse2, delta, outputs=("dv",), **kwargs)
  else:
    dk, dv = _dkv_call(q, k, v, do, lse2, delta, outputs=("dk", "dv"), **kwargs)
  return dq[:, :q_len], dk[:, :kv_len], dv[:, :kv_len]
