#!/usr/bin/env bash
# Sets up oproj_jax on a fresh machine: a Python 3.12 venv in .venv with the GPU machine's
# pinned versions (constraints.txt), the package in editable mode with every extra (setup.py
# already builds the XLA FFI library into the checkout), then the GPU artifacts: CuTe-DSL cubins
# (sm_90a and sm_100a, built without a GPU) with their manifests, and the FFI library again against the venv's jaxlib.
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

say() { echo "install.sh: $*"; }

PY=$(find_python312) || { echo "install.sh: Python 3.12 not found (set PYTHON=/path/to/python3.12)" >&2; exit 1; }
say "using $PY ($("$PY" --version))"
if [ -x .venv/bin/python ]; then
  say "reusing the venv in .venv"
else
  say "creating a venv in .venv"
  "$PY" -m venv .venv
fi
say "installing oproj_jax (editable) with the extras test,cute,triton,bench, pinned by constraints.txt"
say "(pip downloads jax, torch, triton and the CuTe DSL the first time: a few minutes)"
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test,cute,triton,bench]"
say "building the GPU artifacts: python -m oproj_jax.build (no GPU needed; the cubins take a few minutes)"
.venv/bin/python -m oproj_jax.build
say "done: run the tests with .venv/bin/python -m pytest -q"
