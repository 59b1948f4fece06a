"""Several processes (torchrun, util/dist.py): 2 gloo ranks on CPU train and evaluate what one
process does, resume each other's checkpoints, keep their adapters bit-identical, and stop together
with one line on bad set-ups. Also the per-sequence random streams of rollout.py that make it
possible. The tiny model, fp32 on CPU; on a machine with 2 GPUs, the same on the GPU path.

The CPU path, whatever the machine (CPU_ENV): the one-process runs, like the ranks, are processes
of their own (never train.main inside pytest, whose state earlier tests may have changed), none
sees a GPU (CUDA_VISIBLE_DEVICES empty: eval.py would otherwise take cuda, and under torchrun with
2 ranks it is refused on a machine of one GPU), and each does its CPU math on one thread. Why one
thread: a CPU matmul splits its sums by thread, so a one-process run on all the cores and
torchrun's ranks (one thread each, torchrun's default) differ in their last bits, and AdamW, which
divides by the gradient's own scale, carries that into the adapters: 2.1e-6 after two steps with
16 threads against 1 on the 2-core CI machine, 5.4e-5 in a full test run on a 16-core H100 host.
With one thread in every process the adapters are bit-identical on the CI machine, but not on
every CPU: 2.0e-5 and 2.4e-5 on a 32-core H200 host (torch 2.11 with CUDA, one thread each), where
the kernels chosen for the micro-batches of other shapes still sum in another order.

Tolerances (2 ranks against 1 process, the same global batch and seed): the sampled tokens,
rewards, accuracies, counts and evaluation files are equal; float metrics differ only by the order
of the sums (micro-batches of other shapes, the ranks' partial sums added last): at most 9e-8
absolute measured (ratio_mean; mismatch_abs, a difference of two log-probs near 3e-4, 1.2e-8
absolute = 4.5e-5 relative), asserted within rel 1e-5 or abs 1e-6. The adapters: 0 to 2.4e-5
apart after both steps on one thread (above), asserted abs 1e-4: 2% of the up to 5e-3, the tiny
model's lr, that one AdamW step moves a weight (its first step moves each weight by about the lr
whatever the gradient's scale, so a gradient that differs by more than rounding, such as one rank's
half of the batch, shows at that order). Each rank's own adapter is bit-identical to the other's
after every step.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from util import dist
import rollout as R
import train

ROOT = Path(__file__).resolve().parent.parent
# dapo, AQN at step 1
TINY = ["--model", "tiny", "--prompts-per-step", "4", "--group-size", "4", "--eval-limit", "4",
        "--max-new-tokens", "8", "--steps", "2",
        "--save-every", "1", "--base", "bf16", "--device", "cpu", "--max-sample-rounds", "2"]
TIMING = {"t_rollout", "t_reward", "t_train", "t_allreduce", "rollout_tok_s", "peak_mem_gb"}

# torchrun runs this file: train.main, with each rank's adapter saved after every step (SPY_DIR), or
# a model that does not fit on one rank (OOM_RANK)
WRAPPER = """
import os, sys
sys.path.insert(0, {root!r})
import torch
import lora, model as M, train
rank = int(os.environ["RANK"])
if os.environ.get("SPY_DIR"):
    real = train.rl_step
    def rl_step(cfg, p, step, model, *a):
        m = real(cfg, p, step, model, *a)
        torch.save(lora.adapter_state(model),
                   os.path.join(os.environ["SPY_DIR"], f"rank{{rank}}_step{{step}}.pt"))
        return m
    train.rl_step = rl_step
if os.environ.get("OOM_RANK") == str(rank):
    def oom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    M.Model.from_pretrained = oom
sys.exit(train.main(sys.argv[1:]))
"""


# The CPU path for a subprocess, whatever the machine: no GPU, and one thread (the module docstring
# says why; torchrun would set OMP_NUM_THREADS=1 for its ranks itself, a one-process run would not)
CPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def one_process(cwd, script, *args, env=CPU_ENV):
    """`python SCRIPT ARGS` in a process of its own, on the CPU path unless `env` says otherwise
    (eval.py has no --device: the environment picks its path)."""
    full = dict(os.environ, HF_HUB_OFFLINE="1", **env)
    r = subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=full,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def torchrun(cwd, script, *args, nproc=2, env=None, gpus=False):
    """`torchrun --standalone --nproc_per_node N script args` (a free port: other test runs may
    share the machine), on the CPU path (CPU_ENV) unless `gpus`. A monitor interval of 2 s lets
    every rank print its error before torchrun stops the others."""
    full = dict(os.environ, HF_HUB_OFFLINE="1", **({} if gpus else CPU_ENV), **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(nproc), "--monitor-interval", "2", str(script), *args]
    r = subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=600)
    return r.returncode, r.stdout, r.stderr


def rows_of(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_rows(got, ref):
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for a, b in zip(got, ref):
        assert set(a) - TIMING == set(b) - TIMING, (a, b)
        for k in set(b) - TIMING:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (a["step"], k, a[k], b[k])


def adapter(out: Path, step: int) -> dict:
    from safetensors.torch import load_file
    return load_file(out / "checkpoints" / f"step_{step:06d}" / "adapter"
                     / "adapter_model.safetensors")


def assert_close_adapters(a: dict, b: dict):
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-4
    # the steps really moved B from 0
    assert max(b[k].abs().max().item() for k in b if "lora_B" in k) > 1e-3


def rewind(src: Path, dst: Path, step: int) -> Path:
    """A copy of a finished run cut back to its checkpoint at `step`, as if it had stopped there."""
    shutil.copytree(src, dst)
    for ck in (dst / "checkpoints").glob("step_*"):
        if int(ck.name[5:]) > step:
            shutil.rmtree(ck)
    (dst / "checkpoints" / "latest").write_text(f"step_{step:06d}")
    return dst


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 2-step run by one process (python train.py) and by 2 gloo ranks (torchrun, adapters
    spied on)."""
    root = tmp_path_factory.mktemp("dist")
    one_process(root, ROOT / "train.py", "--out", str(root / "one"), *TINY)
    wrapper = root / "wrapper.py"
    wrapper.write_text(WRAPPER.format(root=str(ROOT)))
    (root / "spy").mkdir()
    rc, out, err = torchrun(root, wrapper, "--out", str(root / "two"), *TINY,
                            env={"SPY_DIR": str(root / "spy")})
    assert rc == 0, err[-3000:]
    return dict(root=root, one=root / "one", two=root / "two", spy=root / "spy", wrapper=wrapper,
                stdout=out)


def test_two_ranks_train_what_one_process_trains(runs):
    one, two = runs["one"], runs["two"]
    ref, got = rows_of(one), rows_of(two)
    assert_same_rows(got, ref)
    steps = [r for r in got if "reward" in r]
    # both steps trained
    assert len(steps) == 2 and all("loss" in r and "t_allreduce" in r for r in steps)
    # AQN was on in step 1's rollout
    assert steps[1]["sigma"] > 0 and steps[1]["mismatch_abs"] > 0
    for step in (1, 2):
        assert_close_adapters(adapter(two, step), adapter(one, step))
    # sharded evaluation, merged by rank 0
    for step in (0, 2):
        name = f"eval/step_{step:06d}/samples.jsonl"
        assert (two / name).read_text() == (one / name).read_text()
    # only rank 0 prints progress
    assert runs["stdout"].count("config:") == 1


def test_two_ranks_reusing_pi_old_train_what_one_process_trains(runs, tmp_path):
    # --old-logp reuse under torchrun: each rank takes pi_old of its share of the first minibatch
    # from its own training forward, the shared no-grad pass covers the other rows; the update is
    # the one-process run's (which ran the pass over every row)
    out = tmp_path / "two"
    rc, _, err = torchrun(tmp_path, ROOT / "train.py", "--out", str(out), *TINY,
                          "--old-logp", "reuse")
    assert rc == 0, err[-3000:]
    for step in (1, 2):
        assert_close_adapters(adapter(out, step), adapter(runs["one"], step))
    got, ref = rows_of(out), rows_of(runs["one"])
    for a, b in zip(got, ref):
        for k in ("reward", "entropy", "loss"):
            if k in b:
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (a["step"], k)


def test_each_rank_trains_an_equal_share_of_every_minibatch():
    """The benchmark's shape (2 ranks x 8 groups x 8 samples, 2 minibatches of 64): with each rank
    training its own groups' members, step 1's random minibatches give the ranks 34 and 30, then
    30 and 34 sequences (so every all-reduce waited for the larger share); with the whole batch on
    every rank (rows None) each takes 32 of every minibatch, and together they take exactly the
    one-process minibatch."""
    import ppo
    from trainer.config import Config
    cfg = Config(steps=4, prompts_per_step=16, group_size=8, micro_batch=8, minibatches=2)
    cpu, S = torch.device("cpu"), 128
    one = ppo.minibatch_plan(cfg, 1, torch.arange(S), S, cpu, 1)
    ranks = [dist.Dist(rank=r, world=2, device=cpu) for r in range(2)]
    own = [ppo.minibatch_plan(cfg, 1, torch.arange(64 * r, 64 * (r + 1)), S, cpu, 1, c)
           for r, c in enumerate(ranks)]
    assert [[len(mb) for _, mb in plan] for plan in own] == [[34, 30], [30, 34]]
    whole = [ppo.minibatch_plan(cfg, 1, None, S, cpu, 1, c) for c in ranks]
    assert [[len(mb) for _, mb in plan] for plan in whole] == [[32, 32], [32, 32]]
    for j, (index, mb) in enumerate(one):
        assert [plan[j][0] for plan in whole] == [index, index]
        assert sorted(torch.cat([plan[j][1] for plan in whole]).tolist()) == sorted(mb.tolist())


def test_the_ranks_adapters_stay_bit_identical(runs):
    spy = runs["spy"]
    for step in (0, 1):
        a, b = torch.load(spy / f"rank0_step{step}.pt"), torch.load(spy / f"rank1_step{step}.pt")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert any(a[k].abs().max() > 0 for k in a if "lora_B" in k)


def test_resume_a_two_rank_checkpoint_with_one_process(runs, tmp_path):
    cut = rewind(runs["two"], tmp_path / "cut", 1)
    one_process(tmp_path, ROOT / "train.py", "--resume", str(cut))
    assert_same_rows(rows_of(cut), rows_of(runs["one"]))
    assert_close_adapters(adapter(cut, 2), adapter(runs["one"], 2))


def test_resume_a_one_process_checkpoint_with_two_ranks(runs, tmp_path):
    cut = rewind(runs["one"], tmp_path / "cut", 1)
    rc, _, err = torchrun(tmp_path, ROOT / "train.py", "--resume", str(cut))
    assert rc == 0, err[-3000:]
    assert_same_rows(rows_of(cut), rows_of(runs["one"]))
    assert_close_adapters(adapter(cut, 2), adapter(runs["one"], 2))


def test_eval_py_with_two_ranks_writes_what_one_process_writes(runs, tmp_path):
    from util import tiny

    args = ["--model", str(tiny.tiny_model_dir(0)), "--task", "synthetic", "--limit", "5",
            "--num-samples", "3", "--temperature", "1.0", "--max-new-tokens", "8"]
    # other batches, same draws
    one_process(tmp_path, ROOT / "eval.py", *args, "--out", str(tmp_path / "one"),
                "--batch-prompts", "2")
    rc, out, err = torchrun(tmp_path, ROOT / "eval.py", *args, "--out", str(tmp_path / "two"))
    assert rc == 0, err[-3000:]
    assert ((tmp_path / "two" / "samples.jsonl").read_text()
            == (tmp_path / "one" / "samples.jsonl").read_text())
    one, two = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "two"))
    assert ({k: v for k, v in one.items() if k != "seconds"}
            == {k: v for k, v in two.items() if k != "seconds"})
    assert one["prompts"] == 5 and out.count("pass@1") == 1


# ---------------------------------------------------------------- bad set-ups: one line, every rank
def error_lines(err: str) -> list[str]:
    return [x for x in err.splitlines() if x.startswith("error: ")]


def test_more_ranks_than_prompt_groups(tmp_path):
    out = tmp_path / "run"
    rc, _, err = torchrun(tmp_path, ROOT / "train.py", "--out", str(out), "--prompts-per-step", "1",
                          "--device", "cpu")
    lines = error_lines(err)
    # each rank refuses before any process group, alone: on a loaded machine torchrun may stop the
    # slower rank (its monitor looks every 2 s) before it has printed, so one line or two, alike
    assert rc != 0 and len(lines) in (1, 2) and len(set(lines)) == 1, err
    assert ("torchrun started 2 ranks but --prompts-per-step is 1" in lines[0]
            and "--nproc_per_node 1" in lines[0])
    assert not out.exists()


def test_a_model_that_does_not_fit_on_one_rank_stops_every_rank(runs, tmp_path):
    out = tmp_path / "run"
    rc, _, err = torchrun(tmp_path, runs["wrapper"], "--out", str(out), *TINY,
                          env={"OOM_RANK": "1"})
    lines = error_lines(err)
    assert rc != 0 and len(lines) == 2 and len(set(lines)) == 1, err
    assert lines[0].startswith("error: rank 1 of 2: --model") and "does not fit" in lines[0]
    # no worker traceback (torch prefixes them)
    assert not any(x.startswith("[rank") for x in err.splitlines())
    assert not out.exists()                                              # rank 0 wrote nothing


@pytest.mark.parametrize("case", ["gloo", "nccl", "gpus", "vllm", "device"])
def test_set_up_errors_before_any_process_group(tmp_path, monkeypatch, capsys, case):
    """What torchrun's environment cannot run is refused by dist.init before the ranks meet (so
    every rank prints it), with nothing written. CUDA is simulated where the case needs it."""
    for k, v in dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(dist.td, "init_process_group",
                        lambda *a, **k: pytest.fail("must not get this far"))
    if case in ("nccl", "gpus"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2 if case == "nccl" else 1)
        monkeypatch.setattr(dist.td, "is_nccl_available", lambda: False if case == "nccl" else True)
    if case == "gloo":
        monkeypatch.setattr(dist.td, "is_gloo_available", lambda: False)
    # train.py refuses --engine vllm without vLLM first; dist.init is what it calls with vLLM
    if case == "vllm":
        with pytest.raises(dist.DistError, match="--engine vllm runs in one process only"):
            dist.init(None, 4, "--prompts-per-step", "vllm")
        return
    args = ["--out", str(tmp_path / "run"), "--prompts-per-step", "4"]
    args += (["--device", "cpu"] if case == "gloo"
             else ["--device", "cuda:1"] if case == "device" else [])
    if case == "device":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert train.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert {"gloo": "needs the gloo backend", "nccl": "needs the nccl backend",
            "gpus": "torchrun started 2 ranks on this machine but torch sees 1 GPU",
            "device": "each rank takes cuda:LOCAL_RANK"}[case] in err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- per-sequence random streams
PROMPTS = [[3838, 374, 220, 17, 10, 18, 30],
           [40, 1079, 264],
           [9707, 11, 1879, 0, 576, 4226, 374, 25, 17, 10]]


@pytest.mark.parametrize("race", [False, True])
def test_a_prompts_samples_do_not_depend_on_the_other_prompts(make_checkpoint, monkeypatch, race):
    """Sample k of prompt i comes from stream seed + i * n + k whatever else is in the call, its
    batch or its row: prompts 1 and 2 alone (seed moved by one prompt's n) sample what they sample
    beside prompt 0."""
    import model as M

    monkeypatch.setattr(R, "sample_tokens",
                        lambda *a, real=R.sample_tokens, **k: real(*a, **k, race=race))
    m = M.Model.from_pretrained(make_checkpoint("qwen2", dtype=torch.float32), "cpu", torch.float32)
    # rows stop unevenly
    kw = dict(n=3, max_new_tokens=10, temperature=1.0, stop_token_ids=list(range(0, 151936, 7)))
    full = R.Engine(m, max_batch=9, max_len=64).generate(PROMPTS, seed=100, **kw)
    # other batches too
    part = R.Engine(m, max_batch=4, max_len=64).generate(PROMPTS[1:], seed=103, **kw)
    assert [s.tokens for s in part] == [s.tokens for s in full[3:]]
    for a, b in zip(part, full[3:]):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    assert len({tuple(s.tokens) for s in full}) > 3 and len({len(s.tokens) for s in full}) > 1


def test_philox_noise_is_philox_and_a_pure_function_of_key_and_token(monkeypatch):
    """The CUDA path's noise, run by the Triton interpreter on CPU tensors: Random123's known answer
    for Philox-4x32-10 (key 0, counter 0 -> first word 0x6627e8d5, whose top 23 bits make the
    uniform), rows independent of the batch, and the moments of U(0, 1) and Exp(1)."""
    if R.triton is None or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton (the interpreter on CPU)")
    keys = torch.tensor([0, 7, 2**60 + 3, 7], dtype=torch.int64)
    u = R.philox_noise(keys, 0, 10, False)
    assert u[0, 0].item() == (2 * (0x6627e8d5 >> 9) + 1) / 2**24
    assert torch.equal(u[1], u[3]) and not torch.equal(u[1], u[2])
    # a row ignores the rows beside it
    assert torch.equal(R.philox_noise(keys[1:3], 0, 10, False), u[1:3])
    # the next token draws anew
    assert not torch.equal(R.philox_noise(keys, 1, 10, False), u)
    big = R.philox_noise(torch.arange(4000, dtype=torch.int64), 5, 8, False)   # 32000 draws
    assert (0 < big.min() and big.max() < 1 and abs(big.mean() - 0.5) < 0.01
            and abs(big.var() - 1 / 12) < 0.005)
    e = R.philox_noise(torch.arange(4000, dtype=torch.int64), 5, 8, True)
    assert torch.allclose(e, -big.log()) and abs(e.mean() - 1) < 0.03 and (e > 0).all()


# ---------------------------------------------------------------- GPUs
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpus_nccl(runs, tmp_path):
    """NCCL on 2 GPUs: the run finishes and the ranks' adapters stay bit-identical. In bf16 a
    prompt's logits depend slightly on which rows share its batch, so the run equals one GPU's in
    distribution, not token for token."""
    (tmp_path / "spy").mkdir()
    args = [a for a in TINY if a not in ("--device", "cpu")]
    rc, _, err = torchrun(tmp_path, runs["wrapper"], "--out", str(tmp_path / "run"), *args,
                          env={"SPY_DIR": str(tmp_path / "spy")}, gpus=True)
    assert rc == 0, err[-3000:]
    for step in (0, 1):
        a, b = (torch.load(tmp_path / "spy" / f"rank{r}_step{step}.pt") for r in (0, 1))
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (one a rank)")
def test_eval_py_on_two_gpus_writes_what_one_gpu_writes(tmp_path):
    """The GPU path of the equivalence of eval.py: 2 ranks on 2 GPUs (NCCL) write what one process
    on one GPU writes, byte for byte. In bf16 a row's logits depend on the rows that share its
    batch (the kernels pick their tiles by batch size), so both sides are given the same batches:
    4 prompts, 2 a rank, and --batch-prompts 2 in the one process; the draws are the same by
    construction (a stream a sample)."""
    from util import tiny

    args = ["--model", str(tiny.tiny_model_dir(0)), "--task", "synthetic", "--limit", "4",
            "--num-samples", "3", "--temperature", "1.0", "--max-new-tokens", "8",
            "--batch-prompts", "2"]
    one_process(tmp_path, ROOT / "eval.py", *args, "--out", str(tmp_path / "one"),
                env={"CUDA_VISIBLE_DEVICES": "0"})
    rc, _, err = torchrun(tmp_path, ROOT / "eval.py", *args, "--out", str(tmp_path / "two"),
                          env={"CUDA_VISIBLE_DEVICES": "0,1"}, gpus=True)
    assert rc == 0, err[-3000:]
    one, two = ((tmp_path / d / "samples.jsonl").read_text() for d in ("one", "two"))
    assert one == two and len(one.splitlines()) == 4 * 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_philox_noise_on_cuda():
    keys = torch.tensor([0, 7, 2**60 + 3], dtype=torch.int64, device="cuda")
    assert R.philox_noise(keys, 0, 1, False)[0, 0].item() == (2 * (0x6627e8d5 >> 9) + 1) / 2**24
    e = R.philox_noise(keys, 3, 152064, True)                               # a Qwen2.5 vocabulary
    assert (torch.equal(R.philox_noise(keys[1:], 3, 152064, True), e[1:])
            and e.isfinite().all() and (e > 0).all())


def test_the_scaling_benchmark_runs_its_plumbing_on_cpu(tmp_path):
    """python -m bench dist --smoke: 1 and 2 gloo processes through the benchmark's torchrun jobs,
    one table."""
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, "-m", "bench", "dist", "--smoke", "--modes", "weak",
                        "--steps", "2", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, HF_HUB_OFFLINE="1", **CPU_ENV))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert not any("error" in row for row in rows), (rows, r.stdout[-3000:], r.stderr[-3000:])
    assert [(row["mode"], row["gpus"]) for row in rows] == [("weak", 1), ("weak", 2)]
    assert all(row["step_s"] > 0 and row["tokens_s"] > 0 for row in rows)
    # only 2 ranks all-reduce; each trained an equal share of every minibatch
    assert rows[1]["allreduce_alone_s"] > 0 and rows[0]["allreduce_alone_s"] == 0
    assert rows[1]["batch"] == "whole" and rows[1]["members"] == [[4, 4], [4, 4]]
    # each rank's phases, in the row and under it in the table
    phases = {"rollout", "batch", "old_logp", "update", "allreduce", "train", "step"}
    assert len(rows[1]["per_rank"]) == 2 and all(set(ph) == phases for ph in rows[1]["per_rank"])
    assert "rank 1: rollout" in r.stdout
    assert "efficiency" in r.stdout
