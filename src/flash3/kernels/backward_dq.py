"""The dq kernel of the FlashAttention-3 backward (``flash3.kernels.backward``
describes both kernels and the algorithm): one CTA per (query head,
``compute_wgs_dq * block_q_dq`` queries, batch); each compute warpgroup holds
its q, do, lse, delta tile and walks the key tiles its queries can see while a
producer warpgroup streams K and V through a ring of shared-memory slots.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from flash3.kernels import backward_tiles as tiles
from flash3.kernels import common, end_tiles, tile_mask


def _fused_delta(o_smem, do_smem, delta_smem, lse2_row, head_dim: int, has_dlse: bool):
  """``BackwardConfig.fuse_delta``: delta = rowsum(o * do) (- dlse, which
  ``delta_smem`` holds when ``has_dlse``) in float32, 0 where lse2 is +inf;
  left in ``delta_smem`` (committed, for its TMA store) and returned."""
  row = plgpu.Layout.WGMMA.reduce(1)
  # In 128-column pieces: two whole 64 x 256 tiles in registers spilled into
  # the dq loop at D = 256 (ptxas, docs/ptxas.md).
  wgmma, width = plgpu.Layout.WGMMA, min(head_dim, 128)
  delta_row = None
  for c in range(0, head_dim, width):
    cols = (slice(None), pl.ds(c, width))
    part = jnp.sum(
        plgpu.load(o_smem.at[cols], layout=wgmma).astype(jnp.float32)
        * plgpu.load(do_smem.at[cols], layout=wgmma).astype(jnp.float32), axis=1)
    delta_row = part if delta_row is None else delta_row + part
  if has_dlse:  # lse's cotangent: d lse_i / d s_ij = p_ij shifts delta.
    delta_row = delta_row - plgpu.load(delta_smem, layout=row)
    # Every thread's read of dlse before any write of delta over it.
    plgpu.commit_smem()
  # Rows that see nothing (lse2 +inf: past q_len, fully masked, padding) get 0,
  # as backward.py selects for the XLA delta: p = 0 there, and 0 * NaN would
  # poison ds.
  delta_row = jnp.where(lse2_row == jnp.inf, 0.0, delta_row)
  delta_smem[...] = delta_row
  plgpu.commit_smem()
  return delta_row


def dq_call(q, k, v, do, lse2, delta, *, q_len, kv_len, scale, mask, config,
            interpret, lengths=None, bounds=None, segments=None, softcap=None,
            o=None, dlse=None):
  """dq in the input dtype; q_len, kv_len are the true (buffer) lengths.

  ``o``: None, or (with ``delta`` None) the forward's output, shaped as q:
  then each warpgroup forms its rows' delta = rowsum(o * do) in float32 from
  an o tile (0 where lse2 is +inf: rows that see nothing) and the call
  returns (dq, delta), delta (B, N, lse2's length) for the dk/dv kernel
  (``BackwardConfig.fuse_delta``; the grid must cover every row of lse2).
  ``dlse``: None, or with ``o`` lse's cotangent (B, N, lse2's length)
  float32: delta = rowsum(o * do) - dlse.

  ``lengths``: None or (q_len, kv_len) (B,) int32 per-batch valid lengths;
  with them ``bounds``, the kept query rows and keys (``tiles.length_extras``).
  ``segments``: None or (q_ids, kv_ids, ranges): ids padded to whole tiles and
  the (B, query tiles, 4) key tile ranges of ``forward._segment_tile_ranges``.
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
  extra = tiles.length_extras(q, k, v, do, lengths, bounds, block_q=bq,
                              block_kv=bk) + ((*segments,) if segments is not None else ())
  fuse, has_dlse = o is not None, dlse is not None
  if has_dlse and not fuse:
    raise ValueError("dq_call: dlse is taken only with o (the fused delta)")
  if fuse and (delta is not None or num_q_tiles * wgs * bq != lse2.shape[2]):
    raise ValueError(
        f"dq_call: o is given with delta={None if delta is None else delta.shape} "
        f"and lse2 of {lse2.shape[2]} rows, where the grid covers "
        f"{num_q_tiles * wgs * bq}; the fused delta needs delta None and equal rows")

  def dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest):
    if has_dlse:
      dlse_ref, rest = rest[0], rest[1:]
    extra_refs, rest = rest[:len(extra)], list(rest[len(extra):])
    if fuse:  # o comes in delta's place; delta goes out beside dq.
      o_ref, delta_ref = delta_ref, None
      o_bars, o_smem2 = rest.pop(), rest.pop()
      dq_ref, delta_out = rest.pop(0), rest.pop(0)
    else:
      dq_ref = rest.pop(0)
    (q_smem2, do_smem2, lse_smem2, delta_smem2, k_ring, v_ring,
     staging2, q_bars, do_bars, lse_bars, delta_bars,
     k_bars, v_bars, consumed) = rest
    b = lax.axis_index(common.BATCH_AXIS)
    lens, edges, seg_refs = tiles.split_extras(extra_refs, lengths is not None,
                                               segments is not None, b)
    ql, kl = (q_len, kv_len) if lens is None else lens
    shift = mask.shift(ql, kl)

    def plan_of(q_lo):
      return tiles.rows_plan(
          q_lo, bq, bk, ql, lambda lo, hi: mask.key_range(lo, hi, shift, kl),
          lambda lo, hi: mask.full_key_range(lo, hi, shift, kl),
          None if seg_refs is None else
          lambda tile: [seg_refs[2][b, tile, i] for i in range(4)])

    h = lax.axis_index(common.HEADS_AXIS)
    wg = lax.axis_index(common.WG_AXIS)
    kv_head = lax.div(h, jnp.int32(group))
    cta_q_lo = common.grid_index(common.Q_TILES_AXIS, num_q_tiles,
                                 config.reverse_q_tiles) * (wgs * bq)
    cta_lo, cta_hi = tiles.union([plan_of(cta_q_lo + w * bq) for w in range(wgs)])
    num_steps = cta_hi - cta_lo
    slot_of = lambda t: lax.rem(t - cta_lo, jnp.int32(stages))

    @pl.when(wg < wgs)
    def _compute():
      tiles.set_registers(wgs, compute=True, config=config)
      q_lo = cta_q_lo + wg * bq
      q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
      lse_smem, delta_smem = lse_smem2.at[wg], delta_smem2.at[wg]
      staging = staging2.at[wg] if staged else None
      rows = (b, pl.ds(q_lo, bq), h)
      q_tile = lax.div(q_lo, jnp.int32(bq))
      end_tiles.copy_tile(q_ref, edges.get("q"), b, q_tile, bq, h, q_smem,
                          q_bars.at[wg])
      end_tiles.copy_tile(do_ref, edges.get("do"), b, q_tile, bq, h, do_smem,
                          do_bars.at[wg])
      vec = (b, h, pl.ds(q_lo, bq))
      plgpu.copy_gmem_to_smem(lse_ref.at[vec], lse_smem, lse_bars.at[wg])
      if fuse:
        # Rows of o outside a batch row's lengths may hold anything: their
        # delta is selected to 0 below, row by row, so no end tiles for o.
        o_smem = o_smem2.at[wg]
        plgpu.copy_gmem_to_smem(o_ref.at[rows], o_smem, o_bars.at[wg])
        waits = (q_bars, do_bars, lse_bars, o_bars)
        if has_dlse:  # Into delta's buffer: delta itself is not loaded.
          plgpu.copy_gmem_to_smem(dlse_ref.at[vec], delta_smem, delta_bars.at[wg])
          waits += (delta_bars,)
      else:
        plgpu.copy_gmem_to_smem(delta_ref.at[vec], delta_smem, delta_bars.at[wg])
        waits = (q_bars, do_bars, lse_bars, delta_bars)
      for bars in waits:
        plgpu.barrier_wait(bars.at[wg])
      row = plgpu.Layout.WGMMA.reduce(1)
      lse2_row = plgpu.load(lse_smem, layout=row)
      if fuse:
        delta_row = _fused_delta(o_smem, do_smem, delta_smem, lse2_row, head_dim,
                                 has_dlse)
        plgpu.copy_smem_to_gmem(delta_smem, delta_out.at[vec])
      else:
        delta_row = plgpu.load(delta_smem, layout=row)
      t_lo, a, b_full, t_hi = tiles.own_sections(plan_of(q_lo), cta_lo, cta_hi)
      if seg_refs is not None:  # This warpgroup's query ids, one per row.
        q_seg = plgpu.load(seg_refs[0].at[b, pl.ds(q_lo, bq)], layout=row,
                           optimized=False)

      def step(t, dq, masked: bool, sides=tile_mask.SIDES):
        slot = slot_of(t)
        k_smem, v_smem = k_ring.at[slot], v_ring.at[slot]
        plgpu.barrier_wait(k_bars.at[slot])
        shape = (bq, bk)
        if masked and seg_refs is not None:
          k_seg = plgpu.load(seg_refs[1].at[b, pl.ds(t * bk, bk)],
                             layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)

        def keep_of():
          """The tile's keep (None: all visible)."""
          # Rows past q_len see nothing by the upper bound; with ("lo",) they
          # see more, harmlessly: their dq is selected to 0 below.
          keep = tile_mask.keep(
              tile_mask.key_bounds(mask, q_lo, bq, shift, kl,
                                   None if lens is None else ql), t * bk, shape,
              sides)
          if seg_refs is not None:
            same_doc = (lax.broadcast_in_dim(q_seg, shape, [0])
                        == lax.broadcast_in_dim(k_seg, shape, [1]))
            keep = same_doc if keep is None else keep & same_doc
          return keep

        fold = softcap is not None and config.fold_softcap

        def probabilities(s):
          # The keep formed here, once the scores' matmul is issued: formed
          # before it, LLVM carried it across the matmuls as packed bits
          # (about 200 LOP3 per tile; the backward 0.4-2.5% slower on an
          # H200, fortieth session, docs/ptxas.md).
          keep = keep_of() if masked else None
          p, th = tiles.probabilities(s, lax.broadcast_in_dim(lse2_row, shape, [0]),
                                      scale=scale, softcap=softcap,
                                      fma_cols=config.exp2_fma_cols, guard=staged)
          p = p if keep is None else jnp.where(keep, p, 0.0)
          if th is not None and fold:
            # ds needs only p (1 - tanh^2): one float32 tile lives on instead
            # of two (config.fold_softcap). For zero_where_unseen it is 0
            # where p is (a masked pair, with a finite tanh), where tanh
            # saturated (there ds is 0 anyway) or where the product underflows.
            return tiles.through_softcap(p, th), None
          return p, th

        if overlap:  # GPU: s and dp issued together, p formed while dp runs.
          plgpu.barrier_wait(v_bars.at[slot])
          (p, th), dp = common.matmul_pair_first_then(
              (q_smem, k_smem.transpose((1, 0)), shape),
              (do_smem, v_smem.transpose((1, 0)), shape), probabilities,
              tiles.score_like(shape, None if fold else softcap))
        else:
          p, th = probabilities(common.matmul_smem(
              q_smem, k_smem.transpose((1, 0)), shape))
          plgpu.barrier_wait(v_bars.at[slot])
          dp = common.matmul_smem(do_smem, v_smem.transpose((1, 0)), shape)
        ds = tiles.through_softcap(
            p * (dp - lax.broadcast_in_dim(delta_row, dp.shape, [0])), th)
        if masked:
          ds = tiles.zero_where_unseen(ds, p)
        dq = common.accumulate_register_lhs(dq, ds.astype(dtype), k_smem,
                                            staging=staging)
        plgpu.barrier_arrive(consumed.at[slot])
        return dq

      dq = plgpu.layout_cast(jnp.zeros((bq, head_dim), jnp.float32),
                             plgpu.Layout.WGMMA)
      tiles.drain_loop(cta_lo, t_lo, slot_of, (k_bars, v_bars), consumed)

      def masked_loop(lo, hi, dq, sides=tile_mask.SIDES):
        return lax.fori_loop(lo, hi, functools.partial(step, masked=True,
                                                       sides=sides), dq)

      # Masked tiles that only the lower (first loop) or only the upper (last
      # loop) bound can cut compare that one (tile_mask.edge_tiles, over this
      # warpgroup's rows below q_len). Each split point is formed where its
      # loops run, not live across the others.
      def masked_loops(lo, hi, edge, dq):
        if mask.left is None or not config.one_sided_edges:
          return masked_loop(lo, hi, dq)
        cuts = tile_mask.edge_tiles(
            mask.full_key_range(q_lo, jnp.minimum(q_lo + bq, ql), shift, kl), bk)
        for x, y, sides in tile_mask.edge_loops(lo, hi, edge, cuts):
          dq = masked_loop(x, y, dq, sides)
        return dq

      dq = masked_loops(t_lo, a, "lower", dq)
      dq = lax.fori_loop(a, b_full, functools.partial(step, masked=False), dq)
      dq = masked_loops(b_full, t_hi, "upper", dq)
      tiles.drain_loop(t_hi, cta_hi, slot_of, (k_bars, v_bars), consumed)
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
      tiles.set_registers(wgs, compute=False, config=config)

      def load(t):
        slot = slot_of(t)
        end_tiles.copy_tile(k_ref, edges.get("k"), b, t, bk, kv_head,
                            k_ring.at[slot], k_bars.at[slot])
        end_tiles.copy_tile(v_ref, edges.get("v"), b, t, bk, kv_head,
                            v_ring.at[slot], v_bars.at[slot])

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
  out_type = jax.ShapeDtypeStruct(q.shape, dtype)
  if fuse:
    scratch += [tile(wgs, bq, head_dim), plgpu.Barrier(num_barriers=wgs)]  # o
    out_type = (out_type, jax.ShapeDtypeStruct(lse2.shape, jnp.float32))
  return plgpu.kernel(
      dq_kernel,
      out_type=out_type,
      scratch_types=scratch,
      grid=(num_heads, num_q_tiles, batch),
      grid_names=(common.HEADS_AXIS, common.Q_TILES_AXIS, common.BATCH_AXIS),
      num_threads=wgs + 1,
      thread_name=common.WG_AXIS,
      # With the o tile, D = 128 and 256 fit only without Pallas's 2 KB of
      # cross-warp reduction scratch: the kernel reduces along rows only,
      # within a warp (a cross-warp reduction would fail to lower,
      # tests/test_forward_kernel.py).
      compiler_params=plgpu.CompilerParams(
          approx_math=True, **(dict(reduction_scratch_bytes=0) if fuse else {})),
      interpret=common.interpret_params(interpret),
  )(q, k, v, do, lse2, o if fuse else delta, *((dlse,) if has_dlse else ()), *extra)
