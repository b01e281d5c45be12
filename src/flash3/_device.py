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


def why_not_hopper() -> str | None:
  """None on a Hopper GPU, else a sentence saying what the default device is."""
  if hopper_device_kind() is not None:
    return None
  device = jax.devices()[0]
  if device.platform != "gpu":
    return f"no Hopper GPU (the default device is a {device.platform})"
  return f"no Hopper GPU (the default device is a {device.device_kind}, not sm_90)"
