"""PNG plots: TFLOP/s against sequence length, one line per contender.

One figure per (suite, dtype, mode), one panel per (head_dim, mask, heads)
combination. Only "ok" results are drawn; a contender with no ok point in a
panel is left out of it. matplotlib is imported here only (the ``bench``
extra), with the Agg backend so no display is needed.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from typing import Iterable

from flash3.bench.results import Result

MODE_ORDER = ("fwd", "fwd+bwd", "bwd")


def _panel_key(r: Result) -> tuple:
  return (r.head_dim, r.mask, r.num_heads, r.num_kv_heads)


def _panel_title(key: tuple) -> str:
  d, mask, n, k = key
  heads = f"N={n}" if n == k else f"N={n} K={k}"
  return f"D={d} {mask} {heads}"


def figure_groups(results: Iterable[Result]) -> dict[tuple, list[Result]]:
  """ok results grouped by (suite, dtype, mode): one figure each."""
  groups = defaultdict(list)
  for r in results:
    if r.status == "ok" and r.tflops is not None:
      groups[(r.suite, r.dtype, r.mode)].append(r)
  return dict(groups)


# One colour per contender in every panel and figure (matplotlib's default
# cycle would restart per panel, so one colour would mean different contenders).
_KNOWN_IMPLS = ("cudnn", "flash3", "jax-mgpu", "tokamax", "xla", "cudnn-det", "flash3-nondet")


def impl_color(impl: str, impls: list[str]) -> str:
  """A stable "C<i>" colour: known contenders by their fixed rank, others after."""
  order = list(_KNOWN_IMPLS) + sorted(i for i in impls if i not in _KNOWN_IMPLS)
  return f"C{order.index(impl) % 10}"


def plot(results: Iterable[Result], out_dir: str, env: dict | None = None
         ) -> list[str]:
  """Write one PNG per (suite, dtype, mode) into ``out_dir``; return paths."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  os.makedirs(out_dir, exist_ok=True)
  paths = []
  for (suite, dtype, mode), rows in sorted(
      figure_groups(results).items(),
      key=lambda kv: (kv[0][0], kv[0][1], MODE_ORDER.index(kv[0][2]))):
    panels = defaultdict(list)
    for r in rows:
      panels[_panel_key(r)].append(r)
    keys = sorted(panels)
    cols = min(3, len(keys))
    nrows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows),
                             squeeze=False)
    impls = sorted({r.impl for r in rows})
    for ax, key in zip(axes.flat, keys):
      for impl in impls:
        pts = sorted((r.q_len, r.tflops) for r in panels[key] if r.impl == impl)
        if pts:
          ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                  label=impl, color=impl_color(impl, impls))
      ax.set_xscale("log", base=2)
      ax.set_title(_panel_title(key), fontsize=10)
      ax.set_xlabel("sequence length T")
      ax.set_ylabel("TFLOP/s")
      ax.set_ylim(bottom=0)
      ax.grid(True, alpha=0.3)
      ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(keys):]:
      ax.set_visible(False)
    title = f"{suite}: {mode}, {dtype}"
    if env:
      title += f" ({env.get('gpu', '?')}, jax {env.get('jax', '?')}, " \
               f"cuDNN {env.get('cudnn', '?')})"
    fig.suptitle(title)
    fig.tight_layout()
    name = f"{suite}_{dtype}_{mode.replace('+', '_')}.png"
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
  return paths
