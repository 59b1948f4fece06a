"""noise.py: the AQN sigma schedule against the paper's formula, short runs, the printed schedule.

The expected sigmas are the paper's
sigma(k) = sigma_start * (sigma_end / sigma_start) ** ((k - 1) / (K - 1)) over the K noisy stages,
written out here (and as decimals), never taken from noise.py. `stages` counts the noise-free stage
too, as QeRL's code does, so K = stages - 1 (the model tests hold the README recipe: 10 stages, 100
steps).
"""
import json
import math

import pytest

import noise


def test_ten_noisy_stages_decay_by_a_fixed_ratio_from_start_to_end():
    # K = 10 noisy stages (stages = 11), 110 steps: stage k >= 1 covers steps 10k .. 10k + 9
    ratio = (5e-4 / 1e-2) ** (1 / 9)
    expected = [1e-2 * ratio ** (k - 1) for k in range(1, 11)]
    assert expected == pytest.approx([1.0e-2, 7.1687e-3, 5.1390e-3, 3.6840e-3, 2.6410e-3,
                                      1.8932e-3, 1.3572e-3, 9.7294e-4, 6.9748e-4, 5.0e-4],
                                     rel=1e-4)
    got = [noise.sigma_at(10 * k, 110, 1e-2, 5e-4, 11) for k in range(1, 11)]
    assert got == pytest.approx(expected, rel=1e-12)
    assert got[0] == 1e-2 and got[-1] == 5e-4
    assert all(noise.sigma_at(s, 110, 1e-2, 5e-4, 11) == 0.0 for s in range(10))


def test_three_noisy_stages():
    # stages = 4 over 40 steps: noise-free, then 1e-2, sqrt(1e-2 * 5e-4) = 2.2361e-3, 5e-4
    got = [noise.sigma_at(s, 40, 1e-2, 5e-4, 4) for s in (0, 9, 10, 19, 20, 29, 30, 39)]
    mid = math.sqrt(1e-2 * 5e-4)
    assert mid == pytest.approx(2.2361e-3, rel=1e-4)
    assert got == pytest.approx([0, 0, 1e-2, 1e-2, mid, mid, 5e-4, 5e-4], rel=1e-12)


def test_steps_map_to_equal_stages_like_qerl():
    # QeRL's rule: stage = int(step // (total_steps / stages)). 23 steps in 4 stages: first steps
    # 0, 6, 12, 18
    T, S = 23, 4
    assert [noise.stage_of(s, T, S) for s in range(T)] == [int(s // (T / S)) for s in range(T)]
    assert [first for first, _, _ in noise.schedule(T, 1e-2, 5e-4, S)] == [0, 6, 12, 18]
    assert [last for _, last, _ in noise.schedule(T, 1e-2, 5e-4, S)] == [5, 11, 17, 22]
    assert noise.stage_of(-3, T, S) == 0 and noise.stage_of(10 ** 6, T, S) == S - 1


def test_short_runs_are_compressed_never_skipped():
    # 7 steps, 10 stages asked: 7 stages of one step (the noise-free one, then K = 6 noisy ones),
    # none skipped (the old schedule ran stages 0, 1, 2, 4, 5, 7, 8 and never reached sigma_end)
    paper = [0.0] + [1e-2 * (5e-4 / 1e-2) ** ((k - 1) / 5) for k in range(1, 7)]
    assert paper[1:] == pytest.approx([1.0e-2, 5.4928e-3, 3.0171e-3, 1.6572e-3, 9.1028e-4, 5.0e-4],
                                      rel=1e-4)
    assert [noise.sigma_at(s, 7) for s in range(7)] == pytest.approx(paper, rel=1e-12)
    assert [noise.stage_of(s, 7) for s in range(7)] == list(range(7))
    note = noise.schedule_note(7, 10)
    assert note and "compressed" in note and "\n" not in note
    for T in range(2, 30):  # every length: each stage gets a step, no stage skipped
        stages = [noise.stage_of(s, T) for s in range(T)]
        assert stages == sorted(stages) and set(stages) == set(range(min(10, T)))
        sig = [noise.sigma_at(s, T) for s in range(T)]
        assert sig[0] == 0.0 and sig[math.ceil(T / min(10, T))] == 1e-2   # stage 1 starts there
        if T >= 3:
            assert sig[-1] == 5e-4
        assert (noise.schedule_note(T, 10) is None) == (T >= 10)


def test_equal_sigmas_one_noisy_stage_and_one_step():
    # constant: start == end
    assert {noise.sigma_at(s, 50, 3e-3, 3e-3, 10) for s in range(5, 50)} == {3e-3}
    # one noisy stage
    assert [noise.sigma_at(s, 10, 5e-2, 1e-4, 2) for s in range(10)] == [0.0] * 5 + [5e-2] * 5
    assert "one noisy stage" in noise.schedule_note(10, 2)
    # 1 step: no room for noise
    assert [noise.sigma_at(s, 1) for s in range(3)] == [0.0] * 3
    assert "no AQN noise" in noise.schedule_note(1, 10)


@pytest.mark.parametrize("args", [
    (0, 100, 1e-2, 5e-4, 1),
    (0, 0, 1e-2, 5e-4, 10),
    (0, 100, 1e-2, 0.0, 10),
    (0, 100, 1e-3, 1e-2, 10),
])
def test_bad_schedules_refused(args):
    with pytest.raises(ValueError, match="need"):
        noise.sigma_at(*args)


def test_printed_schedule(capsys):
    """`python noise.py --total-steps 100`: the config as one JSON line, then each stage's first
    step and sigma, from the noise-free stage through sigma_start to sigma_end."""
    assert noise.main(["--total-steps", "100"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("config: ")
    assert json.loads(lines[0][len("config: "):]) == dict(total_steps=100, sigma_start=1e-2,
                                                          sigma_end=5e-4, stages=10)
    rows = [line.split() for line in lines[1:]]
    assert len(rows) == 10 and all(r[0] == "stage" and r[2] == "steps" for r in rows)
    assert [int(r[3]) for r in rows] == list(range(0, 100, 10))
    sig = [float(r[r.index("sigma") + 1]) for r in rows]
    assert sig[0] == 0.0 and sig[1] == 1e-2 and sig[-1] == 5e-4
    assert all(a > b for a, b in zip(sig[1:], sig[2:]))
    noise.main(["--total-steps", "7"])
    assert "compressed" in capsys.readouterr().out.splitlines()[-1]
    with pytest.raises(SystemExit) as e:
        noise.main(["--total-steps", "0"])
    assert e.value.code == 2 and "total_steps >= 1" in capsys.readouterr().err
