"""eval.py: accuracy on GSM8K / MATH-500 / AIME24 / AIME25 / AMC23 (and the synthetic task), any
model we load.

    python eval.py --model Qwen2.5-7B-Instruct-NVFP4 --task gsm8k                  # greedy pass@1
    python eval.py --model DIR --adapter runs/dapo/checkpoints/step_000100/adapter \\
        --task math500 --n 4 --temperature 0.6
    python eval.py --model runs/tiny-qwen2 --task gsm8k --limit 4 --engine builtin  # tiny, CPU
    torchrun --nproc_per_node=4 eval.py --model DIR --task math500 --num-samples 4 \\
        --temperature 0.6                                                          # 4 GPUs
    python eval.py --model models/arith-cpu          # a small model: its own task (arith_test)

Reports pass@1 (the mean over n samples per prompt) with a 95% Wilson score interval
(pass1_interval: never [1, 1] at 64/64), pass@k for k = 1, 2, 4, ... <= n (the unbiased estimator
1 - C(n-c, k) / C(n, k)), the parse-failure rate and the mean response length. Writes
`samples.jsonl` (every prompt, response, extracted answer and score) and `summary.json` to --out.
Uses the same prompts, answer extraction and fail-closed scoring as training (tasks/data.py,
tasks/rewards.py). Sample k of row j is drawn with seed --seed + j * n + k (the engines' per-sample
streams), so the results do not depend on --batch-prompts or on how many processes share the rows:
under torchrun (util/dist.py) each rank evaluates a contiguous share of the rows with the built-in
engine on its GPU, and rank 0 merges them into the same files and numbers one process writes.

--task, --max-new-tokens and --fmt left out are the model's: a folder made by pretrain.py names its
own in recipe.json's "rl" key (its held-out task), anything else gets GSM8K, 1024 and boxed. Every
value, and a writable --out, is checked before the model is loaded; a prompt that the model's
tokenizer cannot encode (GSM8K's curly quotes for a small model's ASCII tokenizer) is one line that
names the task, the tokenizer and the character.

Leaves out: majority voting, LLM judges, multiple-choice letter matching, code tasks.
"""
if __name__ == "__main__":     # run as a script: the pinned packages (pyproject.toml) are
    from util import versions  # checked before torch loads: a missing or wrong one is one line
    versions.check_or_exit()

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

import quantize
import rollout
import vllm_backend
from tasks import data, rewards
from util import dist, fsutil, recipe


def make_engine(kind: str, model=None, model_dir: str | None = None, **kw):
    """The engine a caller chose: 'builtin' (rollout.Engine over a loaded Model) or 'vllm'
    (vllm_backend/engine.VLLMEngine over a checkpoint folder). The choice lives here, above both
    engines, so neither engine module imports the other."""
    if kind == "builtin":
        return rollout.Engine(model, **kw)
    if kind == "vllm":
        try:
            from vllm_backend.engine import VLLMEngine
        except ImportError as e:                       # vLLM lives in .venv-vllm only
            raise RuntimeError(f"{vllm_backend.MISSING} ({e})") from e
        return VLLMEngine(model_dir, **kw)
    raise ValueError(f"unknown engine {kind!r}; choose builtin or vllm")


def encode_prompts(tokenizer, rows, fmt: str) -> list[list[int]]:
    """The prompt token ids of rows (data.prompt_token_ids), or a one-line ValueError naming the
    task, the tokenizer and the character for a prompt the tokenizer cannot encode."""
    out = []
    for row in rows:
        try:
            out.append(data.prompt_token_ids(tokenizer, row["question"], fmt))
        except ValueError:
            raise                                    # already one line (e.g. no chat template)
        except Exception:  # the tokenizers library raises a bare Exception for an unknown char
            raise ValueError(unencodable(tokenizer, row, fmt)) from None
    return out


def unencodable(tokenizer, row: dict, fmt: str) -> str:
    """The message for a prompt the tokenizer cannot encode, found character by character."""
    text = data.build_prompt(tokenizer, row["question"], fmt)
    bad = []
    for ch in sorted(set(text)):
        try:
            tokenizer(ch, add_special_tokens=False)
        except Exception:                            # as above: the character has no token
            bad.append(ch)
    task = row.get("task", "the task")
    folder = tokenizer.name_or_path
    try:                                             # a small model names its own tasks
        rl = (recipe.rl_defaults(folder) if Path(folder).is_dir() else None) or {}
    except ValueError:
        rl = {}
    own = [t for t in (rl.get("task"), rl.get("eval_task")) if t]
    hint = f"its own, from its recipe.json: {' / '.join(own)}" if own else "a task it was made for"
    return (f"task {task}: a prompt holds {''.join(bad)!r}, which the tokenizer of {folder} "
            f"cannot encode: this task is not one the model was made for; pass {hint}, or a model "
            "whose tokenizer covers this task")


def pass1_interval(per_prompt: list[int], n: int, z: float = 1.96) -> list[float]:
    """The 95% Wilson score interval of pass@1 from each prompt's count of correct samples out of
    n. With n = 1 the P prompts are P Bernoulli trials: Wilson's interval, which unlike the normal
    one does not collapse to [1, 1] at P/P (it gives [P / (P + z^2), 1]). With n > 1 the samples
    of a prompt are correlated, so the number of independent trials is the effective one,
    p (1 - p) / var(mean over prompts), kept within [P, P n]: P when each prompt is all right or
    all wrong, P n when its samples vary as independent draws, or when every prompt has the same
    rate (every sample right, say: no spread to measure)."""
    P = len(per_prompt)
    p = sum(per_prompt) / (P * n)
    # the variance of the mean over prompts (sample variance / P); for n = 1 it is p (1 - p) /
    # (P - 1), so the clip below gives exactly P trials
    var_mean = sum((c / n - p) ** 2 for c in per_prompt) / max(1, P - 1) / P
    trials = P * n if var_mean == 0 else min(P * n, max(P, p * (1 - p) / var_mean))
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * math.sqrt(p * (1 - p) / trials
                                                + z * z / (4 * trials * trials))
    return [max(0.0, centre - half), min(1.0, centre + half)]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct."""
    if n - c < k:               # every draw of k samples holds a correct one
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(engine, tokenizer, rows, n: int = 1, temperature: float = 0.0, top_p: float = 1.0,
             max_new_tokens: int = 1024, fmt: str = "boxed", seed: int = 0,
             batch_prompts: int = 32, out_dir: str | None = None, progress: bool = True,
             stop_ids: list[int] | None = None, ctx=dist.SINGLE) -> dict:
    """Generate n completions for each row, score them, and summarise (see the module docstring).

    stop_ids: the tokens that end a response; None: data.stop_token_ids for the folder the
    tokenizer was read from.
    ctx (util/dist.py): this rank evaluates its share of the rows; every rank returns the summary of
    all rows; rank 0 writes the files."""
    from tqdm import tqdm

    t0 = time.time()
    records = []                # one dict per sample (samples.jsonl)
    per_prompt = []             # correct samples per prompt
    lo, hi = ctx.share(len(rows))
    prompts = encode_prompts(tokenizer, rows[lo:hi], fmt)
    if stop_ids is not None:
        stops = stop_ids
    else:
        stops = data.stop_token_ids(tokenizer, tokenizer.name_or_path or None)

    # generate and score this rank's rows, batch_prompts at a time
    quiet = not (progress and ctx.main)
    with tqdm(total=hi - lo, desc="eval", unit="prompt", disable=quiet) as bar:
        for s in range(lo, hi, batch_prompts):
            chunk = rows[s:min(hi, s + batch_prompts)]
            outs = engine.generate(prompts[s - lo:s - lo + len(chunk)], n=n,
                                   max_new_tokens=max_new_tokens, temperature=temperature,
                                   top_p=top_p, stop_token_ids=stops,
                                   seed=seed + s * n)        # row j's sample k: seed + j * n + k
            for i, row in enumerate(chunk):
                mine = [o for o in outs if o.prompt_idx == i]
                correct = 0
                for o in mine:
                    text = tokenizer.decode(o.tokens, skip_special_tokens=True)
                    sc = rewards.score(text, row["gold"], row["kind"], fmt)
                    correct += sc["correct"]
                    records.append(dict(index=row.get("index", s + i),
                                        question=row["question"],
                                        gold=row["gold"],
                                        response=text,
                                        pred=sc["pred"],
                                        correct=sc["correct"],
                                        parse_failed=sc["parse_failed"],
                                        format_ok=sc["format_ok"],
                                        length=len(o.tokens),
                                        finish_reason=o.finish_reason))
                per_prompt.append(correct)
            bar.update(len(chunk))

    # every rank's records, in rank order, which is row order
    shares = ctx.gather((records, per_prompt))
    records = [x for r, _ in shares for x in r]
    per_prompt = [c for _, cs in shares for c in cs]

    P = len(per_prompt)
    ks = [k for k in (2 ** i for i in range(1, 10)) if k <= n]
    R = len(records)
    summary = {"prompts": P,
               "samples_per_prompt": n,
               "pass@1": sum(c / n for c in per_prompt) / P,
               "pass@1_ci95": pass1_interval(per_prompt, n)}
    for k in ks:
        summary[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in per_prompt) / P
    summary["parse_fail_rate"] = sum(r["parse_failed"] for r in records) / R
    summary["format_rate"] = sum(r["format_ok"] for r in records) / R
    summary["mean_length"] = sum(r["length"] for r in records) / R
    summary["truncated_rate"] = sum(r["finish_reason"] == "length" for r in records) / R
    summary["seconds"] = time.time() - t0

    # each file appears whole or not at all (a temporary beside it, then a rename)
    if out_dir and ctx.main:
        out = Path(out_dir)
        lines = "".join(json.dumps(r) + "\n" for r in records)
        fsutil.atomic_write_text(out / "samples.jsonl", lines)
        fsutil.atomic_write_text(out / "summary.json", json.dumps(summary, indent=2))
    return summary


# What --task, --max-new-tokens and --fmt are for a model whose folder names none (a real one)
REAL_DEFAULTS = dict(task="gsm8k", max_new_tokens=1024, fmt="boxed")


def model_defaults(model: str) -> dict:
    """--task, --max-new-tokens and --fmt of --model: a local folder's recipe.json "rl" key (its
    held-out task), else REAL_DEFAULTS."""
    rl = recipe.rl_defaults(model) if Path(model).is_dir() else None
    if rl is None:
        return REAL_DEFAULTS
    task = rl["eval_task"] or rl["task"]
    if task is None:
        raise ValueError(f"--model {model}: its recipe.json names no registered task (it was "
                         "pretrained with other generator knobs than those of tasks/); pass --task")
    return dict(task=task, max_new_tokens=rl["max_new_tokens"], fmt=rl["fmt"])


def check_args(args) -> None:
    """Every value in its range, and --out writable, before anything is loaded (one line each)."""
    if args.task not in data.TASKS:
        raise ValueError(f"unknown task {args.task!r}; choose one of: {', '.join(data.TASKS)}")
    for name in ("n", "max_new_tokens", "limit", "batch_prompts"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    # NaN fails every comparison: refused too
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1] (a share of the probability), got "
                         f"{args.top_p}")
    if args.fmt == "think" and data.is_generated(args.task):
        # its answers are written and checked in \boxed{} (its corpus, its checker)
        raise ValueError(f"--fmt think: task {args.task} is generated and its answers are written "
                         "and checked in \\boxed{} only, so every answer would score 0; leave "
                         "--fmt out (boxed)")
    fsutil.check_writable(args.out or Path("runs") / f"eval-{args.task}")


def main(argv=None):
    ap = argparse.ArgumentParser(description="Evaluate a model (bf16 or NVFP4, optionally with a "
                                             "LoRA adapter) on a math task.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", required=True,
                    help="HF folder or hub id, bf16 or our NVFP4 checkpoint")
    ap.add_argument("--adapter", default=None,
                    help="a LoRA adapter folder (PEFT format) to apply")
    ap.add_argument("--task", default=None,
                    help=f"one of: {', '.join(data.TASKS)}; None: the model's own (a small "
                         "model's recipe.json), else gsm8k")
    ap.add_argument("--data", default=None, help="JSONL path overriding the task's bundled file")
    ap.add_argument("--n", "--num-samples", dest="n", type=int, default=1,
                    help="samples per prompt (pass@1 is their mean; pass@k for k <= n); under "
                         "torchrun write --num-samples (torchrun reads --n as an abbreviation of "
                         "its own flags)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="tokens per response; None: the model's (recipe.json), else 1024")
    ap.add_argument("--limit", type=int, default=None,
                    help="evaluate only the first N rows; None: all")
    ap.add_argument("--fmt", default=None, choices=rewards.FORMATS,
                    help="prompt / answer format; None: the model's (recipe.json), else boxed")
    ap.add_argument("--engine", default="builtin", choices=["builtin", "vllm"],
                    help="rollout backend")
    ap.add_argument("--batch-prompts", type=int, default=32, help="prompts per generate call")
    ap.add_argument("--quantize-on-load", action="store_true",
                    help="quantize a bf16 model to NVFP4 while loading")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--out", default=None,
                    help="output folder; None: runs/eval-<task>-<time>")
    args = ap.parse_args(argv)
    try:  # the flags left out: the model's; then every value checked before any work
        for name, value in model_defaults(args.model).items():
            if getattr(args, name) is None:
                setattr(args, name, value)
        check_args(args)
    except (ValueError, quantize.QuantizeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 alone
        print("config:", json.dumps(vars(args)))

    ctx = dist.SINGLE
    try:
        rows, stats = data.load_rows(args.task, args.data, args.limit)
        ctx = dist.init(None, len(rows), "the number of rows (--limit)", args.engine)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:  # under torchrun only rank 0 prints; every rank prints its errors (stderr)
        with open(os.devnull, "w") as null:
            with contextlib.redirect_stdout(sys.stdout if ctx.main else null):
                return run_eval(args, rows, stats, ctx)
    finally:
        ctx.close()


def run_eval(args, rows, stats, ctx) -> int:
    import lora
    import model as M
    from transformers import AutoTokenizer

    stamp = ctx.gather(time.strftime("%Y%m%d-%H%M%S"))[0]  # rank 0's clock names the output folder
    engine = err = None

    # set-up: tokenizer, stop tokens and the engine; errors are collected, then shared by the ranks
    try:
        model_dir = quantize.resolve_model_dir(args.model)
        tok = AutoTokenizer.from_pretrained(model_dir)
        stops = data.stop_token_ids(tok, model_dir)  # before the model: a bad folder fails fast
        max_prompt = max(map(len, encode_prompts(tok, rows, args.fmt)))   # each prompt encodes
        batch = args.batch_prompts * args.n
        if args.engine == "builtin":
            model = M.Model.from_pretrained(args.model, device=ctx.device,
                                            quantize_on_load=args.quantize_on_load)
            if args.adapter:
                lora.load_adapter(model, args.adapter)
            engine = make_engine("builtin", model, max_batch=batch,
                                 max_len=max_prompt + args.max_new_tokens)
        else:
            engine = make_engine("vllm", model_dir=args.model,
                                 max_model_len=max_prompt + args.max_new_tokens)
            if args.adapter:
                engine.load_adapter_dir(args.adapter)
    except torch.cuda.OutOfMemoryError:
        err = RuntimeError(f"--model {args.model} does not fit on {ctx.device}: pass an NVFP4 "
                           "checkpoint (or --quantize-on-load), or a smaller model")
    except (ValueError, FileNotFoundError, RuntimeError, quantize.QuantizeError) as e:
        err = e
    err = ctx.first_error(err)  # a failure on any rank stops every rank here

    # the evaluation
    try:
        if err is not None:
            raise err
        out = args.out or f"runs/eval-{args.task}-{stamp}"
        s = evaluate(engine, tok, rows, args.n, args.temperature, args.top_p,
                     args.max_new_tokens, args.fmt, args.seed, args.batch_prompts, out,
                     stop_ids=stops, ctx=ctx)
    except (ValueError, FileNotFoundError, RuntimeError, quantize.QuantizeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if hasattr(engine, "close"):  # vLLM keeps process-wide state: free it
            engine.close()

    lo, hi = s["pass@1_ci95"]
    skipped = stats.get("skipped_no_answer", 0) + stats.get("skipped_bad_gold", 0)
    print(f"{args.task}: pass@1 {s['pass@1']:.4f} (95% CI {lo:.4f}-{hi:.4f}) over "
          f"{s['prompts']} prompts x {args.n}; parse failures {s['parse_fail_rate']:.3f}; "
          f"mean length {s['mean_length']:.1f}; rows skipped {skipped}")
    print(f"wrote {out}/samples.jsonl and {out}/summary.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
