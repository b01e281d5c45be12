"""``BackwardConfig.late_keep``: the dq kernel forms a masked tile's keep where
it uses it (the default) or at the top of its step (False, the order before the
fortieth session). The same pairs are masked, so dq, dk and dv are bitwise
equal either way: interpret mode on the masks whose tiles the dq kernel masks
(causal both alignments with a ragged tail, a window's one-sided edges,
lengths, packed documents, a soft cap); on an H100/H200 the same at D = 64
and 128, where the keep is formed inside the overlapped matmuls' window
(interpret mode runs the plain order).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from flash3.kernels.backward_config import BackwardConfig
from flash3.visibility import MaskSpec as W

from test_backward_kernel import assert_gpu_config_field_is_bitwise, check_opts, run_opts

BF16, F16 = jnp.bfloat16, jnp.float16

CASES = [
    # id, B, Tq, Tk, N, K, D, dtype, mask, options
    ("causal-ragged", 1, 200, 200, 2, 1, 64, BF16, W(causal=True), {}),
    ("causal-br-lengths", 2, 150, 260, 4, 2, 64, F16,
     W(causal=True, alignment="bottom_right"),
     dict(q_lengths=[150, 61], kv_lengths=[260, 99])),
    ("causal-window", 1, 384, 384, 2, 1, 64, BF16, W(causal=True, window_left=130), {}),
    ("documents-softcap", 1, 256, 256, 2, 1, 64, BF16, W(causal=True),
     dict(segments=([[40, 216]], [[40, 216]]), softcap=5.0)),
]


def test_config_field_is_checked():
  with pytest.raises(ValueError, match="late_keep"):
    BackwardConfig(late_keep=1)
  assert BackwardConfig().late_keep


@pytest.mark.interpret
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpret_late_keep_is_bitwise_the_early_keep(case):
  _, B, Tq, Tk, N, K, D, dtype, mask, opts = case
  (q, k, v, do), o_lse, grads = check_opts(
      B, Tq, Tk, N, K, D, dtype, mask, interpret=True,
      config=BackwardConfig(late_keep=True), **opts)
  base = run_opts(q, k, v, do, scale=D ** -0.5, mask=mask, opts=opts,
                  interpret=True, o_lse=o_lse, config=BackwardConfig(late_keep=False))
  for name, a, b in zip(("dq", "dk", "dv"), grads, base):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                  err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("mask", [W(causal=True), W(causal=True, window_left=300)],
                         ids=["causal", "window"])
def test_gpu_late_keep_is_bitwise_the_early_keep(D, mask):
  """The default config (late_keep) against the early keep; Tq = 1000 leaves a
  ragged last query tile. On the GPU the keep is formed inside the overlapped
  matmuls' window (interpret mode runs the plain order)."""
  assert_gpu_config_field_is_bitwise(D, mask, "late_keep", seed=11)
