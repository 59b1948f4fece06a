"""prepare.py: what train.py does before and around its RL steps: load the data and the policy,
build the rollout engine, evaluate on the held-out rows, and open (or resume) the run folder.

    python train.py --algo dapo        # runs these functions; this file has no command of its own

Every check raises trainer/config.Stop with a one-line message, so that train.py can refuse a bad
set-up before it writes anything: the run folder is checked first (new_run: writable, and free),
then the data, the policy, every prompt (prompt_length: a task the model's tokenizer cannot encode
is one line) and the engine. Under torchrun (util/dist.py) every rank runs all of it; rank 0 alone
writes (write_run), and only once every rank's set-up has worked. A folder left by a run that
stopped before its first step and saved no checkpoint is no run to protect: a rerun with the same
--out starts it again (and says so), as --resume would.
"""
import dataclasses
import json
from pathlib import Path

import torch

import eval as evaluation
import lora
import model as M
import ppo
import quantize
from tasks import data
from trainer import checkpoint, runlog
from trainer.config import Config, Stop
from util import dist, fsutil, tiny


# --------------------------------------------------------------------------------------------------
# Data and policy

def load_data(cfg: Config) -> tuple[list, list]:
    """Training rows and held-out evaluation rows, which never share a row."""
    rows, stats = data.load_rows(cfg.task, cfg.data, seed=cfg.seed)
    skipped = [f"{v} {k[len('skipped_'):].replace('_', ' ')}"           # e.g. "3 bad gold"
               for k, v in stats.items() if k.startswith("skipped_") and v]
    line = f"data: {stats['rows']} usable rows of {stats['read']} read from {stats['source']}"
    if skipped:
        line += f"; skipped: {', '.join(skipped)}"
    print(line)

    # A separate evaluation task: its rows cannot be training rows
    if cfg.eval_task is not None and (cfg.eval_task != cfg.task or cfg.data is not None):
        eval_rows = data.load_rows(cfg.eval_task, limit=cfg.eval_limit)[0]
        print(f"eval: {len(eval_rows)} rows of {cfg.eval_task}")
        return rows, eval_rows

    # The same task: hold out its last rows (load_rows shuffled them with the seed)
    if len(rows) < 2 * cfg.eval_limit:
        raise Stop(f"task {cfg.task} has {len(rows)} rows, fewer than 2 x --eval-limit "
                   f"({cfg.eval_limit}) needed to hold some out for evaluation: "
                   "lower --eval-limit, or pass --eval-task")
    print(f"eval: the last {cfg.eval_limit} of the {len(rows)} shuffled rows are held out "
          "(never trained on)")
    return rows[:-cfg.eval_limit], rows[-cfg.eval_limit:]


def prompt_length(cfg: Config, tok, rows: list[dict]) -> int:
    """The longest prompt of rows, in tokens. Every prompt is encoded here, in the set-up: one the
    tokenizer cannot encode is a one-line error naming the task and the tokenizer (eval.py's
    encode_prompts), never a traceback in the middle of the run."""
    return max(map(len, evaluation.encode_prompts(tok, rows, cfg.fmt)))


def load_policy(cfg: Config, dev: torch.device):
    """(model folder, tokenizer, model), with one-line errors for folders that cannot be used."""
    from transformers import AutoTokenizer

    folder = tiny.tiny_model_dir(cfg.seed) if cfg.model == "tiny" else cfg.model
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32     # fp32 on CPU: exact tests
    try:
        local = quantize.resolve_model_dir(str(folder))             # a hub id is downloaded here
        json.loads((local / "config.json").read_text())             # a clear error if malformed
        tok = AutoTokenizer.from_pretrained(local)
        model = M.Model.from_pretrained(str(local), device=dev, dtype=dtype,
                                        quantize_on_load=cfg.base == "nvfp4")
    except quantize.QuantizeError as e:
        raise Stop(str(e)) from None
    except FileNotFoundError as e:
        raise Stop(f"--model {folder}: {e.filename or e} is missing; "
                   "pass a complete HF folder") from None
    except json.JSONDecodeError as e:
        raise Stop(f"--model {folder}: config.json is not valid JSON ({e}); "
                   "re-download it") from None
    except torch.cuda.OutOfMemoryError:
        raise Stop(f"--model {folder} does not fit on this GPU: use --base nvfp4, "
                   "or a smaller model") from None

    # An NVFP4 folder cannot give back the bf16 weights it was made from
    if cfg.base == "bf16" and any(lin.words is not None for _, lin in model.linears()):
        raise Stop(f"{folder} is an NVFP4 checkpoint: pass its bf16 original for --base bf16")
    return str(local), tok, model


# --------------------------------------------------------------------------------------------------
# Gradient checkpointing where memory needs it

# share of the free GPU memory the probe's activations may take: the rest is for the allocator's
# fragmentation and what the probe leaves out (AdamW's state, the no-grad pass's logits chunk)
HEADROOM = 0.85


def activation_probe(model, micro_batch: int, max_len: int, completion: int,
                     temperature: float) -> tuple[int | None, int]:
    """(bytes that one training forward and backward of micro_batch sequences of max_len tokens,
    the last `completion` of them scored, adds with every activation kept; None if it ran out of
    memory), and the bytes this process could still allocate before it. A CUDA model; the LoRA
    gradients are dropped after, the model left as it was."""
    dev = model.model.norm.weight.device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.cfg.vocab_size, (micro_batch, max_len), generator=g).to(dev)
    T = completion
    b = dict(ids=ids, valid=torch.ones_like(ids, dtype=torch.bool),                  # (S, L)
             # the hidden state at position j predicts token j + 1: the last T tokens
             pos=torch.arange(max_len - T - 1, max_len - 1, device=dev).expand(micro_batch, T),
             mask=torch.ones(micro_batch, T, device=dev))                            # (S, T)
    torch.cuda.synchronize(dev)
    free = torch.cuda.mem_get_info(dev)[0]
    base = torch.cuda.memory_allocated(dev)
    free += torch.cuda.memory_reserved(dev) - base          # cached by this process: ours to use
    torch.cuda.reset_peak_memory_stats(dev)
    was = model.grad_checkpoint
    model.grad_checkpoint = False
    model.train()
    try:
        lp, _ = ppo.policy_logprobs(model, b, torch.arange(micro_batch, device=dev), temperature)
        lp.sum().backward()
        need = torch.cuda.max_memory_allocated(dev) - base
    except torch.cuda.OutOfMemoryError:
        need = None
    finally:
        model.eval()
        model.grad_checkpoint = was
        for q in lora.lora_parameters(model):
            q.grad = None
        del b
        torch.cuda.empty_cache()
    return need, free


def choose_grad_checkpoint(cfg: Config, model, max_len: int, dev) -> tuple[bool, str]:
    """--grad-checkpoint left out for a model with no default of its own: (on, why), for this
    process. On a GPU it is off when the activations of one micro-batch of the longest sequences
    fit in HEADROOM of the free memory (measured once: activation_probe), since recomputing every
    layer costs a quarter of the train half (7B: 9.29 s a step with it, 7.98 s without). On a CPU
    it is on (nothing to measure there, and the default before). Under torchrun train.py turns it
    on for every rank if one rank needs it."""
    if dev.type != "cuda":
        return True, "on (the default on a CPU)"
    need, free = activation_probe(model, cfg.micro_batch, max_len, cfg.max_new_tokens,
                                  cfg.temperature)
    gb = lambda n: f"{n / 2**30:.1f} GB"                                     # noqa: E731
    size = f"{cfg.micro_batch} x {max_len} tokens"
    if need is None:
        return True, (f"on (a micro-batch of {size} ran out of memory keeping its activations; "
                      f"{gb(free)} free)")
    on = need > HEADROOM * free
    return on, (f"{'on' if on else 'off'} (a micro-batch of {size} keeps {gb(need)} of "
                f"activations, {gb(free)} free; --grad-checkpoint / --no-grad-checkpoint decide)")


# --------------------------------------------------------------------------------------------------
# The engine and evaluation

def make_engine(cfg: Config, model, model_dir: str, dev, max_len: int, ctx=dist.SINGLE):
    """The rollout engine of --engine: the built-in one over the trainer's own model (it sees
    every update at once), or vLLM over a folder (the adapter is synced after every update)."""
    if cfg.engine == "builtin":
        per_rank = -(-cfg.prompts_per_step // ctx.world)      # the largest rank's share of a round
        return evaluation.make_engine("builtin", model, max_len=max_len,
                                      max_batch=per_rank * cfg.group_size)

    # vLLM reads a folder: the NVFP4 one the trainer's base was quantized to (written once, reused)
    vdir = model_dir
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if cfg.base == "nvfp4" and "quantization_config" not in raw:
        vdir = Path("runs/.cache") / (Path(model_dir).name + "-NVFP4")
        if not vdir.exists():
            quantize.quantize_checkpoint(model_dir, str(vdir), device=dev.type)
    kw = {"dtype": "float32"} if dev.type == "cpu" else {}                # the trainer's dtype
    return evaluation.make_engine("vllm", model_dir=str(vdir), max_model_len=max_len, **kw)


def evaluate(cfg, model, engine, tok, rows, stops, run, step, ctx=dist.SINGLE) -> dict:
    """Greedy accuracy of the current policy without AQN noise (vLLM: woken, adapter synced).
    Under torchrun the rows are split over the ranks, and rank 0 writes the merged samples."""
    if cfg.engine == "vllm":                             # no noise: the clean policy's accuracy
        engine.wake()
        if step > 0:
            engine.sync_lora(model)
    s = evaluation.evaluate(engine, tok, rows, n=1, temperature=0.0,
                            max_new_tokens=cfg.max_new_tokens, fmt=cfg.fmt, seed=cfg.seed,
                            stop_ids=stops, progress=False, ctx=ctx,
                            out_dir=str(run / "eval" / f"step_{step:06d}"))
    # eval_step: the updates the evaluated policy has had, its folder's number (trainer/runlog.py)
    return dict(eval_accuracy=s["pass@1"],
                eval_parse_fail=s["parse_fail_rate"],
                eval_format_rate=s["format_rate"],
                eval_step=step)


# --------------------------------------------------------------------------------------------------
# The run folder

def new_run(cfg: Config, stamp: str) -> Path:
    """A new run's folder, checked before any work (nothing is written here): one that can be
    written, and holds no run. A run of train.py's (its config.json) that stopped before its first
    step and saved no checkpoint (its step-0 evaluation at most) holds nothing to keep, and
    --resume would repeat its flags: a rerun uses the folder again, and write_run empties its
    metrics. Metrics that train.py's config.json does not vouch for are never replaced."""
    run = Path(cfg.out or f"runs/{cfg.algo}-{stamp}")
    try:
        fsutil.check_writable(run)
    except ValueError as e:
        raise Stop(str(e)) from None
    if (run / "metrics.jsonl").exists():
        steps = [r for r in runlog.read(run) if "reward" in r]       # the finished steps' rows
        ours = (run / "config.json").exists()
        if steps or checkpoint.latest(run) is not None or not ours:
            raise Stop(f"{run} already holds a run: pass --resume {run}, or another --out")
        print(f"{run} holds a run that stopped before its first step and saved no checkpoint: "
              "starting it again there")
    return run


def open_run(cfg: Config, resume: Path | None, model, opt_, ctx=dist.SINGLE) -> int:
    """The run's first step: 0 for a new run, or a resumed run's latest checkpoint loaded into the
    model and optimizer (by every rank). Writes nothing, except that rank 0 removes what an
    interrupted checkpoint write left."""
    if resume is None:
        return 0
    if ctx.main:
        for stale in checkpoint.clean_stale(resume):
            print(f"removed {stale}, left by an interrupted checkpoint write")
    try:
        start = checkpoint.load(resume, model, opt_)
    except checkpoint.CheckpointError as e:
        raise Stop(str(e)) from None
    if start >= cfg.steps:
        raise Stop(f"{resume} already finished its {start} steps: "
                   f"pass --steps N with N > {start} to extend it")
    return start


def write_run(cfg: Config, run: Path, start: int, resumed: bool):
    """Rank 0's first writes, once every rank's set-up worked: a new run folder with its
    config.json and an empty metrics.jsonl (a run that stopped before its first step leaves its rows
    behind otherwise), or a resumed run's config.json and its metrics cut back to the checkpoint's
    step (the steps after it are replayed, so they are logged again)."""
    if not resumed:
        checkpoint.folder(run).mkdir(parents=True, exist_ok=True)
    fsutil.atomic_write_text(run / "config.json", json.dumps(dataclasses.asdict(cfg), indent=2))
    runlog.truncate(run, start)
    if resumed:
        print(f"resumed {run} at step {start} of {cfg.steps}")
