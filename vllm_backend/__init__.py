"""vllm_backend/: the rollout through vLLM (`--engine vllm`, in .venv-vllm): the engine that
train.py and eval.py drive (engine.py) and what it registers inside vLLM, our NVFP4 linears and
the noisy norms (plugin.py). Importing this folder imports nothing of vLLM."""
import os

# vLLM must run in this process, where our registrations live: set before plugin.py imports it
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# eval.py and trainer/config.py refuse --engine vllm with this line when vLLM is not installed
MISSING = ("--engine vllm needs vLLM in its own environment: ./setup.sh --vllm (the pinned "
           "vllm on a GPU machine, its CPU build otherwise), then .venv-vllm/bin/python; "
           "or use the default --engine builtin")
