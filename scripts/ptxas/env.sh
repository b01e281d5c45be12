#!/usr/bin/env bash
# Run a command where Mosaic GPU kernels compile through ptxas without a GPU:
#   bash scripts/ptxas/env.sh python scripts/compile_report.py --offline --cases bwd:128:4096:1
# Creates (once) .venv-ptxas beside .venv: the pinned jax with the CUDA 13
# plugin (whose MosaicGpuCompile runs the whole MLIR -> PTX -> ptxas pipeline),
# ptxas 13.0.88 (the H200 image's nvcc) and nvdisasm from PyPI, flash3 itself
# (editable, so the working tree's kernels compile), and a stand-in CUDA driver
# (fake_libcuda.c) that lets the compile run and refuses the load. Then runs
# the command with that venv first on the PATH and the environment Mosaic GPU
# reads. JAX_PLATFORMS=cpu: jax itself never looks for a GPU here.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
venv="$root/.venv-ptxas"
# Versions: jax as pyproject pins it; ptxas as on the H200 image (nvcc 13.0).
pins=(jax==0.11.2 jaxlib==0.11.2 jax-cuda13-plugin==0.11.2 jax-cuda13-pjrt==0.11.2
      nvidia-cuda-nvcc==13.0.88 nvidia-cuda-nvdisasm==13.2.86)
stamp="$venv/.installed-$(echo "${pins[*]}" | cksum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  if [ ! -x "$venv/bin/python" ]; then
    # The same Python >= 3.12 that scripts/env.sh picks for .venv.
    py=$(FLASH3_EXTRAS=none bash "$root/scripts/env.sh" >/dev/null 2>&1; \
         "$root/.venv/bin/python" -c 'import sys; print(sys._base_executable)')
    echo "flash3: creating .venv-ptxas with $py" >&2
    "$py" -m venv "$venv"
  fi
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q "${pins[@]}" >&2
  "$venv/bin/python" -m pip install -q --no-deps -e "$root" >&2
  touch "$stamp"
fi
cuda_root=$("$venv/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
driver="$venv/fake_driver"
if [ ! -f "$driver/libcuda.so.1" ] || [ "$here/fake_libcuda.c" -nt "$driver/libcuda.so.1" ]; then
  mkdir -p "$driver"
  ${CC:-cc} -shared -fPIC -O1 -o "$driver/libcuda.so.1" "$here/fake_libcuda.c"
fi
export PATH="$venv/bin:$PATH"
export JAX_PLATFORMS=cpu
export MOSAIC_GPU_CUDA_ROOT="$cuda_root"
export FLASH3_FAKE_DRIVER="$driver"
# Only the compile's process needs the stand-in driver (compile_report.py puts
# it on LD_LIBRARY_PATH for its per-case processes).
exec "$@"
