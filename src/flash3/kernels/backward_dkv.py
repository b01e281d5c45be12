"""The dk/dv kernel of the FlashAttention-3 backward (``flash3.kernels.backward``
describes both kernels and the algorithm): one CTA per (KV head, keys,
batch); its compute warpgroups hold K and V tiles (or share one, split by
role) and walk the query tiles of every query head of the GQA group that see
them, while a producer warpgroup streams q, do, lse and delta. With
``BackwardConfig.deterministic`` False it also adds dq by TMA reduce-add.
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


def dkv_call(q, k, v, do, lse2, delta, *, q_len, kv_len, scale, mask, config,
             interpret, outputs: tuple[str, ...], release_early: bool = False,
             lengths=None, bounds=None, segments=None, softcap=None, dq_mode=None):
  """Returns dk and/or dv (``outputs`` names which) in the input dtype.

  ``dq_mode`` (``BackwardConfig.deterministic`` False): also returns the
  unscaled float32 sum of ds @ k over all keys, (B, Tq buffer, N, D): "atomic"
  adds each tile's part into one zeroed float32 array with TMA reduce-add
  stores (GPU); "partials" stores each warpgroup's part (each CTA's, with
  ``config.share_dq``) into its own slice of a zeroed (B, kv tiles *
  warpgroups, Tq, N, D) and sums those in XLA (interpret mode, whose TMA has
  no reduce-add).

  q_len, kv_len are the true lengths; the arrays may be longer (padded).
  ``lengths``, ``bounds``, ``segments`` as in ``backward_dq.dq_call``, the segment ranges here being
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
  # config.pair_dq (validated: deterministic=False, so dq_mode is set): dq's
  # product is issued beside dk's, with share_dq or without.
  pair = overlap and config.pair_dq
  # config.share_dq: warpgroup w forms columns [w * half, (w + 1) * half) of
  # each query tile's dq from every warpgroup's dsT (double-buffered by step
  # parity in ds_smem2[parity * wgs + warpgroup]).
  share = dq_mode is not None and config.share_dq
  half = head_dim // wgs if share else head_dim
  extra = tiles.length_extras(q, k, v, do, lengths, bounds, block_q=bq,
                              block_kv=bk) + ((*segments,) if segments is not None else ())
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
    lens, edges, seg_refs = tiles.split_extras(extra_refs, lengths is not None,
                                               segments is not None, b)
    ql, kl = (q_len, kv_len) if lens is None else lens
    shift = mask.shift(ql, kl)

    def plan_of(k_lo):
      return tiles.rows_plan(
          k_lo, bk, bq, kl, lambda lo, hi: mask.query_range(lo, hi, shift, ql),
          lambda lo, hi: mask.full_query_range(lo, hi, shift, ql),
          None if seg_refs is None else
          lambda tile: [seg_refs[2][b, tile, i] for i in range(4)])

    kv_head = lax.axis_index(common.HEADS_AXIS)
    wg = lax.axis_index(common.WG_AXIS)
    cta_k_lo = lax.axis_index(common.KV_TILES_AXIS) * cta_keys
    cta_lo, cta_hi = tiles.union([plan_of(cta_k_lo + w * bk)
                                  for w in range(1 if roles else wgs)])
    tiles_per_head = cta_hi - cta_lo
    # Step i walks query head (i // tiles_per_head) of the group, query tile
    # cta_lo + i % tiles_per_head; all heads see the same tiles.
    num_steps = group * tiles_per_head
    slot_of = lambda i: lax.rem(i, jnp.int32(stages))

    def keep_of(t, k_lo, k_seg, sides=None, fresh=False):
      """Which (key, query) pairs of key tile k_lo, query tile t are visible
      (None: all). ``sides`` None: the pairwise rule; else each key row's
      query range against the columns, only the bounds in ``sides``
      (``BackwardConfig.dkv_row_bounds``); ``fresh``: from bounds passed
      through an optimization barrier, so that LLVM forms this keep anew
      instead of keeping an earlier one's predicates live across matmuls."""
      shape = (bk, bq)
      if sides is None:
        k_ids = k_lo + plgpu.broadcasted_iota(jnp.int32, shape, 0,
                                              layout=plgpu.Layout.WGMMA)
        q_ids = t * bq + plgpu.broadcasted_iota(jnp.int32, shape, 1,
                                                layout=plgpu.Layout.WGMMA)
        keep = mask.visible(q_ids, k_ids, shift) & (q_ids < ql) & (k_ids < kl)
      else:
        bounds = tile_mask.query_bounds(mask, k_lo, bk, shift, ql, kl)
        if fresh:
          bounds = tuple(lax.optimization_barrier(x) if jnp.ndim(x) else x
                         for x in bounds)
        keep = tile_mask.keep(bounds, t * bq, shape, sides)
      if seg_refs is not None:
        q_seg = plgpu.load(seg_refs[0].at[b, pl.ds(t * bq, bq)],
                           layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
        same_doc = (lax.broadcast_in_dim(k_seg, shape, [0])
                    == lax.broadcast_in_dim(q_seg, shape, [1]))
        keep = same_doc if keep is None else keep & same_doc
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
      t_lo, a, b_full, t_hi = tiles.own_sections(plan_of(k_lo), cta_lo, cta_hi)
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
        pT, th = tiles.probabilities(sT, lax.broadcast_in_dim(lse2_col, shape, [1]),
                                     scale=scale, softcap=softcap,
                                     fma_cols=config.exp2_fma_cols, guard=staged)
        if masked:
          pT = jnp.where(keep_of(t, k_lo, k_seg), pT, 0.0)
        p_ring.at[slot][...] = tiles.through_softcap(pT, th)
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
          name = "k" if role == 0 else "v"
          src = k_ref if role == 0 else v_ref
          end_tiles.copy_tile(src, edges.get(name), b, lax.div(k_lo, jnp.int32(bk)),
                              bk, kv_head, tile, bars.at[0])
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
      tiles.set_registers(wgs, compute=True, config=config)
      if roles:
        role_compute()
        return
      k_lo = cta_k_lo + wg * bk
      k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
      staging = staging2.at[wg] if staged else None
      keys = (b, pl.ds(k_lo, bk), kv_head)
      k_tile = lax.div(k_lo, jnp.int32(bk))
      end_tiles.copy_tile(k_ref, edges.get("k"), b, k_tile, bk, kv_head, k_smem,
                          k_bars.at[wg])
      end_tiles.copy_tile(v_ref, edges.get("v"), b, k_tile, bk, kv_head, v_smem,
                          v_bars.at[wg])
      plgpu.barrier_wait(k_bars.at[wg])
      plgpu.barrier_wait(v_bars.at[wg])
      t_lo, a, b_full, t_hi = tiles.own_sections(plan_of(k_lo), cta_lo, cta_hi)
      col = plgpu.Layout.WGMMA.reduce(0)
      ready = (q_bars, do_bars, lse_bars, delta_bars)

      def query_edge_tiles():
        """``tile_mask.edge_tiles`` over this warpgroup's key rows: the query
        ranges every row sees. A tile with rows past kv_len compares both
        bounds everywhere (those rows' upper bound, 0, cuts every tile): their
        K and V are 0, but p = exp2(-lse) may still overflow for a query with
        a very negative lse, and where dq is summed in this kernel inf * 0
        would reach it."""
        f_lo, f_hi = mask.full_query_range(k_lo, k_lo + bk, shift, ql)
        f_hi = jnp.where(k_lo + bk > kl, 0, f_hi)
        return tile_mask.edge_tiles((f_lo, f_hi), bq)
      k_seg = None
      if seg_refs is not None:  # This warpgroup's key ids, one per row.
        k_seg = plgpu.load(seg_refs[1].at[b, pl.ds(k_lo, bk)],
                           layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)

      def shared_dq(i, rows):
        """config.share_dq, step i (query rows ``rows``): (stage, pairs, use)
        as ``common.accumulate_pair``'s product takes them. stage puts this
        warpgroup's dsT in shared memory and waits for the other's; pairs
        form this warpgroup's columns of dq from both; use sends them."""
        parity = lax.rem(i, jnp.int32(2))
        cols = pl.ds(wg * half, half)

        def stage(ds):
          ds_smem2.at[parity * wgs + wg][...] = ds
          plgpu.commit_smem()
          # Both warpgroups wait for both dsT tiles. A warpgroup rewrites its
          # buffer of this parity two steps on, after the next step's wait,
          # which the other warpgroup passes only once its reads here are done.
          plgpu.barrier_arrive(ds_ready.at[parity])
          plgpu.barrier_wait(ds_ready.at[parity])

        pairs = lambda: [(ds_smem2.at[parity * wgs + u].transpose((1, 0)),
                          k_smem2.at[u].at[:, cols]) for u in range(wgs)]
        bb, q_rows, h = rows
        use = lambda part: _store_dq_tile(
            part, dq_stage2.at[wg], (bb, q_rows, h, cols),
            dq_acc=dq_refs.get("atomic"), dq_parts=dq_refs.get("partials"),
            slot=lax.axis_index(common.KV_TILES_AXIS))
        return stage, pairs, use

      def share_dq_tile(ds, i, rows):
        """Step i's dq for query rows ``rows``: this warpgroup's columns."""
        stage, pairs, use = shared_dq(i, rows)
        stage(ds)
        use(common.matmul_smem_sum(pairs(), (bq, half)))

      def step(t, carry, head_base, g, masked: bool, sides=None):
        dk, dv = carry
        slot = slot_of(head_base + t - cta_lo)
        q_smem, do_smem = q_ring.at[slot], do_ring.at[slot]
        plgpu.barrier_wait(q_bars.at[slot])
        plgpu.barrier_wait(lse_bars.at[slot])
        shape = (bk, bq)
        # The pairwise keep is formed once for both selects; the row bounds'
        # keep once for each (config.dkv_row_bounds).
        keep = keep_of(t, k_lo, k_seg) if masked and sides is None else None
        keep_p = (lambda: keep) if sides is None else (
            lambda: keep_of(t, k_lo, k_seg, sides))
        keep_ds = (lambda: keep) if sides is None else (
            lambda: keep_of(t, k_lo, k_seg, sides, fresh=True))
        lse2_col = plgpu.load(lse_ring.at[slot], layout=col)

        def probabilities(sT):
          pT, th = tiles.probabilities(sT, lax.broadcast_in_dim(lse2_col, shape, [1]),
                                       scale=scale, softcap=softcap,
                                       fma_cols=config.exp2_fma_cols, guard=staged)
          kp = keep_p() if masked else None
          pT = pT if kp is None else jnp.where(kp, pT, 0.0)
          if th is None or not config.fold_softcap:
            return pT, th
          # dv += pT do needs pT only in the input dtype, dsT only pT (1 - tanh^2):
          # one float32 tile lives on instead of two (config.fold_softcap).
          return pT.astype(dtype), tiles.through_softcap(pT, th)

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
          if th is not None and config.fold_softcap:  # th is pT (1 - tanh^2).
            pT, th = th, None
          dsT = tiles.through_softcap(
              pT * (dpT - lax.broadcast_in_dim(delta_col, shape, [1])), th)
          # Select, so NaN/inf in masked rows cannot leak.
          kd = keep_ds() if masked else None
          return dsT if kd is None else jnp.where(kd, dsT, 0.0)

        if overlap:
          # GPU, FlashAttention-3's order: sT and dpT issued together, pT
          # formed while dpT runs; dv += pT do issued, dsT formed while it
          # runs, then dk += dsT q; the slot is read until the last wait.
          plgpu.barrier_wait(do_bars.at[slot])
          plgpu.barrier_wait(delta_bars.at[slot])
          (pT, th), dpT = common.matmul_pair_first_then(
              (k_smem, q_smem.transpose((1, 0)), shape),
              (v_smem, do_smem.transpose((1, 0)), shape), probabilities,
              tiles.score_like(shape, softcap,
                               p_dtype=dtype if config.fold_softcap else None))
          make_ds = lambda: ds_of(pT, dpT, th).astype(dtype)
          if pair:
            # dq = ds k issued before dk += dsT q, and stored while dk runs.
            if share:
              product = shared_dq(head_base + t - cta_lo, dq_rows())
            else:
              product = (functools.partial(_stage_ds, ds_smem2.at[wg]),
                         lambda: [(ds_smem2.at[wg].transpose((1, 0)), k_smem)],
                         dq_sender())
            dv, dk, _ = common.accumulate_pair(
                dv, pT.astype(dtype), do_smem, dk, make_ds, q_smem,
                product=product)
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
        tiles.drain_loop(lo, hi, lambda t: slot_of(base + t - cta_lo), ready, consumed,
                         then=zero_dq if share else None)

      def head(g, carry):
        base = g * tiles_per_head
        skip(cta_lo, t_lo, base, g)
        def masked(lo, hi, edge, carry):
          # Low query tiles lie on each key's lower query bound, high ones on
          # its upper one (a window's left edge, q_len, or kv_len's rows).
          if not config.dkv_row_bounds:
            loops = [(lo, hi, None)]  # The pairwise rule.
          elif not config.one_sided_edges:
            loops = [(lo, hi, tile_mask.SIDES)]
          else:
            loops = tile_mask.edge_loops(lo, hi, edge, query_edge_tiles())
          for x, y, sides in loops:
            carry = lax.fori_loop(x, y, functools.partial(
                step, head_base=base, g=g, masked=True, sides=sides), carry)
          return carry

        carry = masked(t_lo, a, "lower", carry)
        carry = lax.fori_loop(a, b_full, functools.partial(
            step, head_base=base, g=g, masked=False), carry)
        carry = masked(b_full, t_hi, "upper", carry)
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
      tiles.set_registers(wgs, compute=False, config=config)

      def load(i):
        slot = slot_of(i)
        g = lax.div(i, jnp.maximum(tiles_per_head, 1))
        t = cta_lo + i - g * tiles_per_head
        h = kv_head * group + g
        vec = (b, h, pl.ds(t * bq, bq))
        end_tiles.copy_tile(q_ref, edges.get("q"), b, t, bq, h, q_ring.at[slot],
                            q_bars.at[slot])
        plgpu.copy_gmem_to_smem(lse_ref.at[vec], lse_ring.at[slot], lse_bars.at[slot])
        end_tiles.copy_tile(do_ref, edges.get("do"), b, t, bq, h, do_ring.at[slot],
                            do_bars.at[slot])
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


def _stage_ds(ds_smem, ds):
  """Puts dsT (keys x queries, registers) in shared memory, where dq's
  matmul reads it as the transposed left operand."""
  ds_smem[...] = ds
  plgpu.commit_smem()


def _dq_product(ds, ds_smem, k_smem):
  """ds^T @ k for one (key tile, query tile) pair, float32 (queries x D).

  ``ds`` is dsT (keys x queries) in registers; it goes through shared memory
  to be the transposed left operand. ``_store_dq_tile`` sends the result.
  """
  _stage_ds(ds_smem, ds)
  return common.matmul_smem(ds_smem.transpose((1, 0)), k_smem,
                            (ds.shape[1], k_smem.shape[1]))


def _store_dq_tile(part, dq_stage, rows, *, dq_acc, dq_parts, slot):
  """Sends one float32 dq tile ``part`` (query rows x its columns) by TMA
  through ``dq_stage``: a reduce-add into ``dq_acc`` (GPU), or a plain store
  into slice ``slot`` of ``dq_parts`` (interpret mode). ``rows`` is (b, query
  rows, head) or, for part of the columns, (b, query rows, head, columns).
  The previous tile's store must have read ``dq_stage`` first."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  dq_stage[...] = part
  plgpu.commit_smem()
  if dq_acc is not None:
    plgpu.copy_smem_to_gmem(dq_stage, dq_acc.at[rows], reduction_op="add")
  else:
    b, *rest = rows
    plgpu.copy_smem_to_gmem(dq_stage, dq_parts.at[(b, slot, *rest)])
