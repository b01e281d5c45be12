"""Input checking for flash3.dot_product_attention, before anything is traced.

Every error names the argument, its value and what is allowed: ValueError for
shapes and values, TypeError for dtypes and for arguments of the wrong kind (a
string or traced scale, a float window, a list that is not an array).
"""

from __future__ import annotations

import dataclasses
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np

from flash3.visibility import ALIGNMENTS, MaskSpec

FLOAT_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
IMPLEMENTATIONS = (None, "mosaic", "xla")


@dataclasses.dataclass(frozen=True)
class Problem:
  """Validated, normalised arguments: all arrays batched (rank 4 for q, k, v)."""

  q: jax.Array
  k: jax.Array
  v: jax.Array
  bias: jax.Array | None
  mask: jax.Array | None
  scale: float
  spec: MaskSpec
  query_seq_lengths: jax.Array | None
  key_value_seq_lengths: jax.Array | None
  query_segment_ids: jax.Array | None
  key_value_segment_ids: jax.Array | None
  logits_soft_cap: float | None
  sinks: jax.Array | None
  unbatched: bool
  deterministic: bool = True

  @property
  def shape(self) -> dict[str, int]:
    B, Tq, N, D = self.q.shape
    return dict(B=B, Tq=Tq, Tk=self.k.shape[1], N=N, K=self.k.shape[2], D=D)


def _shape(x) -> tuple[int, ...]:
  return tuple(np.shape(x))


def _dtype(x):
  """The dtype jax will use (float64 NumPy input is float32 unless x64 is on, as in jax.nn)."""
  return jax.dtypes.canonicalize_dtype(_given_dtype(x))


def _given_dtype(x):
  """The dtype as the caller gave it (before jax's x64 canonicalisation): what
  error messages name."""
  return jnp.result_type(x) if not hasattr(x, "dtype") else jnp.dtype(x.dtype)


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _check_float(name: str, x) -> None:
  try:
    dtype, given = _dtype(x), _given_dtype(x)
  except TypeError:  # e.g. NumPy strings, which jax has no dtype for
    dtype = given = getattr(x, "dtype", type(x).__name__)
  if dtype not in FLOAT_DTYPES:
    raise TypeError(
        f"{name} has dtype {given}; allowed: float16, bfloat16, float32")


def _array_from_list(name: str, x, of: str = "floats"):
  """A list or tuple of numbers as an array (NumPy, or jax when it holds
  tracers); a ragged or non-numeric one is refused naming the argument."""
  try:
    array = _host_or_traced(x)
  except (ValueError, TypeError, OverflowError) as e:
    raise TypeError(
        f"{name} is a {type(x).__name__} that is not a rectangular array of numbers "
        f"({e}); allowed: a jax or NumPy array, or nested lists of {of}") from None
  if array.dtype.kind not in "biuf":  # strings, None (object), complex
    raise TypeError(
        f"{name} is a {type(x).__name__} of dtype {array.dtype}, not numbers; "
        f"allowed: a jax or NumPy array, or nested lists of {of}")
  return array


def _check_int(name: str, x) -> None:
  try:
    dtype, given = _dtype(x), _given_dtype(x)
  except TypeError:  # e.g. a str or an object, which jax has no dtype for
    raise TypeError(f"{name} is of type {type(x).__name__}; allowed: an integer array "
                    "(int32)") from None
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"{name} has dtype {given}; allowed: an integer dtype (int32)")


def _check_broadcast(name: str, x, target: tuple[int, ...]) -> None:
  shape = _shape(x)
  ok = len(shape) <= 4 and all(
      s in (1, t) for s, t in zip(shape[::-1], target[::-1]))
  if not ok:
    raise ValueError(
        f"{name} has shape {shape}, which does not broadcast to (B, N, Tq, Tk) = {target}")


def _flag(name: str, value) -> bool:
  """A bool known at trace time: True/False, 0/1, or a concrete 0-d bool array."""
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  if isinstance(value, (int, np.integer)) and value in (0, 1):
    return bool(value)
  if (hasattr(value, "dtype") and getattr(value, "shape", None) == ()
      and jnp.dtype(value.dtype) == jnp.bool_ and _is_concrete(value)):
    return bool(value)
  raise TypeError(f"{name}={value!r}; allowed: True or False, known at trace time")


def _static_int(x) -> int | None:
  """x as a Python int if it is an integer known at trace time (Python, NumPy
  or a concrete 0-d jax integer), else None; bools are not integers here."""
  if isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)):
    return operator.index(x)
  if (isinstance(x, (jax.Array, np.ndarray)) and not isinstance(x, jax.core.Tracer)
      and x.shape == () and jnp.issubdtype(x.dtype, jnp.integer)):
    return operator.index(x)
  return None


WINDOW_CLIP_SYMBOLIC = 2**30


def _window(local_window_size, longest: int) -> tuple[int, int] | None:
  if local_window_size is None:
    return None
  pair = local_window_size
  if not isinstance(pair, (tuple, list)):
    pair = (pair, pair)
  elif len(pair) != 2:
    raise ValueError(
        f"local_window_size={local_window_size!r} has {len(pair)} entries; allowed: "
        "None, an int >= 0, or a (left, right) pair of ints >= 0")
  window = tuple(_static_int(w) for w in pair)
  if None in window:
    raise TypeError(
        f"local_window_size={local_window_size!r}; allowed: None, an int >= 0, "
        "or a (left, right) pair of ints >= 0, known at trace time")
  if min(window) < 0:
    raise ValueError(
        f"local_window_size={local_window_size!r} has a negative size; "
        "allowed: sizes >= 0 (0 keeps only the aligned position itself)")
  # No aligned query is further than Tq + Tk from any key: larger sizes mean
  # the same, so clip them (a huge "no limit" value must not overflow int32).
  # A symbolic Tq + Tk (jax.export) cannot be compared: clip at 2**30, past
  # any length the kernels take and within int32 beside a position.
  if not isinstance(longest, (int, np.integer)):
    longest = WINDOW_CLIP_SYMBOLIC
  return (min(window[0], longest), min(window[1], longest))


def _host_or_traced(x):
  """A list or tuple as a NumPy array, or a jax array when it holds tracers."""
  try:
    return np.asarray(x)
  except jax.errors.TracerArrayConversionError:
    return jnp.asarray(x)


def _host_int_range(x) -> tuple[int, int] | None:
  """(min, max) of a concrete integer array (NumPy, list or jax) in its own
  width, else None (traced).

  jnp.asarray would first cast int64 to int32 (x64 is off) and wrap values
  past 2**31 silently, so host values are checked before that cast; with x64
  on, jax arrays can be int64 or uint32 and are checked the same way.
  """
  if isinstance(x, jax.core.Tracer):
    return None
  if isinstance(x, jax.Array) and jnp.can_cast(x.dtype, jnp.int32):
    return None  # Fits by its dtype: no copy to the host.
  arr = np.asarray(x)
  if not arr.size:
    return None
  return int(arr.min()), int(arr.max())


def _check_fits_int32(name: str, x) -> None:
  span = _host_int_range(x)
  if span is not None and (span[0] < -2**31 or span[1] > 2**31 - 1):
    raise ValueError(
        f"{name} has values in [{span[0]}, {span[1]}]; allowed: values that fit "
        "int32 (renumber 64-bit ids, e.g. with np.unique(..., return_inverse=True))")


def _lengths(name: str, x, batch: int, max_len: int, unbatched: bool):
  if x is None:
    return None
  _check_int(name, x)
  span = _host_int_range(x)
  if span is not None and (span[0] < 0 or span[1] > max_len):
    raise ValueError(
        f"{name} has values in [{span[0]}, {span[1]}]; allowed: 0 <= length <= {max_len}")
  x = jnp.asarray(x)
  if unbatched and x.ndim == 0:
    x = x.reshape(1)
  if _shape(x) != (batch,):
    allowed = ("a scalar or shape (1,) (rank-3 inputs have no batch axis)"
               if unbatched else f"(B,) = ({batch},)")
    raise ValueError(f"{name} has shape {_shape(x)}; allowed: {allowed}")
  if _is_concrete(x) and x.size:
    # On the host: a concrete array closed over inside jit is still concrete,
    # but jnp.min of it there would be traced.
    host = np.asarray(x)
    lo, hi = int(host.min()), int(host.max())
    if lo < 0 or hi > max_len:
      raise ValueError(
          f"{name} has values in [{lo}, {hi}]; allowed: 0 <= length <= {max_len}")
    return x.astype(jnp.int32)
  # Traced values cannot be checked: clamp them into [0, T] so that a wrong
  # length cannot move a bottom_right alignment past the array's ends.
  # Clamped in a width that holds both the value and T: int32 for narrow
  # dtypes (T would wrap in uint8), the given one for uint32 / int64 (a length
  # past int32 must mean the whole row, not wrap negative and become 0).
  if jnp.can_cast(x.dtype, jnp.int32):
    return jnp.clip(x.astype(jnp.int32), 0, max_len)
  return jnp.clip(x, 0, max_len).astype(jnp.int32)


def _segment_ids(name: str, x, batch: int, length: int, unbatched: bool):
  _check_int(name, x)
  _check_fits_int32(name, x)
  x = jnp.asarray(x)
  want = (length,) if unbatched else (batch, length)
  if _shape(x) != want:
    raise ValueError(f"{name} has shape {_shape(x)}; allowed: {want}")
  return (x[None] if unbatched else x).astype(jnp.int32)


_FLOAT32_MAX = float(np.finfo(np.float32).max)
SOFTCAP_RANGE = (1e-30, 1e30)


def _positive_finite(name: str, value) -> float:
  if isinstance(value, (bool, np.bool_, str, bytes)) or isinstance(value, jax.core.Tracer):
    raise TypeError(
        f"{name}={value!r}; allowed: a finite Python or NumPy number, known at trace "
        "time (the kernels are compiled for it)")
  if getattr(value, "shape", ()) != ():
    raise ValueError(f"{name} has shape {np.shape(value)}; allowed: a scalar number")
  try:
    value = float(value)
  except (TypeError, ValueError):
    raise TypeError(f"{name}={value!r}; allowed: a finite Python or NumPy number") from None
  if not math.isfinite(value):
    raise ValueError(f"{name}={value!r}; allowed: a finite number")
  # The kernels and the reference compute in float32: a larger value would
  # become inf there and turn every output into NaN.
  if abs(value) > _FLOAT32_MAX:
    raise ValueError(f"{name}={value!r}; allowed: a finite float32 number "
                     f"(|{name}| <= {_FLOAT32_MAX:.4g})")
  return value


def check(query, key, value, bias, mask, *, scale, is_causal, query_seq_lengths,
          key_value_seq_lengths, local_window_size, implementation,
          return_residual, causal_alignment, query_segment_ids,
          key_value_segment_ids, logits_soft_cap, sinks,
          deterministic=True) -> Problem:
  """Validates every argument and returns the normalised Problem."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"implementation={implementation!r}; allowed: {IMPLEMENTATIONS} "
        "(for cuDNN call jax.nn.dot_product_attention)")
  if causal_alignment not in ALIGNMENTS:
    raise ValueError(f"causal_alignment={causal_alignment!r}; allowed: {ALIGNMENTS}")
  is_causal = _flag("is_causal", is_causal)
  _flag("return_residual", return_residual)
  deterministic = _flag("deterministic", deterministic)

  # Python lists and tuples are arrays to jax.nn; take them the same way.
  # Integer ones become host arrays first, so values past int32 get the
  # range error below rather than an OverflowError from jnp.asarray.
  def listed(name, x, of):  # A ragged list is a TypeError naming the argument.
    return _array_from_list(name, x, of) if isinstance(x, (list, tuple)) else x
  bias, mask, sinks = (
      jnp.asarray(_array_from_list(name, x, of)) if isinstance(x, (list, tuple)) else x
      for name, x, of in (("bias", bias, "floats"), ("mask", mask, "bools"),
                          ("sinks", sinks, "floats")))
  query_seq_lengths = listed("query_seq_lengths", query_seq_lengths, "ints")
  key_value_seq_lengths = listed("key_value_seq_lengths", key_value_seq_lengths, "ints")
  query_segment_ids = listed("query_segment_ids", query_segment_ids, "ints")
  key_value_segment_ids = listed("key_value_segment_ids", key_value_segment_ids, "ints")

  names = ("query", "key", "value")
  query, key, value = (listed(name, x, "floats")
                       for name, x in zip(names, (query, key, value)))
  arrays = (query, key, value)
  for name, x in zip(names, arrays):
    if not hasattr(x, "shape"):
      raise TypeError(f"{name} is a {type(x).__name__}; allowed: a jax or NumPy array")
    _check_float(name, x)
  rank = len(_shape(query))
  for name, x in zip(names, arrays):
    if len(_shape(x)) not in (3, 4) or len(_shape(x)) != rank:
      raise ValueError(
          f"{name} has shape {_shape(x)} (rank {len(_shape(x))}); allowed: rank 4 "
          f"(B, T, heads, D) or rank 3 (T, heads, D), the same rank for query, key and "
          f"value (query has rank {rank})")
  if not _dtype(query) == _dtype(key) == _dtype(value):
    raise TypeError(
        f"query, key and value have dtypes {_given_dtype(query)}, {_given_dtype(key)}, "
        f"{_given_dtype(value)}; allowed: one dtype for all three")
  unbatched = rank == 3
  q = jnp.asarray(query)[None] if unbatched else jnp.asarray(query)
  k = jnp.asarray(key)[None] if unbatched else jnp.asarray(key)
  v = jnp.asarray(value)[None] if unbatched else jnp.asarray(value)
  B, Tq, N, D = q.shape
  Bk, Tk, K, Dk = k.shape
  # key against query first: a wrong key must not be reported as a wrong value.
  if Bk != B:
    raise ValueError(f"key has batch size B={Bk}; allowed: query's batch size B={B}")
  if Dk != D:
    raise ValueError(f"key has head_dim D={Dk}; allowed: query's head_dim D={D}")
  if _shape(v) != _shape(k):
    raise ValueError(f"value has shape {_shape(value)}; allowed: the shape of key {_shape(key)}")
  if K == 0 or N % K:
    raise ValueError(
        f"query has N={N} heads and key has K={K}; allowed: K >= 1 dividing N (GQA/MQA)")

  window = _window(local_window_size, Tq + Tk)
  spec = MaskSpec(causal=bool(is_causal), alignment=causal_alignment,
                  window_left=None if window is None else window[0],
                  window_right=None if window is None else window[1])

  if scale is None:
    scale = 1.0 / math.sqrt(D) if D else 1.0
  scale = _positive_finite("scale", scale)
  if logits_soft_cap is not None:
    logits_soft_cap = _positive_finite("logits_soft_cap", logits_soft_cap)
    # s / cap and its gradient's 1 / cap are float32: past these bounds they
    # leave its normal range (caps near 1e-38 gave NaN gradients, near 1e37
    # scores that underflow to 0, a uniform softmax). Real caps are 20-50.
    if not SOFTCAP_RANGE[0] <= logits_soft_cap <= SOFTCAP_RANGE[1]:
      raise ValueError(
          f"logits_soft_cap={logits_soft_cap!r}; allowed: None or a number in "
          f"[{SOFTCAP_RANGE[0]:g}, {SOFTCAP_RANGE[1]:g}]")

  target = (B, N, Tq, Tk)
  if bias is not None:
    _check_float("bias", bias)
    _check_broadcast("bias", bias, target)
    bias = jnp.asarray(bias)
  if mask is not None:
    if _dtype(mask) != jnp.dtype(bool):
      raise TypeError(f"mask has dtype {_given_dtype(mask)}; allowed: bool (True = keep)")
    _check_broadcast("mask", mask, target)
    mask = jnp.asarray(mask)

  query_seq_lengths = _lengths("query_seq_lengths", query_seq_lengths, B, Tq, unbatched)
  key_value_seq_lengths = _lengths(
      "key_value_seq_lengths", key_value_seq_lengths, B, Tk, unbatched)
  if (query_segment_ids is None) != (key_value_segment_ids is None):
    given = "query_segment_ids" if query_segment_ids is not None else "key_value_segment_ids"
    raise ValueError(
        f"only {given} was given; allowed: both query_segment_ids and "
        "key_value_segment_ids, or neither")
  if query_segment_ids is not None:
    query_segment_ids = _segment_ids("query_segment_ids", query_segment_ids, B, Tq, unbatched)
    key_value_segment_ids = _segment_ids(
        "key_value_segment_ids", key_value_segment_ids, B, Tk, unbatched)
  if sinks is not None:
    _check_float("sinks", sinks)
    if _shape(sinks) != (N,):
      raise ValueError(f"sinks has shape {_shape(sinks)}; allowed: (N,) = ({N},)")
    sinks = jnp.asarray(sinks)

  return Problem(q=q, k=k, v=v, bias=bias, mask=mask, scale=scale, spec=spec,
                 query_seq_lengths=query_seq_lengths,
                 key_value_seq_lengths=key_value_seq_lengths,
                 query_segment_ids=query_segment_ids,
                 key_value_segment_ids=key_value_segment_ids,
                 logits_soft_cap=logits_soft_cap, sinks=sinks, unbatched=unbatched,
                 deterministic=deterministic)

