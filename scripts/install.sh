#!/usr/bin/env bash
# Sets up oproj_jax on a fresh machine: a Python 3.12 venv in .venv with the GPU machine's
# pinned versions (constraints.txt), the package in editable mode with every extra (setup.py
# already builds the XLA FFI library into the checkout), then the GPU artifacts: CuTe-DSL cubins
# (sm_90a, built without a GPU) with their manifest, and the FFI library again against the venv's jaxlib.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python312() {
  local candidate
  for candidate in "${PYTHON:-}" python3.12 "$(command -v pyenv >/dev/null && pyenv root)"/versions/3.12*/bin/python3.12 \
                   /root/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    [ -n "$candidate" ] || continue
    if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  return 1
}

PY=$(find_python312) || { echo "install.sh: Python 3.12 not found (set PYTHON=/path/to/python3.12)" >&2; exit 1; }
echo "install.sh: using $PY ($("$PY" --version))"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test,cute,triton,bench]"
.venv/bin/python -m oproj_jax.build
