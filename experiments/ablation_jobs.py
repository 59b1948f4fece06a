"""ablation_jobs.py: the runs of experiments/qerl_ablation.py: one run's work (train.py, then the
evaluations train.py does not make) and the scheduler that runs many of them on the GPUs.

    python experiments/qerl_ablation.py --out runs/ablation ...     # plans the runs, then runs them

One run = one worker process (`qerl_ablation.py --worker JSON`): `train.main` in the run folder
OUT/runs/<arm>-lr<lr>-s<seed>, then post.json: the entropy probe (the policy's mean token entropy
before any update over its own --entropy-samples completions of each held-out prompt, at a fixed
sampling seed; AQN arms also at sigma_start) and pass@k from --pass-k-n samples a prompt before any
update and after the last step (eval.evaluate, the unbiased estimator; the numbers before any
update are the same for every run of a base and seed, so one run computes them: step0/); a run
that only chooses a learning rate (post None) skips them: the rule reads its training curve alone.
A run that was stopped resumes from its last checkpoint; a trained run brought back by --pack
(numbers, no weights) whose evaluations are still missing trains again. The scheduler keeps a
fixed list of slots (a GPU id, or None for the CPU) busy, one worker a slot, starts no run after
--launch-until nor one that would end after --finish-by, names each failed run with its error
while the others go on, and adds each attempt's wall time x its GPU share to timing/.
Leaves out: several nodes, queueing systems, vLLM for the post-run evaluations.
"""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from util import fsutil


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
    """'trained' (its final evaluation is logged), 'resume' (a checkpoint before the last step) or
    'new'."""
    if not (run / "config.json").exists() or not (run / "metrics.jsonl").exists():
        return "new"
    steps = json.loads((run / "config.json").read_text())["steps"]
    rows = read_rows(run / "metrics.jsonl")
    # the final evaluation's row (a mid-run evaluation shares its step's training row)
    if any(r.get("step") == steps and "eval_accuracy" in r and "reward" not in r for r in rows):
        return "trained"
    pointer = run / "checkpoints" / "latest"
    name = pointer.read_text().strip() if pointer.exists() else ""
    ok = name.startswith("step_") and (run / "checkpoints" / name / "state.pt").exists()
    return "resume" if ok and int(name[5:]) < steps else "new"


def post_done(run: Path, settings: dict | None) -> bool:
    """Whether the post-run evaluations this run needs are written (none needed: settings None)."""
    return settings is None or load_json(run / "post.json", {}).get("settings") == settings


def final_adapter(run: Path) -> Path:
    """The adapter of the run's last step, which the post-run pass@k reads."""
    steps = json.loads((run / "config.json").read_text())["steps"]
    return run / "checkpoints" / f"step_{steps:06d}" / "adapter"


# --------------------------------------------------------------------------------------------------
# One run: train.py, then the post-run evaluations (in a worker process)

def probe_entropy(cfg, model, engine, prompts, stops, n: int, sigma: float) -> float:
    """The policy's mean token entropy over its own n completions of each prompt (a fixed sampling
    seed), with AQN noise of this sigma in the norms of both the sampling and the entropy forward
    when sigma > 0."""
    import torch

    import noise
    import ppo
    import train

    dev = model.model.norm.weight.device
    gen = torch.Generator().manual_seed(train.seeded(cfg, "probe-noise"))
    z = noise.draw(model, sigma, gen)
    samples = engine.generate(prompts, n=n, max_new_tokens=cfg.max_new_tokens,
                              temperature=cfg.temperature, top_p=cfg.top_p, stop_token_ids=stops,
                              seed=train.seeded(cfg, "probe"), noise=z)
    # group-major: the n samples of prompt i at i * n ...
    groups = [dict(prompt=p, samples=samples[i * n:(i + 1) * n]) for i, p in enumerate(prompts)]
    b = ppo.make_batch(groups, torch.zeros(len(prompts), n), dev)
    total = count = 0.0
    with torch.no_grad():
        for c in torch.arange(b["ids"].shape[0], device=dev).split(cfg.micro_batch):
            _, ent = ppo.policy_logprobs(model, b, c, cfg.temperature, entropy=True,
                                         noise=z)                                    # (s, T)
            total += (ent * b["mask"][c]).sum().item()
            count += b["mask"][c].sum().item()
    return total / max(count, 1.0)


@contextlib.contextmanager
def step0_cache(run: Path, cfg, settings: dict):
    """What every run of one base and seed shares before its first update: the entropy probe
    without noise and pass@k at step 0 (LoRA's B starts at 0, so the policy is the base's, whatever
    the arm or learning rate). Yields (the cached dict or None, a function that stores it); the
    runs of a seed end together, so one computes it under a file lock while the others wait for
    it instead of computing it again."""
    import fcntl
    import hashlib

    key = dict(settings=settings, base=cfg.base, seed=cfg.seed, model=cfg.model,
               eval_task=cfg.eval_task, eval_limit=cfg.eval_limit, fmt=cfg.fmt, top_p=cfg.top_p,
               max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    folder = run.parent.parent / "step0"
    folder.mkdir(exist_ok=True)
    path = folder / f"{cfg.base}-s{cfg.seed}-{digest}.json"
    with open(folder / f"{path.stem}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)                       # released when the file closes
        cached = load_json(path, None)

        def store(value: dict):
            fsutil.atomic_write_text(path, json.dumps(dict(key=key, **value), indent=1))
        yield cached, store


def post_run(run: Path, settings: dict) -> dict:
    """The entropy probe before any update, and pass@k before any update and after the last step
    of a trained run; the step-0 numbers once per base and seed (step0_cache)."""
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
    # the arm's base; LoRA starts at B = 0, so this is step 0
    model_dir, tok, model = prepare.load_policy(cfg, dev)
    stops = data.stop_token_ids(tok, model_dir)
    prompts = [data.prompt_token_ids(tok, r["question"], cfg.fmt) for r in eval_rows]
    # the batch training ran with
    engine = rollout.Engine(model, max_len=max(map(len, prompts)) + cfg.max_new_tokens,
                            max_batch=cfg.prompts_per_step * cfg.group_size)
    n = settings["entropy_samples"]

    def pass_at_k(step: int) -> dict:
        s = evaluation.evaluate(engine, tok, eval_rows, n=settings["pass_k_n"],
                                temperature=settings["pass_temperature"], top_p=cfg.top_p,
                                max_new_tokens=cfg.max_new_tokens, fmt=cfg.fmt, seed=cfg.seed,
                                stop_ids=stops, progress=False,
                                out_dir=str(run / "passk" / f"step_{step:06d}"))
        return {k: v for k, v in s.items() if k.startswith("pass@")}

    with step0_cache(run, cfg, settings) as (step0, store):
        if step0 is None:  # before any update
            step0 = dict(entropy_probe=probe_entropy(cfg, model, engine, prompts, stops, n, 0.0),
                         pass_at_k=pass_at_k(0))
            store(step0)
    out = dict(settings=settings, probe_prompts=len(prompts),
               noisy_sigma=cfg.sigma_start if cfg.aqn else None,
               entropy_probe=step0["entropy_probe"], entropy_probe_noisy=None,
               pass_at_k={"0": step0["pass_at_k"]})
    if cfg.aqn:
        out["entropy_probe_noisy"] = probe_entropy(cfg, model, engine, prompts, stops, n,
                                                   cfg.sigma_start)
    # after the last update (the checkpoint of the final step)
    lora.load_adapter(model, final_adapter(run))
    out["pass_at_k"][str(cfg.steps)] = pass_at_k(cfg.steps)
    out["device"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return out | dict(seconds=time.time() - t0)


def worker(spec: dict) -> int:
    """Train (new, resumed or restarted), then the post-run evaluations. Returns the exit code."""
    import train
    from trainer.config import Stop as TrainStop

    run = Path(spec["run"])
    state = run_state(run)
    if state == "trained" and not post_done(run, spec["post"]) and not final_adapter(run).exists():
        state = "new"  # its numbers came back from another machine without the weights
    if state != "trained":
        if state == "resume" and not spec["restart_partial"]:
            # train.py's resume reads every line: drop a partial last one
            rows = read_rows(run / "metrics.jsonl")
            text = "".join(json.dumps(r) + "\n" for r in rows)
            fsutil.atomic_write_text(run / "metrics.jsonl", text)
            argv = ["--resume", str(run)]
        else:
            shutil.rmtree(run, ignore_errors=True)  # a folder of ours without a usable checkpoint
            argv = spec["train_argv"]
        verb = "resuming" if state == "resume" else "starting"
        print(f"{run.name}: {verb}: train.py {' '.join(argv)}", flush=True)
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
    steps = ", ".join(result["pass_at_k"])
    print(f"{run.name}: entropy probe {result['entropy_probe']:.4f}; pass@k at steps {steps}")
    return 0


# --------------------------------------------------------------------------------------------------
# The scheduler: a fixed list of slots (a GPU id, or None for the CPU), one worker a slot at a time

def last_error(log: Path, offset: int) -> str:
    """The failed attempt's `error:` line, else its last line (a traceback's exception)."""
    text = log.read_bytes()[offset:].decode(errors="replace")
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    return ([x for x in lines if x.startswith("error:")] or lines or ["no output"])[-1][:300]


def add_time(exp: Path, name: str, seconds: float, share: float, slot) -> None:
    """Add an attempt's wall time to the run's (a restarted run's lost attempts cost time too)."""
    path = exp / "timing" / f"{name}.json"
    t = load_json(path, dict(seconds=0.0, gpu_seconds=0.0, attempts=0))
    t.update(seconds=t["seconds"] + seconds, gpu_seconds=t["gpu_seconds"] + seconds * share,
             attempts=t["attempts"] + 1, device="cpu" if slot is None else f"cuda:{slot}")
    fsutil.atomic_write_text(path, json.dumps(t))


def run_jobs(jobs: list[dict], slots: list, exp: Path, share: float, script: Path,
             launch_until: float | None = None, finish_by: float | None = None,
             mps: dict | None = None, on_finish=None) -> tuple[dict, int]:
    """Run the jobs on the slots, starting none after `launch_until` and none that would end after
    `finish_by` (time.time() values; a run's length judged by the longest one finished in this
    call, so the first wave always starts). Returns ({name: error} of the failed runs, the number
    of jobs left unstarted). Ctrl-C stops the workers (each keeps its last checkpoint) and
    returns. mps: {GPU id: the client environment of its MPS daemon} (mps_start), or None.
    on_finish: called with no argument after each round of the loop in which a run finished."""
    from tqdm import tqdm

    threads = max(1, (os.cpu_count() or 1) // len(slots))  # workers must not each take every core
    pending, running, failed = list(jobs), {}, {}
    lengths = []  # wall seconds of the runs finished in this call
    bar = tqdm(total=len(jobs), desc="runs", unit="run")

    def finish(slot, error=None):
        job, proc, t0, f, log, offset = running.pop(slot)
        f.close()
        add_time(exp, job["name"], time.time() - t0, share, slots[slot])
        if not (error or proc.returncode):
            lengths.append(time.time() - t0)
        if error or proc.returncode:
            failed[job["name"]] = (error or f"exit {proc.returncode}: {last_error(log, offset)} "
                                            f"(log: {log})")
            tqdm.write(f"FAILED {job['name']}: {failed[job['name']]}")
        bar.update(1)
        bar.set_postfix_str(f"running {len(running)}, failed {len(failed)}")

    def start(slot):
        job = pending.pop(0)
        log = exp / "logs" / f"{job['name']}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        offset = log.stat().st_size if log.exists() else 0
        f = open(log, "a")  # one log per run, every attempt appended
        f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} on {slots[slot] or 'cpu'}\n")
        f.flush()
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false",
                   CUDA_VISIBLE_DEVICES=slots[slot] or "")
        env.setdefault("OMP_NUM_THREADS", str(threads))
        if mps:
            env = mps_client(env, mps[slots[slot]])
        cmd = [sys.executable, str(script), "--out", str(exp), "--worker", json.dumps(job)]
        # its own session, so that Ctrl-C reaches it only through us
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        running[slot] = (job, proc, time.time(), f, log, offset)

    try:
        while pending or running:
            now = time.time()
            late = launch_until is not None and now > launch_until
            # a run started now would end after --finish-by: it would be lost with the machine
            if finish_by is not None and lengths:
                late = late or now + max(lengths) > finish_by
            if late and pending:
                tqdm.write(f"--launch-until / --finish-by reached: {len(pending)} runs left for "
                           "the next call")
                bar.total -= len(pending)
                pending = pending[:0]
            free = [s for s in range(len(slots)) if s not in running]
            for slot in free[:len(pending)]:
                start(slot)
            time.sleep(0.2)
            ended = [s for s, r in running.items() if r[1].poll() is not None]
            for slot in ended:
                finish(slot)
            if ended and on_finish:
                on_finish()
    except KeyboardInterrupt:
        for job, proc, *_ in running.values():
            proc.send_signal(signal.SIGINT)  # train.py stops cleanly at its last checkpoint
        for slot in list(running):
            running[slot][1].wait()
            finish(slot, "interrupted")
        print("\ninterrupted: rerun the same command to resume the stopped runs", file=sys.stderr)
    bar.close()
    return failed, len(jobs) - bar.n


MPS_CONTROL = "nvidia-cuda-mps-control"   # the NVIDIA driver's utility that starts MPS daemons


def mps_client(env: dict, client: dict) -> dict:
    """env for a process that reaches its GPU through that GPU's MPS daemon (client: mps_start's
    entry). The daemon shows its clients that GPU alone, as device 0, so the client names device 0:
    left unset, torch counts the devices through NVML, which sees every GPU of the machine, and
    its first CUDA call then asks for a device the MPS server does not have."""
    return dict(env, **client, CUDA_VISIBLE_DEVICES="0")


def mps_start(gpus: list[str]) -> dict:
    """One CUDA MPS control daemon per GPU, run as this user (the GPU's own settings unchanged):
    the runs sharing a GPU then run their kernels side by side instead of taking turns, which a
    small model's short kernels leave mostly idle. Returns {GPU id: its clients' environment}; the
    pipe folders are short temporary ones (a socket path has a length limit)."""
    import tempfile

    exe = shutil.which(MPS_CONTROL)
    if exe is None:
        raise FileNotFoundError(f"--mps needs {MPS_CONTROL} (the NVIDIA driver's utilities) on "
                                "PATH: install them, or leave out --mps")
    envs = {}
    for g in gpus:
        d = Path(tempfile.mkdtemp(prefix=f"mps{g}-"))
        client = dict(CUDA_MPS_PIPE_DIRECTORY=str(d / "pipe"),
                      CUDA_MPS_LOG_DIRECTORY=str(d / "log"))
        for v in client.values():
            Path(v).mkdir()
        subprocess.run([exe, "-d"], env=dict(os.environ, CUDA_VISIBLE_DEVICES=g, **client),
                       check=True, timeout=60)
        envs[g] = client
    return envs


def mps_stop(envs: dict) -> None:
    """Ask each daemon of mps_start to quit (it ends its server once the clients are gone)."""
    exe = shutil.which(MPS_CONTROL)
    for client in envs.values():
        subprocess.run([exe], input="quit\n", text=True, env=dict(os.environ, **client),
                       timeout=60)


# --------------------------------------------------------------------------------------------------
# What comes back from a machine: the finished runs' numbers, without weights or checkpoints

KEEP = ("config.json", "metrics.jsonl", "post.json")


def pack_often(exp: Path, path: Path, earlier: list[Path], every: float = 60.0):
    """A callback for run_jobs' on_finish: rewrite the pack (pack) at most once every `every`
    seconds, so that a machine lost before the scheduler ends leaves a pack of the runs finished
    up to a minute before. A failure to write it is named and the runs go on."""
    last = [time.time()]

    def maybe():
        if time.time() - last[0] < every:
            return
        last[0] = time.time()
        try:
            pack(exp, path, earlier)
        except OSError as e:
            print(f"warning: the pack {path} was not rewritten: {e}", file=sys.stderr)
    return maybe


def pack(exp: Path, path: Path, earlier: list[Path] = ()) -> Path:
    """A .tar.gz of the experiment's numbers: its config, selection, timing, sessions and failures,
    and of every run its config.json, metrics.jsonl, post.json, evaluation summaries and the last
    evaluation's samples. No adapter, checkpoint or log: small enough to bring back and commit.
    earlier: packs already brought back (and extracted into exp, which keeps their files' times);
    a file one of them holds with the same size and time is left out, so each part's pack adds
    only what is new and the parts are extracted in order."""
    held = set()
    for old in earlier:
        with tarfile.open(old) as tar:
            held |= {(m.name, m.size, int(m.mtime)) for m in tar.getmembers() if m.isfile()}

    def keep(rel: Path) -> bool:
        parts = rel.parts
        if len(parts) == 1:
            return rel.suffix in (".json", ".md", ".png")
        if parts[0] in ("timing", "step0"):
            return rel.suffix == ".json"
        if parts[0] != "runs" or len(parts) < 3:
            return False
        if len(parts) == 3:
            return parts[2] in KEEP
        if parts[2] in ("eval", "passk") and parts[-1] == "summary.json":
            return True
        # the samples of the run's last evaluation: what the model writes at the end
        config = exp / parts[0] / parts[1] / "config.json"
        if not config.exists() or parts[2] != "eval" or parts[-1] != "samples.jsonl":
            return False
        steps = json.loads(config.read_text())["steps"]
        return parts[3] == f"step_{steps:06d}"

    def new(p: Path) -> bool:
        st = p.stat()
        return (str(p.relative_to(exp)), st.st_size, int(st.st_mtime)) not in held
    files = sorted(p for p in exp.rglob("*")
                   if p.is_file() and keep(p.relative_to(exp)) and new(p))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tarfile.open(tmp, "w:gz") as tar:
        for p in files:
            tar.add(p, arcname=str(p.relative_to(exp)))
    os.replace(tmp, path)
    return path
