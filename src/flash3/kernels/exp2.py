"""exp2 of softmax scores, partly on the FMA pipes instead of the MUFU unit.

Why: at head_dim 64 a (64, 128) score tile's two matmuls take about as long on
an H100 / H200 SM as its 8192 ``ex2`` instructions on the MUFU unit (16 per
clock per SM), so the softmax, not the tensor cores, bounds the forward.
FlashAttention-4 (Dao et al. 2025, for Blackwell) computes part of each tile's
exponentials with a polynomial on the FMA pipes (128 lanes per clock per SM),
which run beside MUFU; ``split_exp2`` does that for the first ``fma_cols``
columns of a tile.

The polynomial (Cody-Waite range reduction, then a degree-3 fit):
2**x = 2**j * 2**f with j = round(x), f = x - j in [-0.5, 0.5]. Adding
1.5 * 2**23 rounds x to an integer held in the low mantissa bits of the sum,
without a float-to-int conversion (which runs at MUFU's rate); shifting those
bits left by 23 adds j to the exponent of 2**f. The degree-3 fit of 2**f on
[-0.5, 0.5] (constant term exactly 1) has a relative error below 1.1e-4 (a
float16 P rounds at 4.9e-4, bfloat16 at 3.9e-3). Arguments below -126 give exactly 0, as MUFU's
flush-to-zero ``ex2.approx.ftz`` does, so -inf (masked) scores stay 0.
"Exactly 1 at a row's maximum" holds where x is exactly 0; in unmasked
forward tiles the compiler may fuse ``s * c - m`` into one FMA, leaving x a
rounding away from 0 (as for MUFU).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

# 2**f ~ 1 + C1 f + C2 f**2 + C3 f**3 on [-0.5, 0.5], minimax in relative
# error (iteratively reweighted least squares; max relative error 1.01e-4).
# The constant term is exactly 1 so that a row's maximum (x = 0) gives
# exactly 1, as MUFU does (E03: equal extreme inputs must return v exactly).
C1 = 0.6932829276017481
C2 = 0.24221096006049975
C3 = 0.05500892858327226
_ROUNDER = 12582912.0  # 1.5 * 2**23


def exp2_fma(x, *, guard: bool = True):
  """2**x of a float32 array, by FMA-pipe arithmetic only.

  For x < 127.5: softmax's x <= 0, and the backward's s - lse, which rounding
  can make slightly positive. Larger x (only from an lse inconsistent with
  the scores) gives garbage, and +inf gives NaN, where ``jnp.exp2`` gives inf.

  ``guard`` keeps XLA from folding the range reduction away (interpret mode,
  plain jit). Kernels on the GPU pass False: LLVM does not reassociate float
  adds without fast-math flags (Mosaic GPU sets only ``contract``), and the
  barrier is an inline-asm block with side effects that pins the schedule.

  Relative error below 1.1e-4 on [-126, 0]; exactly 1 at 0; exactly 0 below
  -126 and for -inf; NaN stays NaN.
  """
  x = jnp.maximum(x, -127.0)  # -inf and huge negatives: finite bit tricks
  # XLA's algebraic simplifier folds (x + R) - R into x, making f = 0.
  y = x + _ROUNDER
  if guard:
    y = lax.optimization_barrier(y)
  f = x - (y - _ROUNDER)
  p = ((C3 * f + C2) * f + C1) * f + 1.0
  j_bits = lax.shift_left(lax.bitcast_convert_type(y, jnp.int32), jnp.int32(23))
  out = lax.bitcast_convert_type(lax.bitcast_convert_type(p, jnp.int32) + j_bits,
                                 jnp.float32)
  return jnp.where(x < -126.0, 0.0, out)


def split_exp2(x, fma_cols: int, *, guard: bool = True):
  """2**x of a (rows, cols) float32 tile: columns [0, fma_cols) by ``exp2_fma``
  (``guard`` as there), the rest by ``jnp.exp2`` (MUFU). ``fma_cols`` 0: all
  by ``jnp.exp2``."""
  if fma_cols == 0:
    return jnp.exp2(x)
  if fma_cols == x.shape[1]:
    return exp2_fma(x, guard=guard)
  return jnp.concatenate([exp2_fma(x[:, :fma_cols], guard=guard),
                          jnp.exp2(x[:, fma_cols:])], axis=1)
