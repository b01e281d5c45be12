"""``ForwardConfig.one_sided_edges`` / ``BackwardConfig.one_sided_edges``: a
masked key tile that only the rows' lower (or only their upper) key bound can
cut is masked by comparing that bound alone (``tile_mask.edge_tiles``; the
rule itself is checked on numbers in tests/test_tile_mask.py); and
``BackwardConfig.dkv_row_bounds``, the dk/dv kernel's keep from each key's
query range instead of the pairwise rule.

The same elements are masked either way, so o, lse, dq, dk and dv are bitwise
those of comparing both bounds by the pairwise rule. Interpret mode (race detection on the forward) on
windows whose edge tiles take the one-sided loops (a causal window: the far
edge by its lower bound, the diagonal by its upper one) and the two-sided
ones (a window narrower than a key tile, lengths that cut an edge tile); on
an H100/H200 the same at D=128 with the default configs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flash3.kernels import forward
from flash3.kernels.backward_config import BackwardConfig
from flash3.kernels.config import ForwardConfig
from flash3.visibility import MaskSpec as W

from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from test_backward_kernel import assert_gpu_config_field_is_bitwise, check_opts, run_opts
from test_forward_kernel import (_expand_opts, assert_matches_opts, make_qkv,
                                 run_interpret_opts)

BF16, F16 = jnp.bfloat16, jnp.float16

CASES = [
    # id, B, Tq, Tk, N, K, D, dtype, mask, options
    # Rows 256..319 see keys 126..320: tile 0 is cut by the lower bound
    # alone, tile 2 by the upper one alone.
    ("causal-window", 1, 384, 384, 2, 1, 64, BF16,
     W(causal=True, window_left=130), {}),
    # 30 keys per row: both bounds cut the same 128-key tile.
    ("narrow-window", 1, 300, 420, 2, 2, 64, F16,
     W(window_left=20, window_right=9), {}),
    ("window-lengths", 2, 256, 320, 2, 1, 64, F16,
     W(causal=True, window_left=100, alignment="bottom_right"),
     dict(q_lengths=[256, 100], kv_lengths=[320, 150])),
    # Queries from 200 on see no key (all of their window lies past
    # kv_len = 100), though the formula's reach of key rows 100..127 (past
    # kv_len, in a tile with valid rows) covers some of them.
    ("window-past-kv-len", 1, 400, 400, 2, 1, 64, F16,
     W(window_left=100, window_right=100), dict(kv_lengths=[100])),
    ("window-segments-softcap", 1, 384, 384, 2, 1, 64, BF16,
     W(causal=True, window_left=130), dict(segments=([[20, 364]], [[20, 364]]),
                                           softcap=5.0)),
    # Plain causal: in the dk/dv kernel (rows are keys) the diagonal tiles
    # are cut by each key's lower query bound alone, the ragged last query
    # tile by q_len.
    ("causal-ragged", 1, 300, 320, 2, 1, 64, BF16, W(causal=True), {}),
    ("causal-lengths-gqa", 2, 200, 384, 4, 2, 64, F16,
     W(causal=True, alignment="bottom_right"),
     dict(q_lengths=[200, 77], kv_lengths=[384, 250])),
    # One window edge only: keys' query ranges bounded on one side.
    ("window-left-only", 1, 300, 300, 2, 1, 64, BF16, W(window_left=60), {}),
    ("window-right-only", 1, 260, 330, 2, 1, 64, F16, W(window_right=50), {}),
]
IDS = [c[0] for c in CASES]


def _forward_config(mask, persistent: bool, one_sided: bool) -> ForwardConfig:
  return ForwardConfig(block_kv=128, num_stages=2, half_edge_tiles=True,
                       persistent=persistent, num_sms=2,
                       reverse_q_tiles=mask.causal, one_sided_edges=one_sided)


def test_config_field_is_checked():
  with pytest.raises(ValueError, match="one_sided_edges"):
    ForwardConfig(one_sided_edges=1)
  with pytest.raises(ValueError, match="one_sided_edges"):
    BackwardConfig(one_sided_edges="yes")
  assert ForwardConfig().one_sided_edges and BackwardConfig().one_sided_edges


@pytest.mark.interpret
@pytest.mark.parametrize("persistent", [False, True], ids=["grid", "persistent"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_interpret_forward_is_bitwise_both_sides(case, persistent):
  _, B, Tq, Tk, N, K, D, dtype, mask, opts = case
  opts = _expand_opts(opts, Tq, Tk)
  q, k, v = make_qkv(jax.random.key(Tq + Tk), B, Tq, Tk, N, K, D, dtype)
  run = lambda one_sided, races=False: run_interpret_opts(
      q, k, v, scale=D ** -0.5, mask=mask, detect_races=races,
      config=_forward_config(mask, persistent, one_sided), **opts)
  o, lse = run(True, races=not persistent)
  if not persistent:
    assert not interpret_pallas_call.get_races().races_found
  assert_matches_opts(o, lse, q, k, v, scale=D ** -0.5, mask=mask, **opts)
  o2, lse2 = run(False)
  np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o2, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse2))


BACKWARD_CONFIGS = {
    "one_sided": BackwardConfig(one_sided_edges=True),
    "dkv_rows": BackwardConfig(dkv_row_bounds=True, one_sided_edges=False),
    "dkv_rows_one_sided": BackwardConfig(dkv_row_bounds=True, one_sided_edges=True),
}


@pytest.mark.interpret
@pytest.mark.parametrize("name", list(BACKWARD_CONFIGS))
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_interpret_backward_is_bitwise_pairwise_both_sides(case, name):
  """dq, dk, dv with one-sided edge tiles and / or the dk/dv kernel's row
  bounds (``BackwardConfig.dkv_row_bounds``) against the pairwise rule on
  both sides: the same pairs are selected to 0."""
  _, B, Tq, Tk, N, K, D, dtype, mask, opts = case
  opts = _expand_opts(opts, Tq, Tk)
  (q, k, v, do), o_lse, grads = check_opts(
      B, Tq, Tk, N, K, D, dtype, mask, interpret=True,
      config=BACKWARD_CONFIGS[name], **opts)
  both = run_opts(q, k, v, do, scale=D ** -0.5, mask=mask, opts=opts,
                  interpret=True, o_lse=o_lse,
                  config=BackwardConfig(one_sided_edges=False, dkv_row_bounds=False))
  for grad, a, b in zip(("dq", "dk", "dv"), grads, both):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                  err_msg=grad)


# ----------------------------------------------------------------------------
# H100 / H200
# ----------------------------------------------------------------------------

GPU_MASKS = [
    ("causal-window-1024", W(causal=True, window_left=1024)),
    ("window-300-200", W(window_left=300, window_right=200)),
    ("narrow-window-br", W(window_left=40, window_right=3, alignment="bottom_right")),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name, mask", GPU_MASKS, ids=[m[0] for m in GPU_MASKS])
def test_gpu_default_configs_are_bitwise_both_sides(name, mask):
  """D=128, T=4096 (Tq=4000 against Tk=4096 for the narrow window): the
  default forward and backward configs (windows: the dk/dv kernel's row
  bounds) against both sides compared by the pairwise rule."""
  del name
  B, N, D = 1, 4, 128
  Tq = 4000 if mask.alignment == "bottom_right" else 4096
  Tk = 4096
  q, k, v = make_qkv(jax.random.key(7), B, Tq, Tk, N, N, D, BF16)
  do = jax.random.normal(jax.random.key(8), q.shape, jnp.float32).astype(BF16)
  fwd_base = forward.default_config(D, BF16, mask, Tq, Tk)
  bwd_base = BackwardConfig.heuristic(D, Tq, Tk, mask)
  results = {}
  for one_sided in (True, False):
    fwd = dataclasses.replace(fwd_base, one_sided_edges=one_sided)
    o, lse = forward.attention_forward(q, k, v, scale=D ** -0.5, mask=mask, config=fwd)
    bwd = dataclasses.replace(bwd_base, one_sided_edges=one_sided,
                              dkv_row_bounds=bwd_base.dkv_row_bounds and one_sided)
    grads = run_opts(q, k, v, do, scale=D ** -0.5, mask=mask, opts={},
                     interpret=False, o_lse=(o, lse), config=bwd)
    results[one_sided] = [np.asarray(x, np.float32) for x in (o, lse, *grads)]
  assert_matches_opts(results[True][0].astype(np.float32), results[True][1],
                      q, k, v, scale=D ** -0.5, mask=mask)
  for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), results[True], results[False]):
    assert np.isfinite(a).all() or name == "lse", name
    np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("D, mask, kv_len, want", [
    (64, W(causal=True, window_left=1024), 16384, True),
    (128, W(causal=True, window_left=1024), 16384, True),
    (128, W(window_left=300, window_right=200), 4096, True),
    (128, W(causal=True, alignment="bottom_right"), 16384, False),  # no window
    (128, W(), 4096, False),
    (128, W(window_left=8192, window_right=8192), 4096, False),  # does not bind
    (256, W(causal=True, window_left=1024), 16384, False),  # role split
])
def test_windows_take_the_dkv_row_bounds_by_default(D, mask, kv_len, want):
  # Offline (ptxas): the dk/dv kernel's masked window loops 852-864 -> 595-607
  # instructions at D=128; plain causal's unmasked loop grew, so it keeps the
  # pairwise rule (docs/ptxas.md).
  for deterministic in (True, False):
    config = BackwardConfig.heuristic(D, kv_len, kv_len, mask, deterministic=deterministic)
    assert config.dkv_row_bounds is want
    assert config.one_sided_edges


SINGLE_KERNEL_CASES = ["narrow-window", "window-lengths", "window-past-kv-len",
                       "causal-ragged", "causal-lengths-gqa"]


@pytest.mark.interpret
@pytest.mark.parametrize("case", [c for c in CASES if c[0] in SINGLE_KERNEL_CASES],
                         ids=SINGLE_KERNEL_CASES)
def test_interpret_single_kernel_backward_with_row_bounds(case):
  """deterministic=False at D=64 (dq summed from the dk/dv kernel's dsT): its
  row-bound keep (the heuristic's for windows, forced for plain causal)
  against the pairwise rule. Key rows past kv_len must give dsT = 0 there,
  since dq sums over them."""
  _, B, Tq, Tk, N, K, D, dtype, mask, opts = case
  opts = _expand_opts(opts, Tq, Tk)
  config = BackwardConfig.heuristic(D, Tq, Tk, mask, interpret=True, deterministic=False)
  assert config.dkv_row_bounds != (mask.window_left is None and mask.window_right is None)
  config = dataclasses.replace(config, dkv_row_bounds=True)
  assert not config.deterministic
  (q, k, v, do), o_lse, grads = check_opts(B, Tq, Tk, N, K, D, dtype, mask,
                                           interpret=True, config=config, **opts)
  pairwise = run_opts(q, k, v, do, scale=D ** -0.5, mask=mask, opts=opts,
                      interpret=True, o_lse=o_lse,
                      config=dataclasses.replace(config, dkv_row_bounds=False,
                                                 one_sided_edges=False))
  for grad, a, b in zip(("dq", "dk", "dv"), grads, pairwise):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                  err_msg=grad)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_gpu_causal_dkv_row_bounds_are_bitwise_pairwise(D, alignment):
  """Plain causal with the dk/dv kernel's row bounds (its diagonal tiles by
  each key's lower query bound alone) against the default pairwise rule, at
  the default config otherwise; Tq = 1000 leaves a ragged last query tile."""
  mask = W(causal=True, alignment=alignment)
  assert not BackwardConfig.heuristic(D, 1000, 1024, mask).dkv_row_bounds
  assert_gpu_config_field_is_bitwise(D, mask, "dkv_row_bounds", seed=9)
