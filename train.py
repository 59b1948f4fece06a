"""train.py: GRPO / DAPO / Dr.GRPO with an NVFP4 base + LoRA + AQN, on one GPU (or a CPU for the small default).

    python train.py --algo dapo                                  # built-in default (see README)
    python train.py --algo dapo --model Qwen/Qwen2.5-7B-Instruct --task gsm8k_train --steps 500 \\
        --prompts-per-step 16 --group-size 8 --max-new-tokens 1024 --lr 1e-5 --eval-task gsm8k
    python train.py --resume runs/dapo-20261122-120000          # continue exactly where it stopped
    python train.py --resume runs/dapo-20261122-120000 --steps 80   # extend a finished run
    python train.py --plot runs/dapo-20261122-120000            # redraw curves.png

One RL step:
  1. sample prompts, roll out G completions each with AQN noise in the engine's norms (rollout.py);
  2. score them with fail-closed rewards (data.py); DAPO drops groups that are all right or all wrong
     and rolls out more prompts until the batch is full;
  3. group advantages and overlong shaping (grpo.py);
  4. the trainer's own log-probs pi_old, without noise (the engine sampled from a noisy policy: the TIS
     weight min(pi_old / pi_engine, C) corrects that, for every engine);
  5. several PPO minibatch updates of the LoRA weights (AdamW), then the next AQN sigma (noise.py).
Every random draw (prompts, sampling, noise, shuffling) is derived from (seed, step), so --resume replays
exactly. The run folder holds config.json, metrics.jsonl, curves.png and checkpoints/ (checkpoint.py).

Leaves out: multi-GPU, reward models, value functions.
"""
import dataclasses
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path

import versions

versions.check()
import torch  # noqa: E402

import checkpoint  # noqa: E402
import data  # noqa: E402
import fsutil  # noqa: E402
import grpo  # noqa: E402
import lora  # noqa: E402
import model as M  # noqa: E402
import noise  # noqa: E402
import quantize  # noqa: E402
import rollout  # noqa: E402
import runlog  # noqa: E402
import tiny  # noqa: E402
from train_config import (Config, Stop, apply_model_defaults, check_config, parse_args,  # noqa: E402
                          resolve_config)


def seeded(cfg: Config, *keys) -> int:
    """A seed derived from (seed, keys), stable across processes (so --resume replays the same draws)."""
    return int(hashlib.sha256(repr((cfg.seed,) + keys).encode()).hexdigest()[:15], 16)


def lr_factor(i: int, total: int, warmup: int, schedule: str) -> float:
    """Multiplier of the peak learning rate at optimizer step i of `total` (0-based).

    Warm-up i / warmup, then constant 1, linear (total - i) / (total - warmup), or cosine
    0.5 * (1 + cos(pi * progress)): transformers' get_*_schedule_with_warmup, which TRL uses."""
    if i < warmup:
        return i / max(1, warmup)
    if schedule == "constant":
        return 1.0
    progress = (i - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


# ----------------------------------------------------------------------------------------------------
# Rollout, rewards, the training batch

def rollout_groups(cfg, p, engine, tok, rows, step, stops, round_):
    """Sample prompts, generate G completions each, score them. Returns one dict per prompt group."""
    rng = random.Random(seeded(cfg, "prompts", step, round_))
    picks = [rows[rng.randrange(len(rows))] for _ in range(cfg.prompts_per_step)]
    prompts = [data.prompt_token_ids(tok, r["question"], cfg.fmt) for r in picks]
    t0 = time.time()
    samples = engine.generate(prompts, n=cfg.group_size, max_new_tokens=cfg.max_new_tokens,
                              temperature=cfg.temperature, top_p=cfg.top_p, stop_token_ids=stops,
                              seed=seeded(cfg, "sample", step, round_))
    t_roll = time.time() - t0
    cache = round(p["overlong_cache_frac"] * cfg.max_new_tokens)
    groups = []
    for i, row in enumerate(picks):
        ss = samples[i * cfg.group_size:(i + 1) * cfg.group_size]
        texts = [tok.decode(s.tokens, skip_special_tokens=True) for s in ss]
        scores = [data.score(t, row["gold"], row["kind"], cfg.fmt, cfg.format_weight,
                             cfg.accuracy_weight) for t in texts]
        lengths = torch.tensor([len(s.tokens) for s in ss])                   # (G,)
        pen = grpo.overlong_penalty(lengths, cfg.max_new_tokens, cache, p["overlong_factor"])
        groups.append(dict(prompt=prompts[i], samples=ss, scores=scores,
                           correct=torch.tensor([float(sc["correct"]) for sc in scores]),  # (G,)
                           rewards=torch.tensor([sc["reward"] for sc in scores]) + pen))   # (G,)
    return groups, t_roll, sum(len(s.tokens) for s in samples)


def sample_batch(cfg, p, step, engine, tok, rows, stops):
    """Roll out rounds of prompt groups until the batch is full (DAPO dynamic sampling, bounded).

    Dynamic sampling judges a group by ACCURACY, as DAPO and verl (filter_groups.metric=acc) do: a
    group whose answers are all right or all wrong is dropped, whatever its shaped reward (an overlong
    penalty on one of eight right answers must not turn the group into a learning signal)."""
    rounds = p["max_sample_rounds"] if p["dynamic_sampling"] else 1
    kept, seen, t_roll, n_tok = [], [], 0.0, 0
    for round_ in range(1, rounds + 1):
        groups, t, n = rollout_groups(cfg, p, engine, tok, rows, step, stops, round_)
        seen, t_roll, n_tok = seen + groups, t_roll + t, n_tok + n
        if p["dynamic_sampling"]:
            keep = grpo.dynamic_sampling_keep(torch.stack([g["correct"] for g in groups]))  # (B,)
        else:
            keep = torch.ones(len(groups), dtype=torch.bool)
        kept += [g for g, k in zip(groups, keep.tolist()) if k]
        done, batch, _ = grpo.fill_batch(kept, cfg.prompts_per_step, round_, rounds)
        if done:
            return batch, seen, dict(rounds=round_, t_rollout=t_roll, rollout_tokens=n_tok)


def make_batch(groups, adv, device):
    """Pack prompt + completion per sequence: ids (S, L), valid (S, L), pos (S, T), mask (S, T)."""
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
        pos[i, :n] = torch.arange(len(p) - 1, len(p) - 1 + n)  # the hidden state that predicts each token
        mask[i, :n] = 1.0
        eng[i, :n] = torch.tensor(s.logprobs)                  # the sampling engine's log-probs
        trunc[i] = s.finish_reason == "length"
    b = dict(ids=ids, valid=valid, pos=pos, mask=mask, engine_logp=eng, truncated=trunc,
             adv=adv.reshape(-1).float())
    return {k: v.to(device) for k, v in b.items()}


def policy_logprobs(model, b, idx, temperature, entropy=False):
    """The policy's log-probs of the completion tokens of sequences idx: (s, T), zeros off the mask."""
    h = model.forward_padded(b["ids"][idx], b["valid"][idx])                  # (s, L, H)
    m = b["mask"][idx] > 0                                                    # (s, T)
    rows = torch.arange(len(idx), device=h.device)[:, None].expand_as(m)[m]   # (n,)
    hs = h[rows, b["pos"][idx][m]]                                            # (n, H)
    tgt = b["ids"][idx].gather(1, b["pos"][idx] + 1)[m]                       # (n,)
    lp, ent = M.token_logprobs(model, hs, tgt, temperature, entropy=entropy)  # (n,), (n,)
    out = torch.zeros(m.shape, device=h.device, dtype=lp.dtype).masked_scatter(m, lp)
    ents = torch.zeros(m.shape, device=h.device).masked_scatter(m, ent) if entropy else None
    return out, ents


# ----------------------------------------------------------------------------------------------------
# The update

def merge_stats(parts: list[dict]) -> dict:
    """One minibatch's metrics from its micro-batches': the loss is their sum (each was normalised by
    the minibatch's global counts), maxima take the max, token means are weighted by tokens."""
    tokens = sum(s["tokens"] for s in parts)
    out = {"loss": sum(s["loss"] for s in parts)}
    for k in parts[0]:
        if k in ("loss", "tokens"):
            continue
        if k.endswith("_max"):
            out[k] = max(s[k] for s in parts)
        else:
            out[k] = sum(s[k] * s["tokens"] for s in parts) / max(tokens, 1.0)
    return out


def ppo_update(cfg, p, step, model, b, opt_) -> dict:
    """epochs x minibatches AdamW steps on the LoRA weights. Raises FloatingPointError before any
    optimizer step whose loss or gradient norm is not finite, so no NaN reaches the weights."""
    S, dev = b["ids"].shape[0], b["ids"].device
    per_step = cfg.epochs * cfg.minibatches
    total = cfg.steps * per_step
    tis = grpo.resolve_tis_cap(p["tis_cap"])
    g = torch.Generator().manual_seed(seeded(cfg, "shuffle", step))
    stats, gnorms = [], []
    model.train()
    for epoch in range(cfg.epochs):
        order = torch.randperm(S, generator=g).to(dev)
        for j, mb in enumerate(order.chunk(cfg.minibatches)):
            i = step * per_step + epoch * cfg.minibatches + j         # this optimizer step's index
            for group in opt_.param_groups:
                group["lr"] = cfg.lr * lr_factor(i, total, cfg.warmup_steps, cfg.lr_schedule)
            n_tok = b["mask"][mb].sum().item()                        # global counts of the minibatch
            n_seq = (b["mask"][mb].sum(1) > 0).sum().item()
            parts = []
            for c in mb.split(cfg.micro_batch):
                if b["mask"][c].sum() == 0:                           # all masked: adds nothing
                    continue
                lp, _ = policy_logprobs(model, b, c, cfg.temperature)
                loss, st = grpo.policy_loss(
                    lp, b["old_logp"][c], b["adv"][c], b["mask"][c],
                    eps_low=p["eps_low"], eps_high=p["eps_high"], agg=p["agg"],
                    max_len=cfg.max_new_tokens, beta=p["beta"],
                    ref_logp=b["ref_logp"][c] if p["beta"] > 0 else None,
                    engine_logp=b["engine_logp"][c], tis_cap=tis,
                    num_tokens=n_tok, num_seqs=n_seq)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"the loss is {loss.item()} at step {step}")
                loss.backward()
                parts.append(st)
            if not parts:
                continue
            params = lora.lora_parameters(model)
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm).item()
            if not math.isfinite(gnorm):
                raise FloatingPointError(f"the gradient norm is {gnorm} at step {step}")
            opt_.step()
            opt_.zero_grad(set_to_none=True)
            stats.append(merge_stats(parts))
            gnorms.append(gnorm)
    model.eval()
    if not stats:
        return {}
    out = {k: sum(s[k] for s in stats) / len(stats) for k in stats[0] if not k.endswith("_max")}
    out |= {k: max(s[k] for s in stats) for k in stats[0] if k.endswith("_max")}
    out["grad_norm"] = sum(gnorms) / len(gnorms)
    out["lr"] = opt_.param_groups[0]["lr"]
    return out


def rl_step(cfg, p, step, model, engine, tok, rows, stops, opt_) -> dict:
    """One RL step (see the module docstring). Returns the step's metrics."""
    # 1. AQN: fresh noise for this step's rollout (never added to the previous step's)
    sigma = noise.sigma_at(step, cfg.steps, cfg.sigma_start, cfg.sigma_end, cfg.aqn_stages)
    sigma = sigma if cfg.aqn else 0.0
    if sigma > 0:
        noise.apply(model, sigma, torch.Generator().manual_seed(seeded(cfg, "aqn", step)))
    else:
        noise.clear(model)
    if cfg.engine == "vllm":
        engine.set_noise(model.noise)

    # 2. rollout and rewards
    t0 = time.time()
    batch, seen, r = sample_batch(cfg, p, step, engine, tok, rows, stops)
    if cfg.aqn_where == "rollout_only":
        noise.clear(model)                 # the trainer's pi_old and updates are clean
    if cfg.engine == "vllm":
        engine.sleep()                     # free its GPU memory for training
    scores = [s for g in seen for s in g["scores"]]
    all_rewards = torch.stack([g["rewards"] for g in seen])                        # (B_seen, G)
    m = dict(step=step, sigma=sigma, rounds=r["rounds"], kept_groups=len(batch))
    m["reward"] = all_rewards.mean().item()
    m["accuracy"] = sum(s["correct"] for s in scores) / len(scores)
    m["format_rate"] = sum(s["format_ok"] for s in scores) / len(scores)
    m["parse_fail"] = sum(s["parse_failed"] for s in scores) / len(scores)
    m["zero_var_frac"] = grpo.zero_variance_groups(all_rewards).float().mean().item()
    m["resp_len"] = r["rollout_tokens"] / len(scores)
    m["rollout_tok_s"] = r["rollout_tokens"] / max(r["t_rollout"], 1e-9)
    m["t_rollout"] = r["t_rollout"]
    m["t_reward"] = time.time() - t0 - r["t_rollout"]
    if not batch:
        return m | dict(skipped=1)

    # 3. advantages, and the trainer's log-probs before any update (pi_old; pi_ref when beta > 0)
    t1 = time.time()
    adv = grpo.group_advantages(torch.stack([g["rewards"] for g in batch]), p["std_normalize"])
    b = make_batch(batch, adv, model.model.norm.weight.device)
    if p["mask_truncated"]:
        b["mask"] = grpo.mask_truncated(b["mask"], b["truncated"])
    S = b["ids"].shape[0]
    chunks = [torch.arange(i, min(S, i + cfg.micro_batch), device=b["ids"].device)
              for i in range(0, S, cfg.micro_batch)]
    with torch.no_grad():
        olds = [policy_logprobs(model, b, c, cfg.temperature, entropy=True) for c in chunks]
        b["old_logp"] = torch.cat([o[0] for o in olds])                           # (S, T)
        ent = torch.cat([o[1] for o in olds])                                     # (S, T)
        if p["beta"] > 0:
            with lora.disabled(model):
                refs = [policy_logprobs(model, b, c, cfg.temperature)[0] for c in chunks]
            b["ref_logp"] = torch.cat(refs)
    m["entropy"] = (ent * b["mask"]).sum().item() / max(b["mask"].sum().item(), 1.0)

    # 4. the PPO updates
    m |= ppo_update(cfg, p, step, model, b, opt_)
    m["t_train"] = time.time() - t1
    dev = b["ids"].device
    m["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
    return m


# ----------------------------------------------------------------------------------------------------
# Set-up: every check runs before anything is written

def load_data(cfg: Config) -> tuple[list, list]:
    """Training rows and held-out evaluation rows, which never share a row."""
    rows, stats = data.load_rows(cfg.task, cfg.data, seed=cfg.seed)
    skipped = [f"{v} {k[len('skipped_'):].replace('_', ' ')}" for k, v in stats.items()
               if k.startswith("skipped_") and v]                  # e.g. "3 bad gold"
    print(f"data: {stats['rows']} usable rows of {stats['read']} read from {stats['source']}"
          + (f"; skipped: {', '.join(skipped)}" if skipped else ""))
    if cfg.eval_task is not None and (cfg.eval_task != cfg.task or cfg.data is not None):
        eval_rows = data.load_rows(cfg.eval_task, limit=cfg.eval_limit)[0]
        print(f"eval: {len(eval_rows)} rows of {cfg.eval_task}")
        return rows, eval_rows
    if len(rows) < 2 * cfg.eval_limit:
        raise Stop(f"task {cfg.task} has {len(rows)} rows, fewer than 2 x --eval-limit "
                   f"({cfg.eval_limit}) needed to hold some out for evaluation: lower --eval-limit, "
                   "or pass --eval-task")
    print(f"eval: the last {cfg.eval_limit} of the {len(rows)} shuffled rows are held out "
          "(never trained on)")
    return rows[:-cfg.eval_limit], rows[-cfg.eval_limit:]


def load_policy(cfg: Config, dev: torch.device):
    """(model folder, tokenizer, model) with one-line errors for folders that cannot be used."""
    from transformers import AutoTokenizer

    folder = tiny.tiny_model_dir(cfg.seed) if cfg.model == "tiny" else cfg.model
    try:
        local = quantize.resolve_model_dir(str(folder))  # a hub id is downloaded here
        json.loads((local / "config.json").read_text())
        tok = AutoTokenizer.from_pretrained(local)
        model = M.Model.from_pretrained(str(local), device=dev, quantize_on_load=cfg.base == "nvfp4",
                                        dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    except quantize.QuantizeError as e:
        raise Stop(str(e)) from None
    except FileNotFoundError as e:
        raise Stop(f"--model {folder}: {e.filename or e} is missing; pass a complete HF folder") from None
    except json.JSONDecodeError as e:
        raise Stop(f"--model {folder}: config.json is not valid JSON ({e}); re-download it") from None
    except torch.cuda.OutOfMemoryError:
        raise Stop(f"--model {folder} does not fit on this GPU: use --base nvfp4, or a smaller "
                   "model") from None
    if cfg.base == "bf16" and any(lin.words is not None for _, lin in model.linears()):
        raise Stop(f"{folder} is an NVFP4 checkpoint: pass its bf16 original for --base bf16")
    return str(local), tok, model


def make_engine(cfg: Config, model, model_dir: str, dev, max_len: int):
    if cfg.engine == "builtin":
        return rollout.make_engine("builtin", model, max_len=max_len,
                                   max_batch=cfg.prompts_per_step * cfg.group_size)
    # vLLM reads a folder: the NVFP4 one the trainer's base was quantized to (written once, reused)
    vdir = model_dir
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if cfg.base == "nvfp4" and "quantization_config" not in raw:
        vdir = Path("runs/.cache") / (Path(model_dir).name + "-NVFP4")
        if not vdir.exists():
            quantize.quantize_checkpoint(model_dir, str(vdir), device=dev.type)
    kw = {"dtype": "float32"} if dev.type == "cpu" else {}  # the trainer's dtype
    return rollout.make_engine("vllm", model_dir=str(vdir), max_model_len=max_len, **kw)


def evaluate(cfg, model, engine, tok, rows, stops, run, step) -> dict:
    """Greedy accuracy of the current policy without AQN noise (vLLM: woken, adapter synced)."""
    import eval as evaluation

    noise.clear(model)
    if cfg.engine == "vllm":
        engine.wake()
        engine.set_noise(None)
        if step > 0:
            engine.sync_lora(model)
    s = evaluation.evaluate(engine, tok, rows, n=1, temperature=0.0, max_new_tokens=cfg.max_new_tokens,
                            fmt=cfg.fmt, seed=cfg.seed, stop_ids=stops, progress=False,
                            out_dir=str(run / "eval" / f"step_{step:06d}"))
    return dict(eval_accuracy=s["pass@1"], eval_parse_fail=s["parse_fail_rate"],
                eval_format_rate=s["format_rate"])


# ----------------------------------------------------------------------------------------------------
# The run

def start_run(cfg: Config, run: Path | None, model, opt_) -> tuple[Path, int]:
    """Make a new run folder, or restore a resumed run's latest checkpoint. Returns (run, first step)."""
    if run is None:
        run = Path(cfg.out or f"runs/{cfg.algo}-{time.strftime('%Y%m%d-%H%M%S')}")
        if (run / "metrics.jsonl").exists():
            raise Stop(f"{run} already holds a run: pass --resume {run}, or another --out")
        checkpoint.folder(run).mkdir(parents=True, exist_ok=True)
        fsutil.atomic_write_text(run / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
        return run, 0
    for stale in checkpoint.clean_stale(run):
        print(f"removed {stale}, left by an interrupted checkpoint write")
    try:
        start = checkpoint.load(run, model, opt_)
    except checkpoint.CheckpointError as e:
        raise Stop(str(e)) from None
    if start >= cfg.steps:
        raise Stop(f"{run} already finished its {start} steps: pass --steps N with N > {start} to "
                   "extend it")
    fsutil.atomic_write_text(run / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
    runlog.truncate(run, start)
    print(f"resumed {run} at step {start} of {cfg.steps}")
    return run, start


def main(argv=None):
    from tqdm import tqdm

    cfg, args, given = parse_args(argv)
    if args.plot:
        if not (Path(args.plot) / "metrics.jsonl").exists():
            print(f"error: --plot {args.plot}: no metrics.jsonl there; pass a run folder", file=sys.stderr)
            return 2
        print(f"wrote {runlog.plot(Path(args.plot))}")
        return 0
    try:
        cfg, run = resolve_config(cfg, args, given)
        apply_model_defaults(cfg)
        p = check_config(cfg)
        print("config:", json.dumps(dataclasses.asdict(cfg)))
        print("preset:", json.dumps({k: p[k] for k in grpo.PRESETS[cfg.algo]}))
        note = noise.schedule_note(cfg.steps, cfg.aqn_stages) if cfg.aqn else None
        if note:
            print(note)
        rows, eval_rows = load_data(cfg)
        dev = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch.manual_seed(cfg.seed)
        model_dir, tok, model = load_policy(cfg, dev)
        stops = data.stop_token_ids(tok, model_dir)
        params = lora.add_lora(model, cfg.lora_rank, cfg.lora_alpha, seed=cfg.seed)
        model.grad_checkpoint = cfg.grad_checkpoint
        opt_ = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        run, start = start_run(cfg, run, model, opt_)
    except (Stop, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "code", 2)
    max_prompt = max(len(data.prompt_token_ids(tok, r["question"], cfg.fmt)) for r in rows + eval_rows)
    engine = make_engine(cfg, model, model_dir, dev, max_prompt + cfg.max_new_tokens)
    probe = [data.prompt_token_ids(tok, r["question"], cfg.fmt) for r in eval_rows[:2]]
    writers = runlog.writers(dataclasses.asdict(cfg), run)
    step = start
    try:
        if start == 0:  # the baseline, before any update
            base = evaluate(cfg, model, engine, tok, eval_rows, stops, run, 0)
            runlog.log(run, dict(step=0, **base), writers)
        bar = tqdm(range(start, cfg.steps), desc=cfg.algo, unit="step", initial=start, total=cfg.steps)
        for step in bar:
            gap = None
            if cfg.engine == "vllm":  # the adapter after the last update reaches vLLM; a probe checks it
                engine.wake()
                gap = engine.sync_lora(model, probe=probe)
            m = rl_step(cfg, p, step, model, engine, tok, rows, stops, opt_)
            if gap is not None:
                m["lora_sync_gap"] = gap
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                m |= evaluate(cfg, model, engine, tok, eval_rows, stops, run, step + 1)
            runlog.log(run, m, writers)
            bar.set_postfix_str(f"reward {m['reward']:.3f} acc {m['accuracy']:.3f} "
                                f"fmt {m['format_rate']:.2f} sigma {m['sigma']:.1e}")
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                checkpoint.save(run, step + 1, model, opt_, dataclasses.asdict(cfg), model_dir)
        final = evaluate(cfg, model, engine, tok, eval_rows, stops, run, cfg.steps)
        runlog.log(run, dict(step=cfg.steps, **final), writers)
    except FloatingPointError as e:
        print(f"\nerror: {e}; stopped before it reached the weights. "
              f"{checkpoint.where(run, cfg.save_every)}", file=sys.stderr)
        return 3
    except torch.cuda.OutOfMemoryError:
        print("\nerror: out of GPU memory: lower --micro-batch, --prompts-per-step, --group-size or "
              f"--max-new-tokens. {checkpoint.where(run, cfg.save_every)}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print(f"\ninterrupted at step {step}: {checkpoint.where(run, cfg.save_every)}", file=sys.stderr)
        return 130
    finally:
        if cfg.engine == "vllm":
            engine.close()  # vLLM keeps process-wide state: free it for the next engine
    runlog.plot(run)
    first = runlog.first_eval(run)
    print(f"done: {run}  held-out greedy accuracy {first:.3f} -> {final['eval_accuracy']:.3f} on "
          f"{len(eval_rows)} prompts (format {final['eval_format_rate']:.2f}); curves in "
          f"{run / 'curves.png'} (redraw: python train.py --plot {run})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
