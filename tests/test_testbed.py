"""The ablation's testbed on CPU, at a tiny size: pretrain.py's countdown and stargraph presets
build and save a model of their task (bf16, no quantization-aware training), train.py runs RL on it
with the task's own checker as the reward, and experiments/pilot.py measures its gate."""
import json
import sys
from pathlib import Path

import pytest

import pretrain
import train
from tasks import data, rewards

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "experiments"))

import pilot  # noqa: E402  (experiments/ is not a package: its folder goes on the path first)

# the presets' model cut to a 2-layer width-64 Qwen3 and 3 steps: the plumbing, not the learning
TINY = ["--steps", "3", "--batch-size", "4", "--hidden-size", "64", "--intermediate-size", "128",
        "--num-layers", "2", "--num-heads", "2", "--num-kv-heads", "1", "--eval-every", "0",
        "--final-prompts", "4", "--max-new-tokens", "8", "--threads", "1"]


@pytest.fixture(scope="module", params=["countdown", "stargraph"])
def testbed(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "model"
    assert pretrain.main(["--preset", request.param, "--out", str(out)] + TINY) == 0
    return request.param, out


def test_preset_writes_a_bf16_model_of_its_task(testbed):
    task, out = testbed
    recipe = json.loads((out / "recipe.json").read_text())
    assert recipe["config"]["task"] == task and recipe["config"]["qat_from"] == 1.0
    assert "nvfp4_greedy_accuracy" in recipe["metrics"]          # the RL base is measured too
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype" if "torch_dtype" in config
                                                           else "dtype"] == "bfloat16"


def test_rl_runs_on_the_task_with_its_checker(testbed, tmp_path):
    task, out = testbed
    run = tmp_path / "run"
    rc = train.main(["--algo", "grpo", "--model", str(out), "--task", task,
                     "--eval-task", f"{task}_test", "--steps", "2", "--prompts-per-step", "2",
                     "--group-size", "2", "--max-new-tokens", "8", "--eval-limit", "2",
                     "--lr", "1e-3", "--lora-rank", "2", "--lora-alpha", "4",
                     "--format-weight", "0", "--out", str(run), "--device", "cpu"])
    assert rc == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward" in r] == [0, 1]
    samples = [json.loads(x) for x in (run / "eval" / "step_000002" / "samples.jsonl")
               .read_text().splitlines()]
    # the evaluation scored every held-out answer with the task's checker
    golds = {r["gold"] for r in data.load_rows(f"{task}_test", limit=2)[0]}
    assert len(samples) == 2 and {s["gold"] for s in samples} == golds
    for s in samples:
        assert s["correct"] == rewards.CHECKED[task].check(s["response"], s["gold"])[0]


def test_pilot_measures_the_gate(testbed, tmp_path):
    task, out = testbed
    path = tmp_path / "pilot.json"
    assert pilot.main(["--model", str(out), "--task", f"{task}_test", "--prompts", "3",
                       "--samples", "4", "--kl-samples", "2", "--sigmas", "0.1",
                       "--max-new-tokens", "8", "--out", str(path), "--device", "cpu"]) == 0
    res = json.loads(path.read_text())
    assert set(res["bases"]) == {"bf16", "nvfp4"}
    assert set(res["perturbation"]) == {"nvfp4", "bf16_aqn_0.1", "nvfp4_aqn_0.1"}
    for p in res["perturbation"].values():
        assert p["tokens"] > 0 and p["kl"] >= -1e-6 and 0 <= p["top_changed"] <= 1
    # noise on bf16 moves the distribution; the same policy against itself would not
    assert res["perturbation"]["bf16_aqn_0.1"]["kl"] > 0
    assert set(res["gates"]) == {"entropy", "nvfp4_kl", "pass1", "coverage"}
    assert res["gates"]["coverage"]["ok"] is False               # 4 samples are not pass@64


def test_pilot_rl_gate_by_hand(tmp_path):
    """The RL gate on hand-made metrics: a run whose reward climbs from 0.4 (steps 100-149) to 0.5
    (steps 250-299) with no spread rises; a flat one does not; the best run (by late reward) is the
    one judged, and every run's accuracy over steps 280-299 must stay under 0.9."""
    def run(name, late, acc):
        path = tmp_path / name
        path.mkdir()
        rows = [dict(step=s, reward=0.4 if s < 200 else late, accuracy=acc) for s in range(300)]
        rows.insert(150, dict(step=150, eval_accuracy=0.3))          # an evaluation row, skipped
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return pilot.reward_curve(path)
    climbs, flat = run("climbs", 0.5, 0.6), run("flat", 0.4, 0.95)
    assert climbs["reward_100_150"] == pytest.approx(0.4) and climbs["reward_250_300"] == 0.5
    assert climbs["rising"] and not flat["rising"]                   # no spread: s.e. 0
    res = dict(bases=dict(bf16=dict(entropy=0.2, coverage={"pass@1": 0.3, "pass@64": 0.9})),
               perturbation=dict(nvfp4=dict(kl=2e-3)), runs=[flat, climbs])
    gates = pilot.verdicts(res)
    assert gates["rl_rising"]["ok"] and gates["rl_rising"]["run"].endswith("climbs")
    # the flat run's accuracy 0.95 breaks the headroom gate; 0.9 / 0.3 = 3 passes coverage
    assert not gates["rl_headroom"]["ok"] and gates["coverage"]["ok"] and gates["pass1"]["ok"]
