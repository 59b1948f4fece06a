"""dist.py: the several-process plumbing of train.py and eval.py under torchrun
(torch.distributed), in one place.

    torchrun --nproc_per_node=4 train.py --algo dapo ...    # 4 GPUs of one machine: cuda:0 .. 3
    torchrun --nproc_per_node=2 train.py --device cpu ...   # 2 CPU processes (gloo): the tests
    torchrun --nproc_per_node=4 eval.py --model DIR --task gsm8k   # the rows split over 4 GPUs

`init` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE). Without it,
or with one process, it returns SINGLE: no process group, and every helper below is the identity,
so `python train.py` runs the same code as before. With several, each rank takes cuda:LOCAL_RANK
(NCCL) or the CPU (gloo). Work is split by whole units (prompt groups, evaluation rows): rank r
takes the contiguous units [r * n // N, (r + 1) * n // N).

Every bad set-up is one line on every rank before anything is written: more ranks than units,
more ranks on a machine than GPUs, a backend this torch lacks, --engine vllm (see
VLLM_UNDER_TORCHRUN). A failure on one rank only (a GPU that cannot hold the model) reaches the
others through `first_error`, so they all stop with the same line.
Leaves out: several machines' worth of testing (torchrun's --nnodes works, unmeasured),
overlapping the gradient all-reduce with backward (a 7B model's rank-32 LoRA gradient takes
1.1-1.4 ms of NCCL on 2-4 H100s, `python -m bench dist`: not worth the complexity).
"""
import datetime
import hashlib
import os
import pickle
import time

import torch
import torch.distributed as td

# Why vLLM is refused under torchrun: each rank would need its own engine on cuda:LOCAL_RANK, but
# vLLM sets up its own torch.distributed state and inside a torchrun job has to run in its
# "external_launcher" mode, which has not been measured here. One process with --engine vllm, or
# torchrun with the built-in engine, both work.
VLLM_UNDER_TORCHRUN = ("--engine vllm runs in one process only: under torchrun each rank rolls "
                       "out with the built-in engine (leave --engine out), or run one process "
                       "with --engine vllm")


class DistError(RuntimeError):
    """A set-up that cannot run with this many processes: train.py and eval.py print it as one line
    (exit code 2)."""


class Dist:
    """rank / world and the few collectives train.py and eval.py use; world 1 makes each one the
    identity."""

    def __init__(self, rank=0, world=1, local_rank=0, device=None):
        self.rank = rank
        self.world = world
        self.local_rank = local_rank
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.main = rank == 0

    def share(self, n: int) -> tuple[int, int]:
        """This rank's contiguous units [lo, hi) of n (sizes differ by at most one)."""
        return self.rank * n // self.world, (self.rank + 1) * n // self.world

    def _reduce(self, values, op) -> list[float]:
        if self.world == 1:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64,
                         device=self._comm_device())
        td.all_reduce(t, op=op)
        return t.tolist()

    def sum(self, values) -> list[float]:
        """Elementwise sums over the ranks (float64: counts stay exact)."""
        return self._reduce(values, td.ReduceOp.SUM)

    def max(self, values) -> list[float]:
        return self._reduce(values, td.ReduceOp.MAX)

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the ranks, in place (through the backend's device: gloo reduces CPU
        tensors)."""
        if self.world == 1:
            return t
        c = t.to(self._comm_device())
        td.all_reduce(c)
        t.copy_(c)
        return t

    def gather(self, obj) -> list:
        """[obj of rank 0, obj of rank 1, ...] on every rank (pickled: for small Python objects)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        td.all_gather_object(out, obj)
        return out

    def first_error(self, err: Exception | None) -> Exception | None:
        """Collective: every rank learns the first rank's error (None when all succeeded). A failure
        that only some ranks met is prefixed with the rank, so the line says where it happened."""
        if self.world == 1:
            return err
        # the message and exit code travel, not the exception (it may not pickle)
        mine = None if err is None else (str(err), getattr(err, "code", 2))
        errs = self.gather(mine)
        failed = [(r, e) for r, e in enumerate(errs) if e is not None]
        if not failed:
            return None
        r, (msg, code) = failed[0]
        if len(failed) < self.world:
            msg = f"rank {r} of {self.world}: {msg}"
        out = DistError(msg)
        out.code = code
        return out

    def on_main(self, fn):
        """Run fn() on rank 0 only; every rank returns its result or raises its exception (so a
        failed write stops all ranks together instead of leaving the others waiting in the next
        collective)."""
        res = err = None
        if self.main:
            try:
                res = fn()
            except Exception as e:  # noqa: BLE001 (passed to every rank, then raised there)
                err = e
        if self.world > 1:
            box = [(res, None if err is None else (type(err), str(err)))]
            td.broadcast_object_list(box, src=0)
            res, e = box[0]
            if e is not None and err is None:
                # rebuild rank 0's exception here: its own type when train.py / eval.py catch it
                known = (FloatingPointError, OSError, RuntimeError, ValueError)
                kind = e[0] if issubclass(e[0], known) else RuntimeError
                err = kind(e[1])
        if err is not None:
            raise err
        return res

    def check_same(self, tensors, what: str):
        """Raise on every rank unless `tensors` are bit-identical on all ranks (a sha256 of their
        bytes)."""
        if self.world == 1:
            return
        h = hashlib.sha256()
        for t in tensors:
            h.update(pickle.dumps(tuple(t.shape)))
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        digests = self.gather(h.hexdigest())
        if len(set(digests)) > 1:
            bad = [r for r, d in enumerate(digests) if d != digests[0]]
            raise DistError(f"{what} differ between rank 0 and rank(s) {bad}: the ranks no longer "
                            "train one model (a bug: please report it with the command line)")

    def sum_grads(self, params, extra: float = 0.0) -> tuple[float, float]:
        """Replace every parameter's gradient by its sum over the ranks (None counts as zeros): ONE
        all-reduce of a flat buffer holding all of them and `extra` (train.py: a loss that was not
        finite). Returns (extra summed, seconds). The time starts after the queued work (CUDA
        sync), so it is the transfer plus the wait for the slowest rank, not the backward before
        it."""
        if self.world == 1:
            return extra, 0.0
        grads = [(q.grad if q.grad is not None else torch.zeros_like(q)).reshape(-1)
                 for q in params]
        tail = torch.tensor([extra], dtype=params[0].dtype, device=params[0].device)
        flat = torch.cat(grads + [tail])                                   # (numel + 1,)
        if flat.is_cuda:
            torch.cuda.synchronize(flat.device)
        t0 = time.perf_counter()
        td.all_reduce(flat)
        extra = flat[-1].item()                                  # .item() waits for the all-reduce
        secs = time.perf_counter() - t0
        # views into the summed buffer: the optimizer reads them, zero_grad drops them
        off = 0
        for q in params:
            q.grad = flat[off:off + q.numel()].view_as(q)
            off += q.numel()
        return extra, secs

    def _comm_device(self):
        # gloo reduces CPU tensors; NCCL only GPU ones
        return self.device if td.get_backend() == "nccl" else torch.device("cpu")

    def close(self):
        if self.world > 1 and td.is_initialized():
            td.destroy_process_group()


SINGLE = Dist()


def env_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init(device: str | None, units: int, what: str, engine: str = "builtin") -> Dist:
    """The run's Dist: SINGLE without torchrun, else a process group over the ranks (see the module
    docstring). device: --device (None: cuda when present); units: how many units are split,
    `what` names them for the error (e.g. "--prompts-per-step"). Every check runs before the
    process group forms, alike on every rank: each prints the same line."""
    world = env_world()
    if world == 1:
        default = "cuda" if torch.cuda.is_available() else "cpu"
        return Dist(device=torch.device(device or default))
    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))

    # the checks, on every rank alike
    if engine != "builtin":
        raise DistError(VLLM_UNDER_TORCHRUN)
    if world > units:
        raise DistError(f"torchrun started {world} ranks but {what} is {units}: each rank needs "
                        f"at least one; use --nproc_per_node {units} or fewer")
    if device not in (None, "cpu", "cuda"):
        raise DistError(f"--device {device}: under torchrun each rank takes cuda:LOCAL_RANK; pass "
                        "--device cuda (or cpu), and pick the GPUs with CUDA_VISIBLE_DEVICES")
    cuda = device != "cpu" and torch.cuda.is_available()
    if device == "cuda" and not cuda:
        raise DistError("--device cuda: this machine has no CUDA GPU that torch can use; pass "
                        "--device cpu (gloo)")
    backend = "nccl" if cuda else "gloo"
    if not td.is_available():
        raise DistError("this torch build has no torch.distributed: run one process (python, not "
                        "torchrun)")
    has_backend = td.is_nccl_available() if cuda else td.is_gloo_available()
    if not has_backend:
        if cuda:
            fix = "install a CUDA build of torch (./setup.sh), or pass --device cpu for gloo"
        else:
            fix = "install a torch build with gloo (the PyPI builds have it), or run one process"
        raise DistError(f"torchrun needs the {backend} backend, which this torch build lacks: "
                        f"{fix}")
    if cuda and local_world > torch.cuda.device_count():
        n_gpus = torch.cuda.device_count()
        raise DistError(f"torchrun started {local_world} ranks on this machine but torch sees "
                        f"{n_gpus} GPU(s): use --nproc_per_node {n_gpus} or fewer (one GPU per "
                        "rank), or check CUDA_VISIBLE_DEVICES")

    # the process group
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    # the timeout bounds how long ranks wait for one that died without a word (torchrun usually
    # stops them first)
    try:
        td.init_process_group(backend, timeout=datetime.timedelta(minutes=30),
                              device_id=dev if cuda else None)
    except (RuntimeError, ValueError) as e:
        first = str(e).splitlines()[0]                  # torch's message runs to many lines
        raise DistError(f"torch.distributed could not start ({backend}): {first}; check "
                        "MASTER_ADDR / MASTER_PORT (a port in use: torchrun --master_port)"
                        ) from None
    return Dist(rank, world, local, dev)
