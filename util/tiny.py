"""tiny.py: tiny random checkpoints of the real architectures, for the tests and train.py's
built-in default.

    python -m util.tiny runs/tiny-qwen2 [--arch qwen3]   # a tiny random HF checkpoint

`build_tiny_hf` makes a transformers model of a real architecture (Qwen2, Qwen3, Llama) at hidden
size 64 with random weights, norm weights and biases; `save_tiny_checkpoint` writes it as an HF
folder; `tiny_model_dir` is the built-in model of `python train.py`: a tiny Qwen2 after a short
supervised warm-up on the answer format with random digits (cached under runs/.cache, or
$NANOQERL_CACHE). Leaves out: pretrained weights of any kind.
"""
if __name__ == "__main__":     # run as a script: the pinned packages (pyproject.toml) are
    from util import versions  # checked before torch loads: a missing or wrong one is one line
    versions.check_or_exit()

import argparse
import json
import os
import random
import shutil
import sys
from pathlib import Path

import torch

from tasks import data
from util import fsutil


TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "tests" / "assets" / "qwen2.5-tokenizer"
TINY_VOCAB = 151936  # the Qwen2.5 embedding size (the tokenizer has 151665 tokens)
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1)
TINY_ARCHS = {  # head_dim 32 (vLLM's CPU attention supports it), GQA 2:1
    # qkv bias, tied embeddings
    "qwen2": dict(_TINY, cls="Qwen2", tie_word_embeddings=True,
                  rms_norm_eps=1e-6, rope_theta=1e6),
    "qwen3": dict(_TINY, cls="Qwen3", head_dim=32, tie_word_embeddings=False,
                  rms_norm_eps=1e-6, rope_theta=1e6),
    "llama": dict(_TINY, cls="Llama", tie_word_embeddings=False, rms_norm_eps=1e-5,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}),
    # down_proj K = 72: not a multiple of 16, stays bf16 when quantized
    "qwen2_oddk": dict(_TINY, cls="Qwen2", intermediate_size=72, tie_word_embeddings=True,
                       rms_norm_eps=1e-6, rope_theta=1e6),
}


def build_tiny_hf(arch: str, seed: int = 0, dtype=torch.float32, **overrides):
    """A tiny random transformers model of a real architecture (norm weights and biases randomised
    too)."""
    import transformers

    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {', '.join(TINY_ARCHS)}")
    spec = dict(TINY_ARCHS[arch], **overrides)
    cls = spec.pop("cls")
    if "rope_theta" in spec:                     # transformers reads it from rope_parameters
        spec["rope_parameters"] = {"rope_type": "default", "rope_theta": spec.pop("rope_theta")}
    config_cls = getattr(transformers, f"{cls}Config")
    config = config_cls(vocab_size=TINY_VOCAB, max_position_embeddings=512,
                        bos_token_id=151643, eos_token_id=151645, **spec)   # Qwen2.5's ids
    torch.manual_seed(seed)
    model = getattr(transformers, f"{cls}ForCausalLM")(config)
    with torch.no_grad():  # norms at exactly 1.0 would hide bugs in how their weights are used
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif n.endswith("bias"):
                p.copy_(0.02 * torch.randn_like(p))
    return model.to(dtype).eval()


def save_tiny_checkpoint(path, arch: str = "qwen2", dtype=torch.bfloat16, shards: int = 1,
                         seed: int = 0, **overrides) -> Path:
    """Write a tiny random HF folder (config.json, safetensors, index when sharded, real Qwen2.5
    tokenizer)."""
    path = Path(path)
    model = build_tiny_hf(arch, seed, dtype, **overrides)
    total = sum(p.numel() * p.element_size() for p in model.parameters())   # bytes
    if shards > 1:
        max_shard = f"{max(1, total // shards // 1000 + 1)}KB"   # about total / shards a shard
    else:
        max_shard = "10GB"                                       # one file
    model.save_pretrained(path, max_shard_size=max_shard)
    copy_tokenizer(path)
    return path


def copy_tokenizer(path: Path) -> None:
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy2(f, path / f.name)


def tiny_model_dir(seed: int = 0) -> Path:
    """train.py's built-in model: a tiny Qwen2 warmed up on the answer format, built once and
    cached (atomically)."""
    default_cache = Path(__file__).resolve().parent.parent / "runs" / ".cache"
    cache = Path(os.environ.get("NANOQERL_CACHE", default_cache))
    out = cache / f"tiny-synthetic-{seed}"
    if (out / "config.json").exists():
        return out
    hf = warm_up_tiny(seed)

    def write(tmp: Path):
        hf.to(torch.bfloat16).save_pretrained(tmp)
        copy_tokenizer(tmp)
    return publish_cached(out, write)


def warm_up_tiny(seed: int):
    """A tiny random Qwen2 after 60 supervised steps on the answer format with a RANDOM digit: RL
    must then find which digit pays."""
    from transformers import AutoTokenizer
    hf = build_tiny_hf("qwen2", seed=seed).train()
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    rng = random.Random(seed)
    opt_ = torch.optim.AdamW(hf.parameters(), lr=1e-2)
    rows = data.synthetic_rows(256, seed)
    for _ in range(60):
        # 16 (prompt, completion) pairs; the completion is a boxed random digit and end-of-turn
        batch = rng.sample(rows, 16)
        seqs = []
        for r in batch:
            prompt = data.prompt_token_ids(tok, r["question"])
            reply = f"\\boxed{{{rng.randint(0, 9)}}}<|im_end|>"
            seqs.append((prompt, tok(reply, add_special_tokens=False)["input_ids"]))

        # right-padded; the loss is on the completion tokens only (-100 elsewhere)
        L = max(len(p) + len(c) for p, c in seqs)
        ids = torch.zeros(len(seqs), L, dtype=torch.long)                  # (B, L)
        labels = torch.full((len(seqs), L), -100)                           # (B, L)
        for i, (p, c) in enumerate(seqs):
            ids[i, :len(p) + len(c)] = torch.tensor(p + c)
            labels[i, len(p):len(p) + len(c)] = torch.tensor(c)
        h = hf.model(input_ids=ids).last_hidden_state                       # (B, L, H)
        sel = labels[:, 1:] != -100                 # position j predicts token j + 1
        logits = hf.lm_head(h[:, :-1][sel])                                 # (n, V)
        loss = torch.nn.functional.cross_entropy(logits.float(), labels[:, 1:][sel])
        opt_.zero_grad()
        loss.backward()
        opt_.step()
    return hf


def publish_cached(out: Path, write) -> Path:
    """Put a cache entry at `out` in one step: write(tmp) fills a temporary beside `out` (never in
    $TMPDIR, which may be another filesystem), then one rename. Another process that published the
    same entry first wins; any other failure is one RuntimeError that says where and what to do."""
    if (out / "config.json").exists():  # another process built it meanwhile
        return out
    # a folder without config.json is not one of ours (ours appear whole, by one rename)
    if out.exists():
        raise RuntimeError(f"{out} exists but holds no config.json: remove it and run again (it "
                           "is rebuilt)")
    try:
        with fsutil.atomic_dir(out) as tmp:
            write(tmp)
    except OSError as e:
        # the rename lost a race to a finished build of the same entry: use it
        if (out / "config.json").exists():
            return out
        raise RuntimeError(f"could not write the built-in tiny model to {out}: {e}; make "
                           f"{out.parent} writable or set NANOQERL_CACHE to a writable folder"
                           ) from e
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description="Write a tiny random checkpoint of a real "
                                             "architecture (real tokenizer).")
    ap.add_argument("out", metavar="DIR", help="folder to create (must not exist or be empty)")
    ap.add_argument("--arch", default="qwen2", choices=sorted(TINY_ARCHS), help="the architecture")
    ap.add_argument("--seed", type=int, default=0, help="the weights' random seed")
    args = ap.parse_args(argv)
    print("config:", json.dumps(vars(args)))
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        print(f"error: {out} exists and is not empty: choose another folder", file=sys.stderr)
        return 2
    # an interrupted run leaves no half-written folder (an existing empty folder is swapped out)
    with fsutil.atomic_dir(out, replace=out.exists()) as tmp:
        save_tiny_checkpoint(tmp, args.arch, seed=args.seed)
    print(f"wrote a tiny random {args.arch} checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
