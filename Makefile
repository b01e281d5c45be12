# The two commands of the README. Each does all set-up on a fresh machine.
.PHONY: demo test gpu-test

demo:
	bash scripts/demo.sh

# Without a GPU the tests (interpret-mode kernels, mostly) spread over every CPU
# core with pytest-xdist; with one they run in one process (GPU memory). A test
# still running after 20 minutes has hung: pytest-timeout fails
# it with every thread's stack instead of letting the run hang.
test:
	FLASH3_EXTRAS=test,bench,examples$$(nvidia-smi -L >/dev/null 2>&1 && echo ,cuda) bash scripts/env.sh
	.venv/bin/python -m pytest -q -p no:cacheprovider --timeout=1200 $$(nvidia-smi -L >/dev/null 2>&1 || echo --numprocesses=auto) tests

# On an H100/H200 with jax and its CUDA plugin already installed (the image's python3):
# every GPU test. Each test compiles Mosaic GPU kernels (seconds of CPU), so they run
# in GPU_TEST_WORKERS processes at once (pytest-xdist) sharing the GPU: memory on
# demand, each process capped at GPU_TEST_MEM_FRACTION of it. Then the tests marked
# `serial` (the T=131072 peak-memory test, a CUPTI timing) run alone in one process;
# FLASH3_RESULTS_DIR=dir keeps the memory record. Every stage runs; any failure fails.
GPU_TEST_WORKERS ?= 12
GPU_TEST_MEM_FRACTION ?= 0.3
GPU_PYTEST = PYTHONPATH=src XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -p no:cacheprovider
GPU_SHARED = XLA_PYTHON_CLIENT_MEM_FRACTION=$(GPU_TEST_MEM_FRACTION) $(GPU_PYTEST)

gpu-test:
	@rc=0; \
	$(GPU_SHARED) -n $(GPU_TEST_WORKERS) -m "gpu and not serial" tests || rc=1; \
	$(GPU_SHARED) -n 4 tests/test_mosaic_path.py || rc=1; \
	$(GPU_PYTEST) -s -m "gpu and serial" tests || rc=1; \
	exit $$rc
