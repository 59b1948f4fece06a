"""pilot.py: does a model and task give the QeRL ablation a regime where exploration can matter?
The gate of issue "a testbed where exploration decides the outcome", measured on any model folder.

    # the static gate on one GPU (a few minutes): entropy, NVFP4 and AQN against bf16, coverage
    python experiments/pilot.py --model runs/countdown --task countdown_test --out pilot.json
    # with the RL gate: the reward curve of bf16 + LoRA runs of train.py (e.g. the ablation's)
    python experiments/pilot.py --model runs/countdown --task countdown_test --out pilot.json \\
        --static-from pilot.json --runs runs/ablation/runs/bf16-lr0.0003-s0
    # CPU smoke (tests/test_pilot.py)
    python experiments/pilot.py --model tiny --task synthetic --prompts 4 --samples 4 --out p.json

What it measures, each fixed before any run (temperature 1, top-p 1, the built-in engine):
- coverage: `--samples` completions of each of `--prompts` held-out prompts from the bf16 policy and
  from the NVFP4 one (the same folder quantized while loading, as train.py --base nvfp4 does):
  pass@1 (the mean accuracy) and pass@k for k = 1, 2, 4, ..., samples (eval.py's unbiased
  estimator), the format rate and the response length;
- entropy: the mean token entropy of each policy over its own first `--kl-samples` completions of
  each prompt (what train.py logs as `entropy`, before any update);
- perturbation: on the bf16 policy's own samples (the same first `--kl-samples` a prompt), at every
  sampled position, the full-vocabulary KL(p_bf16 || p_q) and whether the top token changes, where
  q is NVFP4, NVFP4 + AQN and bf16 + AQN at each of `--sigmas` (one noise draw each, as one RL
  step draws it);
- the RL gate (with --runs): each run's training reward (metrics.jsonl, `reward`) averaged over
  steps [100, 150) and [250, 300), and its mean accuracy over steps [280, 300).
The gate (README, "Does quantization noise help?"): entropy >= 0.1 nats a token; NVFP4 KL >= 1e-3
a token (aimed for; reported either way); 0.05 <= pass@1 <= 0.4 and pass@64 >= 2 pass@1 (bf16);
bf16 reward rising from [100, 150) to [250, 300) and accuracy below 0.9 at step 300.
Leaves out: vLLM, several GPUs, any training (train.py and experiments/qerl_ablation.py do that).
"""
if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the stages, from anywhere
    from util import versions
    versions.check_or_exit()

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

import eval as evaluation
import noise
import ppo
import rollout
from tasks import data, rewards
from trainer import prepare
from trainer.config import Config
from util import fsutil

GATES = dict(entropy_min=0.1, kl_aim=1e-3, pass1_lo=0.05, pass1_hi=0.4, coverage_ratio=2.0,
             acc_max_at_300=0.9)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", required=True, help="HF folder of the bf16 model (or 'tiny')")
    ap.add_argument("--task", required=True, help=f"held-out task, one of {', '.join(data.TASKS)}")
    ap.add_argument("--out", required=True, help="JSON file to write (atomically)")
    ap.add_argument("--prompts", type=int, default=512, help="held-out prompts")
    ap.add_argument("--samples", type=int, default=64, help="completions a prompt for pass@k")
    ap.add_argument("--kl-samples", type=int, default=8,
                    help="of those, completions a prompt for the entropy and the KL")
    ap.add_argument("--sigmas", default="1e-2,1e-1,3e-1",
                    help="AQN sigmas measured on both bases, comma list")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="completion length limit")
    ap.add_argument("--runs", nargs="*", default=[],
                    help="train.py run folders of the bf16 + LoRA arm, for the RL gate")
    ap.add_argument("--static-from", default=None,
                    help="a pilot JSON of the same model and task: take its sampling, entropy "
                         "and perturbation numbers instead of measuring them again")
    ap.add_argument("--seed", type=int, default=0, help="sampling and noise seed")
    ap.add_argument("--batch", type=int, default=1024, help="sequences the engine decodes at once")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    args = ap.parse_args(argv)
    for name in ("prompts", "samples", "kl_samples", "max_new_tokens", "batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.kl_samples > args.samples:
        ap.error("--kl-samples must be <= --samples (they are the first of them)")
    try:
        args.sigmas = [float(s) for s in args.sigmas.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--sigmas {args.sigmas!r}: expected a comma list of numbers")
    if any(s <= 0 for s in args.sigmas):
        ap.error("--sigmas must be > 0")
    if args.task not in data.TASKS:
        ap.error(f"--task {args.task!r} is not one of: {', '.join(data.TASKS)}")
    return args


# --------------------------------------------------------------------------------------------------
# Sampling and scoring

def sample(model, tok, rows, prompts, stops, args, dev) -> dict:
    """`samples` completions of every prompt, scored: their Samples (group-major) and the coverage
    numbers."""
    n = args.samples
    max_len = max(map(len, prompts)) + args.max_new_tokens
    engine = rollout.Engine(model, max_batch=min(args.batch, len(prompts) * n), max_len=max_len)
    out = []
    step = max(1, args.batch // n)                       # prompts a generate call
    for i in range(0, len(prompts), step):
        out += engine.generate(prompts[i:i + step], n=n, max_new_tokens=args.max_new_tokens,
                               temperature=1.0, top_p=1.0, stop_token_ids=stops,
                               seed=args.seed + i * n)
    correct = []                                         # (prompts, n) bools
    formatted = 0
    length = 0
    for j, row in enumerate(rows):
        group = out[j * n:(j + 1) * n]
        texts = [tok.decode(s.tokens, skip_special_tokens=True) for s in group]
        scores = [rewards.score(t, row["gold"], row["kind"]) for t in texts]
        correct.append([s["correct"] for s in scores])
        formatted += sum(s["format_ok"] for s in scores)
        length += sum(len(s.tokens) for s in group)
    ks = [k for k in (2 ** e for e in range(20)) if k <= n]
    pass_at = {f"pass@{k}": sum(evaluation.pass_at_k(n, sum(c), k) for c in correct) / len(rows)
               for k in ks}
    total = len(rows) * n
    return dict(samples=out, coverage=dict(pass_at, format_rate=formatted / total,
                                           resp_len=length / total,
                                           solved_any=sum(any(c) for c in correct) / len(rows)))


def own_batch(samples, prompts, args, dev) -> dict:
    """The first kl_samples completions of every prompt, packed as train.py packs a batch."""
    n, m = args.samples, args.kl_samples
    groups = [dict(prompt=p, samples=samples[i * n:i * n + m]) for i, p in enumerate(prompts)]
    return ppo.make_batch(groups, torch.zeros(len(prompts), m), dev)


# --------------------------------------------------------------------------------------------------
# Entropy and perturbation on a batch of sampled completions

@torch.no_grad()
def token_dists(model, b, chunk: int, noise_z=None):
    """Per chunk of sequences: log-probs over the vocabulary at every completion position,
    (tokens, V) fp32, in the mask's order."""
    S = b["ids"].shape[0]
    for c in torch.arange(S, device=b["ids"].device).split(chunk):
        h = model.forward_padded(b["ids"][c], b["valid"][c], noise=noise_z)        # (s, L, H)
        m = b["mask"][c] > 0                                                          # (s, T)
        rows = torch.arange(len(c), device=h.device)[:, None].expand_as(m)[m]        # (n,)
        hs = h[rows, b["pos"][c][m]]                                                  # (n, H)
        yield torch.log_softmax(model.logits(hs).float(), -1)                        # (n, V)


def entropy(model, b, chunk: int) -> float:
    """Mean token entropy of the model at its sampled positions (nats a token)."""
    total = count = 0.0
    for lp in token_dists(model, b, chunk):
        total += -(lp.exp() * lp).sum().item()
        count += lp.shape[0]
    return total / max(count, 1.0)


def perturbation(ref, other, b, chunk: int, z=None) -> dict:
    """KL(ref || other) a token, the fraction of positions whose top token differs, and the mean
    |log p| change of the sampled token, over the completion positions of b."""
    kl = flips = dlp = count = 0.0
    tgt = b["ids"].gather(1, b["pos"] + 1)[b["mask"] > 0]                              # (N,)
    pairs = zip(token_dists(ref, b, chunk), token_dists(other, b, chunk, z))
    for lp, lq in pairs:
        t = tgt[int(count):int(count) + lp.shape[0]]
        kl += (lp.exp() * (lp - lq)).sum().item()
        flips += (lp.argmax(-1) != lq.argmax(-1)).sum().item()
        dlp += (lp.gather(1, t[:, None]) - lq.gather(1, t[:, None])).abs().sum().item()
        count += lp.shape[0]
    n = max(count, 1.0)
    return dict(kl=kl / n, top_changed=flips / n, abs_dlogp=dlp / n, tokens=int(count))


# --------------------------------------------------------------------------------------------------
# The RL gate

def reward_curve(run: Path) -> dict | None:
    """A run's training reward and accuracy windows (steps [100, 150), [250, 300), [280, 300))."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    steps = {r["step"]: r for r in rows if "reward" in r}

    def values(key, lo, hi):       # a step that dynamic sampling skipped logs no entropy
        return [steps[s][key] for s in range(lo, hi) if key in steps.get(s, {})]

    def mean(key, lo, hi):
        vals = values(key, lo, hi)
        return sum(vals) / len(vals) if vals else math.nan

    def se(key, lo, hi):
        vals = values(key, lo, hi)
        if len(vals) < 2:
            return math.nan
        mu = sum(vals) / len(vals)
        return math.sqrt(sum((v - mu) ** 2 for v in vals) / (len(vals) - 1) / len(vals))

    out = dict(run=str(run), steps=len(steps),
               reward_100_150=mean("reward", 100, 150), reward_250_300=mean("reward", 250, 300),
               se_100_150=se("reward", 100, 150), se_250_300=se("reward", 250, 300),
               accuracy_280_300=mean("accuracy", 280, 300),
               entropy_0_10=mean("entropy", 0, 10), entropy_280_300=mean("entropy", 280, 300))
    rise = out["reward_250_300"] - out["reward_100_150"]
    out["rising"] = rise > 2 * math.hypot(out["se_100_150"], out["se_250_300"])
    return out


def verdicts(res: dict) -> dict:
    """Each gate: the measured value, the rule and pass / fail."""
    bf16 = res["bases"]["bf16"]
    p1 = bf16["coverage"]["pass@1"]
    k = max(int(key[5:]) for key in bf16["coverage"] if key.startswith("pass@") and
            int(key[5:]) <= 64)                          # 64, or fewer samples than that
    pk = bf16["coverage"][f"pass@{k}"]
    out = dict(
        entropy=dict(value=bf16["entropy"], rule=">= 0.1 nats a token",
                     ok=bf16["entropy"] >= GATES["entropy_min"]),
        nvfp4_kl=dict(value=res["perturbation"]["nvfp4"]["kl"], rule=">= 1e-3 a token (aimed for)",
                      ok=res["perturbation"]["nvfp4"]["kl"] >= GATES["kl_aim"]),
        pass1=dict(value=p1, rule="0.05 <= pass@1 <= 0.4",
                   ok=GATES["pass1_lo"] <= p1 <= GATES["pass1_hi"]),
        coverage=dict(value=pk / max(p1, 1e-12), rule=f"pass@{k} >= 2 pass@1 (pass@64 aimed)",
                      ok=k == 64 and pk >= GATES["coverage_ratio"] * p1))
    curves = [c for c in res["runs"] if c]
    if curves:
        # the run with the best late reward (the learning rate the arm would be compared at)
        best = max(curves, key=lambda c: c["reward_250_300"])
        out["rl_rising"] = dict(value=best["reward_250_300"] - best["reward_100_150"],
                                run=best["run"],
                                rule="at the best run (highest reward over steps 250-299), reward "
                                     "over steps 250-299 above 100-149 by > 2 s.e.",
                                ok=best["rising"])
        out["rl_headroom"] = dict(value=[c["accuracy_280_300"] for c in curves],
                                  rule="accuracy over steps 280-299 < 0.9 in every run",
                                  ok=all(c["accuracy_280_300"] < GATES["acc_max_at_300"]
                                         for c in curves))
    return out


# --------------------------------------------------------------------------------------------------
# The run

def write(res: dict, args, t0: float) -> int:
    res["gates"] = verdicts(res)
    # the measuring time (an RL gate added to an earlier pilot's numbers keeps that pilot's)
    res.setdefault("seconds", time.time() - t0)
    fsutil.atomic_write_text(Path(args.out), json.dumps(res, indent=1))
    for name, g in res["gates"].items():
        print(f"{'PASS' if g['ok'] else 'FAIL'}  {name}: {g['value']}  ({g['rule']})")
    print(f"wrote {args.out} in {res['seconds']:.0f} s")
    return 0


def with_runs(args, t0: float) -> int:
    """The RL gate on top of an earlier pilot's static numbers (the same model and task)."""
    try:
        res = json.loads(Path(args.static_from).read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"error: --static-from {args.static_from}: {e}", file=sys.stderr)
        return 2
    same = res["config"]["model"] == args.model and res["config"]["task"] == args.task
    if not same:
        print(f"error: --static-from {args.static_from} measured {res['config']['model']} on "
              f"{res['config']['task']}, not {args.model} on {args.task}", file=sys.stderr)
        return 2
    res["runs"] = [reward_curve(Path(r)) for r in args.runs]
    return write(res, args, t0)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    if args.static_from:
        return with_runs(args, t0)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print("config:", json.dumps(vars(args)))
    cfg = Config(model=args.model, base="bf16", seed=args.seed)
    try:
        model_dir, tok, bf16 = prepare.load_policy(cfg, dev)
        nvfp4 = prepare.load_policy(Config(model=args.model, base="nvfp4", seed=args.seed), dev)[2]
        rows, _ = data.load_rows(args.task, limit=args.prompts)
        prompts = [data.prompt_token_ids(tok, r["question"]) for r in rows]
        stops = data.stop_token_ids(tok, model_dir)
    except Exception as e:                               # a bad folder or task: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    chunk = 256 if dev.type == "cuda" else 16
    res = dict(config=vars(args), prompts=len(rows), bases={}, perturbation={}, runs=[])
    batches = {}
    for name, model in (("bf16", bf16), ("nvfp4", nvfp4)):
        s = sample(model, tok, rows, prompts, stops, args, dev)
        batches[name] = own_batch(s["samples"], prompts, args, dev)
        res["bases"][name] = dict(coverage=s["coverage"], entropy=entropy(model, batches[name],
                                                                          chunk))
        print(f"{name}: {json.dumps(res['bases'][name])}")

    # every perturbation on the bf16 policy's own samples
    b = batches["bf16"]
    gen = torch.Generator().manual_seed(args.seed)
    res["perturbation"]["nvfp4"] = perturbation(bf16, nvfp4, b, chunk)
    for sigma in args.sigmas:
        z = noise.draw(bf16, sigma, gen)
        res["perturbation"][f"bf16_aqn_{sigma:g}"] = perturbation(bf16, bf16, b, chunk, z)
        res["perturbation"][f"nvfp4_aqn_{sigma:g}"] = perturbation(bf16, nvfp4, b, chunk, z)
    for name, p in res["perturbation"].items():
        print(f"KL(bf16 || {name}) = {p['kl']:.3g} a token; top token changed at "
              f"{p['top_changed']:.4f} of {p['tokens']} positions")

    res["runs"] = [reward_curve(Path(r)) for r in args.runs]
    res["device"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return write(res, args, t0)


if __name__ == "__main__":
    sys.exit(main())
