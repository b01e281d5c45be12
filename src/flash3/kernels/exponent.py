"""exp2's argument in the forward's online softmax as one FMA per score
(``ForwardConfig.fma_exponent``).

With raw scores s, a row's reference m and c = scale * log2(e), the kernel
exponentiates (s - m) * c: an add and a multiply per score. FlashAttention-3
(Shah et al. 2024, Algorithm 1's softmax) takes s * c - m * c instead: one
FMA per score against a per-row product. That product rounds, and the FMA
does not round s * c, so at a row's max the argument is the product's rounding
error rather than 0 (E03 in ../shared/cases: near 2**31 it overflowed exp2 and
gave NaN).

Here a row's exp2-domain reference is ``ref = round(m * c)`` exactly:

* a warp whose references are all below ``FMA_REFERENCE_LIMIT`` (the old
  one may be -inf) takes x = fma(s, c, -ref), which is (s - m) * c + err
  with err = m * c - ref, rounded once, and rescales by exp2(ref_old - ref);
* any other warp takes the exact form: err computed per row (0 on rows past
  the limit, whose reference stays m * c itself, as without this option),
  x = (s - m) * c + err and the rescale's (m_old - m) * c + err - err_old:
  the same values, so P, the row sum l and the lse refer to one reference
  whichever form a warp took in each tile;
* the epilogue's lse is ref + log2(l), as before (``scale_rounded``).

So P is at most 2**|err| (|err| <= 1/8: half an ulp below 2**22) off its
plain value, in every element of a row alike; o = acc / l and the lse do not
see it, up to one thing: P @ V takes P rounded to the input dtype and l the
float32 P, so equal scores (E03's shape, below the limit) give o within one
ulp of v instead of v exactly. Interpret mode takes the exact form everywhere
(err from Dekker's two-product), so CI checks that form's bookkeeping; the
one-FMA form, and a warp switching between the two, run only on the GPU.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu
import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, math as mlir_math, scf

from flash3.kernels import common

# |ref| below this: err is at most 1/8 (half an ulp below 2**22), so P stays
# within 2**0.125 of its exact value times the lazy threshold's 2**8.
FMA_REFERENCE_LIMIT = 2.0 ** 22

_ROWS = plgpu.Layout.WGMMA.reduce(1)


def _split(x):
  """float32 x as hi + lo, each of at most 12 significant bits: hi is x with
  its 12 low significand bits cleared (Veltkamp's 4097 * x would overflow
  for |x| above 8.3e34)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.int32)
  hi = jax.lax.bitcast_convert_type(bits & ~0xFFF, jnp.float32)
  return hi, x - hi


def _product_error(m: jax.Array, c: float, ref: jax.Array) -> jax.Array:
  """m * c - ref exactly, for ref = round(m * c) (Dekker's two-product:
  every partial product of 12-bit halves is exact, so the sum is too,
  whether or not XLA on the CPU fuses a product into the next add; the GPU
  has fma). Interpret mode's form."""
  m_hi, m_lo = _split(m)
  c_hi, c_lo = _split(jnp.float32(c))
  return ((m_hi * c_hi - ref) + m_hi * c_lo + m_lo * c_hi) + m_lo * c_lo


def _err_where_normal(m, c, ref):
  """m * c - ref exactly where |ref| < FMA_REFERENCE_LIMIT, else 0 (and 0
  where ref is not finite: there the product's error would be NaN)."""
  return jnp.where(jnp.abs(ref) < FMA_REFERENCE_LIMIT, _product_error(m, c, ref), 0.0)


def exact_form(s, m_old, m, ref_old, ref, c):
  """Interpret mode's (shift, x) for any rows: the rescale's argument from
  reference m_old to m, (m_old - m) * c + err - err_old, and P's,
  (s - m) * c + err, with err = m * c - ref (0 on large rows, whose
  reference is m * c itself). The GPU's form for a warp with a large row."""
  err = _err_where_normal(m, c, ref)
  err_old = _err_where_normal(m_old, c, ref_old)
  shift = (m_old - m) * c + (err - err_old)
  rows = lambda v: jax.lax.broadcast_in_dim(v, s.shape, [0])
  return shift, (s - rows(m)) * c + rows(err)


def exponents(s: jax.Array, m_old: jax.Array, m: jax.Array, c: float, *,
              interpret: bool) -> tuple[jax.Array, jax.Array]:
  """exp2's arguments for a (rows, keys) WGMMA-layout tile of raw scores s
  whose rows move their reference from m_old (-inf: none yet) to m, both
  (rows,) in ``Layout.WGMMA.reduce(1)``: (the rescale's, P's).

  A warp whose references are all normal (|round(m * c)| below
  FMA_REFERENCE_LIMIT, the old one possibly -inf) takes ref_old - ref and
  fma(s, c, -ref) (GPU); any other warp, and interpret mode, the exact form
  (``exact_form``). Both are the same values up to one rounding."""
  ref = common.scale_rounded(m, c, interpret=interpret, layout=_ROWS)
  ref_old = common.scale_rounded(m_old, c, interpret=interpret, layout=_ROWS)
  if interpret:
    # XLA on the CPU may fuse a product into the add that follows: kept
    # apart, each ref is the rounded product that err measures against.
    ref, ref_old = jax.lax.optimization_barrier((ref, ref_old))
    return exact_form(s, m_old, m, ref_old, ref, c)
  normal = ((jnp.abs(ref) < FMA_REFERENCE_LIMIT)
            & ((jnp.abs(ref_old) < FMA_REFERENCE_LIMIT) | (ref_old == -jnp.inf)))
  normal = normal.astype(jnp.int32)

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA, _ROWS, _ROWS, _ROWS, _ROWS, _ROWS),
      return_type=(plgpu.ShapeDtypeStruct(m.shape, m.dtype, layout=_ROWS),
                   plgpu.ShapeDtypeStruct(s.shape, s.dtype, layout=plgpu.Layout.WGMMA)))
  def both(_, s_fa, m_old_fa, m_fa, ref_old_fa, ref_fa, normal_fa):
    f32, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(32)
    zero = arith.constant(i32, 0)
    warp_normal = common.warp_vote(
        normal_fa, lambda v: arith.cmpi(arith.CmpIPredicate.ne, v, zero), "all")
    fma = mgpu.FragmentedArray._lift_fast_instr("fma.rn.f32")
    factor = mgpu.FragmentedArray.splat(arith.constant(f32, c), s_fa.shape)
    wide = lambda v: v.broadcast_in_dim(s_fa.shape, (0,), s_fa.layout)
    flat = lambda shift, x: list(shift.registers.flat) + list(x.registers.flat)
    n_rows = ref_fa.registers.size
    types = [r.type for r in flat(ref_fa, s_fa)]
    branch = scf.IfOp(warp_normal, types, has_else=True)
    with ir.InsertionPoint(branch.then_block):
      scf.yield_(flat(ref_old_fa - ref_fa, s_fa._pointwise(fma, factor, wide(-ref_fa))))
    with ir.InsertionPoint(branch.else_block):
      rows = lambda value: mgpu.FragmentedArray.splat(arith.constant(f32, value), m_fa.shape)
      row_factor, limit, zeros = rows(c), rows(FMA_REFERENCE_LIMIT), rows(0.0)

      def err_of(m_, ref_):
        # |ref| < limit, ordered: false for NaN and +-inf.
        small = ref_._pointwise(mlir_math.absf) < limit
        return small.select(m_._pointwise(fma, row_factor, -ref_), zeros)

      err, err_old = err_of(m_fa, ref_fa), err_of(m_old_fa, ref_old_fa)
      shift = (m_old_fa - m_fa) * row_factor + (err - err_old)
      x = (s_fa - wide(m_fa))._pointwise(fma, factor, wide(err))
      scf.yield_(flat(shift, x))
    results = list(branch.results)
    return (common.fragmented_like(ref_fa, results[:n_rows]),
            common.fragmented_like(s_fa, results[n_rows:]))

  return both(s, m_old, m, ref_old, ref, normal)
