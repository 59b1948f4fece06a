"""train.py: GRPO / DAPO / Dr.GRPO with an NVFP4 base + LoRA + AQN, on one GPU, several
(torchrun), or a CPU for the small default.

    python train.py --algo dapo                               # the built-in default (see README)
    python train.py --algo dapo --model Qwen/Qwen2.5-7B-Instruct --task gsm8k_train --steps 500 \\
        --prompts-per-step 16 --group-size 8 --max-new-tokens 1024 --lr 1e-5 --eval-task gsm8k
    python train.py --resume runs/dapo-20261122-120000        # continue exactly where it stopped
    python train.py --resume runs/dapo-20261122-120000 --steps 80   # extend a finished run
    python train.py --plot runs/dapo-20261122-120000          # redraw curves.png
    torchrun --nproc_per_node=4 train.py --algo dapo --prompts-per-step 32 ...   # 4 GPUs

One RL step (rl_step):
  1. AQN: fresh noise for the norms of this step's rollout (noise.py), passed to the engine;
  2. roll out G completions for each prompt (rollout.py) and score them with fail-closed rewards
     (tasks/rewards.py); DAPO drops groups whose answers are all right or all wrong and rolls out
     more prompts until the batch is full (sample_batch);
  3. group advantages and overlong shaping (grpo.py), and the trainer's own log-probs pi_old,
     without noise: the engine sampled from a noisy policy, and the TIS weight
     min(pi_old / pi_engine, C) corrects that, for every engine;
  4. several PPO minibatch updates of the LoRA weights with AdamW (ppo.py).
Every random draw (prompts, sampling, noise, shuffling) is derived from (seed, step) and the
prompt's index by `seeded`, so --resume replays exactly. The run folder holds config.json,
metrics.jsonl, curves.png (trainer/runlog.py) and checkpoints/ (trainer/checkpoint.py); set-up and
evaluation are in trainer/prepare.py, the flags in trainer/config.py.

Several GPUs (torchrun, util/dist.py): data parallel by whole prompt groups; --prompts-per-step
stays global. Each rank rolls out and scores its share of every round with its own engine; no draw
depends on the rank, DAPO counts kept groups over all ranks, every rank then takes the whole batch
and trains an equal share of each of one process's minibatches under global counts, and the LoRA
gradients are summed: N ranks make the one-process update. Rank 0 logs
and writes checkpoints, which any number of ranks can --resume.

Leaves out: reward models, value functions, several machines (untested).
"""
if __name__ == "__main__":     # run as a script: the pinned packages (pyproject.toml) are
    from util import versions  # checked before torch loads: a missing or wrong one is one line
    versions.check_or_exit()

import contextlib
import dataclasses
import hashlib
import json
import os
import random
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

import torch

import grpo
import lora
import noise
import ppo
from tasks import data, rewards
from trainer import checkpoint, runlog
from trainer.config import Config, Stop, apply_model_defaults, check_config, parse_args
from trainer.config import resolve_config
from trainer.prepare import evaluate, load_data, load_policy, make_engine, new_run, open_run
from trainer.prepare import choose_grad_checkpoint, prompt_length, write_run
from util import dist


def seeded(cfg, *keys) -> int:
    """A seed derived from (seed, keys), stable across processes: every draw of a step comes from
    one, so --resume replays the draws and torchrun's ranks draw what one process draws."""
    # sha256, not hash(): Python salts hash() per process. 15 hex digits: 60 bits, a valid seed
    digest = hashlib.sha256(repr((cfg.seed,) + keys).encode()).hexdigest()
    return int(digest[:15], 16)


# --------------------------------------------------------------------------------------------------
# Rollout, rewards, the training batch

def rollout_groups(cfg, p, engine, tok, rows, step, stops, round_, z, ctx=dist.SINGLE):
    """Sample prompts, generate G completions each (AQN noise z, or None), score them. Returns one
    dict per prompt group of this rank's share [lo, hi) of the round's prompts (all of them in one
    process).

    Every rank draws the whole prompt list, and sample k of prompt i comes from the engine's
    stream seed + i * G + k (rollout.py), so together the ranks draw what one process draws."""
    G = cfg.group_size
    rng = random.Random(seeded(cfg, "prompts", step, round_))
    picks = [rows[rng.randrange(len(rows))] for _ in range(cfg.prompts_per_step)]
    lo, hi = ctx.share(cfg.prompts_per_step)
    picks = picks[lo:hi]                                                 # this rank's prompts
    prompts = [data.prompt_token_ids(tok, r["question"], cfg.fmt) for r in picks]

    t0 = time.time()
    seed = seeded(cfg, "sample", step, round_) + lo * G                # prompt lo's first stream
    samples = engine.generate(prompts, n=G, max_new_tokens=cfg.max_new_tokens,
                              temperature=cfg.temperature, top_p=cfg.top_p,
                              stop_token_ids=stops, seed=seed, noise=z)
    # samples: (len(picks) * G,) group-major, sample k of prompt i at i * G + k
    t_roll = time.time() - t0

    cache = round(p["overlong_cache_frac"] * cfg.max_new_tokens)      # DAPO's soft overlong window
    groups = []
    for i, row in enumerate(picks):
        ss = samples[i * G:(i + 1) * G]
        texts = [tok.decode(s.tokens, skip_special_tokens=True) for s in ss]
        scores = [rewards.score(t, row["gold"], row["kind"], cfg.fmt, cfg.format_weight,
                                cfg.accuracy_weight) for t in texts]
        lengths = torch.tensor([len(s.tokens) for s in ss])                          # (G,)
        penalty = grpo.overlong_penalty(lengths, cfg.max_new_tokens, cache, p["overlong_factor"])
        correct = torch.tensor([float(sc["correct"]) for sc in scores])              # (G,)
        shaped = torch.tensor([sc["reward"] for sc in scores]) + penalty             # (G,)
        groups.append(dict(key=(round_, lo + i), prompt=prompts[i], samples=ss, scores=scores,
                           correct=correct, rewards=shaped))
    return groups, t_roll, sum(len(s.tokens) for s in samples)


def sample_batch(cfg, p, step, engine, tok, rows, stops, z, ctx=dist.SINGLE):
    """Roll out rounds of prompt groups until the batch is full (DAPO dynamic sampling, bounded).

    Dynamic sampling judges a group by ACCURACY, as DAPO and verl (filter_groups.metric=acc) do:
    a group whose answers are all right or all wrong is dropped, whatever its shaped reward (an
    overlong penalty on one of eight right answers must not turn the group into a signal).
    Under torchrun one all-reduce a round adds up which groups the ranks kept, so all agree on
    when the batch is full and on its groups: the first prompts_per_step kept in (round, prompt)
    order, as one process keeps them.

    Returns this rank's groups of the batch, the groups it rolled out, and info: rounds,
    t_rollout, rollout_tokens; slots (each returned group's place in the global batch) and
    batch_groups (the global batch size, 0 when no round filled it)."""
    rounds = p["max_sample_rounds"] if p["dynamic_sampling"] else 1
    kept = []           # (round, prompt index) of every kept group, on all ranks, in order
    seen = []           # every group this rank rolled out (the step's reward metrics)
    mine = {}           # (round, prompt index) -> this rank's kept group
    t_roll, n_tok = 0.0, 0
    for round_ in range(1, rounds + 1):
        groups, t, n = rollout_groups(cfg, p, engine, tok, rows, step, stops, round_, z, ctx)
        seen += groups
        t_roll += t
        n_tok += n
        correct = torch.stack([g["correct"] for g in groups])                   # (B, G)
        if p["dynamic_sampling"]:
            keep = grpo.dynamic_sampling_keep(correct)                          # (B,)
        else:
            keep = torch.ones(len(groups), dtype=torch.bool)

        flags = [0.0] * cfg.prompts_per_step           # 1.0 where the round's prompt i was kept
        for g, k in zip(groups, keep.tolist()):
            flags[g["key"][1]] = float(k)
            mine[g["key"]] = g
        kept += [(round_, i) for i, f in enumerate(ctx.sum(flags)) if f]       # all ranks' flags

        done, batch, _ = grpo.fill_batch(kept, cfg.prompts_per_step, round_, rounds)
        if done:
            ours = [(slot, mine[key]) for slot, key in enumerate(batch) if key in mine]
            info = dict(rounds=round_, t_rollout=t_roll, rollout_tokens=n_tok,
                        slots=[slot for slot, _ in ours], batch_groups=len(batch))
            return [g for _, g in ours], seen, info


def rl_step(cfg, p, step, model, engine, tok, rows, stops, opt_, ctx=dist.SINGLE) -> dict:
    """One RL step (see the module docstring). Returns the step's metrics: under torchrun, sums
    over the ranks divided by global counts (never a mean of the ranks' means), and the slowest
    rank's times."""
    # 1. AQN: fresh noise z for this step's rollout (never added to the previous step's); the
    #    trainer's pi_old and updates see it only with --aqn-where both
    sigma = noise.sigma_at(step, cfg.steps, cfg.sigma_start, cfg.sigma_end, cfg.aqn_stages)
    sigma = sigma if cfg.aqn else 0.0
    z = noise.draw(model, sigma, torch.Generator().manual_seed(seeded(cfg, "aqn", step)))
    z_train = z if cfg.aqn_where == "both" else None

    # 2. rollout and rewards
    t0 = time.time()
    batch, seen, r = sample_batch(cfg, p, step, engine, tok, rows, stops, z, ctx)
    if cfg.engine == "vllm":
        engine.sleep()                     # free its GPU memory for training
    scores = [s for g in seen for s in g["scores"]]
    all_rewards = torch.stack([g["rewards"] for g in seen])           # (B_seen, G) of this rank
    sums = dict(                            # this rank's sums; one all-reduce adds the ranks'
        samples=len(scores),
        reward=all_rewards.double().sum().item(),
        correct=sum(s["correct"] for s in scores),
        format_ok=sum(s["format_ok"] for s in scores),
        parse_failed=sum(s["parse_failed"] for s in scores),
        zero_var=grpo.zero_variance_groups(all_rewards).sum().item(),
        groups=len(seen),
        tokens=r["rollout_tokens"],
    )
    tot = dict(zip(sums, ctx.sum(list(sums.values()))))
    n = tot["samples"]
    m = dict(
        step=step,
        sigma=sigma,
        rounds=r["rounds"],
        kept_groups=r["batch_groups"],
        reward=tot["reward"] / n,
        accuracy=tot["correct"] / n,
        format_rate=tot["format_ok"] / n,
        parse_fail=tot["parse_failed"] / n,
        zero_var_frac=tot["zero_var"] / tot["groups"],
        resp_len=tot["tokens"] / n,
    )
    times = dict(t_rollout=r["t_rollout"], t_reward=time.time() - t0 - r["t_rollout"])
    if not r["batch_groups"]:              # dynamic sampling found no batch: no update
        m.update(finish_times(times, ctx, tot["tokens"]))
        m["skipped"] = 1
        return m

    # 3. advantages, and the trainer's log-probs before any update (pi_old; pi_ref when beta > 0).
    #    Under torchrun every rank takes the whole batch, to train an equal share of each
    #    minibatch (ppo.py says why)
    t1 = time.time()
    dev = model.model.norm.weight.device
    shared = ctx.world > 1
    if shared:
        batch = ppo.gather_groups(batch, r["slots"], ctx)
    b, ent_sum, n_mask = None, 0.0, 0.0
    if batch:
        shaped = torch.stack([g["rewards"] for g in batch])                     # (B, G)
        adv = grpo.group_advantages(shaped, p["std_normalize"])                 # (B, G)
        b = ppo.make_batch(batch, adv, dev)
        if p["mask_truncated"]:
            b["mask"] = grpo.mask_truncated(b["mask"], b["truncated"])
        # --old-logp reuse: the first minibatch's rows get pi_old from their training forward
        skip = (ppo.shuffled_minibatches(cfg, len(b["adv"]), seeded(cfg, "shuffle", step))[0]
                if cfg.old_logp == "reuse" else None)
        b["old_logp"], ent_sum, n_mask = ppo.batch_logprobs(                    # (S, T)
            model, b, cfg.temperature, cfg.micro_batch, z_train, ctx, shared, skip=skip)
        if p["beta"] > 0:
            with lora.disabled(model):                                          # the base policy
                b["ref_logp"] = ppo.batch_logprobs(                             # (S, T)
                    model, b, cfg.temperature, cfg.micro_batch, z_train, ctx, shared,
                    entropy=False)[0]

    # 4. the PPO updates; each sequence's global index is its group's slot x G + its sample
    G = cfg.group_size
    rows_ = None if shared else torch.tensor([s * G + k for s in r["slots"] for k in range(G)],
                                             dtype=torch.long)
    upd = ppo.ppo_update(cfg, p, step, model, b, opt_, rows_, r["batch_groups"] * G,
                         seeded(cfg, "shuffle", step), z_train, ctx)
    # the entropy of the rows that reused their training forward (--old-logp reuse)
    ent_sum, n_mask = ent_sum + upd.pop("ent_sum", 0.0), n_mask + upd.pop("ent_tokens", 0.0)
    ent_sum, n_mask = ctx.sum([ent_sum, n_mask])
    m["entropy"] = ent_sum / max(n_mask, 1.0)          # mean over all ranks' tokens
    m.update(upd)
    times["t_train"] = time.time() - t1
    if "t_allreduce" in m:
        times["t_allreduce"] = m.pop("t_allreduce")
    on_gpu = dev.type == "cuda"
    times["peak_mem_gb"] = torch.cuda.max_memory_allocated(dev) / 2**30 if on_gpu else 0.0
    m.update(finish_times(times, ctx, tot["tokens"]))
    return m


def finish_times(times: dict, ctx, tokens: float) -> dict:
    """The step's times and peak memory: the slowest rank's, which the step waits for; and the
    rollout's tokens/s over all ranks' tokens."""
    out = dict(zip(times, ctx.max(list(times.values()))))
    return dict(rollout_tok_s=tokens / max(out["t_rollout"], 1e-9), **out)


# --------------------------------------------------------------------------------------------------
# The run

def stop_on_ctrl_c() -> tuple[dict, object]:
    """Ctrl-C asks the run to stop at the end of the current step; a second Ctrl-C stops at once.

    The first interrupt only sets a flag that the loop reads between steps, so it never lands inside
    a library call (a tokenizer, a progress bar's lock, a checkpoint write), where an exception
    could leave a lock held and hang the exit. Returns the flag and the handler to put back."""
    asked = {"stop": False}

    def handler(signum, frame):
        if asked["stop"]:
            raise KeyboardInterrupt                       # the second Ctrl-C: now
        asked["stop"] = True
        # os.write, not print: a handler may run inside a print of the main thread
        os.write(2, b"\nCtrl-C: stopping after this step (Ctrl-C again to stop now)\n")

    if threading.current_thread() is not threading.main_thread():
        return asked, None                                # signals reach the main thread only
    return asked, signal.signal(signal.SIGINT, handler)


def main(argv=None):
    cfg, args, given = parse_args(argv)
    if args.plot:
        if not (Path(args.plot) / "metrics.jsonl").exists():
            print(f"error: --plot {args.plot}: no metrics.jsonl there; pass a run folder",
                  file=sys.stderr)
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
        with open(os.devnull, "w") as null:
            with contextlib.redirect_stdout(sys.stdout if ctx.main else null):
                return run_rl(cfg, p, resume, ctx)
    finally:
        ctx.close()


def run_rl(cfg: Config, p: dict, resume: Path | None, ctx) -> int:
    """Set up (every check before anything is written), evaluate, train, evaluate.
    Returns the exit code."""
    from tqdm import tqdm

    # Set-up on every rank; a failure on any rank stops all of them before the first write, so a
    # failed set-up leaves no run folder
    stamp = ctx.gather(time.strftime("%Y%m%d-%H%M%S"))[0]   # rank 0's clock names a new run
    err = engine = auto = None
    try:
        print("config:", json.dumps(dataclasses.asdict(cfg)))
        print("preset:", json.dumps({k: p[k] for k in grpo.PRESETS[cfg.algo]}))
        note = noise.schedule_note(cfg.steps, cfg.aqn_stages) if cfg.aqn else None
        if note:
            print(note)
        if ctx.world > 1:
            print(f"torchrun: {ctx.world} ranks on {ctx.device.type}, "
                  "each rolling out its share of the prompts")
        run = resume or new_run(cfg, stamp)                 # before any work: writable and free
        rows, eval_rows = load_data(cfg)
        dev = ctx.device
        torch.manual_seed(cfg.seed)
        model_dir, tok, model = load_policy(cfg, dev)
        max_prompt = prompt_length(cfg, tok, rows + eval_rows)     # every prompt encodes
        stops = data.stop_token_ids(tok, model_dir)
        params = lora.add_lora(model, cfg.lora_rank, cfg.lora_alpha, seed=cfg.seed)
        model.grad_checkpoint = cfg.grad_checkpoint
        opt_ = ppo.optimizer(cfg, params)
        start = open_run(cfg, resume, model, opt_, ctx)
        engine = make_engine(cfg, model, model_dir, dev, max_prompt + cfg.max_new_tokens, ctx)
        if cfg.grad_checkpoint is None:     # a real model: on only if the GPU has no room
            auto = choose_grad_checkpoint(cfg, model, max_prompt + cfg.max_new_tokens, dev)
    except (Stop, ValueError, FileNotFoundError, RuntimeError) as e:
        err = e
    err = ctx.first_error(err)
    if err is None and auto is not None:
        on = ctx.max([float(auto[0])])[0] > 0                # a rank without room: on for all
        cfg.grad_checkpoint = model.grad_checkpoint = on
        print(f"grad checkpoint: {auto[1] if on == auto[0] else 'on (another rank has no room)'}")
    if err is None:
        try:
            ctx.on_main(lambda: write_run(cfg, run, start, resume is not None))
        except (OSError, RuntimeError) as e:
            err = e
    if err is not None:
        if engine is not None and cfg.engine == "vllm":
            engine.close()              # vLLM keeps process-wide state: free it for the next engine
        print(f"error: {err}", file=sys.stderr)
        return getattr(err, "code", 2)

    probe = [data.prompt_token_ids(tok, r["question"], cfg.fmt) for r in eval_rows[:2]]
    writers = runlog.writers(dataclasses.asdict(cfg), run) if ctx.main else []

    def log(row):                                  # rank 0 alone writes metrics.jsonl
        if ctx.main:
            runlog.log(run, row, writers)

    step = done = start
    asked, old_handler = stop_on_ctrl_c()
    try:
        if start == 0:                             # the baseline, before any update
            log(dict(step=0, **evaluate(cfg, model, engine, tok, eval_rows, stops, run, 0, ctx)))
        bar = tqdm(range(start, cfg.steps), desc=cfg.algo, unit="step", initial=start,
                   total=cfg.steps, disable=not ctx.main)
        for step in bar:
            gap = None
            if cfg.engine == "vllm":               # the adapter after the last update reaches vLLM
                engine.wake()
                gap = engine.sync_lora(model, probe=probe)   # a probe prompt checks it arrived
            m = rl_step(cfg, p, step, model, engine, tok, rows, stops, opt_, ctx)
            if gap is not None:
                m["lora_sync_gap"] = gap
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                m.update(evaluate(cfg, model, engine, tok, eval_rows, stops, run, step + 1, ctx))
            log(m)
            bar.set_postfix_str(f"reward {m['reward']:.3f} acc {m['accuracy']:.3f} "
                                f"fmt {m['format_rate']:.2f} sigma {m['sigma']:.1e}")
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                ctx.check_same(lora.lora_parameters(model), "the LoRA adapters")
                ctx.on_main(lambda: checkpoint.save(run, step + 1, model, opt_,
                                                    dataclasses.asdict(cfg), model_dir))
            done = step + 1
            if ctx.max([float(asked["stop"])])[0] and done < cfg.steps:   # any rank's Ctrl-C
                raise KeyboardInterrupt
        final = evaluate(cfg, model, engine, tok, eval_rows, stops, run, cfg.steps, ctx)
        log(dict(step=cfg.steps, **final))
    except FloatingPointError as e:
        print(f"\nerror: {e}; stopped before it reached the weights. "
              f"{checkpoint.where(run, cfg.save_every)}", file=sys.stderr)
        return 3
    except torch.cuda.OutOfMemoryError:
        print("\nerror: out of GPU memory: lower --micro-batch, --prompts-per-step, --group-size "
              f"or --max-new-tokens. {checkpoint.where(run, cfg.save_every)}", file=sys.stderr)
        return 3
    except dist.DistError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print(f"\ninterrupted at step {done}: {checkpoint.where(run, cfg.save_every)}",
              file=sys.stderr)
        return 130
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGINT, old_handler)
        if cfg.engine == "vllm":
            engine.close()              # vLLM keeps process-wide state: free it for the next engine

    if ctx.main:
        runlog.plot(run)
        first = runlog.first_eval(run)
        print(f"done: {run}  held-out greedy accuracy {first:.3f} -> "
              f"{final['eval_accuracy']:.3f} on {len(eval_rows)} prompts "
              f"(format {final['eval_format_rate']:.2f}); curves in {run / 'curves.png'} "
              f"(redraw: python train.py --plot {shlex.quote(str(run))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
