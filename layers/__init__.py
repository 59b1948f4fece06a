"""layers/: what model.py and rollout.py run on besides the GEMM: the linears with their LoRA term
(linear.py), the noisy RMSNorm, RoPE and SiLU x up (ops.py), decode attention over the KV cache
(attention.py), the rollout's sampler (sampler.py) and the LoRA A product of a decode step in one
launch (shrink.py), each a Triton kernel beside its PyTorch reference."""
