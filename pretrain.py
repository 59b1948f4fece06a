"""pretrain.py: a small Qwen3 trained from scratch on a generated task's worked solutions, the
starting point of RL.

    python pretrain.py --preset cpu --out models/arith-cpu        # the shipped model (2 CPU cores)
    python pretrain.py --preset gpu --out runs/arith-gpu          # addition at 25M (one GPU)
    python pretrain.py --preset countdown --out runs/countdown    # the ablation's testbed (one GPU)
    python pretrain.py --preset stargraph --out runs/stargraph    # another candidate (one GPU)
    python pretrain.py --preset cpu --out /tmp/x --steps 50       # any flag overrides the preset

What it does: builds a tokenizer of its own (BPE over printable ASCII with every digit a token of
its own; a character outside the alphabet is an error, never a silent <unk>), trains a randomly
initialised Qwen3 on chat-formatted worked solutions of one task family of tasks/ (--task: arith,
countdown or stargraph; loss on the assistant turn only), measures greedy and sampled
(temperature 1) accuracy on held-out prompts with the task's strict checker, and writes a standard
Hugging Face folder in one atomic rename: config.json, model.safetensors (bf16), tokenizer files
with a Qwen-style chat template, generation_config.json, and recipe.json (the command, the flat
config, the RL defaults of its task, the metrics, the time, and the sha256 of every other file).

The RL defaults (recipe.json's "rl" key, rl_recipe below) are what train.py and eval.py use for
the flags left out, wherever the folder lies: the registered task of the preset's generator knobs
and its held-out split (tasks/arith.py, countdown.py, stargraph.py TASKS; none when the knobs
match no registered task, and train.py then asks for --task), the answer format, the steps, the
length limit, the learning rate, LoRA's rank and alpha, the format weight and how often to
evaluate. The addition presets' are the shipped default run's.

Headroom for RL comes from the task. Addition (tasks/arith.py): the corpus forgets a carry with
probability `slip`, so the model knows the procedure but its most likely move at a carry is the
slip. Countdown and star graphs (tasks/countdown.py, tasks/stargraph.py): the corpus holds only
correct solutions, but a move that leads to the answer cannot be told from one that does not
without a search the corpus never shows, so the model learns plausible moves and RL has to find
the right ones. Quantization: `--qat-from` trains the last part of the steps through the NVFP4
weights the RL base will use (the addition presets); the countdown and stargraph presets train in
bf16 only and are quantized afterwards, as QeRL quantizes a bf16-trained model.

Leaves out: resuming, several GPUs, mixed task families, tasks without a generator.
"""
if __name__ == "__main__":     # run as a script: the pinned packages (pyproject.toml) are
    from util import versions  # checked before torch loads: a missing or wrong one is one line
    versions.check_or_exit()

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tasks import arith, countdown, stargraph
from tasks.tokenizer import SPECIALS, build_tokenizer, chat_text, encode_checked
from trainer.pretraining import Swapped, evaluate, rounded_weights
from trainer.schedule import lr_factor, set_lr
from util import fsutil

HEAD_DIMS = (32, 64, 80, 96, 112, 128)  # the head sizes vLLM's CPU attention runs
# the task families (each a module of tasks/ with corpus_example, rows and check)
FAMILIES = {"arith": arith, "countdown": countdown, "stargraph": stargraph}


def opt(default, help):
    return field(default=default, metadata=dict(help=help))


@dataclass
class Config:
    preset: str = opt("cpu", "cpu (addition, ships in the repo: <= 5 MB, <= 15 min on 2 cores), "
                             "gpu (addition, >= 20M params), countdown or stargraph (one GPU)")
    out: str = opt(None, "output folder to create (must not exist, its parent writable); written "
                         "atomically; required")
    seed: int = opt(0, "seed of the weights, the corpus and the evaluation samples")
    task: str = opt(None, f"task family of the corpus: {', '.join(FAMILIES)} (tasks/<name>.py)")
    steps: int = opt(None, "optimizer steps")
    batch_size: int = opt(None, "worked solutions per step (fresh ones every step)")
    lr: float = opt(None, "peak AdamW learning rate (linear warm-up, then cosine to 10%%)")
    warmup_steps: int = opt(None, "linear learning-rate warm-up steps")
    weight_decay: float = opt(0.01, "AdamW weight decay")
    max_grad_norm: float = opt(1.0, "gradient clipping")
    hidden_size: int = opt(None, "model width (a multiple of 16)")
    intermediate_size: int = opt(None, "MLP width (a multiple of 16)")
    num_layers: int = opt(None, "decoder layers")
    num_heads: int = opt(None, "attention heads (hidden_size / num_heads must be one of "
                               "32, 64, 80, 96, 112, 128)")
    num_kv_heads: int = opt(None, "key/value heads (divides num_heads)")
    digits: int = opt(arith.DEFAULT_DIGITS, "arith: digits of each operand, the difficulty knob "
                                            "(train.py's arith task: 4)")
    slip: float = opt(0.6, "arith: probability that a corpus solution forgets an owed carry (the "
                           "RL headroom)")
    count: int = opt(countdown.DEFAULT_COUNT, "countdown: numbers an instance gives (train.py's "
                                              "countdown task: 4)")
    max_number: int = opt(countdown.DEFAULT_MAX_NUMBER, "countdown: the given numbers are drawn "
                                                        "from 1..this")
    degree: int = opt(stargraph.DEFAULT_DEGREE, "stargraph: arms of the star (train.py's "
                                                "stargraph task: 5)")
    length: int = opt(stargraph.DEFAULT_LENGTH, "stargraph: nodes an arm holds after the center")
    qat_from: float = opt(None, "from this fraction of the steps on, train through the NVFP4 "
                                "weights the RL base will use (straight-through); 1 = never")
    vocab_target: int = opt(256, "BPE vocabulary size to aim at (digits stay single tokens "
                                 "whatever it is)")
    eval_every: int = opt(None, "evaluate held-out accuracy every N steps (0 = only at the end)")
    eval_prompts: int = opt(None, "held-out prompts of each evaluation (greedy and sampled)")
    final_prompts: int = opt(None, "held-out prompts of the final evaluation (the metrics in "
                                   "recipe.json)")
    max_new_tokens: int = opt(64, "generation limit of the evaluations")
    device: str = opt(None, "cpu or cuda (default: cuda when present)")
    threads: int = opt(None, "CPU threads for torch (default: all cores)")


# The addition presets: the shipped CPU model and its 25M version, trained through their NVFP4
# weights for the last quarter. The testbed presets: about 6M parameters (12 MB in bf16), bf16 only.
SMALL = dict(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2)
WIDE = dict(hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8, num_kv_heads=4)
TESTBED = dict(hidden_size=256, intermediate_size=768, num_layers=8, num_heads=4, num_kv_heads=2)
PRESETS = {
    "cpu": dict(task="arith", steps=1200, batch_size=32, lr=3e-3, warmup_steps=50, qat_from=0.75,
                eval_every=100, eval_prompts=64, final_prompts=256, **SMALL),
    "gpu": dict(task="arith", steps=3000, batch_size=256, lr=1e-3, warmup_steps=200,
                qat_from=0.75, eval_every=500, eval_prompts=256, final_prompts=1024, **WIDE),
    "countdown": dict(task="countdown", steps=4000, batch_size=256, lr=1e-3, warmup_steps=200,
                      qat_from=1.0, eval_every=1000, eval_prompts=256, final_prompts=1024,
                      **TESTBED),
    "stargraph": dict(task="stargraph", steps=4000, batch_size=256, lr=1e-3, warmup_steps=200,
                      qat_from=1.0, eval_every=1000, eval_prompts=256, final_prompts=1024,
                      **TESTBED),
}
# The RL defaults a model carries in recipe.json's "rl" key (rl_recipe adds its task names). The
# addition presets: the shipped default run's (20 steps of DAPO at lr 2e-3 lift held-out greedy
# accuracy from 0.17 to 1.00; 80 new tokens: the longest solution is about 57, and DAPO's overlong
# penalty covers the last quarter of the limit). The testbed presets: the pilot's RL gate (300
# steps at lr 3e-4, 64 new tokens, accuracy as the only reward).
RL_ARITH = dict(fmt="boxed", steps=20, max_new_tokens=80, lr=2e-3, lora_rank=8, lora_alpha=16.0,
                format_weight=0.1, eval_every=5, grad_checkpoint=False)
RL_TESTBED = dict(fmt="boxed", steps=300, max_new_tokens=64, lr=3e-4, lora_rank=8,
                  lora_alpha=16.0, format_weight=0.0, eval_every=50, grad_checkpoint=False)
# the flags whose default is None (the parser cannot read their type from the default)
FLAG_TYPES = {"steps": int, "batch_size": int, "lr": float, "warmup_steps": int,
              "hidden_size": int, "intermediate_size": int, "num_layers": int, "num_heads": int,
              "num_kv_heads": int, "qat_from": float, "eval_every": int, "eval_prompts": int,
              "final_prompts": int, "threads": int}


def parse_args(argv=None) -> Config:
    ap = argparse.ArgumentParser(
        description="Pretrain a small Qwen3 from scratch on a generated task's worked solutions "
                    "(tasks/) and write a Hugging Face folder. Flags left out take the preset's "
                    "value.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        default_type = type(f.default) if f.default is not None else str
        kind = FLAG_TYPES.get(f.name, default_type)
        text = f.metadata["help"]
        if f.name in PRESETS["cpu"]:  # "(default: None)" would say nothing: name the presets'
            text += " [" + ", ".join(f"{p}: {v[f.name]}" for p, v in PRESETS.items()) + "]"
        if f.name == "out":                   # required (validate): no "(default: None)" shown
            ap.add_argument("--out", default=argparse.SUPPRESS, help=text)
        else:
            ap.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default,
                            help=text)
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
        raise ValueError(f"output folder {cfg.out} already exists: choose another --out or "
                         "remove it first")
    # the folder is renamed into place beside its temporary
    fsutil.check_writable(cfg.out, inside=False)
    if cfg.task not in FAMILIES:
        raise ValueError(f"--task {cfg.task!r} is not one of: {', '.join(FAMILIES)}")
    for name in ("steps", "batch_size", "lr", "hidden_size", "intermediate_size", "num_layers",
                 "num_heads", "num_kv_heads", "digits", "vocab_target", "max_new_tokens",
                 "final_prompts"):
        if getattr(cfg, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(cfg, name)}")
    for name in ("warmup_steps", "eval_every", "eval_prompts", "weight_decay", "max_grad_norm"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
    if not 0.0 <= cfg.slip <= 1.0:
        raise ValueError(f"--slip is a probability in [0, 1], got {cfg.slip}")
    # the family's own checks of its knobs (count, max_number, degree, length), as one line
    try:
        family(cfg).rows(1, cfg.seed, "train", **task_knobs(cfg))
    except ValueError as e:
        raise ValueError(f"--task {cfg.task}: {e}") from None
    for name in ("hidden_size", "intermediate_size"):  # NVFP4 quantizes blocks of 16 along K
        if getattr(cfg, name) % 16:
            raise ValueError(f"--{name.replace('_', '-')} must be a multiple of 16 (NVFP4 blocks), "
                             f"got {getattr(cfg, name)}")
    if cfg.hidden_size % cfg.num_heads or cfg.hidden_size // cfg.num_heads not in HEAD_DIMS:
        raise ValueError(f"hidden_size / num_heads = {cfg.hidden_size} / {cfg.num_heads} must be "
                         f"a whole head size in {HEAD_DIMS} (vLLM's CPU attention)")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"--num-kv-heads {cfg.num_kv_heads} must divide --num-heads "
                         f"{cfg.num_heads}")
    if cfg.device not in (None, "cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {cfg.device!r}")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible: leave --device out to use "
                         "the CPU")


# --------------------------------------------------------------------------------------------------
# The task family: its generator knobs, its corpus, its held-out rows

def family(cfg: Config):
    return FAMILIES[cfg.task]


def task_knobs(cfg: Config) -> dict:
    """The generator knobs of the family (the difficulty), as its rows() takes them."""
    if cfg.task == "arith":
        return dict(digits=cfg.digits)
    if cfg.task == "countdown":
        return dict(count=cfg.count, max_number=cfg.max_number)
    return dict(degree=cfg.degree, length=cfg.length)


def rl_recipe(cfg: Config) -> dict:
    """recipe.json's "rl" key: the family's RL defaults, with the registered task of the preset's
    knobs and its held-out split (None where no registered task has these knobs)."""
    names = {"arith": {n: (split, arith.DEFAULT_DIGITS) for n, split in arith.TASKS.items()},
             "countdown": {n: spec + (countdown.DEFAULT_MAX_NUMBER,)
                           for n, spec in countdown.TASKS.items()},
             "stargraph": dict(stargraph.TASKS)}[cfg.task]
    knobs = {"arith": (cfg.digits,), "countdown": (cfg.count, cfg.max_number),
             "stargraph": (cfg.degree, cfg.length)}[cfg.task]

    def registered(split: str) -> str | None:       # names: task -> (split, its knobs...)
        return next((n for n, spec in names.items() if spec == (split,) + knobs), None)
    rest = RL_ARITH if cfg.task == "arith" else RL_TESTBED
    return dict(task=registered("train"), eval_task=registered("test"), **rest)


def corpus_example(cfg: Config, rng: random.Random, split: str) -> tuple[str, str]:
    """One fresh (question, worked solution) of the family; arith's also slips (its headroom)."""
    if cfg.task == "arith":
        return arith.corpus_example(rng, split, cfg.digits, cfg.slip)
    return family(cfg).corpus_example(rng, split, **task_knobs(cfg))


def tokenizer_sample(cfg: Config) -> list[str]:
    """2000 chat-formatted training examples, the tokenizer's training text."""
    rng = random.Random(cfg.seed)
    if cfg.task == "arith":
        # drawn as the shipped model's tokenizer was (rows, then a solution each from rng): another
        # draw of the same distribution could merge other pairs and change the vocabulary
        return [chat_text(r["question"], arith.solution(r["a"], r["b"], rng, cfg.slip)[0])
                for r in arith.rows(2000, cfg.seed, "train", cfg.digits)]
    return [chat_text(*corpus_example(cfg, rng, "train")) for _ in range(2000)]


# --------------------------------------------------------------------------------------------------
# The corpus and the model (the evaluation and the NVFP4 weights: trainer/pretraining.py)

def make_batch(tok, rng: random.Random, cfg: Config, split: str = "train"):
    """A batch of fresh worked solutions: ids (B, L) right-padded, labels (B, L) with -100 off the
    assistant turn."""
    examples = [corpus_example(cfg, rng, split) for _ in range(cfg.batch_size)]
    # one call encodes the whole batch (the tokenizer's batch path runs in parallel)
    prompts = encode_checked(tok, [chat_text(q) for q, _ in examples])
    answers = encode_checked(tok, [text + "<|im_end|>" for _, text in examples])
    L = max(len(p) + len(c) for p, c in zip(prompts, answers))
    ids = []
    labels = []
    for p, c in zip(prompts, answers):
        pad = L - len(p) - len(c)
        ids.append(p + c + [tok.pad_token_id] * pad)
        # the loss covers the answer and its <|im_end|>
        labels.append([-100] * len(p) + c + [-100] * pad)
    return torch.tensor(ids), torch.tensor(labels)                              # (B, L) each


def build_model(cfg: Config, tok):
    """A random Qwen3 (q/k norms, no q/k/v bias), tied embeddings. Why not Qwen2: transformers 5
    loads any "qwen2" folder's tokenizer as Qwen2Tokenizer, which rebuilds a byte-level pipeline
    over our vocabulary and silently drops characters it cannot encode; for "qwen3" it honours the
    saved tokenizer.json as it is."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # a multiple of 16 (kernel-friendly); the extra rows are never produced
    vocab = -(-len(tok) // 16) * 16
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    hf_cfg = Qwen3Config(vocab_size=vocab, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size,
                         num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                         num_key_value_heads=cfg.num_kv_heads,
                         head_dim=cfg.hidden_size // cfg.num_heads,
                         max_position_embeddings=1024, rms_norm_eps=1e-6, attention_bias=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         tie_word_embeddings=True, bos_token_id=ids["<|endoftext|>"],
                         eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    torch.manual_seed(cfg.seed)
    return Qwen3ForCausalLM(hf_cfg)


def lr_at(step: int, cfg: Config) -> float:
    """Linear warm-up to cfg.lr (its first step already at 1 / warmup_steps), then cosine decay to
    10% of it at the last step: trainer/schedule.py's one schedule."""
    return cfg.lr * lr_factor(step, cfg.steps, cfg.warmup_steps, "cosine", floor=0.1,
                              warmup_from=1)


# --------------------------------------------------------------------------------------------------
# Writing the folder

def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save(model, tok, cfg: Config, recipe: dict) -> Path:
    """The HF folder, all or nothing: weights (bf16), tokenizer, generation config, recipe.json
    with the sha256s."""
    from transformers import GenerationConfig

    out = Path(cfg.out)
    with fsutil.atomic_dir(out) as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp)
        # tokenizer_class "TokenizersBackend": the tokenizer.json is loaded as it is
        tok.save_pretrained(tmp)
        ids = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
        # eos lists the end of turn first
        GenerationConfig(eos_token_id=ids, pad_token_id=ids[1], bos_token_id=ids[1],
                         do_sample=True, temperature=1.0, top_p=1.0).save_pretrained(tmp)
        for p in tmp.iterdir():
            # save_pretrained may write 0600 files; make them read like any other
            os.chmod(p, 0o666 & ~fsutil._umask())
        recipe["sha256"] = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / "recipe.json").write_text(json.dumps(recipe, indent=1) + "\n")
    return out


# --------------------------------------------------------------------------------------------------
# The run

def measure(model, tok, cfg: Config, rows: list[dict], heldout, autocast) -> dict:
    """Greedy and sampled accuracy on held-out rows, and the loss of the fixed held-out batch."""
    dev = next(model.parameters()).device
    check = family(cfg).check
    greedy = evaluate(model, tok, rows, check, cfg.max_new_tokens, False, cfg.seed)
    sampled = evaluate(model, tok, rows, check, cfg.max_new_tokens, True, cfg.seed)
    with torch.no_grad(), autocast:
        ids, labels = heldout[0].to(dev), heldout[1].to(dev)
        loss = model(input_ids=ids, labels=labels).loss.item()
    return dict(greedy=greedy, sampled=sampled, loss=loss)


def final_metrics(model, tok, cfg: Config, rows: list[dict], heldout, autocast) -> dict:
    """The metrics of recipe.json, for the RL base (NVFP4), the master weights (fp32) and what ships
    (bf16, left in the model)."""
    metrics = {}
    shipped = rounded_weights(model, "bf16")
    for base in ("nvfp4", "fp32", "bf16"):
        nvfp4 = base == "nvfp4"
        with Swapped(model, rounded_weights(model, "nvfp4")) if nvfp4 else contextlib.nullcontext():
            if base == "bf16":
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(shipped[n])
            m = measure(model, tok, cfg, rows, heldout, autocast)
        key = "" if base == "bf16" else base + "_"  # unprefixed keys: the shipped bf16 weights
        metrics[f"{key}heldout_loss"] = round(m["loss"], 4)
        metrics[f"{key}greedy_accuracy"] = m["greedy"]["accuracy"]
        metrics[f"{key}sampled_accuracy"] = m["sampled"]["accuracy"]
        metrics[f"{key}greedy_format_rate"] = m["greedy"]["format_rate"]
        metrics[f"{key}sampled_format_rate"] = m["sampled"]["format_rate"]
        print(f"{base} greedy example:\n" + m["greedy"]["examples"][0])
    return metrics


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
    tok = build_tokenizer(tokenizer_sample(cfg), cfg.vocab_target)
    model = build_model(cfg, tok).to(dev).train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tokenizer: {len(tok)} tokens; model: {n_params / 1e6:.2f}M parameters "
          f"({n_params * 2 / 2**20:.2f} MiB in bf16); device {dev}, "
          f"{torch.get_num_threads()} threads")
    n_eval = max(cfg.eval_prompts, cfg.final_prompts)
    eval_rows = family(cfg).rows(n_eval, 0, "test", **task_knobs(cfg))
    # no learning rate here: set_lr sets each step's from the schedule
    opt_ = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=cfg.weight_decay,
                             betas=(0.9, 0.95))
    rng = random.Random(cfg.seed)
    history = []
    if dev.type == "cuda":
        autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        autocast = torch.autocast("cpu", enabled=False)
    # a fixed held-out batch: its loss is logged
    heldout = make_batch(tok, random.Random(cfg.seed), cfg, "test")

    def log_eval(step):
        m = measure(model, tok, cfg, eval_rows[:cfg.eval_prompts], heldout, autocast)
        history.append(dict(step=step, heldout_loss=round(m["loss"], 4),
                            greedy=m["greedy"]["accuracy"], sampled=m["sampled"]["accuracy"],
                            format=m["sampled"]["format_rate"], time_s=round(time.time() - t0, 1)))
        tqdm.write(json.dumps(history[-1]))

    if cfg.eval_every:
        log_eval(0)
    bar = tqdm(range(cfg.steps), desc=f"pretrain {cfg.preset}", unit="step")
    loss_ema = None
    for step in bar:
        set_lr(opt_, lr_at(step, cfg))
        ids, labels = make_batch(tok, rng, cfg)
        qat = step >= cfg.qat_from * cfg.steps
        opt_.zero_grad(set_to_none=True)
        nvfp4 = Swapped(model, rounded_weights(model, "nvfp4")) if qat else contextlib.nullcontext()
        with nvfp4, autocast:
            loss = model(input_ids=ids.to(dev), labels=labels.to(dev)).loss
            # with QAT: the gradient at the NVFP4 weights, applied to the master weights
            loss.backward()
        if not torch.isfinite(loss):
            print(f"\nerror: the loss is {loss.item()} at step {step}: lower --lr; nothing was "
                  "written", file=sys.stderr)
            return 3
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt_.step()
        loss_ema = loss.item() if loss_ema is None else 0.9 * loss_ema + 0.1 * loss.item()
        bar.set_postfix_str(f"loss {loss_ema:.3f} lr {lr_at(step, cfg):.1e}")
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            log_eval(step + 1)
    t_train = time.time() - t0

    rows = eval_rows[:cfg.final_prompts]
    metrics = dict(loss=round(loss_ema, 4))
    metrics.update(final_metrics(model, tok, cfg, rows, heldout, autocast))
    metrics.update(eval_prompts=len(rows), eval_split="test", parameters=n_params,
                   train_time_s=round(t_train, 1), total_time_s=round(time.time() - t0, 1))
    print("final:", json.dumps(metrics))
    command = "python pretrain.py " + " ".join(sys.argv[1:] if argv is None else argv)
    device = str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev)
    recipe = dict(command=command, seed=cfg.seed, preset=cfg.preset,
                  config=dataclasses.asdict(cfg), rl=rl_recipe(cfg), metrics=metrics,
                  history=history, device=device, threads=torch.get_num_threads(),
                  torch=torch.__version__)
    try:
        out = save(model, tok, cfg, recipe)
    except FileExistsError:
        print(f"error: output folder {cfg.out} appeared while training: nothing was written; "
              "choose another --out", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in out.iterdir()) / 2**20
    print(f"wrote {out} ({size:.2f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
