"""First contact, round 3: what a user meets first in `python -m bench vllm` (a GPU and vLLM checked
before anything is written, the disk each shape needs, its random checkpoints removed on any
exit), in `python -m tasks.data` (bad input is one line) and with a truncated or corrupt adapter
in eval.py --adapter and train.py --resume (one line that names the file and what to do).

Every case runs the command as a user does (a subprocess, or main(argv)) and checks the exit code
and that stderr is a single "error: ..." line with no traceback. CPU only: CUDA_VISIBLE_DEVICES is
emptied where a GPU would change the path taken.
"""
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

from bench import peer_folders
from bench import vllm_speed as V

ROOT = Path(__file__).resolve().parent.parent
CPU = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
GB = 1e9
# The tokenizer files every random folder holds (tests/assets/qwen2.5-tokenizer)
TOKENIZER_BYTES = sum(f.stat().st_size for f in (ROOT / "tests/assets/qwen2.5-tokenizer").iterdir())


def one_error_line(stderr: str) -> str:
    """The single line a bad input must give: "error: ...", and no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def alive_mentioning(text: str) -> list[int]:
    """PIDs of the live processes (zombies aside) whose command line holds `text` (Linux /proc)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue                               # it ended while being read
        if text in cmd and state != "Z":
            pids.append(int(d.name))
    return pids


# ---------------------------------------------------------------- python -m bench vllm

def bench_cmd(tmp_path, *args) -> list[str]:
    return [sys.executable, "-m", "bench", "vllm", "--dir", str(tmp_path / "dir"),
            "--out", str(tmp_path / "out"), *args]


# The smallest run that times something on a CPU: the built-in engine (no vLLM), the small shape
SMOKE = ["--shapes", "small", "--engines", "built-in-nvfp4", "--batches", "1", "--prompt", "4",
         "--lora-rank", "0"]


def test_no_gpu_is_one_line_before_anything_is_written(tmp_path):
    """Without a CUDA GPU the default shapes (7B and 32B, 42 GB of random checkpoints) are refused
    at once. (--timeout bounds what the code before this check wrote: it started on the 7B
    folder.)"""
    r = subprocess.run(bench_cmd(tmp_path, "--timeout", "5"), cwd=ROOT, env=CPU,
                       capture_output=True, text=True, timeout=120)
    line = one_error_line(r.stderr)
    assert r.returncode == 2 and "CUDA GPU" in line and "--shapes small" in line
    assert not (tmp_path / "dir").exists() and not (tmp_path / "out").exists()


def test_no_vllm_is_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """A vLLM engine asked for in an environment without vLLM (the main .venv): one line that
    points at .venv-vllm, before the folders are written."""
    monkeypatch.setattr(V, "vllm_installed", lambda: False, raising=False)
    argv = ["--shapes", "small", "--engines", "vllm-bf16,built-in-nvfp4", "--batches", "1",
            "--dir", str(tmp_path / "dir"), "--out", str(tmp_path / "out"), "--timeout", "60"]
    assert V.main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "vLLM" in line and ".venv-vllm" in line and "vllm-bf16" in line
    assert not (tmp_path / "dir").exists() and not (tmp_path / "out").exists()


def test_too_little_disk_is_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """The small NVFP4 folder (--lora-rank 0: no adapter) needs 0.17 GB, worked out by hand:
    embed_tokens + lm_head 2 x 152064 x 256 bf16 = 155,713,536 bytes; per layer the 7 linears
    hold 256 x (256 + 128 + 128 + 256) + 3 x 512 x 256 = 589,824 weights at 0.5625 bytes (a 4-bit
    code and an FP8 scale a block of 16) = 331,776 bytes and 7 fp32 global scales, x 2 layers;
    q/k/v biases and the norms a few kB; and the 11.5 MB of tokenizer files."""
    monkeypatch.setattr(V, "free_bytes", lambda path: 10**6, raising=False)
    argv = SMOKE + ["--dir", str(tmp_path / "dir"), "--out", str(tmp_path / "out")]
    assert V.main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "0.17 GB" in line and "0.00 GB free" in line and "--dir" in line
    assert not (tmp_path / "dir").exists() and not (tmp_path / "out").exists()


def test_help_says_the_disk_each_shape_needs(capsys):
    """By hand, from the Qwen2.5 shapes (GB = 1e9 bytes). 7B: H 3584, I 18944, 28 layers, KV rows
    512. Linear weights a layer 3584 x (3584 + 512 + 512 + 3584) + 3 x 18944 x 3584 = 233,046,016,
    x 28 = 6,525,288,448; embed + lm_head 2 x 152064 x 3584 = 1,089,986,560 weights. bf16 folder:
    2 bytes each = 15.2306 GB, + biases and norms (0.7 MB) + tokenizer (11.5 MB) = 15.24 GB.
    NVFP4 folder: the linears at 0.5625 bytes = 3.6705 GB, + embed / lm_head bf16 2.1800 GB + the
    rest = 5.86 GB. Rank-32 adapter: 32 x (7168 + 4096 + 4096 + 7168 + 3 x 22528) = 2,883,584
    weights a layer x 28 x 2 bytes = 0.16 GB. 7B in all 21.27 GB.
    32B: H 5120, I 27648, 64 layers, KV rows 1024: 487,587,840 linear weights a layer x 64 x
    0.5625 = 17.5532 GB, + embed / lm_head 2 x 152064 x 5120 x 2 = 3.1143 GB + the rest = 20.68 GB
    (NVFP4 only); adapter 32 x (10240 + 6144 + 6144 + 10240 + 3 x 32768) x 64 x 2 = 0.54 GB;
    32B in all 21.22 GB. The default run: 21.2668 + 21.2180 = 42.48 GB."""
    with pytest.raises(SystemExit) as e:
        V.parse_args(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for number in ("21.27 GB", "15.24", "5.86", "0.16", "21.22 GB", "20.68", "0.54"):
        assert number in text, number
    assert "needs 42.48 GB" in text                        # the default run, 7b and 32b


@pytest.mark.parametrize("base", ["bf16", "nvfp4"])
def test_folder_bytes_are_what_is_written(tmp_path, base):
    """The disk figure is the written folder's size: tensor data (safetensors less its header) +
    the tokenizer files, exactly."""
    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                tie_word_embeddings=False)
    folder = peer_folders.write_folder(tmp_path / base, tiny, base, "cpu")
    st = (folder / "model.safetensors").read_bytes()
    data = len(st) - 8 - int.from_bytes(st[:8], "little")     # 8-byte length, JSON header
    assert peer_folders.folder_bytes(tiny, base) == data + TOKENIZER_BYTES
    adapter = peer_folders.write_adapter(tmp_path / "lora", tiny, 4)
    st = (adapter / "adapter_model.safetensors").read_bytes()
    # rank 4 x (64+64, 64+32, 64+32, 64+64, 64+128, 64+128, 128+64) x 2 layers x 2 bytes
    assert len(st) - 8 - int.from_bytes(st[:8], "little") == 4 * 1024 * 2 * 2
    assert peer_folders.adapter_bytes(tiny, 4) == 4 * 1024 * 2 * 2


def test_a_finished_run_removes_the_checkpoints_it_wrote(tmp_path):
    r = subprocess.run(bench_cmd(tmp_path, *SMOKE, "--new-tokens", "2"), cwd=ROOT, env=CPU,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = V.read_rows(tmp_path / "out" / "rows.jsonl")
    assert [x["kind"] for x in rows] == ["start", "time", "done"]
    assert not (tmp_path / "dir").exists()                  # this run made it: nothing is left
    assert "removed" in r.stdout and "--keep" in r.stdout


def test_prepare_only_keeps_what_it_wrote(tmp_path):
    r = subprocess.run(bench_cmd(tmp_path, *SMOKE, "--prepare-only"), cwd=ROOT, env=CPU,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "dir").iterdir()) == ["small-nvfp4"]
    assert (tmp_path / "dir" / "small-nvfp4" / "config.json").exists()


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm-keep"])
def test_a_stopped_run_stops_its_jobs_and_cleans_up(tmp_path, how):
    """Stopped while a job generates: Ctrl-C at a terminal (SIGINT to the whole process group), or
    `kill PID` (SIGTERM to the orchestrator alone) with --keep. The job process is ended with it,
    the stop is one line, and the random folder is removed unless --keep asked to keep it;
    temporaries are never left."""
    keep = ["--keep"] if how == "sigterm-keep" else []
    # 4000 new tokens: a job of minutes on a CPU, so that the stop lands while it runs
    cmd = bench_cmd(tmp_path, *SMOKE, "--new-tokens", "4000", *keep)
    # the default SIGINT disposition, as at a terminal: a test run in the background (bash's `&`)
    # starts with SIGINT ignored, and Python would then never raise KeyboardInterrupt
    p = subprocess.Popen(cmd, cwd=ROOT, env=CPU, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        rows, deadline = tmp_path / "out" / "rows.jsonl", time.time() + 300
        while not (rows.exists() and '"start"' in rows.read_text()) and time.time() < deadline:
            assert p.poll() is None, p.communicate()
            time.sleep(0.2)
        assert alive_mentioning(str(tmp_path / "dir")), "the job process is not running"
        if how == "ctrl-c":
            os.killpg(p.pid, signal.SIGINT)
        else:
            os.kill(p.pid, signal.SIGTERM)
        out, err = p.communicate(timeout=120)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)      # whatever the code before the fix left running
        except ProcessLookupError:
            pass
    line = one_error_line(err)
    assert p.returncode == (130 if how == "ctrl-c" else 143) and "stopped" in line
    assert alive_mentioning(str(tmp_path / "dir")) == []      # the job is gone too
    if keep:
        assert sorted(x.name for x in (tmp_path / "dir").iterdir()) == ["small-nvfp4"]
    else:
        assert not (tmp_path / "dir").exists()


# ---------------------------------------------------------------- python -m tasks.data

def data_cli(*args):
    return subprocess.run([sys.executable, "-m", "tasks.data", *args], cwd=ROOT, env=CPU,
                          capture_output=True, text=True, timeout=300)


GOOD = '{"question": "What is 1+1?", "answer": "#### 2"}\n'


@pytest.mark.parametrize("case", ["malformed", "missing", "empty", "binary", "not-gzip",
                                  "tokenizer"])
def test_tasks_data_bad_input_is_one_line(tmp_path, case):
    f = tmp_path / ("rows.jsonl.gz" if case == "not-gzip" else "rows.jsonl")
    if case == "malformed":
        f.write_text(GOOD + '{"question": "What is 2+2?", "answer": \n')
    elif case == "empty":
        f.write_text("")
    elif case == "binary":
        f.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    elif case in ("not-gzip", "tokenizer"):
        f.write_text(GOOD)
    args = ["--task", "gsm8k", "--data", str(f)]
    if case == "tokenizer":
        args += ["--tokenizer", str(tmp_path / "no-such-model")]
    r = data_cli(*args)
    line = one_error_line(r.stderr)
    assert r.returncode == 2
    expected = {"malformed": "rows.jsonl:2 is not valid JSON", "missing": "not found",
                "empty": "has no rows", "binary": "rows.jsonl:1 is not UTF-8 text",
                "not-gzip": "is not a gzip file", "tokenizer": "--tokenizer"}[case]
    assert expected in line, line
    assert case == "missing" or str(f) in line or "--tokenizer" in line


def test_tasks_data_stats_say_rows_read_usable_and_shown(tmp_path):
    """8 rows, 2 of them without an answer, --limit 3: 8 read, 6 usable, 3 shown."""
    lines = [f'{{"question": "What is {i}+1?", "answer": "#### {i + 1}"}}\n' for i in range(6)]
    lines += ['{"question": "What is 9+1?", "answer": ""}\n'] * 2
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(lines))
    r = data_cli("--task", "gsm8k", "--data", str(f), "--limit", "3")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout[r.stdout.rindex("\n{"):])
    assert (stats["read"], stats["usable"], stats["shown"]) == (8, 6, 3)
    assert stats["skipped_no_answer"] == 2 and "rows" not in stats
    assert r.stdout.count("[gold]") == 3


# ---------------------------------------------------------------- corrupt adapters

def corrupt(f: Path, how: str):
    blob = f.read_bytes()
    if how == "truncated":
        f.write_bytes(blob[: len(blob) // 2])       # a copy cut short
    elif how == "text":
        f.write_text("version https://git-lfs.github.com/spec/v1\n")   # a Git LFS pointer
    else:
        f.write_bytes(b"")


@pytest.fixture(scope="module")
def tiny_adapter(tmp_path_factory):
    """The tiny model's folder and a rank-2 adapter saved for it."""
    import lora
    import model as M
    from util import tiny

    folder = tiny.tiny_model_dir(0)
    m = M.Model.from_pretrained(str(folder), "cpu", torch.float32)
    lora.add_lora(m, rank=2, alpha=4)
    out = tmp_path_factory.mktemp("adapter") / "ad"
    lora.save_adapter(m, out)
    return folder, out


@pytest.mark.parametrize("how", ["truncated", "text", "empty"])
def test_eval_with_a_corrupt_adapter_is_one_line(tmp_path, tiny_adapter, how):
    folder, good = tiny_adapter
    ad = Path(shutil.copytree(good, tmp_path / "ad"))
    corrupt(ad / "adapter_model.safetensors", how)
    r = subprocess.run([sys.executable, "eval.py", "--model", str(folder), "--adapter", str(ad),
                        "--task", "synthetic", "--limit", "1", "--max-new-tokens", "1",
                        "--out", str(tmp_path / "ev")],
                       cwd=ROOT, env=CPU, capture_output=True, text=True, timeout=300)
    line = one_error_line(r.stderr)
    assert r.returncode == 2
    assert str(ad / "adapter_model.safetensors") in line
    assert "truncated or not a safetensors file" in line and "save" in line
    assert not (tmp_path / "ev").exists()


def test_eval_with_a_malformed_adapter_config_names_the_file(tmp_path, tiny_adapter):
    folder, good = tiny_adapter
    ad = Path(shutil.copytree(good, tmp_path / "ad"))
    (ad / "adapter_config.json").write_text('{"r": 2, "lora_alpha":')
    r = subprocess.run([sys.executable, "eval.py", "--model", str(folder), "--adapter", str(ad),
                        "--task", "synthetic", "--limit", "1", "--max-new-tokens", "1",
                        "--out", str(tmp_path / "ev")],
                       cwd=ROOT, env=CPU, capture_output=True, text=True, timeout=300)
    line = one_error_line(r.stderr)
    assert r.returncode == 2 and str(ad / "adapter_config.json") in line and "JSON" in line


def test_resume_with_a_corrupt_adapter_is_one_line_and_its_advice_works(tmp_path):
    """train.py --resume of a run whose last checkpoint's adapter was cut short: one line naming
    the file, saying to delete that checkpoint; done, the run resumes from the one before it."""
    import train

    run = tmp_path / "run"
    args = ["--model", "tiny", "--prompts-per-step", "2", "--group-size", "2", "--eval-limit", "2",
            "--max-new-tokens", "4", "--steps", "2", "--save-every", "1", "--base", "bf16",
            "--device", "cpu", "--max-sample-rounds", "1", "--out", str(run)]
    assert train.main(args) == 0
    ck = run / "checkpoints" / "step_000002"
    corrupt(ck / "adapter" / "adapter_model.safetensors", "truncated")
    resume = [sys.executable, "train.py", "--resume", str(run)]
    r = subprocess.run(resume, cwd=ROOT, env=CPU, capture_output=True, text=True, timeout=300)
    line = one_error_line(r.stderr)
    assert r.returncode == 2
    assert str(ck / "adapter" / "adapter_model.safetensors") in line and "truncated" in line
    assert f"delete {ck}" in line and "step_000001" in line
    # the advice, followed: the run goes on from step 1
    shutil.rmtree(ck)
    r = subprocess.run(resume, cwd=ROOT, env=CPU, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resumed {run} at step 1 of 2" in r.stdout
    assert (run / "checkpoints" / "latest").read_text() == "step_000002"
    assert (ck / "adapter" / "adapter_model.safetensors").stat().st_size > 1000
