"""Tile sizes and pipeline depths of the two backward kernels (the dq kernel and
the dk/dv kernel, ``flash3.kernels.backward``), and the heuristic that picks them.

A ``BackwardConfig`` is frozen and hashable (the kernels take it as a static
argument) and checks itself at construction: every error is a ``ValueError``
naming the field, the value and what is allowed. ``smem_bytes`` estimates each
kernel's shared memory; tests compare it with Mosaic GPU's own count.
"""

from __future__ import annotations

import dataclasses

from flash3.kernels.config import (SMEM_LIMIT_BYTES, SMEM_RESERVED_BYTES,
                                   check_bool, check_multiple, check_registers,
                                   window_key_span)
from flash3.visibility import MaskSpec


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
    pair_dq: with ``deterministic`` False and the overlapped order, issue
      dq = ds k before dk += dsT q and send dq's tile while dk's matmul runs,
      as FlashAttention-3's backward does, instead of a separate matmul and
      wait after dk's (``backward_dkv._dq_product``). With ``share_dq`` the
      warpgroups exchange their dsT tiles first and each issues its half of
      dq's columns (FlashAttention-3's head_dim 128 layout; twenty-second
      session): its GPU tests and racecheck passed on an H200, and at head_dim
      128 it is the fastest single-kernel form (backward 0.78 of cuDNN against
      0.74 for ``share_dq`` alone and 0.955 for the two deterministic kernels,
      bfloat16, T 4096 / 16384; docs/benchmarks/h200/2026-12-04-s23/), so no
      heuristic takes it. GPU path only (interpret mode runs the unpaired order, as
      for ``overlap_matmuls``). Without ``share_dq`` its GPU tests and
      racecheck passed on an H200 (tenth session); 3-7% faster than the
      unpaired order on three of four head_dim 64 shapes, 1% slower on one:
      the heuristic takes it for deterministic=False at head_dim 64.
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
    fold_softcap: with a soft cap, fold the chain rule's 1 - tanh^2 into p as
      soon as p is formed (ds = (p (1 - tanh^2)) (dp - delta)), so one
      float32 score-shaped tile stays live until ds instead of two (p and
      tanh); in the dk/dv kernel p also goes to the input dtype for dv's
      matmul right away (that copy stays live too, at half the registers).
      Both kernels fold, the dq kernel at every head_dim. The same math up to float32 rounding. Default
      since the twenty-seventh session from ptxas's report alone
      (docs/ptxas.md; no GPU was lent): at head_dim 64 the dk/dv kernel's
      unmasked loop went from 237 to 26 local-memory instructions out of 980
      and 763, at 128 from 62 to 0 out of 521 and 444. Not yet timed or run
      on a GPU (docs/gpu_runs.md). The role split's dk/dv kernel (head_dim
      256) hands p (1 - tanh^2) over already, so there it changes nothing.
    one_sided_edges: the dq kernel runs a masked key tile that only the
      rows' lower (or only their upper) key bound can cut in a loop that
      compares that bound alone (``tile_mask.edge_tiles``; as
      ``ForwardConfig.one_sided_edges``): a window's edges. Masks without a
      window's left edge compile as before. With ``dkv_row_bounds`` the
      dk/dv kernel's masked query tiles are split the same way, for every
      mask (its rows are keys: plain causal's diagonal tiles are cut by each
      key's lower query bound alone).
    dkv_row_bounds: the dk/dv kernel (its rows are keys) masks a tile by
      each key's range of queries (``tile_mask.query_bounds``: two compares
      per element, one on a one-sided tile) instead of the pairwise rule
      (``MaskSpec.visible`` and both lengths: four), and forms the keep anew
      for each of its two selects (pT, dsT) rather than keeping one live
      across the matmuls. Not on the role-split path (head_dim 256). On an
      H200 (thirty-first session, causal window of 1024, T=16384, two runs),
      with one_sided_edges: the D=64 backward 5.7% faster (264 -> 279
      TFLOP/s; either alone +0-1%), D=128 within 1%. Plain causal
      (fortieth session, offline ptxas, T=4096): the diagonal loop 1444 ->
      1124 instructions per tile at D=64 (193 -> 119 of them local memory),
      759 -> 607 at D=128; the unmasked loop 552 -> 560 and 353 -> 365. Not
      yet timed; the default for windows only.
    fuse_delta: the dq kernel forms delta = rowsum(o * do) (float32) itself,
      each warpgroup from an o tile loaded beside its q and do tiles, and
      writes it out for the dk/dv kernel, instead of a separate XLA pass over
      o and do before both kernels. That pass reads all of o and do at about
      the card's bandwidth: 36 us at B*T = 16384, N*D = 2048 on an H200
      (twenty-sixth session), 6% of the T = 512 causal backward at D = 64,
      0.7% at T = 16384. Costs one (block_q_dq, D) tile of shared memory per
      dq warpgroup. Needs ``deterministic`` (the dq kernel) and
      ``block_q_dkv`` dividing ``compute_wgs_dq * block_q_dq`` (the dq grid
      then writes every row the dk/dv kernel reads). Without it, or when the
      caller passes ``delta``, XLA forms delta. On an H200 (fortieth
      session, causal D=64 and 128, T=512 and 4096, one run) 1-3% faster:
      the heuristic's choice for the deterministic backward up to
      head_dim 128 (forty-first session) where it fits; for every mask,
      though only causal was timed (XLA's pass costs the same there).
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
  fold_softcap: bool = True
  one_sided_edges: bool = True
  dkv_row_bounds: bool = False
  fuse_delta: bool = False

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
                 "share_dq", "overlap_matmuls", "pair_dq", "role_split", "fold_softcap",
                 "one_sided_edges", "dkv_row_bounds", "fuse_delta"):
      check_bool(name, getattr(self, name))
    if self.role_split and (self.compute_wgs_dkv != 2 or not self.deterministic
                            or self.split_dkv):
      raise ValueError(
          f"role_split=True needs compute_wgs_dkv=2, deterministic=True and "
          f"split_dkv=False; got compute_wgs_dkv={self.compute_wgs_dkv}, "
          f"deterministic={self.deterministic}, split_dkv={self.split_dkv}")
    if self.pair_dq and (self.deterministic or not self.overlap_matmuls):
      raise ValueError(
          f"pair_dq=True needs deterministic=False and overlap_matmuls=True; got "
          f"deterministic={self.deterministic}, "
          f"overlap_matmuls={self.overlap_matmuls}")
    if self.share_dq and (self.deterministic or self.compute_wgs_dkv != 2):
      raise ValueError(
          f"share_dq=True needs deterministic=False and compute_wgs_dkv=2 (two "
          f"warpgroups that share dq); got deterministic={self.deterministic}, "
          f"compute_wgs_dkv={self.compute_wgs_dkv}")
    if self.fuse_delta and (not self.deterministic or (
        self.compute_wgs_dq * self.block_q_dq) % self.block_q_dkv):
      raise ValueError(
          f"fuse_delta=True needs deterministic=True (the dq kernel forms delta) "
          f"and block_q_dkv dividing compute_wgs_dq * block_q_dq; got "
          f"deterministic={self.deterministic}, block_q_dkv={self.block_q_dkv}, "
          f"compute_wgs_dq={self.compute_wgs_dq}, block_q_dq={self.block_q_dq}")
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
    if self.fuse_delta:
      dq += w * bq * head_dim * itemsize  # o (lse's cotangent loads into delta's row)
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
    return (dq + SMEM_RESERVED_BYTES, dkv + SMEM_RESERVED_BYTES)

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
    the two-kernel path; ``share_dq`` with ``pair_dq``, twenty-second
    session: 0.78 against 0.955). Not below 64: the backward runs D as given (the forward pads it) and the
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
      # The dq kernel takes two compute warpgroups up to D = 192 (their q/do
      # tiles and a two-slot ring fit up to 224, untimed above 192): at
      # D = 160 and 192 its time fell 25-37% and the backward went from
      # 1.15-1.49 to 1.33-1.76 of cuDNN's (sixteenth session, docs/benchmarks/
      # h200/2026-12-02-s16/README.md). At D = 256 only one fits with two
      # slots (two with one slot were 53-76% slower).
      config = cls(block_kv_dq=64, compute_wgs_dq=2 if head_dim <= 192 else 1,
                   block_q_dkv=64, compute_wgs_dkv=2, num_stages=2,
                   role_split=True)
    config = dataclasses.replace(config, reverse_q_tiles=causal)
    if packed and causal and head_dim <= 128:
      config = dataclasses.replace(config, block_kv_dq=64, block_q_dkv=64)
    if not deterministic and head_dim == 64:
      config = dataclasses.replace(config, block_q_dkv=64, deterministic=False,
                                   pair_dq=True)
    if head_dim <= 128 and config.deterministic:
      # 240 registers per compute thread (the producer 24): the two kernels'
      # hot loops spill less (dk/dv D=64 causal 36 -> 4 local-memory
      # instructions offline, docs/ptxas.md), and on an H200 (twenty-ninth
      # session, one run, docs/benchmarks/h200/2026-12-06-s29/) D=64 causal
      # T=4096 ran 3.4% faster, non-causal T=16384 2.8%, causal 16384 1.7%,
      # D=128 causal T=4096 3.4%, non-causal 4096 even. The single kernel
      # keeps 232 / 40 (untimed with 240).
      config = dataclasses.replace(config, compute_registers=240, producer_registers=24)
      # delta = rowsum(o * do) in the dq kernel, not an XLA pass over o and do
      # before both kernels: on an H200 (fortieth session, causal, D=64 and
      # 128, T=512 and 4096, one run) 1-3% faster, most at short lengths.
      config = dataclasses.replace(config, fuse_delta=True)
    if span is not None and not config.role_split:
      # A window's edge tiles by each key's query range, one compare per
      # element where one bound alone cuts (dkv_row_bounds): offline
      # (ptxas, D=128, causal window of 1024, thirty-first session) the dk/dv
      # kernel's masked loops went from 852-864 instructions (19-20 of them
      # local memory) to 595-607 (3-5), the unmasked one from 362 to 353.
      # On an H200 (thirty-first session, that window, two runs) the D=64
      # backward ran 5.7% faster with one_sided_edges, D=128 within 1%.
      # Plain causal keeps the pairwise rule until timed: its diagonal loop
      # shrinks (1444 -> 1124 instructions at D=64, fortieth session) but its
      # unmasked loop grows by 8-12.
      config = dataclasses.replace(config, dkv_row_bounds=True)
    # Interpret mode stages register operands in smem too: shallower rings,
    # each kernel's on its own (the dk/dv kernel's with role_split at D=256).
    fits = lambda i: config.smem_bytes(head_dim, 2, interpret=interpret)[i] <= SMEM_LIMIT_BYTES
    if not fits(0) and config.fuse_delta:
      # The o tile before a shallower ring (interpret mode at D=128: its ds
      # staging leaves no room for both; the GPU's D=128 fits).
      config = dataclasses.replace(config, fuse_delta=False)
    while not fits(1) and config.stages_dkv > 1:
      config = dataclasses.replace(config, num_stages_dkv=config.stages_dkv - 1)
    while not fits(0) and config.num_stages > 1:
      config = dataclasses.replace(config, num_stages=config.num_stages - 1)
    config.check_fits(head_dim, 2, interpret=interpret)
    return config
