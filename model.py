"""model.py: the policy decoder (Qwen2 / Qwen2.5 / Qwen3 / Llama) and tiny random checkpoints for tests and demos.

    python model.py --make-tiny runs/tiny-qwen2            # a tiny random Qwen2 checkpoint with the real tokenizer

Leaves out (for now): everything but the tiny-checkpoint builder; the decoder over our kernels comes next.
"""
import argparse
import shutil
import sys
from pathlib import Path

import versions

versions.check()
import torch  # noqa: E402

TOKENIZER_DIR = Path(__file__).resolve().parent / "tests" / "assets" / "qwen2.5-tokenizer"
TINY_VOCAB = 151936  # the Qwen2.5 embedding size (the tokenizer has 151665 tokens)

# head_dim 32 everywhere (vLLM's CPU attention supports 32); GQA with 2 query heads per kv head.
TINY_ARCHS = {
    # Qwen2 / Qwen2.5: qkv bias, tied embeddings
    "qwen2": dict(cls="Qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e6),
    # Qwen3: q_norm / k_norm, no bias, explicit head_dim, untied
    "qwen3": dict(cls="Qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1e6),
    # Llama 3.x: rope scaling of type llama3, untied
    "llama": dict(cls="Llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, tie_word_embeddings=False, rms_norm_eps=1e-5,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}),
    # Qwen2 with intermediate 72: down_proj has K = 72, not a multiple of 16 (stays bf16 when quantized)
    "qwen2_oddk": dict(cls="Qwen2", hidden_size=64, intermediate_size=72, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e6),
}


def build_tiny_hf(arch: str, seed: int = 0, dtype=torch.float32, **overrides):
    """A tiny random transformers model of a real architecture (norm weights and biases randomised too)."""
    import transformers

    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {', '.join(TINY_ARCHS)}")
    spec = dict(TINY_ARCHS[arch], **overrides)
    cls = spec.pop("cls")
    if "rope_theta" in spec:
        spec["rope_parameters"] = {"rope_type": "default", "rope_theta": spec.pop("rope_theta")}
    config = getattr(transformers, f"{cls}Config")(vocab_size=TINY_VOCAB, max_position_embeddings=512,
                                                   bos_token_id=151643, eos_token_id=151645, **spec)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{cls}ForCausalLM")(config)
    with torch.no_grad():  # norms at exactly 1.0 would hide bugs in how their weights are used
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.02 * torch.randn_like(p))
    return model.to(dtype).eval()


def save_tiny_checkpoint(path, arch: str = "qwen2", dtype=torch.bfloat16, shards: int = 1, seed: int = 0,
                         **overrides) -> Path:
    """Write a tiny random HF folder (config.json, safetensors, index when sharded, real Qwen2.5 tokenizer)."""
    path = Path(path)
    model = build_tiny_hf(arch, seed, dtype, **overrides)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    max_shard = f"{max(1, total // shards // 1000 + 1)}KB" if shards > 1 else "10GB"
    model.save_pretrained(path, max_shard_size=max_shard)
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy2(f, path / f.name)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description="nanoqerl model utilities.")
    ap.add_argument("--make-tiny", metavar="DIR", required=True,
                    help="write a tiny random checkpoint (real architecture, real Qwen2.5 tokenizer) to DIR")
    ap.add_argument("--arch", default="qwen2", choices=sorted(TINY_ARCHS), help="architecture of the tiny model")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    args = ap.parse_args(argv)
    out = Path(args.make_tiny)
    if out.exists() and any(out.iterdir()):
        print(f"error: {out} exists and is not empty: choose another folder", file=sys.stderr)
        return 2
    save_tiny_checkpoint(out, args.arch, seed=args.seed)
    print(f"wrote a tiny random {args.arch} checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
