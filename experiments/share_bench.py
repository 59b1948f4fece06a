"""share_bench.py: how many small runs one GPU carries at once, with and without MPS.

The ablation runs many 6M-parameter RL runs side by side; their kernels are short, so a GPU that
lets one process in at a time idles between them, and CUDA MPS lets the processes' kernels run
together.

    python experiments/share_bench.py --procs 10 --steps 30            # one GPU, both modes
    python experiments/share_bench.py --procs 10 --steps 30 --modes plain

Each mode starts --procs copies of train.py at once on GPU --gpu (the Countdown ablation's flags,
--steps and --eval-limit shortened, each copy its own seed) and measures the wall time until the
last one ends, and each run's median seconds a step (rollout + update, from its metrics.jsonl).
Prints one row a mode, the ratio of the throughputs, and writes --out/share_bench.json. The runs'
numbers do not depend on the mode (same kernels); only the time does.
Leaves out: several GPUs (each has its own daemon in the ablation, so one tells the story).
"""
if __name__ == "__main__":
    import sys
    from pathlib import Path

    HERE = Path(__file__).resolve().parent
    sys.path[:0] = [str(HERE.parent), str(HERE)]
    from util import versions
    versions.check_or_exit()

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import ablation_jobs as jobs
import qerl_ablation as abl
from util import fsutil

ROOT = Path(__file__).resolve().parent.parent


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--procs", type=int, default=10, help="runs at once on the GPU (default: 10)")
    ap.add_argument("--steps", type=int, default=30, help="RL steps a run (default: 30)")
    ap.add_argument("--gpu", default="0", help="the GPU id (default: 0)")
    ap.add_argument("--modes", default="plain,mps",
                    help="comma list of plain (the GPU as it is) and mps (default: both)")
    ap.add_argument("--out", default="runs/share-bench",
                    help="folder for the runs and share_bench.json (default: runs/share-bench)")
    return ap


def train_argv(steps: int, seed: int, out: Path) -> list[str]:
    """The design's train.py flags, shortened: --steps, 64 held-out prompts, no mid-run
    evaluation or checkpoint."""
    flags = list(abl.DESIGNS["countdown5"]["train_flags"])
    for name, value in (("--steps", steps), ("--eval-limit", 64), ("--eval-every", 0),
                        ("--save-every", steps)):
        flags[flags.index(name) + 1] = str(value)
    return flags + ["--base", "bf16", "--no-aqn", "--lr", "3e-4", "--seed", str(seed),
                    "--out", str(out)]


def one_mode(mode: str, args, folder: Path) -> dict:
    """--procs runs at once in this mode: wall seconds and the runs' median step times."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    mps = jobs.mps_start([args.gpu]) if mode == "mps" else None
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES=args.gpu,
               OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.procs)))
    if mps:
        env = jobs.mps_client(env, mps[args.gpu])
    t0 = time.time()
    try:
        procs = []
        for i in range(args.procs):
            log = open(folder / f"run{i}.log", "w")
            cmd = [sys.executable, str(ROOT / "train.py")]
            cmd += train_argv(args.steps, i, folder / f"run{i}")
            procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                           stderr=subprocess.STDOUT), log))
        codes = [p.wait() for p, _ in procs]
    finally:
        if mps:
            jobs.mps_stop(mps)
    wall = time.time() - t0
    if any(codes):
        bad = codes.index(next(c for c in codes if c))
        raise SystemExit(f"error: run {bad} in mode {mode} exited {codes[bad]}: see "
                         f"{folder / f'run{bad}.log'}")
    per_run = []
    for i in range(args.procs):
        rows = jobs.read_rows(folder / f"run{i}" / "metrics.jsonl")
        steps = [r["t_rollout"] + r["t_train"] for r in rows if "t_train" in r]
        per_run.append(statistics.median(steps))
    return dict(mode=mode, procs=args.procs, steps=args.steps, wall_s=wall,
                step_s_median=statistics.median(per_run), step_s_per_run=per_run,
                runs_per_hour=args.procs * 3600 / wall)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    modes = args.modes.split(",")
    if args.procs < 1 or args.steps < 1 or any(m not in ("plain", "mps") for m in modes):
        print("error: --procs and --steps must be >= 1 and --modes a comma list of plain, mps",
              file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("error: share_bench.py measures a GPU and torch sees none here", file=sys.stderr)
        return 2
    if "mps" in modes and shutil.which(jobs.MPS_CONTROL) is None:
        print(f"error: the mps mode needs {jobs.MPS_CONTROL} on PATH: pass --modes plain",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    name = torch.cuda.get_device_name(int(args.gpu))
    rows = [one_mode(m, args, out / m) for m in modes]
    print(f"{name}: {args.procs} runs of {args.steps} steps at once")
    print(f"{'mode':>6} {'wall s':>8} {'median s/step':>14} {'runs/hour':>10}")
    for r in rows:
        print(f"{r['mode']:>6} {r['wall_s']:8.1f} {r['step_s_median']:14.3f} "
              f"{r['runs_per_hour']:10.1f}")
    if len(rows) == 2:
        print(f"throughput {rows[1]['mode']} / {rows[0]['mode']}: "
              f"{rows[0]['wall_s'] / rows[1]['wall_s']:.2f}x (same runs, same GPU, one call)")
    fsutil.atomic_write_text(out / "share_bench.json",
                             json.dumps(dict(device=name, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
