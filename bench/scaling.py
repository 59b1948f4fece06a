"""bench/scaling.py (python -m bench dist): weak and strong scaling of one RL step over several GPUs
(torchrun), with its time split.

    python -m bench dist                             # 1, 2 and 4 GPUs (those present), weak and
                                                     # strong: one table
    python -m bench dist --gpus 1,2 --modes weak     # a part of it
    python -m bench dist --smoke                     # the same plumbing on 1 and 2 CPU processes
                                                     # (gloo, tiny model)

The step is `python -m bench train`'s: Qwen2.5-7B shapes with random weights (NVFP4 base), LoRA r32
on every linear, 256 prompt tokens, 8 samples a prompt of 512 new tokens each (EOS ignored), random
rewards, the trainer's pi_old and 2 minibatch updates in micro-batches of 8; but through train.py's
own several-GPU code: each rank rolls out its share of the prompts with its own engine, every rank
then takes the whole batch (ppo.gather_groups) and trains an equal share of each global minibatch
(ppo.ppo_update), and the LoRA gradient is summed with one all-reduce per optimizer step. --batch
own trains the earlier way instead, each rank its own groups' members of each minibatch: a random
minibatch gives one rank more of them than the other (34 against 30 of 64, and the next minibatch
the reverse), and the all-reduce waits for the larger share; the row's `members` (sequences each
rank trained in each minibatch of the last step) shows it. Each (mode, N) is one torchrun job
running this file with --worker; the parent collects what rank 0 wrote and prints the table.

Weak scaling keeps 8 prompts per GPU (8N in all): efficiency T(1) / T(N); the goal is 90% at 2 GPUs
and 85% at 4.
Strong scaling splits 16 prompts over the N GPUs: efficiency T(1) / (N T(N)).
Columns, medians over the timed steps after one warm-up step (compilation, CUDA graphs): step =
rank 0's wall time; rollout and train = the slowest rank's; all-reduce = the fastest rank's time in
the gradient all-reduce, which is the transfer (a slower rank's time there also holds its wait for
the slowest one, so train + all-reduce < step). The row's `per_rank` holds each rank's medians of
every phase: the batch (ppo.gather_groups and make_batch), pi_old (batch_logprobs), the update
without its all-reduce, and the all-reduce; the phase where one rank is slower than the others is
where the others' wait in the all-reduce comes from.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# torchrun runs this file as a script: import the stages, not bench/'s modules
if __name__ == "__main__" and Path(sys.path[0]).name == "bench":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch

from util import fsutil

ROOT = Path(__file__).resolve().parent.parent


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build(args, dev):
    """The policy: bench.common's random Qwen2.5 shape on this rank's GPU, or the built-in tiny
    model (--smoke)."""
    import model as M
    from util import tiny
    from bench.common import random_model

    if args.smoke:
        return M.Model.from_pretrained(str(tiny.tiny_model_dir(0)), device=dev, dtype=torch.float32)
    # on the current device (dist.init set it)
    return random_model(args.size, args.base == "nvfp4")


def pure_allreduce(params, ctx, reps: int = 5) -> float:
    """The gradient all-reduce alone: the flat buffer of ppo_update's all-reduce (every LoRA
    gradient and one float), summed after a barrier so no rank waits for another; the median of
    `reps` after one warm-up. In the step, a rank's all-reduce time also holds its wait for the
    slowest rank."""
    import torch.distributed as td

    if ctx.world == 1:
        return 0.0
    buf = torch.zeros(sum(q.numel() for q in params) + 1, dtype=params[0].dtype, device=ctx.device)
    out = []
    for _ in range(reps + 1):
        td.barrier()
        sync(ctx.device)
        t0 = time.perf_counter()
        td.all_reduce(buf)
        sync(ctx.device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out[1:])


def worker(args) -> int:
    """One rank of one torchrun job: args.steps RL steps; rank 0 writes the timings to args.out."""
    from util import dist
    import grpo
    import lora
    import ppo
    import rollout
    from trainer.config import Config

    world = dist.env_world()
    # global prompt groups a step
    P = args.prompts * world if args.mode == "weak" else args.strong_prompts
    G = args.group
    ctx = dist.init("cpu" if args.smoke else "cuda", P, "the prompts a step")
    dev = ctx.device
    torch.manual_seed(0)
    m = build(args, dev)
    opt_ = torch.optim.AdamW(lora.add_lora(m, args.lora_rank, 2.0 * args.lora_rank, seed=0),
                             lr=1e-5)
    m.grad_checkpoint = True
    lo, hi = ctx.share(P)
    eng = rollout.Engine(m, max_batch=(hi - lo) * G, max_len=args.prompt_len + args.new_tokens)
    cfg = Config(steps=args.steps, prompts_per_step=P, group_size=G,
                 max_new_tokens=args.new_tokens, lr=1e-5, micro_batch=8, minibatches=2)
    p = grpo.apply_preset("dapo", {})
    times = []
    for step in range(args.steps):
        sync(dev)
        t0 = time.perf_counter()
        # prompt i is the same for every N
        prompts = [torch.randint(
                       0, m.cfg.vocab_size, (args.prompt_len,),
                       generator=torch.Generator().manual_seed(step * 100_003 + i)).tolist()
                   for i in range(lo, hi)]
        samples = eng.generate(prompts, n=G, max_new_tokens=args.new_tokens, stop_token_ids=[],
                               seed=step * 1_000_003 + lo * G)
        rewards = torch.rand(P, G,
                             generator=torch.Generator().manual_seed(step))[lo:hi]  # (groups, G)
        groups = [dict(prompt=prompts[i], samples=samples[i * G:(i + 1) * G], rewards=rewards[i])
                  for i in range(hi - lo)]
        sync(dev)
        t1 = time.perf_counter()
        # train.py's way: every rank takes the whole batch and trains an equal share of each
        # minibatch; --batch own: each rank its own groups' members of each minibatch
        shared = ctx.world > 1 and args.batch == "whole"
        if shared:
            groups = ppo.gather_groups(groups, list(range(lo, hi)), ctx)
        adv = grpo.group_advantages(torch.stack([g["rewards"] for g in groups]))   # (B, G)
        b = ppo.make_batch(groups, adv, dev)
        sync(dev)
        tg = time.perf_counter()
        b["old_logp"] = ppo.batch_logprobs(m, b, 1.0, 8, ctx=ctx, shared=shared,
                                           entropy=False)[0]                         # (S, T)
        sync(dev)
        to = time.perf_counter()
        rows = None if shared else torch.arange(lo * G, hi * G)
        out = ppo.ppo_update(cfg, p, step, m, b, opt_, rows, P * G, shuffle_seed=step, ctx=ctx)
        sync(dev)
        t2 = time.perf_counter()
        members = [len(mb) for _, mb in ppo.minibatch_plan(cfg, step, rows, P * G, dev, step, ctx)]
        ar = out.get("t_allreduce", 0.0)
        times.append(dict(step=t2 - t0, rollout=t1 - t0, train=t2 - t1 - ar, allreduce=ar,
                          batch=tg - t1, old_logp=to - tg, update=t2 - to - ar))
    pure = pure_allreduce(lora.lora_parameters(m), ctx)
    timed = times[1:] or times  # the first step compiles and captures
    mean = {k: statistics.median(t[k] for t in timed) for k in timed[0]}  # medians over timed steps
    rollout_s, train_s, neg_ar = ctx.max([mean["rollout"], mean["train"], -mean["allreduce"]])
    peak = ctx.max([torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0])[0]
    members = ctx.gather(members)                          # (ranks, minibatches) of the last step
    # every rank's phases (medians): the phase where one rank is slower is where the wait starts
    per_rank = ctx.gather({k: round(v, 4) for k, v in mean.items()})
    if ctx.main:
        row = dict(mode=args.mode, gpus=world, prompts=P, sequences=P * G, step_s=mean["step"],
                   rollout_s=rollout_s, train_s=train_s, allreduce_s=-neg_ar,
                   allreduce_alone_s=pure, tokens_s=P * G * args.new_tokens / mean["step"],
                   steps_s=[t["step"] for t in timed], peak_GB=peak, batch=args.batch,
                   members=members, per_rank=per_rank,
                   device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu")
        fsutil.atomic_write_text(Path(args.out), json.dumps(row))
    # tear the group down together: a rank that left while rank 0 still wrote its row aborted
    # at exit once in about 17 two-rank CPU runs ("terminate called without an active exception")
    if ctx.world > 1:
        import torch.distributed as td
        td.barrier()
    ctx.close()
    return 0


# the per-rank phases under a row of several GPUs: (shown as, key)
PHASES = (("rollout", "rollout"), ("batch", "batch"), ("pi_old", "old_logp"),
          ("update", "update"), ("all-reduce", "allreduce"))


def table(rows) -> str:
    base = {r["mode"]: r["step_s"] for r in rows if r.get("gpus") == 1 and "step_s" in r}
    lines = [("mode    GPUs  prompts  step s  rollout s  train s  all-reduce s  alone s  tokens/s  "
              "peak GB  efficiency"),
             ("------  ----  -------  ------  ---------  -------  ------------  -------  --------  "
              "-------  ----------")]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['mode']:<6}  {r['gpus']:>4}  failed: {r['error']}")
            continue
        t1 = base.get(r["mode"])
        eff = ((t1 / r["step_s"] if r["mode"] == "weak" else t1 / (r["gpus"] * r["step_s"]))
               if t1 else float("nan"))
        lines.append(f"{r['mode']:<6}  {r['gpus']:>4}  {r['prompts']:>7}  {r['step_s']:>6.2f}  "
                     f"{r['rollout_s']:>9.2f}  {r['train_s']:>7.2f}  {r['allreduce_s']:>12.4f}  "
                     f"{r.get('allreduce_alone_s', 0):>7.4f}  {r['tokens_s']:>8.0f}  "
                     f"{r['peak_GB']:>7.1f}  {100 * eff:>9.1f}%")
        for k, ph in enumerate(r.get("per_rank", []) if r["gpus"] > 1 else []):
            lines.append(f"        rank {k}: " + "  ".join(
                f"{name} {ph[key]:.3f}" for name, key in PHASES if key in ph))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m bench dist",
        description="Weak and strong scaling of an RL step over GPUs (torchrun jobs).")
    ap.add_argument("--gpus", default="1,2,4",
                    help="GPU counts to run (those above the machine's count are skipped)")
    ap.add_argument("--modes", default="weak,strong",
                    help="weak (prompts per GPU fixed), strong (global fixed)")
    ap.add_argument("--prompts", type=int, default=8, help="weak scaling: prompt groups per GPU")
    ap.add_argument("--strong-prompts", type=int, default=16,
                    help="strong scaling: prompt groups in all")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=256, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=512,
                    help="tokens generated per sample (EOS ignored)")
    ap.add_argument("--steps", type=int, default=4,
                    help="RL steps per job; the first is a warm-up, not timed; medians of the rest")
    ap.add_argument("--size", default="7b", choices=["7b", "32b"],
                    help="the model shape (bench.common.QWEN)")
    ap.add_argument("--base", default="nvfp4", choices=["nvfp4", "bf16"], help="base weights")
    ap.add_argument("--lora-rank", type=int, default=32,
                    help="LoRA rank on every linear (alpha = 2 x rank)")
    ap.add_argument("--batch", default="whole", choices=["whole", "own"],
                    help="whole: every rank takes the batch and trains an equal share of each "
                         "minibatch (train.py's way); own: each rank trains its own groups' "
                         "members of each minibatch (the earlier way, for comparison)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU processes (gloo) and the tiny model: "
                         "checks the plumbing where there is no GPU (small shapes)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="weak", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke and not args.worker:  # small enough for 2 CPU processes
        args.prompt_len = 16
        args.new_tokens = 8
        args.prompts = 2
        args.strong_prompts = 4
        args.group = 4
        args.lora_rank, args.gpus = 8, "1,2"
    if args.worker:
        return worker(args)
    print("config:", json.dumps(vars(args)))
    have = 2 if args.smoke else torch.cuda.device_count()
    if have == 0:
        print("error: python -m bench dist needs CUDA GPUs (or --smoke: CPU processes)",
              file=sys.stderr)
        return 2
    counts = [n for n in (int(x) for x in args.gpus.split(",")) if n <= have]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            for n in counts:
                out = Path(tmp) / f"{mode}-{n}.json"
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc_per_node", str(n),
                       str(Path(__file__).resolve()), "--worker", "--mode", mode, "--out", str(out)]
                cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                        if k in ("prompts", "strong_prompts", "group", "prompt_len", "new_tokens",
                                 "steps", "size", "base", "lora_rank", "batch")]
                cmd += ["--smoke"] if args.smoke else []
                env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
                r = subprocess.run(cmd, env=env)
                rows.append(json.loads(out.read_text()) if r.returncode == 0 and out.exists() else
                            dict(mode=mode, gpus=n,
                                 error=f"torchrun exited {r.returncode} (its output is above)"))
                print(json.dumps(rows[-1]))
    print(table(rows))
    if args.json:
        fsutil.atomic_write_text(Path(args.json), json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
