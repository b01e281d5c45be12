#!/usr/bin/env bash
# Run a command with tokamax importable, from wheels carried in .whl/.
#
# Usage, from the repo root on the GPU machine (carry: [".whl"]):
#   bash scripts/with_tokamax.sh python3 -m flash3.bench --quick
# Installs .whl/*.whl (tokamax 0.0.17 and the packages the image lacks; see
# docs/benchmarks/README.md) into $TOKAMAX_SITE (default /tmp/site), puts src/,
# that folder and scripts/tokamax_shim (a stand-in for xprof) on PYTHONPATH,
# then execs the command. Without .whl/ or when the install fails it says so
# and runs the command anyway; flash3-bench then reports tokamax "unavailable".
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SITE=${TOKAMAX_SITE:-/tmp/site}
PY=${PYTHON:-python3}
paths=src
if compgen -G ".whl/*.whl" > /dev/null; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target "$SITE" .whl/*.whl; then
    paths="$paths:$SITE:$PWD/scripts/tokamax_shim"
    echo "with_tokamax: installed $(ls .whl/*.whl | wc -l) wheels into $SITE" >&2
  else
    echo "with_tokamax: installing .whl/*.whl failed; running without tokamax" >&2
  fi
else
  echo "with_tokamax: no .whl/*.whl here (carry .whl); running without tokamax" >&2
fi
export PYTHONPATH="$paths${PYTHONPATH:+:$PYTHONPATH}"
export WITH_TOKAMAX=1  # Lets scripts/bench_shards.sh install only once.
[ "$#" -gt 0 ] || { echo "with_tokamax: no command given" >&2; exit 2; }
exec "$@"
