"""Several GPUs with the kernels equal one GPU; the multi-GPU benchmark's CPU parts.

GPU tests (two Hopper GPUs; skipped otherwise): context parallelism (causal and
not, GQA, both layouts, a window) and batch/head sharding, forward and
gradients, against flash3's kernels on one GPU for the same full problem, up to
T = 131072. CPU tests: scripts/bench_multi_gpu.py's case list, arithmetic and
result files, and a tiny run on the 4 virtual CPU devices through the XLA path.
"""

import importlib.util
import json
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import flash3
from flash3._device import hopper_device_kind

GPUS = [d for d in jax.devices() if d.platform == "gpu"]
two_gpus = pytest.mark.skipif(
    len(GPUS) < 2 or hopper_device_kind() is None,
    reason=f"needs 2 Hopper GPUs; {len(GPUS)} GPU(s) visible")
# max|sharded - one GPU| / max|one GPU|: bfloat16 keeps 8 bits (0.4% a rounding);
# dk/dv summed over devices and chunks in bfloat16 add a few roundings.
TOL = {"o": 1e-2, "dq": 2e-2, "dk": 2e-2, "dv": 2e-2}


def _inputs(B, T, N, K, D=128, dtype=jnp.bfloat16, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  make = jax.jit(lambda: (jax.random.normal(ks[0], (B, T, N, D), dtype),
                          jax.random.normal(ks[1], (B, T, K, D), dtype),
                          jax.random.normal(ks[2], (B, T, K, D), dtype),
                          jax.random.normal(ks[3], (B, T, N, D), dtype)),
                 out_shardings=dev)
  return make()


def _forward_and_grads(attend, q, k, v, do):
  """o, lse and (dq, dk, dv) of o's cotangent do, in one jitted call."""
  @jax.jit
  def run(q, k, v, do):
    (o, lse), vjp = jax.vjp(attend, q, k, v)
    return o, lse, vjp((do, jnp.zeros_like(lse)))
  return run(q, k, v, do)


def _normalised_error(got, want):
  got = jax.device_put(got, jax.devices()[0]).astype(jnp.float32)
  want = want.astype(jnp.float32)
  return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def _assert_close(got: dict, want: dict):
  errors = {name: _normalised_error(got[name], want[name]) for name in want}
  bad = {n: e for n, e in errors.items() if not e <= TOL[n]}
  assert not bad, f"normalised errors {errors}; tolerances {TOL}"


def _one_gpu(q, k, v, do, **kw):
  attend = lambda q, k, v: flash3.dot_product_attention(
      q, k, v, implementation="mosaic", return_residual=True, **kw)
  o, lse, (dq, dk, dv) = _forward_and_grads(attend, q, k, v, do)
  return dict(o=o, dq=dq, dk=dk, dv=dv), lse


def _context_parallel(q, k, v, do, *, layout, causal, window=None):
  """CP on 2 GPUs; results back in natural order, on GPU 0."""
  n = 2
  mesh = jax.make_mesh((n,), ("ctx",), axis_types=(AxisType.Auto,), devices=GPUS[:n])
  seq = NamedSharding(mesh, P(None, "ctx", None, None))
  zig = layout == "zigzag"
  to = (lambda x: flash3.zigzag(x, n)) if zig else (lambda x: x)
  back = (lambda x: flash3.unzigzag(x, n)) if zig else (lambda x: x)
  args = [jax.device_put(to(x), seq) for x in (q, k, v, do)]
  attend = lambda q, k, v: flash3.context_parallel_attention(
      q, k, v, mesh=mesh, sequence_axis="ctx", layout=layout, is_causal=causal,
      local_window_size=window, implementation="mosaic", return_residual=True)
  o, lse, (dq, dk, dv) = _forward_and_grads(attend, *args)
  assert tuple(o.sharding.spec)[:2] == (None, "ctx")
  assert tuple(dk.sharding.spec)[:2] == (None, "ctx")
  g0 = lambda x: back(jax.device_put(x, GPUS[0]))
  return dict(o=g0(o), dq=g0(dq), dk=g0(dk), dv=g0(dv)), g0(lse)


def _check_context_parallel(B, T, N, K, layout, causal, window=None):
  q, k, v, do = _inputs(B, T, N, K)
  kw = dict(is_causal=causal)
  if window is not None:
    kw["local_window_size"] = (window, 0)
  want, want_lse = _one_gpu(q, k, v, do, **kw)
  got, got_lse = _context_parallel(q, k, v, do, layout=layout, causal=causal,
                                   window=window)
  _assert_close(got, want)
  assert float(jnp.max(jnp.abs(got_lse - want_lse))) < 1e-3


@pytest.mark.parametrize("layout,causal,N,K,window", [
    ("zigzag", True, 8, 2, None),
    ("zigzag", False, 8, 2, None),
    ("contiguous", True, 4, 4, None),
    ("contiguous", False, 4, 1, None),
    ("zigzag", True, 4, 2, 1000),
], ids=["zigzag-causal-gqa", "zigzag-full-gqa", "contiguous-causal",
        "contiguous-full-mqa", "zigzag-causal-window"])
@pytest.mark.gpu
@two_gpus
def test_context_parallel_equals_one_gpu_8192(layout, causal, N, K, window):
  _check_context_parallel(2, 8192, N, K, layout, causal, window)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_context_parallel_equals_one_gpu_131072(causal):
  # Two query heads over one key/value head (GQA) keep memory small at this length.
  _check_context_parallel(1, 131072, 2, 1, "zigzag", causal)


def _check_sharded(axis, split, N, K):
  """flash3 under jit on inputs sharded over ``split`` ("batch" or "heads") of a
  2-GPU mesh whose axis is named ``axis``: o and grads equal one GPU's."""
  q, k, v, do = _inputs(4, 2048, N, K)
  want, _ = _one_gpu(q, k, v, do, is_causal=True)
  mesh = jax.make_mesh((2,), (axis,), axis_types=(AxisType.Auto,), devices=GPUS[:2])
  spec = P(axis) if split == "batch" else P(None, None, axis, None)
  args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, do)]

  def run(q, k, v, do):
    o, vjp = jax.vjp(lambda q, k, v: flash3.dot_product_attention(
        q, k, v, is_causal=True, implementation="mosaic"), q, k, v)
    return o, vjp(do)
  compiled = jax.jit(run).lower(*args).compile()
  assert not re.search(r"all-gather|all-to-all|collective-permute", compiled.as_text())
  o, (dq, dk, dv) = compiled(*args)
  pad = lambda s: (tuple(s) + (None,) * 4)[:4]
  for x in (o, dq, dk, dv):
    assert pad(x.sharding.spec) == pad(spec)
  _assert_close(dict(o=o, dq=dq, dk=dk, dv=dv), want)


@pytest.mark.gpu
@two_gpus
# "batch" and "wg" are also names the kernels gave their own grid / warpgroup
# axes before 2026-12: a mesh axis of that name replaced the CTA's batch index
# (or warpgroup) by the device's mesh position.
@pytest.mark.parametrize("axis", ["data", "batch", "wg"])
def test_batch_sharded_equals_one_gpu(axis):
  _check_sharded(axis, "batch", 8, 4)


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("N, K", [(8, 8), (8, 4), (16, 2)])
def test_heads_sharded_equals_one_gpu_when_allowed(monkeypatch, N, K):
  """The fix for the wrong heads of 2026-11-30 (kernel axes renamed; sharding.py).

  Head sharding stays refused by default until this passes on two GPUs; the
  mesh axis is called "heads" as in that run.
  """
  monkeypatch.setattr(flash3.sharding, "ALLOW_HEAD_SHARDING", True)
  _check_sharded("heads", "heads", N, K)


@pytest.mark.gpu
@two_gpus
def test_heads_sharding_is_refused():
  q, k, v, _ = _inputs(4, 256, 8, 4)
  mesh = jax.make_mesh((2,), ("heads",), axis_types=(AxisType.Auto,), devices=GPUS[:2])
  args = [jax.device_put(x, NamedSharding(mesh, P(None, None, "heads", None)))
          for x in (q, k, v)]
  with pytest.raises((NotImplementedError, jax.errors.JaxRuntimeError),
                     match="sharded over heads"):
    jax.jit(lambda q, k, v: flash3.dot_product_attention(
        q, k, v, is_causal=True, implementation="mosaic"))(*args)


# ------------------------------------------------- the benchmark script, on the CPU

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "bench_multi_gpu.py"


@pytest.fixture(scope="module")
def bench():
  spec = importlib.util.spec_from_file_location("bench_multi_gpu", _SCRIPT)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there.
  try:
    spec.loader.exec_module(module)
    yield module
  finally:
    sys.modules.pop(spec.name, None)


def test_bench_case_selection(bench):
  default = bench.select_cases("default")
  assert [c.name for c in default] == list(bench.DEFAULT_CASES)
  assert default[0].name == "cp-131072-causal" and default[0].seq_len == 131072
  assert len(bench.select_cases("all")) == len(bench.CASES)
  picked = bench.select_cases("bh-data-gqa, cp-32768-full,bh-data-gqa")
  assert [c.name for c in picked] == ["bh-data-gqa", "cp-32768-full"]
  with pytest.raises(ValueError, match="unknown case 'nope'; allowed: default, all"):
    bench.select_cases("default,nope")


def test_bench_flag_lifts_the_head_sharding_refusal(bench, capsys):
  import flash3.sharding
  try:
    assert bench.main(["--list", "--allow-head-sharding"]) == 0
    assert flash3.sharding.ALLOW_HEAD_SHARDING is True
    assert bench.main(["--list"]) == 0
    assert flash3.sharding.ALLOW_HEAD_SHARDING is False
  finally:
    flash3.sharding.ALLOW_HEAD_SHARDING = False
  assert "bh-heads-gqa" in capsys.readouterr().out


def test_bench_sizes_targets_and_arithmetic(bench):
  cp = bench.CASES["cp-131072-causal"]
  bh = bench.CASES["bh-heads-gqa"]
  # FA3 convention: 4*B*T*T*N*D, half when causal, 3.5x forward+backward.
  assert bench.flops(cp, "fwd") == 4 * 131072 ** 2 * 16 * 128 / 2
  assert bench.flops(cp, "fwd+bwd") == 3.5 * bench.flops(cp, "fwd")
  assert bench.flops(bench.CASES["cp-131072-full"], "fwd") == 2 * bench.flops(cp, "fwd")
  assert bench.target(cp, "fwd+bwd") == 1.7
  assert bench.target(cp, "fwd") is None
  assert bench.target(bench.CASES["cp-32768-causal"], "fwd+bwd") is None
  assert bench.target(bh, "fwd") == 1.9 and bench.target(bh, "fwd+bwd") == 1.9
  assert bench.target(bh, "fwd", num_devices=4) is None
  assert bench.speedup(10.0, 5.0) == 2.0
  assert bench.speedup(None, 5.0) is None and bench.speedup(10.0, 0.0) is None
  assert bench.tflops(1e12, 1.0) == 1000.0
  assert bench.check_errors({"o": 5e-3}) == (True, "o=5.00e-03 (tol 1e-02)")
  ok, worst = bench.check_errors({"dq": 1e-3, "dk": 3e-2, "dv": float("nan")})
  assert not ok and worst.startswith("dk=3.00e-02")
  small = bench.tiny(bh, 4)
  assert (small.batch, small.seq_len, small.num_heads, small.num_kv_heads) == (4, 64, 16, 4)
  assert bench.unsupported_reason(small, 4) is None
  assert bench.unsupported_reason(bh, 3) == "num_kv_heads=8 is not a multiple of 3 devices"
  assert "seq_len=131072 is not a multiple of 6" in bench.unsupported_reason(cp, 3)
  assert bench.estimate_s(cp, "fwd+bwd", 2, 5, mosaic=True) > bench.estimate_s(
      cp, "fwd", 2, 5, mosaic=True) > 20


def test_bench_result_files(bench, tmp_path):
  case = bench.CASES["bh-data-mha"]
  record = {"case": bench.dataclasses.asdict(case), "mode": "fwd", "status": "ok",
            "t_one_ms": 10.0, "t_many_ms": 5.0, "speedup": 2.0, "target": 1.9,
            "tflops_one": 100.0, "tflops_many": 200.0, "check": "o=0.00e+00 (tol 1e-02)",
            "collectives": {}}
  skipped = {"case": bench.dataclasses.asdict(case), "mode": "fwd+bwd",
             "status": "skipped", "reason": "time budget", "target": 1.9}
  writer = bench.Writer(str(tmp_path / "r"), {"num_devices": 2, "device_kind": "H200"})
  writer.add(record)
  writer.add(skipped)
  data = json.loads((tmp_path / "r" / "results.json").read_text())
  assert [r["status"] for r in data["results"]] == ["ok", "skipped"]
  assert "CUPTI sums kernel time" in data["note"]
  md = (tmp_path / "r" / "results.md").read_text()
  assert "| bh-data-mha | data | 16 | 4096 | 16/16 | 128 | yes | fwd | 10.00 |" in md
  assert "| 2.00x | >= 1.9 met | 100 / 200 |" in md
  assert "| none | ok |" in md
  assert "| skipped: time budget |" in md
  assert "wall-clock" in md


@pytest.mark.skipif(len(jax.devices()) < 4 or GPUS,
                    reason="the CPU smoke run wants the 4 virtual CPU devices")
def test_bench_runs_tiny_on_cpu_devices(bench, tmp_path):
  rc = bench.main(["--implementation", "xla", "--tiny", "--cases",
                   "cp-131072-causal,bh-heads-gqa", "--iters", "1", "--warmup", "0",
                   "--out", str(tmp_path)])
  assert rc == 0
  data = json.loads((tmp_path / "results.json").read_text())
  assert data["meta"]["num_devices"] == 4 and data["meta"]["tiny"]
  rows = {(r["case"]["name"], r["mode"]): r for r in data["results"]}
  assert set(rows) == {("cp-131072-causal", "fwd+bwd"), ("cp-131072-causal", "fwd"),
                       ("bh-heads-gqa", "fwd+bwd"), ("bh-heads-gqa", "fwd")}
  for r in rows.values():
    assert r["status"] == "ok", r
    assert r["speedup"] > 0 and r["t_one_ms"] > 0 and r["target"] is None
    assert max(r["errors"].values()) < 2e-2
  assert set(rows["cp-131072-causal", "fwd+bwd"]["errors"]) == {"dq", "dk", "dv"}
  # Context parallelism gathers keys/values (and reduce-scatters their gradients).
  assert rows["cp-131072-causal", "fwd+bwd"]["collectives"].get("all-gather", 0) >= 1
  assert rows["cp-131072-causal", "fwd+bwd"]["collectives"].get("reduce-scatter", 0) >= 1
  assert (tmp_path / "results.md").read_text().count("| ok |") == 4


def test_bench_needs_two_devices(bench, capsys):
  assert bench.main(["--implementation", "xla", "--num-devices", "1"]) == 2
  err = capsys.readouterr().err
  assert "--num-devices=1; allowed: 2 to" in err
  if not GPUS:
    assert bench.main([]) == 2
    assert "needs >= 2 Hopper GPUs" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    bench.main(["--cases", "nope"])
