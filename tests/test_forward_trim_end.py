"""``ForwardConfig.trim_end_tile``: the key tile that holds the last key
computes only its first keys, rounded up to a multiple of 64.

The choice of the tile and its width (``forward._trimmed_end``,
``forward.key_part``) is checked on numbers; the kernel in interpret mode (with
race detection) against the float32 reference and against whole tiles; the
lowering for the GPU on the CPU; and on an H100/H200 against the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flash3.kernels.config import ForwardConfig
from flash3.kernels.forward import _trimmed_end, attention_forward, key_part
from flash3.visibility import MaskSpec

from test_forward_kernel import (CAUSAL_BR, CAUSAL_TL, NO_MASK, _expand_opts,
                                 assert_interpret_knob_close, assert_matches_opts,
                                 make_qkv)

W = MaskSpec


@pytest.mark.parametrize("kw", [dict(overlap_softmax=True), dict(fuse_pv_qk=True),
                                dict(trim_end_tile=1)])
def test_config_rejects_trimming_it_cannot_run(kw):
  kw = {"trim_end_tile": True, **kw}
  with pytest.raises(ValueError, match="trim_end_tile"):
    ForwardConfig(**kw)


@pytest.mark.parametrize("Tk, block_kv, want", [
    (4096, 192, (21, 64)),     # 21 * 192 = 4032: 64 keys left
    (2048, 192, (10, 128)),    # 1920: 128 left
    (8192, 192, (42, 128)),
    (16384, 192, (85, 64)),
    (4096, 128, None),         # whole tiles
    (1000, 128, None),         # 104 keys left: rounded up, the whole tile
    (1000, 256, None),         # 232 left: rounded up, the whole tile
    (300, 256, (1, 64)),       # 44 left
    (65, 192, (0, 128)),       # one tile, 65 keys
    (64, 192, (0, 64)),
    (190, 192, None),
])
def test_trimmed_end(Tk, block_kv, want):
  assert _trimmed_end(Tk, block_kv) == want


def test_trimmed_end_needs_a_static_length():
  assert _trimmed_end(jnp.int32(4096), 192) is None
  assert _trimmed_end(np.int64(4096), 192) == (21, 64)


@pytest.mark.parametrize("part, w_end, want", [
    (None, 64, (0, 64)), (None, 192, (0, 192)),
    ((0, 128), 64, (0, 64)),     # a half edge tile's lower half, trimmed
    ((0, 128), 192, (0, 128)),   # already within: unchanged
    ((128, 128), 192, (128, 64)),
])
def test_key_part(part, w_end, want):
  assert key_part(part, w_end, 256) == want


def test_key_part_rejects_a_part_past_the_end():
  with pytest.raises(ValueError, match="part"):
    key_part((128, 128), 128, 256)


INTERPRET_CASES = [
    # id, B, Tq, Tk, N, K, D, dtype, mask, block_kv, fields, options
    # 192-key tiles, 256 keys: tile 1 holds 64.
    ("no-mask-192", 1, 200, 256, 2, 1, 64, jnp.bfloat16, NO_MASK, 192, {}, {}),
    # 300 keys in 192-key tiles: tile 1's 108 keys run as 128, masked.
    ("ragged-192-fp16", 2, 130, 300, 2, 2, 64, jnp.float16, NO_MASK, 192, {}, {}),
    # Causal, bottom-right: the diagonal's last tile is the trimmed one.
    ("causal-br-192", 1, 320, 320, 2, 1, 64, jnp.bfloat16, CAUSAL_BR, 192,
     dict(reverse_q_tiles=True), {}),
    # Half edge tiles and the trim together: 300 keys in 256-key tiles, the
    # upper edge's half tile (128 keys) cut to 64.
    ("causal-tl-half-256", 1, 300, 300, 2, 1, 64, jnp.bfloat16, CAUSAL_TL, 256,
     dict(half_edge_tiles=True), {}),
    ("window-192-segments-softcap-sinks", 1, 256, 448, 2, 1, 64, jnp.bfloat16,
     W(window_left=150, window_right=90), 192, {},
     dict(segments=([[256]], [[30, 418]]), softcap=7.0, sinks=[0.5, -2.0])),
]
# Each case on the grid kernel; two on the persistent kernel (2 CTAs).
INTERPRET_RUNS = [(c, False) for c in INTERPRET_CASES] + [
    (c, True) for c in INTERPRET_CASES if c[0] in ("ragged-192-fp16", "causal-br-192")]


@pytest.mark.interpret
@pytest.mark.parametrize("case, persistent", INTERPRET_RUNS,
                         ids=[c[0] + ("-persistent" if p else "") for c, p in INTERPRET_RUNS])
def test_interpret_trimmed_end_matches_reference_no_races(case, persistent):
  _, B, Tq, Tk, N, K, D, dtype, mask, block_kv, fields, opts = case
  opts = _expand_opts(opts, Tq, Tk)
  q, k, v = make_qkv(jax.random.key(Tq + 7 * Tk), B, Tq, Tk, N, K, D, dtype)
  config = ForwardConfig(block_kv=block_kv, num_stages=2, trim_end_tile=True,
                         persistent=persistent, num_sms=2, **fields)
  # The keys cut off lie past Tk (exp2(-inf) = 0): whole tiles give the same
  # result up to the order of float32 sums.
  assert_interpret_knob_close(q, k, v, scale=D ** -0.5, mask=mask, config=config,
                              field="trim_end_tile", **opts)


def test_interpret_cases_trim():
  # Every case has a trimmed end tile narrower than its other tiles.
  for _, _, _, Tk, *_, block_kv, _, _ in INTERPRET_CASES:
    assert _trimmed_end(Tk, block_kv) is not None


@pytest.mark.parametrize("D, block_kv, Tk, mask", [
    (64, 192, 4096, NO_MASK), (128, 192, 4096, NO_MASK), (128, 192, 2048, CAUSAL_BR),
    (64, 256, 1100, NO_MASK), (64, 256, 300, CAUSAL_TL)])
def test_trimmed_end_lowers_for_the_gpu(D, block_kv, Tk, mask):
  q, k, v = make_qkv(jax.random.key(0), 1, 512, Tk, 4, 2, D, jnp.bfloat16)
  config = ForwardConfig(block_kv=block_kv, num_stages=2, trim_end_tile=True)
  f = lambda q, k, v: attention_forward(q, k, v, scale=0.1, mask=mask, config=config)
  text = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


GPU_CASES = [
    # B, Tq, Tk, N, K, D, dtype, mask, block_kv, persistent
    (4, 4096, 4096, 16, 16, 128, jnp.bfloat16, NO_MASK, 192, True),
    (2, 2048, 2048, 16, 4, 128, jnp.bfloat16, NO_MASK, 192, False),
    (2, 1000, 1000, 8, 2, 64, jnp.float16, NO_MASK, 256, True),
    (1, 2048, 2112, 8, 8, 128, jnp.bfloat16, CAUSAL_BR, 192, True),
    (2, 777, 1025, 4, 1, 64, jnp.bfloat16, W(causal=True, window_left=300), 256, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES,
                         ids=lambda c: f"D{c[5]}-T{c[1]}x{c[2]}-bk{c[8]}-p{int(c[9])}")
def test_gpu_trimmed_end_matches_reference(case):
  B, Tq, Tk, N, K, D, dtype, mask, block_kv, persistent = case
  q, k, v = make_qkv(jax.random.key(Tq + Tk + D), B, Tq, Tk, N, K, D, dtype)
  config = ForwardConfig(block_kv=block_kv, num_stages=2, trim_end_tile=True,
                         persistent=persistent, reverse_q_tiles=mask.causal,
                         half_edge_tiles=block_kv == 256 and mask.causal)
  o, lse = attention_forward(q, k, v, scale=D ** -0.5, mask=mask, config=config)
  assert_matches_opts(o, lse, q, k, v, scale=D ** -0.5, mask=mask)
