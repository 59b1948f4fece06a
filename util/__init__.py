"""util/: plumbing shared by the stages: the version pins checked against pyproject.toml
(versions.py), atomic file writes (fsutil.py), several processes under torchrun (dist.py) and
tiny random checkpoints of the real architectures for tests and `--model tiny` (tiny.py)."""
