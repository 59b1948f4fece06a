"""util/: plumbing shared by the stages: the version pins checked against pyproject.toml
(versions.py), atomic file writes and writable outputs (fsutil.py), safetensors read and written a
few rows at a time (tensorfile.py), several processes under torchrun (dist.py), tiny random
checkpoints of the real architectures for tests and `--model tiny` (tiny.py), and the RL defaults a
small model's recipe.json carries (recipe.py)."""
