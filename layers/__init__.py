"""layers/: what model.py and rollout.py run on besides the GEMM: the linears with their LoRA term
(linear.py), the noisy RMSNorm, RoPE and SiLU x up (ops.py), decode attention over the KV cache
(attention.py) and the rollout's sampler (sampler.py), each a Triton kernel beside its PyTorch
reference."""
