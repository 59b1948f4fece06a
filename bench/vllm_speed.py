"""bench/vllm_speed.py: `python -m bench vllm`: rollout tokens/s of the engines an RL user would
pick, side by side on one random Qwen2.5-shaped checkpoint, without and with a LoRA adapter.

    python -m bench vllm          # every engine, 7B shape, batch 1 / 16 / 64 / 256, LoRA off and
                                  # rank 32; then the 32B shape at batch 1 / 16 for vllm-nvfp4 and
                                  # built-in-nvfp4
    python -m bench vllm --engines vllm-ours,built-in-nvfp4 --shapes small --batches 1 \\
        --new-tokens 8            # a smoke run, any machine (vllm-* engines: .venv-vllm)
    python -m bench vllm --report --out experiments/results/peers-h100x4   # a saved run's table

The engines (--engines):
    vllm-bf16       vLLM on the bf16 folder (what TRL's GRPOTrainer and verl run by default)
    vllm-nvfp4      vLLM on the NVFP4 folder through its own compressed-tensors path: weights-only
                    NVFP4 is its W4A16 FP4 scheme on the Marlin FP4 kernel (no code of ours:
                    QeRL's rollout)
    vllm-ours       vLLM with our GEMM and noisy norms (vllm_backend/engine.VLLMEngine), NVFP4
                    folder
    built-in-nvfp4  the built-in engine (rollout.Engine), NVFP4 folder
    built-in-bf16   the built-in engine, bf16 folder

What is timed. The folders and the adapter are bench/peer_folders.py's: random weights written
under --dir, the NVFP4 folder being the bf16 one quantized by quantize.py's math; the 32B
shape gets the NVFP4 folder only (its bf16 weights, 65 GB, leave no room for a KV cache on an
80 GB GPU). LoRA rows load one PEFT adapter, rank --lora-rank on every decoder linear with
nonzero A and B, into every engine. Each engine generates exactly --new-tokens tokens (EOS
ignored) after --prompt random prompt tokens, temperature 1, and returns each sampled token's
log-prob (an RL rollout needs it). At each batch a first call on other random prompts warms up
(compiles, captures graphs; other prompts, so that no prefix cache serves the timed call); the
second is timed end to end, prefill included: tokens/s = batch x new tokens / seconds.
Memory: device memory in use (NVML, the whole GPU, less its idle use) after the batch-64 call,
each engine sized for that batch: the built-in engine allocates a KV cache of batch x (prompt +
new tokens); vLLM gets kv_cache_memory_bytes for the same tokens (plus one block a sequence)
instead of a share of the GPU.

Disk and clean-up. The folders take 21 GB a shape (--help gives each folder's size, computed
from the shapes). Before anything is written the run checks, each a one-line error: a CUDA GPU
for the 7b and 32b shapes (only `small` runs on a CPU), vLLM for the vllm-* engines (.venv-vllm),
and the free disk of --dir. The folders a run writes are removed when it ends, also on an error,
Ctrl-C or `kill` (SIGTERM), its job processes ended first; --keep (and --prepare-only) keeps
them, and a later run reuses folders already there and leaves them in place.

Settings: each engine's fastest documented ones. vLLM at its defaults (V1 engine, torch.compile,
CUDA graphs captured at the timed batch sizes, its engine core in a process of its own), except
vllm-ours, which runs in the job's process (our kernels are registered there); the built-in
engine with its CUDA graphs. Every (engine, shape, LoRA, batches) job is a process of its own,
pinned to one GPU; with several GPUs the jobs run side by side, one a GPU. A job's rows are
appended to --out/rows.jsonl as they come; a rerun skips finished jobs (--fresh starts over).

Measured on 4 H100 80GB HBM3 (vLLM 0.26.0, experiments/results/peers-h100x4/): with a rank-32
LoRA the built-in NVFP4 engine made 274 / 3768 / 10233 / 17473 tokens/s at batch 1 / 16 / 64 /
256 at 7B: 1.48x / 1.36x / 1.51x / 1.83x vLLM's NVFP4 path, 2.15x / 1.90x / 1.58x / 1.35x vLLM
bf16 (the README's "Against vLLM" has every row).
Leaves out: per-request seeds in vLLM (they move its sampling to a slower per-request path; the
built-in engine draws one stream a sample at no cost), n > 1 samples per prompt, tensor
parallelism, FlashInfer (not installed).
"""
import argparse
import gc
import importlib.util
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from bench.peer_folders import SHAPES, adapter_bytes, folder_bytes, folders, prepare
from util import fsutil

ROOT = Path(__file__).resolve().parent.parent
ENGINES = {"vllm-bf16": "bf16",               # engine -> the folder it reads
           "vllm-nvfp4": "nvfp4",
           "vllm-ours": "nvfp4",
           "built-in-nvfp4": "nvfp4",
           "built-in-bf16": "bf16"}
BIG_ENGINES = ("vllm-nvfp4", "built-in-nvfp4")   # the 32B rows: NVFP4 only
BIG_BATCHES = (1, 16)
MEM_BATCH = 64                                   # memory is read after this batch
JOB_KEY = ("engine", "shape", "lora_rank", "batches")
CPU_SHAPES = ("small",)                          # the smoke shape; the others need a CUDA GPU
STOP_GRACE_S = 10                                # seconds a stopped process gets before SIGKILL
GB = 1e9


# ------------------------------------------------------------------------------------------------
# One job: one engine, one shape, LoRA on or off, some batch sizes (a process of its own)

def device_used_bytes() -> int | None:
    """Memory in use on the job's GPU, the whole device (NVML), or None without one. The GPU is
    the job's CUDA_VISIBLE_DEVICES index, in PCI bus order (the orchestrator sets it for CUDA)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "") in ("", "cpu"):
        return None
    import pynvml

    pynvml.nvmlInit()
    index = int(os.environ["CUDA_VISIBLE_DEVICES"].split(",")[0])
    return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used


def kv_bytes(shape: dict, tokens: int) -> int:
    """bf16 keys + values of `tokens` tokens."""
    hd = shape["hidden_size"] // shape["num_attention_heads"]
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * hd * 2 * tokens


def vllm_generate_fn(job: dict, folder: Path, adapter: Path | None, cuda: bool):
    """Start the job's vLLM engine; return generate(prompts) -> each sample's token count."""
    shape, B = SHAPES[job["shape"]], max(job["batches"])
    max_len = job["prompt"] + job["new_tokens"]
    blocks = -(-max_len // 16) + 1                 # vLLM's 16-token blocks, one spare a sequence
    if cuda:
        kv = kv_bytes(shape, B * blocks * 16) + (32 << 20)
    else:
        kv = 256 << 20                             # the CPU backend wants a floor
    args = dict(max_model_len=max_len, max_num_seqs=B, seed=0, kv_cache_memory_bytes=kv,
                enforce_eager=not cuda)
    if cuda:
        args["compilation_config"] = {"cudagraph_capture_sizes": sorted(job["batches"])}

    if job["engine"] == "vllm-ours":
        from vllm_backend import engine as RV

        eng = RV.VLLMEngine(str(folder), enable_lora=bool(adapter),
                            max_lora_rank=max(job["lora_rank"], 1), enable_sleep_mode=False,
                            **args)
        if adapter:
            eng.load_adapter_dir(adapter)

        def generate(prompts):
            outs = eng.generate(prompts, max_new_tokens=job["new_tokens"], stop_token_ids=[],
                                seed=None)
            return [len(o.tokens) for o in outs]
        return generate

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    if adapter:
        args.update(enable_lora=True, max_lora_rank=job["lora_rank"], max_loras=1)
    llm = LLM(model=str(folder), **args)
    req = LoRARequest("bench", 1, str(adapter)) if adapter else None
    sp = SamplingParams(max_tokens=job["new_tokens"], temperature=1.0, ignore_eos=True,
                        logprobs=0, detokenize=False)

    def generate(prompts):
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        outs = llm.generate(inputs, sp, lora_request=req, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]
    return generate


def builtin_generate_fns(job: dict, folder: Path, adapter: Path | None, cuda: bool):
    """Load the model once; return make(B) -> generate(prompts), an engine sized for B."""
    import lora
    import model as M
    import rollout

    m = M.Model.from_pretrained(str(folder), "cuda" if cuda else "cpu", torch.bfloat16)
    if adapter:
        lora.load_adapter(m, adapter)
    m.eval()

    def make(B):
        if cuda:
            torch.cuda.empty_cache()     # the last batch's engine and graphs are gone before this
        eng = rollout.Engine(m, max_batch=B, max_len=job["prompt"] + job["new_tokens"],
                             cuda_graphs=cuda)

        def generate(prompts):
            outs = eng.generate(prompts, max_new_tokens=job["new_tokens"], stop_token_ids=[],
                                seed=0)
            return [len(o.tokens) for o in outs]
        return generate
    return make


def run_job(job: dict, rows_file: Path):
    """Time one job: append a `start` row, one `time` row per batch and a `done` row to
    rows_file. A failure raises (the orchestrator reads its cause from the job's log)."""
    cuda = (os.environ.get("CUDA_VISIBLE_DEVICES", "") not in ("", "cpu")
            and torch.cuda.is_available())
    where = folders(Path(job["dir"]), job["shape"])
    folder = where[ENGINES[job["engine"]]]
    adapter = where["adapter"] if job["lora_rank"] else None

    def emit(row):
        line = json.dumps({**{k: job[k] for k in ("engine", "shape", "lora_rank")}, **row})
        with open(rows_file, "a") as f:     # one line a write: parallel jobs' rows never interleave
            f.write(line + "\n")
        print(line, flush=True)

    idle = device_used_bytes()
    t0 = time.time()
    if job["engine"].startswith("vllm"):
        gen = vllm_generate_fn(job, folder, adapter, cuda)
        make = lambda B: gen                      # noqa: E731 (one vLLM engine for every batch)
    else:
        make = builtin_generate_fns(job, folder, adapter, cuda)
    emit(dict(kind="start", batches=job["batches"], load_s=round(time.time() - t0, 1)))

    g = torch.Generator().manual_seed(0)          # the same prompts for every engine
    for B in job["batches"]:
        warm = torch.randint(0, 150000, (B, job["prompt"]), generator=g).tolist()
        timed = torch.randint(0, 150000, (B, job["prompt"]), generator=g).tolist()
        generate = None                           # the last batch's engine goes before this one
        gc.collect()
        generate = make(B)
        generate(warm)                            # compile, capture graphs, fill caches
        if cuda:
            torch.cuda.synchronize()
        t1 = time.time()
        counts = generate(timed)
        if cuda:
            torch.cuda.synchronize()
        dt = time.time() - t1
        if sum(counts) != B * job["new_tokens"]:
            raise RuntimeError(f"{sum(counts)} tokens generated, expected {B} x "
                               f"{job['new_tokens']}")
        row = dict(kind="time", batch=B, tok_s=round(B * job["new_tokens"] / dt, 1),
                   seconds=round(dt, 3))
        used = device_used_bytes()
        if B == job["mem_batch"] and used is not None and idle is not None:
            row["mem_GB"] = round((used - idle) / 1e9, 2)
        emit(row)
    emit(dict(kind="done", batches=job["batches"], total_s=round(time.time() - t0, 1)))


# ------------------------------------------------------------------------------------------------
# The orchestrator: folders, jobs over GPUs, the table

def make_jobs(args) -> list[dict]:
    """Every (engine, shape, LoRA, batches) job. vLLM sizes its KV cache and graphs at start, so
    it gets one engine for the batches up to MEM_BATCH and one for the larger ones; the built-in
    engine is sized per batch inside one job."""
    jobs = []
    for shape in args.shapes:
        big = shape == "32b"
        engines = [e for e in args.engines if e in BIG_ENGINES] if big else args.engines
        batches = [b for b in args.batches if b in BIG_BATCHES] if big else args.batches
        small = [b for b in batches if b <= MEM_BATCH]
        large = [b for b in batches if b > MEM_BATCH]
        for engine in engines:
            parts = [small, large] if engine.startswith("vllm") else [batches]
            for rank in sorted({0, args.lora_rank}):
                for part in parts:
                    if not part:
                        continue
                    jobs.append(dict(engine=engine, shape=shape, lora_rank=rank, batches=part,
                                     mem_batch=MEM_BATCH, prompt=args.prompt,
                                     new_tokens=args.new_tokens, dir=str(args.dir)))
    return jobs


def finished(rows: list[dict], job: dict) -> bool:
    """Has a `done` row of this job (or of the job an error row names)?"""
    return any(r["kind"] == "done" and all(r[k] == job[k] for k in JOB_KEY) for r in rows)


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Terminated(Exception):
    """SIGTERM (`kill PID`) reached the orchestrator: it stops as on Ctrl-C."""


def on_sigterm(signum, frame):
    raise Terminated()


def signal_group(p: subprocess.Popen, sig: int):
    """Send `sig` to the process group `p` leads (p and what it started), if any is left."""
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass                                         # the whole group has ended


class Children:
    """The prepare and job processes of one run, and the threads that wait for them. Each process
    leads a session of its own, so that ending it ends what it started too (vLLM's engine core),
    and a terminal's Ctrl-C reaches the orchestrator alone, which then ends them: `stop`, called
    on every exit before the folders the jobs read are removed, lets no new process start and
    ends the running ones (SIGTERM, then SIGKILL after STOP_GRACE_S)."""

    def __init__(self):
        self.live: set[subprocess.Popen] = set()
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    def thread(self, target, *args):
        # a daemon: a thread left waiting can never hold the interpreter open
        t = threading.Thread(target=target, args=args, daemon=True)
        self.threads.append(t)
        t.start()

    def join(self):
        for t in self.threads:
            t.join()                                 # Ctrl-C / SIGTERM interrupt this wait

    def run(self, argv: list[str], gpu: str, log: Path, timeout: float) -> int:
        """`python -m bench vllm ARGV` on one GPU (or "cpu"), its output appended to log.
        Returns its exit code: 124 when it ran past `timeout`, -15 when the run was stopped."""
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu, "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
               "PYTHONUNBUFFERED": "1"}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default (vllm-ours sets its own)
        # the job has asked torch about CUDA, so vLLM must spawn its engine core, not fork it
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        cmd = [sys.executable, "-m", "bench", "vllm", *argv]
        with open(log, "a") as f:
            with self.lock:                          # no start once stop() has begun
                if self.stopping.is_set():
                    return -signal.SIGTERM
                p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                     start_new_session=True)
                self.live.add(p)
            try:
                return p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                f.write(f"\ntimed out after {timeout:.0f} s\n")
                f.flush()
                signal_group(p, signal.SIGKILL)
                p.wait()
                return 124
            finally:
                with self.lock:
                    self.live.discard(p)

    def stop(self):
        with self.lock:
            self.stopping.set()
            live = list(self.live)
        for p in live:
            signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in live:
            signal_group(p, signal.SIGKILL)          # what did not end, and what it left behind
            p.wait()
        for t in self.threads:
            t.join()


def root_cause(log: Path, start: int, rc: int) -> str:
    """The first `SomethingError: ...` line a failed job wrote to its log after byte `start`
    (vLLM's engine core reports its own failure before the one its caller raises), or the exit
    code."""
    text = log.read_bytes()[start:].decode(errors="replace") if log.exists() else ""
    for line in text.splitlines():
        m = re.search(r"\b(\w+(?:Error|Exception)): (.+)$", line)
        if m and "WARNING" not in line:
            return f"{m.group(1)}: {m.group(2)[:300]} ({log.name})"
    return f"exit code {rc} ({log.name})"


def run_all(jobs: list[dict], gpus: list[str], out: Path, timeout: float,
            children: Children) -> list[dict]:
    """Each GPU takes the next job when its last one ends; a job that did not finish gets an
    `error` row. Returns every row of out/rows.jsonl."""
    rows_file = out / "rows.jsonl"
    todo = queue.Queue()
    for j in jobs:
        todo.put(j)

    def worker(gpu):
        while not children.stopping.is_set():
            try:
                job = todo.get_nowait()
            except queue.Empty:
                return
            batches = "_".join(map(str, job["batches"]))
            name = f"{job['engine']}-{job['shape']}-r{job['lora_rank']}-b{batches}"
            print(f"[gpu {gpu}] {name}", flush=True)
            log = out / f"{name}.log"
            start = log.stat().st_size if log.exists() else 0     # a rerun appends to the log
            argv = ["--worker", json.dumps(job), "--out", str(out)]
            rc = children.run(argv, gpu, log, timeout)
            if children.stopping.is_set():
                return                               # stopped, not failed: no error row
            if not finished(read_rows(rows_file), job):
                error = {**{k: job[k] for k in JOB_KEY}, "kind": "error",
                         "error": root_cause(log, start, rc)}
                with open(rows_file, "a") as f:
                    f.write(json.dumps(error) + "\n")
            print(f"[gpu {gpu}] {name}: exit {rc}", flush=True)

    for g in gpus:
        children.thread(worker, g)
    children.join()
    return read_rows(rows_file)


def table(rows: list[dict], args) -> str:
    """Markdown: tokens/s per engine and batch with, in brackets, the built-in NVFP4 engine's
    tokens/s over it at the same LoRA; memory at MEM_BATCH; the jobs that failed."""
    best = {}
    for r in rows:
        if r["kind"] == "time":
            best[(r["engine"], r["shape"], r["lora_rank"], r["batch"])] = r
    errors = {}
    for r in rows:
        if r["kind"] == "error" and not finished(rows, r):   # a rerun may have finished it
            errors[(r["engine"], r["shape"], r["lora_rank"])] = r["error"]
    lines = []
    for shape in args.shapes:
        batches = [b for b in args.batches if shape != "32b" or b in BIG_BATCHES]
        heads = " | ".join(f"batch {b}" for b in batches)
        lines += [f"\n{shape}: tokens/s (built-in NVFP4 / engine at the same LoRA)", "",
                  f"| engine | LoRA | {heads} | GB at {MEM_BATCH} |",
                  "|---|---|" + "---|" * (len(batches) + 1)]
        for e in args.engines:
            for rank in sorted({0, args.lora_rank}):
                cells = []
                for b in batches:
                    r = best.get((e, shape, rank, b))
                    ours = best.get(("built-in-nvfp4", shape, rank, b))
                    if r is None:
                        cells.append("-")
                    elif ours and e != "built-in-nvfp4":
                        cells.append(f"{r['tok_s']:.0f} ({ours['tok_s'] / r['tok_s']:.2f}x)")
                    else:
                        cells.append(f"{r['tok_s']:.0f}")
                if all(c == "-" for c in cells) and (e, shape, rank) not in errors:
                    continue                                  # not run
                mem = best.get((e, shape, rank, MEM_BATCH), {}).get("mem_GB") or "-"
                lines.append(f"| {e} | {rank or 'off'} | " + " | ".join(cells) + f" | {mem} |")
        for (e, s, rank), err in sorted(errors.items()):
            if s == shape:
                lines.append(f"\n{e} {shape} LoRA {rank or 'off'} failed: {err}")
    return "\n".join(lines)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench vllm", description=__doc__,
                                 epilog=disk_text(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default=",".join(ENGINES),
                    help="comma-separated, from: " + ", ".join(ENGINES))
    ap.add_argument("--shapes", default="7b,32b",
                    help="comma-separated Qwen2.5 shapes: 7b, 32b, small (32b times "
                         f"{', '.join(BIG_ENGINES)} at batch {BIG_BATCHES} only)")
    ap.add_argument("--batches", default="1,16,64,256",
                    help="comma-separated batch sizes (sequences)")
    ap.add_argument("--lora-rank", type=int, default=32,
                    help="rank of the adapter for the LoRA rows (0: no LoRA rows)")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per sequence")
    ap.add_argument("--new-tokens", type=int, default=512,
                    help="generated tokens per sequence (EOS ignored)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/nanoqerl-peers"),
                    help="where the random folders and adapters are written (the disk each "
                         "shape needs is below); those this run writes are removed when it "
                         "ends, unless --keep")
    ap.add_argument("--keep", action="store_true",
                    help="keep the random folders this run writes in --dir, for later runs to "
                         "reuse (remove them by hand when done)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-vllm"),
                    help="rows.jsonl (every measured row), one log per job, table.md and "
                         "results.json")
    ap.add_argument("--gpus", default=None,
                    help="comma-separated GPU indices to spread the jobs over (default: every "
                         "visible GPU; cpu when there is none)")
    ap.add_argument("--timeout", type=float, default=1200,
                    help="seconds before a job is stopped")
    ap.add_argument("--fresh", action="store_true",
                    help="forget the rows of an earlier run in --out")
    ap.add_argument("--prepare-only", action="store_true",
                    help="write the folders and adapters and keep them (as --keep), time "
                         "nothing")
    ap.add_argument("--report", action="store_true",
                    help="print the table of the rows already in --out, run nothing")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)    # one job as JSON
    ap.add_argument("--prepare", default=None, help=argparse.SUPPRESS)   # "shape:base+base"
    args = ap.parse_args(argv)
    if args.worker or args.prepare:
        return args
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    bad = [e for e in args.engines if e not in ENGINES]
    bad += [s for s in args.shapes if s not in SHAPES]
    if bad:
        ap.error(f"unknown engine or shape {bad[0]!r}: engines are {', '.join(ENGINES)}; "
                 f"shapes {', '.join(SHAPES)}")
    try:
        args.batches = sorted({int(b) for b in args.batches.split(",")})
    except ValueError:
        ap.error(f"--batches must be comma-separated integers, got {args.batches!r}")
    if min(args.batches) < 1 or args.lora_rank < 0 or args.prompt < 1 or args.new_tokens < 1:
        ap.error("batches, --prompt and --new-tokens must be >= 1, --lora-rank >= 0")
    return args


def settings(args) -> dict:
    """The flags as plain JSON values."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def disk_text(rank: int = 32) -> str:
    """What --help says of the disk under --dir, computed from SHAPES (bench/peer_folders.py)."""
    lines = ["Disk under --dir while a run lasts (GB = 1e9 bytes; every engine; the adapter at "
             f"--lora-rank {rank}):"]
    total = {}
    for name, shape in SHAPES.items():
        parts = {f"{b} folder": folder_bytes(shape, b) for b in sorted(bases_of(name, ENGINES))}
        parts["adapter"] = adapter_bytes(shape, rank)
        total[name] = sum(parts.values())
        each = ", ".join(f"{k} {v / GB:.2f}" for k, v in parts.items())
        lines.append(f"  {name:5s} {total[name] / GB:6.2f} GB: {each}")
        if name == "32b":
            big = folder_bytes(shape, "bf16") / GB
            lines.append(f"{'':17s}(no bf16 folder: its {big:.2f} GB and a KV cache do not fit "
                         "on an 80 GB GPU)")
    default = (total["7b"] + total["32b"]) / GB
    lines += [f"The default run (--shapes 7b,32b) needs {default:.2f} GB, and about as much host "
              "memory as the",
              "folder being written. The 7b and 32b shapes need a CUDA GPU; the GPU, vLLM and "
              "the free disk",
              "are checked before anything is written. On a CPU, run the smoke shape: --shapes "
              "small."]
    return "\n".join(lines)


def bases_of(shape: str, engines) -> set[str]:
    """The folders ("bf16", "nvfp4") that `engines` read at `shape` (32b: BIG_ENGINES only)."""
    return {ENGINES[e] for e in engines if shape != "32b" or e in BIG_ENGINES}


def vllm_installed() -> bool:
    """Can this Python import vLLM? (Found without importing it, which takes seconds.)"""
    return importlib.util.find_spec("vllm") is not None


def free_bytes(path: Path) -> int:
    """Free bytes on the disk that holds `path` (its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def to_write(args, jobs: list[dict]) -> list[tuple[str, Path, int]]:
    """(shape, folder, bytes) of each folder or adapter the jobs read that --dir lacks."""
    out = []
    for shape in dict.fromkeys(j["shape"] for j in jobs):
        where = folders(args.dir, shape)
        for base in sorted(bases_of(shape, {j["engine"] for j in jobs if j["shape"] == shape})):
            if not (where[base] / "config.json").exists():
                out.append((shape, where[base], folder_bytes(SHAPES[shape], base)))
        if args.lora_rank and not (where["adapter"] / "adapter_config.json").exists():
            out.append((shape, where["adapter"], adapter_bytes(SHAPES[shape], args.lora_rank)))
    return out


def check_machine(args, jobs: list[dict], writes: list) -> str | None:
    """Why this machine cannot run the jobs (one line), or None. Runs before anything is
    written: a CUDA GPU for every shape but the CPU smoke one, vLLM for the vllm-* engines, no
    stranger's folder where ours go, and room on the disk of --dir."""
    gpu_shapes = [s for s in dict.fromkeys(j["shape"] for j in jobs) if s not in CPU_SHAPES]
    if gpu_shapes and not torch.cuda.is_available():
        size = sum(b for shape, _, b in writes if shape in gpu_shapes)
        return (f"--shapes {','.join(gpu_shapes)} needs a CUDA GPU, and torch sees none: their "
                f"random checkpoints take {size / GB:.2f} GB under --dir and are timed on the "
                "GPU; on a CPU only the smoke run works: --shapes small --engines "
                "built-in-nvfp4 --batches 1 --new-tokens 8")
    wants = sorted({j["engine"] for j in jobs if j["engine"].startswith("vllm")})
    if wants and not args.prepare_only and not vllm_installed():
        return (f"--engines {','.join(wants)} need vLLM, which {sys.executable} cannot import: "
                "run .venv-vllm/bin/python -m bench vllm (./setup.sh --vllm makes it), or time "
                "the built-in engine alone: --engines built-in-nvfp4,built-in-bf16")
    for _, path, _ in writes:
        if path.exists():
            return (f"{path} exists but is not a complete folder of this benchmark: remove it, "
                    "or pass another --dir")
    need = sum(b for *_, b in writes)
    free = free_bytes(args.dir)
    if need > free:
        return (f"the random checkpoints to write under --dir {args.dir} need {need / GB:.2f} "
                f"GB, and its disk has {free / GB:.2f} GB free: pass --dir on a disk with room "
                "(python -m bench vllm --help gives each shape's need)")
    return None


def clean_up(args, writes: list, made_dir: bool, keep: bool) -> str:
    """Remove what a stopped write left beside the folders this run wrote, and unless `keep` the
    folders themselves (and --dir when this run made it). Returns what was done, for the user."""
    for _, path, _ in writes:
        for tmp in path.parent.glob(f".{path.name}{fsutil.TMP_TAG}*"):
            shutil.rmtree(tmp, ignore_errors=True)
        if not keep:
            shutil.rmtree(path, ignore_errors=True)
    if not writes:
        return f"the random checkpoints were already in {args.dir} (kept)"
    if keep:
        return f"kept the random checkpoints in {args.dir} (remove them by hand when done)"
    if made_dir:
        try:
            args.dir.rmdir()                      # only when empty: nothing of anyone else's
        except OSError:
            pass
    return (f"removed the random checkpoints this run wrote in {args.dir} (--keep keeps them "
            "for later runs)")


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return run_job(json.loads(args.worker), args.out / "rows.jsonl")
    if args.prepare:
        shape, bases = args.prepare.split(":")
        return prepare(args.dir, shape, set(bases.split("+")), args.lora_rank)
    if args.report:
        print(table(read_rows(args.out / "rows.jsonl"), args))
        return 0
    # every check before the first write: the GPU, vLLM, the disk
    done = [] if args.fresh else read_rows(args.out / "rows.jsonl")
    jobs = [j for j in make_jobs(args) if not finished(done, j)]
    writes = to_write(args, jobs)
    problem = check_machine(args, jobs, writes)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    children, made_dir = Children(), not args.dir.exists()
    keep = args.keep or args.prepare_only
    main_thread = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, on_sigterm) if main_thread else None
    stopped = None
    try:
        return orchestrate(args, jobs, children)
    except KeyboardInterrupt:
        stopped = ("Ctrl-C", 130)
    except Terminated:
        stopped = ("SIGTERM", 143)
    finally:
        if main_thread:                           # a second Ctrl-C must not cut the cleanup short
            handlers = {s: signal.signal(s, signal.SIG_IGN)
                        for s in (signal.SIGINT, signal.SIGTERM)}
        children.stop()
        note = clean_up(args, writes, made_dir, keep)
        if main_thread:
            signal.signal(signal.SIGINT, handlers[signal.SIGINT])
            signal.signal(signal.SIGTERM, old)
        if stopped is None:
            print(note, flush=True)
    print(f"error: stopped by {stopped[0]}: its processes were ended; {note}; the rows so far "
          f"are in {args.out}/rows.jsonl (a rerun skips finished jobs)", file=sys.stderr)
    return stopped[1]


def orchestrate(args, jobs: list[dict], children: Children) -> int:
    """Write the folders the jobs need, run the jobs over the GPUs, print and save the table."""
    gpus = args.gpus.split(",") if args.gpus else [str(i) for i in range(torch.cuda.device_count())]
    gpus = gpus or ["cpu"]
    print(json.dumps(settings(args)), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.fresh:
        (args.out / "rows.jsonl").unlink(missing_ok=True)

    # the folders first: one process a shape, side by side on the GPUs
    bases = {}
    for j in jobs:
        bases.setdefault(j["shape"], set()).add(ENGINES[j["engine"]])
    for i, (shape, b) in enumerate(bases.items()):
        argv = ["--prepare", f"{shape}:{'+'.join(sorted(b))}", "--dir", str(args.dir),
                "--lora-rank", str(args.lora_rank)]
        log = args.out / f"prepare-{shape}.log"
        children.thread(children.run, argv, gpus[i % len(gpus)], log, args.timeout)
    children.join()
    for shape, b in bases.items():
        if not all((folders(args.dir, shape)[base] / "config.json").exists() for base in b):
            print(f"error: could not write the {shape} folders under {args.dir}: see "
                  f"{args.out}/prepare-{shape}.log", file=sys.stderr)
            return 2
    if args.prepare_only:
        return 0

    print(f"{len(jobs)} jobs on {len(gpus)} device(s): {', '.join(gpus)}", flush=True)
    jobs.sort(key=lambda j: (j["shape"] != "32b", -max(j["batches"])))   # the longest first
    rows = run_all(jobs, gpus, args.out, args.timeout, children)
    text = table(rows, args)
    print(text)
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    fsutil.atomic_write_text(args.out / "table.md", f"{name}\n{text}\n")
    results = dict(device=name, settings=settings(args), rows=rows)
    fsutil.atomic_write_text(args.out / "results.json", json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    main()
