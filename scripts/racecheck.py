"""Tiny calls of every kernel for `compute-sanitizer --tool racecheck` on an H100/H200.

Runs the forward (plain, causal bottom-right, lengths + segments + softcap + sinks)
and the backward kernels (dq, dk/dv) through the public API, at B=1, T=192, N=2, K=1,
then the persistent forward (plain, causal, causal packed documents) with 2 CTAs
looping over the work items, D=256's default forward (the lazy softmax),
causal D=64's default (256-key tiles, a 2-slot ring that wraps, persistent),
the forward with overlapped softmax (grid, persistent), the other ping-pong modes, exp2 on the FMA pipes,
and the single-kernel backward (dq by TMA reduce-add; per warpgroup and shared),
and both backwards in the plain matmul order (overlap_matmuls=False); last, D=128's
192-key tiles (its non-causal default for long keys), and the dk/dv kernel split
by role (``BackwardConfig.role_split``) at D = 64, 192 (with two dq warpgroups)
and 256, with lengths, segments and a soft cap.

``--only role_split`` runs that group alone (a kernel new since the last
full run, checked in a short device call); ``--only lengths`` the loads of
the lengths' end tiles (also run last in a full run); ``--only shared_pair``
the single-kernel backward with a shared dq tile paired with dk's matmul;
``--only fused`` the forward with P @ V and the next Q K^T issued together;
``--only overlap`` the overlapped softmax in the persistent kernel at D = 128;
``--only softcap`` the backward's folded soft cap on its GPU-only paths;
``--only defer`` the persistent forward's deferred epilogue;
``--only warpgroups`` the forward with three compute warpgroups;
``--only window`` windows' one-sided edge tiles and the dk/dv kernel's row bounds;
``--only off_turn`` the forward's epilogue off the ping-pong turn
(``epilogue_off_turn``); ``--only overlap`` also runs P in registers;
``--only trim`` the forward's trimmed end tile (``trim_end_tile``);
``--only delta`` the backward's delta formed in the dq kernel (``fuse_delta``);
``--only block_q128`` the forward with 128 query rows per warpgroup;
``--only fma_exponent`` the forward's exp2 argument as one FMA (``fma_exponent``);
``--only dkv_causal`` the dk/dv kernel's row bounds on plain causal.
"""
import argparse
import sys

import jax
import jax.numpy as jnp

import flash3
from flash3.kernels.backward import BackwardConfig, attention_backward
from flash3.visibility import MaskSpec


def role_split_cases():
  """The dk/dv kernel's warpgroups split by role: pT handed over per ring slot
  (300 queries: 5 tiles of 64 and 2 heads of a GQA group wrap a 2-slot ring).
  Three documents of 100 tokens, causal bottom-right with lengths 290 / 280
  (query i sees keys up to i - 10 of its own document): most tiles are
  visible, and the run fails unless dk and dv get nonzero entries."""
  keys = jax.random.split(jax.random.key(1), 4)
  for d in (64, 192, 256):
    qr = jax.random.normal(keys[0], (1, 300, 2, d), jnp.bfloat16)
    kr, vr = (jax.random.normal(kk, (1, 300, 1, d), jnp.bfloat16) for kk in keys[1:3])
    ids = jnp.repeat(jnp.arange(3), 100)[None]
    # D = 192: the dq kernel with two warpgroups, its default there since the
    # sixteenth session.
    config = BackwardConfig(block_kv_dq=64, compute_wgs_dq=2 if d == 192 else 1,
                            block_q_dkv=64, num_stages=2, role_split=True)
    grads = attention_backward(
        qr, kr, vr, qr, jnp.zeros((1, 2, 300), jnp.float32), qr, scale=0.1,
        mask=MaskSpec(causal=True, alignment="bottom_right"), config=config,
        q_lengths=jnp.array([290], jnp.int32), kv_lengths=jnp.array([280], jnp.int32),
        q_segment_ids=ids, kv_segment_ids=ids, softcap=20.0)
    finite = all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in grads)
    nonzero = [int(jnp.count_nonzero(g)) for g in grads]
    print(f"role-split dk/dv, D={d}: finite {finite}, nonzero (dq, dk, dv) {nonzero}")
    if not (finite and min(nonzero) > 0):
      raise SystemExit(f"role-split case D={d} computed nothing or non-finite values")


def lengths_cases():
  """Per-batch lengths, whose first and last tiles of q, do, k and v the
  kernels load from side arrays (kernels/end_tiles.py): a window under
  the bottom_right shift cuts both ends, through several tiles of each
  (forward grid and persistent; both backward kernels)."""
  from flash3.kernels.config import ForwardConfig
  from flash3.kernels.forward import attention_forward
  keys = jax.random.split(jax.random.key(2), 4)
  q, do = (jax.random.normal(kk, (2, 300, 2, 64), jnp.bfloat16) for kk in keys[:2])
  k, v = (jax.random.normal(kk, (2, 300, 1, 64), jnp.bfloat16) for kk in keys[2:])
  mask = MaskSpec(causal=True, alignment="bottom_right", window_left=30)
  lens = dict(q_lengths=jnp.array([100, 300], jnp.int32),
              kv_lengths=jnp.array([290, 201], jnp.int32))
  for persistent in (False, True):
    config = ForwardConfig(block_kv=64, persistent=persistent, num_sms=2)
    o, lse = attention_forward(q, k, v, scale=0.125, mask=mask, config=config, **lens)
    print(f"lengths forward, persistent={persistent}: finite "
          f"{bool(jnp.isfinite(o.astype(jnp.float32)).all())}, nonzero {bool(jnp.any(o != 0))}")
  grads = attention_backward(q, k, v, o, lse, do, scale=0.125, mask=mask,
                             config=BackwardConfig(block_kv_dq=64, block_q_dkv=64), **lens)
  finite = all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in grads)
  nonzero = [int(jnp.count_nonzero(g)) for g in grads]
  print(f"lengths backward: finite {finite}, nonzero (dq, dk, dv) {nonzero}")
  if not (finite and min(nonzero) > 0):
    raise SystemExit("lengths backward computed nothing or non-finite values")


def shared_pair_cases():
  """The single-kernel backward at D = 128 with the dq tile shared by the two
  warpgroups and its matmul issued beside dk's (share_dq with pair_dq): the
  dsT exchange through a double buffer per step parity, and dq's half tiles
  sent by reduce-add while dk's matmul runs. Causal bottom-right, 300 queries
  (5 tiles, the last ragged) over 260 keys, GQA 2: the two warpgroups' keys
  see different query tiles, so one takes part in the other's dq with a zero
  dsT."""
  keys = jax.random.split(jax.random.key(3), 4)
  q = jax.random.normal(keys[0], (1, 300, 2, 128), jnp.bfloat16)
  k, v = (jax.random.normal(kk, (1, 260, 1, 128), jnp.bfloat16) for kk in keys[1:3])
  do = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
  mask = MaskSpec(causal=True, alignment="bottom_right")
  from flash3.kernels.forward import attention_forward
  o, lse = attention_forward(q, k, v, scale=0.09, mask=mask)
  grads = attention_backward(
      q, k, v, o, lse, do, scale=0.09, mask=mask,
      config=BackwardConfig(block_q_dkv=64, deterministic=False, share_dq=True,
                            pair_dq=True))
  finite = all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in grads)
  nonzero = [int(jnp.count_nonzero(g)) for g in grads]
  print(f"single-kernel backward, shared dq paired with dk: finite {finite}, "
        f"nonzero (dq, dk, dv) {nonzero}")
  if not (finite and min(nonzero) > 0):
    raise SystemExit("shared paired dq computed nothing or non-finite values")


def fused_cases():
  """The forward with each tile's P @ V and the next tile's Q K^T issued back
  to back (ForwardConfig.fuse_pv_qk): grid and persistent (2 CTAs), causal
  bottom-right with GQA 2 over a 2-slot ring that wraps (200 keys, 64-key
  tiles), the same at D = 256 (its default since the twenty-fourth session,
  with the hand-off ping-pong), and D = 128 without a mask (one 128-key tile
  per CTA: Q K^T, then P @ V alone)."""
  from flash3.kernels.config import ForwardConfig
  from flash3.kernels.forward import attention_forward
  keys = jax.random.split(jax.random.key(4), 3)
  for d, bk, mask in ((64, 64, MaskSpec(causal=True, alignment="bottom_right")),
                      (128, 128, MaskSpec()),
                      (256, 64, MaskSpec(causal=True, alignment="bottom_right"))):
    q = jax.random.normal(keys[0], (1, 192, 2, d), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (1, 100 if d == 128 else 200, 1, d), jnp.bfloat16)
            for kk in keys[1:])
    for persistent in (False, True):
      config = ForwardConfig(block_kv=bk, fuse_pv_qk=True, persistent=persistent,
                             num_sms=2, pingpong="handoff" if d == 256 else "meeting")
      o, lse = attention_forward(q, k, v, scale=0.125, mask=mask, config=config)
      ok = bool(jnp.isfinite(o.astype(jnp.float32)).all()) and bool(jnp.any(o != 0))
      print(f"fused P @ V and Q K^T, D={d}, persistent={persistent}: finite and nonzero {ok}")
      if not ok:
        raise SystemExit(f"fused case D={d} computed nothing or non-finite values")


def overlap_cases():
  """The overlapped softmax (ForwardConfig.overlap_softmax) in the persistent
  kernel at D = 128, where the next item's q is issued in each item's last
  step (it never was, and the kernel hung, until the twenty-fifth session): a
  causal window over 384 keys, 2 CTAs with 3 items each."""
  from flash3.kernels.config import ForwardConfig
  from flash3.kernels.forward import attention_forward
  q, k = (jax.random.normal(jax.random.key(i), (1, 384, 2, 128), jnp.bfloat16)
          for i in (21, 22))
  mask = MaskSpec(causal=True, window_left=100, alignment="bottom_right")
  # P through shared memory, then P carried in registers (overlap_p_registers).
  for regs in (False, True):
    o, _ = attention_forward(
        q, k, k, scale=0.09, mask=mask,
        config=ForwardConfig(block_kv=64, overlap_softmax=True, persistent=True,
                             num_sms=2, overlap_p_registers=regs))
    ok = bool(jnp.isfinite(o.astype(jnp.float32)).all()) and bool(jnp.any(o != 0))
    print(f"overlapped softmax, persistent D=128 window, P in registers {regs}: "
          f"finite and nonzero {ok}")
    if not ok:
      raise SystemExit("overlap case computed nothing or non-finite values")


def off_turn_cases():
  """Each warpgroup's epilogue off its ping-pong turn
  (``ForwardConfig.epilogue_off_turn``): the o / lse staging tiles and the
  next q while the other warpgroup's last P @ V runs; the persistent kernel
  (2 CTAs, several items each, o apart from q at D = 64 and in it at D = 256)
  and the grid kernel, hand-off and meeting turns."""
  from flash3.kernels.config import ForwardConfig
  from flash3.kernels.forward import attention_forward
  for d, fields in ((64, dict(persistent=True, num_sms=2, pingpong="handoff")),
                    (128, dict(persistent=True, num_sms=2, pingpong="meeting")),
                    (256, dict(persistent=True, num_sms=2, pingpong="handoff")),
                    (128, dict(pingpong="handoff"))):
    q, k = (jax.random.normal(jax.random.key(i), (1, 384, 2, d), jnp.bfloat16)
            for i in (31, 32))
    mask = MaskSpec(causal=True, window_left=100, alignment="bottom_right")
    o, _ = attention_forward(q, k, k, scale=0.09, mask=mask, config=ForwardConfig(
        block_kv=64, epilogue_off_turn=True, **fields))
    ok = bool(jnp.isfinite(o.astype(jnp.float32)).all()) and bool(jnp.any(o != 0))
    print(f"epilogue off the turn, D={d} {fields}: finite and nonzero {ok}")
    if not ok:
      raise SystemExit(f"off-turn case D={d} computed nothing or non-finite values")


def trim_cases():
  """The key tile holding the last key computed in part
  (``ForwardConfig.trim_end_tile``): 192-key tiles over 256 and 300 keys (64
  and 128 of the last tile's keys), grid and persistent kernels, and with
  half edge tiles (256-key tiles, causal)."""
  from flash3.kernels.config import ForwardConfig
  from flash3.kernels.forward import attention_forward
  for d, tk, mask, fields in (
      (128, 256, MaskSpec(), dict(block_kv=192)),
      (128, 300, MaskSpec(), dict(block_kv=192, persistent=True, num_sms=2)),
      (64, 300, MaskSpec(causal=True), dict(block_kv=256, half_edge_tiles=True))):
    q = jax.random.normal(jax.random.key(41), (1, 256, 2, d), jnp.bfloat16)
    k = jax.random.normal(jax.random.key(42), (1, tk, 2, d), jnp.bfloat16)
    o, _ = attention_forward(q, k, k, scale=0.09, mask=mask, config=ForwardConfig(
        trim_end_tile=True, **fields))
    ok = bool(jnp.isfinite(o.astype(jnp.float32)).all()) and bool(jnp.any(o != 0))
    print(f"trimmed end tile, D={d} Tk={tk} {fields}: finite and nonzero {ok}")
    if not ok:
      raise SystemExit(f"trim case D={d} Tk={tk} computed nothing or non-finite values")


def block_q128_cases():
  """128 query rows per compute warpgroup (``ForwardConfig.block_q=128``, D <= 64):
  two wgmma M tiles per matmul, grid and persistent kernels, causal with
  documents, and a window with the hand-off ping-pong."""
  from flash3.kernels.config import ForwardConfig
  from flash3.kernels.forward import attention_forward
  ids = jnp.repeat(jnp.arange(3), 100)[None]
  for mask, fields, seg in (
      (MaskSpec(causal=True), dict(block_kv=64), False),
      (MaskSpec(), dict(block_kv=64, persistent=True, num_sms=2), False),
      (MaskSpec(causal=True), dict(block_kv=64), True),
      (MaskSpec(causal=True, window_left=90), dict(block_kv=64, pingpong="handoff"), False)):
    q = jax.random.normal(jax.random.key(43), (1, 300, 2, 64), jnp.bfloat16)
    k = jax.random.normal(jax.random.key(44), (1, 300, 1, 64), jnp.bfloat16)
    kw = dict(q_segment_ids=ids, kv_segment_ids=ids) if seg else {}
    o, _ = attention_forward(q, k, k, scale=0.125, mask=mask,
                             config=ForwardConfig(block_q=128, **fields), **kw)
    ok = bool(jnp.isfinite(o.astype(jnp.float32)).all()) and bool(jnp.any(o != 0))
    print(f"block_q=128, {mask} {fields} segments {seg}: finite and nonzero {ok}")
    if not ok:
      raise SystemExit(f"block_q=128 case {fields} computed nothing or non-finite values")


def fma_exponent_cases():
  """exp2's argument as one FMA per score (``ForwardConfig.fma_exponent``):
  D = 64 and 128, causal and a window; its warp vote touches no shared
  memory, but the loop around it was rebuilt."""
  from flash3.kernels.config import ForwardConfig
  from flash3.kernels.forward import attention_forward
  for d, mask in ((64, MaskSpec(causal=True)), (128, MaskSpec(causal=True, window_left=90))):
    q = jax.random.normal(jax.random.key(45), (1, 256, 2, d), jnp.bfloat16)
    k = jax.random.normal(jax.random.key(46), (1, 256, 1, d), jnp.bfloat16)
    o, _ = attention_forward(q, k, k, scale=0.125, mask=mask, config=ForwardConfig(
        block_kv=64, scale_first=False, fma_exponent=True))
    ok = bool(jnp.isfinite(o.astype(jnp.float32)).all()) and bool(jnp.any(o != 0))
    print(f"fma_exponent, D={d} {mask}: finite and nonzero {ok}")
    if not ok:
      raise SystemExit(f"fma_exponent case D={d} computed nothing or non-finite values")


def schedule_cases():
  """Causal D = 128's default forward, persistent since the twenty-sixth
  session up to 4096 keys, with its schedule in chunks of the grid's order
  (one round of 2 CTAs each: 8 items of unequal length in 4 chunks), and
  packed documents on the same schedule built on the device."""
  import dataclasses
  from flash3.kernels.forward import attention_forward, default_config
  q, k = (jax.random.normal(jax.random.key(i), (1, 512, 2, 128), jnp.bfloat16)
          for i in (31, 32))
  mask = MaskSpec(causal=True, alignment="bottom_right")
  config = dataclasses.replace(default_config(128, jnp.bfloat16, mask, 512, 512),
                               num_sms=2, schedule_rounds=1)
  assert config.persistent, config
  ids = jnp.repeat(jnp.arange(4), 128)[None]
  for name, seg in (("causal", {}),
                    ("causal documents", dict(q_segment_ids=ids, kv_segment_ids=ids))):
    o, _ = attention_forward(q, k, k, scale=0.09, mask=mask, config=config, **seg)
    ok = bool(jnp.isfinite(o.astype(jnp.float32)).all()) and bool(jnp.any(o != 0))
    print(f"persistent D=128 {name}, schedule in chunks: finite and nonzero {ok}")
    if not ok:
      raise SystemExit(f"schedule case {name} computed nothing or non-finite values")


def _check_grads(grads, label: str) -> None:
  """Prints whether (dq, dk, dv) are finite and nonzero; exits if not."""
  finite = all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in grads)
  nonzero = [int(jnp.count_nonzero(g)) for g in grads]
  print(f"{label}: finite {finite}, nonzero (dq, dk, dv) {nonzero}")
  if not (finite and min(nonzero) > 0):
    raise SystemExit(f"{label}: computed nothing or non-finite values")


def softcap_cases():
  """The backward with a soft cap, 1 - tanh^2 folded into p
  (``BackwardConfig.fold_softcap``, the default since the twenty-seventh
  session) on the paths interpret mode never runs: the default overlapped
  order at D = 64, 128 and 256 (role split), the plain order with
  ``fuse_matmuls``, and the single kernel with ``pair_dq``. Causal
  bottom-right, 192 queries over 200 keys (the last key tile ragged), GQA 2."""
  from flash3.kernels.forward import attention_forward
  keys = jax.random.split(jax.random.key(5), 4)
  mask = MaskSpec(causal=True, alignment="bottom_right")
  cases = [(64, None), (128, None), (256, None),
           (64, BackwardConfig(overlap_matmuls=False, fuse_matmuls=True)),
           (64, BackwardConfig(block_q_dkv=64, deterministic=False, pair_dq=True))]
  for d, config in cases:
    q, do = (jax.random.normal(kk, (1, 192, 2, d), jnp.bfloat16) for kk in keys[:2])
    k, v = (jax.random.normal(kk, (1, 200, 1, d), jnp.bfloat16) for kk in keys[2:])
    o, lse = attention_forward(q, k, v, scale=0.2, mask=mask, softcap=10.0)
    grads = attention_backward(q, k, v, o, lse, do, scale=0.2, mask=mask,
                               softcap=10.0, config=config)
    _check_grads(grads, f"soft-cap backward, D={d}, config={config}")


def defer_cases():
  """The persistent forward with each item's epilogue deferred into the next
  item's first step (``ForwardConfig.defer_epilogue``): the o / lse staging
  tiles written while the next Q K^T runs and the previous stores may still
  read them. 2 CTAs with several items each: D = 64 plain, D = 128 causal
  with half edge tiles, and packed documents with a window (items whose
  warpgroup sees no key tile)."""
  from flash3.kernels.config import ForwardConfig
  from flash3.kernels.forward import attention_forward
  ids = jnp.repeat(jnp.arange(4), 96)[None]
  cases = [(64, MaskSpec(), dict(block_kv=128), {}),
           (128, MaskSpec(causal=True, alignment="bottom_right"),
            dict(block_kv=128, half_edge_tiles=True, reverse_q_tiles=True), {}),
           (64, MaskSpec(causal=True, window_left=70), dict(block_kv=64),
            dict(q_segment_ids=ids, kv_segment_ids=ids))]
  for d, mask, fields, seg in cases:
    q, k = (jax.random.normal(jax.random.key(i), (1, 384, 2, d), jnp.bfloat16)
            for i in (41, 42))
    config = ForwardConfig(persistent=True, num_sms=2, defer_epilogue=True, **fields)
    o, _ = attention_forward(q, k, k, scale=0.1, mask=mask, config=config, **seg)
    ok = bool(jnp.isfinite(o.astype(jnp.float32)).all()) and bool(jnp.any(o != 0))
    print(f"deferred epilogue, D={d}, {mask}, segments={bool(seg)}: finite and nonzero {ok}")
    if not ok:
      raise SystemExit(f"deferred epilogue case D={d} computed nothing or non-finite values")


def warpgroups_cases():
  """The forward with three compute warpgroups (``ForwardConfig.
  compute_warpgroups=3``, 192 query rows per CTA, the turns round all three):
  the grid kernel without a mask (a CTA whose third warpgroup has no row),
  and the persistent kernel causal with half edge tiles and with the
  deferred epilogue."""
  from flash3.kernels.config import ForwardConfig
  from flash3.kernels.forward import attention_forward
  three = dict(compute_warpgroups=3, compute_registers=160, producer_registers=24,
               pingpong="handoff", block_kv=128)
  causal = MaskSpec(causal=True, alignment="bottom_right")
  cases = [(300, MaskSpec(), dict()),
           (400, causal, dict(persistent=True, num_sms=2, half_edge_tiles=True,
                              reverse_q_tiles=True)),
           (400, causal, dict(persistent=True, num_sms=2, defer_epilogue=True))]
  for t, mask, fields in cases:
    q, k = (jax.random.normal(jax.random.key(i), (1, t, 2, 64), jnp.bfloat16)
            for i in (51, 52))
    config = ForwardConfig(**three, **fields)
    o, _ = attention_forward(q, k, k, scale=0.1, mask=mask, config=config)
    ok = bool(jnp.isfinite(o.astype(jnp.float32)).all()) and bool(jnp.any(o != 0))
    print(f"three warpgroups, T={t}, {mask}, {fields}: finite and nonzero {ok}")
    if not ok:
      raise SystemExit(f"three-warpgroup case T={t} computed nothing or non-finite values")


def window_cases():
  """Windows through the public API, forward and gradients at D = 64 and 128
  (their defaults: the forward's and dq kernel's one-sided edge loops, the
  dk/dv kernel's row bounds): a causal window of 130 over 400 keys (both
  edges cut by one bound each) and a narrow two-sided window (20, 9) with
  lengths (tiles both bounds cut)."""
  cases = [dict(is_causal=True, local_window_size=(130, 0)),
           dict(local_window_size=(20, 9), query_seq_lengths=jnp.array([390]),
                key_value_seq_lengths=jnp.array([333]))]
  for d in (64, 128):
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 400, 2, d), jnp.bfloat16)
               for i in (61, 62, 63))
    for kw in cases:
      def loss(q, k, v, kw=kw):
        o = flash3.dot_product_attention(q, k, v, implementation="mosaic", **kw)
        return (o.astype(jnp.float32) ** 2).sum()
      value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
      ok = bool(jnp.isfinite(value)) and all(
          bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in grads)
      print(f"window D={d} {kw}: loss {float(value):.4g}, finite {ok}")
      if not ok:
        raise SystemExit(f"window case D={d} {kw}: non-finite values")


def delta_cases():
  """The backward with delta formed in the dq kernel (``BackwardConfig.fuse_delta``):
  the o and dlse tiles' loads, the row sums and delta's store, at D = 64, 128
  and 256 (one dq warpgroup), causal bottom-right with rows that see no key,
  and with lengths. Each run's dq, dk, dv must be finite and nonzero."""
  import dataclasses
  from flash3.kernels.forward import attention_forward
  keys = jax.random.split(jax.random.key(6), 5)
  mask = MaskSpec(causal=True, alignment="bottom_right")
  for d, lengths in ((64, False), (128, False), (256, False), (128, True)):
    q, do = (jax.random.normal(kk, (1, 264, 2, d), jnp.bfloat16) for kk in keys[:2])
    k, v = (jax.random.normal(kk, (1, 200, 1, d), jnp.bfloat16) for kk in keys[2:4])
    dlse = jax.random.normal(keys[4], (1, 2, 264))
    lens = dict(q_lengths=jnp.array([250]), kv_lengths=jnp.array([190])) if lengths else {}
    o, lse = attention_forward(q, k, v, scale=0.2, mask=mask, **lens)
    config = dataclasses.replace(BackwardConfig.heuristic(d, 264, 200, mask),
                                 fuse_delta=True)
    grads = attention_backward(q, k, v, o, lse, do, scale=0.2, mask=mask,
                               config=config, dlse=dlse, **lens)
    _check_grads(grads, f"fused delta backward, D={d}, lengths {lengths}")


def dkv_causal_cases():
  """The dk/dv kernel's row bounds on plain causal (``BackwardConfig.
  dkv_row_bounds``: its diagonal query tiles in a loop comparing each key's
  lower query bound alone), D = 64 and 128, top-left with a ragged last query
  tile and bottom-right with lengths."""
  import dataclasses
  from flash3.kernels.forward import attention_forward
  keys = jax.random.split(jax.random.key(7), 4)
  for d, mask, lens in (
      (64, MaskSpec(causal=True), {}),
      (128, MaskSpec(causal=True, alignment="bottom_right"),
       dict(q_lengths=jnp.array([250]), kv_lengths=jnp.array([190])))):
    q, do = (jax.random.normal(kk, (1, 264, 2, d), jnp.bfloat16) for kk in keys[:2])
    k, v = (jax.random.normal(kk, (1, 264, 1, d), jnp.bfloat16) for kk in keys[2:4])
    o, lse = attention_forward(q, k, v, scale=0.2, mask=mask, **lens)
    config = dataclasses.replace(BackwardConfig.heuristic(d, 264, 264, mask),
                                 dkv_row_bounds=True)
    grads = attention_backward(q, k, v, o, lse, do, scale=0.2, mask=mask,
                               config=config, **lens)
    _check_grads(grads, f"causal dk/dv row bounds, D={d}, {mask}, lengths {bool(lens)}")


GROUPS = {"role_split": role_split_cases, "lengths": lengths_cases,
          "shared_pair": shared_pair_cases, "fused": fused_cases,
          "overlap": overlap_cases, "schedule": schedule_cases,
          "softcap": softcap_cases, "defer": defer_cases,
          "warpgroups": warpgroups_cases, "window": window_cases,
          "off_turn": off_turn_cases, "trim": trim_cases, "delta": delta_cases,
          "block_q128": block_q128_cases, "fma_exponent": fma_exponent_cases,
          "dkv_causal": dkv_causal_cases}

if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", choices=sorted(GROUPS), nargs="+", default=None,
                      help="run only these groups of cases (then exit)")
  only = parser.parse_args().only
  if only is not None:
    for group in only:
      GROUPS[group]()
    sys.exit(0)

ks = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(ks[0], (1, 192, 2, 64), jnp.bfloat16)
k = jax.random.normal(ks[1], (1, 200, 1, 64), jnp.bfloat16)
v = jax.random.normal(ks[2], (1, 200, 1, 64), jnp.bfloat16)
calls = {
    "plain": {},
    "causal bottom-right": dict(is_causal=True, causal_alignment="bottom_right"),
    "lengths+segments+softcap+sinks": dict(
        is_causal=True, query_seq_lengths=jnp.array([150]),
        key_value_seq_lengths=jnp.array([170]),
        query_segment_ids=jnp.repeat(jnp.arange(3), 64)[None],
        key_value_segment_ids=jnp.concatenate([jnp.repeat(jnp.arange(3), 64),
                                               jnp.full((8,), 2)])[None],
        logits_soft_cap=20.0, sinks=jnp.zeros((2,))),
}
for name, kw in calls.items():
  def loss(q, k, v):
    o = flash3.dot_product_attention(q, k, v, implementation="mosaic", **kw)
    return (o.astype(jnp.float32) ** 2).sum()
  value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
  finite = all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in grads)
  print(f"{name}: loss {float(value):.4f}, finite gradients {finite}")

# The persistent forward (opt-in): 2 CTAs each looping over 2 of the 4 items, so
# the K/V ring and the q/o staging run on across items.
from flash3.kernels.config import ForwardConfig, forward_config  # noqa: E402
from flash3.kernels.forward import attention_forward  # noqa: E402

for name, mask in {"persistent plain": MaskSpec(),
                   "persistent causal": MaskSpec(causal=True, alignment="bottom_right")}.items():
  base = forward_config(64, jnp.bfloat16, mask, 192, 200)
  config = ForwardConfig(block_kv=base.block_kv, num_stages=base.num_stages,
                         reverse_q_tiles=base.reverse_q_tiles, persistent=True, num_sms=2)
  o, lse = attention_forward(q, k, v, scale=0.125, mask=mask, config=config)
  print(f"{name}: finite {bool(jnp.isfinite(o.astype(jnp.float32)).all())}")

# The persistent forward at D=128: o staged apart from q, and the next item's q
# issued in each item's last compute step (a causal window: unequal items).
q128, k128 = (jax.random.normal(jax.random.key(i), (1, 384, 2, 128), jnp.bfloat16)
              for i in (11, 12))
wmask = MaskSpec(causal=True, window_left=100, alignment="bottom_right")
o, lse = attention_forward(
    q128, k128, k128, scale=0.09, mask=wmask,
    config=ForwardConfig(block_kv=128, reverse_q_tiles=True, persistent=True, num_sms=2,
                         half_edge_tiles=True))
print(f"persistent D=128 window: finite {bool(jnp.isfinite(o.astype(jnp.float32)).all())}, "
      f"nonzero {bool(jnp.any(o != 0))}")

# D=256's default forward: the lazy softmax on raw scores (a warp vote and a
# branch around the accumulator's rescale) with the hand-off ping-pong.
q256 = jax.random.normal(ks[0], (1, 192, 2, 256), jnp.bfloat16)
k256 = jax.random.normal(ks[1], (1, 200, 1, 256), jnp.bfloat16)
o, _ = attention_forward(q256, k256, k256, scale=0.0625, mask=MaskSpec(causal=True))
print(f"D=256 default (lazy softmax): finite {bool(jnp.isfinite(o.astype(jnp.float32)).all())}, "
      f"nonzero {bool(jnp.any(o != 0))}")

# The persistent forward with packed documents: its schedule table is built on
# the device from the segment ids (schedule.segment_schedule).
ids = jnp.repeat(jnp.arange(3), 64)[None]
o, lse = attention_forward(
    q, k[:, :192], v[:, :192], scale=0.125, mask=MaskSpec(causal=True),
    config=ForwardConfig(block_kv=64, reverse_q_tiles=True, persistent=True, num_sms=2),
    q_segment_ids=ids, kv_segment_ids=ids)
print(f"persistent causal packed: finite {bool(jnp.isfinite(o.astype(jnp.float32)).all())}")

# The forward with each tile's softmax overlapping the previous P @ V (opt-in,
# ForwardConfig(overlap_softmax=True)), grid and persistent.
for name, persistent in (("overlapped softmax", False), ("overlapped softmax, persistent", True)):
  mask = MaskSpec(causal=True, alignment="bottom_right")
  config = ForwardConfig(block_kv=64, overlap_softmax=True, persistent=persistent, num_sms=2)
  o, lse = attention_forward(q, k, v, scale=0.125, mask=mask, config=config)
  print(f"{name}: finite {bool(jnp.isfinite(o.astype(jnp.float32)).all())}")

# The forward's ping-pong modes other than the default "meeting" (A/B knobs), grid
# and persistent (where the turns run on across items).
for mode in ("handoff", "off"):
  for persistent in (False, True):
    o, lse = attention_forward(
        q, k, v, scale=0.125, mask=MaskSpec(causal=True, alignment="bottom_right"),
        config=ForwardConfig(block_kv=64, pingpong=mode, persistent=persistent, num_sms=2))
    print(f"ping-pong {mode}, persistent={persistent}: finite "
          f"{bool(jnp.isfinite(o.astype(jnp.float32)).all())}")

# Causal D=64's default (ninth session): 256-key tiles in a 2-slot ring that
# wraps (600 keys: 3 tiles), persistent, 2 CTAs with 2 items each.
k6 = jax.random.normal(ks[1], (1, 600, 1, 64), jnp.bfloat16)
q6 = jax.random.normal(ks[0], (1, 256, 2, 64), jnp.bfloat16)
o, lse = attention_forward(
    q6, k6, k6, scale=0.125, mask=MaskSpec(causal=True, alignment="bottom_right"),
    config=ForwardConfig(block_kv=256, num_stages=2, reverse_q_tiles=True, persistent=True,
                         num_sms=2))
print(f"causal 256-key persistent ring: finite {bool(jnp.isfinite(o.astype(jnp.float32)).all())}")

# Part of each tile's exp2 on the FMA pipes (ForwardConfig.exp2_fma_cols).
o, lse = attention_forward(q, k, v, scale=0.125,
                           mask=MaskSpec(causal=True, alignment="bottom_right"),
                           config=ForwardConfig(block_kv=64, exp2_fma_cols=32))
print(f"exp2 on FMA: finite {bool(jnp.isfinite(o.astype(jnp.float32)).all())}")

# The single-kernel backward (opt-in, BackwardConfig(deterministic=False)): dq by
# TMA reduce-add from the dk/dv kernel.

mask = MaskSpec(causal=True, alignment="bottom_right")
o, lse = attention_forward(q, k, v, scale=0.125, mask=mask)
dq, dk, dv = attention_backward(q, k, v, o, lse, o, scale=0.125, mask=mask,
                                config=BackwardConfig(block_q_dkv=64, deterministic=False))
print(f"single-kernel backward: finite {bool(jnp.isfinite(dq.astype(jnp.float32)).all())}")
dq5, _, _ = attention_backward(
    q, k, v, o, lse, o, scale=0.125, mask=mask,
    config=BackwardConfig(block_q_dkv=64, deterministic=False, pair_dq=True))
print(f"single-kernel backward, dq paired with dk: finite "
      f"{bool(jnp.isfinite(dq5.astype(jnp.float32)).all())}")

# The same with the warpgroups sharing each query tile's dq (share_dq, D = 128).
q2, k2, v2 = (jax.random.normal(kk, (1, s, n, 128), jnp.bfloat16)
              for kk, s, n in zip(ks, (192, 200, 200), (2, 1, 1)))
o2, lse2 = attention_forward(q2, k2, v2, scale=0.09, mask=mask)
dq2, dk2, dv2 = attention_backward(
    q2, k2, v2, o2, lse2, o2, scale=0.09, mask=mask,
    config=BackwardConfig(block_q_dkv=64, deterministic=False, share_dq=True))
print(f"single-kernel backward, shared dq: finite "
      f"{bool(jnp.isfinite(dq2.astype(jnp.float32)).all())}")

# Part of each tile's exp2 on the FMA pipes in both backward kernels.
dq4, dk4, dv4 = attention_backward(q, k, v, o, lse, o, scale=0.125, mask=mask,
                                   config=BackwardConfig(exp2_fma_cols=32))
print(f"backward exp2 on FMA: finite "
      f"{all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in (dq4, dk4, dv4))}")

# The defaults above use FlashAttention-3's matmul order (overlap_matmuls);
# the plain order, still a config: both kernels, and the single kernel.
for name, cfg in (("plain-order backward", BackwardConfig(overlap_matmuls=False)),
                  ("plain-order single-kernel backward",
                   BackwardConfig(block_q_dkv=64, deterministic=False, overlap_matmuls=False))):
  dq3, dk3, dv3 = attention_backward(q, k, v, o, lse, o, scale=0.125, mask=mask, config=cfg)
  print(f"{name}: finite "
        f"{all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in (dq3, dk3, dv3))}")

# Half edge tiles (ForwardConfig.half_edge_tiles): a causal window whose edges
# fall in the middle of 128-key tiles (rows 0..63: tile 0's lower half; rows
# 128..191: tile 0's upper half), grid and persistent.
for persistent in (False, True):
  o, lse = attention_forward(
      q, k, v, scale=0.125, mask=MaskSpec(causal=True, window_left=40),
      config=ForwardConfig(block_kv=128, half_edge_tiles=True, persistent=persistent,
                           num_sms=2, reverse_q_tiles=True))
  print(f"half edge tiles, persistent={persistent}: finite "
        f"{bool(jnp.isfinite(o.astype(jnp.float32)).all())}")

# D=128's non-causal default for long keys (thirteenth session): 192-key tiles
# in a 2-slot ring that wraps (500 keys: 3 tiles, the last ragged), with lengths.
q7, k7, v7 = (jax.random.normal(kk, (1, s, n, 128), jnp.bfloat16)
              for kk, s, n in zip(ks, (128, 500, 500), (2, 1, 1)))
o, lse = attention_forward(q7, k7, v7, scale=0.09, mask=MaskSpec(),
                           config=ForwardConfig(block_kv=192, num_stages=2),
                           kv_lengths=jnp.array([450], jnp.int32))
print(f"192-key tiles at D=128: finite {bool(jnp.isfinite(o.astype(jnp.float32)).all())}")

role_split_cases()
shared_pair_cases()
lengths_cases()
fused_cases()
overlap_cases()
window_cases()
