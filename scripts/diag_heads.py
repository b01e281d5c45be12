"""Diagnoses flash3's forward under jit with q/k/v sharded over heads on 2 GPUs."""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import flash3
mesh = jax.make_mesh((2,), ("heads",), axis_types=(AxisType.Auto,))
B, T, N, K, D = 2, 256, 4, 4, 64
ks = jax.random.split(jax.random.key(0), 3)
q, k, v = (jax.random.normal(kk, (B, T, n, D), jnp.bfloat16) for kk, n in zip(ks, (N, K, K)))
f = jax.jit(lambda q, k, v: flash3.dot_product_attention(q, k, v, implementation="mosaic"))
want = np.asarray(f(q, k, v), np.float32)
sh = NamedSharding(mesh, P(None, None, "heads", None))
args = [jax.device_put(x, sh) for x in (q, k, v)]
got = f(*args)
print("out sharding", got.sharding)
for s in got.addressable_shards:
  print("shard", s.device, s.index, "nan", bool(jnp.isnan(s.data.astype(jnp.float32)).any()))
got = np.asarray(got, np.float32)
for h in range(N):
  print("head", h, "max err", np.nanmax(np.abs(got[:, :, h] - want[:, :, h])), "nan", np.isnan(got[:, :, h]).any())
# Is head h of the sharded result equal to some other head of the reference?
for h in range(N):
  print("head", h, "matches ref heads", [g for g in range(N) if np.allclose(got[:, :, h], want[:, :, g], atol=1e-2)])
txt = f.lower(*args).compile().as_text()
import re
print("custom calls:", len(re.findall("custom-call", txt)))
for line in txt.splitlines():
  if "custom-call" in line or "ENTRY" in line or "parameter(" in line:
    print(line[:300])
