"""Shared fixtures: tiny random checkpoints of the real architectures, saved as Hugging Face
folders.

`make_checkpoint(arch, ...)` builds the model with transformers (random init, fixed seed) through
tiny.save_tiny_checkpoint: config.json, safetensors (one file, or shards with
model.safetensors.index.json) and the real Qwen2.5 tokenizer files (tests/assets/qwen2.5-tokenizer,
Apache-2.0). Cached per session.
"""
import os
import sys
from pathlib import Path

import torch

# Triton kernels run on CPU through the interpreter (set before triton loads)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from util import tiny  # noqa: E402

TOKENIZER_DIR = tiny.TOKENIZER_DIR


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory):
    """make_checkpoint(arch, dtype=torch.bfloat16, shards=1, seed=0) -> Path of a cached HF
    folder."""
    cache = {}

    def make(arch: str, dtype=torch.bfloat16, shards: int = 1, seed: int = 0) -> Path:
        key = (arch, str(dtype), shards, seed)
        if key not in cache:
            path = tmp_path_factory.mktemp(f"{arch}-{str(dtype).split('.')[-1]}-{shards}shards")
            cache[key] = tiny.save_tiny_checkpoint(path, arch, dtype, shards, seed)
        return cache[key]

    return make
