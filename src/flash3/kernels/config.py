"""Tile sizes and pipeline depth of the forward kernel, and the heuristic that picks them.

A ``ForwardConfig`` is frozen and hashable (the kernel takes it as a static
argument) and checks itself at construction: every error is a ``ValueError``
naming the field, the value and what is allowed.

Shared memory of one CTA (``forward_smem_bytes``), everything in the input
dtype except the float32 lse staging:

* q / o staging: ``2 * block_q * D`` elements (one tile per compute warpgroup;
  the output reuses the q tile),
* the K/V ring: ``2 * num_stages * block_kv * D`` elements,
* lse staging: ``2 * block_q`` float32,
* interpret mode only: ``2 * block_q * block_kv`` elements for P (see common.py),
* persistent kernel only, when it fits (``persistent_separate_o``): a separate
  ``2 * block_q * D`` output tile, so the next work item's q can load while
  this one's o is stored.

Hopper (H100, H200) gives a CTA at most 227 KiB of shared memory.
"""

from __future__ import annotations

import dataclasses

from flash3._device import DEFAULT_SM_COUNT
from flash3.kernels import sync
from flash3.kernels.schedule import LOCALITY_ROUNDS
from flash3.visibility import MaskSpec

# Opt-in shared memory per CTA on sm90 (cudaDevAttrMaxSharedMemoryPerBlockOptin).
SMEM_LIMIT_BYTES = 227 * 1024
# Barriers and alignment padding (Pallas aligns each buffer to 1024 bytes, so
# the 512-byte lse tile takes 1024). The forward asks Pallas for no cross-warp
# reduction scratch (its reductions run along rows, within a warp; it would
# reserve 2048 bytes by default), so Mosaic GPU's total for D=128,
# block_kv=128, num_stages=3 is 230464 bytes, 576 more than the buffers
# (lowered for CUDA on the CPU, twelfth session; the seventh's 232568 included
# that scratch). tests/test_forward_kernel.py checks the estimate bounds
# Mosaic's own count.
SMEM_RESERVED_BYTES = 1024
# The forward runs two compute warpgroups by default (``ForwardConfig.
# compute_warpgroups``), each on its own tile of block_q rows.
NUM_COMPUTE_WARPGROUPS = 2
COMPUTE_WARPGROUP_COUNTS = (2, 3)
# ForwardConfig.lazy_rescale: how far (log2 units) a tile's scores may exceed
# a row's reference maximum before the row is rescaled (FlashAttention-4's
# value: P <= 2**8).
RESCALE_THRESHOLD = 8.0
# Ring depth the forward's named barriers allow (two per slot, kernels/sync.py)
# with two compute warpgroups; ``sync.max_ring_slots`` for other counts.
MAX_NAMED_STAGES = sync.MAX_RING_SLOTS


# ForwardConfig.block_q=128: the largest (padded) head_dim whose accumulator
# leaves registers for the scores.
BLOCK_Q_128_MAX_HEAD_DIM = 64


def check_multiple(name: str, value, multiple: int, lo: int, hi: int) -> None:
  """ValueError naming the config field unless value is an int multiple in [lo, hi]."""
  if (not isinstance(value, int) or isinstance(value, bool) or value % multiple
      or not lo <= value <= hi):
    raise ValueError(
        f"{name}={value!r} is not allowed: it must be a multiple of {multiple} "
        f"in [{lo}, {hi}]")


def check_registers(compute: int, producer: int,
                    compute_warpgroups: int = NUM_COMPUTE_WARPGROUPS) -> None:
  """Raises ValueError unless (compute, producer) is a valid setmaxnreg split
  for ``compute_warpgroups`` compute warpgroups and one producer warpgroup of
  128 threads."""
  check_multiple("compute_registers", compute, 8, 24, 256)
  check_multiple("producer_registers", producer, 8, 24, 256)
  if producer > compute:
    raise ValueError(
        f"producer_registers={producer} exceeds compute_registers={compute}: "
        "setmaxnreg raises the compute warpgroups' count and lowers the producer's")
  total = 128 * (compute_warpgroups * compute + producer)
  if total > 65536:
    raise ValueError(
        f"compute_registers={compute} with producer_registers={producer} needs "
        f"{total} registers per CTA with {compute_warpgroups} compute "
        "warpgroups; at most 65536 are allowed")


def check_bool(name: str, value) -> None:
  """ValueError naming the config field unless value is a bool."""
  if not isinstance(value, bool):
    raise ValueError(f"{name}={value!r} must be a bool")


PINGPONG_MODES = tuple(sync.TURNS)  # ("handoff", "meeting", "off")


def can_halve_tiles(block_kv: int, overlap_softmax: bool = False) -> bool:
  """Whether ``ForwardConfig.half_edge_tiles`` may be on with these fields: a
  half tile is one wgmma N of 64 or 128 keys, and the overlapped branch
  stages P in a fixed (64, block_kv) tile."""
  return block_kv in (128, 256) and not overlap_softmax


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
  """Static tuning of the forward kernel.

  Attributes:
    block_q: query rows per compute warpgroup (a CTA covers
      ``compute_warpgroups * block_q`` rows): 64 (one wgmma M tile), or 128
      for head_dim <= 64 with two compute warpgroups (each matmul then two
      M tiles; above 64 the accumulator leaves no registers). 128 rows per
      warpgroup read each K/V tile once for 256 query rows and halve the
      work items (and their fixed cost: the first K, the epilogue's
      hand-over) at the same work per step as 64 rows with twice the keys:
      with 64-key tiles, offline (ptxas) D = 64 compiles without a spill,
      causal or not. An A/B knob for D = 64 at short sequences.
    block_kv: keys per K/V tile: a multiple of 64 in [64, 256].
    num_stages: depth of the K/V ring in shared memory, in [1, 8]. The kernel
      uses min(num_stages, number of key tiles) when that is smaller.
    compute_registers: registers per thread granted to the compute
      warpgroups (setmaxnreg); the producer gets ``producer_registers``.
    reverse_q_tiles: launch the query tiles last-first (the ones that see
      the most keys under a causal mask start first; see
      ``common.grid_index``).
    persistent: launch ``min(num_sms, work items)`` CTAs that each loop over
      work items (head, query tile, batch), longest first within chunks of
      the grid's order (``schedule.lpt_schedule``, ``schedule_rounds``;
      round-robin when all cost the same; with segment ids ordered by each
      item's documents on the device); the
      K/V ring streams on across items, so the producer loads the next item's
      tiles while the compute warpgroups finish the current one.
    compute_warpgroups: 2 (default) or 3 compute warpgroups per CTA, each on
      its own ``block_q`` rows, sharing every K/V tile (FlashAttention-3's
      head_dim 64 kernel runs three, 192 query rows per CTA). With three the
      turns go round all three (``pingpong`` "handoff" or "off"; "meeting"
      is for two), so two warpgroups' softmax can run while one's matmuls
      do, and each K/V tile is read from memory for 192 rows instead of 128;
      the register file then allows at most 160 registers per compute
      thread beside a producer of 24 (``compute_registers``, which must be
      given: the default 232 does not fit), so score tiles of 128 keys.
      The default for causal D=64 from 2048 keys (``forward_config``;
      H200, twenty-ninth session: +2-3% there, slower at short T and at
      D=128).
    num_sms: CTAs of the persistent kernel (132 SMs on an H100 / H200 SXM);
      ignored unless ``persistent``.
    overlap_softmax: overlap each tile's softmax with the previous tile's
      P @ V in the same warpgroup (FlashAttention-3, Section 3.2), on top of
      the two warpgroups' ping-pong; P then goes through shared memory (one
      (64, block_kv) tile per warpgroup); needs num_stages >= 2. Off by
      default, for experiments: measured on an H200 with its overlapped
      branch compiled (eighth session, docs/benchmarks/h200/2026-12-01-s8/
      tune.md) it is 7-10% slower at head_dim 128 and 18-24% slower at 256
      (the ping-pong already hides one warpgroup's softmax behind the other's
      matmuls; the P tile and the second accumulator cost more). Its GPU
      tests pass. Keeping P in registers was 35% slower (sixth session),
      see ``overlap_p_registers``.
    overlap_p_registers: with ``overlap_softmax``, on the GPU P_{t-1} stays
      in registers (carried from one step to the next) as the register
      operand of the P @ V in flight during tile t's softmax, as in
      FlashAttention-3, instead of a shared-memory tile: no 16 KiB store and
      fence per tile, and no P tile in shared memory. ptxas (13.0, offline,
      D=128) keeps that wgmma in flight across the softmax (it waits for
      the scores alone, then for both after the softmax) with no spill.
      Interpret mode stages P through shared memory whatever this says. An
      A/B knob; the sixth session's register form ran 35% slower, before the
      kernel's current softmax and turns.
    named_barriers: on the GPU, hand the ping-pong turns and the ring's
      releases over with hardware named barriers (``bar.arrive`` /
      ``bar.sync``, kernels/sync.py) instead of mbarriers; interpret mode
      always uses mbarriers (same protocol), and so does a ring of more than
      ``MAX_NAMED_STAGES`` (5) slots: a CTA has 16 hardware barriers.
    pingpong: how the two compute warpgroups take turns on the tensor cores
      (FlashAttention-3 section 3.1; kernels/sync.py). "meeting" (default):
      both warpgroups meet (one named barrier) where a warpgroup has issued
      its matmuls and where it is about to issue the next ones. "handoff"
      (the seventh and eighth sessions' default): a warpgroup signals the
      other's turn one way and waits for its own. "off": no turns. On an
      H200 (ninth session, bf16, D 64/128, T 4096/16384, causal or not)
      "meeting" was faster than "handoff" on 7 of 8 shapes, flash3/cuDNN
      geomean 0.974 against 0.949 ("off": 0.887).
    exp2_fma_cols: columns of each score tile whose exp2 runs as a
      polynomial on the FMA pipes instead of the MUFU unit (kernels/exp2.py,
      FlashAttention-4's split): 0 (default) or a multiple of 16 up to
      block_kv (a half edge tile puts min(exp2_fma_cols, block_kv / 2) of
      its columns there). An A/B knob: on an H200 (ninth session) 32
      columns were 2-7% slower at head_dim 64 and 128 (MUFU does not bound
      the softmax there); its GPU tests pass.
    half_edge_tiles: a warpgroup computes only the half of its first or last
      key tile that the mask lets its 64 rows see, when the other half is
      wholly invisible to them (a window's far edge, a causal diagonal past
      the warpgroup's last row): a (64, block_kv / 2) score tile and P @ V of
      half the depth. With 128-key tiles a causal window of 1024 computes
      1088 keys per warpgroup of 64 rows instead of 1152. Needs block_kv 128
      or 256 and overlap_softmax off (``can_halve_tiles``).
      ``forward_config`` turns it on for windows and causal masks (a
      causal window of 1024 at T=16384 ran 6% faster at D=64 and D=128,
      eleventh session; plain causal 0 to +1.3%, causal documents +0.6% to
      +4.0%, never slower, twelfth session).
    lazy_rescale: the online softmax keeps a row's running maximum (the
      reference its exponentials are taken against) until a tile's scores
      exceed it by more than ``RESCALE_THRESHOLD`` (8, in log2 units), as
      FlashAttention-4 does: P then lies in [0, 2**8] instead of [0, 1] (the
      same relative precision in float16 / bfloat16, and o = acc / l is
      unchanged), and most tiles leave the accumulator as it is, so on the GPU
      each warp skips rescaling it whenever none of its rows moved their
      reference (a warp vote). False: every tile rescaled (the kernels until
      the eighteenth session).
    scale_first: multiply the scores by ``scale * log2(e)`` before the row
      max (each product rounded once: ``common.scale_rounded``), then
      exponentiate ``s - m``; else take the max of the raw scores and
      exponentiate ``(s - m) * scale * log2(e)``. Both give exp2(0) = 1 at a
      row's max (E03). The first puts the multiplies before the max, the
      second after it, beside the exponentials.
    fma_exponent: with ``scale_first`` off, exponentiate s * c - round(m * c)
      as one FMA per score (FlashAttention-3's form) instead of an add and a
      multiply, the product's rounding error carried per row so that a row's
      max still gets exp2 of (almost) 0 and P, l and the lse agree
      (kernels/exponent.py; warps with a reference of 2**22 or more, E03's
      magnitudes, keep the exact form). Offline (ptxas 13.0, D=128 causal)
      the unmasked loop's usual path runs 492 instructions per thread and
      tile instead of the default's 540. Equal scores then give o within one
      ulp of v, not v exactly (P @ V takes the rounded P, l the float32 one).
      No effect with a soft cap, or a scale whose scale * log2(e) is not a
      positive normal float32 (the scaled-first path). An A/B knob, not yet
      timed: the softmax bounds a step at D <= 128, and FMA-pipe work added
      there cost time before (``exp2_fma_cols``).
    fuse_pv_qk: issue each tile's P @ V and the next tile's Q K^T back to
      back and wait for both once, so a warpgroup's two matmuls of a
      ping-pong turn leave no gap on the tensor cores between them (P stays
      in registers: nothing writes it while its wgmma runs, as the softmax
      of the next tile starts only after the wait). The last tile of a work
      item issues P @ V alone. Needs overlap_softmax and half_edge_tiles
      off (a half tile's narrower scores would change the carried tile's
      shape). ``forward_config`` turns it on above D=128 (H200, twenty-fourth
      session: +0.6% to +3.0% at D=256; 7-26% slower at D=64 and 128, whose
      softmax bounds a step).
    schedule_rounds: the persistent kernel's schedule balances its items
      longest first within consecutive chunks of ``schedule_rounds *
      num_sms`` items in the grid's order, so CTAs running at the same time
      read nearby K/V (shared in L2); 0 sorts all items by cost at once (the
      schedule until the twenty-sixth session). ``kernels/schedule.py``
      explains the trade; ignored unless ``persistent``. An int in [0, 64].
    defer_epilogue: in the persistent kernel, a warpgroup runs an item's
      epilogue (o = acc / l, the lse, their stores) while the next item's
      first Q K^T is in flight, after it has handed the tensor cores to the
      other warpgroup, instead of inside its turn before that Q K^T (the
      other warpgroup waited for it). Needs ``persistent`` and the separate
      o tile (``persistent_separate_o``; checked where head_dim is known)
      and ``overlap_softmax`` off. An A/B knob for items of few key tiles
      (short sequences, windows), off by default: on an H200 (twenty-ninth
      session) it was 6-21% slower causal at D 64 / 128, T 512-2048, and
      -5% to +0.3% without a mask; a causal window of 1024 at D=128, T=16384
      7% slower (thirty-first session). Its costs:
      the epilogue runs before the first K slot is freed (with 2 stages the
      producer's refill may wait); at D=64, where the next q is issued only
      after an item's loop, the next item waits for its q before the
      epilogue instead of during it; a warpgroup without a key tile in an
      item runs it at once, inside its turn.
    one_sided_edges: a masked key tile on the rows' lower (upper) key
      bound that no row's upper (lower) bound can cut runs in a loop that
      compares only that one bound per element (``tile_mask.edge_tiles``):
      a window's far edge and its diagonal, one compare and one select per
      element instead of two of each. Offline (ptxas, D=128, causal window
      of 1024) those loops hold 743 instructions instead of 861; masks
      without a window's left edge compile as before. On an H200 (thirty-
      first session, that window at T=16384, two runs) D=64 ran 1.2-1.8%
      faster, D=128 within 1%. False: every masked tile compares both bounds
      (the kernels until the thirty-first session).
    epilogue_off_turn: a warpgroup hands the tensor cores on after its
      item's last P @ V and waits for its turn again after the epilogue
      (o = acc / l, the lse, their stores), before the next item's first
      Q K^T, instead of holding the turn through both: one more signal and
      wait per item and warpgroup, in every warpgroup alike, so the turns
      still alternate. The other warpgroup's last P @ V then runs during this
      epilogue. Needs ``defer_epilogue`` off (which moves the epilogue off
      the turn another way). With ``pingpong="meeting"`` every signal is a
      meeting, so each epilogue waits for the other warpgroup's last P @ V:
      the hand-off suits it. An A/B knob for items of few key tiles.
    trim_end_tile: the key tile that holds the last key (Tk - 1, when Tk is
      static: no per-batch lengths) computes only its first keys, rounded up
      to a multiple of 64, instead of all ``block_kv``: with Tk = 4096 and
      192-key tiles, 21 whole tiles and one of 64 keys instead of 22 whole
      ones (4224 keys' work). The keys cut off are past Tk, so invisible
      anyway; the result equals whole tiles' up to the order of float32
      sums. Needs overlap_softmax and fuse_pv_qk off (their steps keep
      whole tiles). An A/B knob for ragged key lengths and wide tiles.
    prefetch_segment_ids: with segment ids, a masked step loads its key
      tile's ids (one per column, from global memory) before issuing its
      Q K^T instead of after the scores arrive, so the load's latency runs
      under the matmul. The same values and arithmetic (bitwise equal); the
      ids' registers are held across the matmul. Offline (ptxas) the loads
      of the default followed the scores' wait in every masked loop. It acts
      on the plain step only: with overlap_softmax or fuse_pv_qk the ids
      are still loaded after the scores. An A/B knob for packed documents.
  """

  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2
  compute_registers: int = 232
  producer_registers: int = 40
  reverse_q_tiles: bool = False
  persistent: bool = False
  num_sms: int = DEFAULT_SM_COUNT
  overlap_softmax: bool = False
  overlap_p_registers: bool = False
  named_barriers: bool = True
  pingpong: str = "meeting"
  exp2_fma_cols: int = 0
  half_edge_tiles: bool = False
  lazy_rescale: bool = True
  scale_first: bool = False
  fma_exponent: bool = False
  fuse_pv_qk: bool = False
  schedule_rounds: int = LOCALITY_ROUNDS
  defer_epilogue: bool = False
  one_sided_edges: bool = True
  epilogue_off_turn: bool = False
  trim_end_tile: bool = False
  prefetch_segment_ids: bool = False
  compute_warpgroups: int = NUM_COMPUTE_WARPGROUPS

  def __post_init__(self):
    if type(self.block_q) is not int or self.block_q not in (64, 128):
      raise ValueError(f"block_q={self.block_q!r} is not allowed: it must be 64 "
                       "or 128")
    check_multiple("block_kv", self.block_kv, 64, 64, 256)
    check_multiple("num_stages", self.num_stages, 1, 1, 8)
    check_bool("reverse_q_tiles", self.reverse_q_tiles)
    check_bool("persistent", self.persistent)
    check_bool("overlap_softmax", self.overlap_softmax)
    check_bool("overlap_p_registers", self.overlap_p_registers)
    check_bool("named_barriers", self.named_barriers)
    check_multiple("exp2_fma_cols", self.exp2_fma_cols, 16, 0, self.block_kv)
    if self.pingpong not in PINGPONG_MODES:
      raise ValueError(f"pingpong={self.pingpong!r} is not one of {PINGPONG_MODES}")
    if self.overlap_softmax and self.num_stages < 2:
      # One slot: V_{t-1} is released only after step t's wait for its turn,
      # which the other warpgroup may give only once that slot's next tile
      # has loaded: deadlock.
      raise ValueError(f"overlap_softmax=True needs num_stages >= 2; got "
                       f"num_stages={self.num_stages}")
    check_multiple("num_sms", self.num_sms, 1, 1, 4096)
    if (type(self.compute_warpgroups) is not int
        or self.compute_warpgroups not in COMPUTE_WARPGROUP_COUNTS):
      raise ValueError(f"compute_warpgroups={self.compute_warpgroups!r} is not one "
                       f"of {COMPUTE_WARPGROUP_COUNTS}")
    if self.compute_warpgroups != 2 and self.pingpong == "meeting":
      raise ValueError(
          f"compute_warpgroups={self.compute_warpgroups} needs pingpong "
          "'handoff' or 'off' (a meeting is for two warpgroups); got "
          f"pingpong={self.pingpong!r}")
    if self.block_q == 128 and self.compute_warpgroups != 2:
      raise ValueError(
          f"block_q=128 needs compute_warpgroups=2; got compute_warpgroups="
          f"{self.compute_warpgroups}")
    check_registers(self.compute_registers, self.producer_registers,
                    self.compute_warpgroups)
    check_bool("half_edge_tiles", self.half_edge_tiles)
    check_bool("lazy_rescale", self.lazy_rescale)
    check_bool("scale_first", self.scale_first)
    check_bool("fma_exponent", self.fma_exponent)
    if self.fma_exponent and self.scale_first:
      raise ValueError(
          "fma_exponent=True needs scale_first=False (it folds the scale into "
          f"exp2's argument); got scale_first={self.scale_first}")
    check_bool("fuse_pv_qk", self.fuse_pv_qk)
    check_multiple("schedule_rounds", self.schedule_rounds, 1, 0, 64)
    check_bool("defer_epilogue", self.defer_epilogue)
    check_bool("one_sided_edges", self.one_sided_edges)
    check_bool("epilogue_off_turn", self.epilogue_off_turn)
    if self.epilogue_off_turn and self.defer_epilogue:
      raise ValueError(
          "epilogue_off_turn=True needs defer_epilogue=False; got "
          f"defer_epilogue={self.defer_epilogue}")
    check_bool("trim_end_tile", self.trim_end_tile)
    check_bool("prefetch_segment_ids", self.prefetch_segment_ids)
    if self.trim_end_tile and (self.overlap_softmax or self.fuse_pv_qk):
      raise ValueError(
          f"trim_end_tile=True needs overlap_softmax=False and fuse_pv_qk=False; "
          f"got overlap_softmax={self.overlap_softmax}, fuse_pv_qk={self.fuse_pv_qk}")
    if self.defer_epilogue and (not self.persistent or self.overlap_softmax):
      raise ValueError(
          f"defer_epilogue=True needs persistent=True and overlap_softmax="
          f"False; got persistent={self.persistent}, overlap_softmax="
          f"{self.overlap_softmax}")
    if self.fuse_pv_qk and (self.overlap_softmax or self.half_edge_tiles):
      raise ValueError(
          f"fuse_pv_qk=True needs overlap_softmax=False and half_edge_tiles="
          f"False; got overlap_softmax={self.overlap_softmax}, half_edge_tiles="
          f"{self.half_edge_tiles}")
    if self.half_edge_tiles and not can_halve_tiles(self.block_kv, self.overlap_softmax):
      raise ValueError(
          f"half_edge_tiles=True needs block_kv 128 or 256 and overlap_softmax="
          f"False; got block_kv={self.block_kv}, overlap_softmax={self.overlap_softmax}")


def forward_smem_bytes(config: ForwardConfig, head_dim: int, itemsize: int,
                       *, num_stages: int | None = None,
                       interpret: bool = False) -> int:
  """Shared memory one CTA of the forward kernel needs, in bytes."""
  stages = config.num_stages if num_stages is None else num_stages
  n = config.compute_warpgroups
  total = n * config.block_q * head_dim * itemsize
  total += 2 * stages * config.block_kv * head_dim * itemsize
  total += n * config.block_q * 4
  if interpret or (config.overlap_softmax and not config.overlap_p_registers):
    # P through shared memory.
    total += n * config.block_q * config.block_kv * itemsize
  return total + SMEM_RESERVED_BYTES


def persistent_separate_o(config: ForwardConfig, head_dim: int, itemsize: int,
                          *, num_stages: int | None = None,
                          interpret: bool = False) -> bool:
  """Whether the persistent kernel has room for an output tile apart from q.

  With it, a compute warpgroup loads the next item's q as soon as its last
  QK^T is done, before its epilogue; without it, o is staged in the q tile
  and the next q loads only after the store has read it.
  """
  o_bytes = config.compute_warpgroups * config.block_q * head_dim * itemsize
  return (forward_smem_bytes(config, head_dim, itemsize, num_stages=num_stages,
                             interpret=interpret) + o_bytes <= SMEM_LIMIT_BYTES)


def check_fits(config: ForwardConfig, head_dim: int, itemsize: int,
               *, num_stages: int | None = None, interpret: bool = False) -> None:
  """Raises ValueError if the config does not fit in shared memory, or its
  128-row warpgroups (``ForwardConfig.block_q``) in registers."""
  if config.block_q > 64 and head_dim > BLOCK_Q_128_MAX_HEAD_DIM:
    raise ValueError(
        f"block_q={config.block_q} needs head_dim <= {BLOCK_Q_128_MAX_HEAD_DIM} "
        f"(a ({config.block_q}, head_dim) float32 accumulator per warpgroup); got "
        f"head_dim={head_dim}")
  need = forward_smem_bytes(config, head_dim, itemsize, num_stages=num_stages,
                            interpret=interpret)
  if need > SMEM_LIMIT_BYTES:
    raise ValueError(
        f"config={config} needs {need} bytes of shared memory at head_dim="
        f"{head_dim}; at most {SMEM_LIMIT_BYTES} are allowed: lower num_stages "
        "or block_kv")


def window_key_span(mask: MaskSpec, kv_len: int, rows: int = 128) -> int | None:
  """Keys that ``rows`` consecutive queries can see under the mask's window;
  None without a window, or when the window does not bind (it would span all
  ``kv_len`` keys: the mask is then judged as if it had none). The kernels'
  defaults take smaller or persistent tiles when this is short (the work per
  query tile is bounded).
  """
  if mask.window_left is None and mask.window_right is None:
    return None
  left = kv_len if mask.window_left is None else mask.window_left
  right = 0 if mask.causal else (kv_len if mask.window_right is None else mask.window_right)
  span = left + right + rows
  return span if span < kv_len else None


def _prefers_persistent(head_dim: int, mask: MaskSpec, kv_len: int,
                        packed: bool = False) -> bool:
  """Whether the persistent kernel is the faster default for these arguments.

  Short items (few key tiles per query tile) spend much of a CTA's life in its
  prologue and epilogue, which the persistent kernel overlaps with the next
  item. H200 sweep (2026-12-01, docs/benchmarks/h200/2026-12-01/tune.md):
  +5% to +31% where this returns True; causal D=128 at T=1024 and 2048 lost
  12-16% (round-robin items of unequal length idle some SMs), T >= 4096 was
  neutral. With the longest-first schedule (kernels/schedule.py; sweep of
  2026-12-01, second call) causal D=64 gained 3-12% up to T=4096 while causal
  D=128 still lost 3-5% at T=1024-4096. A window bounds every item's keys
  whatever T is, so it is judged by the keys one query tile can see (window
  plus a tile): a causal window of 1024 at T=16384, D=128 ran 12% faster
  persistent (sweep of 2026-12-01, fifth session, docs/benchmarks/h200/
  2026-12-01-s5/tune.md); other windows follow the non-causal rule untested.
  Packed rows (segment ids) take the grid kernel. With a static schedule
  (blind to each item's documents) the persistent kernel ran 8 causal
  documents of 2048 at T=16384 12% (D=128) and 51% (D=64) slower (tenth
  session, docs/benchmarks/h200/2026-12-01-s10/tune.md); with the schedule
  built from the documents on the device (``schedule.segment_schedule``,
  eleventh session, docs/benchmarks/h200/2026-12-02-s11/tune.md) it ran
  causal D=64 +2%, D=128 -7%, and without causal D=64 -13%, D=128 even: no
  shape gains enough to leave the grid kernel's dynamic block scheduling.
  With that schedule in chunks of the grid's order (twenty-sixth session)
  causal documents ran at D=128 as fast as the grid kernel (0.2962 against
  0.2963 ms; 0.3414 with one sort over all items) and at D=64 still 4.5%
  slower.
  Packed rows with a short window follow the packed rule, unmeasured.
  """
  if packed:
    return False
  span = window_key_span(mask, kv_len)
  if span is not None:
    return (head_dim <= 128 and span <= 2048) or (head_dim <= 64 and span <= 4096)
  if mask.causal:
    # Ninth session: with the meeting ping-pong and 256-key tiles, causal
    # D=64 ran faster persistent than in the grid: +21% at T=1024, +7% at
    # 4096, +2-7% at 16384. Twenty-sixth session (docs/benchmarks/h200/
    # 2026-12-04-s26/): with the schedule's chunks of the grid's order
    # (``ForwardConfig.schedule_rounds``) causal D=128 ran persistent +23% at
    # T=1024, +9% at 2048, +2% at 4096, and 2-3% slower at 8192 and 16384;
    # D=256 0.7% slower to even at T 1024-16384.
    return head_dim <= 64 or (head_dim <= 128 and kv_len <= 4096)
  # Twenty-third session (docs/benchmarks/h200/2026-12-04-s23/): D=256 ran
  # 3-4% faster persistent at T=512 and 0.5-1.5% at 1024, 0.6-1.6% slower at
  # 2048 (two sweeps each).
  return (kv_len <= 1024 or (head_dim <= 128 and kv_len <= 2048)
          or (head_dim <= 64 and kv_len <= 4096))


def forward_config(head_dim: int, dtype, mask: MaskSpec, q_len: int,
                   kv_len: int, *, interpret: bool = False,
                   num_sms: int = DEFAULT_SM_COUNT,
                   packed: bool = False) -> ForwardConfig:
  """The default config for these arguments; it always fits shared memory.

  Chosen from a sweep on an H200 (scripts/tune.py, 2026-11-30, bfloat16,
  T 4096 and 16384, against cuDNN in the same run): the widest K/V ring that
  fits at D=64, 128-key tiles at D=128 (192 for long non-causal keys since
  the thirteenth session), 64-key tiles at D=256, and causal
  query tiles launched last-first (4-18% faster than first-first); (sweep
  of 2026-12-01) the persistent kernel for short sequences, see
  ``_prefers_persistent``; and (sixth session,
  docs/benchmarks/h200/2026-12-01-s6/tune.md) 240 registers per compute
  thread for the widest score tiles; (ninth session) the "meeting"
  ping-pong up to D=128, the "handoff" at D=256 (and, since the
  twenty-fifth session, in D=64's persistent kernel without a window).

  Args:
    head_dim: D after any padding the kernel does (a multiple of 64).
    dtype: float16 or bfloat16 (both 2 bytes; the choice does not depend on it).
    mask: the MaskSpec; causal masks launch the longest query tiles first,
      and at D=64 take 256-key tiles in a 2-slot ring, persistent (ninth
      session: 0.99-1.07x cuDNN at T 4096-16384, against 0.90-0.95 with the
      128-key grid kernel; 128-key tiles below 1024 keys since the
      twenty-sixth); windows take 128-key tiles up to D=128. Causal D=64
      from 2048 keys runs three compute warpgroups (twenty-ninth session).
    q_len, kv_len: Tq and Tk.
    interpret: the ring is shrunk until interpret mode's P staging buffer
      fits too (see common.py); the GPU path keeps the full ring.
    num_sms: the GPU's SMs, the persistent kernel's CTA count (132 on an
      H100 / H200 SXM, 114 on an H100 PCIe: more CTAs than SMs would run a
      second wave).
    packed: segment ids are given (packed documents): the grid kernel, and
      causal D=64 takes 128-key tiles.
  """
  del dtype, q_len  # Same choice for both 16-bit types and all Tq today.
  if head_dim <= 64:
    block_kv, stages = (256, 2) if mask.causal else (256, 3)
  elif head_dim <= 128:
    block_kv, stages = 128, 2
  else:
    block_kv, stages = 64, 2
  # A window that binds (one that spans every key is judged as no window).
  windowed = window_key_span(mask, kv_len) is not None
  if windowed and head_dim <= 128:
    block_kv = 128
  if packed and mask.causal and head_dim <= 64:
    # Causal documents end on a diagonal tile each: 128-key tiles ran 19%
    # faster than 256 (8 documents of 2048, T=16384, tenth session).
    block_kv = 128
  if mask.causal and head_dim <= 64 and kv_len < 1024:
    # Short causal rows: 128-key tiles in the persistent kernel ran +3.3% to
    # +3.9% at T=512 (three runs) and +5% at 768, even at 1024, -0.5% at
    # 2048 (twenty-sixth session, docs/benchmarks/h200/2026-12-04-s26/).
    block_kv = 128
  if (64 < head_dim <= 128 and not mask.causal and not windowed and not packed
      and kv_len >= 8192):
    # 192-key tiles (two ring slots fit once Pallas's reduction scratch is
    # gone): non-causal D=128 ran 2.6% faster at T=16384 (twice), 1.2% at
    # 8192 (once), 0.6-1.1% slower at 4096 (three times) (thirteenth session,
    # docs/benchmarks/h200/2026-12-02-s13/tune.md). A causal diagonal cuts
    # them badly (no half tiles of 96 keys): -18% at T=4096.
    block_kv = 192
  # Never ring more tiles than there are keys.
  tiles = max(1, -(-kv_len // block_kv))
  stages = max(1, min(stages, tiles))
  persistent = _prefers_persistent(head_dim, mask, kv_len, packed)
  if persistent and head_dim <= 64:
    stages = min(stages, 2)  # The persistent sweep's best at D=64.
  # The meeting ping-pong gained 1-5% at D=64 (on 9 of 10 shapes; causal
  # T=16384 lost 2%), even at D=128; the hand-off
  # kept D=256 0.5-1.4% faster (ninth session, docs/benchmarks/h200/
  # 2026-12-01-s9/tune.md).
  # Twenty-fifth session (docs/benchmarks/h200/2026-12-04-s25/, bfloat16,
  # T 512-16384, two runs): D=64's persistent kernel now gains from the
  # hand-off, +1.6-2.6% without a mask up to T=4096 and +1.2-2.1% causal from
  # T=2048 (within 0.4% below); its grid kernel (non-causal, long keys) stays
  # with the meeting (0.6-0.7% slower with the hand-off, twice). Windows were
  # not measured and keep the meeting.
  handoff = head_dim > 128 or (head_dim <= 64 and persistent and not windowed)
  pingpong = "handoff" if handoff else "meeting"
  # A window's edges and a causal diagonal cut a warpgroup's first or last
  # key tile: computing only the half it sees ran a causal window of 1024 at
  # T=16384 6% faster at D=64 and D=128 (eleventh session); plain causal
  # T 4096 / 16384 0 to +1.3% (within noise), causal 8 x 2048 documents +4.0%
  # at D=64 and +0.6% at D=128, never slower (twelfth session; docs/
  # benchmarks/h200/2026-12-02-s12/tune.md). Masks without causal or a
  # window (packed or not) have no cut edge tile and keep whole tiles.
  half_edge_tiles = (windowed or bool(mask.causal)) and can_halve_tiles(block_kv)
  # The softmax's form (eighteenth session, docs/benchmarks/h200/2026-12-03-s18/,
  # bfloat16, T 4096 / 16384, causal or not): lazy rescaling gained 3.2-8.3% at
  # D=256 (raw max) and 1.6-3.6% at D=128 (scores scaled first), but cost up
  # to 4.6-5.7% at D=64 (its 64 x 256 tiles' warp votes weigh more than their
  # 32 rescaling multiplies per thread), which keeps the every-tile softmax,
  # scaled first. (The class defaults are D=256's form.)
  lazy_rescale = head_dim > 64
  scale_first = head_dim <= 128
  # P @ V and the next Q K^T back to back (twenty-fourth session, docs/
  # benchmarks/h200/2026-12-04-s24/): above D=128 (64-key tiles, whose
  # softmax is short beside the matmuls) +0.6% to +3.0% on all six shapes
  # (T 1024 / 4096 / 16384, causal or not); at D=128 7-16% slower and at
  # D=64 16-26% slower (their softmax, not the tensor cores, bounds a step).
  fuse_pv_qk = head_dim > 128 and not half_edge_tiles
  config = ForwardConfig(block_q=64, block_kv=block_kv, num_stages=stages,
                         reverse_q_tiles=bool(mask.causal), persistent=persistent,
                         num_sms=num_sms, pingpong=pingpong,
                         half_edge_tiles=half_edge_tiles, lazy_rescale=lazy_rescale,
                         scale_first=scale_first, fuse_pv_qk=fuse_pv_qk)
  if not persistent and head_dim <= 64 and (block_kv == 256 or packed):
    # The widest score tile (64 x 256) gains from 8 more registers per compute
    # thread (setmaxnreg 240, the producer 24): D=64 non-causal T >= 8192
    # +5-6% in the fa3 benchmark; D=256 lost 1% there, the other defaults
    # were within noise (2026-12-01, sixth session). Packed rows' 128-key
    # tiles were measured with them too (tenth session).
    config = dataclasses.replace(config, compute_registers=240, producer_registers=24)
  if (head_dim <= 64 and mask.causal and persistent and not windowed
      and not packed and kv_len >= 2048):
    # Three compute warpgroups (FlashAttention-3's D=64 layout: 192 query
    # rows per CTA, 128-key tiles, 160 registers, the turns round all three)
    # ran causal D=64 +1.9% to +3.2% at T=2048 and +2.4% to +2.9% at 16384
    # (three runs each), 0.1-1.4% slower at 4096; below 2048 keys 3-13%
    # slower, without a mask -2% to +1%, at D=128 (64-key tiles) slower
    # everywhere (twenty-ninth session, docs/benchmarks/h200/2026-12-06-s29/).
    config = dataclasses.replace(
        config, compute_warpgroups=3, compute_registers=160, producer_registers=24,
        block_kv=128, pingpong="handoff")
  # Shrink the ring until it fits (interpret mode's P buffer included there).
  while (forward_smem_bytes(config, head_dim, 2, interpret=interpret)
         > SMEM_LIMIT_BYTES and config.num_stages > 1):
    config = dataclasses.replace(config, num_stages=config.num_stages - 1)
  check_fits(config, head_dim, 2, interpret=interpret)
  return config
