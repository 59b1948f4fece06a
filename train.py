"""train.py: GRPO / DAPO / Dr.GRPO with an NVFP4 base + LoRA + AQN, on one GPU (or a CPU for the tiny default).

    python train.py --algo dapo                                  # built-in default: tiny model, synthetic task
    python train.py --algo dapo --model Qwen/Qwen2.5-7B-Instruct --task gsm8k_train --steps 500 \\
        --prompts-per-step 16 --group-size 8 --max-new-tokens 1024 --lr 1e-5 --eval-task gsm8k   # the real recipe
    python train.py --resume runs/dapo-20261122-120000          # continue exactly where it stopped
    python train.py --plot runs/dapo-20261122-120000            # redraw curves.png

One RL step: sample prompts -> roll out G completions each (built-in engine by default; the same modules that
train) -> fail-closed rewards (data.py) -> group advantages, DAPO dynamic sampling and overlong shaping (grpo.py)
-> the trainer's log-probs -> several PPO minibatch updates of the LoRA weights (AdamW) -> next AQN sigma.
Every random draw (prompts, sampling, noise, shuffling) is derived from (seed, step), so --resume replays exactly.
The run folder holds config.json, metrics.jsonl, curves.png and checkpoints/step_N/ (PEFT adapter, optimizer,
RNG, step), written atomically; a NaN loss stops the run and keeps the last good checkpoint.

The built-in default (--model tiny) builds once a tiny random Qwen2 with the real tokenizer and spends ~20 s of
supervised warm-up teaching it the answer format with random digits, so RL starts at chance (1 in 10) on the
synthetic task (the lucky digit, always 7) and has to find the answer: accuracy climbs within ~40 steps on a CPU.
A random tiny model cannot learn prompt-dependent answers (copy, next digit) that fast; use a pretrained model.
Leaves out: multi-GPU, reward models, value functions.
"""
import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import versions

versions.check()
import torch  # noqa: E402

import data  # noqa: E402
import grpo  # noqa: E402
import lora  # noqa: E402
import model as M  # noqa: E402
import noise  # noqa: E402
import quantize  # noqa: E402
import rollout  # noqa: E402
import tiny  # noqa: E402


def opt(default, help, **kw):
    return field(default=default, metadata=dict(help=help, **kw))


@dataclass
class Config:
    algo: str = opt("dapo", "preset: grpo | dapo | dr_grpo (see grpo.PRESETS); every knob below overrides it")
    model: str = opt("tiny", "HF folder or hub id; 'tiny' = the built-in warm-started tiny Qwen2")
    base: str = opt("nvfp4", "base precision: nvfp4 (bf16 checkpoints are quantized while loading) or bf16")
    task: str = opt("synthetic", f"training data: {', '.join(data.TASKS)}")
    data: str = opt(None, "JSONL path for the task (needed for math12k)")
    fmt: str = opt("boxed", "answer format: boxed or think")
    steps: int = opt(None, "RL steps (default 500; 40 for the tiny model)")
    prompts_per_step: int = opt(8, "prompt groups per RL step")
    group_size: int = opt(8, "G, completions per prompt")
    max_new_tokens: int = opt(8, "completion length limit")
    temperature: float = opt(1.0, "sampling temperature (the trainer's log-probs use the same)")
    top_p: float = opt(1.0, "nucleus sampling mass (1 keeps engine and trainer log-probs identical)")
    lr: float = opt(None, "AdamW learning rate of the LoRA weights (default 1e-5, QeRL's NVFP4 choice; 5e-3 tiny)")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    warmup_steps: int = opt(0, "linear learning-rate warm-up steps")
    max_grad_norm: float = opt(1.0, "gradient clipping")
    lora_rank: int = opt(None, "LoRA rank (default 32; 8 for the tiny model)")
    lora_alpha: float = opt(None, "LoRA alpha, the scale is alpha / rank (default 64; 16 for the tiny model)")
    epochs: int = opt(1, "passes over each rollout batch")
    minibatches: int = opt(2, "optimizer steps per pass (> 1 makes the PPO clip matter)")
    micro_batch: int = opt(16, "sequences per forward/backward (gradient accumulation inside a minibatch)")
    std_normalize: bool = opt(None, "divide advantages by the group std (GRPO, DAPO) or not (Dr.GRPO)")
    eps_low: float = opt(None, "PPO clip below 1")
    eps_high: float = opt(None, "PPO clip above 1 (DAPO clip-higher: 0.28)")
    agg: str = opt(None, f"loss aggregation: {', '.join(grpo.AGGREGATIONS)}")
    beta: float = opt(None, "k3 KL to the base policy (LoRA disabled); 0 = off")
    tis_cap: float = opt(None, "TIS cap C on pi_trainer / pi_engine; 0 = off; default: on (2) for vllm only")
    dynamic_sampling: bool = opt(None, "DAPO: drop all-equal groups and roll out more prompts")
    max_sample_rounds: int = opt(None, "bound on rollout rounds per step with dynamic sampling")
    overlong_cache_frac: float = opt(None, "DAPO overlong penalty window, a fraction of max_new_tokens; 0 = off")
    overlong_factor: float = opt(None, "overlong penalty at the length limit")
    mask_truncated: bool = opt(None, "zero the loss of samples cut at the length limit")
    format_weight: float = opt(None, "reward weight of the answer format (default 0; 0.2 for the tiny model, "
                                     "whose format otherwise erodes under negative advantages)")
    accuracy_weight: float = opt(1.0, "reward weight of a correct answer")
    aqn: bool = opt(True, "adaptive quantization noise in the norms")
    sigma_start: float = opt(1e-2, "AQN sigma of stage 1")
    sigma_end: float = opt(5e-4, "AQN sigma the schedule decays to")
    aqn_stages: int = opt(10, "AQN stages (stage 0 has no noise)")
    aqn_where: str = opt("rollout_only", "AQN in the rollout only (paper) or 'both' (training forward too)")
    engine: str = opt("builtin", "rollout backend: builtin or vllm")
    grad_checkpoint: bool = opt(True, "recompute each layer in backward (less memory)")
    eval_task: str = opt(None, "task evaluated every --eval-every steps (default: the training task's held-out rows)")
    eval_every: int = opt(0, "evaluate every N steps (0 = only at the end)")
    eval_limit: int = opt(64, "prompts per evaluation")
    save_every: int = opt(20, "checkpoint every N steps (and at the end)")
    out: str = opt(None, "run folder (default runs/<algo>-<time>)")
    seed: int = opt(0, "seed of everything")
    tensorboard: bool = opt(False, "also log to tensorboard (needs the tensorboard package)")
    wandb: bool = opt(False, "also log to Weights & Biases (needs wandb)")
    device: str = opt(None, "cuda or cpu (default: cuda when present)")


def parse_args(argv=None) -> tuple[Config, argparse.Namespace]:
    ap = argparse.ArgumentParser(description="RL (GRPO / DAPO / Dr.GRPO) on an NVFP4 base with LoRA and AQN.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        name, kind = "--" + f.name.replace("_", "-"), (type(f.default) if f.default is not None else str)
        kind = {"steps": int, "lr": float, "beta": float, "eps_low": float, "eps_high": float, "tis_cap": float,
                "max_sample_rounds": int, "overlong_cache_frac": float, "overlong_factor": float, "lora_rank": int,
                "lora_alpha": float, "format_weight": float}.get(f.name, kind)
        if f.type in ("bool", bool) or isinstance(f.default, bool):
            ap.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
        else:
            ap.add_argument(name, type=kind, default=f.default, help=f.metadata["help"])
    ap.add_argument("--resume", default=None, help="continue the run in this folder from its last checkpoint")
    ap.add_argument("--plot", default=None, help="only redraw RUN/curves.png from RUN/metrics.jsonl")
    args = ap.parse_args(argv)
    return Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)}), args


def seeded(cfg: Config, *keys) -> int:
    """A seed derived from (seed, keys), stable across processes (so --resume replays the same draws)."""
    return int(hashlib.sha256(repr((cfg.seed,) + keys).encode()).hexdigest()[:15], 16)


# ----------------------------------------------------------------------------------------------------------------
# Rollout, rewards, the training batch

def rollout_groups(cfg, p, engine, tok, rows, step, stops, round_):
    """Sample prompts, generate G completions each, score them. Returns one dict per prompt group."""
    rng = random.Random(seeded(cfg, "prompts", step, round_))
    picks = [rows[rng.randrange(len(rows))] for _ in range(cfg.prompts_per_step)]
    prompts = [data.prompt_token_ids(tok, r["question"], cfg.fmt) for r in picks]
    t0 = time.time()
    samples = engine.generate(prompts, n=cfg.group_size, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                              top_p=cfg.top_p, stop_token_ids=stops, seed=seeded(cfg, "sample", step, round_))
    t_roll = time.time() - t0
    cache = round(p["overlong_cache_frac"] * cfg.max_new_tokens)
    groups = []
    for i, row in enumerate(picks):
        ss = samples[i * cfg.group_size:(i + 1) * cfg.group_size]
        scores = [data.score(tok.decode(s.tokens, skip_special_tokens=True), row["gold"], row["kind"], cfg.fmt,
                             cfg.format_weight, cfg.accuracy_weight) for s in ss]
        pen = grpo.overlong_penalty(torch.tensor([len(s.tokens) for s in ss]), cfg.max_new_tokens, cache,
                                    p["overlong_factor"])
        groups.append(dict(prompt=prompts[i], samples=ss, scores=scores,
                           rewards=torch.tensor([sc["reward"] for sc in scores]) + pen))
    return groups, t_roll, sum(len(s.tokens) for s in samples)


def make_batch(groups, adv, device):
    """Pack prompt + completion per sequence: ids (S, L), valid (S, L), completion index (S, T), mask (S, T)."""
    seqs = [(g["prompt"], s) for g in groups for s in g["samples"]]
    S, L = len(seqs), max(len(p) + len(s.tokens) for p, s in seqs)
    T = max(len(s.tokens) for _, s in seqs)
    ids, valid = torch.zeros(S, L, dtype=torch.long), torch.zeros(S, L, dtype=torch.bool)
    pos, mask = torch.zeros(S, T, dtype=torch.long), torch.zeros(S, T)
    eng, trunc = torch.zeros(S, T), torch.zeros(S, dtype=torch.bool)
    for i, (p, s) in enumerate(seqs):
        n = len(s.tokens)
        ids[i, :len(p) + n] = torch.tensor(p + s.tokens)
        valid[i, :len(p) + n] = True
        pos[i, :n] = torch.arange(len(p) - 1, len(p) - 1 + n)       # hidden state that predicts each token
        mask[i, :n], eng[i, :n], trunc[i] = 1.0, torch.tensor(s.logprobs), s.finish_reason == "length"
    b = dict(ids=ids, valid=valid, pos=pos, mask=mask, engine_logp=eng, truncated=trunc, adv=adv.reshape(-1).float())
    return {k: v.to(device) for k, v in b.items()}


def policy_logprobs(model, b, idx, temperature, entropy=False):
    """The policy's log-probs of the completion tokens of sequences idx: (s, T) (zeros off the mask)."""
    h = model.forward_padded(b["ids"][idx], b["valid"][idx])                  # (s, L, H)
    m = b["mask"][idx] > 0
    rows = torch.arange(len(idx), device=h.device)[:, None].expand_as(m)[m]
    hs = h[rows, b["pos"][idx][m]]                                            # (n, H)
    tgt = b["ids"][idx].gather(1, b["pos"][idx] + 1)[m]                       # (n,)
    lp, ent = M.token_logprobs(model, hs, tgt, temperature, entropy=entropy)
    out = torch.zeros(m.shape, device=h.device, dtype=lp.dtype).masked_scatter(m, lp)
    ents = torch.zeros(m.shape, device=h.device).masked_scatter(m, ent) if entropy else None
    return out, ents


# ----------------------------------------------------------------------------------------------------------------
# The loop

def rl_step(cfg, p, step, model, engine, tok, rows, stops, opt_, sched, gen_noise):
    sigma = noise.sigma_at(step, cfg.steps, cfg.sigma_start, cfg.sigma_end, cfg.aqn_stages) if cfg.aqn else 0.0
    noise.apply(model, sigma, torch.Generator().manual_seed(seeded(cfg, "aqn", step))) if sigma > 0 else noise.clear(model)
    if cfg.engine == "vllm":
        engine.set_noise(model.noise)
    t0, kept, all_groups, t_roll, n_tok = time.time(), [], [], 0.0, 0
    for round_ in range(1, p["max_sample_rounds"] + 1):                     # DAPO dynamic sampling (bounded)
        groups, tr, nt = rollout_groups(cfg, p, engine, tok, rows, step, stops, round_)
        all_groups, t_roll, n_tok = all_groups + groups, t_roll + tr, n_tok + nt
        rewards = torch.stack([g["rewards"] for g in groups])
        keep = grpo.dynamic_sampling_keep(rewards) if p["dynamic_sampling"] else torch.ones(len(groups), dtype=torch.bool)
        kept += [g for g, k in zip(groups, keep.tolist()) if k]
        done, batch, status = grpo.fill_batch(kept, cfg.prompts_per_step, round_, p["max_sample_rounds"] if p["dynamic_sampling"] else 1)
        if done:
            break
    if cfg.aqn_where == "rollout_only":
        noise.clear(model)
    if cfg.engine == "vllm":
        engine.sleep()                                                        # free its GPU memory for training
    all_r = torch.stack([g["rewards"] for g in all_groups])
    sc = [s for g in all_groups for s in g["scores"]]
    m = dict(step=step, sigma=sigma, reward=all_r.mean().item(), accuracy=sum(s["correct"] for s in sc) / len(sc),
             format_rate=sum(s["format_ok"] for s in sc) / len(sc), parse_fail=sum(s["parse_failed"] for s in sc) / len(sc),
             zero_var_frac=grpo.zero_variance_groups(all_r).float().mean().item(), rounds=round_,
             resp_len=n_tok / len(sc), rollout_tok_s=n_tok / max(t_roll, 1e-9), t_rollout=t_roll,
             t_reward=time.time() - t0 - t_roll, kept_groups=len(batch))
    if not batch:
        return m | dict(skipped=1)
    t1 = time.time()
    adv = grpo.group_advantages(torch.stack([g["rewards"] for g in batch]), p["std_normalize"])
    dev = model.model.norm.weight.device
    b = make_batch(batch, adv, dev)
    S = b["ids"].shape[0]
    if p["mask_truncated"]:
        b["mask"] = grpo.mask_truncated(b["mask"], b["truncated"])
    with torch.no_grad():                                                     # pi_old (and the reference policy)
        chunks = [torch.arange(i, min(S, i + cfg.micro_batch), device=dev) for i in range(0, S, cfg.micro_batch)]
        olds = [policy_logprobs(model, b, c, cfg.temperature, entropy=True) for c in chunks]
        b["old_logp"], ent = torch.cat([o[0] for o in olds]), torch.cat([o[1] for o in olds])
        if p["beta"] > 0:
            with lora.disabled(model):
                b["ref_logp"] = torch.cat([policy_logprobs(model, b, c, cfg.temperature)[0] for c in chunks])
    tis = grpo.resolve_tis_cap(p["tis_cap"], cfg.engine)
    g = torch.Generator().manual_seed(seeded(cfg, "shuffle", step))
    model.train()
    stats, gnorms = [], []
    for _ in range(cfg.epochs):
        for mb in torch.randperm(S, generator=g).to(dev).chunk(cfg.minibatches):
            n_tok, n_seq = b["mask"][mb].sum().item(), (b["mask"][mb].sum(1) > 0).sum().item()
            for c in mb.split(cfg.micro_batch):
                lp, _ = policy_logprobs(model, b, c, cfg.temperature)
                loss, st = grpo.policy_loss(lp, b["old_logp"][c], b["adv"][c], b["mask"][c], eps_low=p["eps_low"],
                                            eps_high=p["eps_high"], agg=p["agg"], max_len=cfg.max_new_tokens,
                                            ref_logp=b["ref_logp"][c] if p["beta"] > 0 else None, beta=p["beta"],
                                            engine_logp=b["engine_logp"][c], tis_cap=tis, num_tokens=n_tok, num_seqs=n_seq)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"the loss is {loss.item()} at step {step}")
                loss.backward()
                stats.append(st)
            gnorms.append(torch.nn.utils.clip_grad_norm_(lora.lora_parameters(model), cfg.max_grad_norm).item())
            opt_.step()
            opt_.zero_grad(set_to_none=True)
    sched.step()
    model.eval()
    avg = {k: sum(s[k] for s in stats if k in s) / max(1, sum(k in s for s in stats)) for k in stats[0]}
    mem = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
    return m | {k: v for k, v in avg.items() if k != "tokens"} | dict(
        entropy=(ent * b["mask"]).sum().item() / b["mask"].sum().item(), grad_norm=sum(gnorms) / len(gnorms),
        lr=sched.get_last_lr()[0], t_train=time.time() - t1, peak_mem_gb=mem)


def save_checkpoint(run: Path, step: int, model, opt_, sched, cfg: Config, base_model: str):
    ck = run / "checkpoints" / f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".step_{step:06d}-", dir=run / "checkpoints"))
    lora.save_adapter(model, tmp / "adapter", base_model=base_model)
    torch.save(dict(step=step, optimizer=opt_.state_dict(), scheduler=sched.state_dict(),
                    rng=dict(torch=torch.get_rng_state(), python=random.getstate())), tmp / "state.pt")
    (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    if ck.exists():
        shutil.rmtree(ck)
    tmp.rename(ck)
    (run / "checkpoints" / ".latest.tmp").write_text(ck.name)
    os.replace(run / "checkpoints" / ".latest.tmp", run / "checkpoints" / "latest")


def plot(run: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    keys = [k for k in ("reward", "accuracy", "eval_accuracy", "entropy", "resp_len", "mismatch_abs", "sigma", "kl_ref")
            if any(k in r for r in rows)]
    fig, axes = plt.subplots(2, (len(keys) + 1) // 2, figsize=(4 * ((len(keys) + 1) // 2), 6), squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.axis("off")
    for ax, k in zip(axes.flat, keys):
        ax.plot([r["step"] for r in rows if k in r], [r[k] for r in rows if k in r], marker="o" if k.startswith("eval") else None)
        ax.set_title(k)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(run / "curves.png", dpi=80)
    plt.close(fig)
    return run / "curves.png"


def main(argv=None):
    from tqdm import tqdm
    from transformers import AutoTokenizer

    import eval as evaluation

    cfg, args = parse_args(argv)
    if args.plot:
        print(f"wrote {plot(Path(args.plot))}")
        return 0
    run, start = None, 0
    if args.resume:
        run = Path(args.resume)
        if not (run / "config.json").exists():
            print(f"error: {run} is not a run folder (no config.json)", file=sys.stderr)
            return 2
        cfg = Config(**json.loads((run / "config.json").read_text()))
    try:
        p = grpo.apply_preset(cfg.algo, dataclasses.asdict(cfg))
        for name, val, allowed in (("task", cfg.task, data.TASKS), ("fmt", cfg.fmt, data.FORMATS), ("base", cfg.base, ("nvfp4", "bf16")),
                                   ("aqn_where", cfg.aqn_where, noise.WHERE), ("engine", cfg.engine, ("builtin", "vllm")),
                                   ("agg", p["agg"], grpo.AGGREGATIONS)):
            if val not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} {val!r} is not one of: {', '.join(allowed)}")
        if cfg.prompts_per_step < 1 or cfg.group_size < 2:
            raise ValueError("need --prompts-per-step >= 1 and --group-size >= 2 (advantages compare samples of a group)")
        if cfg.engine == "vllm" and importlib.util.find_spec("vllm") is None:
            raise RuntimeError(rollout.VLLM_MISSING)
        rows, stats = data.load_rows(cfg.task, cfg.data, seed=cfg.seed)
        if not rows:
            raise ValueError(f"task {cfg.task} has no usable rows ({stats})")
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    small_run = cfg.model == "tiny"  # defaults that let RL show on a tiny random model within minutes on a CPU
    for name, real, small in (("steps", 500, 40), ("lr", 1e-5, 5e-3), ("lora_rank", 32, 8), ("lora_alpha", 64.0, 16.0),
                              ("format_weight", 0.0, 0.2)):
        if getattr(cfg, name) is None:
            setattr(cfg, name, small if small_run else real)
    print("config:", json.dumps(dataclasses.asdict(cfg)))
    print("preset:", json.dumps({k: p[k] for k in grpo.PRESETS[cfg.algo]}))
    dev = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(cfg.seed)
    model_dir = str(tiny.tiny_model_dir(cfg.seed)) if cfg.model == "tiny" else cfg.model
    eval_rows = rows[-cfg.eval_limit:] if cfg.eval_task is None else data.load_rows(cfg.eval_task, limit=cfg.eval_limit)[0]
    rows = rows[:-cfg.eval_limit] if cfg.eval_task is None and len(rows) > 2 * cfg.eval_limit else rows
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = M.Model.from_pretrained(model_dir, device=dev, quantize_on_load=cfg.base == "nvfp4",
                                        dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)  # CPU: fp32 is faster
        if cfg.base == "bf16" and any(lin.words is not None for _, lin in model.linears()):
            raise ValueError(f"{model_dir} is an NVFP4 checkpoint: pass its bf16 original for --base bf16")
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except torch.cuda.OutOfMemoryError:
        print(f"error: {model_dir} does not fit on this GPU: use --base nvfp4, or a smaller model", file=sys.stderr)
        return 2
    params = lora.add_lora(model, cfg.lora_rank, cfg.lora_alpha, seed=cfg.seed)
    model.grad_checkpoint = cfg.grad_checkpoint
    opt_ = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt_, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps)))
    if run is None:
        run = Path(cfg.out or f"runs/{cfg.algo}-{time.strftime('%Y%m%d-%H%M%S')}")
        if (run / "metrics.jsonl").exists():
            print(f"error: {run} already holds a run: pass --resume {run}, or another --out", file=sys.stderr)
            return 2
        (run / "checkpoints").mkdir(parents=True, exist_ok=True)
        (run / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    elif (run / "checkpoints" / "latest").exists():
        ck = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
        lora.load_adapter(model, ck / "adapter")
        st = torch.load(ck / "state.pt", weights_only=False)
        opt_.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        torch.set_rng_state(st["rng"]["torch"])
        random.setstate(st["rng"]["python"])
        start = st["step"]
        print(f"resumed {run} at step {start} from {ck}")
    lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").exists() else []
    (run / "metrics.jsonl").write_text("".join(x + "\n" for x in lines if json.loads(x).get("step", 0) < start))
    stops = [t for t in (tok.convert_tokens_to_ids(x) for x in ("<|im_end|>", "<|endoftext|>")) if t is not None]
    max_prompt = max(len(data.prompt_token_ids(tok, r["question"], cfg.fmt)) for r in rows + eval_rows)
    if cfg.engine == "builtin":
        engine = rollout.make_engine("builtin", model, max_batch=cfg.prompts_per_step * cfg.group_size,
                                     max_len=max_prompt + cfg.max_new_tokens)
    else:  # vLLM reads a folder: the NVFP4 one the trainer's base was quantized to (written once, then reused)
        vdir = model_dir
        if cfg.base == "nvfp4" and "quantization_config" not in json.loads((quantize.resolve_model_dir(model_dir) / "config.json").read_text()):
            vdir = Path("runs/.cache") / (Path(model_dir).name + "-NVFP4")
            if not vdir.exists():
                quantize.quantize_checkpoint(model_dir, str(vdir), device=dev.type)
        engine = rollout.make_engine("vllm", model_dir=str(vdir), max_model_len=max_prompt + cfg.max_new_tokens,
                                     **({"dtype": "float32"} if dev.type == "cpu" else {}))  # the trainer's dtype
    try:
        probe = [data.prompt_token_ids(tok, r["question"], cfg.fmt) for r in eval_rows[:2]]
        writers = _writers(cfg, run)
        if start == 0:  # the baseline, before any update
            _log(run, dict(step=0, **_eval(cfg, evaluation, model, engine, tok, eval_rows, run, 0)), writers)
        bar = tqdm(range(start, cfg.steps), desc=cfg.algo, unit="step", initial=start, total=cfg.steps)
        m = {}
        for step in bar:
            gap = None
            if cfg.engine == "vllm":  # the adapter after the last update reaches vLLM; a fixed probe checks the sync
                engine.wake()
                gap = engine.sync_lora(model, probe=probe)
            try:
                m = rl_step(cfg, p, step, model, engine, tok, rows, stops, opt_, sched, None)
                if gap is not None:
                    m["lora_sync_gap"] = gap
            except FloatingPointError as e:
                print(f"\nerror: {e}; stopping. The last good checkpoint is in {run / 'checkpoints'}", file=sys.stderr)
                return 3
            except torch.cuda.OutOfMemoryError:
                print("\nerror: out of GPU memory: lower --micro-batch, --prompts-per-step, --group-size or "
                      "--max-new-tokens", file=sys.stderr)
                return 3
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                m |= _eval(cfg, evaluation, model, engine, tok, eval_rows, run, step + 1)
            _log(run, m, writers)
            bar.set_postfix_str(f"reward {m['reward']:.3f} acc {m['accuracy']:.3f} mm {m.get('mismatch_abs', 0):.4f} "
                                f"sigma {m['sigma']:.1e}")
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                save_checkpoint(run, step + 1, model, opt_, sched, cfg, model_dir)
        final = _eval(cfg, evaluation, model, engine, tok, eval_rows, run, cfg.steps)
        _log(run, dict(step=cfg.steps, **final), writers)
        plot(run)
        print(f"done: {run}  eval accuracy {first_eval(run):.3f} -> {final['eval_accuracy']:.3f} on {len(eval_rows)} held-out prompts; "
              f"curves in {run / 'curves.png'} (redraw: python train.py --plot {run})")
        return 0
    finally:
        if cfg.engine == "vllm":
            engine.close()  # vLLM keeps process-wide state: free it for the next engine


def _eval(cfg, evaluation, model, engine, tok, rows, run, step):
    """Greedy accuracy of the current policy without AQN noise (vLLM: woken, current adapter, noise cleared)."""
    noise.clear(model)
    if cfg.engine == "vllm":
        engine.wake()
        engine.set_noise(None)
        if step > 0:
            engine.sync_lora(model)
    s = evaluation.evaluate(engine, tok, rows, n=1, temperature=0.0, max_new_tokens=cfg.max_new_tokens, fmt=cfg.fmt,
                            seed=cfg.seed, out_dir=str(run / "eval" / f"step_{step:06d}"), progress=False)
    return dict(eval_accuracy=s["pass@1"], eval_parse_fail=s["parse_fail_rate"])


def first_eval(run) -> float:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return next(r["eval_accuracy"] for r in rows if "eval_accuracy" in r)


def _writers(cfg, run):
    out = []
    if cfg.tensorboard:
        from torch.utils.tensorboard import SummaryWriter
        out.append(("tb", SummaryWriter(str(run / "tb"))))
    if cfg.wandb:
        import wandb
        out.append(("wandb", wandb.init(project="nanoqerl", config=dataclasses.asdict(cfg), dir=str(run))))
    return out


def _log(run, m, writers):
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps(m) + "\n")
    for kind, w in writers:
        for k, v in m.items():
            if isinstance(v, (int, float)) and k != "step":
                w.add_scalar(k, v, m["step"]) if kind == "tb" else w.log({k: v}, step=m["step"])


if __name__ == "__main__":
    sys.exit(main())
