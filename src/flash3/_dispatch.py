"""Choosing between the Mosaic GPU kernels and the XLA reference.

implementation=None takes the kernels when they support the call and the
device is a Hopper GPU; otherwise the XLA path, saying why once per reason.
implementation="mosaic" raises NotImplementedError with that reason instead.
"""

from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp
from jax._src import config as _jax_config

from flash3._device import why_not_hopper
from flash3._validate import Problem

# Set by interpret_kernels(). Part of jit's cache key, so that a function
# traced outside the context (on the XLA path) is traced anew inside it
# rather than reused, and the other way round. (A config state of jax's, a
# private API: jax is pinned to 0.11.2.)
_INTERPRET = _jax_config.enum_state(
    "flash3_interpret_kernels", ["off", "on", "races"], "off",
    "flash3: run the Mosaic GPU kernels in jax's GPU interpret mode "
    "(set with flash3.interpret_kernels())", include_in_jit_key=True,
    include_in_trace_context=True)
_warned: set[str] = set()
# Fewer host devices than this and jax's GPU interpreter was seen to stall
# (its warpgroup threads wait on each other; see interpret_kernels).
MIN_INTERPRET_CPU_DEVICES = 4


@contextlib.contextmanager
def interpret_kernels(detect_races: bool = False):
  """Run flash3's Mosaic GPU kernels in jax's GPU interpret mode, on the CPU.

  For testing the kernel logic on machines without a GPU (slow: use small
  shapes). Inside this context implementation="mosaic" works on any device.

  The interpreter runs every warpgroup of a kernel as a host thread that
  waits on the others at barriers; with fewer than 4 CPU devices (a small
  host) it was seen to stall for good (2 cores, 2 devices: the forward with
  causal segment ids and GQA at head_dim 64). Set
  ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` before jax starts,
  as the test suite does; a warning says so once. Rarely it stalls with 4
  as well (thirty-fifth session's fresh-user run, 2 cores: long processes
  mixing many kernel calls with other eager jax work), so the tests run
  under pytest-timeout.

  Args:
    detect_races: ask the interpreter to report shared-memory races; after a
      call, ``jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call
      .get_races().races_found`` says whether it found one (jax 0.11.2; its
      wgmma operands are not race-checked).
  """
  cpu_devices = len(jax.devices("cpu"))
  if cpu_devices < MIN_INTERPRET_CPU_DEVICES:
    warn_once(
        f"flash3.interpret_kernels: {cpu_devices} CPU device(s); "
        f"jax's GPU interpreter can stall with fewer than "
        f"{MIN_INTERPRET_CPU_DEVICES}: set XLA_FLAGS=--xla_force_host_platform_"
        f"device_count={MIN_INTERPRET_CPU_DEVICES} before importing jax")
  with _INTERPRET("races" if detect_races else "on"):
    yield interpret_params()


def interpret_params():
  """The active InterpretGPUParams, or False outside interpret_kernels()."""
  if _INTERPRET.value == "off":
    return False
  from jax.experimental.pallas import mosaic_gpu as plgpu
  return plgpu.InterpretGPUParams(detect_races=_INTERPRET.value == "races")


def _feature_reason(p: Problem, supported: frozenset[str]) -> str | None:
  """Options of this call that the forward kernel does not take, all of them."""
  reasons = []
  if p.q.dtype.itemsize != 2:
    reasons.append(f"{p.q.dtype} inputs (the kernels take float16 or bfloat16)")
  needed = {
      "bias": p.bias is not None,
      "mask": p.mask is not None,
      "lengths": p.query_seq_lengths is not None or p.key_value_seq_lengths is not None,
      "segments": p.query_segment_ids is not None,
      "softcap": p.logits_soft_cap is not None,
      "sinks": p.sinks is not None,
  }
  unsupported = [name for name, used in needed.items() if used and name not in supported]
  if unsupported:
    reasons.append(f"{', '.join(unsupported)} (not supported by the kernels yet)")
  return "; ".join(reasons) or None


def forward_reason(p: Problem) -> str | None:
  """None if the forward kernel takes this problem, else every reason why
  not (a user who mends one should not meet the next one after)."""
  if _INTERPRET.value == "off" and (reason := why_not_hopper()):
    return reason
  try:
    from flash3.kernels import forward
  except ImportError:
    return "the forward kernel is not available in this build"
  features = _feature_reason(p, getattr(forward, "SUPPORTED_FEATURES", frozenset()))
  # The shape checks under a dtype the kernels take: an unsupported dtype is
  # named above already.
  dtype = p.q.dtype if p.q.dtype.itemsize == 2 else jnp.dtype(jnp.float16)
  shapes = forward.unsupported_reason(p.q.shape, p.k.shape, dtype, p.spec)
  return "; ".join(r for r in (features, shapes) if r) or None


def warn_once(message: str) -> None:
  if message not in _warned:
    _warned.add(message)
    warnings.warn(message, UserWarning, stacklevel=4)


def choose(p: Problem, implementation: str | None) -> str:
  """Returns "mosaic" or "xla" for this problem."""
  if implementation == "xla":
    return "xla"
  reason = forward_reason(p)
  if reason is None:
    return "mosaic"
  if implementation == "mosaic":
    raise NotImplementedError(
        f"flash3: implementation='mosaic' cannot run this call: {reason}")
  warn_once(f"flash3: using the XLA reference path: {reason}")
  return "xla"
