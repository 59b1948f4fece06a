"""noise.py: adaptive quantization noise (AQN): a decaying Gaussian added to the RMSNorm weights.

    python noise.py --total-steps 100                     # print the sigma schedule

For the norm that feeds q/k/v (input_layernorm) and the one that feeds gate/up (post_attention_layernorm) of every
layer, a fresh z ~ N(0, sigma^2 I) of size hidden enters ops.rms_norm as `noise`: the norm uses weight + z, which
is multiplicative noise (1 + z / w) on the next linear's input channels at no GEMM cost. The stored weights are never
touched (nothing accumulates across steps). Schedule over K equal stages of training: stage 0 has sigma = 0 (the
quantization noise alone), stage k >= 1 has sigma_start * (sigma_end / sigma_start) ** ((k - 1) / (K - 1)).

Where the noise applies is a flag: `rollout_only` (the default, as in the paper: the rollout forward is noisy, the
training forward is clean) or `both`. Leaves out: linear / cosine / log decays (exponential worked best in the paper).
"""
import argparse
import json
import sys

import versions

versions.check()
import torch  # noqa: E402

WHERE = ("rollout_only", "both")


def sigma_at(step: int, total_steps: int, sigma_start: float = 1e-2, sigma_end: float = 5e-4, stages: int = 10) -> float:
    """The AQN sigma at a 0-based training step. stages = K equal intervals of total_steps; stage 0 is noise-free."""
    if total_steps < 1 or stages < 2:
        raise ValueError(f"need total_steps >= 1 and stages >= 2, got {total_steps} and {stages}")
    if not 0 < sigma_end <= sigma_start:
        raise ValueError(f"need 0 < sigma_end <= sigma_start, got {sigma_end} and {sigma_start}")
    k = min(stages - 1, max(0, step) * stages // total_steps)
    if k == 0:
        return 0.0
    return sigma_start * (sigma_end / sigma_start) ** ((k - 1) / (stages - 1))


def sample(num_layers: int, hidden: int, sigma: float, generator: torch.Generator, device="cpu") -> torch.Tensor:
    """(layers, 2, hidden) fp32: index 0 for the q/k/v norm, 1 for the gate/up norm; each its own draw."""
    z = torch.randn(num_layers, 2, hidden, generator=generator, dtype=torch.float32)
    return (z * sigma).to(device)


def apply(model, sigma: float, generator: torch.Generator):
    """Draw fresh noise into `model.noise` (in place when a buffer exists, so captured CUDA graphs see it)."""
    cfg = model.cfg
    z = sample(cfg.num_layers, cfg.hidden_size, sigma, generator, model.model.norm.weight.device)
    if model.noise is not None and model.noise.shape == z.shape:
        model.noise.copy_(z)
    else:
        model.noise = z
    return model.noise


def clear(model):
    model.noise = None


def main(argv=None):
    ap = argparse.ArgumentParser(description="Print the AQN sigma schedule.")
    ap.add_argument("--total-steps", type=int, default=100, help="training steps")
    ap.add_argument("--sigma-start", type=float, default=1e-2, help="sigma of stage 1")
    ap.add_argument("--sigma-end", type=float, default=5e-4, help="sigma the decay heads to")
    ap.add_argument("--stages", type=int, default=10, help="K, the number of equal stages (stage 0: no noise)")
    args = ap.parse_args(argv)
    print("config:", json.dumps(vars(args)))
    for s in range(0, args.total_steps, max(1, args.total_steps // args.stages)):
        print(f"step {s:6d}  sigma {sigma_at(s, args.total_steps, args.sigma_start, args.sigma_end, args.stages):.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
