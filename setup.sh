#!/usr/bin/env bash
# Create .venv and install nanoqerl with what the tests need (idempotent: a second run only checks).
#   ./setup.sh          the main environment (.venv)
# torch is pinned to 2.13.0 here: on a machine without a GPU pip takes its CPU build; with CUDA it takes the
# CUDA build. pyproject.toml holds every other pin.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "== installing torch 2.13.0"
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
echo "== installing nanoqerl's pinned dependencies (pyproject.toml)"
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -c "import versions; versions.check('torch', 'triton', 'transformers', 'compressed-tensors', 'peft'); print('== environment OK')"
