"""gemm/: the insides of kernels.py's NVFP4 GEMM: the kernel layout of a weight (layout.py), the
tile configs per token bucket (configs.py) and the warp-specialized Gluon GEMM that Hopper runs at
33-1023 tokens (warp_specialized.py)."""
