"""experiments/qerl_ablation.py and experiments/stats.py: the statistics against numbers computed by
hand (or scipy when installed), and the experiment end to end on the CPU at a smoke size (2 arms x 1
seed x 2 steps of the tiny model): the results hold the runs' own numbers, a rerun skips finished
runs, a broken run is named with its error while the other run goes on, and --report-only redoes
the report alone."""
import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "experiments"))

import ablation_jobs as jobs  # noqa: E402
import ablation_report as rep  # noqa: E402
import qerl_ablation as abl  # noqa: E402
import stats  # noqa: E402

# Student t quantiles t(0.975, df) from the standard tables
# (= scipy.stats.t.ppf(0.975, df) to 1e-9)
T975 = {1: 12.706204736, 2: 4.302652730, 4: 2.776445105, 9: 2.262157163, 29: 2.045229642,
        1000: 1.962339081}


def test_t_quantiles_and_cdf_match_the_tables():
    for df, t in T975.items():
        assert stats.t_ppf(0.975, df) == pytest.approx(t, abs=1e-7)
        assert stats.t_ppf(0.025, df) == pytest.approx(-t, abs=1e-7)
    assert stats.t_cdf(1.0, 1) == pytest.approx(0.75, abs=1e-12)     # Cauchy: 1/2 + atan(1) / pi
    assert stats.t_cdf(-2.0, 3) == pytest.approx(0.0696629842794, abs=1e-10)
    try:
        from scipy import stats as sps
    except ImportError:
        return
    for df in (1, 3, 5, 7, 12, 50):
        for q in (0.9, 0.975, 0.995):
            assert stats.t_ppf(q, df) == pytest.approx(sps.t.ppf(q, df), abs=1e-7)


def test_mean_ci_is_the_t_interval():
    # sd = sqrt(2.5), half width = 2.776445105 * sqrt(2.5 / 5) = 1.963243161
    c = stats.mean_ci([1, 2, 3, 4, 5])
    assert (c["n"], c["mean"], c["sd"]) == (5, 3.0, pytest.approx(math.sqrt(2.5)))
    assert (c["lo"], c["hi"]) == (pytest.approx(1.036756839), pytest.approx(4.963243161))
    # missing values are left out; one value has no interval
    one = stats.mean_ci([0.4, None, math.nan])
    assert one["n"] == 1 and one["mean"] == 0.4 and math.isnan(one["lo"])


def test_band_per_step_leaves_out_missing_values():
    mean, lo, hi = stats.band([[1, 2, math.nan], [3, math.nan, math.nan], [5, 4, math.nan]])
    # step 0: [1, 3, 5], sd 2, half 4.302652730 * 2 / sqrt(3); step 1: [2, 4], sd sqrt(2),
    # half 12.706204736 * 1
    assert mean[:2].tolist() == [3.0, 3.0] and math.isnan(mean[2])
    assert (lo[0] == pytest.approx(3 - 4.302652730 * 2 / math.sqrt(3))
            and hi[1] == pytest.approx(3 + 12.706204736))


def test_sign_flip_p_counts_every_pattern():
    # |+-3 +-1 +-2 +-1| >= 5: the flipped subset sums to <= 1 or >= 6: {}, {1}, {1'}, {3,1,2},
    # {3,2,1'}, all: 6 of 16
    assert stats.sign_flip_p([3, 1, 2, -1]) == pytest.approx(6 / 16)
    # only all + and all -: the floor at 5 seeds
    assert stats.sign_flip_p([1, 2, 3, 4, 5]) == pytest.approx(2 / 32)
    assert stats.sign_flip_p([1, -1]) == 1.0
    # above 20 pairs: random patterns, seeded
    assert stats.sign_flip_p(list(range(1, 23))) < 1e-5


def test_paired_comparison_and_verdicts():
    a, b = {0: 1.0, 1: 2.0, 2: 3.5}, {0: 0.5, 1: 1.0, 2: 1.5, 3: 9.0}  # seed 3 has no pair
    # diffs 0.5, 1, 2: mean 7/6, sd sqrt(0.58333), half 4.302652730 * sd / sqrt(3)
    r = stats.paired(a, b)
    half = 4.302652730 * math.sqrt(0.7 / 1.2) / math.sqrt(3)
    assert r["seeds"] == [0, 1, 2] and r["mean"] == pytest.approx(7 / 6)
    assert (r["lo"], r["hi"]) == (pytest.approx(7 / 6 - half), pytest.approx(7 / 6 + half))
    assert (r["p"] == pytest.approx(2 / 8) and r["min_p"] == pytest.approx(2 / 8)
            and r["verdict"] == "inconclusive")
    assert stats.verdict(0.1, 0.3) == "supported" and stats.verdict(-0.3, -0.1) == "refuted"
    assert (stats.verdict(-0.1, 0.3) == "inconclusive"
            and stats.verdict(math.nan, math.nan) == "inconclusive")
    assert stats.paired({0: 1.0}, {0: 0.0})["verdict"] == "inconclusive"  # one pair: no interval


def test_detectable_difference_gives_the_published_sample_sizes():
    # G*Power's one-sample / paired t-test, two-sided alpha 0.05, power 0.80, effect size dz:
    # dz 0.8 needs 15 pairs, 0.5 needs 34, 0.2 needs 199 (Cohen's medium and small effects)
    def pairs_needed(dz):
        return next(n for n in range(2, 1000) if stats.detectable(1.0, n) <= dz)
    assert [pairs_needed(d) for d in (0.8, 0.5, 0.2)] == [15, 34, 199]
    # it scales with the spread and needs two seeds
    assert stats.detectable(0.5, 12) == pytest.approx(0.5 * stats.detectable(1.0, 12))
    assert math.isnan(stats.detectable(1.0, 1))
    assert stats.paired({0: 1.0, 1: 2.0, 2: 4.0}, {0: 0.0, 1: 0.0, 2: 0.0})["detectable"] == \
        pytest.approx(stats.detectable(math.sqrt(7 / 3), 3))


def test_claims_figure_draws_only_reward_claims_with_intervals():
    def claim(measure, diffs, lr_text="own (a 0.1, b 0.1)"):
        return dict(claim="x", a="a", b="b", lr_text=lr_text, measure=measure, diffs=diffs,
                    **{k: v for k, v in stats.paired(dict(enumerate(diffs)),
                                                     {i: 0.0 for i in range(len(diffs))}).items()
                       if k != "diffs"})
    # the entropy claim and a one-seed claim have nothing to draw
    assert rep.claims_figure([claim("entropy0", [0.1, 0.2]), claim("reward_auc", [0.1])]) is None
    png = rep.claims_figure([claim("reward_auc", [0.1, -0.2, 0.3]),
                             claim("reward_auc", [0.1, -0.2, 0.3], lr_text="0.1")])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_measures_from_hand_made_rows():
    rows = [{"step": 0, "eval_accuracy": 0.0},
            {"step": 0, "reward": 0.2, "accuracy": 0.1, "entropy": 0.9, "mismatch_abs": 0.01,
             "tis_capped_frac": 0.0},
            # replaced by the resumed step's row below
            {"step": 1, "reward": 9.0, "accuracy": 9.0},
            {"step": 1, "reward": 0.4, "accuracy": 0.3, "entropy": 0.8, "mismatch_abs": 0.03,
             "tis_capped_frac": 0.5},
            {"step": 2, "reward": 0.6, "accuracy": 0.5, "entropy": 0.7, "eval_accuracy": 0.75},
            {"step": 3, "eval_accuracy": 1.0}]
    post = {"entropy_probe": 1.25, "pass_at_k": {"3": {"pass@1": 0.5, "pass@2": 0.75}}}
    m = rep.run_measures(3, rows, {0: 0.0, 3: 1.0}, post, thr_greedy=0.5, thr_sampled=0.35,
                         window=2)
    assert m["reward"] == [0.2, 0.4, 0.6] and m["reward_auc"] == pytest.approx(0.4)
    assert m["entropy_auc"] == pytest.approx((0.9 + 0.8 + 0.7) / 3)
    assert (m["acc_auc"] == pytest.approx(0.3) and m["final_acc"] == 1.0
            and m["entropy0_trainer"] == 0.9)
    assert (m["entropy0"] == 1.25 and m["mismatch"] == pytest.approx(0.02)
            and m["tis_capped"] == pytest.approx(0.25))
    # trailing means of 2: 0.2 at step 1, 0.4 at step 2
    assert m["steps_greedy"] == 3 and m["steps_sampled"] == 2
    # pass@k after the last step (step 3): k = 2 is the largest
    assert m["pass1_final"] == 0.5 and m["passk_final"] == 0.75 and m["k_final"] == 2
    # first 5 / last 20 steps are all three here; accuracy 0.3 both, no format logged: kept
    assert m["reward_head"] == pytest.approx(0.4) and m["collapsed"] is False
    assert stats.first_reach([0, 1, 2], [0.1, 0.2, 0.3], 0.9) is None


def test_bad_input_is_one_line(capsys, tmp_path):
    out = str(tmp_path / "exp")
    cases = [(["--lrs", "1e-3", "--seed", "3"],
              "--seed is set by this script for each run: use --seeds"),
             (["--lrs", "1e-3", "--base", "bf16"], "use --arms"),
             (["--seeds", "0-2"], "--lrs is needed"),
             (["--lrs", "1e-3,1e-3"], "give distinct values"),
             (["--lrs", "1e-3", "--arms", "bf16,fp8"], "--arms bf16,fp8"),
             (["--lrs", "1e-3", "--stepz", "3"], "unknown flag(s) --stepz 3"),
             (["--lrs", "1e-3", "--steps", "x"], "--steps: invalid int value"),
             (["--lrs", "1e-3", "--algo", "ppo"], "unknown algo"),
             (["--lrs", "1e-3", "--tis-cap", "0"], "nvfp4_aqn_notis is the one without it"),
             (["--lrs", "1e-3", "--gpus", "0", "--mps"], "--mps shares GPUs between runs"),
             (["--report-only"], "holds no experiment")]
    for argv, needle in cases:
        assert abl.main(["--out", out] + argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], (argv, err)
    assert not Path(out).exists()
    assert abl.parse_list("0-2,7", "--seeds", int) == [0, 1, 2, 7]


SMOKE = ["--arms", "bf16,nvfp4_aqn", "--seeds", "0", "--lrs", "5e-3", "--gpus", "0",
         "--procs-per-gpu", "2", "--pass-k-n", "4", "--entropy-samples", "2", "--steps", "2",
         "--algo", "grpo", "--prompts-per-step", "2", "--group-size", "4", "--eval-limit", "4",
         "--max-new-tokens", "8"]
NAMES = ("bf16-lr0.005-s0", "nvfp4_aqn-lr0.005-s0")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The smoke experiment, run once; each test copies it. Workers run the CPU reference paths, as
    a user's would."""
    exp = tmp_path_factory.mktemp("ablation") / "exp"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        assert abl.main(["--out", str(exp)] + SMOKE) == 0
    return exp


def rows_of(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_smoke_results_hold_the_runs_numbers(smoke):
    res = json.loads((smoke / "results.json").read_text())
    md = (smoke / "results.md").read_text()
    assert (smoke / "fig_lr0.005.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert res["finished"] == 2 and set(res["runs"]) == set(NAMES)
    for name, arm in zip(NAMES, ("bf16", "nvfp4_aqn")):
        run = smoke / "runs" / name
        rows = rows_of(run / "metrics.jsonl")
        train = [r for r in rows if "reward" in r]
        post = json.loads((run / "post.json").read_text())
        r, g = res["runs"][name], res["groups"][f"{arm}@0.005"]
        assert [x["step"] for x in train] == [0, 1]
        assert r["reward"] == pytest.approx([x["reward"] for x in train])
        assert r["reward_auc"] == pytest.approx(sum(x["reward"] for x in train) / 2)
        assert r["acc_auc"] == pytest.approx(sum(x["accuracy"] for x in train) / 2)
        assert r["entropy0_trainer"] == pytest.approx(train[0]["entropy"])
        assert r["final_acc"] == pytest.approx(next(x["eval_accuracy"] for x in rows
                                                    if x["step"] == 2 and "reward" not in x))
        assert r["evals"]["0"] == pytest.approx(rows[0]["eval_accuracy"])
        assert r["entropy0"] == pytest.approx(post["entropy_probe"]) and post["entropy_probe"] > 0
        assert (post["entropy_probe_noisy"] is not None) == (arm == "nvfp4_aqn")
        assert (set(post["pass_at_k"]) == {"0", "2"}
                and set(post["pass_at_k"]["2"]) >= {"pass@1", "pass@2", "pass@4"})
        assert r["pass_at_k"]["2"]["pass@4"] == pytest.approx(post["pass_at_k"]["2"]["pass@4"])
        assert g["seeds"] == [0] and g["reward_auc"]["mean"] == pytest.approx(r["reward_auc"])
        assert g["final_acc"]["n"] == 1 and g["final_acc"]["mean"] == pytest.approx(r["final_acc"])
        # one seed: the band is the curve
        assert g["curves"]["reward"][0] == pytest.approx(r["reward"])
        assert g["pass1_final"]["mean"] == pytest.approx(post["pass_at_k"]["2"]["pass@1"])
        assert g["planned"] == 1 and g["collapsed"] == []
        assert r["timing"]["attempts"] == 1 and r["timing"]["gpu_seconds"] > 0
        row = next(x for x in md.splitlines()
                   if x.startswith(f"| {abl.ARMS[arm][0]} | 0.005 | 1/1 | 0 |"))
        assert f"| {r['reward_auc']:.3f} | {r['reward_auc']:.3f} | {r['final_acc']:.3f} |" in row
    assert (res["gpu_minutes"]["total"]
            == pytest.approx(sum(res["gpu_minutes"]["per_arm"].values())))
    assert res["gpu_minutes"]["total"] > 0 and res["gpu_minutes"]["held"] > 0
    assert [c["a"] + "-" + c["b"] for c in res["comparisons"]][:1] == ["nvfp4_aqn-bf16"]
    assert "Rule: each claim" in md and "inconclusive" in md and "fig_lr0.005.png" in md
    # what each run wrote at its last evaluation: its first answers, quoted in results.md
    for name in NAMES:
        last = rows_of(smoke / "runs" / name / "eval" / "step_000002" / "samples.jsonl")
        ex = res["runs"][name]["writes"]["examples"]
        assert [e["response"] for e in ex] == [x["response"] for x in last[:2]]
        assert last[0]["question"] in md


def test_writes_counts_the_gold_boxed_but_refused():
    # Countdown rows as train.py keeps them: right; the target boxed after false arithmetic;
    # another number boxed; nothing boxed
    gold = "96 from 3,10,2,8,2"
    rows = [dict(question="q0", response="a", pred="96", gold=gold, correct=True),
            dict(question="q1", response="b", pred="96", gold=gold, correct=False),
            dict(question="q2", response="c", pred="95", gold=gold, correct=False),
            dict(question="q3", response="d", pred=None, gold=gold, correct=False)]
    w = rep.writes(rows)
    assert w["gold_refused"] == 0.25
    assert w["examples"] == [dict(question="q0", response="a", correct=True),
                             dict(question="q1", response="b", correct=False)]
    # an answer-only task (the gold is the answer): a boxed gold is always right
    assert rep.writes([dict(question="q", response="r", pred="7", gold="7",
                            correct=True)])["gold_refused"] == 0.0
    assert rep.writes([])["gold_refused"] is None


def test_rerun_skips_then_names_a_broken_run_while_the_other_goes_on(smoke, tmp_path, capsys):
    exp = Path(shutil.copytree(smoke, tmp_path / "exp"))
    metrics = {n: (exp / "runs" / n / "metrics.jsonl").stat().st_mtime_ns for n in NAMES}
    assert abl.main(["--out", str(exp), "--gpus", "0"]) == 0  # flags left out: the saved ones
    out = capsys.readouterr().out
    assert "0 runs to do" in out and "2 finished runs skipped" in out
    assert {n: (exp / "runs" / n / "metrics.jsonl").stat().st_mtime_ns for n in NAMES} == metrics

    # bf16: its post-run evaluation is gone, so only that is redone; nvfp4_aqn: a partial run whose
    # checkpoint is junk
    (exp / "runs" / NAMES[0] / "post.json").unlink()
    broken = exp / "runs" / NAMES[1]
    rows = [r for r in rows_of(broken / "metrics.jsonl") if r["step"] < 1]
    (broken / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows)
                                          + '{"step": 1, "rew')
    (broken / "checkpoints" / "step_000001").mkdir()
    (broken / "checkpoints" / "step_000001" / "state.pt").write_bytes(b"not a checkpoint")
    (broken / "checkpoints" / "latest").write_text("step_000001")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        assert abl.main(["--out", str(exp)] + SMOKE) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert any(x.startswith(f"error: run {NAMES[1]} failed: exit 2: error: ") and "state.pt" in x
               for x in err), err
    # it was resumed, not restarted
    assert "resuming" in (exp / "logs" / f"{NAMES[1]}.log").read_text()
    assert (exp / "runs" / NAMES[0] / "post.json").exists()
    res = json.loads((exp / "results.json").read_text())
    assert (res["runs"][NAMES[0]]["final_acc"] is not None
            and res["runs"][NAMES[0]]["timing"]["attempts"] == 2)
    assert "state.pt" in res["runs"][NAMES[1]]["error"] and res["finished"] == 1
    assert f"- {NAMES[1]}: exit 2" in (exp / "results.md").read_text()

    (exp / "results.md").unlink()
    assert abl.main(["--out", str(exp), "--report-only"]) == 0
    again = json.loads((exp / "results.json").read_text())
    assert again["runs"][NAMES[0]]["reward_auc"] == res["runs"][NAMES[0]]["reward_auc"]
    assert (exp / "results.md").exists()


# ---------------------------------------------------------------------------------------------
# Learning-rate selection, the gain thresholds, collapse, and what a machine brings back

def fake_run(run: Path, rewards: list[float], seed: int, lr: float, format_rate=1.0):
    """A finished run folder as train.py leaves it: config.json, metrics.jsonl (training rows and
    the final evaluation's row) and the final evaluation's summary."""
    run.mkdir(parents=True)
    steps = len(rewards)
    (run / "config.json").write_text(json.dumps(dict(
        steps=steps, model="m", task="t", algo="dapo", prompts_per_step=2, group_size=2,
        eval_limit=2, eval_every=0, save_every=steps, lr=lr, seed=seed)))
    rows = [dict(step=s, reward=r, accuracy=r, format_rate=format_rate)
            for s, r in enumerate(rewards)]
    rows.append(dict(step=steps, eval_accuracy=0.5))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "eval" / f"step_{steps:06d}").mkdir(parents=True)
    (run / "eval" / f"step_{steps:06d}" / "summary.json").write_text('{"pass@1": 0.5}')
    (run / "eval" / f"step_{steps:06d}" / "samples.jsonl").write_text('{"response": "x"}\n')


def selection_cfg(exp):
    return dict(arms=["bf16", "nvfp4"], lrs=[1e-4, 3e-4], select_seeds=[100, 101], seeds=[0],
                every_lr=[], threshold_greedy=0.5, threshold_sampled=0.3, pass_k_n=4,
                pass_temperature=1.0, entropy_samples=2, gpus=0, restart_partial=False,
                train_flags=[], out=str(exp))


def test_each_arm_gets_the_lr_of_its_highest_mean_auc_and_verdicts_wait_for_it(tmp_path):
    exp = tmp_path / "exp"
    cfg = selection_cfg(exp)
    # bf16: mean AUC 0.2 at 1e-4 ((0.1 + 0.3) / 2) against 0.25 at 3e-4: 3e-4
    # nvfp4: 0.25 at both (exact in binary): the tie goes to the smaller, 1e-4
    aucs = {("bf16", 1e-4): (0.1, 0.3), ("bf16", 3e-4): (0.2, 0.3),
            ("nvfp4", 1e-4): (0.25, 0.25), ("nvfp4", 3e-4): (0.125, 0.375)}
    for (arm, lr), pair in aucs.items():
        for seed, auc in zip((100, 101), pair):
            fake_run(exp / "runs" / abl.run_name(arm, lr, seed), [auc] * 4, seed, lr)
    chosen = abl.selection(exp, cfg)
    assert chosen["bf16"]["lr"] == 3e-4 and chosen["nvfp4"]["lr"] == 1e-4
    means = chosen["bf16"]["mean_auc"]
    assert means == {"0.0001": pytest.approx(0.2), "0.0003": pytest.approx(0.25)}
    verdict = [c for c in abl.cells(exp, cfg) if c[3] == "verdict"]
    assert verdict == [("bf16", 3e-4, 0, "verdict"), ("nvfp4", 1e-4, 0, "verdict")]
    # an arm whose selection is unfinished plans no verdict run; --every-lr arms run every lr
    shutil.rmtree(exp / "runs" / abl.run_name("nvfp4", 3e-4, 101))
    cfg["every_lr"] = ["bf16"]
    verdict = [c for c in abl.cells(exp, cfg) if c[3] == "verdict"]
    assert verdict == [("bf16", 1e-4, 0, "verdict"), ("bf16", 3e-4, 0, "verdict")]


def test_claims_compare_each_arm_at_its_own_lr_and_at_equal_lrs():
    def run(auc):
        return dict(summary=dict(reward_auc=auc, entropy0=None), timing={})
    runs = {("bf16", 1e-4, s): run(0.5 + 0.01 * s) for s in range(3)}
    runs |= {("nvfp4", 3e-4, s): run(0.6 + 0.01 * s) for s in range(3)}
    runs |= {("nvfp4", 1e-4, s): run(0.4 + 0.01 * s) for s in range(3)}
    _, claims = rep.compare(runs, ["bf16", "nvfp4"], [1e-4, 3e-4], [0, 1, 2],
                            best={"bf16": 1e-4, "nvfp4": 3e-4})
    auc = [c for c in claims if c["measure"] == "reward_auc"]
    # own: nvfp4 at 3e-4 - bf16 at 1e-4 = +0.1 every seed; equal lr 1e-4: -0.1 every seed
    assert [c["lr_text"] for c in auc] == ["own (nvfp4 0.0003, bf16 0.0001)", "0.0001"]
    assert auc[0]["mean"] == pytest.approx(0.1) and auc[1]["mean"] == pytest.approx(-0.1)


def test_gain_steps_and_collapse_by_hand(tmp_path):
    # the reference: first 5 steps 0.1, last 20 steps 0.5: gain 0.4; 50% at 0.3, 90% at 0.46
    ref = [0.1] * 5 + [0.3] * 15 + [0.5] * 20
    climbs = [0.1] * 10 + [0.56] * 30
    flat = [0.1] * 40                          # never
    runs = {}
    for key, curve in ((("bf16", 1e-4, 0), ref), (("nvfp4", 1e-4, 0), climbs),
                       (("nvfp4", 1e-4, 1), flat)):
        rows = [dict(step=s, reward=r, accuracy=r) for s, r in enumerate(curve)]
        m = rep.run_measures(40, rows, {}, {}, 0.5, 0.3)
        runs[key] = dict(summary=m, timing={})
    gain = rep.gain_steps(runs, ("bf16", 1e-4))
    assert gain["r0"] == pytest.approx(0.1) and gain["gain"] == pytest.approx(0.4)
    # the window of 10 ending at step s holds x = 19 - s steps at 0.1 and the rest at 0.56:
    # s = 13: (6 x 0.1 + 4 x 0.56) / 10 = 0.284; s = 14: (0.5 + 2.8) / 10 = 0.33 >= 0.3
    assert runs[("nvfp4", 1e-4, 0)]["summary"]["steps_50"] == 14
    # s = 16: (0.3 + 3.92) / 10 = 0.422; s = 17: (0.2 + 4.48) / 10 = 0.468 >= 0.46
    assert runs[("nvfp4", 1e-4, 0)]["summary"]["steps_90"] == 17
    assert runs[("nvfp4", 1e-4, 1)]["summary"]["steps_50"] is None
    # a fall in accuracy to below half its start, then a fall in format alone, collapse
    fell = [0.6] * 5 + [0.2] * 20
    rows = [dict(step=s, reward=r, accuracy=r, format_rate=1.0) for s, r in enumerate(fell)]
    assert rep.run_measures(25, rows, {}, {}, 0.5, 0.3)["collapsed"] is True
    rows = [dict(step=s, reward=0.5, accuracy=0.5, format_rate=1.0 if s < 5 else 0.4)
            for s in range(25)]
    assert rep.run_measures(25, rows, {}, {}, 0.5, 0.3)["collapsed"] is True


def test_pack_keeps_the_numbers_and_no_weights(tmp_path):
    import tarfile
    exp = tmp_path / "exp"
    fake_run(exp / "runs" / "bf16-lr0.0001-s0", [0.1, 0.2], 0, 1e-4)
    run = exp / "runs" / "bf16-lr0.0001-s0"
    (run / "checkpoints" / "step_000002" / "adapter").mkdir(parents=True)
    (run / "checkpoints" / "step_000002" / "state.pt").write_bytes(b"weights")
    (run / "post.json").write_text("{}")
    (run / "eval" / "step_000000").mkdir()
    (run / "eval" / "step_000000" / "samples.jsonl").write_text("{}\n")   # not the last: left out
    (exp / "config.json").write_text("{}")
    (exp / "timing").mkdir()
    (exp / "timing" / "bf16-lr0.0001-s0.json").write_text("{}")
    path = jobs.pack(exp, tmp_path / "out.tgz")
    names = sorted(tarfile.open(path).getnames())
    assert names == ["config.json", "runs/bf16-lr0.0001-s0/config.json",
                     "runs/bf16-lr0.0001-s0/eval/step_000002/samples.jsonl",
                     "runs/bf16-lr0.0001-s0/eval/step_000002/summary.json",
                     "runs/bf16-lr0.0001-s0/metrics.jsonl", "runs/bf16-lr0.0001-s0/post.json",
                     "timing/bf16-lr0.0001-s0.json"]


def test_selection_runs_need_no_post_and_a_run_brought_back_without_weights_trains_again(
        tmp_path, monkeypatch):
    exp = tmp_path / "exp"
    cfg = selection_cfg(exp) | dict(arms=["bf16"], lrs=[1e-4], select_seeds=[100], seeds=[0])
    # both trained (the final evaluation's row is there), neither has post.json nor weights
    for seed in (100, 0):
        fake_run(exp / "runs" / abl.run_name("bf16", 1e-4, seed), [0.2, 0.3], seed, 1e-4)
    todo, skipped = abl.plan(cfg, exp, False)
    # the selection run is done (the rule reads its curve alone); the verdict run needs pass@k
    assert skipped == 1 and [j["name"] for j in todo] == ["bf16-lr0.0001-s0"]
    assert todo[0]["post"] == {k: cfg[k] for k in abl.POST_KEYS}

    import train
    calls = []
    monkeypatch.setattr(train, "main", lambda argv: calls.append(argv) or 7)
    # its pass@k needs the last step's adapter, which did not come back: trained again, from new
    assert jobs.worker(todo[0]) == 7 and calls == [todo[0]["train_argv"]]
    assert not (exp / "runs" / "bf16-lr0.0001-s0").exists()
    # a selection run's worker trains nothing and evaluates nothing more
    sel = dict(todo[0], name="bf16-lr0.0001-s100", run=str(exp / "runs" / "bf16-lr0.0001-s100"),
               post=None)
    assert jobs.worker(sel) == 0 and len(calls) == 1
    assert not (exp / "runs" / "bf16-lr0.0001-s100" / "post.json").exists()


def test_one_scheduler_per_experiment_folder(tmp_path):
    exp = tmp_path / "exp"
    exp.mkdir()
    first = abl.hold_lock(exp)
    with pytest.raises(abl.Stop, match=r"another qerl_ablation.py \(pid \d+\) is running on"):
        abl.hold_lock(exp)
    first.close()
    abl.hold_lock(exp).close()  # free again once the first one ends


def test_finish_by_starts_no_run_that_would_end_after_it(tmp_path):
    # a stand-in worker that takes 1 s; one slot. Run 1 ends near 1.0 s; run 2 would end near
    # 2.0 s < 2.6 s, so it starts; run 3 would end near 3.0 s > 2.6 s, so it waits for the next call
    script = tmp_path / "worker.py"
    script.write_text("import time\ntime.sleep(1.0)\n")
    exp = tmp_path / "exp"
    jobs_ = [dict(name=f"r{i}") for i in range(3)]
    t0 = __import__("time").time()
    failed, left = jobs.run_jobs(jobs_, [None], exp, 1.0, script, finish_by=t0 + 2.6)
    assert failed == {} and left == 1
    assert sorted(p.name for p in (exp / "timing").iterdir()) == ["r0.json", "r1.json"]


def test_the_pack_is_rewritten_while_the_runs_go(tmp_path):
    # --pack: the scheduler calls on_finish after each round in which a run ended; pack_often
    # rewrites the pack then, at most once every `every` seconds
    import tarfile
    exp = tmp_path / "exp"
    fake_run(exp / "runs" / "bf16-lr0.0001-s0", [0.1, 0.2], 0, 1e-4)
    script = tmp_path / "worker.py"
    script.write_text("import time\ntime.sleep(0.3)\n")
    path, seen = tmp_path / "sofar.tgz", []
    refresh = jobs.pack_often(exp, path, [], every=0.0)

    def on_finish():
        refresh()
        seen.append(sorted(tarfile.open(path).getnames()))
    failed, left = jobs.run_jobs([dict(name=f"r{i}") for i in range(3)], [None], exp, 1.0, script,
                                 on_finish=on_finish)
    assert failed == {} and left == 0
    # one slot: each run ends in a round of its own, and the pack holds the finished run's numbers
    assert len(seen) == 3 and "runs/bf16-lr0.0001-s0/metrics.jsonl" in seen[0]
    # within `every` seconds of the last write (or of its start) it writes nothing
    later = jobs.pack_often(exp, tmp_path / "later.tgz", [], every=3600.0)
    later()
    assert not (tmp_path / "later.tgz").exists()


def test_mps_daemons_per_gpu_and_their_clients_environment(tmp_path, monkeypatch):
    # a stand-in for nvidia-cuda-mps-control that logs how it was called, and a stand-in worker
    # that logs the environment it got
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    calls = tmp_path / "calls.jsonl"
    fake = bin_ / "nvidia-cuda-mps-control"
    fake.write_text(f"""#!{sys.executable}
import json, os, sys
stdin = "" if "-d" in sys.argv else sys.stdin.read()
keys = ("CUDA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")
with open({str(calls)!r}, "a") as f:
    f.write(json.dumps(dict(args=sys.argv[1:], stdin=stdin,
                            env={{k: os.environ.get(k) for k in keys}})) + "\\n")
""")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    envs = jobs.mps_start(["0", "1"])
    started = [json.loads(x) for x in calls.read_text().splitlines()]
    # one daemon a GPU, each seeing its GPU alone, each with its own pipe folder
    assert [c["args"] for c in started] == [["-d"], ["-d"]]
    assert [c["env"]["CUDA_VISIBLE_DEVICES"] for c in started] == ["0", "1"]
    assert [c["env"]["CUDA_MPS_PIPE_DIRECTORY"] for c in started] == [
        envs[g]["CUDA_MPS_PIPE_DIRECTORY"] for g in ("0", "1")]
    assert envs["0"]["CUDA_MPS_PIPE_DIRECTORY"] != envs["1"]["CUDA_MPS_PIPE_DIRECTORY"]

    worker = tmp_path / "worker.py"
    worker.write_text("import json, os, sys\n"
                      "spec = json.loads(sys.argv[sys.argv.index('--worker') + 1])\n"
                      "keys = ('CUDA_VISIBLE_DEVICES', 'CUDA_MPS_PIPE_DIRECTORY')\n"
                      "open(spec['log'], 'w').write(json.dumps({k: os.environ.get(k) "
                      "for k in keys}))\n")
    exp = tmp_path / "exp"
    todo = [dict(name=f"r{i}", log=str(tmp_path / f"r{i}.json")) for i in range(2)]
    failed, left = jobs.run_jobs(todo, ["0", "1"], exp, 0.5, worker, mps=envs)
    assert failed == {} and left == 0
    got = [json.loads(Path(j["log"]).read_text()) for j in todo]
    # each run reaches its slot's GPU through that GPU's daemon, which shows it as device 0
    # (unset, torch's NVML count sees every GPU of the machine and asks the server for a second)
    assert got == [dict(CUDA_VISIBLE_DEVICES="0",
                        CUDA_MPS_PIPE_DIRECTORY=envs[g]["CUDA_MPS_PIPE_DIRECTORY"])
                   for g in ("0", "1")]
    jobs.mps_stop(envs)
    stopped = [json.loads(x) for x in calls.read_text().splitlines()][2:]
    assert [(c["args"], c["stdin"]) for c in stopped] == [([], "quit\n")] * 2
    assert [c["env"]["CUDA_MPS_PIPE_DIRECTORY"] for c in stopped] == [
        envs[g]["CUDA_MPS_PIPE_DIRECTORY"] for g in ("0", "1")]


def test_a_later_pack_holds_only_what_the_earlier_ones_do_not(tmp_path):
    import tarfile
    exp = tmp_path / "exp"
    fake_run(exp / "runs" / "bf16-lr0.0001-s0", [0.1, 0.2], 0, 1e-4)
    (exp / "sessions.json").write_text('[{"part": "part1"}]')
    first = jobs.pack(exp, tmp_path / "part1.tgz")
    # the next machine: the first pack extracted (file times kept), one more run, a longer record
    there = tmp_path / "there"
    with tarfile.open(first) as tar:
        tar.extractall(there, filter="data")
    fake_run(there / "runs" / "bf16-lr0.0001-s1", [0.3, 0.4], 1, 1e-4)
    (there / "sessions.json").write_text('[{"part": "part1"}, {"part": "part2"}]')
    second = jobs.pack(there, tmp_path / "part2.tgz", [first])
    assert sorted(tarfile.open(second).getnames()) == [
        "runs/bf16-lr0.0001-s1/config.json", "runs/bf16-lr0.0001-s1/eval/step_000002/samples.jsonl",
        "runs/bf16-lr0.0001-s1/eval/step_000002/summary.json",
        "runs/bf16-lr0.0001-s1/metrics.jsonl", "sessions.json"]
    # both extracted in order give the whole experiment
    whole = tmp_path / "whole"
    for part in (first, second):
        with tarfile.open(part) as tar:
            tar.extractall(whole, filter="data")
    assert sorted(p.name for p in (whole / "runs").iterdir()) == ["bf16-lr0.0001-s0",
                                                                 "bf16-lr0.0001-s1"]
    assert "part2" in (whole / "sessions.json").read_text()


def test_runs_of_one_base_and_seed_share_their_step0_numbers(smoke, tmp_path, monkeypatch):
    """Another bf16 run of seed 0 (a copy of the smoke's, post.json removed): its post-run
    evaluation reads the probe and pass@k before any update from step0/, which the smoke's own run
    wrote, and evaluates only after its last step."""
    exp = Path(shutil.copytree(smoke, tmp_path / "exp"))
    assert len(list((exp / "step0").glob("bf16-s0-*.json"))) == 1
    src, run = exp / "runs" / NAMES[0], exp / "runs" / "bf16-lr0.001-s0"
    shutil.copytree(src, run)
    (run / "post.json").unlink()
    settings = json.loads((src / "post.json").read_text())["settings"]
    import eval as evaluation
    real, steps = evaluation.evaluate, []

    def counted(*a, **k):
        steps.append(Path(k["out_dir"]).name)
        return real(*a, **k)
    monkeypatch.setattr(evaluation, "evaluate", counted)
    monkeypatch.setattr(jobs, "probe_entropy", lambda *a: pytest.fail("probe ran again"))
    got = jobs.post_run(run, settings)
    ref = json.loads((src / "post.json").read_text())
    assert steps == ["step_000002"]
    assert got["pass_at_k"]["0"] == ref["pass_at_k"]["0"]
    assert got["entropy_probe"] == ref["entropy_probe"]
    assert got["pass_at_k"]["2"] == ref["pass_at_k"]["2"]    # same adapter, same draws


def test_share_bench_runs_the_designs_flags_shortened(tmp_path):
    """experiments/share_bench.py (a GPU benchmark) hands train.py the Countdown design's flags with
    --steps, --eval-limit, --eval-every and --save-every replaced; train.py's parser and checks take
    them."""
    import share_bench
    from trainer.config import apply_model_defaults, check_config, parse_args
    argv = share_bench.train_argv(30, 4, tmp_path / "run")
    cfg, _, _ = parse_args(argv)
    apply_model_defaults(cfg)
    check_config(cfg)
    got = (cfg.steps, cfg.eval_limit, cfg.eval_every, cfg.save_every, cfg.seed)
    assert got == (30, 64, 0, 30, 4)
    assert (cfg.model, cfg.base, cfg.aqn, cfg.lr) == ("models/countdown5", "bf16", False, 3e-4)
    assert share_bench.main(["--procs", "0"]) == 2
