"""The correctness gate: every contender is checked before it is timed.

FlashAttention-3's rule (its tests, and the project's): against a float32
reference, an implementation's error may be at most ``FACTOR`` times the error
of the same math done in the input dtype, plus a small ``atol``. NaN never
passes. Forward checks the output o; forward+backward checks dq, dk and dv for
a random cotangent do.

To keep the reference cheap on big shapes it is computed on two slices only:
batch row 0 with key-value head 0 and its query heads, and the last batch row
with the last key-value head. Attention of one (batch row, key-value head
group) depends on nothing else, gradients included, so the slices are exact.
Queries are processed in chunks under ``jax.checkpoint`` so memory stays
O(chunk * Tk), and T = 131072 fits.

With padding lengths (``Case.seq_lengths``) a slice's reference applies its
batch row's length: query rows past it see no key (output 0, dq 0, as in
docs/semantics.md section 3) and keys past it are invisible (dk, dv 0). The
check compares only the valid rows, though (see ``check``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from flash3.visibility import MaskSpec

FACTOR = 3.0
# Scores of a chunk held at once, bytes, float32 (B, N, chunk, Tk).
CHUNK_BYTES = 1 << 30


def _attend_chunk(q, k, v, q_pos, q_seg, kv_seg, q_lengths, kv_lengths, *,
                  spec, scale, q_len, kv_len, dtype):
  """Attention of one query chunk against all keys; rows seeing no key -> 0.

  q: (B, C, N, D); k, v: (B, Tk, K, D); q_pos: (C,) absolute query positions;
  q_seg: (B, C) or None; kv_seg: (B, Tk) or None; q_lengths, kv_lengths: (B,)
  valid lengths (right padding) or None. Scores and probabilities are
  rounded to ``dtype`` (the "same math in the input dtype" when it is 16-bit),
  matmuls accumulate in float32.
  """
  b, c, n, d = q.shape
  kv_heads = k.shape[2]
  g = n // kv_heads
  q = q.reshape(b, c, kv_heads, g, d).astype(dtype)
  s = jnp.einsum("bqhgd,bthd->bhgqt", q, k.astype(dtype),
                 preferred_element_type=jnp.float32,
                 precision=jax.lax.Precision.HIGHEST)
  s = (s * scale).astype(dtype).astype(jnp.float32)
  k_pos = jnp.arange(kv_len, dtype=jnp.int32)
  if q_lengths is None and kv_lengths is None:
    keep = spec.visible(q_pos[:, None], k_pos[None, :],
                        spec.shift(q_len, kv_len))
    keep = keep & (q_pos[:, None] < q_len)  # The last chunk's padding rows.
    keep = keep[None]
  else:  # Per batch row: its valid lengths, which also set the alignment.
    q_valid = (jnp.full((b,), q_len, jnp.int32) if q_lengths is None
               else q_lengths.astype(jnp.int32))
    kv_valid = (jnp.full((b,), kv_len, jnp.int32) if kv_lengths is None
                else kv_lengths.astype(jnp.int32))
    shift = spec.shift(q_valid, kv_valid)
    shift = shift[:, None, None] if not isinstance(shift, int) else shift
    keep = spec.visible(q_pos[None, :, None], k_pos[None, None, :], shift)
    keep = (keep & (q_pos[None, :, None] < q_valid[:, None, None])
            & (k_pos[None, None, :] < kv_valid[:, None, None]))
  if q_seg is not None:
    keep = keep & (q_seg[:, :, None] == kv_seg[:, None, :])
  keep = keep[:, None, None]  # (B or 1, 1, 1, C, Tk)
  s = jnp.where(keep, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m)
  l = jnp.sum(p, axis=-1, keepdims=True)
  p = (p / jnp.where(l == 0, 1.0, l)).astype(dtype)
  o = jnp.einsum("bhgqt,bthd->bqhgd", p, v.astype(dtype),
                 preferred_element_type=jnp.float32,
                 precision=jax.lax.Precision.HIGHEST)
  return o.reshape(b, c, n, d).astype(dtype).astype(jnp.float32)


def chunk_len(batch: int, num_heads: int, q_len: int, kv_len: int,
              budget: int = CHUNK_BYTES) -> int:
  """Query rows per chunk so float32 scores (B, N, chunk, Tk) fit ``budget``."""
  rows = budget // max(1, 4 * batch * num_heads * kv_len)
  return int(max(16, min(q_len, rows)))


def attention(q, k, v, q_seg=None, kv_seg=None, q_lengths=None,
              kv_lengths=None, *, spec: MaskSpec, scale: float,
              dtype=jnp.float32):
  """Chunked reference attention, BTNH layout, float32 result.

  q: (B, Tq, N, D); k, v: (B, Tk, K, D); segment ids (B, Tq), (B, Tk) or None;
  lengths (B,) ints or None: query rows at or past ``q_lengths[b]`` see no key
  (output 0), keys at or past ``kv_lengths[b]`` are hidden.
  Differentiable (each chunk is rematerialised in the backward).
  """
  b, q_len, n, d = q.shape
  kv_len = k.shape[1]
  c = chunk_len(b, n, q_len, kv_len)
  num_chunks = math.ceil(q_len / c)
  pad = num_chunks * c - q_len
  qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
  qp = qp.reshape(b, num_chunks, c, n, d).swapaxes(0, 1)
  pos = jnp.arange(num_chunks * c, dtype=jnp.int32).reshape(num_chunks, c)
  if q_seg is not None:
    segp = jnp.pad(q_seg, ((0, 0), (0, pad)), constant_values=-1)
    segp = segp.reshape(b, num_chunks, c).swapaxes(0, 1)
  else:
    segp = jnp.zeros((num_chunks, 0), jnp.int32)  # A placeholder to map over.
  body = functools.partial(_attend_chunk, spec=spec, scale=scale,
                           q_len=q_len, kv_len=kv_len, dtype=dtype)

  @jax.checkpoint
  def one(args):
    q_chunk, q_pos, seg = args
    return body(q_chunk, k, v, q_pos, seg if q_seg is not None else None,
                kv_seg, q_lengths, kv_lengths)

  o = jax.lax.map(one, (qp, pos, segp))  # (chunks, B, C, N, D)
  o = o.swapaxes(0, 1).reshape(b, num_chunks * c, n, d)
  return o[:, :q_len]


@dataclasses.dataclass(frozen=True)
class Slice:
  """Batch row ``b`` and key-value head ``h`` (with its query heads)."""

  b: int
  h: int

  def q_heads(self, group: int) -> slice:
    return slice(self.h * group, (self.h + 1) * group)

  def of_q(self, x, group: int):
    """x of query shape (B, T, N, ...): this slice's rows and query heads."""
    return x[self.b:self.b + 1, :, self.q_heads(group)]

  def of_kv(self, x):
    return x[self.b:self.b + 1, :, self.h:self.h + 1]


def slices(case) -> list[Slice]:
  first = Slice(0, 0)
  last = Slice(case.batch - 1, case.num_kv_heads - 1)
  return [first] if last == first else [first, last]


@dataclasses.dataclass
class Expected:
  """Reference results on the check slices, float32, and their tolerances.

  ``values[name]`` is a list (one per slice) of float32 arrays; ``tol[name]``
  the allowed max abs error: FACTOR x (input-dtype math's error) + atol.
  """

  names: tuple[str, ...]
  values: dict
  tol: dict


def _max_abs(a, b) -> float:
  return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def _atol(dtype, ref_max: float) -> float:
  # A few roundings of the largest value: the floor for tiny errors.
  return 2.0 * float(jnp.finfo(dtype).eps) * max(ref_max, 1e-6)


def expected_modes(case, modes, q, k, v, do, segment_ids) -> dict:
  """Reference values and tolerances for each of ``modes`` on the slices.

  Returns {mode: Expected}. One compiled program per case serves every mode
  and both computations (float32 and the input dtype): the forward output is
  the primal of the backward's vjp, so compiles per case drop from four to
  one (compiles, not FLOPs, are most of a benchmark case's time).
  """
  return run_program(program(case, modes, q, k, v, do, segment_ids))


@dataclasses.dataclass
class Program:
  """A case's reference, built but not run: ``compile_program`` (in any
  thread) then ``run_program``, so that its compile, the longest of a case,
  can overlap the contenders' compiles."""

  modes: tuple[str, ...]
  statics: dict  # _references' static arguments.
  # Per slice: _references' arguments (args, do, q_seg, kv_seg, lengths).
  calls: list
  compiled: list | None = None  # Per slice, once compiled.


def program(case, modes, q, k, v, do, segment_ids) -> Program:
  """The reference program of ``case`` for ``modes`` (see expected_modes);
  slices the inputs, compiles and runs nothing."""
  for mode in modes:
    if mode not in ("fwd", "fwd+bwd"):
      raise ValueError(f"mode={mode!r}: expected 'fwd' or 'fwd+bwd'")
  group = case.num_heads // case.num_kv_heads
  lengths = case.lengths()
  calls = []
  for sl in slices(case):
    seg = None if segment_ids is None else segment_ids[sl.b:sl.b + 1]
    # An array, not a static: both slices share one executable.
    lens = None if lengths is None else jnp.asarray(lengths[sl.b:sl.b + 1])
    calls.append(((sl.of_q(q, group), sl.of_kv(k), sl.of_kv(v)),
                  sl.of_q(do, group), seg, seg, lens))
  statics = dict(with_grads="fwd+bwd" in modes, spec=case.mask_spec,
                 scale=case.scale, dtype=jnp.dtype(case.dtype))
  return Program(tuple(modes), statics, calls)


# The reference's float32 GEMMs need no autotuning: on the H200 it made the
# reference's compile 20-30 s per new shape, most of a benchmark case's time
# (the autotuned cache then served other masks of that shape in ~1 s). For this
# executable only; the contenders compile with XLA's defaults.
_REFERENCE_COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0}


def _signature(call) -> tuple:
  leaves, tree = jax.tree.flatten(call)
  return tree, tuple((x.shape, x.dtype) for x in leaves)


def compile_program(prog: Program) -> None:
  """Lower and compile ``prog`` in place. Nothing runs on the device, so it
  may run in a thread. Slices of equal shapes (all, in practice) share one
  executable: the same one ``jax.jit`` would have used."""
  by_signature = {}
  compiled = []
  for call in prog.calls:
    key = _signature(call)
    if key not in by_signature:
      by_signature[key] = _references.lower(*call, **prog.statics).compile(
          compiler_options=_REFERENCE_COMPILER_OPTIONS)
    compiled.append(by_signature[key])
  prog.compiled = compiled


def run_program(prog: Program) -> dict:
  """Run ``prog`` (compiled first if it is not yet): {mode: Expected}."""
  if prog.compiled is None:
    compile_program(prog)
  names = {"fwd": ("o",), "fwd+bwd": ("dq", "dk", "dv")}
  values = {name: [] for mode in prog.modes for name in names[mode]}
  errs = dict.fromkeys(values, 0.0)
  maxes = dict.fromkeys(values, 0.0)
  for fn, call in zip(prog.compiled, prog.calls):
    ref, low = fn(*call)
    for name in values:
      values[name].append(ref[name])
      errs[name] = max(errs[name], _max_abs(low[name], ref[name]))
      maxes[name] = max(maxes[name], float(jnp.max(jnp.abs(ref[name]))))
  dtype = prog.statics["dtype"]
  tol = {name: FACTOR * errs[name] + _atol(dtype, maxes[name])
         for name in values}
  return {mode: Expected(names[mode], {n: values[n] for n in names[mode]},
                         {n: tol[n] for n in names[mode]})
          for mode in prog.modes}


def expected(case, mode: str, q, k, v, do, segment_ids) -> Expected:
  """Reference values and tolerances for ``case`` in ``mode`` on its slices."""
  return expected_modes(case, (mode,), q, k, v, do, segment_ids)[mode]


@functools.partial(jax.jit, static_argnames=("with_grads", "spec", "scale",
                                             "dtype"))
def _references(args, do, q_seg, kv_seg, lengths, *, with_grads, spec, scale,
                dtype):
  """({name: float32 array} computed in float32, the same in ``dtype``).

  Names: "o", and "dq", "dk", "dv" (for the cotangent ``do``) with grads.
  ``lengths``: (B,) valid lengths of queries and keys alike, or None.
  """
  out = []
  for compute in (jnp.float32, dtype):
    f = functools.partial(attention, q_seg=q_seg, kv_seg=kv_seg,
                          q_lengths=lengths, kv_lengths=lengths, spec=spec,
                          scale=scale, dtype=compute)
    if not with_grads:
      out.append({"o": f(*args)})
      continue
    o, vjp = jax.vjp(f, *args)
    dq, dk, dv = vjp(do.astype(o.dtype))
    out.append({"o": o, "dq": dq.astype(jnp.float32),
                "dk": dk.astype(jnp.float32), "dv": dv.astype(jnp.float32)})
  return tuple(out)


def check(case, exp: Expected, outputs: tuple, q_grad_scale: float = 1.0
          ) -> tuple[bool, float, str]:
  """Compare an implementation's outputs to ``exp``.

  Args:
    outputs: (o,) for "fwd", (dq, dk, dv) for "fwd+bwd", full shapes.
    q_grad_scale: multiplies dq first (for contenders fed a pre-scaled q).

  With padding lengths only the valid rows are compared (o and dq rows, dk
  and dv keys before the batch row's length), for every contender alike:
  jax.nn.dot_product_attention documents nothing for the padded rows, and
  cuDNN does not promise to write them, so they may hold anything (NaN
  included); flash3's own tests cover its zeros there (docs/semantics.md
  section 3).

  Returns:
    (passed, worst error / tolerance ratio, a short description).
  """
  group = case.num_heads // case.num_kv_heads
  lengths = case.seq_lengths
  worst, detail = 0.0, ""
  for name, out in zip(exp.names, outputs):
    if name == "dq" and q_grad_scale != 1.0:
      out = out.astype(jnp.float32) * q_grad_scale
    for sl, ref in zip(slices(case), exp.values[name]):
      got = sl.of_kv(out) if name in ("dk", "dv") else sl.of_q(out, group)
      if lengths is not None:  # Axis 1 is Tq or Tk; both have the length.
        got, ref = got[:, :lengths[sl.b]], ref[:, :lengths[sl.b]]
      got = got.astype(jnp.float32)
      if not bool(jnp.all(jnp.isfinite(got))):
        return False, math.inf, f"{name} has NaN or Inf"
      err = _max_abs(got, ref)
      ratio = err / exp.tol[name] if exp.tol[name] > 0 else math.inf
      if ratio >= worst:
        worst = ratio
        detail = f"{name} max error {err:.3g} (allowed {exp.tol[name]:.3g})"
  return worst <= 1.0, worst, detail


def random_inputs(case, seed: int = 0):
  """q, k, v, do (standard normal, in the case's dtype) and segment ids.

  With padding lengths, ``do`` is 0 on the padded query rows, as a training
  loss that ignores padding gives: what a contender puts in those rows (0,
  the mean of v, anything) then cannot reach dk and dv through ``do``, so
  the valid rows compare alike whatever its convention for padding.
  """
  keys = jax.random.split(jax.random.key(seed), 4)
  dtype = jnp.dtype(case.dtype)
  q_shape = (case.batch, case.q_len, case.num_heads, case.head_dim)
  kv_shape = (case.batch, case.kv_len, case.num_kv_heads, case.head_dim)
  q = jax.random.normal(keys[0], q_shape, dtype)
  k = jax.random.normal(keys[1], kv_shape, dtype)
  v = jax.random.normal(keys[2], kv_shape, dtype)
  do = jax.random.normal(keys[3], q_shape, dtype)
  lengths = case.lengths()
  if lengths is not None:
    valid = jnp.arange(case.q_len)[None, :] < jnp.asarray(lengths)[:, None]
    do = jnp.where(valid[:, :, None, None], do, jnp.zeros((), dtype))
  seg = case.segment_ids()
  return q, k, v, do, (None if seg is None else jnp.asarray(seg))
