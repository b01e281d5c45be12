"""Mosaic GPU's own shared-memory count of kernels lowered for CUDA on the CPU.

Shared by the forward and backward kernel tests: they check that the configs'
``smem`` estimates match what Mosaic GPU allocates.
"""

import jax


def lowered_smem_totals(monkeypatch, f, *args) -> list[int]:
  """Lowers ``f(*args)`` for CUDA on the CPU; returns the shared-memory bytes
  Mosaic GPU allocated for each kernel launch (in lowering order)."""
  from jax.experimental.mosaic.gpu import core as mgpu_core
  totals = []
  tree_size = mgpu_core._smem_tree_size

  def count(tree):
    totals.append(tree_size(tree))
    return totals[-1]

  monkeypatch.setattr(mgpu_core, "_smem_tree_size", count)
  jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
  return totals
