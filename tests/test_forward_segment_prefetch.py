"""``ForwardConfig.prefetch_segment_ids``: a masked step with segment ids loads
its key tile's ids before its Q K^T instead of after the scores. Only the
order of the work changes, so the result is bitwise the plain order's: in
interpret mode (with race detection) and on an H100/H200, where the ids come
from global memory.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flash3.kernels.config import ForwardConfig
from flash3.kernels.forward import attention_forward, default_config
from flash3.visibility import MaskSpec

from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from test_forward_kernel import (CAUSAL_BR, NO_MASK, _expand_opts, assert_matches_opts,
                                 case_inputs, make_qkv, run_interpret_opts)

W = MaskSpec

CASES = [
    # id, B, Tq, Tk, N, K, D, mask, config fields, options
    ("causal-docs", 1, 384, 384, 2, 1, 64, CAUSAL_BR, dict(half_edge_tiles=True),
     dict(segments=([[100, 200, 84]], [[100, 200, 84]]))),
    ("docs-no-mask-persistent", 2, 256, 320, 2, 2, 64, NO_MASK,
     dict(persistent=True, num_sms=2),
     dict(segments=([[56, 200], [256]], [[90, 230], [100, 220]]))),
    ("window-docs-softcap", 1, 320, 320, 2, 1, 64, W(causal=True, window_left=150),
     dict(half_edge_tiles=True),
     dict(segments=([[20, 280, 20]], [[20, 280, 20]]), softcap=5.0)),
    ("trimmed-end-docs", 1, 256, 300, 2, 1, 64, NO_MASK,
     dict(block_kv=192, trim_end_tile=True),
     dict(segments=([[256]], [[30, 270]]))),
]


@pytest.mark.interpret
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpret_prefetched_ids_are_bitwise_the_plain_order(case):
  q, k, v, mask, fields, opts, scale = case_inputs(case, 5)
  config = ForwardConfig(**dict(dict(num_stages=2), **fields))
  o, lse = run_interpret_opts(
      q, k, v, scale=scale, mask=mask, detect_races=True,
      config=dataclasses.replace(config, prefetch_segment_ids=True), **opts)
  assert not interpret_pallas_call.get_races().races_found
  assert_matches_opts(o, lse, q, k, v, scale=scale, mask=mask, **opts)
  o1, lse1 = run_interpret_opts(q, k, v, scale=scale, mask=mask, config=config, **opts)
  np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o1, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse1))


def test_prefetch_segment_ids_config_error():
  with pytest.raises(ValueError, match="prefetch_segment_ids"):
    ForwardConfig(prefetch_segment_ids=1)


@pytest.mark.gpu
@pytest.mark.parametrize("D, mask, persistent", [
    (128, CAUSAL_BR, False), (64, CAUSAL_BR, False), (128, CAUSAL_BR, True),
    (128, W(causal=True, window_left=700), False), (128, NO_MASK, False)])
def test_gpu_prefetched_ids_are_bitwise_the_plain_order(D, mask, persistent):
  # Documents of unequal lengths, not on tile edges, so that some masked
  # tiles hold two documents.
  B, T = 2, 4096
  opts = _expand_opts(dict(segments=([[1000, 2000, 1096], [300, 3000, 796]],) * 2),
                      T, T)
  q, k, v = make_qkv(jax.random.key(D + T), B, T, T, 8, 2, D, jnp.bfloat16)
  config = dataclasses.replace(
      default_config(D, jnp.bfloat16, mask, T, T, packed=True), persistent=persistent)
  o, lse = attention_forward(
      q, k, v, scale=D ** -0.5, mask=mask,
      config=dataclasses.replace(config, prefetch_segment_ids=True), **opts)
  o1, lse1 = attention_forward(q, k, v, scale=D ** -0.5, mask=mask, config=config, **opts)
  assert bool(jnp.all(o == o1)), "o differs from the plain order"
  assert bool(jnp.all(lse == lse1)), "lse differs from the plain order"
  assert_matches_opts(o, lse, q, k, v, scale=D ** -0.5, mask=mask, **opts)
