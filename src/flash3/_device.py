"""Which accelerator we are on: the kernels need Hopper (compute capability 9.0)."""

from __future__ import annotations

import functools

import jax


@functools.cache
def hopper_device_kind() -> str | None:
  """The device kind of the default backend's first GPU if it is Hopper, else None."""
  try:
    devices = jax.devices()
  except RuntimeError:
    return None
  device = devices[0]
  if device.platform != "gpu":
    return None
  capability = getattr(device, "compute_capability", None)
  if capability is None or not str(capability).startswith("9."):
    return None
  return device.device_kind


# SMs of an H100 / H200 SXM: the persistent kernel's CTA count where no GPU
# says otherwise (interpret mode, lowering on a CPU machine).
DEFAULT_SM_COUNT = 132


@functools.cache
def sm_count() -> int:
  """Streaming multiprocessors of the default backend's first Hopper GPU
  (``Device.core_count``: 132 on H100/H200 SXM, 114 on H100 PCIe), else
  ``DEFAULT_SM_COUNT``."""
  if hopper_device_kind() is None:
    return DEFAULT_SM_COUNT
  count = getattr(jax.devices()[0], "core_count", None)
  return int(count) if count else DEFAULT_SM_COUNT


def why_not_hopper() -> str | None:
  """None on a Hopper GPU, else a sentence saying what the default device is."""
  if hopper_device_kind() is not None:
    return None
  device = jax.devices()[0]
  if device.platform != "gpu":
    return f"no Hopper GPU (the default device is a {device.platform})"
  return f"no Hopper GPU (the default device is a {device.device_kind}, not sm_90)"
