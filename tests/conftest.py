"""Shared test fixtures: GPU skip rule and interpret-mode hygiene."""

import gc
import os

# Sharding tests need several devices; on the CPU, XLA can fake them. This must
# happen before jax initialises its backends (the import below does).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=4").strip()
# The float32 references' GEMMs need no autotuning: on the H200 it cost 20-30 s
# of compile per new shape (src/flash3/bench/reference.py), times 14 test
# workers; the Mosaic GPU kernels under test do not go through it.
if "xla_gpu_autotune_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_gpu_autotune_level=0"

# GPU interpret mode runs each warpgroup as a thread whose barrier waits block
# inside io_callbacks, and the interpreter dispatches small JAX computations
# from those callbacks. With async dispatch those wait for a thread of the CPU
# client's pool, which the blocked callbacks can all hold on a small machine:
# on this project's 2-core CI machine tests/test_mosaic_path.py's E07 backward
# hung that way twice (every thread idle; py-spy showed the interpreter's
# `jnp.int32(i)` waiting in apply_primitive). Inline dispatch needs no pool.
# (A flag, not an environment variable; set before the CPU backend starts.)
import jax  # noqa: E402

jax.config.update("jax_cpu_enable_async_dispatch", False)

import pytest  # noqa: E402

from flash3._device import hopper_device_kind  # noqa: E402

ON_HOPPER = hopper_device_kind() is not None

# Skip GPU tests only where there is no Hopper GPU; on the H200 they must run.
requires_hopper = pytest.mark.skipif(
    not ON_HOPPER, reason="needs a Hopper GPU (sm_90); this machine has none")


def pytest_configure(config):
  # `make gpu-test` runs the GPU tests in several processes at once
  # (pytest-xdist); these run afterwards, one at a time in one process.
  config.addinivalue_line(
      "markers", "serial: measures the process or the GPU (peak memory, CUPTI "
      "timings), so it must not share them: not run under pytest-xdist")


def pytest_collection_modifyitems(config, items):
  for item in items:
    if "gpu" in item.keywords and not ON_HOPPER:
      item.add_marker(pytest.mark.skip(reason="needs a Hopper GPU (sm_90)"))


def _max_map_count() -> int | None:
  try:
    with open("/proc/sys/vm/max_map_count") as limit:
      return int(limit.read())
  except OSError:  # Not Linux: no such limit to guard.
    return None


_MAX_MAP_COUNT = _max_map_count()  # A system setting: read once.


@pytest.fixture(autouse=True)
def _release_compiled_executables():
  """Frees jax's compiled executables once they hold half the process's maps.

  Each XLA CPU executable keeps its JIT code in its own memory maps, about 500
  per interpret-mode kernel test, and jax caches every executable. One xdist
  worker ran about 800 tests, passed Linux's vm.max_map_count (65530) and
  crashed inside XLA's CPU compiler (SIGSEGV or SIGABRT in
  backend_compile_and_load), twice on the same later test. Clearing the caches
  unmaps them; doing it only past half the limit keeps the cache's speed.
  """
  yield
  if _MAX_MAP_COUNT is None:
    return
  with open("/proc/self/maps") as maps:
    count = sum(1 for _ in maps)
  if count > _MAX_MAP_COUNT // 2:
    jax.clear_caches()
    gc.collect()  # Executables caught in reference cycles too.
