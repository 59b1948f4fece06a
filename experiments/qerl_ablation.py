"""qerl_ablation.py: does quantization noise help exploration? QeRL's claims measured over arms x learning rates x seeds
with train.py's own loop, each claim judged by a paired 95% interval over seeds.

    # CPU smoke: 2 arms x 1 seed x 2 steps of the built-in tiny model (tests/test_ablation.py runs it)
    python experiments/qerl_ablation.py --out runs/ablation-smoke --arms bf16,nvfp4_aqn --seeds 0 --lrs 5e-3 \\
        --pass-k-n 4 --entropy-samples 2 --steps 2 --algo grpo --prompts-per-step 2 --group-size 4 \\
        --eval-limit 4 --max-new-tokens 8
    # the experiment: 5 arms x 2 learning rates x 8 seeds = 80 runs, 8 at once on each visible GPU
    python experiments/qerl_ablation.py --out runs/ablation --seeds 0-7 --lrs 5e-4,5e-3 --procs-per-gpu 8 \\
        --model MODEL_DIR --task TASK --steps 200 --eval-every 20 --save-every 20
    python experiments/qerl_ablation.py --out runs/ablation --report-only     # redo results.* and the figures alone

Arms (ARMS): bf16 + LoRA, NVFP4 + LoRA, NVFP4 + LoRA + AQN (QeRL), bf16 + LoRA + AQN, and NVFP4 + LoRA + AQN without
the importance-weight (TIS) correction. Every other flag goes to train.py, the same for every run; train.py draws
prompts, samples and noise from (--seed, step), so one seed means the same data order in every arm.

One run = one worker process: `train.main` (run folder OUT/runs/<arm>-lr<lr>-s<seed>), then the evaluations train.py
does not make, in post.json: the entropy probe (the policy's mean token entropy before any update over its own
--entropy-samples completions of each held-out prompt, at a fixed sampling seed; AQN arms also at sigma_start, the
noise of their first noisy stage) and pass@k from --pass-k-n samples at step 0 and at every checkpoint (eval.evaluate,
the unbiased estimator). Workers run --procs-per-gpu at a time on each GPU (CUDA_VISIBLE_DEVICES), or on the CPU. A
rerun skips finished runs, resumes a partial one from its last checkpoint (or starts it again: --restart-partial) and
names each failed run with its error while the others go on. The report (results.json, results.md, fig_lr<lr>.png)
reads only the run folders, so --report-only redoes it alone. GPU time: each attempt's wall time x the share of its
GPU (1 / --procs-per-gpu), summed per arm and in all; beside it, the machine time held (wall time x GPUs).
Leaves out: several nodes, queueing systems, vLLM for the post-run evaluations (always the built-in engine).
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # the stage files and stats.py, whatever the working folder

from util import fsutil  # noqa: E402
import stats  # noqa: E402

# name: (label, train.py flags). The four QeRL arms, then QeRL's arm without the TIS correction.
ARMS = {"bf16": ("bf16 + LoRA", ["--base", "bf16", "--no-aqn"]),
        "nvfp4": ("NVFP4 + LoRA", ["--base", "nvfp4", "--no-aqn"]),
        "nvfp4_aqn": ("NVFP4 + LoRA + AQN (QeRL)", ["--base", "nvfp4", "--aqn"]),
        "bf16_aqn": ("bf16 + LoRA + AQN", ["--base", "bf16", "--aqn"]),
        "nvfp4_aqn_notis": ("NVFP4 + LoRA + AQN, no TIS", ["--base", "nvfp4", "--aqn", "--tis-cap", "0"])}
CONTROLLED = {"base": "--arms", "aqn": "--arms", "lr": "--lrs", "seed": "--seeds", "out": "this script's --out",
              "device": "--gpus (0 = CPU)", "resume": "a rerun of the same command", "plot": "--report-only"}
POST_KEYS = ("pass_k_n", "pass_temperature", "entropy_samples")
# defaults of the flags that, left out, keep the experiment's saved value (so a rerun needs no flag repeated)
DEFAULTS = dict(threshold_greedy=0.5, threshold_sampled=0.3, pass_k_n=8, pass_temperature=1.0, entropy_samples=4)


class Stop(Exception):
    """Bad input: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,  # --seed is train.py's
                                 epilog="Any other flag goes to train.py, for every run (python train.py --help).")
    ap.add_argument("--out", required=True, help="experiment folder: runs/, logs/, timing/, results.*, figures")
    ap.add_argument("--arms", default=None, help=f"comma list of: {', '.join(ARMS)} (default: all, or the saved)")
    ap.add_argument("--seeds", default=None, help="seeds, e.g. 0-4 or 0,2,5 (default: 0-4, or the saved)")
    ap.add_argument("--lrs", default=None, help="peak learning rates, e.g. 5e-4,5e-3 (needed for a new experiment)")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: every visible one; 0 = CPU)")
    ap.add_argument("--procs-per-gpu", type=int, default=1, help="runs at once on each GPU, or on the CPU with "
                                                                 "--gpus 0 (default: 1)")
    ap.add_argument("--threshold-greedy", type=float, help="held-out greedy accuracy whose first evaluation step "
                                                           "is reported (default: 0.5, or the saved)")
    ap.add_argument("--threshold-sampled", type=float, help=f"sampled accuracy (a trailing mean of {stats.WINDOW} "
                                                            "steps) whose first step is reported (default: 0.3, or "
                                                            "the saved)")
    ap.add_argument("--pass-k-n", type=int, help="samples per held-out prompt for pass@k (k = 1, 2, 4, ... <= n) at "
                                                 "step 0 and every checkpoint (default: 8, or the saved)")
    ap.add_argument("--pass-temperature", type=float, help="sampling temperature of pass@k (default: 1.0, or the "
                                                           "saved)")
    ap.add_argument("--entropy-samples", type=int, help="completions per held-out prompt in the entropy probe "
                                                        "(default: 4, or the saved)")
    ap.add_argument("--restart-partial", action="store_true", help="start partial runs again, not resume them")
    ap.add_argument("--report-only", action="store_true", help="launch nothing; redo the report from the runs")
    ap.add_argument("--dry-run", action="store_true", help="print each run's state and command; launch nothing")
    ap.add_argument("--worker", default=None, help="internal: run the one job this JSON describes")
    return ap


def parse_list(text: str, flag: str, kind) -> list:
    """'0-4,7' -> [0, 1, 2, 3, 4, 7] (ints), '5e-4,5e-3' -> floats; duplicates and bad items are one-line errors."""
    out = []
    try:
        for part in (p.strip() for p in text.split(",")):
            if kind is int and "-" in part[1:]:
                a, b = part.split("-", 1)
                out += list(range(int(a), int(b) + 1))
            else:
                out.append(kind(part))
    except ValueError:
        raise Stop(f"{flag} {text!r}: expected a comma list of {kind.__name__}s"
                   + (" or ranges like 0-4" if kind is int else "")) from None
    if not out or len(set(out)) != len(out) or (kind is float and min(out) <= 0):
        raise Stop(f"{flag} {text!r}: give distinct values" + (", all > 0" if kind is float else ""))
    return out


def check_train_flags(extra: list[str], arms: list[str], lrs: list[float]) -> None:
    """Every arm's train.py config is checked here, before any process starts (one line for the first problem)."""
    from trainer import config as tc

    def fail(msg):
        raise Stop(f"train.py flags: {msg}")
    ap = tc.build_parser(suppress=True)
    ap.error = fail  # argparse would print its usage and exit
    given, unknown = ap.parse_known_args(extra)
    if unknown:
        raise Stop(f"unknown flag(s) {' '.join(unknown)}: neither this script's (--help) nor train.py's "
                   "(python train.py --help)")
    for name in sorted(set(vars(given)) & set(CONTROLLED)):
        raise Stop(f"--{name.replace('_', '-')} is set by this script for each run: use {CONTROLLED[name]}")
    if getattr(given, "tis_cap", 1.0) <= 0:
        raise Stop("--tis-cap <= 0 turns the correction off in every arm; the arm nvfp4_aqn_notis is the one "
                   "without it")
    for arm in arms:
        try:
            cfg = tc.parse_args(extra + ARMS[arm][1] + ["--lr", str(lrs[0])])[0]
            tc.check_config(tc.apply_model_defaults(cfg))
        except (tc.Stop, ValueError) as e:
            raise Stop(f"arm {arm}: {e}") from None


# ----------------------------------------------------------------------------------------------------
# One run: train.py, then the post-run evaluations (in a worker process)

def read_rows(path: Path) -> list[dict]:
    """The rows of a JSONL file; a killed writer's partial last line is left out."""
    rows = []
    for line in Path(path).read_text().splitlines() if Path(path).exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def load_json(path: Path, default):
    return json.loads(path.read_text()) if path.exists() else default


def run_state(run: Path) -> str:
    """'trained' (its final evaluation is logged), 'resume' (a checkpoint before the last step) or 'new'."""
    if not (run / "config.json").exists() or not (run / "metrics.jsonl").exists():
        return "new"
    steps = json.loads((run / "config.json").read_text())["steps"]
    rows = read_rows(run / "metrics.jsonl")
    if any(r.get("step") == steps and "eval_accuracy" in r and "reward" not in r for r in rows):
        return "trained"  # the final evaluation's row (a mid-run evaluation shares its step's training row)
    pointer = run / "checkpoints" / "latest"
    name = pointer.read_text().strip() if pointer.exists() else ""
    ok = name.startswith("step_") and (run / "checkpoints" / name / "state.pt").exists()
    return "resume" if ok and int(name[5:]) < steps else "new"


def post_done(run: Path, settings: dict) -> bool:
    return load_json(run / "post.json", {}).get("settings") == settings


def probe_entropy(cfg, model, engine, prompts, stops, n: int, sigma: float) -> float:
    """The policy's mean token entropy over its own n completions of each prompt (a fixed sampling seed), with AQN
    noise of this sigma in the norms of both the sampling and the entropy forward when sigma > 0."""
    import torch

    import noise
    import ppo
    import train

    dev = model.model.norm.weight.device
    z = noise.draw(model, sigma, torch.Generator().manual_seed(train.seeded(cfg, "probe-noise")))
    samples = engine.generate(prompts, n=n, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                              top_p=cfg.top_p, stop_token_ids=stops, seed=train.seeded(cfg, "probe"), noise=z)
    groups = [dict(prompt=p, samples=samples[i * n:(i + 1) * n]) for i, p in enumerate(prompts)]  # group-major
    b = ppo.make_batch(groups, torch.zeros(len(prompts), n), dev)
    total = count = 0.0
    with torch.no_grad():
        for c in torch.arange(b["ids"].shape[0], device=dev).split(cfg.micro_batch):
            _, ent = ppo.policy_logprobs(model, b, c, cfg.temperature, entropy=True, noise=z)       # (s, T)
            total += (ent * b["mask"][c]).sum().item()
            count += b["mask"][c].sum().item()
    return total / max(count, 1.0)


def post_run(run: Path, settings: dict) -> dict:
    """The entropy probe before any update, and pass@k at step 0 and at every checkpoint of a trained run."""
    import torch

    import eval as evaluation
    import lora
    import rollout
    from tasks import data
    from trainer import prepare
    from trainer.config import Config

    t0 = time.time()
    cfg = Config(**json.loads((run / "config.json").read_text()))
    _, eval_rows = prepare.load_data(cfg)  # the held-out rows training used
    dev = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model_dir, tok, model = prepare.load_policy(cfg, dev)  # the arm's base; LoRA starts at B = 0, so this is step 0
    stops = data.stop_token_ids(tok, model_dir)
    prompts = [data.prompt_token_ids(tok, r["question"], cfg.fmt) for r in eval_rows]
    engine = rollout.Engine(model, max_len=max(map(len, prompts)) + cfg.max_new_tokens,
                            max_batch=cfg.prompts_per_step * cfg.group_size)  # the size training ran with
    n = settings["entropy_samples"]
    out = dict(settings=settings, probe_prompts=len(prompts), noisy_sigma=cfg.sigma_start if cfg.aqn else None,
               entropy_probe=probe_entropy(cfg, model, engine, prompts, stops, n, 0.0),
               entropy_probe_noisy=probe_entropy(cfg, model, engine, prompts, stops, n, cfg.sigma_start)
               if cfg.aqn else None, pass_at_k={})
    kept = sorted(p for p in (run / "checkpoints").glob("step_*") if (p / "adapter").is_dir())
    for step, adapter in [(0, None)] + [(int(p.name[5:]), p / "adapter") for p in kept]:
        if adapter is not None:
            lora.load_adapter(model, adapter)
        s = evaluation.evaluate(engine, tok, eval_rows, n=settings["pass_k_n"],
                                temperature=settings["pass_temperature"], top_p=cfg.top_p,
                                max_new_tokens=cfg.max_new_tokens, fmt=cfg.fmt, seed=cfg.seed, stop_ids=stops,
                                progress=False, out_dir=str(run / "passk" / f"step_{step:06d}"))
        out["pass_at_k"][str(step)] = {k: v for k, v in s.items() if k.startswith("pass@")}
    out["device"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return out | dict(seconds=time.time() - t0)


def worker(spec: dict) -> int:
    """Train (new, resumed or restarted), then the post-run evaluations. Returns the exit code."""
    import train
    from trainer.config import Stop as TrainStop

    run = Path(spec["run"])
    state = run_state(run)
    if state != "trained":
        if state == "resume" and not spec["restart_partial"]:
            rows = read_rows(run / "metrics.jsonl")  # train.py's resume reads every line: drop a partial last one
            fsutil.atomic_write_text(run / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
            argv = ["--resume", str(run)]
        else:
            shutil.rmtree(run, ignore_errors=True)  # a folder of ours without a usable checkpoint
            argv = spec["train_argv"]
        print(f"{run.name}: {'resuming' if state == 'resume' else 'starting'}: train.py {' '.join(argv)}", flush=True)
        rc = train.main(argv)
        if rc:
            return rc
    if post_done(run, spec["post"]):
        return 0
    try:
        result = post_run(run, spec["post"])
    except (TrainStop, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: the post-run evaluation of {run.name} failed: {e}", file=sys.stderr)
        return 4
    fsutil.atomic_write_text(run / "post.json", json.dumps(result, indent=1))
    print(f"{run.name}: entropy probe {result['entropy_probe']:.4f}; pass@k at steps {', '.join(result['pass_at_k'])}")
    return 0


# ----------------------------------------------------------------------------------------------------
# The scheduler: a fixed list of slots (a GPU id, or None for the CPU), one worker process per slot at a time

def last_error(log: Path, offset: int) -> str:
    """The failed attempt's `error:` line, else its last line (a traceback's exception)."""
    lines = [x.strip() for x in log.read_bytes()[offset:].decode(errors="replace").splitlines() if x.strip()]
    return ([x for x in lines if x.startswith("error:")] or lines or ["no output"])[-1][:300]


def add_time(exp: Path, name: str, seconds: float, share: float, slot) -> None:
    """Add an attempt's wall time to the run's (a restarted run's lost attempts cost time too)."""
    path = exp / "timing" / f"{name}.json"
    t = load_json(path, dict(seconds=0.0, gpu_seconds=0.0, attempts=0))
    t.update(seconds=t["seconds"] + seconds, gpu_seconds=t["gpu_seconds"] + seconds * share,
             attempts=t["attempts"] + 1, device="cpu" if slot is None else f"cuda:{slot}")
    fsutil.atomic_write_text(path, json.dumps(t))


def run_jobs(jobs: list[dict], slots: list, exp: Path, share: float) -> dict:
    """Run every job on the slots; returns {name: error} of the failed ones. Ctrl-C stops the workers (each keeps
    its last checkpoint) and returns."""
    from tqdm import tqdm

    threads = max(1, (os.cpu_count() or 1) // len(slots))  # workers must not each take every core
    pending, running, failed = list(jobs), {}, {}
    bar = tqdm(total=len(jobs), desc="runs", unit="run")

    def finish(slot, error=None):
        job, proc, t0, f, log, offset = running.pop(slot)
        f.close()
        add_time(exp, job["name"], time.time() - t0, share, slots[slot])
        if error or proc.returncode:
            failed[job["name"]] = error or f"exit {proc.returncode}: {last_error(log, offset)} (log: {log})"
            tqdm.write(f"FAILED {job['name']}: {failed[job['name']]}")
        bar.update(1)
        bar.set_postfix_str(f"running {len(running)}, failed {len(failed)}")
    try:
        while pending or running:
            for slot in [s for s in range(len(slots)) if s not in running][:len(pending)]:
                job = pending.pop(0)
                log = exp / "logs" / f"{job['name']}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                offset = log.stat().st_size if log.exists() else 0
                f = open(log, "a")  # one log per run, every attempt appended
                f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} on {slots[slot] or 'cpu'}\n")
                f.flush()
                env = dict(os.environ, TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES=slots[slot] or "")
                env.setdefault("OMP_NUM_THREADS", str(threads))
                proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--out", str(exp),
                                         "--worker", json.dumps(job)], stdout=f, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)  # so Ctrl-C reaches it only through us
                running[slot] = (job, proc, time.time(), f, log, offset)
            time.sleep(0.2)
            for slot in [s for s, r in running.items() if r[1].poll() is not None]:
                finish(slot)
    except KeyboardInterrupt:
        for job, proc, *_ in running.values():
            proc.send_signal(signal.SIGINT)  # train.py stops cleanly at its last checkpoint
        for slot in list(running):
            running[slot][1].wait()
            finish(slot, "interrupted")
        print("\ninterrupted: rerun the same command to resume the stopped runs", file=sys.stderr)
    bar.close()
    return failed


# ----------------------------------------------------------------------------------------------------
# The report: per-run numbers, per arm x lr aggregates, paired comparisons, claims, figures

def run_name(arm: str, lr: float, seed: int) -> str:
    return f"{arm}-lr{lr:g}-s{seed}"


def summarize_run(run: Path, thr_greedy: float, thr_sampled: float) -> dict | None:
    """A finished run's numbers (stats.run_measures), None when its final evaluation is missing. The greedy accuracy
    at each evaluation step is read from every sample train.py kept (eval/step_N/samples.jsonl)."""
    if run_state(run) != "trained":
        return None
    evals = {}
    for d in sorted((run / "eval").glob("step_*")):
        samples = read_rows(d / "samples.jsonl")
        if samples:
            evals[int(d.name[5:])] = sum(bool(x["correct"]) for x in samples) / len(samples)
    cfg = json.loads((run / "config.json").read_text())
    out = stats.run_measures(cfg["steps"], read_rows(run / "metrics.jsonl"), evals, load_json(run / "post.json", {}),
                             thr_greedy, thr_sampled, stats.WINDOW)
    return out | dict(config={k: cfg[k] for k in ("model", "task", "algo", "steps", "prompts_per_step",
                                                  "group_size", "eval_limit", "eval_every", "save_every")})


def report(exp: Path, cfg: dict) -> dict:
    """Read every run folder of the grid; write results.json, results.md and one figure per lr."""
    arms, lrs, seeds = cfg["arms"], cfg["lrs"], cfg["seeds"]
    failed = load_json(exp / "failed.json", {})
    names = {(a, lr, s): run_name(a, lr, s) for a in arms for lr in lrs for s in seeds}
    runs = {k: dict(name=n, timing=load_json(exp / "timing" / f"{n}.json", {}),
                    summary=summarize_run(exp / "runs" / n, cfg["threshold_greedy"], cfg["threshold_sampled"]))
            for k, n in names.items()}
    groups = stats.aggregate(runs, arms, lrs, seeds)
    comps, claims = stats.compare(runs, arms, lrs, seeds)
    sessions = load_json(exp / "sessions.json", [])
    gpu_s = lambda arm: sum(r["timing"].get("gpu_seconds", 0) for k, r in runs.items() if k[0] == arm)  # noqa: E731
    res = dict(config=cfg, arms={a: dict(label=ARMS[a][0], flags=ARMS[a][1]) for a in arms},
               runs={r["name"]: dict(arm=k[0], lr=k[1], seed=k[2], timing=r["timing"], error=failed.get(r["name"]),
                                     **(r["summary"] or {})) for k, r in runs.items()},
               groups=groups, claims=claims, comparisons=comps, sessions=sessions,
               finished=sum(r["summary"] is not None for r in runs.values()),
               devices=sorted({r["summary"]["device"] for r in runs.values() if (r["summary"] or {}).get("device")}),
               device_kind="GPU" if cfg["gpus"] else "CPU",
               gpu_minutes=dict(per_arm={a: gpu_s(a) / 60 for a in arms}, total=sum(map(gpu_s, arms)) / 60,
                                held=sum(x["wall_s"] * x["devices"] for x in sessions) / 60))
    for lr in lrs:
        png = stats.figure(groups, {a: ARMS[a][0] for a in arms}, lr)
        fsutil.atomic_write_bytes(exp / f"fig_lr{lr:g}.png", png)
    res = stats.clean(res)
    fsutil.atomic_write_text(exp / "results.json", json.dumps(res, indent=1))
    fsutil.atomic_write_text(exp / "results.md", stats.markdown(res))
    return res


# ----------------------------------------------------------------------------------------------------
# The driver

def resolve(args, extra: list[str], exp: Path) -> tuple[dict, list]:
    """The flat config (checked; train.py flags and grid flags left out come from the saved config) and the worker
    slots."""
    saved = load_json(exp / "config.json", None)
    if args.report_only and saved is None:
        raise Stop(f"{exp} holds no experiment (no config.json): pass the folder a run of this script made")
    flags = saved["train_flags"] if saved and not extra else extra  # none given: the saved ones
    if saved and flags != saved["train_flags"] and any((exp / "runs").glob("*/metrics.jsonl")):
        raise Stop(f"{exp} was made with the train.py flags `{' '.join(saved['train_flags'])}`, this command passes "
                   f"`{' '.join(flags)}`: pass the same ones, or another --out")
    arms = args.arms.split(",") if args.arms else saved["arms"] if saved else list(ARMS)
    if any(a not in ARMS for a in arms) or len(set(arms)) != len(arms):
        raise Stop(f"--arms {args.arms}: give distinct names among {', '.join(ARMS)}")
    seeds = parse_list(args.seeds, "--seeds", int) if args.seeds else saved["seeds"] if saved else list(range(5))
    if args.lrs is None and saved is None:
        raise Stop("--lrs is needed for a new experiment, e.g. --lrs 5e-4,5e-3 (two, one 10x the other)")
    lrs = parse_list(args.lrs, "--lrs", float) if args.lrs else saved["lrs"]
    v = {k: getattr(args, k) if getattr(args, k) is not None else (saved or {}).get(k, d) for k, d in DEFAULTS.items()}
    for name, value in (("procs_per_gpu", args.procs_per_gpu), ("pass_k_n", v["pass_k_n"]),
                        ("entropy_samples", v["entropy_samples"])):
        if value < 1:
            raise Stop(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not (0 <= v["threshold_greedy"] <= 1 and 0 <= v["threshold_sampled"] <= 1) or v["pass_temperature"] <= 0:
        raise Stop("the thresholds are accuracies in [0, 1], and --pass-temperature must be > 0")
    import torch

    visible = torch.cuda.device_count()  # counts without making a CUDA context in this process
    gpus = visible if args.gpus is None else args.gpus
    if not 0 <= gpus <= visible:
        raise Stop(f"--gpus {gpus}: torch sees {visible} CUDA device(s) here; pass at most {visible}, or 0 for the CPU")
    cfg = dict(out=str(exp), arms=arms, seeds=seeds, lrs=lrs, gpus=gpus, procs_per_gpu=args.procs_per_gpu, **v,
               restart_partial=args.restart_partial, train_flags=flags)
    if args.report_only:  # the runs' devices and evaluations stay as saved
        return cfg | {k: saved[k] for k in POST_KEYS + ("gpus", "procs_per_gpu")}, []
    check_train_flags(flags, arms, lrs)
    ids = (os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(visible)))).split(",")
    return cfg, [ids[g] for _ in range(args.procs_per_gpu) for g in range(gpus)] or [None] * args.procs_per_gpu


def plan(cfg: dict, exp: Path, dry_run: bool) -> tuple[list, int]:
    """The jobs of the runs left to do (seeds outermost, so the first to finish cover every arm) and the number of
    finished runs skipped. dry_run: print each run's state and command instead."""
    post, jobs, skipped = {k: cfg[k] for k in POST_KEYS}, [], 0
    for seed in cfg["seeds"]:
        for lr in cfg["lrs"]:
            for arm in cfg["arms"]:
                name = run_name(arm, lr, seed)
                run = exp / "runs" / name
                argv = cfg["train_flags"] + ARMS[arm][1] + ["--lr", str(lr), "--seed", str(seed), "--out", str(run)]
                argv += [] if cfg["gpus"] else ["--device", "cpu"]
                state, evaluated = run_state(run), post_done(run, post)
                if dry_run:
                    print(f"{name}: {state}{' and evaluated' if evaluated else ''}: python train.py {' '.join(argv)}")
                elif state == "trained" and evaluated:
                    skipped += 1
                else:
                    jobs.append(dict(name=name, run=str(run), train_argv=argv, post=post,
                                     restart_partial=cfg["restart_partial"]))
    return jobs, skipped


def main(argv=None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    exp = Path(args.out).resolve()
    if args.worker:
        return worker(json.loads(args.worker))
    try:
        cfg, slots = resolve(args, extra, exp)
    except Stop as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("config:", json.dumps(cfg))
    failed = {}
    if not args.report_only:
        jobs, skipped = plan(cfg, exp, args.dry_run)
        if args.dry_run:
            return 0
        fsutil.atomic_write_text(exp / "config.json", json.dumps(cfg, indent=1))
        print(f"{len(jobs)} runs to do on {len(slots)} slot(s) ({', '.join(s or 'cpu' for s in slots)}); "
              f"{skipped} finished runs skipped")
        if jobs:
            from trainer import config as tc

            if tc.parse_args(cfg["train_flags"])[0].model == "tiny":  # made per seed on first use: once, here
                from util import tiny
                for seed in cfg["seeds"]:
                    tiny.tiny_model_dir(seed)
            t0 = time.time()
            failed = run_jobs(jobs, slots, exp, 1.0 / cfg["procs_per_gpu"])
            fsutil.atomic_write_text(exp / "sessions.json", json.dumps(load_json(exp / "sessions.json", []) + [dict(
                started=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0)), wall_s=time.time() - t0,
                devices=max(1, cfg["gpus"]), procs_per_device=cfg["procs_per_gpu"], runs=len(jobs),
                failed=len(failed))], indent=1))
            done = {j["name"] for j in jobs} - set(failed)
            failed_all = {k: v for k, v in load_json(exp / "failed.json", {}).items() if k not in done} | failed
            fsutil.atomic_write_text(exp / "failed.json", json.dumps(failed_all, indent=1))
    res = report(exp, cfg)
    for c in res["claims"]:
        print(f"{c['verdict']:>12}  {c['claim']} (lr {c['lr']:g}, {c['n']} seeds paired)")
    print(f"wrote {exp / 'results.md'}, {exp / 'results.json'} and {len(cfg['lrs'])} figure(s); "
          f"{res['finished']} of {len(res['runs'])} runs finished")
    for name, err in failed.items():
        print(f"error: run {name} failed: {err}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
