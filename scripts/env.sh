#!/usr/bin/env bash
# Create (once) and activate .venv with a Python >= 3.12 found on this machine,
# then install flash3 with the extras named in $FLASH3_EXTRAS.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
find_python() {
  local c
  for c in python3.12 python3.13 python3; do
    if command -v "$c" >/dev/null && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  if command -v pyenv >/dev/null; then
    for c in "$(pyenv root)"/versions/3.1[2-9]*/bin/python3; do
      [ -x "$c" ] && { echo "$c"; return 0; }
    done
  fi
  echo "flash3: no Python >= 3.12 found (tried python3.12, python3.13, python3, pyenv)" >&2
  return 1
}
if [ ! -x "$root/.venv/bin/python" ]; then
  py=$(find_python)
  echo "flash3: creating .venv with $py" >&2
  "$py" -m venv "$root/.venv"
fi
stamp="$root/.venv/.installed-${FLASH3_EXTRAS:-none}"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  "$root/.venv/bin/python" -m pip install -q --upgrade pip >&2
  "$root/.venv/bin/python" -m pip install -q -e "$root${FLASH3_EXTRAS:+[$FLASH3_EXTRAS]}" >&2
  touch "$stamp"
fi
