"""Save and restore the training state as one .npz file, atomically.

The state is any pytree of arrays (here: float32 params and optax's AdamW state) plus the
number of steps already taken. Leaves are stored in tree-flatten order with their dtypes;
restoring needs a template with the same structure (a freshly initialised state), so no
pickled Python objects are written or read.
"""

from __future__ import annotations

import os
import pathlib

import jax
import numpy as np


def save(path: str | os.PathLike, state, step: int) -> None:
  """Write state and step to path (via a temporary file and rename, so a crash mid-write
  leaves the previous checkpoint intact)."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  leaves = jax.tree.leaves(state)
  arrays = {f"leaf_{i:05d}": np.asarray(x) for i, x in enumerate(leaves)}
  tmp = path.with_suffix(".tmp.npz")
  with open(tmp, "wb") as f:
    np.savez(f, step=np.int64(step), num_leaves=np.int64(len(leaves)), **arrays)
  os.replace(tmp, path)


def restore(path: str | os.PathLike, template):
  """(state, step) from path; state has template's tree structure.

  Raises ValueError if the file's leaves do not match the template's count, shapes or dtypes
  (e.g. a checkpoint from a model of another size).
  """
  leaves, treedef = jax.tree.flatten(template)
  hint = ("; a checkpoint from a run with other model flags (--preset, --num-layers, "
          "--head-dim, ...)? Use that run's flags, or another --out")
  with np.load(path) as f:
    n = int(f["num_leaves"])
    if n != len(leaves):
      raise ValueError(f"checkpoint {path} has {n} arrays, the model needs "
                       f"{len(leaves)}{hint}")
    loaded = []
    for i, ref in enumerate(leaves):
      a = f[f"leaf_{i:05d}"]
      if a.shape != tuple(ref.shape) or a.dtype != np.dtype(ref.dtype):
        raise ValueError(f"checkpoint {path} array {i}: {a.shape} {a.dtype}, expected "
                         f"{tuple(ref.shape)} {np.dtype(ref.dtype)}{hint}")
      loaded.append(jax.numpy.asarray(a))
    step = int(f["step"])
  return jax.tree.unflatten(treedef, loaded), step
