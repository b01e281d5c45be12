"""A GPT-style decoder in plain JAX: pre-norm, rotary embeddings, GQA, SwiGLU MLP.

Parameters are a dict of float32 arrays (the master weights); the forward pass casts them
to bfloat16 once, so activations and matmuls run in bfloat16 while norms, softmax
statistics inside attention and the loss are float32. The layers' parameters are stacked
on a leading axis and run with lax.scan, so compile time does not grow with depth.

Rotary embeddings: Su et al., "RoFormer" (2021), section 3.4, in the rotate-half form;
positions restart at 0 at each document start within a packed row.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from . import attention as attention_lib


@dataclasses.dataclass(frozen=True)
class Config:
  vocab_size: int = 256
  num_layers: int = 8
  num_heads: int = 8       # N, query heads
  num_kv_heads: int = 2    # K, key/value heads (GQA: N % K == 0)
  head_dim: int = 128      # D
  mlp_dim: int = 2816
  rope_base: float = 10000.0
  attention: str = "flash3"  # flash3 | cudnn | xla | identity
  max_segments: int = 0      # static bound on documents per row (cuDNN's packed layout)
  flash3_implementation: str | None = None  # None: kernels where supported, else XLA
  segments: bool = True  # False: attention and rotary positions ignore document boundaries

  @property
  def model_dim(self) -> int:
    return self.num_heads * self.head_dim

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                       f"num_kv_heads={self.num_kv_heads} (GQA)")


def init_params(config: Config, key: jax.Array) -> dict:
  """float32 parameters; output projections scaled by 1/sqrt(2 * layers) (GPT-2)."""
  d, L, F = config.model_dim, config.num_layers, config.mlp_dim
  N, K, D = config.num_heads, config.num_kv_heads, config.head_dim
  keys = iter(jax.random.split(key, 9))
  std, out_std = 0.02, 0.02 / math.sqrt(2 * L)

  def normal(shape, s):
    return s * jax.random.normal(next(keys), shape, jnp.float32)

  return {
      "embed": normal((config.vocab_size, d), std),
      "layers": {
          "attn_norm": jnp.ones((L, d), jnp.float32),
          "wq": normal((L, d, N * D), std),
          "wk": normal((L, d, K * D), std),
          "wv": normal((L, d, K * D), std),
          "wo": normal((L, N * D, d), out_std),
          "mlp_norm": jnp.ones((L, d), jnp.float32),
          "w_gate": normal((L, d, F), std),
          "w_up": normal((L, d, F), std),
          "w_down": normal((L, F, d), out_std),
      },
      "final_norm": jnp.ones((d,), jnp.float32),
      "unembed": normal((d, config.vocab_size), std),
  }


def num_params(params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))


def rms_norm(x, scale, eps=1e-6):
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def positions_in_document(segment_ids):
  """int32[B, T]: index of each position within its document (0 at each start)."""
  B, T = segment_ids.shape
  t = jnp.arange(T, dtype=jnp.int32)[None, :]
  is_start = jnp.concatenate(
      [jnp.ones((B, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  start = jax.lax.cummax(jnp.where(is_start, t, 0), axis=1)
  return t - start


def rope(x, positions, base):
  """Rotate-half rotary embedding of x: [B, T, H, D] at positions int32[B, T]."""
  D = x.shape[-1]
  inv_freq = base ** (-jnp.arange(0, D // 2, dtype=jnp.float32) * 2 / D)
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def _block(config: Config, x, layer, positions, segment_ids):
  B, T, _ = x.shape
  N, K, D = config.num_heads, config.num_kv_heads, config.head_dim
  h = rms_norm(x, layer["attn_norm"])
  q = (h @ layer["wq"]).reshape(B, T, N, D)
  k = (h @ layer["wk"]).reshape(B, T, K, D)
  v = (h @ layer["wv"]).reshape(B, T, K, D)
  q = rope(q, positions, config.rope_base)
  k = rope(k, positions, config.rope_base)
  o = attention_lib.attend(q, k, v, segment_ids if config.segments else None,
                           config.attention, config.max_segments, config.flash3_implementation)
  x = x + o.reshape(B, T, N * D) @ layer["wo"]
  h = rms_norm(x, layer["mlp_norm"])
  x = x + (jax.nn.silu(h @ layer["w_gate"]) * (h @ layer["w_up"])) @ layer["w_down"]
  return x


def embed(table: jax.Array, inputs: jax.Array) -> jax.Array:
  """``table[inputs]`` as a one-hot matmul: [vocab, d] and int32 [B, T] -> [B, T, d].

  The same values as the gather, but its gradient is a matmul instead of a
  scatter-add of B*T rows into a 256-row table (atomics on a few addresses),
  which took 15-32 ms of a 90 ms train step on an H200 (twelfth session's
  trace, examples.train_gpt.timeline); the matmul accumulates in float32.
  """
  # HIGHEST: exact for a float32 table too (a GPU's default may be TF32).
  return jnp.matmul(jax.nn.one_hot(inputs, table.shape[0], dtype=table.dtype), table,
                    precision=jax.lax.Precision.HIGHEST)


def pick(logp: jax.Array, targets: jax.Array) -> jax.Array:
  """``logp[..., targets]`` by a one-hot product (elementwise in the backward)."""
  return jnp.sum(logp * jax.nn.one_hot(targets, logp.shape[-1], dtype=logp.dtype), axis=-1)


def forward(config: Config, params, inputs, segment_ids, dtype=jnp.bfloat16):
  """float32 logits [B, T, vocab] for int32 inputs [B, T]."""
  p = jax.tree.map(lambda a: a.astype(dtype), params)
  x = embed(p["embed"], inputs)
  if config.segments:
    positions = positions_in_document(segment_ids)
  else:
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)

  def body(x, layer):
    return _block(config, x, layer, positions, segment_ids), None

  x, _ = jax.lax.scan(body, x, p["layers"])
  x = rms_norm(x, p["final_norm"])
  return (x @ p["unembed"]).astype(jnp.float32)


def loss_fn(config: Config, params, batch) -> jax.Array:
  """Mean next-byte cross-entropy in nats over positions whose target is in the same document."""
  logits = forward(config, params, batch["inputs"], batch["segment_ids"])
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -pick(logp, batch["targets"])
  mask = batch["loss_mask"]
  return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)
