"""pretrain.py: a small Qwen3 trained from scratch on worked column additions, the starting point of RL.

    python pretrain.py --preset cpu --out models/arith-cpu          # the shipped model (2 CPU cores, minutes)
    python pretrain.py --preset gpu --out runs/arith-gpu            # the QeRL ablation's testbed (one GPU, >= 20M)
    python pretrain.py --preset cpu --out /tmp/x --steps 50         # any flag overrides the preset

What it does: builds a tokenizer of its own (BPE over printable ASCII with every digit a token of its own; a
character outside the alphabet is an error, never a silent <unk>), trains a randomly initialised Qwen3 on chat-
formatted worked solutions of arith.py's column additions (loss on the assistant turn only), measures greedy and
sampled (temperature 1) accuracy on held-out prompts with a strict checker (a complete closed \\boxed{...} holding
exactly the gold), and writes a standard Hugging Face folder in one atomic rename: config.json, model.safetensors
(bf16), tokenizer files with a Qwen-style chat template, generation_config.json, and recipe.json (the command, the
flat config, the metrics, the time, and the sha256 of every other file).

Headroom for RL by construction (see arith.py): the corpus forgets a carry with probability `slip` at each column
that owes one, so the model knows the procedure but, at each carry, its most likely move is the slip. Greedy accuracy
starts low, sampled accuracy sits in the 20-50% band, and RL has a local, checkable rule to sharpen.

RL then (measured on 2 shared CPU cores, NVFP4 base + AQN, 64 held-out prompts, strict boxed checker):
    python train.py --algo dapo --model models/arith-cpu --task arith --eval-task arith_test --steps 20 \
        --max-new-tokens 80 --lr 2e-3 --lora-rank 8 --lora-alpha 16 --format-weight 0.1 --eval-every 5 \
        --no-grad-checkpoint --micro-batch 32
  greedy 0.17 -> 0.94 (step 5) -> 1.00 (step 20); sampled 0.25 -> 0.98; format 1.00; 4 min 54 s wall.
  --max-new-tokens 80 keeps DAPO's overlong window (the last quarter) beyond the longest solution (~57 tokens):
  with 60 the length penalty pays the model to drop the "+1" tokens and accuracy collapses.

Leaves out: resuming, multi-GPU, mixed task families, pretraining on anything but arith.py's generator.
"""
import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import versions

versions.check()
import torch  # noqa: E402

import arith  # noqa: E402
import data  # noqa: E402
import fsutil  # noqa: E402
import quantize  # noqa: E402

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # Qwen's names: train.py stops on the last two
# The BPE unknown token is deliberately NOT in the vocabulary: encoding a character outside the alphabet then raises
# (tokenizers: "Unk token `...` not found in the vocabulary") instead of producing a silent <unk>. Its name says why.
UNK = "[error: a character outside this tokenizer's alphabet (printable ASCII); remove it from the prompt]"
ALPHABET = sorted(set(chr(c) for c in range(32, 127)) | {"\n", "\t"})
CHAT_TEMPLATE = ("{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
HEAD_DIMS = (32, 64, 80, 96, 112, 128)  # the head sizes vLLM's CPU attention runs


def opt(default, help):
    return field(default=default, metadata=dict(help=help))


@dataclass
class Config:
    preset: str = opt("cpu", "cpu (ships in the repo: <= 5 MB, <= 15 min on 2 cores) or gpu (>= 20M params, one GPU)")
    out: str = opt(None, "output folder to create (must not exist); written atomically")
    seed: int = opt(0, "seed of the weights, the corpus and the evaluation samples")
    steps: int = opt(None, "optimizer steps")
    batch_size: int = opt(None, "worked solutions per step (fresh ones every step: the corpus never repeats)")
    lr: float = opt(None, "peak AdamW learning rate (linear warm-up, then cosine to 10%%)")
    warmup_steps: int = opt(None, "linear learning-rate warm-up steps")
    weight_decay: float = opt(0.01, "AdamW weight decay")
    max_grad_norm: float = opt(1.0, "gradient clipping")
    hidden_size: int = opt(None, "model width (a multiple of 16)")
    intermediate_size: int = opt(None, "MLP width (a multiple of 16)")
    num_layers: int = opt(None, "decoder layers")
    num_heads: int = opt(None, "attention heads (hidden_size / num_heads must be one of 32, 64, 80, 96, 112, 128)")
    num_kv_heads: int = opt(None, "key/value heads (divides num_heads)")
    digits: int = opt(arith.DEFAULT_DIGITS, "digits of each operand, the difficulty knob (train.py's arith task: 4)")
    slip: float = opt(0.6, "probability that a corpus solution forgets an owed carry (the RL headroom)")
    qat_from: float = opt(0.75, "from this fraction of the steps on, train through the NVFP4 weights the RL base will "
                               "use (straight-through); 1 = never")
    vocab_target: int = opt(256, "BPE vocabulary size to aim at (digits stay single tokens whatever it is)")
    eval_every: int = opt(None, "evaluate held-out accuracy every N steps (0 = only at the end)")
    eval_prompts: int = opt(None, "held-out prompts of each evaluation (greedy and sampled)")
    final_prompts: int = opt(None, "held-out prompts of the final evaluation (the metrics in recipe.json)")
    max_new_tokens: int = opt(64, "generation limit of the evaluations")
    device: str = opt(None, "cpu or cuda (default: cuda when present)")
    threads: int = opt(None, "CPU threads for torch (default: all cores)")


PRESETS = {
    "cpu": dict(steps=1200, batch_size=32, lr=3e-3, warmup_steps=50, hidden_size=128, intermediate_size=384,
                num_layers=4, num_heads=4, num_kv_heads=2, eval_every=100, eval_prompts=64, final_prompts=256),
    "gpu": dict(steps=3000, batch_size=256, lr=1e-3, warmup_steps=200, hidden_size=512, intermediate_size=1536,
                num_layers=8, num_heads=8, num_kv_heads=4, eval_every=500, eval_prompts=256, final_prompts=1024),
}


def parse_args(argv=None) -> Config:
    ap = argparse.ArgumentParser(description="Pretrain a small Qwen3 on worked column additions (arith.py) from "
                                             "scratch and write a Hugging Face folder. Flags left out take the "
                                             "preset's value.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        kind = {"steps": int, "batch_size": int, "lr": float, "warmup_steps": int, "hidden_size": int,
                "intermediate_size": int, "num_layers": int, "num_heads": int, "num_kv_heads": int, "eval_every": int,
                "eval_prompts": int, "final_prompts": int, "threads": int}.get(f.name, type(f.default) if f.default
                                                                                 is not None else str)
        text = f.metadata["help"]
        if f.name in PRESETS["cpu"]:  # "(default: None)" would say nothing: name the presets' values
            text += " [" + ", ".join(f"{p}: {v[f.name]}" for p, v in PRESETS.items()) + "]"
        ap.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default, help=text)
    args = ap.parse_args(argv)
    cfg = Config(**vars(args))
    if cfg.preset not in PRESETS:
        raise ValueError(f"unknown preset {cfg.preset!r}; choose one of: {', '.join(PRESETS)}")
    for k, v in PRESETS[cfg.preset].items():
        if getattr(cfg, k) is None:
            setattr(cfg, k, v)
    return cfg


def validate(cfg: Config) -> None:
    """One clear error for the first bad value, before anything is built."""
    if not cfg.out:
        raise ValueError("--out is required: the folder to create, e.g. --out models/arith-cpu")
    if os.path.exists(cfg.out):
        raise ValueError(f"output folder {cfg.out} already exists: choose another --out or remove it first")
    for name in ("steps", "batch_size", "lr", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "digits", "vocab_target", "max_new_tokens", "final_prompts"):
        if getattr(cfg, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(cfg, name)}")
    for name in ("warmup_steps", "eval_every", "eval_prompts", "weight_decay", "max_grad_norm"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
    if not 0.0 <= cfg.slip <= 1.0:
        raise ValueError(f"--slip is a probability in [0, 1], got {cfg.slip}")
    for name in ("hidden_size", "intermediate_size"):  # NVFP4 quantizes blocks of 16 along each input dimension
        if getattr(cfg, name) % 16:
            raise ValueError(f"--{name.replace('_', '-')} must be a multiple of 16 (NVFP4 blocks), got "
                             f"{getattr(cfg, name)}")
    if cfg.hidden_size % cfg.num_heads or cfg.hidden_size // cfg.num_heads not in HEAD_DIMS:
        raise ValueError(f"hidden_size / num_heads = {cfg.hidden_size} / {cfg.num_heads} must be a whole head size "
                         f"in {HEAD_DIMS} (vLLM's CPU attention)")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"--num-kv-heads {cfg.num_kv_heads} must divide --num-heads {cfg.num_heads}")
    if cfg.device not in (None, "cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {cfg.device!r}")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible: leave --device out to use the CPU")


# ----------------------------------------------------------------------------------------------------------------
# The tokenizer

def chat_text(question: str, answer: str | None = None) -> str:
    """The chat-formatted text of one example: the same system prompt and template as data.build_prompt."""
    text = (f"<|im_start|>system\n{data.SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n")
    return text if answer is None else text + answer + "<|im_end|>\n"


def build_tokenizer(cfg: Config):
    """A BPE tokenizer trained on a sample of the corpus, as a transformers tokenizer with the chat template.

    Pre-tokenization keeps every digit a token of its own (the arithmetic is done digit by digit) and lets words
    merge, so the system prompt costs a dozen tokens, not seventy characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\d| ?[A-Za-z]+|\\boxed\{|\s+|."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # tokens are raw text pieces: decoding concatenates them
    rng = random.Random(cfg.seed)
    sample = []
    for r in arith.rows(2000, cfg.seed, "train", cfg.digits):
        sample.append(chat_text(r["question"], arith.solution(r["a"], r["b"], rng, cfg.slip)[0]))
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_target, special_tokens=list(SPECIALS), initial_alphabet=ALPHABET,
                                  limit_alphabet=len(ALPHABET), min_frequency=50, show_progress=False)
    tok.train_from_iterator(sample, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 bos_token=None, unk_token=None, model_max_length=1024)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def encode_checked(tok, text: str) -> list[int]:
    """Token ids of `text`, or a clear ValueError naming the characters the tokenizer cannot encode."""
    bad = sorted({c for c in text if c not in ALPHABET})
    if bad:
        raise ValueError(f"the text has characters this tokenizer cannot encode: {''.join(bad)!r} (its alphabet is "
                         "printable ASCII plus newline and tab); remove or replace them")
    return list(tok(text, add_special_tokens=False)["input_ids"])


# ----------------------------------------------------------------------------------------------------------------
# The corpus, the model, the evaluation

def make_batch(tok, rng: random.Random, cfg: Config, prompt_cache: dict, split: str = "train"):
    """A batch of fresh worked solutions: ids (B, L) right-padded, labels (B, L) with -100 off the assistant turn."""
    seqs = []
    for _ in range(cfg.batch_size):
        a, b = arith.sample_pair(rng, cfg.digits, split)
        q = arith.question(a, b)
        if q not in prompt_cache:
            prompt_cache.clear() if len(prompt_cache) > 100_000 else None
            prompt_cache[q] = encode_checked(tok, chat_text(q))
        answer = encode_checked(tok, arith.solution(a, b, rng, cfg.slip)[0] + "<|im_end|>")
        seqs.append((prompt_cache[q], answer))
    L = max(len(p) + len(c) for p, c in seqs)
    ids = torch.full((len(seqs), L), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(seqs), L), -100, dtype=torch.long)
    for i, (p, c) in enumerate(seqs):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        labels[i, len(p):len(p) + len(c)] = torch.tensor(c)  # the loss covers the answer and its <|im_end|>
    return ids, labels


def build_model(cfg: Config, tok):
    """A random Qwen3 (q/k norms, no q/k/v bias), tied embeddings. Why not Qwen2: transformers 5 loads any "qwen2"
    folder's tokenizer as Qwen2Tokenizer, which rebuilds a byte-level pipeline over our vocabulary and silently drops
    characters it cannot encode; for "qwen3" it honours the saved tokenizer.json as it is."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab = -(-len(tok) // 16) * 16  # a multiple of 16 (kernel-friendly); the extra rows are never produced
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    hf_cfg = Qwen3Config(vocab_size=vocab, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                         num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.hidden_size // cfg.num_heads,
                         max_position_embeddings=1024, rms_norm_eps=1e-6, attention_bias=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"])
    torch.manual_seed(cfg.seed)
    return Qwen3ForCausalLM(hf_cfg)


@torch.no_grad()
def evaluate(model, tok, rows: list[dict], cfg: Config, sample: bool, seed: int) -> dict:
    """Strict held-out accuracy: greedy or one temperature-1 sample per prompt; format = a closed \\boxed{...}."""
    model.eval()
    dev = next(model.parameters()).device
    stops = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    correct = formatted = 0
    examples = []
    gen = torch.Generator(device=dev).manual_seed(seed)
    for i in range(0, len(rows), 128):
        chunk = rows[i:i + 128]
        prompts = [encode_checked(tok, chat_text(r["question"])) for r in chunk]
        P = max(map(len, prompts))
        ids = torch.tensor([[tok.pad_token_id] * (P - len(p)) + p for p in prompts], device=dev)  # left-padded
        mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], device=dev)
        out = generate(model, ids, mask, cfg.max_new_tokens, sample, gen, stops)
        for r, seq in zip(chunk, out):
            text = tok.decode(seq, skip_special_tokens=True)
            ok, fmt = arith.strict_correct(text, r["answer"])
            correct, formatted = correct + ok, formatted + fmt
            if len(examples) < 2:
                examples.append(text)
    model.train()
    return {"accuracy": correct / len(rows), "format_rate": formatted / len(rows), "examples": examples}


def generate(model, ids, mask, max_new: int, sample: bool, gen, stops) -> list[list[int]]:
    """Batched decoding with transformers' KV cache: ids (B, P) left-padded -> completion token lists."""
    B = ids.shape[0]
    pos = (mask.cumsum(1) - 1).clamp(min=0)                                   # (B, P) positions skip the padding
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    cache, done, toks = out.past_key_values, torch.zeros(B, dtype=torch.bool, device=ids.device), []
    logits, last = out.logits[:, -1].float(), pos[:, -1]
    for _ in range(max_new):
        nxt = (torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0] if sample else logits.argmax(-1))  # (B,)
        nxt = torch.where(done, torch.full_like(nxt, stops[-1]), nxt)
        toks.append(nxt)
        done |= torch.isin(nxt, torch.tensor(stops, device=ids.device))
        if done.all():
            break
        mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=mask.device)], 1)
        last = last + 1
        out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last[:, None], past_key_values=cache,
                    use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1].float()
    seqs = torch.stack(toks, 1).tolist() if toks else [[] for _ in range(B)]
    return [s[:next((j + 1 for j, t in enumerate(s) if t in stops), len(s))] for s in seqs]


def rounded_weights(model, base: str) -> dict:
    """The weights as a client will see them: every tensor rounded to bf16 (what ships), and with base "nvfp4" the
    decoder linears replaced by their NVFP4 values (quantize.py's exact scheme, shared q/k/v and gate/up scales)."""
    out = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    if base == "nvfp4":
        lin = {n: t for n, t in out.items() if quantize.linear_kind(n)}
        q, _ = quantize.quantize_state_dict(lin, device=str(next(model.parameters()).device))
        for n in lin:
            p = n[:-len(".weight")]
            out[n] = quantize.dequantize_weight(q[p + ".weight_packed"], q[p + ".weight_scale"],
                                                q[p + ".weight_global_scale"]).to(lin[n].device)
    return out


class Swapped:
    """with Swapped(model, weights): the model runs with `weights`; on exit its own (master) weights come back.
    Gradients computed inside stay on the parameters: the straight-through estimator of quantization-aware training."""

    def __init__(self, model, weights: dict):
        self.params, self.weights = dict(model.named_parameters()), weights

    def __enter__(self):
        self.saved = {n: p.detach().clone() for n, p in self.params.items()}
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.weights[n])

    def __exit__(self, *exc):
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.saved[n])


def lr_at(step: int, cfg: Config) -> float:
    """Linear warm-up to cfg.lr, then cosine decay to 10% of it at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


# ----------------------------------------------------------------------------------------------------------------
# Writing the folder

def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save(model, tok, cfg: Config, recipe: dict) -> Path:
    """The HF folder, all or nothing: weights (bf16), tokenizer, generation config, recipe.json with the sha256s."""
    from transformers import GenerationConfig

    out = Path(cfg.out)
    with fsutil.atomic_dir(out) as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp)
        tok.save_pretrained(tmp)  # tokenizer_class "TokenizersBackend": the tokenizer.json is loaded as it is
        ids = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
        GenerationConfig(eos_token_id=ids, pad_token_id=ids[1], bos_token_id=ids[1], do_sample=True, temperature=1.0,
                         top_p=1.0).save_pretrained(tmp)  # eos lists the end of turn first
        for p in tmp.iterdir():
            os.chmod(p, 0o666 & ~fsutil._umask())  # save_pretrained may write 0600 files; make them read like any other
        recipe["sha256"] = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / "recipe.json").write_text(json.dumps(recipe, indent=1) + "\n")
    return out


# ----------------------------------------------------------------------------------------------------------------
# The run

def main(argv=None) -> int:
    from tqdm import tqdm

    try:
        cfg = parse_args(argv)
        validate(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dev = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print("config:", json.dumps(dataclasses.asdict(cfg)))
    t0 = time.time()
    random.seed(cfg.seed)
    tok = build_tokenizer(cfg)
    model = build_model(cfg, tok).to(dev).train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tokenizer: {len(tok)} tokens; model: {n_params / 1e6:.2f}M parameters ({n_params * 2 / 2**20:.2f} MiB "
          f"in bf16); device {dev}, {torch.get_num_threads()} threads")
    eval_rows = arith.rows(max(cfg.eval_prompts, cfg.final_prompts), 0, "test", cfg.digits)
    opt_ = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    rng, prompt_cache, history = random.Random(cfg.seed), {}, []
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    heldout = make_batch(tok, random.Random(cfg.seed), cfg, {}, "test")  # a fixed held-out batch: its loss is logged

    def log_eval(step):
        rs = eval_rows[:cfg.eval_prompts]
        g_, s_ = evaluate(model, tok, rs, cfg, False, cfg.seed), evaluate(model, tok, rs, cfg, True, cfg.seed)
        with torch.no_grad(), autocast:
            loss = model(input_ids=heldout[0].to(dev), labels=heldout[1].to(dev)).loss.item()
        history.append(dict(step=step, heldout_loss=round(loss, 4), greedy=g_["accuracy"], sampled=s_["accuracy"],
                            format=s_["format_rate"], time_s=round(time.time() - t0, 1)))
        tqdm.write(json.dumps(history[-1]))

    if cfg.eval_every:
        log_eval(0)
    bar = tqdm(range(cfg.steps), desc=f"pretrain {cfg.preset}", unit="step")
    loss_ema = None
    for step in bar:
        for g in opt_.param_groups:
            g["lr"] = lr_at(step, cfg)
        ids, labels = make_batch(tok, rng, cfg, prompt_cache)
        qat = step >= cfg.qat_from * cfg.steps
        opt_.zero_grad(set_to_none=True)
        with Swapped(model, rounded_weights(model, "nvfp4")) if qat else contextlib.nullcontext(), autocast:
            loss = model(input_ids=ids.to(dev), labels=labels.to(dev)).loss
            loss.backward()  # with QAT: the gradient at the NVFP4 weights, applied to the master weights
        if not torch.isfinite(loss):
            print(f"\nerror: the loss is {loss.item()} at step {step}: lower --lr; nothing was written",
                  file=sys.stderr)
            return 3
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt_.step()
        loss_ema = loss.item() if loss_ema is None else 0.9 * loss_ema + 0.1 * loss.item()
        bar.set_postfix_str(f"loss {loss_ema:.3f} lr {lr_at(step, cfg):.1e}")
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            log_eval(step + 1)
    t_train = time.time() - t0
    rs, metrics = eval_rows[:cfg.final_prompts], dict(loss=round(loss_ema, 4))
    shipped = rounded_weights(model, "bf16")
    for base in ("nvfp4", "fp32", "bf16"):  # the RL base, the master weights, then what ships (left in the model)
        with Swapped(model, rounded_weights(model, "nvfp4")) if base == "nvfp4" else contextlib.nullcontext():
            if base == "bf16":
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(shipped[n])
            g_, s_ = evaluate(model, tok, rs, cfg, False, cfg.seed), evaluate(model, tok, rs, cfg, True, cfg.seed)
            with torch.no_grad(), autocast:
                heldout_loss = model(input_ids=heldout[0].to(dev), labels=heldout[1].to(dev)).loss.item()
        key = "" if base == "bf16" else base + "_"  # unprefixed keys: the shipped bf16 weights
        metrics.update({f"{key}heldout_loss": round(heldout_loss, 4), f"{key}greedy_accuracy": g_["accuracy"],
                        f"{key}sampled_accuracy": s_["accuracy"], f"{key}greedy_format_rate": g_["format_rate"],
                        f"{key}sampled_format_rate": s_["format_rate"]})
        print(f"{base} greedy example:\n" + g_["examples"][0])
    metrics.update(eval_prompts=len(rs), eval_split="test", parameters=n_params, train_time_s=round(t_train, 1),
                   total_time_s=round(time.time() - t0, 1))
    print("final:", json.dumps(metrics))
    recipe = dict(command="python pretrain.py " + " ".join(sys.argv[1:] if argv is None else argv), seed=cfg.seed,
                  preset=cfg.preset, config=dataclasses.asdict(cfg), metrics=metrics, history=history,
                  device=str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev),
                  threads=torch.get_num_threads(), torch=torch.__version__)
    try:
        out = save(model, tok, cfg, recipe)
    except FileExistsError:
        print(f"error: output folder {cfg.out} appeared while training: nothing was written; choose another --out",
              file=sys.stderr)
        return 2
    print(f"wrote {out} ({sum(p.stat().st_size for p in out.iterdir()) / 2**20:.2f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
