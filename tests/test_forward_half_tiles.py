"""``ForwardConfig.half_edge_tiles``: a warpgroup computes only the half of its
first or last key tile that the mask lets its rows see.

The choice of tiles (``forward._half_edges``) is checked on numbers; the kernel
in interpret mode (with race detection) against the float32 reference and
against the same config without half tiles; the lowering for the GPU on the
CPU; and on an H100/H200 against the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flash3.kernels.config import ForwardConfig
from flash3.kernels.forward import _half_edges, _tile_ranges, attention_forward
from flash3.visibility import MaskSpec

from test_forward_kernel import (CAUSAL_BR, CAUSAL_TL, NO_MASK, _expand_opts,
                                 assert_interpret_knob_close, assert_matches_opts,
                                 make_qkv)

W = MaskSpec


# ----------------------------------------------------------------------------
# Config and the choice of half tiles (CPU, fast)
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(block_kv=64), dict(block_kv=192),
                                dict(overlap_softmax=True),
                                dict(half_edge_tiles=1)])
def test_config_rejects_half_tiles_it_cannot_run(kw):
  kw = {"half_edge_tiles": True, **kw}
  with pytest.raises(ValueError, match="half_edge_tiles"):
    ForwardConfig(**kw)


@pytest.mark.parametrize("D, mask, kv_len, want", [
    (64, W(causal=True, window_left=1024), 16384, True),
    (128, W(causal=True, window_left=1024), 16384, True),
    (128, W(window_left=500, window_right=500), 16384, True),
    (256, W(causal=True, window_left=1024), 16384, False),  # 64-key tiles
    (128, CAUSAL_BR, 16384, True),
    (64, CAUSAL_BR, 4096, True),  # 256-key tiles, persistent
    (256, CAUSAL_BR, 16384, False),  # 64-key tiles
    (128, NO_MASK, 4096, False),
    (128, W(window_left=4096, window_right=4096), 2048, False),  # does not bind
])
def test_windows_and_causal_take_half_tiles_by_default(D, mask, kv_len, want):
  # Eleventh session: a causal window of 1024 at T=16384 ran 6% faster;
  # twelfth: plain causal 0 to +1.3%, causal documents +0.6 to +4.0%.
  from flash3.kernels.config import forward_config
  for interpret in (False, True):
    config = forward_config(D, jnp.bfloat16, mask, kv_len, kv_len, interpret=interpret)
    assert config.half_edge_tiles is want


def _edges(mask, q_lo, Tq, Tk, block_kv=128, block_q=64):
  q_hi = min(q_lo + block_q, Tq)
  shift = mask.shift(Tq, Tk)
  w_lo, w_hi = _tile_ranges(mask, q_lo, q_hi, shift, Tk, block_kv)
  a, b = _half_edges(mask, q_lo, q_hi, shift, Tk, w_lo, w_hi, block_kv)
  return int(w_lo), int(w_hi), int(a), int(b)


@pytest.mark.parametrize("q_lo, want", [
    # A causal window of 1024 at T=16384, 128-key tiles, CTA rows 1024..1151.
    # Warpgroup 0 (rows 1024..1087) sees keys 0..1087: tile 8's upper half
    # (1088..1151) is past its last row.
    (1024, (0, 9, 0, 8)),
    # Warpgroup 1 (rows 1088..1151) sees keys 64..1151: tile 0's lower half
    # is before its window.
    (1088, (0, 9, 1, 9)),
    # Further on, the same two cases shifted by whole tiles.
    (4096, (24, 33, 24, 32)),
    (4160, (24, 33, 25, 33)),
])
def test_half_edges_of_a_causal_window(q_lo, want):
  mask = W(causal=True, window_left=1024, alignment="bottom_right")
  assert _edges(mask, q_lo, 16384, 16384) == want


@pytest.mark.parametrize("mask, q_lo, Tq, Tk, want", [
    # No mask: every key is seen, no half tile.
    (NO_MASK, 0, 256, 256, (0, 2, 0, 2)),
    # Plain causal, rows 0..63: the first tile's upper half is in the future.
    (CAUSAL_TL, 0, 256, 256, (0, 1, 0, 0)),
    (CAUSAL_TL, 64, 256, 256, (0, 1, 0, 1)),
    # A ragged end: 180 keys, the last tile holds keys 128..179 < 192: only
    # its lower half is computed; with 200 keys the whole tile.
    (NO_MASK, 0, 64, 180, (0, 2, 0, 1)),
    (NO_MASK, 0, 64, 200, (0, 2, 0, 2)),
    # Rows 192..255, causal window of 150: keys from 42, in tile 0's lower
    # half, so the whole tile; a window of 100 starts at key 92: upper half.
    (W(causal=True, window_left=150), 192, 256, 256, (0, 2, 0, 2)),
    (W(causal=True, window_left=100), 192, 256, 256, (0, 2, 1, 2)),
    # Rows 0..63 with a window (left 30, right 0) see keys 0..63 only: one
    # half tile; with right 10 (keys up to 73) the whole tile.
    (W(window_left=30, window_right=0), 0, 256, 256, (0, 1, 0, 0)),
    (W(window_left=30, window_right=10), 0, 256, 256, (0, 1, 0, 1)),
])
def test_half_edges_cases(mask, q_lo, Tq, Tk, want):
  assert _edges(mask, q_lo, Tq, Tk) == want


def test_interpret_cases_take_both_halves():
  # Mask alone (documents only narrow the tiles): some warpgroup of the
  # cases computes an upper half (a > w_lo) and some a lower half (b < w_hi).
  uppers = lowers = 0
  for _, _, Tq, Tk, _, _, _, _, mask, block_kv, _ in INTERPRET_CASES:
    for q_lo in range(0, Tq, 64):
      w_lo, w_hi, a, b = _edges(mask, q_lo, Tq, Tk, block_kv)
      uppers += a > w_lo
      lowers += b < w_hi
  assert uppers > 0 and lowers > 0
  # The case with documents, rows 256..319: tile 0's upper half (keys from
  # 126) and tile 2's lower half (keys up to 319).
  assert _edges(W(causal=True, window_left=130), 256, 384, 384) == (0, 3, 1, 2)


def test_half_edges_never_empty_a_tile_some_row_sees():
  # Exhaustive over small shapes: every key a row of the warpgroup sees lies
  # in the computed range [a (upper half if a > w_lo), b (lower half of b)).
  rng = np.random.default_rng(0)
  for _ in range(300):
    Tq, Tk = (int(x) for x in rng.integers(1, 600, 2))
    left = None if rng.random() < 0.3 else int(rng.integers(0, 400))
    right = None if rng.random() < 0.3 else int(rng.integers(0, 400))
    causal = bool(rng.random() < 0.5)
    mask = W(causal=causal, window_left=left, window_right=None if causal else right,
             alignment=str(rng.choice(["top_left", "bottom_right"])))
    shift = mask.shift(Tq, Tk)
    block_kv = int(rng.choice([128, 256]))
    hw = block_kv // 2
    for q_lo in range(0, Tq, 64):
      w_lo, w_hi, a, b = _edges(mask, q_lo, Tq, Tk, block_kv)
      lo_key = w_lo * block_kv + (hw if a > w_lo else 0)
      hi_key = (w_hi - 1) * block_kv + hw if b < w_hi else w_hi * block_kv
      rows = np.arange(q_lo, min(q_lo + 64, Tq))[:, None]
      keys = np.arange(Tk)[None, :]
      seen = np.asarray(mask.visible(rows, keys, shift)).any(axis=0)
      idx = np.flatnonzero(seen)
      if idx.size:
        assert lo_key <= idx.min() and idx.max() < hi_key, (mask, Tq, Tk, q_lo)


# ----------------------------------------------------------------------------
# Interpret mode
# ----------------------------------------------------------------------------

INTERPRET_CASES = [
    # id, B, Tq, Tk, N, K, D, dtype, mask, block_kv, options
    ("causal-window", 1, 384, 384, 2, 1, 64, jnp.bfloat16,
     W(causal=True, window_left=130, alignment="bottom_right"), 128, {}),
    ("window-both-sides", 1, 300, 420, 2, 2, 64, jnp.float16,
     W(window_left=70, window_right=40), 128, {}),
    ("causal-tl-ragged", 2, 200, 150, 2, 1, 64, jnp.bfloat16, CAUSAL_TL, 128, {}),
    ("causal-br-lengths", 2, 256, 320, 2, 1, 64, jnp.float16, CAUSAL_BR, 128,
     dict(q_lengths=[256, 100], kv_lengths=[320, 150])),
    ("causal-segments-sinks", 1, 320, 320, 2, 1, 64, jnp.bfloat16,
     W(causal=True, window_left=200), 128,
     dict(segments=([[70, 130, 120]], [[70, 130, 120]]), sinks=[0.3, -1.0])),
    ("causal-window-256", 1, 512, 512, 2, 1, 64, jnp.bfloat16,
     W(causal=True, window_left=200), 256, {}),
    # Rows 256..319 see keys from 126: tile 0's upper half only, with its
    # segment ids loaded from key 64 (one document spans keys 20..383).
    ("window-upper-half-segments", 1, 384, 384, 2, 1, 64, jnp.bfloat16,
     W(causal=True, window_left=130), 128,
     dict(segments=([[20, 364]], [[20, 364]]), softcap=5.0)),
]


# Each case on the grid kernel; the persistent kernel (2 CTAs looping over the
# items) on the two with the most unequal items.
INTERPRET_RUNS = [(c, False) for c in INTERPRET_CASES] + [
    (c, True) for c in INTERPRET_CASES if c[0] in ("causal-window", "causal-segments-sinks")]


@pytest.mark.interpret
@pytest.mark.parametrize("case, persistent", INTERPRET_RUNS,
                         ids=[c[0] + ("-persistent" if p else "") for c, p in INTERPRET_RUNS])
def test_interpret_half_tiles_match_reference_no_races(case, persistent):
  _, B, Tq, Tk, N, K, D, dtype, mask, block_kv, opts = case
  opts = _expand_opts(opts, Tq, Tk)
  q, k, v = make_qkv(jax.random.key(Tq + 3 * Tk), B, Tq, Tk, N, K, D, dtype)
  config = ForwardConfig(block_kv=block_kv, num_stages=2, half_edge_tiles=True,
                         persistent=persistent, num_sms=2,
                         reverse_q_tiles=mask.causal)
  # The skipped halves hold only masked keys (exp2(-inf) = 0): the same
  # result as computing whole tiles, up to the order of float32 sums.
  assert_interpret_knob_close(q, k, v, scale=D ** -0.5, mask=mask, config=config,
                              field="half_edge_tiles", **opts)


# ----------------------------------------------------------------------------
# Lowering for the GPU (on the CPU) and the GPU
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("D, block_kv, fma_cols", [
    (64, 128, 0), (128, 128, 0), (64, 256, 0), (256, 128, 0),
    # More FMA-pipe exp2 columns than a half tile has: capped to its width.
    (128, 128, 96), (64, 256, 256)])
def test_half_tiles_lower_for_the_gpu(D, block_kv, fma_cols):
  q, k, v = make_qkv(jax.random.key(0), 1, 1000, 1000, 4, 2, D, jnp.bfloat16)
  mask = W(causal=True, window_left=300)
  stages = 1 if D == 256 else 2
  config = ForwardConfig(block_kv=block_kv, num_stages=stages, half_edge_tiles=True,
                         exp2_fma_cols=fma_cols)
  f = lambda q, k, v: attention_forward(q, k, v, scale=0.1, mask=mask, config=config)
  text = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


GPU_CASES = [
    # B, Tq, Tk, N, K, D, dtype, mask, block_kv, persistent
    (1, 4096, 4096, 16, 16, 128, jnp.bfloat16, W(causal=True, window_left=1024), 128, True),
    (2, 1000, 1200, 8, 2, 64, jnp.float16, W(window_left=100, window_right=50), 128, False),
    (1, 2048, 2048, 8, 2, 128, jnp.bfloat16, CAUSAL_BR, 128, False),
    (2, 777, 1025, 4, 1, 64, jnp.bfloat16, CAUSAL_BR, 256, True),
    (1, 2048, 2048, 4, 4, 256, jnp.float16, W(causal=True, window_left=500), 128, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"D{c[5]}-T{c[1]}x{c[2]}-bk{c[8]}")
def test_gpu_half_tiles_match_reference(case):
  B, Tq, Tk, N, K, D, dtype, mask, block_kv, persistent = case
  q, k, v = make_qkv(jax.random.key(Tq + Tk + D), B, Tq, Tk, N, K, D, dtype)
  config = ForwardConfig(block_kv=block_kv, num_stages=1 if D == 256 else 2,
                         half_edge_tiles=True, persistent=persistent,
                         reverse_q_tiles=mask.causal)
  o, lse = attention_forward(q, k, v, scale=D ** -0.5, mask=mask, config=config)
  assert_matches_opts(o, lse, q, k, v, scale=D ** -0.5, mask=mask)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_half_tiles_with_documents_lengths_and_softcap(D):
  # Windows edges mid-tile in both halves, inside documents of unequal
  # lengths (segment ids loaded from a half tile's first key), with lengths.
  B, T = 2, 2048
  mask = W(causal=True, window_left=330)
  q, k, v = make_qkv(jax.random.key(D), B, T, T, 4, 2, D, jnp.bfloat16)
  opts = _expand_opts(dict(segments=([[20, 1500, 528], [700, 1348]],) * 2,
                           softcap=30.0, q_lengths=[2048, 1500],
                           kv_lengths=[2048, 1700]), T, T)
  config = ForwardConfig(block_kv=128, half_edge_tiles=True, reverse_q_tiles=True)
  o, lse = attention_forward(q, k, v, scale=D ** -0.5, mask=mask, config=config, **opts)
  assert_matches_opts(o, lse, q, k, v, scale=D ** -0.5, mask=mask, **opts)
