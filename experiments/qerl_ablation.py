"""qerl_ablation.py: does quantization noise help exploration? QeRL's claims measured over arms x
learning rates x seeds with train.py's own loop, each claim judged by a paired 95% interval over
seeds.

    # CPU smoke: 2 arms x 1 seed x 2 steps of the built-in tiny model (tests/test_ablation.py)
    python experiments/qerl_ablation.py --out runs/ablation-smoke --arms bf16,nvfp4_aqn --seeds 0 \\
        --lrs 5e-3 --pass-k-n 4 --entropy-samples 2 --steps 2 --algo grpo --prompts-per-step 2 \\
        --group-size 4 --eval-limit 4 --max-new-tokens 8
    # the Countdown ablation (README, "Does quantization noise help?"): every arm at three
    # learning rates on 3 selection seeds, then at its own best one on 12 seeds, in parts
    python experiments/qerl_ablation.py --out runs/ablation-cd5 --design countdown5 \\
        --procs-per-gpu 10 --finish-by 1500 --part part1 --pack ablation-cd5.tgz
    python experiments/qerl_ablation.py --out runs/ablation-cd5 --report-only   # results.* again

Arms (ARMS): bf16 + LoRA; NVFP4 + LoRA; NVFP4 + LoRA + AQN at sigma_start 1e-2 (QeRL's), 1e-1 and
3e-1 (sigma_end = sigma_start / 20); bf16 + LoRA + AQN at 1e-2 and at 7e-2 (the sigma whose KL to
the bf16 policy matches NVFP4's on the Countdown model, experiments/results/testbed-pilot-h100x4);
NVFP4 + LoRA + AQN 1e-2 without the importance-weight (TIS) correction. Every other flag goes to
train.py, the same for every run; train.py draws prompts, samples and noise from (--seed, step), so
one seed means the same data order in every arm.

Learning rates: with --select-seeds, every arm first runs at every --lrs value on those seeds; its
learning rate is then the one with the highest mean area under the training-reward curve (the
primary measure) over them, the smaller on a tie; the verdicts use the --seeds runs at that learning
rate only, so no verdict seed chose it. --every-lr arms also run their verdict seeds at every
learning rate (the comparison at equal learning rates). Without --select-seeds, every arm runs at
every learning rate on every seed and the claims are judged at each.

A rerun skips finished runs, resumes a partial one from its last checkpoint (or starts it again:
--restart-partial), starts no run after --launch-until seconds nor one that would end after
--finish-by (a machine's time is limited), and names each failed run with its error while the others
go on (experiments/ablation_jobs.py runs them). One scheduler per folder (a lock); --mps lets the
runs sharing a GPU run their kernels side by side. The report (results.json, results.md,
fig_lr<lr>.png, fig_own_lr.png, fig_claims.png, selection.json) reads only the run folders, so
--report-only redoes it alone; --pack writes what a machine brings back (also while the runs go, at
most once a minute). GPU time: each attempt's wall time x its GPU share, per arm and per --part.
Leaves out: several nodes, queueing systems, vLLM for the post-run evaluations.
"""
if __name__ == "__main__":
    import sys
    from pathlib import Path

    HERE = Path(__file__).resolve().parent
    sys.path[:0] = [str(HERE.parent), str(HERE)]  # the stages and stats.py, from anywhere
    from util import versions
    versions.check_or_exit()

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import ablation_jobs as jobs
import ablation_report as rep
from util import fsutil

# name: (label, train.py flags). sigma_end is sigma_start / 20 in every AQN arm, as QeRL's 1e-2 to
# 5e-4.
ARMS = {
    "bf16": ("bf16 + LoRA", ["--base", "bf16", "--no-aqn"]),
    "nvfp4": ("NVFP4 + LoRA", ["--base", "nvfp4", "--no-aqn"]),
    "nvfp4_aqn": ("NVFP4 + LoRA + AQN 1e-2 (QeRL)",
                  ["--base", "nvfp4", "--aqn", "--sigma-start", "1e-2", "--sigma-end", "5e-4"]),
    "nvfp4_aqn_1e-1": ("NVFP4 + LoRA + AQN 1e-1",
                       ["--base", "nvfp4", "--aqn", "--sigma-start", "1e-1",
                        "--sigma-end", "5e-3"]),
    "nvfp4_aqn_3e-1": ("NVFP4 + LoRA + AQN 3e-1",
                       ["--base", "nvfp4", "--aqn", "--sigma-start", "3e-1",
                        "--sigma-end", "1.5e-2"]),
    "bf16_aqn": ("bf16 + LoRA + AQN 1e-2",
                 ["--base", "bf16", "--aqn", "--sigma-start", "1e-2", "--sigma-end", "5e-4"]),
    "bf16_aqn_7e-2": ("bf16 + LoRA + AQN 7e-2 (NVFP4's KL)",
                      ["--base", "bf16", "--aqn", "--sigma-start", "7e-2", "--sigma-end",
                       "3.5e-3"]),
    "nvfp4_aqn_notis": ("NVFP4 + LoRA + AQN 1e-2, no TIS",
                        ["--base", "nvfp4", "--aqn", "--sigma-start", "1e-2", "--sigma-end",
                         "5e-4", "--tis-cap", "0"]),
}
# train.py flags this script sets for each run, and where to set them instead
CONTROLLED = {"base": "--arms", "aqn": "--arms", "sigma_start": "--arms", "sigma_end": "--arms",
              "lr": "--lrs", "seed": "--seeds", "out": "this script's --out",
              "device": "--gpus (0 = CPU)", "resume": "a rerun of the same command",
              "plot": "--report-only"}
POST_KEYS = ("pass_k_n", "pass_temperature", "entropy_samples")
# defaults of the flags that, left out, keep the experiment's saved value (a rerun repeats none)
DEFAULTS = dict(threshold_greedy=0.5, threshold_sampled=0.3, pass_k_n=8, pass_temperature=1.0,
                entropy_samples=4)
# The Countdown ablation's design, fixed before its runs (README, "Does quantization noise help?"):
# flags of this script, then train.py's
DESIGNS = {
    "countdown5": dict(
        arms=["bf16", "nvfp4", "nvfp4_aqn", "nvfp4_aqn_1e-1", "nvfp4_aqn_3e-1", "bf16_aqn_7e-2",
              "nvfp4_aqn_notis"],
        lrs=[1e-4, 3e-4, 1e-3], select_seeds=[100, 101, 102], seeds=list(range(12)),
        every_lr=["bf16", "nvfp4"], pass_k_n=16, entropy_samples=4,
        train_flags=["--model", "models/countdown5", "--task", "countdown5",
                     "--eval-task", "countdown5_test", "--algo", "dapo", "--steps", "300",
                     "--prompts-per-step", "8", "--group-size", "8", "--max-new-tokens", "64",
                     "--lora-rank", "8", "--lora-alpha", "16", "--format-weight", "0",
                     "--eval-every", "50", "--save-every", "100", "--eval-limit", "512"]),
}


class Stop(Exception):
    """Bad input: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                 epilog="Any other flag goes to train.py, for every run "
                                        "(python train.py --help).")
    ap.add_argument("--out", required=True,
                    help="experiment folder: runs/, logs/, timing/, results.*, figures")
    ap.add_argument("--design", choices=sorted(DESIGNS), default=None,
                    help="a design fixed in this file: its arms, learning rates, seeds and "
                         "train.py flags (flags given here are refused where it sets them)")
    ap.add_argument("--arms", default=None,
                    help=f"comma list of: {', '.join(ARMS)} (default: the design's, the saved, "
                         "or bf16,nvfp4,nvfp4_aqn,bf16_aqn,nvfp4_aqn_notis)")
    ap.add_argument("--seeds", default=None,
                    help="verdict seeds, e.g. 0-11 or 0,2,5 (default: 0-4, or the saved)")
    ap.add_argument("--select-seeds", default=None,
                    help="seeds that choose each arm's learning rate (highest mean reward AUC); "
                         "none: every arm runs every lr on the verdict seeds")
    ap.add_argument("--every-lr", default=None,
                    help="with --select-seeds: arms whose verdict seeds also run at every lr")
    ap.add_argument("--lrs", default=None,
                    help="peak learning rates, e.g. 1e-4,3e-4,1e-3 (needed for a new experiment)")
    ap.add_argument("--gpus", type=int, default=None,
                    help="GPUs to use (default: every visible one; 0 = CPU)")
    ap.add_argument("--procs-per-gpu", type=int, default=1,
                    help="runs at once on each GPU, or on the CPU with --gpus 0 (default: 1)")
    ap.add_argument("--launch-until", type=float, default=None,
                    help="start no run after this many seconds (the rest wait for a rerun)")
    ap.add_argument("--finish-by", type=float, default=None,
                    help="start no run that would end after this many seconds, judged by the "
                         "longest run finished so far in this call (a machine's time runs out: "
                         "a run stopped with it is lost when its checkpoints stay there)")
    ap.add_argument("--mps", action="store_true",
                    help="run an MPS daemon on each GPU while the runs go, so the runs sharing a "
                         "GPU run their kernels side by side (needs nvidia-cuda-mps-control; "
                         "the numbers are the same, only the time changes)")
    ap.add_argument("--part", default=None,
                    help="a name for this invocation in sessions.json (GPU time per part)")
    ap.add_argument("--pack-after", nargs="+", default=[], metavar="TGZ",
                    help="packs brought back before (extracted into --out): --pack leaves out "
                         "the files they hold unchanged, so each part adds only what is new")
    ap.add_argument("--pack", default=None,
                    help="write the runs' numbers (no weights) to this .tar.gz: at the end, and "
                         "at most once a minute while runs finish (a machine lost midway "
                         "leaves the runs finished up to a minute before)")
    ap.add_argument("--threshold-greedy", type=float,
                    help="held-out greedy accuracy whose first evaluation step is reported "
                         "(default: 0.5, or the saved)")
    ap.add_argument("--threshold-sampled", type=float,
                    help=f"sampled accuracy (a trailing mean of {rep.WINDOW} steps) whose first "
                         "step is reported (default: 0.3, or the saved)")
    ap.add_argument("--pass-k-n", type=int,
                    help="samples per held-out prompt for pass@k (k = 1, 2, 4, ... <= n) "
                         "before any update and after the last step (default: 8, or the saved)")
    ap.add_argument("--pass-temperature", type=float,
                    help="sampling temperature of pass@k (default: 1.0, or the saved)")
    ap.add_argument("--entropy-samples", type=int,
                    help="completions per held-out prompt in the entropy probe (default: 4, or "
                         "the saved)")
    ap.add_argument("--restart-partial", action="store_true",
                    help="start partial runs again, not resume them")
    ap.add_argument("--report-only", action="store_true",
                    help="launch nothing; redo the report from the runs")
    ap.add_argument("--dry-run", action="store_true",
                    help="print each run's state and command; launch nothing")
    ap.add_argument("--worker", default=None, help="internal: run the one job this JSON describes")
    return ap


def parse_list(text: str, flag: str, kind) -> list:
    """'0-4,7' -> [0, 1, 2, 3, 4, 7] (ints), '5e-4,5e-3' -> floats; duplicates and bad items are
    one-line errors."""
    out = []
    try:
        for part in (p.strip() for p in text.split(",")):
            if kind is int and "-" in part[1:]:
                a, b = part.split("-", 1)
                out += list(range(int(a), int(b) + 1))
            else:
                out.append(kind(part))
    except ValueError:
        ranges = " or ranges like 0-4" if kind is int else ""
        raise Stop(f"{flag} {text!r}: expected a comma list of {kind.__name__}s{ranges}") from None
    if not out or len(set(out)) != len(out) or (kind is float and min(out) <= 0):
        positive = ", all > 0" if kind is float else ""
        raise Stop(f"{flag} {text!r}: give distinct values{positive}")
    return out


def check_train_flags(extra: list[str], arms: list[str], lrs: list[float]) -> None:
    """Every arm's train.py config is checked here, before any process starts (one line for the
    first problem)."""
    from trainer import config as tc

    def fail(msg):
        raise Stop(f"train.py flags: {msg}")
    ap = tc.build_parser(suppress=True)
    ap.error = fail  # argparse would print its usage and exit
    given, unknown = ap.parse_known_args(extra)
    if unknown:
        raise Stop(f"unknown flag(s) {' '.join(unknown)}: neither this script's (--help) nor "
                   "train.py's (python train.py --help)")
    for name in sorted(set(vars(given)) & set(CONTROLLED)):
        raise Stop(f"--{name.replace('_', '-')} is set by this script for each run: use "
                   f"{CONTROLLED[name]}")
    if getattr(given, "tis_cap", 1.0) <= 0:
        raise Stop("--tis-cap <= 0 turns the correction off in every arm; the arm "
                   "nvfp4_aqn_notis is the one without it")
    for arm in arms:
        try:
            cfg = tc.parse_args(extra + ARMS[arm][1] + ["--lr", str(lrs[0])])[0]
            tc.check_config(tc.apply_model_defaults(cfg))
        except (tc.Stop, ValueError) as e:
            raise Stop(f"arm {arm}: {e}") from None


# --------------------------------------------------------------------------------------------------
# The plan: selection runs, then verdict runs at each arm's chosen learning rate

def run_name(arm: str, lr: float, seed: int) -> str:
    return f"{arm}-lr{lr:g}-s{seed}"


def selection(exp: Path, cfg: dict) -> dict:
    """{arm: chosen lr} for the arms whose selection runs have all finished, with the rule's
    numbers (written to selection.json): the mean reward AUC of each lr over the selection
    seeds."""
    out = {}
    for arm in cfg["arms"]:
        aucs = {}
        for lr in cfg["lrs"]:
            vals = []
            for seed in cfg["select_seeds"]:
                m = summarize_run(exp / "runs" / run_name(arm, lr, seed), cfg)
                vals.append(None if m is None else m["reward_auc"])
            aucs[lr] = vals
        if all(v is not None for vals in aucs.values() for v in vals):
            means = {lr: sum(v) / len(v) for lr, v in aucs.items()}
            # the highest mean AUC; on a tie the smaller learning rate
            best = max(sorted(means), key=lambda lr: means[lr])
            out[arm] = dict(lr=best, mean_auc={f"{lr:g}": m for lr, m in means.items()},
                            auc={f"{lr:g}": v for lr, v in aucs.items()})
    return out


def cells(exp: Path, cfg: dict) -> list[tuple[str, float, int, str]]:
    """Every run the design asks for that can be planned now: (arm, lr, seed, phase)."""
    if not cfg["select_seeds"]:
        return [(arm, lr, seed, "verdict") for seed in cfg["seeds"] for lr in cfg["lrs"]
                for arm in cfg["arms"]]
    out = [(arm, lr, seed, "select") for seed in cfg["select_seeds"] for lr in cfg["lrs"]
           for arm in cfg["arms"]]
    chosen = selection(exp, cfg)
    for seed in cfg["seeds"]:                                 # seeds outermost: arms fill evenly
        for arm in cfg["arms"]:
            if arm in cfg["every_lr"]:
                lrs = cfg["lrs"]
            elif arm in chosen:
                lrs = [chosen[arm]["lr"]]
            else:
                lrs = []                          # its selection runs are not all finished yet
            out += [(arm, lr, seed, "verdict") for lr in lrs]
    return out


def plan(cfg: dict, exp: Path, dry_run: bool) -> tuple[list, int]:
    """The jobs of the runs left to do and the number of finished runs skipped. dry_run: print each
    run's state and command instead."""
    todo, skipped = [], 0
    for arm, lr, seed, phase in cells(exp, cfg):
        # the selection rule reads the training curve alone: no post-run evaluations there
        post = {k: cfg[k] for k in POST_KEYS} if phase == "verdict" else None
        name = run_name(arm, lr, seed)
        run = exp / "runs" / name
        argv = cfg["train_flags"] + ARMS[arm][1] + ["--lr", str(lr), "--seed", str(seed),
                                                    "--out", str(run)]
        argv += [] if cfg["gpus"] else ["--device", "cpu"]
        state, evaluated = jobs.run_state(run), jobs.post_done(run, post)
        if dry_run:
            done = " and evaluated" if evaluated else ""
            print(f"{name} ({phase}): {state}{done}: python train.py {' '.join(argv)}")
        elif state == "trained" and evaluated:
            skipped += 1
        else:
            todo.append(dict(name=name, run=str(run), train_argv=argv, post=post,
                             restart_partial=cfg["restart_partial"]))
    return todo, skipped


# --------------------------------------------------------------------------------------------------
# The report: per-run numbers, per arm x lr aggregates, paired comparisons, claims, figures

def summarize_run(run: Path, cfg: dict) -> dict | None:
    """A finished run's numbers (ablation_report.run_measures), None when its final evaluation is
    missing.
    The greedy accuracy at each evaluation step is read from every sample train.py kept."""
    if jobs.run_state(run) != "trained":
        return None
    evals = {}
    for d in sorted((run / "eval").glob("step_*")):
        summary = jobs.load_json(d / "summary.json", {})
        if "pass@1" in summary:
            evals[int(d.name[5:])] = summary["pass@1"]
    rc = json.loads((run / "config.json").read_text())
    rows = jobs.read_rows(run / "metrics.jsonl")
    out = rep.run_measures(rc["steps"], rows, evals, jobs.load_json(run / "post.json", {}),
                           cfg["threshold_greedy"], cfg["threshold_sampled"], rep.WINDOW)
    keys = ("model", "task", "algo", "steps", "prompts_per_step", "group_size", "eval_limit",
            "eval_every", "save_every", "lr", "seed")
    last = run / "eval" / f"step_{rc['steps']:06d}" / "samples.jsonl"
    samples = jobs.read_rows(last) if last.exists() else []
    return out | dict(config={k: rc[k] for k in keys}, writes=rep.writes(samples))


def report(exp: Path, cfg: dict) -> dict:
    """Read every run folder of the design; write selection.json, results.json, results.md and
    one figure per lr."""
    failed = jobs.load_json(exp / "failed.json", {})
    chosen = selection(exp, cfg) if cfg["select_seeds"] else {}
    runs = {}
    for arm, lr, seed, phase in cells(exp, cfg):
        name = run_name(arm, lr, seed)
        runs[(arm, lr, seed)] = dict(name=name, phase=phase,
                                     timing=jobs.load_json(exp / "timing" / f"{name}.json", {}),
                                     summary=summarize_run(exp / "runs" / name, cfg))
    verdict_runs = {k: r for k, r in runs.items() if r["phase"] == "verdict"}
    best = {arm: c["lr"] for arm, c in chosen.items()}
    # the bf16 arm at its own learning rate (or the first) is the reference of the gain thresholds
    ref = ("bf16", best.get("bf16", cfg["lrs"][0]))
    gain = rep.gain_steps(verdict_runs, ref) if "bf16" in cfg["arms"] else {}
    groups = rep.aggregate(verdict_runs, cfg["arms"], cfg["lrs"], cfg["seeds"])
    comps, claims = rep.compare(verdict_runs, cfg["arms"], cfg["lrs"], cfg["seeds"], best)
    sessions = jobs.load_json(exp / "sessions.json", [])

    def gpu_s(arm):
        return sum(r["timing"].get("gpu_seconds", 0) for k, r in runs.items() if k[0] == arm)
    parts = {}
    for s in sessions:
        part = s.get("part") or "-"
        parts[part] = parts.get(part, 0.0) + s["wall_s"] * s["devices"] / 60
    # one figure for each learning rate, and one with every arm at its own
    figures = {f"fig_lr{lr:g}": ({a: f"{a}@{lr:g}" for a in cfg["arms"]}, f"lr {lr:g}")
               for lr in cfg["lrs"]}
    if best:
        figures["fig_own_lr"] = ({a: f"{a}@{lr:g}" for a, lr in best.items()},
                                 "each arm at its own learning rate")
    res = dict(config=cfg, arms={a: dict(label=ARMS[a][0], flags=ARMS[a][1]) for a in cfg["arms"]},
               selection=chosen, gain=gain, figures=list(figures),
               runs={r["name"]: dict(arm=k[0], lr=k[1], seed=k[2], phase=r["phase"],
                                     timing=r["timing"], error=failed.get(r["name"]),
                                     **(r["summary"] or {})) for k, r in runs.items()},
               groups=groups, claims=claims, comparisons=comps, sessions=sessions,
               finished=sum(r["summary"] is not None for r in runs.values()),
               devices=sorted({r["summary"]["device"] for r in runs.values()
                               if (r["summary"] or {}).get("device")}),
               device_kind="GPU" if cfg["gpus"] else "CPU",
               gpu_minutes=dict(per_arm={a: gpu_s(a) / 60 for a in cfg["arms"]},
                                total=sum(map(gpu_s, cfg["arms"])) / 60,
                                held=sum(x["wall_s"] * x["devices"] for x in sessions) / 60,
                                held_per_part=parts))
    labels = {a: ARMS[a][0] for a in cfg["arms"]}
    for name, (keys, title) in figures.items():
        fsutil.atomic_write_bytes(exp / f"{name}.png", rep.figure(groups, labels, keys, title))
    # the claims at a glance, once two seeds give them intervals
    if (png := rep.claims_figure(claims)) is not None:
        fsutil.atomic_write_bytes(exp / "fig_claims.png", png)
        res["figures"].append("fig_claims")
    res = rep.clean(res)
    fsutil.atomic_write_text(exp / "selection.json", json.dumps(res["selection"], indent=1))
    fsutil.atomic_write_text(exp / "results.json", json.dumps(res, indent=1))
    fsutil.atomic_write_text(exp / "results.md", rep.markdown(res))
    return res


# --------------------------------------------------------------------------------------------------
# The driver

def resolve(args, extra: list[str], exp: Path) -> tuple[dict, list]:
    """The flat config (checked; flags left out come from the design or the saved config) and the
    worker slots."""
    saved = jobs.load_json(exp / "config.json", None)
    if args.report_only and saved is None:
        raise Stop(f"{exp} holds no experiment (no config.json): pass the folder a run of this "
                   "script made")
    design = DESIGNS.get(args.design or (saved or {}).get("design") or "", {})
    if design and extra and not saved:
        raise Stop(f"--design {args.design} sets train.py's flags: leave out {' '.join(extra)}")
    flags = design.get("train_flags") or (saved["train_flags"] if saved and not extra else extra)
    if saved and flags != saved["train_flags"] and any((exp / "runs").glob("*/metrics.jsonl")):
        raise Stop(f"{exp} was made with the train.py flags `{' '.join(saved['train_flags'])}`, "
                   f"this command passes `{' '.join(flags)}`: pass the same ones, or another --out")

    def pick(name, kind, fallback):
        text = getattr(args, name)
        if text is not None:
            return parse_list(text, "--" + name.replace("_", "-"), kind) if kind else \
                text.split(",")
        if name in design:
            return design[name]
        return saved.get(name, fallback) if saved else fallback
    arms = pick("arms", None, ["bf16", "nvfp4", "nvfp4_aqn", "bf16_aqn", "nvfp4_aqn_notis"])
    if any(a not in ARMS for a in arms) or len(set(arms)) != len(arms):
        raise Stop(f"--arms {args.arms}: give distinct names among {', '.join(ARMS)}")
    seeds = pick("seeds", int, list(range(5)))
    select_seeds = pick("select_seeds", int, [])
    if set(select_seeds) & set(seeds):
        raise Stop("--select-seeds and --seeds must not share a seed: a verdict seed must not "
                   "have chosen its learning rate")
    every_lr = pick("every_lr", None, [])
    if any(a not in arms for a in every_lr):
        raise Stop(f"--every-lr {args.every_lr}: name arms of --arms")
    lrs = pick("lrs", float, None)
    if lrs is None:
        raise Stop("--lrs is needed for a new experiment, e.g. --lrs 1e-4,3e-4,1e-3")
    v = {}
    for k, d in DEFAULTS.items():
        given = getattr(args, k)
        v[k] = given if given is not None else design.get(k, (saved or {}).get(k, d))
    for name, value in (("procs_per_gpu", args.procs_per_gpu), ("pass_k_n", v["pass_k_n"]),
                        ("entropy_samples", v["entropy_samples"])):
        if value < 1:
            raise Stop(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    in_range = 0 <= v["threshold_greedy"] <= 1 and 0 <= v["threshold_sampled"] <= 1
    if not in_range or v["pass_temperature"] <= 0:
        raise Stop("the thresholds are accuracies in [0, 1], and --pass-temperature must be > 0")
    import torch

    visible = torch.cuda.device_count()  # counts without making a CUDA context in this process
    gpus = visible if args.gpus is None else args.gpus
    if not 0 <= gpus <= visible:
        raise Stop(f"--gpus {gpus}: torch sees {visible} CUDA device(s) here; pass at most "
                   f"{visible}, or 0 for the CPU")
    if args.mps and not args.report_only:
        if gpus == 0:
            raise Stop("--mps shares GPUs between runs: it needs --gpus >= 1 (none here)")
        if shutil.which(jobs.MPS_CONTROL) is None:
            raise Stop(f"--mps needs {jobs.MPS_CONTROL} (the NVIDIA driver's utilities) on PATH: "
                       "install them, or leave out --mps")
    cfg = dict(out=args.out, design=args.design or (saved or {}).get("design"), arms=arms,
               seeds=seeds, select_seeds=select_seeds, every_lr=every_lr, lrs=lrs, gpus=gpus,
               procs_per_gpu=args.procs_per_gpu, **v, restart_partial=args.restart_partial,
               train_flags=flags)
    if args.report_only:  # the runs' devices and evaluations stay as saved
        return cfg | {k: saved[k] for k in POST_KEYS + ("gpus", "procs_per_gpu")}, []
    check_train_flags(flags, arms, lrs)
    visible_ids = os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(visible)))
    ids = visible_ids.split(",")
    slots = [ids[g] for _ in range(args.procs_per_gpu) for g in range(gpus)]
    return cfg, slots or [None] * args.procs_per_gpu


def execute(args, cfg: dict, exp: Path, slots: list) -> dict:
    """Plan and run until nothing is left that can be planned (the verdict runs of an arm become
    plannable once its selection runs are done). Returns {name: error} of the failed runs."""
    t0 = time.time()
    until = t0 + args.launch_until if args.launch_until is not None else None
    finish_by = t0 + args.finish_by if args.finish_by is not None else None
    if cfg["train_flags"] and "tiny" in cfg["train_flags"]:
        from util import tiny
        for seed in cfg["seeds"] + cfg["select_seeds"]:  # made per seed on first use: once, here
            tiny.tiny_model_dir(seed)
    mps = jobs.mps_start(sorted(set(slots))) if args.mps else None
    try:
        failed, ran = run_all(args, cfg, exp, slots, until, finish_by, mps)
    finally:
        if mps:
            jobs.mps_stop(mps)
    session = dict(started=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0)),
                   wall_s=time.time() - t0, devices=max(1, cfg["gpus"]),
                   procs_per_device=cfg["procs_per_gpu"], runs=ran, failed=len(failed),
                   part=args.part, mps=bool(mps))
    sessions = jobs.load_json(exp / "sessions.json", []) + [session]
    fsutil.atomic_write_text(exp / "sessions.json", json.dumps(sessions, indent=1))
    old = jobs.load_json(exp / "failed.json", {})
    done = {n for n, r in old.items() if jobs.run_state(exp / "runs" / n) == "trained"}
    failed_all = {k: v for k, v in old.items() if k not in done} | failed
    fsutil.atomic_write_text(exp / "failed.json", json.dumps(failed_all, indent=1))
    return failed


def run_all(args, cfg: dict, exp: Path, slots: list, until, finish_by, mps) -> tuple[dict, int]:
    """Plan and run rounds until nothing plannable is left or time is up: ({name: error}, runs
    started)."""
    failed, ran = {}, 0
    # --pack: rewritten while the runs go, so a machine lost midway leaves the finished ones
    refresh = (jobs.pack_often(exp, Path(args.pack), [Path(x) for x in args.pack_after])
               if args.pack else None)
    while True:
        todo, skipped = plan(cfg, exp, False)
        todo = [j for j in todo if j["name"] not in failed]
        print(f"{len(todo)} runs to do on {len(slots)} slot(s) "
              f"({', '.join(s or 'cpu' for s in slots)}); {skipped} finished runs skipped")
        if not todo:
            return failed, ran
        bad, left = jobs.run_jobs(todo, slots, exp, 1.0 / cfg["procs_per_gpu"],
                                  Path(__file__).resolve(), until, finish_by, mps, refresh)
        failed.update(bad)
        ran += len(todo) - left
        if left or until and time.time() > until or finish_by and time.time() > finish_by:
            return failed, ran


def hold_lock(exp: Path):
    """One scheduler per experiment folder: a second would start the same runs again and the two
    would delete each other's files. Returns the open lock file (the lock ends with the
    process)."""
    import fcntl

    f = open(exp / "lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        pid = f.read().strip() or "?"
        raise Stop(f"another qerl_ablation.py (pid {pid}) is running on {exp}: wait for it to end "
                   "or stop it (Ctrl-C keeps every run's last checkpoint), then run this again")
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f


def main(argv=None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    exp = Path(args.out).resolve()
    if args.worker:
        return jobs.worker(json.loads(args.worker))
    try:
        cfg, slots = resolve(args, extra, exp)
    except Stop as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("config:", json.dumps(cfg))
    failed = {}
    if args.dry_run:
        plan(cfg, exp, True)
        return 0
    if not args.report_only:
        exp.mkdir(parents=True, exist_ok=True)
        try:
            lock = hold_lock(exp)
        except Stop as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        fsutil.atomic_write_text(exp / "config.json", json.dumps(cfg, indent=1))
        failed = execute(args, cfg, exp, slots)
        lock.close()
    res = report(exp, cfg)
    for c in res["claims"]:
        print(f"{c['verdict']:>12}  {c['claim']} (lr {c['lr_text']}, {c['n']} seeds paired)")
    print(f"wrote {exp / 'results.md'}, {exp / 'results.json'} and {len(res['figures'])} "
          f"figure(s); {res['finished']} of {len(res['runs'])} runs finished")
    if args.pack:
        print(f"wrote {jobs.pack(exp, Path(args.pack), [Path(x) for x in args.pack_after])}")
    for name, err in failed.items():
        print(f"error: run {name} failed: {err}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
