"""bench/vllm_speed.py: `python -m bench vllm`: tokens/s of the vLLM backend (our NVFP4 GEMM inside vLLM) against
the built-in engine, one folder.

    python -m bench vllm                      # H100: Qwen2.5-7B shape, batches 1,16,64 (vLLM installed)
    python -m bench vllm --shape small        # a small random shape, any machine with vLLM (a smoke run)

It writes a random NVFP4 checkpoint once (--dir): bf16 weights drawn N(0, 0.02) on the fly and quantized layer by
layer with quantize.quantize_state_dict, quantize.py's config and the real Qwen2.5 tokenizer, so vLLM loads it as it
loads quantize.py's output. Both engines generate --new-tokens tokens after random --prompt-token prompts with EOS
ignored; at each batch size the first call warms up (compiles, captures graphs) and the second is timed. vLLM runs
with its torch.compile + CUDA graphs (enforce_eager=False; graphs captured at the benchmarked batch sizes), LoRA and
sleep mode off; the built-in engine as `python -m bench rollout` runs it. Prints one JSON line per engine and batch.
One run on the H100 (vLLM 0.26.0): vLLM 319 / 4276 / 11244 tok/s at batch 1 / 16 / 64, the built-in engine 379 / 4891
/ 12192, so vLLM with our kernels runs at 0.84x / 0.87x / 0.92x of the built-in engine's speed.
Leaves out: LoRA adapters during timing, bf16 in vLLM (python -m bench rollout has the bf16 built-in engine).
"""
import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch

import fsutil
from bench.common import QWEN

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # rollout_vllm runs vLLM in this process

SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=152064, tie_word_embeddings=False)


def write_folder(path: Path, shape: dict, dev: str) -> Path:
    """A random NVFP4 checkpoint of the Qwen2 architecture at `shape` (bench.common.QWEN's keys), written atomically."""
    import quantize
    import tiny
    from safetensors.torch import save_file

    if (path / "config.json").exists():
        return path
    H, I, L, V = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["vocab_size"]
    hd = H // shape["num_attention_heads"]
    rows = {"q": shape["num_attention_heads"] * hd, "k": shape["num_key_value_heads"] * hd,
            "v": shape["num_key_value_heads"] * hd}
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(n, k):                                                            # (n, k) bf16
        return torch.randn(n, k, device=dev, generator=g).mul_(0.02).to(torch.bfloat16)

    ones = torch.ones(H, dtype=torch.bfloat16)
    sd = {"model.embed_tokens.weight": rnd(V, H).cpu(), "lm_head.weight": rnd(V, H).cpu(), "model.norm.weight": ones}
    for i in range(L):
        p = f"model.layers.{i}."
        w = {p + f"self_attn.{n}_proj.weight": rnd(r, H) for n, r in rows.items()}
        w.update({p + "self_attn.o_proj.weight": rnd(H, rows["q"]), p + "mlp.gate_proj.weight": rnd(I, H),
                  p + "mlp.up_proj.weight": rnd(I, H), p + "mlp.down_proj.weight": rnd(H, I)})
        q, _ = quantize.quantize_state_dict(w, device=dev)                   # q/k/v and gate/up share a scale
        sd.update({k: t.cpu() for k, t in q.items()})
        sd.update({p + f"self_attn.{n}_proj.bias": torch.zeros(r, dtype=torch.bfloat16) for n, r in rows.items()})
        sd.update({p + "input_layernorm.weight": ones.clone(), p + "post_attention_layernorm.weight": ones.clone()})
    cfg = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", rms_norm_eps=1e-6,
               rope_theta=1e6, max_position_embeddings=32768, bos_token_id=151643, eos_token_id=151645,
               torch_dtype="bfloat16", quantization_config=quantize.QUANTIZATION_CONFIG, **shape)
    with fsutil.atomic_dir(path) as tmp:  # an existing --dir without config.json is not ours: FileExistsError
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        for f in tiny.TOKENIZER_DIR.iterdir():
            shutil.copy(f, tmp / f.name)
    return path


def timed(generate, prompts, new_tokens: int) -> dict:
    """Warm-up call, then the timed one: tokens/s end to end (prefill included)."""
    generate(prompts, new_tokens)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.time()
    outs = generate(prompts, new_tokens)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = time.time() - t0
    toks = sum(len(o.tokens) for o in outs)
    assert toks == len(prompts) * new_tokens, toks                            # EOS ignored: every sample is full
    return dict(tok_s=round(toks / dt, 1), seconds=round(dt, 3))   # (no peak memory: vLLM keeps its pool after close)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench vllm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["7b", "32b", "small"], default="7b", help="Qwen2.5 shape of the random model")
    ap.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes (sequences)")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per sequence")
    ap.add_argument("--new-tokens", type=int, default=512, help="generated tokens per sequence (EOS ignored)")
    ap.add_argument("--dir", default=None, help="where the random checkpoint is written once (default: /tmp/...)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="vLLM's share of the GPU")
    args = ap.parse_args(argv)
    print(json.dumps(vars(args)))
    import model as M
    import rollout
    import rollout_vllm as RV

    batches = [int(b) for b in args.batches.split(",")]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shape = SMALL if args.shape == "small" else QWEN[args.shape]
    folder = write_folder(Path(args.dir or f"/tmp/nanoqerl-bench-{args.shape}-nvfp4"), shape, dev)
    g = torch.Generator().manual_seed(0)
    prompts = {B: torch.randint(0, 150000, (B, args.prompt), generator=g).tolist() for B in batches}
    max_len = args.prompt + args.new_tokens

    graphs = dict(compilation_config={"cudagraph_capture_sizes": batches}, max_num_seqs=max(batches))
    kw = graphs if dev == "cuda" else {}
    eng = RV.VLLMEngine(str(folder), max_model_len=max_len, enable_lora=False, enforce_eager=dev != "cuda",
                        enable_sleep_mode=False, gpu_memory_utilization=args.gpu_memory_utilization, **kw)
    for B in batches:
        row = timed(lambda p, n: eng.generate(p, max_new_tokens=n, stop_token_ids=[], seed=0), prompts[B],
                    args.new_tokens)
        print(json.dumps(dict(engine="vllm", shape=args.shape, batch=B, **row)))
    eng.close()
    del eng
    if dev == "cuda":
        torch.cuda.empty_cache()

    m = M.Model.from_pretrained(str(folder), dev, torch.bfloat16)
    for B in batches:
        e = rollout.Engine(m, max_batch=B, max_len=max_len)
        row = timed(lambda p, n: e.generate(p, max_new_tokens=n, stop_token_ids=[], seed=0), prompts[B],
                    args.new_tokens)
        print(json.dumps(dict(engine="built-in", shape=args.shape, batch=B, **row)))
        del e


if __name__ == "__main__":
    main()
