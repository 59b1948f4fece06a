"""config.py: train.py's one flat config, its command line, and the checks that run before
anything is written.

    python train.py --help                        # every flag, with its default and what it does

Config holds every knob of a run; `python train.py` prints it as one JSON line at start, and it is
saved in the run folder and in every checkpoint. The RL knobs whose default is None take it from
the --algo preset (grpo.PRESETS), or from the model's defaults (model_defaults below): a folder
made by pretrain.py carries its own in recipe.json's "rl" key (its task, length limit, learning
rate, ...), read wherever the folder lies; "tiny" and real models have the defaults here. Resuming
keeps the saved config and lets only RESUMABLE flags change; any other flag given with --resume is
refused by name, never silently ignored. check_config turns every bad value (a sigma, a
temperature, a learning rate, a missing logger package, ...) into one line (Stop) before a model
is loaded or a folder is made.
Leaves out: config files (the flags and the saved config.json are the whole story).
"""
import argparse
import dataclasses
import importlib.util
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

import grpo
import noise
import vllm_backend
from tasks import data
from util import recipe


def opt(default, help, **kw):
    """A Config field with its --help text (build_parser turns each field into a flag)."""
    return field(default=default, metadata=dict(help=help, **kw))


SCHEDULES = ("constant", "linear", "cosine")
OLD_LOGP = ("pass", "reuse")


@dataclass
class Config:
    """Every flag of train.py (see --help); None = the preset's or the model's default."""
    algo: str = opt("dapo", "preset: grpo | dapo | dr_grpo (grpo.PRESETS); the flags below "
                            "override it")
    model: str = opt("models/arith-cpu", "HF folder or hub id: a small model of pretrain.py "
                                         "(its recipe.json holds its RL defaults), 'tiny' (a "
                                         "random tiny Qwen2, for plumbing tests) or a real one")
    base: str = opt("nvfp4", "base precision: nvfp4 (a bf16 checkpoint is quantized while loading) "
                             "or bf16")
    task: str = opt(None, f"training data: {', '.join(data.TASKS)} (default: the model's, see "
                          "trainer/config.py model_defaults)")
    data: str = opt(None, "JSONL path (or hub name) with the rows of --task; needs --task")
    # Config() keeps "boxed"; the command line leaves it None for the model's (CLI_NONE below)
    fmt: str = opt("boxed", "answer format: boxed or think (default: the model's, boxed unless "
                            "its recipe.json says think; a generated task is written and checked "
                            "in \\boxed{} only)")
    steps: int = opt(None, "RL steps (default: the model's)")
    prompts_per_step: int = opt(8, "prompt groups per RL step")
    group_size: int = opt(8, "G, completions per prompt")
    max_new_tokens: int = opt(None, "completion length limit (default: the model's)")
    temperature: float = opt(1.0, "sampling temperature (the trainer's log-probs use the same)")
    top_p: float = opt(1.0, "nucleus sampling mass (1 keeps engine and trainer log-probs "
                            "identical)")
    lr: float = opt(None, "peak AdamW learning rate of the LoRA weights (default: the model's; "
                          "1e-5, QeRL's NVFP4 choice, for a real model)")
    lr_schedule: str = opt("constant", "learning rate after warm-up: constant, linear or cosine "
                                       "(to 0 at the last optimizer step)")
    warmup_steps: int = opt(0, "linear warm-up, in OPTIMIZER steps (epochs x minibatches per RL "
                               "step). The schedule follows the RL step: a step that dynamic "
                               "sampling leaves without a batch makes no update but still moves "
                               "the schedule on")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    max_grad_norm: float = opt(1.0, "gradient clipping")
    lora_rank: int = opt(None, "LoRA rank (default: the model's; 32 for a real model)")
    lora_alpha: float = opt(None, "LoRA alpha; scale = alpha / rank (default: the model's)")
    epochs: int = opt(1, "passes over each rollout batch")
    minibatches: int = opt(2, "optimizer steps per pass (> 1 makes the PPO clip matter)")
    old_logp: str = opt("reuse", "pi_old of the first minibatch: 'reuse' (that minibatch's own "
                                 "training forward, detached: no update has happened yet, so it "
                                 "is pi_old, and its rows skip the no-grad pass; needs --epochs "
                                 "1) or 'pass' (the no-grad forward over the whole batch before "
                                 "any update gives every row's) (default: reuse with --epochs 1, "
                                 "else pass)")
    micro_batch: int = opt(16, "sequences per forward/backward (accumulated inside a "
                               "minibatch)")
    std_normalize: bool = opt(None, "divide advantages by the group std (GRPO, DAPO) or not "
                                    "(Dr.GRPO)")
    eps_low: float = opt(None, "PPO clip below 1")
    eps_high: float = opt(None, "PPO clip above 1 (DAPO clip-higher: 0.28)")
    agg: str = opt(None, f"loss aggregation: {', '.join(grpo.AGGREGATIONS)}")
    beta: float = opt(None, "k3 KL to the base policy (LoRA disabled); 0 = off")
    tis_cap: float = opt(None, f"TIS cap C on the weight pi_trainer / pi_engine (default "
                               f"{grpo.TIS_CAP}, every engine); 0 = no correction")
    dynamic_sampling: bool = opt(None, "DAPO: drop groups whose answers are all right or all "
                                       "wrong, roll out more prompts")
    max_sample_rounds: int = opt(None, "bound on rollout rounds per step with dynamic sampling")
    overlong_cache_frac: float = opt(None, "DAPO overlong penalty window, a fraction of "
                                           "max_new_tokens; 0 = off")
    overlong_factor: float = opt(None, "overlong penalty at the length limit")
    mask_truncated: bool = opt(None, "zero the loss of samples cut at the length limit")
    format_weight: float = opt(None, "reward weight of a well-formed answer (default: the "
                                     "model's; 0 for a real model)")
    accuracy_weight: float = opt(1.0, "reward weight of a correct answer")
    aqn: bool = opt(True, "adaptive quantization noise in the norms")
    sigma_start: float = opt(1e-2, "AQN sigma of the first noisy stage")
    sigma_end: float = opt(5e-4, "AQN sigma of the last stage")
    aqn_stages: int = opt(10, "AQN stages, the noise-free first one included (noise.py)")
    aqn_where: str = opt("rollout_only", "AQN in the rollout only (paper) or 'both' (training "
                                         "too)")
    engine: str = opt("builtin", "rollout backend: builtin or vllm")
    grad_checkpoint: bool = opt(None, "recompute each layer in backward (less memory, a quarter "
                                      "of the train half more time; default: the model's, and for "
                                      "a real model on a GPU off when one --micro-batch of the "
                                      "longest sequences fits without it, measured at the start)")
    eval_task: str = opt(None, "task evaluated every --eval-every steps (default: held-out rows of "
                               "the training task, never rows it trains on)")
    eval_every: int = opt(None, "evaluate every N steps (0 = only before and after training; "
                                "default: the model's)")
    eval_limit: int = opt(64, "prompts per evaluation")
    save_every: int = opt(20, "checkpoint every N steps (and at the end)")
    out: str = opt(None, "run folder (default runs/<algo>-<time>)")
    seed: int = opt(0, "seed of everything")
    tensorboard: bool = opt(False, "also log to tensorboard (needs the tensorboard package)")
    wandb: bool = opt(False, "also log to Weights & Biases (needs wandb)")
    device: str = opt(None, "cuda or cpu (default: cuda when present)")


# Flags whose command-line default is None, to be the model's (apply_model_defaults), while a
# Config built in code keeps its dataclass default.
CLI_NONE = ("fmt", "old_logp")
# Flags that may change when a run is resumed; any other flag given with --resume is refused.
RESUMABLE = ("steps", "eval_every", "save_every", "tensorboard", "wandb", "device")
# The types of the flags whose default is None (the parser cannot read those from the default).
FLAG_TYPES = {"steps": int, "eval_every": int, "max_new_tokens": int,
              "lr": float, "beta": float, "eps_low": float, "eps_high": float,
              "tis_cap": float, "max_sample_rounds": int,
              "overlong_cache_frac": float, "overlong_factor": float,
              "lora_rank": int, "lora_alpha": float, "format_weight": float}


class Stop(Exception):
    """Bad input or an unusable run: train.py prints the message as one line and exits with
    `code`."""

    def __init__(self, msg: str, code: int = 2):
        super().__init__(msg)
        self.code = code


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default. A None default is someone else's: the --algo
    preset's (said here) or the model's (said in the flag's own help); "(default: None)" would
    hide it."""

    def _get_help_string(self, action):
        if action.default is not None:
            return super()._get_help_string(action)
        name = action.dest
        if name in grpo.PRESETS["dapo"] and "default" not in action.help:
            values = ", ".join(f"{a} {p[name]}" for a, p in grpo.PRESETS.items())
            return f"{action.help} (default: the --algo preset's: {values})"
        return action.help


def build_parser(suppress: bool = False) -> argparse.ArgumentParser:
    """The CLI. suppress=True leaves unset flags out of the result (to see which ones were
    given)."""
    ap = argparse.ArgumentParser(description="RL (GRPO / DAPO / Dr.GRPO) on an NVFP4 base with "
                                             "LoRA and AQN.",
                                 formatter_class=HelpFormatter,
                                 argument_default=argparse.SUPPRESS if suppress else None)
    # the booleans whose default is None (the preset's): --x / --no-x like the other booleans
    tristate = ("std_normalize", "dynamic_sampling", "mask_truncated", "grad_checkpoint")
    for f in dataclasses.fields(Config):
        name = "--" + f.name.replace("_", "-")
        default = argparse.SUPPRESS if suppress else None if f.name in CLI_NONE else f.default
        if isinstance(f.default, bool) or f.name in tristate:
            ap.add_argument(name, action=argparse.BooleanOptionalAction, default=default,
                            help=f.metadata["help"])
        else:
            kind = FLAG_TYPES.get(f.name, type(f.default) if f.default is not None else str)
            ap.add_argument(name, type=kind, default=default, help=f.metadata["help"])
    resumable = ", ".join("--" + k.replace("_", "-") for k in RESUMABLE)
    ap.add_argument("--resume", help="continue the run in this folder from its last checkpoint; "
                                     f"only {resumable} may change")
    ap.add_argument("--plot", help="only redraw RUN/curves.png from RUN/metrics.jsonl")
    return ap


def parse_args(argv=None) -> tuple[Config, argparse.Namespace, set]:
    args = build_parser().parse_args(argv)
    given = set(vars(build_parser(suppress=True).parse_args(argv)))  # the flags on the command line
    cfg = Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)})
    return cfg, args, given - {"resume", "plot"}


# Defaults that depend on the model; each applies only where the flag was left out. A model folder
# made by pretrain.py: the "rl" key of its recipe.json (the shipped models/arith-cpu: its addition
# task, where DAPO lifts held-out greedy accuracy from ~0.16 within minutes on a CPU), wherever the
# folder lies. The tiny random model: the lucky-digit plumbing task. Anything else: QeRL's GSM8K
# recipe.
SHIPPED = Path(__file__).resolve().parent.parent / "models" / "arith-cpu"
TINY_DEFAULTS = dict(task="synthetic", fmt="boxed", steps=40, max_new_tokens=8,
                     lr=5e-3, lora_rank=8, lora_alpha=16.0, format_weight=0.2,
                     eval_every=0, grad_checkpoint=True)
# (grad_checkpoint None: train.py measures whether the GPU needs it, prepare.choose_grad_checkpoint)
REAL_DEFAULTS = dict(task="gsm8k_train", eval_task="gsm8k", fmt="boxed", steps=500,
                     max_new_tokens=1024, lr=1e-5, lora_rank=32, lora_alpha=64.0,
                     format_weight=0.0, eval_every=50, grad_checkpoint=None)


def model_defaults(model: str) -> dict:
    """The defaults of --model: "tiny"'s, a local folder's recipe.json "rl" key, or a real
    model's."""
    if model == "tiny":
        return TINY_DEFAULTS
    try:
        rl = recipe.rl_defaults(model) if Path(model).is_dir() else None
    except ValueError as e:
        raise Stop(f"--model {model}: {e}") from None
    return REAL_DEFAULTS if rl is None else rl


def apply_model_defaults(cfg: Config) -> Config:
    """Fill the flags left out (None) with the model's defaults, in place. The default model's
    relative path is taken from the repository, wherever train.py is run from."""
    if cfg.model == Config.model and not Path(cfg.model).exists():
        cfg.model = str(SHIPPED)
    defaults = model_defaults(cfg.model)
    if cfg.task is None and defaults["task"] is None:
        # pretrain.py wrote no task: its generator knobs match none of the registered tasks
        raise Stop(f"--model {cfg.model}: its recipe.json names no registered task (it was "
                   "pretrained with other generator knobs than those of tasks/); pass --task "
                   "(and --eval-task)")
    for name, value in defaults.items():
        if getattr(cfg, name) is None:
            setattr(cfg, name, value)
    if cfg.old_logp is None:
        # the first minibatch's training forward is pi_old only before any update: one epoch.
        # It saves that minibatch's share of the no-grad pass (7B: bench train --old-logp both)
        cfg.old_logp = "reuse" if cfg.epochs == 1 else "pass"
    return cfg


def resolve_config(cfg: Config, args, given: set) -> tuple[Config, Path | None]:
    """The run's config: a new one from the flags, or a resumed run's with the flags that may
    change."""
    if "data" in given and "task" not in given:
        raise Stop(f"--data {cfg.data} needs --task to say what its rows are (e.g. --task "
                   "gsm8k_train for GSM8K-style rows, --task math12k for MATH-style rows)")
    if not args.resume:
        return cfg, None
    run = Path(args.resume)
    if not (run / "config.json").exists():
        raise Stop(f"{run} is not a run folder (no config.json): pass the folder train.py printed")
    saved = Config(**json.loads((run / "config.json").read_text()))
    fixed = sorted(given - set(RESUMABLE))
    if fixed:
        names = ", ".join("--" + k.replace("_", "-") for k in fixed)
        resumable = ", ".join("--" + k.replace("_", "-") for k in RESUMABLE)
        raise Stop(f"{names} cannot change when resuming {run} (they shape the replayed steps); "
                   f"only {resumable} may")
    changed = {k: getattr(cfg, k) for k in given}          # only RESUMABLE flags are left here
    return dataclasses.replace(saved, **changed), run


def flag(name: str) -> str:
    """A Config field's flag: lora_rank -> --lora-rank."""
    return "--" + name.replace("_", "-")


def check_numbers(cfg: Config, p: dict) -> None:
    """Every number in its range (NaN fails every comparison, so it is refused too). p: the preset
    with the flags applied (the clip, TIS, KL and DAPO knobs left out take the preset's)."""
    for f in dataclasses.fields(Config):
        value = p.get(f.name, getattr(cfg, f.name))
        if isinstance(value, float) and not math.isfinite(value):
            raise Stop(f"{flag(f.name)} must be a finite number, got {value}")
    if cfg.prompts_per_step < 1 or cfg.group_size < 2:
        raise Stop("need --prompts-per-step >= 1 and --group-size >= 2 (advantages compare the "
                   "samples of a group)")
    for name in ("steps", "save_every", "eval_limit", "max_new_tokens", "epochs", "minibatches",
                 "micro_batch", "lora_rank", "max_sample_rounds"):
        if p.get(name) is not None and p[name] < 1:               # apply_preset drops a None
            raise Stop(f"{flag(name)} must be >= 1, got {p[name]}")
    if cfg.eval_every < 0 or cfg.warmup_steps < 0:
        raise Stop("--eval-every and --warmup-steps must be >= 0")
    # (name, value, holds, the rule as the message says it, why)
    rules = (
        ("lr", cfg.lr, cfg.lr > 0, "> 0", ""),
        ("lora_alpha", cfg.lora_alpha, cfg.lora_alpha > 0, "> 0", " (scale = alpha / rank)"),
        ("temperature", cfg.temperature, cfg.temperature > 0, "> 0",
         ": at 0 sampling is greedy, the G samples of a prompt agree and nothing is learned"),
        ("top_p", cfg.top_p, 0 < cfg.top_p <= 1, "in (0, 1]", " (a share of the probability)"),
        ("max_grad_norm", cfg.max_grad_norm, cfg.max_grad_norm > 0, "> 0", ""),
        ("weight_decay", cfg.weight_decay, cfg.weight_decay >= 0, ">= 0", ""),
        ("format_weight", cfg.format_weight, cfg.format_weight >= 0, ">= 0", ""),
        ("accuracy_weight", cfg.accuracy_weight, cfg.accuracy_weight >= 0, ">= 0", ""),
        ("eps_low", p["eps_low"], 0 <= p["eps_low"] < 1, "in [0, 1)",
         " (the clip's lower end is 1 - eps_low)"),
        ("eps_high", p["eps_high"], p["eps_high"] >= 0, ">= 0", ""),
        ("tis_cap", p["tis_cap"], p["tis_cap"] is None or p["tis_cap"] >= 0, ">= 0",
         " (0 = no correction)"),                      # None: grpo.TIS_CAP
        ("beta", p["beta"], p["beta"] >= 0, ">= 0", " (0 = no KL term)"),
        ("overlong_cache_frac", p["overlong_cache_frac"], 0 <= p["overlong_cache_frac"] <= 1,
         "in [0, 1]", " (a fraction of --max-new-tokens)"),
        ("overlong_factor", p["overlong_factor"], p["overlong_factor"] >= 0, ">= 0", ""),
        # AQN: noise.sigma_at runs every step, with --no-aqn too (its sigma is then dropped)
        ("sigma_start", cfg.sigma_start, cfg.sigma_start > 0, "> 0", ""),
        ("sigma_end", cfg.sigma_end, 0 < cfg.sigma_end <= cfg.sigma_start,
         f"in (0, --sigma-start {cfg.sigma_start}]", " (the noise decays)"),
        ("aqn_stages", cfg.aqn_stages, cfg.aqn_stages >= 2, ">= 2",
         " (the noise-free first stage, then noisy ones)"),
    )
    for name, value, holds, rule, why in rules:
        if not holds:
            raise Stop(f"{flag(name)} must be {rule}, got {value}{why}")
    if cfg.format_weight == 0 and cfg.accuracy_weight == 0:
        raise Stop("--format-weight and --accuracy-weight are both 0: every reward would be 0 and "
                   "nothing learned; give one of them a weight > 0")


def check_config(cfg: Config) -> dict:
    """Validate every flag (one-line errors); returns the preset with the flags applied."""
    p = grpo.apply_preset(cfg.algo, dataclasses.asdict(cfg))
    choices = (("task", cfg.task, data.TASKS),
               ("fmt", cfg.fmt, data.FORMATS),
               ("base", cfg.base, ("nvfp4", "bf16")),
               ("aqn_where", cfg.aqn_where, noise.WHERE),
               ("engine", cfg.engine, ("builtin", "vllm")),
               ("agg", p["agg"], grpo.AGGREGATIONS),           # the preset's when --agg is left out
               ("lr_schedule", cfg.lr_schedule, SCHEDULES),
               ("old_logp", cfg.old_logp, OLD_LOGP))
    for name, val, allowed in choices:
        if val not in allowed:
            raise Stop(f"{flag(name)} {val!r} is not one of: {', '.join(allowed)}")
    if cfg.eval_task is not None and cfg.eval_task not in data.TASKS:
        raise Stop(f"--eval-task {cfg.eval_task!r} is not one of: {', '.join(data.TASKS)}")
    check_numbers(cfg, p)
    if cfg.old_logp == "reuse" and cfg.epochs > 1:
        raise Stop(f"--old-logp reuse needs --epochs 1 (got {cfg.epochs}): a later epoch revisits "
                   "the first minibatch's rows after updates, when their pi_old must be the one "
                   "from before them; use --old-logp pass")
    # a generated task's answers are written and checked in \boxed{} (its corpus, its checker):
    # with think every reward would be 0, for the whole run, without a word
    generated = [t for t in (cfg.task, cfg.eval_task) if t is not None and data.is_generated(t)]
    if cfg.fmt == "think" and generated:
        raise Stop(f"--fmt think: task {generated[0]} is generated and its answers are written "
                   "and checked in \\boxed{} only, so every reward would be 0; leave --fmt out "
                   "(boxed)")
    if cfg.data is not None and data.is_generated(cfg.task):
        raise Stop(f"--data {cfg.data}: task {cfg.task} is generated and reads no file; say what "
                   "the rows are with --task (e.g. gsm8k_train for GSM8K-style rows, math12k for "
                   "MATH-style)")
    if cfg.device not in (None, "cpu", "cuda") and not cfg.device.startswith("cuda:"):
        raise Stop(f"--device {cfg.device!r}: use cpu or cuda (cuda:N for one GPU of several)")
    if (cfg.device or "").startswith("cuda") and not torch.cuda.is_available():
        raise Stop(f"--device {cfg.device}: this machine has no CUDA GPU that torch can use; "
                   "leave --device out (or --device cpu)")
    if cfg.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise Stop(vllm_backend.MISSING)
    # the loggers are imported only when the run folder is already written: check them now
    for wanted, package in ((cfg.tensorboard, "tensorboard"), (cfg.wandb, "wandb")):
        if wanted and importlib.util.find_spec(package) is None:
            raise Stop(f"--{package} needs the {package} package, which is not installed: "
                       f"install it (.venv/bin/pip install {package}) or leave --{package} out")
    return p
