"""train.py as a new user meets it: every common mistake is one line on stderr (no traceback, exit
code 2, nothing written), Ctrl-C names the checkpoint and the resume command, resume extends or
refuses by name, and run folders are safe to share (usual permissions, no leftovers, a state file
that cannot run code)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import train
from test_train import FAST, run

ROOT = Path(__file__).resolve().parent.parent


def cli(tmp_path, *args, env=None):
    """Run `python train.py ARGS` in a subprocess; returns (rc, stdout, stderr)."""
    full = dict(os.environ, HF_HUB_OFFLINE="1", **(env or {}))
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, env=full,
                       capture_output=True, text=True, timeout=600)
    return r.returncode, r.stdout, r.stderr


def assert_one_line_error(rc, err, *needles):
    assert rc == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(scope="module")
def broken_models(tmp_path_factory):
    """A checkpoint with a truncated safetensors file, and one with a malformed config.json."""
    from util import tiny

    root = tmp_path_factory.mktemp("broken")
    good = tiny.save_tiny_checkpoint(root / "good", "qwen2")
    cut = Path(shutil.copytree(good, root / "truncated"))
    blob = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(blob[:len(blob) // 2])
    bad = Path(shutil.copytree(good, root / "badconfig"))
    (bad / "config.json").write_text('{"model_type": "qwen2",')
    return dict(truncated=cut, badconfig=bad)


@pytest.mark.parametrize("case", [
    "missing",
    "hub_offline",
    "truncated",
    "badconfig",
    "cuda",
    "save_every",
    "plot",
    "data_without_task",
    "zero_steps",
])
def test_common_mistakes_are_one_line(tmp_path, broken_models, case):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n")
    args, needles = {
        "missing": (["--model", "/nonexistent/model"], ["/nonexistent/model", "no such folder"]),
        "hub_offline": (["--model", "nobody-here/no-such-model"], ["nobody-here/no-such-model"]),
        "truncated": (["--model", str(broken_models["truncated"])], ["truncated"]),
        "badconfig": (["--model", str(broken_models["badconfig"])], ["config.json"]),
        "cuda": (["--device", "cuda"], ["no CUDA GPU"]),
        "save_every": (["--save-every", "0"], ["--save-every must be >= 1"]),
        "plot": (["--plot", str(tmp_path / "no-such-run")], ["no-such-run"]),
        "data_without_task": (["--data", str(rows)], ["--task"]),
        "zero_steps": (["--steps", "0"], ["--steps must be >= 1"]),
    }[case]
    out = tmp_path / "run"
    # a machine without a GPU, also where there is one: torch then sees none
    hide = dict(CUDA_VISIBLE_DEVICES="") if case == "cuda" else None
    rc, _, err = cli(tmp_path, "--out", str(out), *args, env=hide)
    assert_one_line_error(rc, err, *needles)
    assert not out.exists()                                    # nothing half written


def test_ctrl_c_names_the_checkpoint_and_the_resume_command(tmp_path):
    out = tmp_path / "run"
    full = dict(os.environ, HF_HUB_OFFLINE="1")
    args = ["--out", str(out)] + FAST + ["--steps", "500", "--save-every", "1"]
    p = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, env=full,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 400
    while (not (out / "checkpoints" / "latest").exists() and time.time() < deadline
           and p.poll() is None):
        time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 130 and "Traceback" not in err, err
    assert "Ctrl-C: stopping after this step" in err          # the step in flight finishes first
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted at step") and f"python train.py --resume {out}" in last
    assert f"the last good checkpoint is {out / 'checkpoints'}" in last
    done = int(last.split()[3].rstrip(":"))                 # it stopped at a step boundary: the
    assert (out / "checkpoints" / "latest").read_text() == f"step_{done:06d}"   # one just saved


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 2-step run with a checkpoint at every step (made once, copied by each test)."""
    tmp = tmp_path_factory.mktemp("finished")
    rc, _, out = run(tmp, "run", "--steps", "2", "--save-every", "1", "--eval-limit", "4")
    assert rc == 0
    return out


def copy_run(finished_run, tmp_path) -> Path:
    return Path(shutil.copytree(finished_run, tmp_path / "run"))


def test_resume_extends_a_finished_run_or_refuses_by_name(finished_run, tmp_path, capsys):
    out = copy_run(finished_run, tmp_path)
    assert train.main(["--resume", str(out)]) == 2
    assert "already finished its 2 steps: pass --steps N with N > 2" in capsys.readouterr().err
    assert train.main(["--resume", str(out), "--lr", "0.1", "--group-size", "4"]) == 2
    assert "--group-size, --lr cannot change when resuming" in capsys.readouterr().err
    assert train.main(["--resume", str(out), "--steps", "3"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward" in r] == [0, 1, 2]
    assert json.loads((out / "config.json").read_text())["steps"] == 3
    assert (out / "checkpoints" / "latest").read_text() == "step_000003"


def test_resume_cleans_an_interrupted_checkpoint_write(finished_run, tmp_path):
    out = copy_run(finished_run, tmp_path)
    stale = out / "checkpoints" / ".step_000003.tmp-x1y2"     # what a kill during a write leaves
    (stale / "adapter").mkdir(parents=True)
    assert train.main(["--resume", str(out), "--steps", "3"]) == 0
    assert not stale.exists()
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]


def test_run_folders_have_the_usual_permissions(finished_run):
    mask = os.umask(0)
    os.umask(mask)
    want = 0o777 & ~mask
    for p in (finished_run, finished_run / "checkpoints",
              finished_run / "checkpoints" / "step_000002",
              finished_run / "checkpoints" / "step_000002" / "adapter"):
        assert p.stat().st_mode & 0o777 == want, p


class Payload:
    """Unpickling this would create a marker file: a state.pt must never be able to do that."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_state_file_loads_without_running_code(finished_run, tmp_path, capsys):
    out = copy_run(finished_run, tmp_path)
    state = out / "checkpoints" / "step_000002" / "state.pt"
    loaded = torch.load(state, weights_only=True)             # tensors and plain types only
    assert loaded["step"] == 2 and "optimizer" in loaded
    marker = tmp_path / "code-ran"
    loaded["extra"] = Payload(str(marker))
    torch.save(loaded, state)
    assert train.main(["--resume", str(out), "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "holds objects other than tensors and plain types" in err and not marker.exists()


def test_nan_stop_says_when_there_is_no_checkpoint(tmp_path, monkeypatch, capsys):
    import grpo

    real = grpo.policy_loss

    def nan_loss(*a, **k):
        loss, stats = real(*a, **k)
        return loss * float("nan"), stats

    monkeypatch.setattr(grpo, "policy_loss", nan_loss)
    rc, _, out = run(tmp_path, "nan0", "--steps", "3", "--save-every", "10", "--eval-limit", "4")
    err = capsys.readouterr().err
    assert rc == 3 and "no checkpoint was written yet" in err and "last good checkpoint" not in err
