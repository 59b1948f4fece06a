"""First contact, round 3: a model folder carries its own RL recipe (recipe.json's "rl" key, written
by pretrain.py and read by train.py and eval.py wherever the folder lies); every bad value is one
line before any work and no run folder is left that neither a rerun nor --resume can use; eval.py's
pass@1 interval is a Wilson interval; held-out markers sit where their evaluation folders say; and
--help shows the defaults. On CPU, with the shipped models/arith-cpu and runs of 1-2 steps."""
import json
import os
import shlex
import shutil
import tempfile
from pathlib import Path

import pytest

import eval as E
import pretrain
import quantize as Q
import train
from tasks import data
from trainer import config as tc

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "models" / "arith-cpu"
COUNTDOWN5 = ROOT / "models" / "countdown5"
# The addition model's RL defaults as train.py had them before models carried recipes
# (trainer/config.py ARITH_DEFAULTS), plus the answer format every generated task uses
ARITH_RL = dict(task="arith", eval_task="arith_test", fmt="boxed", steps=20, max_new_tokens=80,
                lr=2e-3, lora_rank=8, lora_alpha=16.0, format_weight=0.1, eval_every=5,
                grad_checkpoint=False)
# The defaults for the Countdown / star-graph presets (the pilot's RL gate's settings)
TESTBED_RL = dict(fmt="boxed", steps=300, max_new_tokens=64, lr=3e-4, lora_rank=8,
                  lora_alpha=16.0, format_weight=0.0, eval_every=50, grad_checkpoint=False)
# a run of the shipped model that still takes steps, evaluates between them and saves
SHORT = ["--steps", "2", "--prompts-per-step", "2", "--group-size", "4", "--eval-limit", "4",
         "--eval-every", "1", "--save-every", "1", "--device", "cpu"]


def one_line_error(capsys, *needles) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def rows_of(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


TIMINGS = ("t_", "rollout_tok_s", "peak_mem_gb", "seconds")


def untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMINGS)} for r in rows]


@pytest.fixture
def no_work(monkeypatch):
    """Loading the data or the model fails the test: a bad value must be refused before."""
    import model as M

    def boom(*a, **k):
        raise AssertionError("work started before the flags were checked")
    monkeypatch.setattr(train, "load_policy", boom)
    monkeypatch.setattr(train, "load_data", boom)
    monkeypatch.setattr(M.Model, "from_pretrained", boom)
    monkeypatch.setattr(pretrain, "build_tokenizer", boom)
    monkeypatch.setattr(Q, "scan", boom)


# --------------------------------------------------------------------------------------------------
# 1. A model carries its own recipe

def test_shipped_models_carry_their_rl_recipe():
    arith = json.loads((SHIPPED / "recipe.json").read_text())["rl"]
    assert arith == ARITH_RL
    cd5 = json.loads((COUNTDOWN5 / "recipe.json").read_text())["rl"]
    assert cd5 == dict(task="countdown5", eval_task="countdown5_test", **TESTBED_RL)


@pytest.mark.parametrize("args, task, eval_task, family", [
    (["--preset", "cpu"], "arith", "arith_test", "arith"),
    (["--preset", "gpu"], "arith", "arith_test", "arith"),
    (["--preset", "countdown", "--count", "5"], "countdown5", "countdown5_test", "countdown"),
    (["--preset", "countdown"], "countdown", "countdown_test", "countdown"),
    (["--preset", "stargraph", "--degree", "3"], "stargraph3", "stargraph3_test", "stargraph"),
    # knobs no registered task has: the recipe names no task (train.py then asks for --task)
    (["--preset", "cpu", "--digits", "2"], None, None, "arith"),
    (["--preset", "countdown", "--max-number", "12"], None, None, "countdown"),
])
def test_pretrain_recipe_names_the_registered_task_of_its_knobs(args, task, eval_task, family):
    cfg = pretrain.parse_args(args + ["--out", "unused"])
    rl = pretrain.rl_recipe(cfg)
    assert rl["task"] == task and rl["eval_task"] == eval_task
    rest = {k: v for k, v in rl.items() if k not in ("task", "eval_task")}
    want = ARITH_RL if family == "arith" else TESTBED_RL
    assert rest == {k: v for k, v in want.items() if k not in ("task", "eval_task")}


def test_pretrain_writes_the_rl_key(tmp_path):
    out = tmp_path / "m"
    tiny = ["--steps", "1", "--batch-size", "2", "--hidden-size", "64", "--intermediate-size",
            "128", "--num-layers", "1", "--num-heads", "2", "--num-kv-heads", "1",
            "--eval-every", "0", "--final-prompts", "2", "--max-new-tokens", "4", "--threads", "1"]
    assert pretrain.main(["--preset", "cpu", "--out", str(out)] + tiny) == 0
    recipe = json.loads((out / "recipe.json").read_text())
    assert recipe["rl"] == ARITH_RL
    # train.py reads it from wherever the folder lies
    cfg = tc.apply_model_defaults(tc.parse_args(["--model", str(out)])[0])
    assert {k: getattr(cfg, k) for k in ARITH_RL} == ARITH_RL


def test_a_copied_model_folder_gets_the_same_defaults_and_numbers(tmp_path):
    copy = Path(shutil.copytree(SHIPPED, tmp_path / "elsewhere" / "m"))
    cfg = tc.apply_model_defaults(tc.parse_args(["--model", str(copy)])[0])
    assert {k: getattr(cfg, k) for k in ARITH_RL} == ARITH_RL
    # flags given on the command line still win over the recipe
    cfg = tc.apply_model_defaults(tc.parse_args(["--model", str(copy), "--lr", "1e-4"])[0])
    assert cfg.lr == 1e-4 and cfg.steps == 20
    # the real-model and tiny defaults are unchanged
    assert tc.apply_model_defaults(tc.parse_args(["--model", "Qwen/X"])[0]).task == "gsm8k_train"
    assert tc.apply_model_defaults(tc.parse_args(["--model", "tiny"])[0]).task == "synthetic"
    # the same short run from the shipped path and from the copy: the same numbers
    a, b = tmp_path / "a", tmp_path / "b"
    assert train.main(["--out", str(a)] + SHORT) == 0
    assert train.main(["--model", str(copy), "--out", str(b)] + SHORT) == 0
    assert untimed(rows_of(a)) == untimed(rows_of(b))


def test_redraw_hint_quotes_a_path_with_spaces(tmp_path, capsys):
    out = tmp_path / "with space" / "run"
    assert train.main(["--out", str(out), "--steps", "1", "--prompts-per-step", "2",
                       "--group-size", "2", "--eval-limit", "2"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.endswith(f"(redraw: python train.py --plot {shlex.quote(str(out))})"), last


def test_eval_takes_the_models_own_task(tmp_path, capsys):
    copy = Path(shutil.copytree(SHIPPED, tmp_path / "m"))
    out = tmp_path / "ev"
    assert E.main(["--model", str(copy), "--limit", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "arith_test: pass@1" in printed
    golds = [r["gold"] for r in data.load_rows("arith_test", limit=2)[0]]
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["gold"] for s in samples] == golds
    # the recipe's length limit (80), not a real model's 1024
    assert json.loads(printed.splitlines()[0][len("config: "):])["max_new_tokens"] == 80


def test_a_prompt_the_tokenizer_cannot_encode_is_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    rc = train.main(["--task", "gsm8k_train", "--eval-task", "gsm8k", "--steps", "1",
                     "--out", str(out)])
    assert rc == 2
    line = one_line_error(capsys, "gsm8k", "arith-cpu", "tokenizer")
    assert "’" in line                            # the character, named
    assert not out.exists()                       # refused before the run folder was made
    assert E.main(["--model", str(SHIPPED), "--task", "gsm8k", "--limit", "2",
                   "--out", str(tmp_path / "ev")]) == 2
    one_line_error(capsys, "gsm8k", "arith-cpu", "tokenizer")


# --------------------------------------------------------------------------------------------------
# 2. and 3. Nothing fails late, nothing silently accepted

@pytest.mark.parametrize("args, needle", [
    (["--sigma-start", "-0.1"], "--sigma-start"),
    (["--sigma-end", "0"], "--sigma-end"),
    (["--sigma-end", "0.1"], "--sigma-end"),              # above sigma_start 1e-2
    (["--aqn-stages", "1"], "--aqn-stages"),
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "0"], "--temperature"),            # greedy: nothing to learn from
    (["--temperature", "nan"], "--temperature"),
    (["--top-p", "2"], "--top-p"),
    (["--top-p", "0"], "--top-p"),
    (["--lr", "0"], "--lr"),
    (["--lora-rank", "0"], "--lora-rank"),
    (["--lora-alpha", "-1"], "--lora-alpha"),
    (["--format-weight", "-0.5"], "--format-weight"),
    (["--accuracy-weight", "-1"], "--accuracy-weight"),
    (["--eps-low", "-0.1"], "--eps-low"),
    (["--eps-high", "-1"], "--eps-high"),
    (["--tis-cap", "-1"], "--tis-cap"),
    (["--beta", "-1"], "--beta"),
    (["--max-grad-norm", "0"], "--max-grad-norm"),
    (["--weight-decay", "-1"], "--weight-decay"),
    (["--max-sample-rounds", "0"], "--max-sample-rounds"),
    (["--overlong-cache-frac", "1.5"], "--overlong-cache-frac"),
    (["--group-size", "1"], "--group-size"),
    (["--fmt", "think"], "think"),                        # the addition model writes \boxed{}
    (["--fmt", "think", "--model", str(COUNTDOWN5)], "think"),
])
def test_train_refuses_bad_values_before_any_work(tmp_path, capsys, no_work, args, needle):
    out = tmp_path / "run"
    assert train.main(["--out", str(out)] + args) == 2
    one_line_error(capsys, needle)
    assert not out.exists()


@pytest.mark.parametrize("flag, package", [("--tensorboard", "tensorboard"),
                                           ("--wandb", "wandb")])
def test_missing_logger_package_is_one_line_before_any_work(tmp_path, capsys, no_work, flag,
                                                           package):
    import importlib.util

    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    out = tmp_path / "run"
    assert train.main(["--out", str(out), flag]) == 2
    one_line_error(capsys, flag, package)
    assert not out.exists()


def test_a_run_that_died_in_its_first_step_can_be_run_again(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    args = ["--out", str(out), "--steps", "1", "--prompts-per-step", "2", "--group-size", "2",
            "--eval-limit", "2"]
    real = train.rl_step

    def crash(*a, **k):
        raise RuntimeError("boom")
    monkeypatch.setattr(train, "rl_step", crash)
    with pytest.raises(RuntimeError, match="boom"):         # a crash no check could foresee
        train.main(args)
    assert (out / "metrics.jsonl").exists()                 # the step-0 evaluation is logged
    monkeypatch.setattr(train, "rl_step", real)
    capsys.readouterr()
    # neither a checkpoint nor a finished step: a rerun replaces it, and says so
    assert train.main(args) == 0
    assert "starting it again" in capsys.readouterr().out
    rows = rows_of(out)
    assert [r["step"] for r in rows] == [0, 0, 1]           # one baseline, not two
    # a finished run still refuses a rerun
    assert train.main(args) == 2
    assert "already holds a run" in capsys.readouterr().err
    # and so do metrics that no config.json of train.py's vouches for
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text("")
    assert train.main(args[:1] + [str(other)] + args[2:]) == 2
    assert "already holds a run" in capsys.readouterr().err


@pytest.mark.parametrize("args, needle", [
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "2"], "--top-p"),
    (["--top-p", "0"], "--top-p"),
    (["--n", "0"], "--n"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--limit", "0"], "--limit"),
    (["--fmt", "think"], "think"),
])
def test_eval_refuses_bad_values_before_any_work(tmp_path, capsys, no_work, args, needle):
    out = tmp_path / "ev"
    assert E.main(["--model", str(SHIPPED), "--out", str(out)] + args) == 2
    one_line_error(capsys, needle)
    assert not out.exists()


@pytest.mark.parametrize("args, needle", [
    (["--shard-mb", "-1"], "--shard-mb"),
    (["--shard-mb", "0"], "--shard-mb"),
    (["--chunk-mb", "0"], "--chunk-mb"),
    (["--chunk-mb", "nan"], "--chunk-mb"),
])
def test_quantize_refuses_bad_sizes(tmp_path, capsys, no_work, args, needle):
    out = tmp_path / "q"
    assert Q.main(["--model", str(SHIPPED), "--out", str(out), "--device", "cpu"] + args) == 2
    one_line_error(capsys, needle)
    assert not out.exists()


def unwritable(tmp_path: Path, kind: str) -> Path:
    """An --out that cannot be written: below a file, or in a read-only folder (for root, whom
    permission bits do not stop: below /sys, which refuses new files)."""
    if kind == "below_a_file":
        (tmp_path / "file").write_text("x")
        return tmp_path / "file" / "out"
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        return ro / "out"
    try:
        tempfile.TemporaryFile(dir="/sys").close()
    except OSError:
        return Path("/sys/nanoqerl-test-out")
    pytest.skip("no read-only folder to test with")


@pytest.mark.parametrize("kind", ["below_a_file", "read_only"])
@pytest.mark.parametrize("stage", ["eval", "quantize", "pretrain"])
def test_unwritable_out_is_refused_before_the_work(tmp_path, capsys, no_work, stage, kind):
    out = unwritable(tmp_path, kind)
    argv = {"eval": ["--model", str(SHIPPED), "--limit", "1"],
            "quantize": ["--model", str(SHIPPED), "--device", "cpu"],
            "pretrain": ["--preset", "cpu"]}[stage] + ["--out", str(out)]
    main = {"eval": E.main, "quantize": Q.main, "pretrain": pretrain.main}[stage]
    assert main(argv) == 2
    one_line_error(capsys, str(out))
    if kind == "read_only" and os.geteuid() != 0:
        out.parent.chmod(0o755)                             # let pytest clean up


# --------------------------------------------------------------------------------------------------
# 4. Numbers a reader trips on

class AnswerEngine:
    """An engine whose sample k of prompt i answers right when right[i][k] (the gold, boxed) and
    wrong otherwise."""

    def __init__(self, tok, rows, right):
        self.tok, self.rows, self.right = tok, rows, right

    def generate(self, prompts, n, seed, **kw):
        from rollout import Sample

        first = seed // n                  # eval.evaluate: row j's sample k has seed base + j n + k
        out = []
        for i in range(len(prompts)):
            for k in range(n):
                gold = self.rows[first + i]["gold"]
                text = "\\boxed{%s}" % (gold if self.right[first + i][k] else "0")
                ids = self.tok(text, add_special_tokens=False)["input_ids"]
                out.append(Sample(prompt_idx=i, tokens=ids, logprobs=[0.0] * len(ids),
                                  finish_reason="stop"))
        return out


@pytest.mark.parametrize("right, n, lo, hi", [
    # n = 1: Wilson's interval over the prompts, z = 1.96, worked by hand:
    # 64/64: lower = P / (P + z^2) = 64 / 67.8416 = 0.94337, upper 1
    ([[1]] * 64, 1, 0.94337, 1.0),
    # 32/64: centre 0.5, half-width z / (1 + z^2/P) * sqrt(p(1-p)/P + z^2/(4P^2))
    #       = 1.96 / 1.060025 * sqrt(0.00390625 + 0.00023447) = 0.11898
    ([[1]] * 32 + [[0]] * 32, 1, 0.38102, 0.61898),
    # 0/64: the mirror of 64/64
    ([[0]] * 64, 1, 0.0, 0.05663),
    # n = 2, every sample right: the samples are the trials, P n = 8: 8 / (8 + z^2) = 0.67558
    ([[1, 1]] * 4, 2, 0.67558, 1.0),
    # n = 2, each prompt all right or all wrong: the samples of a prompt agree, so the prompts are
    # the trials (P = 4, p = 0.5): half-width 1.96 / 1.9604 * sqrt(0.0625 + 0.060025) = 0.34996
    ([[1, 1], [0, 0], [1, 1], [0, 0]], 2, 0.15004, 0.84996),
])
def test_pass1_interval_is_wilson(right, n, lo, hi):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SHIPPED)
    rows = data.load_rows("arith_test", limit=len(right))[0]
    s = E.evaluate(AnswerEngine(tok, rows, right), tok, rows, n=n, max_new_tokens=8,
                   progress=False, stop_ids=[])
    assert s["pass@1"] == pytest.approx(sum(map(sum, right)) / (n * len(right)))
    assert s["pass@1_ci95"] == pytest.approx([lo, hi], abs=1e-5)


def test_heldout_markers_sit_at_their_evaluation_folders(tmp_path, monkeypatch):
    """An evaluation at step s is after s updates: eval/step_s, eval_step s in its metrics row, and
    its marker at x = s in curves.png."""
    import matplotlib.axes

    run = tmp_path / "run"
    assert train.main(["--out", str(run)] + SHORT) == 0
    folders = sorted(int(p.name[len("step_"):]) for p in (run / "eval").iterdir())
    assert folders == [0, 1, 2]                        # before, after 1 update (eval_every 1), end
    rows = rows_of(run)
    assert sorted(r["eval_step"] for r in rows if "eval_accuracy" in r) == folders
    drawn = {}
    real = matplotlib.axes.Axes.plot

    def spy(self, xs, ys, *a, **k):
        drawn[k.get("label")] = list(xs)
        return real(self, xs, ys, *a, **k)
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    from trainer import runlog
    runlog.plot(run)
    assert sorted(drawn["held-out, greedy"]) == folders
    assert list(drawn["training, sampled (T = 1)"]) == [0, 1]    # rollouts after 0 and 1 updates


@pytest.mark.parametrize("main, needles", [
    (E.main, ["(default: 1)", "(default: 0.0)", "(default: builtin)", "(default: 32)"]),
    (Q.main, ["(default: 64.0)", "(default: 4096.0)"]),
])
def test_help_shows_the_defaults(capsys, main, needles):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for n in needles:
        assert n in text


def test_pretrain_help_says_out_is_required(capsys):
    with pytest.raises(SystemExit):
        pretrain.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    out = text[text.rindex("--out OUT"):text.rindex("--seed SEED")]     # its line, not the usage
    assert "required" in out and "default: None" not in out

