# The two commands of the README. Each does all set-up on a fresh machine.
.PHONY: demo test gpu-test

demo:
	bash scripts/demo.sh

test:
	FLASH3_EXTRAS=test,bench,examples$$(nvidia-smi -L >/dev/null 2>&1 && echo ,cuda) bash scripts/env.sh
	.venv/bin/python -m pytest -q -p no:cacheprovider tests

# On an H100/H200 with jax and its CUDA plugin already installed (the image's python3):
# every GPU test (slow: Mosaic GPU compiles each shape).
gpu-test:
	PYTHONPATH=src python3 -m pytest -q -p no:cacheprovider -m gpu tests
	PYTHONPATH=src python3 -m pytest -q -p no:cacheprovider tests/test_mosaic_path.py
