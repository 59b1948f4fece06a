"""bench/peer_folders.py: the random checkpoints and the LoRA adapter that `python -m bench vllm`
(bench/vllm_speed.py) gives every engine, written once as Hugging Face / PEFT folders.

Weights are drawn N(0, 0.02) from fixed seeds. The NVFP4 folder holds the bf16 folder's weights
quantized by quantize.quantize_state_dict (quantize.py's math and its compressed-tensors config),
so vLLM and the built-in engine read it as they read quantize.py's output. The adapter is PEFT's
layout: rank r on every decoder linear, A and B drawn N(0, 0.01) so that the LoRA product is
nonzero (an RL rollout's adapter is; a fresh one has B = 0 and costs less in some engines).
folder_bytes and adapter_bytes say how much disk they take, before anything is written.
"""
import json
import shutil
from pathlib import Path

import torch

from util import fsutil
from bench.common import QWEN

SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=152064, tie_word_embeddings=False)
SHAPES = {**QWEN, "small": SMALL}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def folders(root: Path, shape_name: str) -> dict:
    """Where the bf16 / NVFP4 folders and the adapter of a shape live under --dir."""
    return {"bf16": root / f"{shape_name}-bf16",
            "nvfp4": root / f"{shape_name}-nvfp4",
            "adapter": root / f"{shape_name}-lora"}


def layer_rows(shape: dict) -> dict:
    """Module name -> (out_features, in_features) of one decoder layer's linears."""
    H, I = shape["hidden_size"], shape["intermediate_size"]
    hd = H // shape["num_attention_heads"]
    q = shape["num_attention_heads"] * hd
    kv = shape["num_key_value_heads"] * hd
    return {"self_attn.q_proj": (q, H),
            "self_attn.k_proj": (kv, H),
            "self_attn.v_proj": (kv, H),
            "self_attn.o_proj": (H, q),
            "mlp.gate_proj": (I, H),
            "mlp.up_proj": (I, H),
            "mlp.down_proj": (H, I)}


def folder_bytes(shape: dict, base: str) -> int:
    """Bytes on disk of the folder write_folder writes: its tensor data (the safetensors header
    and config.json, a few kB, left out) and the tokenizer files. Linears in NVFP4 as
    quantize.py stores them: a 4-bit code a weight, an FP8 scale a block of 16, one fp32 scale
    (a K that is not a multiple of 16 stays bf16)."""
    from util import tiny

    H, V, L = shape["hidden_size"], shape["vocab_size"], shape["num_hidden_layers"]
    n = 2 * V * H * 2 + H * 2                    # embed_tokens, lm_head, the final norm (bf16)
    rows = layer_rows(shape)
    for r, k in rows.values():
        nvfp4 = base == "nvfp4" and k % 16 == 0
        n += L * (r * k // 2 + r * k // 16 + 4 if nvfp4 else r * k * 2)
    qkv = sum(r for r, _ in list(rows.values())[:3])
    n += L * (qkv * 2 + 2 * H * 2)               # a layer's q/k/v biases and its two norms
    return n + sum(f.stat().st_size for f in tiny.TOKENIZER_DIR.iterdir())


def adapter_bytes(shape: dict, rank: int) -> int:
    """Bytes of write_adapter's tensors: A (rank, in) and B (out, rank) in bf16 a linear."""
    per_layer = sum(rank * (r + k) for r, k in layer_rows(shape).values())
    return shape["num_hidden_layers"] * per_layer * 2


def random_layers(shape: dict, dev: str):
    """Yield (layer index, {name: bf16 weight}) from a fixed seed: the same draw for the bf16 and
    the NVFP4 folder."""
    g = torch.Generator(device=dev).manual_seed(0)
    for i in range(shape["num_hidden_layers"]):
        w = {}
        for n, (r, k) in layer_rows(shape).items():
            w[f"model.layers.{i}.{n}.weight"] = (
                torch.randn(r, k, device=dev, generator=g).mul_(0.02).to(torch.bfloat16))
        yield i, w


def write_folder(path: Path, shape: dict, base: str, dev: str) -> Path:
    """A random Qwen2 checkpoint at `shape`, base "bf16" or "nvfp4", written atomically; an
    existing folder with a config.json is kept."""
    import quantize
    from util import tiny
    from safetensors.torch import save_file

    if (path / "config.json").exists():
        return path
    H, V = shape["hidden_size"], shape["vocab_size"]
    g = torch.Generator(device=dev).manual_seed(1)
    ones = torch.ones(H, dtype=torch.bfloat16)
    sd = {}
    for n in ("model.embed_tokens.weight", "lm_head.weight"):
        sd[n] = torch.randn(V, H, device=dev, generator=g).mul_(0.02).to(torch.bfloat16).cpu()
    sd["model.norm.weight"] = ones
    for i, w in random_layers(shape, dev):
        if base == "nvfp4":
            w, _ = quantize.quantize_state_dict(w, device=dev)   # q/k/v, gate/up share a scale
        sd.update({k: t.cpu() for k, t in w.items()})
        p = f"model.layers.{i}."
        for n, (r, _) in list(layer_rows(shape).items())[:3]:     # Qwen2's q/k/v biases
            sd[p + n + ".bias"] = torch.zeros(r, dtype=torch.bfloat16)
        sd[p + "input_layernorm.weight"] = ones.clone()
        sd[p + "post_attention_layernorm.weight"] = ones.clone()
    cfg = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu",
               rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768,
               bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16", **shape)
    if base == "nvfp4":
        cfg["quantization_config"] = quantize.QUANTIZATION_CONFIG
    # an existing folder without config.json is not ours: atomic_dir raises FileExistsError
    with fsutil.atomic_dir(path) as tmp:
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        for f in tiny.TOKENIZER_DIR.iterdir():                    # the real Qwen2.5 tokenizer
            shutil.copy(f, tmp / f.name)
    return path


def write_adapter(path: Path, shape: dict, rank: int) -> Path:
    """A PEFT LoRA folder: rank `rank`, alpha 2 * rank, every decoder linear, A and B drawn
    N(0, 0.01) in bf16."""
    import lora
    from safetensors.torch import save_file

    if (path / "adapter_config.json").exists():
        return path
    g = torch.Generator().manual_seed(2)
    sd = {}
    for i in range(shape["num_hidden_layers"]):
        for n, (r, k) in layer_rows(shape).items():
            key = f"{lora.PREFIX}model.layers.{i}.{n}"
            A = torch.randn(rank, k, generator=g).mul_(0.01)     # (r, in)
            B = torch.randn(r, rank, generator=g).mul_(0.01)     # (out, r)
            sd[key + ".lora_A.weight"] = A.to(torch.bfloat16)
            sd[key + ".lora_B.weight"] = B.to(torch.bfloat16)
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "",
           "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
           "target_modules": list(TARGETS), "bias": "none"}
    with fsutil.atomic_dir(path) as tmp:
        save_file(sd, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    return path


def prepare(root: Path, shape_name: str, bases: set, rank: int):
    """Write the folders of one shape (and its adapter when rank > 0), on the GPU when there is
    one."""
    import time

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    where = folders(root, shape_name)
    for base in sorted(bases):
        t0 = time.time()
        write_folder(where[base], SHAPES[shape_name], base, dev)
        print(f"{shape_name} {base}: {where[base]} ({time.time() - t0:.0f} s)", flush=True)
    if rank:
        write_adapter(where["adapter"], SHAPES[shape_name], rank)
