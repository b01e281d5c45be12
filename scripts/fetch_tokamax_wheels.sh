#!/usr/bin/env bash
# Download into .whl/ the wheels tokamax 0.0.17 needs on the GPU machines
# (Python 3.12, x86-64 Linux), which have jax 0.11.2, flax, absl-py, jaxtyping,
# numpy, protobuf, packaging, opt-einsum and tqdm but not these. About 6 MB;
# .whl/ is not committed (add "/.whl/" to .git/info/exclude). Run where pip can
# reach PyPI; then carry .whl to the GPU machine and use scripts/with_tokamax.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WHEELS=(
  tokamax==0.0.17 einshape==1.0 qwix==0.1.8 immutabledict==4.3.1
  tensorboardx==2.6.5 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  typeguard==2.13.3
)
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
ls -l .whl
