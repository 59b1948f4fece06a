"""train.py: GRPO / DAPO / Dr.GRPO with an NVFP4 base + LoRA + AQN, on one GPU (or a CPU for the small default).

    python train.py --algo dapo                                  # built-in default (see README)
    python train.py --algo dapo --model Qwen/Qwen2.5-7B-Instruct --task gsm8k_train --steps 500 \\
        --prompts-per-step 16 --group-size 8 --max-new-tokens 1024 --lr 1e-5 --eval-task gsm8k
    python train.py --resume runs/dapo-20261122-120000          # continue exactly where it stopped
    python train.py --resume runs/dapo-20261122-120000 --steps 80   # extend a finished run
    python train.py --plot runs/dapo-20261122-120000            # redraw curves.png
    torchrun --nproc_per_node=4 train.py --algo dapo --prompts-per-step 32 ...   # 4 GPUs (see "Several GPUs")

One RL step:
  1. sample prompts, roll out G completions each with AQN noise in the engine's norms (rollout.py);
  2. score them with fail-closed rewards (data.py); DAPO drops groups that are all right or all wrong
     and rolls out more prompts until the batch is full;
  3. group advantages and overlong shaping (grpo.py);
  4. the trainer's own log-probs pi_old, without noise (the engine sampled from a noisy policy: the TIS
     weight min(pi_old / pi_engine, C) corrects that, for every engine);
  5. several PPO minibatch updates of the LoRA weights (AdamW), then the next AQN sigma (noise.py).
Every random draw (prompts, sampling, noise, shuffling) is derived from (seed, step) and the prompt's index, so
--resume replays exactly. The run folder holds config.json, metrics.jsonl, curves.png and checkpoints/ (checkpoint.py).

Several GPUs (torchrun, dist.py): data parallel by whole prompt groups; --prompts-per-step stays global. Each rank
rolls out and scores its share of every round with its own engine; no draw depends on the rank, DAPO counts kept
groups over all ranks, the minibatches are one process's, under global counts, and the gradients are summed: N ranks
make the one-process update (sample_batch, ppo_update). Rank 0 logs and writes checkpoints (any N can --resume them).

Leaves out: reward models, value functions, several machines (untested), rebalancing DAPO's kept groups across ranks.
"""
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import versions

versions.check()
import torch  # noqa: E402

import checkpoint  # noqa: E402
import data  # noqa: E402
import dist  # noqa: E402
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

def rollout_groups(cfg, p, engine, tok, rows, step, stops, round_, ctx=dist.SINGLE):
    """Sample prompts, generate G completions each, score them. Returns one dict per prompt group of this rank's
    share [lo, hi) of the round's prompts (all of them in one process). Every rank draws the whole prompt list, and
    sample k of prompt i comes from the engine's stream seed + i * G + k (rollout.py), so together the ranks draw
    exactly what one process draws."""
    rng = random.Random(seeded(cfg, "prompts", step, round_))
    picks = [rows[rng.randrange(len(rows))] for _ in range(cfg.prompts_per_step)]
    lo, hi = ctx.share(cfg.prompts_per_step)
    picks = picks[lo:hi]
    prompts = [data.prompt_token_ids(tok, r["question"], cfg.fmt) for r in picks]
    t0 = time.time()
    samples = engine.generate(prompts, n=cfg.group_size, max_new_tokens=cfg.max_new_tokens,
                              temperature=cfg.temperature, top_p=cfg.top_p, stop_token_ids=stops,
                              seed=seeded(cfg, "sample", step, round_) + lo * cfg.group_size)
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
        groups.append(dict(key=(round_, lo + i), prompt=prompts[i], samples=ss, scores=scores,
                           correct=torch.tensor([float(sc["correct"]) for sc in scores]),  # (G,)
                           rewards=torch.tensor([sc["reward"] for sc in scores]) + pen))   # (G,)
    return groups, t_roll, sum(len(s.tokens) for s in samples)


def sample_batch(cfg, p, step, engine, tok, rows, stops, ctx=dist.SINGLE):
    """Roll out rounds of prompt groups until the batch is full (DAPO dynamic sampling, bounded).

    Dynamic sampling judges a group by ACCURACY, as DAPO and verl (filter_groups.metric=acc) do: a
    group whose answers are all right or all wrong is dropped, whatever its shaped reward (an overlong
    penalty on one of eight right answers must not turn the group into a learning signal).
    Under torchrun one all-reduce a round adds up which groups the ranks kept, so all agree on when the batch is full
    and on its groups: the first prompts_per_step kept in (round, prompt) order, as one process keeps them. Returns
    this rank's groups of the batch, the groups it rolled out, and info (rounds, t_rollout, rollout_tokens; slots:
    each returned group's place in the global batch; batch_groups: the global batch size)."""
    rounds = p["max_sample_rounds"] if p["dynamic_sampling"] else 1
    kept, seen, mine, t_roll, n_tok = [], [], {}, 0.0, 0
    for round_ in range(1, rounds + 1):
        groups, t, n = rollout_groups(cfg, p, engine, tok, rows, step, stops, round_, ctx)
        seen, t_roll, n_tok = seen + groups, t_roll + t, n_tok + n
        if p["dynamic_sampling"]:
            keep = grpo.dynamic_sampling_keep(torch.stack([g["correct"] for g in groups]))  # (B,)
        else:
            keep = torch.ones(len(groups), dtype=torch.bool)
        flags = [0.0] * cfg.prompts_per_step                      # 1 where the round's prompt i was kept
        for g, k in zip(groups, keep.tolist()):
            flags[g["key"][1]], mine[g["key"]] = float(k), g
        kept += [(round_, i) for i, f in enumerate(ctx.sum(flags)) if f]
        done, batch, _ = grpo.fill_batch(kept, cfg.prompts_per_step, round_, rounds)
        if done:
            ours = [(slot, mine[key]) for slot, key in enumerate(batch) if key in mine]
            return [g for _, g in ours], seen, dict(rounds=round_, t_rollout=t_roll, rollout_tokens=n_tok,
                                                    slots=[s for s, _ in ours], batch_groups=len(batch))


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


def ppo_update(cfg, p, step, model, b, opt_, rows, S, ctx=dist.SINGLE) -> dict:
    """epochs x minibatches AdamW steps on the LoRA weights. Raises FloatingPointError before any
    optimizer step whose loss or gradient norm is not finite, so no NaN reaches the weights.

    b: this rank's sequences (None: none), rows (s,): their indices in the global batch of S sequences (all of it in
    one process). Shuffle and minibatch split are over the global indices, as in one process; each rank runs its
    members of every minibatch under the minibatch's GLOBAL token and sequence counts, and the ranks' gradients are
    summed before each optimizer step, so every rank makes the one-process update."""
    dev = model.model.norm.weight.device
    where = torch.full((S,), -1, dtype=torch.long)                    # global index -> this rank's row (-1: not ours)
    where[rows] = torch.arange(len(rows))
    per_step = cfg.epochs * cfg.minibatches
    total = cfg.steps * per_step
    tis = grpo.resolve_tis_cap(p["tis_cap"])
    g = torch.Generator().manual_seed(seeded(cfg, "shuffle", step))
    plan = []                                                         # (optimizer step index, our rows of it)
    for epoch in range(cfg.epochs):
        order = torch.randperm(S, generator=g)
        for j, mb in enumerate(order.chunk(cfg.minibatches)):
            ours = where[mb]
            plan.append((step * per_step + epoch * cfg.minibatches + j, ours[ours >= 0].to(dev)))
    local = [(b["mask"][mb].sum().item(), (b["mask"][mb].sum(1) > 0).sum().item()) if len(mb) else (0.0, 0.0)
             for _, mb in plan]
    counts = ctx.sum([x for pair in local for x in pair])             # global counts of every minibatch, one reduce
    params = lora.lora_parameters(model)
    stats, gnorms, t_allreduce = [], [], 0.0
    model.train()
    for k, (i, mb) in enumerate(plan):
        for group in opt_.param_groups:
            group["lr"] = cfg.lr * lr_factor(i, total, cfg.warmup_steps, cfg.lr_schedule)
        n_tok, n_seq = counts[2 * k], counts[2 * k + 1]
        if n_tok == 0:                                                # all masked on every rank: adds nothing
            continue
        parts, bad = [], 0.0
        for c in mb.split(cfg.micro_batch) if len(mb) else ():         # this rank's members of the minibatch
            if b["mask"][c].sum() == 0:                               # all masked: adds nothing
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
                bad = loss.item()
                break
            loss.backward()
            parts.append(st)
        bad, secs = ctx.sum_grads(params, bad)                        # the one-process gradient on every rank
        t_allreduce += secs
        if not math.isfinite(bad):
            raise FloatingPointError(f"the loss is {bad} at step {step}")
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm).item()
        if not math.isfinite(gnorm):
            raise FloatingPointError(f"the gradient norm is {gnorm} at step {step}")
        opt_.step()
        opt_.zero_grad(set_to_none=True)
        stats.append(parts)
        gnorms.append(gnorm)
    model.eval()
    if not stats:
        return {}
    ranks = ctx.gather(stats)                                         # every rank's micro-batch metrics
    stats = [merge_stats([st for r in ranks for st in r[j]]) for j in range(len(stats))]
    out = {k: sum(s[k] for s in stats) / len(stats) for k in stats[0] if not k.endswith("_max")}
    out |= {k: max(s[k] for s in stats) for k in stats[0] if k.endswith("_max")}
    out["grad_norm"] = sum(gnorms) / len(gnorms)
    out["lr"] = opt_.param_groups[0]["lr"]
    if ctx.world > 1:
        out["t_allreduce"] = t_allreduce
    return out


def rl_step(cfg, p, step, model, engine, tok, rows, stops, opt_, ctx=dist.SINGLE) -> dict:
    """One RL step (see the module docstring). Returns the step's metrics: under torchrun, sums over the ranks
    divided by global counts (never a mean of the ranks' means), and the slowest rank's times."""
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
    batch, seen, r = sample_batch(cfg, p, step, engine, tok, rows, stops, ctx)
    if cfg.aqn_where == "rollout_only":
        noise.clear(model)                 # the trainer's pi_old and updates are clean
    if cfg.engine == "vllm":
        engine.sleep()                     # free its GPU memory for training
    scores = [s for g in seen for s in g["scores"]]
    all_rewards = torch.stack([g["rewards"] for g in seen])                        # (B_seen, G) of this rank
    n, reward, correct, fmt, fail, zero_var, groups, tokens = ctx.sum([
        len(scores), all_rewards.double().sum().item(), sum(s["correct"] for s in scores),
        sum(s["format_ok"] for s in scores), sum(s["parse_failed"] for s in scores),
        grpo.zero_variance_groups(all_rewards).sum().item(), len(seen), r["rollout_tokens"]])
    m = dict(step=step, sigma=sigma, rounds=r["rounds"], kept_groups=r["batch_groups"])
    m |= dict(reward=reward / n, accuracy=correct / n, format_rate=fmt / n, parse_fail=fail / n,
              zero_var_frac=zero_var / groups, resp_len=tokens / n)
    times = dict(t_rollout=r["t_rollout"], t_reward=time.time() - t0 - r["t_rollout"])
    if not r["batch_groups"]:
        return m | finish_times(times, ctx, tokens) | dict(skipped=1)

    # 3. advantages, and the trainer's log-probs before any update (pi_old; pi_ref when beta > 0)
    t1 = time.time()
    dev = model.model.norm.weight.device
    b, ent_sum, n_mask = None, 0.0, 0.0
    if batch:  # this rank's groups of the batch (under torchrun a rank may have none)
        adv = grpo.group_advantages(torch.stack([g["rewards"] for g in batch]), p["std_normalize"])
        b = make_batch(batch, adv, dev)
        if p["mask_truncated"]:
            b["mask"] = grpo.mask_truncated(b["mask"], b["truncated"])
        S = b["ids"].shape[0]
        chunks = [torch.arange(i, min(S, i + cfg.micro_batch), device=dev) for i in range(0, S, cfg.micro_batch)]
        with torch.no_grad():
            olds = [policy_logprobs(model, b, c, cfg.temperature, entropy=True) for c in chunks]
            b["old_logp"] = torch.cat([o[0] for o in olds])                       # (S, T)
            ent = torch.cat([o[1] for o in olds])                                 # (S, T)
            if p["beta"] > 0:
                with lora.disabled(model):
                    refs = [policy_logprobs(model, b, c, cfg.temperature)[0] for c in chunks]
                b["ref_logp"] = torch.cat(refs)
        ent_sum, n_mask = (ent * b["mask"]).sum().item(), b["mask"].sum().item()
    ent_sum, n_mask = ctx.sum([ent_sum, n_mask])
    m["entropy"] = ent_sum / max(n_mask, 1.0)

    # 4. the PPO updates (each sequence's index in the global batch: its group's slot x G + its sample)
    G = cfg.group_size
    rows_ = torch.tensor([s * G + k for s in r["slots"] for k in range(G)], dtype=torch.long)
    m |= ppo_update(cfg, p, step, model, b, opt_, rows_, r["batch_groups"] * G, ctx)
    times["t_train"] = time.time() - t1
    if "t_allreduce" in m:
        times["t_allreduce"] = m.pop("t_allreduce")
    times["peak_mem_gb"] = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0
    return m | finish_times(times, ctx, tokens)


def finish_times(times: dict, ctx, tokens: float) -> dict:
    """The step's times (and peak memory): the slowest rank's, which the step waits for; rollout tokens/s over them."""
    out = dict(zip(times, ctx.max(list(times.values()))))
    return dict(rollout_tok_s=tokens / max(out["t_rollout"], 1e-9), **out)


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


def make_engine(cfg: Config, model, model_dir: str, dev, max_len: int, ctx=dist.SINGLE):
    if cfg.engine == "builtin":  # room for the largest rank's share of a round's prompts
        return rollout.make_engine("builtin", model, max_len=max_len,
                                   max_batch=-(-cfg.prompts_per_step // ctx.world) * cfg.group_size)
    # vLLM reads a folder: the NVFP4 one the trainer's base was quantized to (written once, reused)
    vdir = model_dir
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if cfg.base == "nvfp4" and "quantization_config" not in raw:
        vdir = Path("runs/.cache") / (Path(model_dir).name + "-NVFP4")
        if not vdir.exists():
            quantize.quantize_checkpoint(model_dir, str(vdir), device=dev.type)
    kw = {"dtype": "float32"} if dev.type == "cpu" else {}  # the trainer's dtype
    return rollout.make_engine("vllm", model_dir=str(vdir), max_model_len=max_len, **kw)


def evaluate(cfg, model, engine, tok, rows, stops, run, step, ctx=dist.SINGLE) -> dict:
    """Greedy accuracy of the current policy without AQN noise (vLLM: woken, adapter synced). Under torchrun the
    rows are split over the ranks and rank 0 writes the merged samples (eval.evaluate)."""
    import eval as evaluation

    noise.clear(model)
    if cfg.engine == "vllm":
        engine.wake()
        engine.set_noise(None)
        if step > 0:
            engine.sync_lora(model)
    s = evaluation.evaluate(engine, tok, rows, n=1, temperature=0.0, max_new_tokens=cfg.max_new_tokens,
                            fmt=cfg.fmt, seed=cfg.seed, stop_ids=stops, progress=False,
                            out_dir=str(run / "eval" / f"step_{step:06d}"), ctx=ctx)
    return dict(eval_accuracy=s["pass@1"], eval_parse_fail=s["parse_fail_rate"],
                eval_format_rate=s["format_rate"])


# ----------------------------------------------------------------------------------------------------
# The run

def open_run(cfg: Config, resume: Path | None, model, opt_, stamp: str, ctx=dist.SINGLE) -> tuple[Path, int]:
    """The run folder and its first step: a new one (checked here, made by write_run), or a resumed run's latest
    checkpoint loaded into the model and optimizer (by every rank). Writes nothing, except that rank 0 removes what
    an interrupted checkpoint write left behind."""
    if resume is None:
        run = Path(cfg.out or f"runs/{cfg.algo}-{stamp}")
        if (run / "metrics.jsonl").exists():
            raise Stop(f"{run} already holds a run: pass --resume {run}, or another --out")
        return run, 0
    if ctx.main:
        for stale in checkpoint.clean_stale(resume):
            print(f"removed {stale}, left by an interrupted checkpoint write")
    try:
        start = checkpoint.load(resume, model, opt_)
    except checkpoint.CheckpointError as e:
        raise Stop(str(e)) from None
    if start >= cfg.steps:
        raise Stop(f"{resume} already finished its {start} steps: pass --steps N with N > {start} to "
                   "extend it")
    return resume, start


def write_run(cfg: Config, run: Path, start: int, resumed: bool):
    """Rank 0's first writes, once every rank's set-up worked: a new run folder with its config.json, or a resumed
    run's config.json and its metrics cut back to the checkpoint's step (the steps after it are replayed)."""
    if not resumed:
        checkpoint.folder(run).mkdir(parents=True, exist_ok=True)
    fsutil.atomic_write_text(run / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
    if resumed:
        runlog.truncate(run, start)
        print(f"resumed {run} at step {start} of {cfg.steps}")


def main(argv=None):
    cfg, args, given = parse_args(argv)
    if args.plot:
        if not (Path(args.plot) / "metrics.jsonl").exists():
            print(f"error: --plot {args.plot}: no metrics.jsonl there; pass a run folder", file=sys.stderr)
            return 2
        print(f"wrote {runlog.plot(Path(args.plot))}")
        return 0
    try:
        cfg, resume = resolve_config(cfg, args, given)
        apply_model_defaults(cfg)
        p = check_config(cfg)
        ctx = dist.init(cfg.device, cfg.prompts_per_step, "--prompts-per-step", cfg.engine)
    except (Stop, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "code", 2)
    try:  # under torchrun only rank 0 prints progress; every rank prints its errors (stderr)
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(sys.stdout if ctx.main else null):
            return run_rl(cfg, p, resume, ctx)
    finally:
        ctx.close()


def run_rl(cfg: Config, p: dict, resume: Path | None, ctx) -> int:
    """Set up (every check before anything is written), evaluate, train, evaluate. Returns the exit code."""
    from tqdm import tqdm

    stamp = ctx.gather(time.strftime("%Y%m%d-%H%M%S"))[0]  # rank 0's clock names a new run folder for all ranks
    err = None
    try:
        print("config:", json.dumps(dataclasses.asdict(cfg)))
        print("preset:", json.dumps({k: p[k] for k in grpo.PRESETS[cfg.algo]}))
        note = noise.schedule_note(cfg.steps, cfg.aqn_stages) if cfg.aqn else None
        if note:
            print(note)
        if ctx.world > 1:
            print(f"torchrun: {ctx.world} ranks on {ctx.device.type}, each rolling out its share of the prompts")
        rows, eval_rows = load_data(cfg)
        dev = ctx.device
        torch.manual_seed(cfg.seed)
        model_dir, tok, model = load_policy(cfg, dev)
        stops = data.stop_token_ids(tok, model_dir)
        params = lora.add_lora(model, cfg.lora_rank, cfg.lora_alpha, seed=cfg.seed)
        model.grad_checkpoint = cfg.grad_checkpoint
        opt_ = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        run, start = open_run(cfg, resume, model, opt_, stamp, ctx)
    except (Stop, ValueError, FileNotFoundError, RuntimeError) as e:
        err = e
    err = ctx.first_error(err)  # a failure on any rank stops every rank here, before the first write
    if err is None:
        try:
            ctx.on_main(lambda: write_run(cfg, run, start, resume is not None))
        except (OSError, RuntimeError) as e:
            err = e
    if err is not None:
        print(f"error: {err}", file=sys.stderr)
        return getattr(err, "code", 2)
    max_prompt = max(len(data.prompt_token_ids(tok, r["question"], cfg.fmt)) for r in rows + eval_rows)
    engine = make_engine(cfg, model, model_dir, dev, max_prompt + cfg.max_new_tokens, ctx)
    probe = [data.prompt_token_ids(tok, r["question"], cfg.fmt) for r in eval_rows[:2]]
    writers = runlog.writers(dataclasses.asdict(cfg), run) if ctx.main else []
    log = (lambda row: runlog.log(run, row, writers)) if ctx.main else (lambda row: None)  # rank 0 alone logs
    step = start
    try:
        if start == 0:  # the baseline, before any update
            log(dict(step=0, **evaluate(cfg, model, engine, tok, eval_rows, stops, run, 0, ctx)))
        bar = tqdm(range(start, cfg.steps), desc=cfg.algo, unit="step", initial=start, total=cfg.steps,
                   disable=not ctx.main)
        for step in bar:
            gap = None
            if cfg.engine == "vllm":  # the adapter after the last update reaches vLLM; a probe checks it
                engine.wake()
                gap = engine.sync_lora(model, probe=probe)
            m = rl_step(cfg, p, step, model, engine, tok, rows, stops, opt_, ctx)
            if gap is not None:
                m["lora_sync_gap"] = gap
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                m |= evaluate(cfg, model, engine, tok, eval_rows, stops, run, step + 1, ctx)
            log(m)
            bar.set_postfix_str(f"reward {m['reward']:.3f} acc {m['accuracy']:.3f} "
                                f"fmt {m['format_rate']:.2f} sigma {m['sigma']:.1e}")
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                ctx.check_same(lora.lora_parameters(model), "the LoRA adapters")
                ctx.on_main(lambda: checkpoint.save(run, step + 1, model, opt_, dataclasses.asdict(cfg), model_dir))
        final = evaluate(cfg, model, engine, tok, eval_rows, stops, run, cfg.steps, ctx)
        log(dict(step=cfg.steps, **final))
    except FloatingPointError as e:
        print(f"\nerror: {e}; stopped before it reached the weights. "
              f"{checkpoint.where(run, cfg.save_every)}", file=sys.stderr)
        return 3
    except torch.cuda.OutOfMemoryError:
        print("\nerror: out of GPU memory: lower --micro-batch, --prompts-per-step, --group-size or "
              f"--max-new-tokens. {checkpoint.where(run, cfg.save_every)}", file=sys.stderr)
        return 3
    except dist.DistError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print(f"\ninterrupted at step {step}: {checkpoint.where(run, cfg.save_every)}", file=sys.stderr)
        return 130
    finally:
        if cfg.engine == "vllm":
            engine.close()  # vLLM keeps process-wide state: free it for the next engine
    if ctx.main:
        runlog.plot(run)
        first = runlog.first_eval(run)
        print(f"done: {run}  held-out greedy accuracy {first:.3f} -> {final['eval_accuracy']:.3f} on "
              f"{len(eval_rows)} prompts (format {final['eval_format_rate']:.2f}); curves in "
              f"{run / 'curves.png'} (redraw: python train.py --plot {run})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
