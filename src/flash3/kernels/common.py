"""Small Mosaic GPU helpers shared by the forward and backward kernels.

The one difference between the GPU path and GPU interpret mode lives here.
jax 0.11.2's interpreter (../shared/design/INTERPRET.md) lacks three rules the
fast GPU path uses: ``pl.run_state`` with ``plgpu.ACC.init`` (an accumulator
initialised from registers), wgmma with a register left operand (FlashAttention-3
feeds P to P @ V from registers), and stores into an accumulator ref. The
static switch is ``uses_register_operands(interpret)``:

* GPU (``interpret`` false): the left operand stays in registers and the
  wgmma accumulates into the running accumulator in place.
* interpret mode: the left operand is staged through a shared-memory buffer
  (``staging``) and the product goes into a fresh zero accumulator that is then
  added to the running one. Same math, one extra rounding-free add.

Kernels allocate the staging buffer only when the switch says so, so the GPU
path pays nothing for it. GPU tests cover the register path.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu
import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, nvvm, scf, vector
import numpy as np

# Natural-log <-> base-2 conversions for softmax in the exp2 domain.
LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453

_FLOAT32_MAX = float(np.finfo(np.float32).max)


def softcap_factor(scale: float, softcap: float) -> float:
  """scale / softcap, the kernels' one factor on the raw scores before tanh,
  held to float32's max: past it the factor was inf and a zero score gave
  0 * inf = NaN. Held, tanh of every score of magnitude above ~1e-37 still
  saturates at +-1, as under the true factor; a zero score gives 0."""
  return min(scale / softcap, _FLOAT32_MAX)


# The kernels' grid and thread axis names. Inside a kernel,
# ``lax.axis_index(name)`` resolves ``name`` against the JAX mesh axes FIRST
# (jax 0.11.2, pallas/mosaic_gpu/lowering.py ``_axis_index_rule``) whenever the
# kernel is lowered under a mesh: per shard under custom_partitioning or
# shard_map. With grid names such as "heads" a mesh axis called "heads" turned
# the CTA's head index into the device's position on that axis, so every CTA of
# device d worked on local head d and the other heads were never written (the
# head-sharded runs on two H200s, 2026-11-30). Prefixed names cannot meet a
# user's mesh axis; ``check_mesh_axis_names`` refuses a mesh that uses one.
HEADS_AXIS = "flash3_kernel_heads"
BATCH_AXIS = "flash3_kernel_batch"
Q_TILES_AXIS = "flash3_kernel_q_tiles"
KV_TILES_AXIS = "flash3_kernel_kv_tiles"
CTA_AXIS = "flash3_kernel_cta"
WG_AXIS = "flash3_kernel_wg"
KERNEL_AXIS_NAMES = frozenset({HEADS_AXIS, BATCH_AXIS, Q_TILES_AXIS,
                               KV_TILES_AXIS, CTA_AXIS, WG_AXIS})


def check_mesh_axis_names(axis_names) -> None:
  """Raises ValueError if a mesh axis shares a name with a kernel axis."""
  clash = sorted(set(axis_names) & KERNEL_AXIS_NAMES)
  if clash:
    raise ValueError(
        f"flash3: mesh axis names {clash} are reserved for flash3's kernels "
        "(a kernel's axis_index would read the device's mesh position); "
        "rename those mesh axes")


def is_interpret(interpret: Any) -> bool:
  """True if ``interpret`` (False/None, True, or InterpretGPUParams) asks for it."""
  return interpret is not None and interpret is not False


def interpret_params(interpret: Any) -> Any:
  """The ``interpret=`` argument for ``plgpu.kernel``: None on the GPU path."""
  if not is_interpret(interpret):
    return None
  if interpret is True:
    return plgpu.InterpretGPUParams()
  return interpret


def uses_register_operands(interpret: Any) -> bool:
  """THE static switch: register-operand wgmma on the GPU, smem staging when interpreted."""
  return not is_interpret(interpret)


def grid_index(name: str, count: int, reverse: bool) -> jax.Array:
  """The index of grid axis ``name``; ``count - 1 - index`` when ``reverse``.

  CUDA starts CTAs in grid order. Under a causal mask later query tiles see
  more keys, so visiting them first (``reverse``) leaves the short tiles for
  the last wave instead of the long ones (FlashAttention-3 does the same).
  """
  i = jax.lax.axis_index(name)
  return (count - 1 - i) if reverse else i


# Benchmarking knob only, not an API (issue 5). The producer warpgroups end
# with a "drain": they wait for the consumers' last release of every ring
# slot, because the interpreter requires every phase of a waited barrier to
# be waited on. On the GPU nothing waits after those phases, so the drain only
# keeps the producer alive a little longer. Setting this to False omits the
# drains on the GPU path so scripts/bench_drain.py can time their cost; it is
# read when a kernel is traced (clear jax's caches after changing it) and has
# no effect in interpret mode, which always drains.
DRAIN_BARRIERS = True


def wait_final_stores() -> None:
  """A kernel's last wait on its TMA stores: until they have READ shared memory.

  Shared memory must outlive the reads; the global writes complete on their
  own and are visible after the kernel (CUTLASS's SM90 epilogues end the same
  way). Waiting for the writes too kept each CTA, and the next CTA for its SM,
  waiting on the store's round trip to memory.
  """
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def drains_barriers(interpret: Any) -> bool:
  """Whether the producer waits out its ring's last phases (always when interpreted)."""
  return is_interpret(interpret) or bool(DRAIN_BARRIERS)


def smem_swizzle_transforms(minor_dim: int, itemsize: int) -> tuple[Any, ...]:
  """Tiling + swizzle transforms for a 2D smem tile read by wgmma and TMA.

  Uses the widest swizzle (128, 64 or 32 bytes) whose row fits ``minor_dim``.
  Raises ValueError if ``minor_dim * itemsize`` is not a multiple of 32 bytes.
  """
  for swizzle in (128, 64, 32):
    if (minor_dim * itemsize) % swizzle == 0:
      elems = swizzle // itemsize
      return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))
  raise ValueError(
      f"minor_dim={minor_dim} with itemsize={itemsize} is {minor_dim * itemsize} "
      "bytes; a multiple of 32 bytes is needed for a swizzled wgmma tile")


def matmul_smem(a_ref, b_ref, shape: tuple[int, int],
                while_running: Callable[[], None] | None = None) -> jax.Array:
  """``a_ref @ b_ref`` (both in shared memory) into a fresh float32 accumulator.

  ``while_running`` is called after the wgmma is issued and before its result
  is read, to overlap waits with the matmul. Works the same in interpret mode.
  """
  def body(acc_ref):
    plgpu.wgmma(acc_ref, a_ref, b_ref)
    if while_running is not None:
      while_running()
    return acc_ref[...]
  return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def accumulate_register_lhs(acc: jax.Array, a: jax.Array, b_ref, *,
                            staging=None,
                            while_running: Callable[[], None] | None = None
                            ) -> jax.Array:
  """``acc + a @ b_ref`` with ``a`` in registers (WGMMA layout), ``b_ref`` in smem.

  Args:
    acc: float32 (M, N) accumulator in the WGMMA layout.
    a: (M, K) in the input dtype, WGMMA layout.
    b_ref: (K, N) shared-memory ref.
    staging: None on the GPU path; in interpret mode a (M, K) shared-memory
      ref of a's dtype that ``a`` is written through (see the module docstring).
    while_running: as in ``matmul_smem``.
  """
  if staging is None:
    def body(acc_ref):
      plgpu.wgmma(acc_ref, a, b_ref)
      if while_running is not None:
        while_running()
    return pl.run_state(body)(plgpu.ACC.init(acc))
  staging[...] = a
  plgpu.commit_smem()
  return acc + matmul_smem(staging, b_ref, acc.shape, while_running)


def accumulate_then_matmul(acc: jax.Array, a: jax.Array, b_ref, a2_ref, b2_ref,
                           shape2: tuple[int, int], *, staging=None,
                           while_running: Callable[[], None] | None = None
                           ) -> tuple[jax.Array, jax.Array]:
  """``(acc + a @ b_ref, a2_ref @ b2_ref)``: the two wgmmas issued back to
  back, then one wait for both.

  ``a`` is a register operand (input dtype, WGMMA layout), ``a2_ref`` and
  ``b_ref`` / ``b2_ref`` shared-memory refs; the second product goes into a
  fresh float32 (``shape2``) accumulator. Nothing runs between the issues and
  the wait but ``while_running``, so ``a`` cannot change while its wgmma
  reads it. ``staging``: as in ``accumulate_register_lhs`` (interpret mode:
  one matmul after the other).
  """
  if staging is not None:
    acc = accumulate_register_lhs(acc, a, b_ref, staging=staging)
    return acc, matmul_smem(a2_ref, b2_ref, shape2, while_running)

  def body(refs):
    acc_ref, out_ref = refs
    plgpu.wgmma(acc_ref, a, b_ref)

    def scope(s_ref):
      plgpu.wgmma(s_ref, a2_ref, b2_ref)
      if while_running is not None:
        while_running()
      out_ref[...] = s_ref[...]  # Waits for both wgmmas.
    pl.run_scoped(scope, plgpu.ACC(shape2, jnp.float32))

  out_like = plgpu.layout_cast(jnp.zeros(shape2, jnp.float32), plgpu.Layout.WGMMA)
  return pl.run_state(body)((plgpu.ACC.init(acc), out_like))


def matmul_smem_sum(pairs, shape: tuple[int, int]) -> jax.Array:
  """``sum(a @ b for a, b in pairs)`` (all in shared memory), float32.

  The wgmmas accumulate into one fresh accumulator before a single wait.
  """
  def body(acc_ref):
    for a_ref, b_ref in pairs:
      plgpu.wgmma(acc_ref, a_ref, b_ref)
    return acc_ref[...]
  return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def matmul_pair_first_then(first, second, then: Callable[[jax.Array], Any],
                           out_like: Any) -> tuple[Any, jax.Array]:
  """Two smem wgmmas issued back to back; ``then`` runs on the first's result
  while the second is still in flight (FlashAttention-3's backward overlaps
  the softmax of S with the dP matmul this way).

  Args:
    first, second: ``(a_ref, b_ref, (M, N))``, both operands in shared memory.
    then: maps the first product (float32, WGMMA layout) to a pytree of
      arrays shaped like ``out_like``.
    out_like: initial values of ``then``'s outputs (their shapes, dtypes and
      layouts; the values are overwritten).

  Returns:
    (``then``'s outputs, the second product). GPU path only: the interpreter
    lacks accumulator loads with ``wait_n`` (see the module docstring).
  """
  (a1, b1, shape1), (a2, b2, shape2) = first, second

  def body(refs):
    acc1, acc2, out = refs
    plgpu.wgmma(acc1, a1, b1)
    plgpu.wgmma(acc2, a2, b2)
    x1 = plgpu.wgmma_accumulator_load(acc1, wait_n=1)  # The first only.
    jax.tree.map(lambda ref, value: ref.__setitem__(Ellipsis, value), out, then(x1))

  zeros = lambda shape: plgpu.layout_cast(jnp.zeros(shape, jnp.float32),
                                          plgpu.Layout.WGMMA)
  # Leaving run_state waits for the second wgmma too.
  _, x2, out = pl.run_state(body)(
      (plgpu.ACC.init(zeros(shape1)), plgpu.ACC.init(zeros(shape2)), out_like))
  return out, x2


def accumulate_pair(acc1: jax.Array, a1: jax.Array, b1_ref, acc2: jax.Array,
                    make_a2: Callable[[], jax.Array], b2_ref, product=None):
  """``acc1 + a1 @ b1_ref`` and ``acc2 + a2 @ b2_ref``, ``a2 = make_a2()``
  computed while the first wgmma runs; one wait for both at the end.

  ``a1`` and ``a2`` are register operands (input dtype, WGMMA layout); they
  must not change while their wgmma runs, which holds as both are values.
  ``product=(stage, pairs, use)``: also ``sum(a @ b for a, b in pairs)``
  (float32, shared-memory operands), after ``stage(a2)`` has put a2 where
  those operands read it (a transposed left operand must be in shared
  memory). Its wgmmas are issued before the second, and ``use(product)``
  runs as soon as they are done, while the second still runs
  (FlashAttention-3's backward issues dq = ds k before dk += ds^T q and
  stores dq meanwhile); its accumulator exists only from then on. Returns
  (acc1, acc2, a2). GPU path only, as ``matmul_pair_first_then``.
  """
  def body(refs):
    r1, r2, a2_ref = refs
    plgpu.wgmma(r1, a1, b1_ref)
    a2 = make_a2()
    a2_ref[...] = a2
    if product is None:
      plgpu.wgmma(r2, a2, b2_ref)
      return
    stage, pairs, use = product
    stage(a2)
    pairs = pairs()
    shape = (pairs[0][0].shape[0], pairs[0][1].shape[1])

    def scope(r3):
      for a_ref, b_ref in pairs:
        plgpu.wgmma(r3, a_ref, b_ref)
      plgpu.wgmma(r2, a2, b2_ref)
      use(plgpu.wgmma_accumulator_load(r3, wait_n=1))  # The second still runs.
    pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32))

  a2_like = plgpu.layout_cast(jnp.zeros(a1.shape[:1] + (b2_ref.shape[0],), a1.dtype),
                              plgpu.Layout.WGMMA)
  return pl.run_state(body)((plgpu.ACC.init(acc1), plgpu.ACC.init(acc2), a2_like))


def warp_vote(fa, test: Callable[[ir.Value], ir.Value], kind: str) -> ir.Value:
  """Inside ``plgpu.inline_mgpu``: whether ``test`` (one element -> i1) holds
  for "any" or "all" of the elements of FragmentedArray ``fa`` that the
  warp's threads hold, as one i1 equal across the warp (a branch on it does
  not diverge)."""
  combine = {"any": arith.ori, "all": arith.andi}[kind]
  mine = None
  for reg in fa.registers.flat:
    for i in range(ir.VectorType(reg.type).shape[0]):
      t = test(vector.extract(reg, dynamic_position=[], static_position=[i]))
      mine = t if mine is None else combine(mine, t)
  i32 = ir.IntegerType.get_signless(32)
  return nvvm.vote_sync(arith.constant(i32, 0xFFFFFFFF), mine, kind)


def fragmented_like(like, registers) -> Any:
  """A FragmentedArray of ``like``'s shape and layout holding ``registers``
  (e.g. an ``scf.IfOp``'s results, in ``like.registers``' order)."""
  new = np.empty(like.registers.shape, dtype=object)
  new.flat[:] = list(registers)
  return mgpu.FragmentedArray(_registers=new, _layout=like.layout, _is_signed=None)


def scale_rows(acc: jax.Array, alpha: jax.Array, *, skip_ones: bool) -> jax.Array:
  """``acc * alpha[:, None]`` for a float32 (M, N) WGMMA-layout accumulator
  and its (M,) row factors (``Layout.WGMMA.reduce(1)``).

  ``skip_ones`` (GPU only): each warp votes, and a warp whose rows all have
  alpha == 1 keeps acc without the multiplies: the result is the same, and
  the forward's 64 (head_dim 128) or 128 (256) multiplies per thread and
  tile sat between a warpgroup's softmax and its P @ V, after the ping-pong
  barrier where ptxas placed them. A NaN alpha is not 1, so it still
  reaches acc.
  """
  if not skip_ones:
    return acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)),
      return_type=plgpu.ShapeDtypeStruct(acc.shape, acc.dtype,
                                         layout=plgpu.Layout.WGMMA))
  def scaled(_, acc_fa, alpha_fa):
    one = arith.constant(ir.F32Type.get(), 1.0)
    # Does any row this warp holds have alpha != 1?
    warp_moved = warp_vote(
        alpha_fa, lambda x: arith.cmpf(arith.CmpFPredicate.UNE, x, one), "any")
    regs = list(acc_fa.registers.flat)
    branch = scf.IfOp(warp_moved, [r.type for r in regs], has_else=True)
    with ir.InsertionPoint(branch.then_block):
      out = acc_fa * alpha_fa.broadcast_in_dim(acc_fa.shape, (0,), acc_fa.layout)
      scf.yield_(list(out.registers.flat))
    with ir.InsertionPoint(branch.else_block):
      scf.yield_(regs)
    return fragmented_like(acc_fa, branch.results)

  return scaled(acc, alpha)


def scale_rounded(s: jax.Array, c: float, *, interpret: bool,
                  layout=plgpu.Layout.WGMMA) -> jax.Array:
  """``s * c`` for a float32 array in ``layout`` (a WGMMA-layout tile, or
  its rows' ``Layout.WGMMA.reduce(1)``), each product rounded to float32
  once (PTX ``mul.rn``) so that no compiler fuses it with a later add into an
  FMA. The forward's scaled scores feed both the row max and
  ``s * c - max``; fused, that subtraction saw the unrounded product and a
  row's max got exp2 of a rounding error instead of exp2(0) (E03 in whole
  tiles). Interpret mode: a plain multiply (XLA on the CPU may fuse products
  into adds; E03's interpret tests pass with this one).
  """
  if interpret:
    return s * c

  @plgpu.inline_mgpu(
      arg_types=(layout,),
      return_type=plgpu.ShapeDtypeStruct(s.shape, s.dtype, layout=layout))
  def scaled(_, s_fa):
    factor = mgpu.FragmentedArray.splat(arith.constant(ir.F32Type.get(), c), s_fa.shape)
    return s_fa._pointwise(mgpu.FragmentedArray._lift_fast_instr("mul.rn.f32"), factor)

  return scaled(s)
