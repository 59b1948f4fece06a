"""tasks/countdown.py: the checker (each way to be right and to be wrong), the gold string, the
split, the exhaustive solver on instances enumerated by hand, generation, rows and the command
line. Standard library only; a few seconds on one CPU core."""
import hashlib
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks import countdown

ROOT = Path(__file__).resolve().parent.parent

GOLD = "29 from 3,7,8,2"
# 8*3 = 24, 24+7 = 31, 31-2 = 29: every given number used once, 29 is the target
RIGHT = "8*3=24\n24+7=31\n31-2=29\n\\boxed{29}"


# ---------------------------------------------------------------------------------------------
# The checker

def test_a_correct_answer():
    assert countdown.check(RIGHT, GOLD) == (True, True)


def test_operands_in_either_order():
    # 3*8 = 24 and 7+24 = 31 are as true as 8*3 and 24+7 (31-2 has one order: 2-31 is negative)
    assert countdown.check("3*8=24\n7+24=31\n31-2=29\n\\boxed{29}", GOLD) == (True, True)


def test_blank_lines_and_text_after_the_box():
    response = "\n8*3=24\n\n24+7=31\n  31-2=29  \n\n\\boxed{ 29 }\nDone."
    assert countdown.check(response, GOLD) == (True, True)


def test_an_exact_division():
    # 8/2 = 4 (2*4 = 8), 4+3 = 7
    assert countdown.check("8/2=4\n4+3=7\n\\boxed{7}", "7 from 8,2,3") == (True, True)


WRONG = {
    # 31+2 is 33, not 29; the rest (numbers, final value, box) would be right
    "false equation": ("8*3=24\n24+7=31\n31+2=29\n\\boxed{29}", GOLD),
    # 8*3 = 24 takes the only 3; 24+3 = 27 takes it again (27+2 = 29 is true, 7 is left over)
    "number used twice": ("8*3=24\n24+3=27\n27+2=29\n\\boxed{29}", GOLD),
    # 6*4 = 24: neither 6 nor 4 is given (nor made)
    "number not given": ("6*4=24\n24+7=31\n31-2=29\n\\boxed{29}", GOLD),
    # the same three true steps as RIGHT, but 24 is used on the line before the one that makes it
    "result used before it is made": ("24+7=31\n8*3=24\n31-2=29\n\\boxed{29}", GOLD),
    # 8*3 = 24, 24+7 = 31 is the target, but the given 2 is never used
    "given number unused": ("8*3=24\n24+7=31\n\\boxed{31}", "31 from 3,7,8,2"),
    # 31+2 = 33 is true and uses everything, but 33 is not the target the box claims
    "final value is not the target": ("8*3=24\n24+7=31\n31+2=33\n\\boxed{29}", GOLD),
    # a valid derivation of 29, and 30 in the box
    "box is not the target": ("8*3=24\n24+7=31\n31-2=29\n\\boxed{30}", GOLD),
    # a valid derivation of 29, but the box must hold exactly the target
    "box holds more than the target": ("8*3=24\n24+7=31\n31-2=29\n\\boxed{29=29}", GOLD),
    # 7/2 is 3.5 (3 only with floor division); 3+3 = 6 would then reach the target
    "division not exact": ("7/2=3\n3+3=6\n\\boxed{6}", "6 from 7,2,3"),
    # 3-3 = 0 and 7-7 = 0 are true; 0/0=7 passes "0*7 == 0" but divides by 0
    "division by zero": ("3-3=0\n7-7=0\n0/0=7\n\\boxed{7}", "7 from 3,3,7,7"),
    "stray line first": ("Let me try.\n" + RIGHT, GOLD),
    "stray line between steps": ("8*3=24\nthen\n24+7=31\n31-2=29\n\\boxed{29}", GOLD),
    "prose before the box": ("8*3=24\n24+7=31\n31-2=29\nSo: \\boxed{29}", GOLD),
    "an expression, not a step": ("8*3+7-2=29\n\\boxed{29}", GOLD),
    "spaces inside a step": ("8 * 3 = 24\n24+7=31\n31-2=29\n\\boxed{29}", GOLD),
    "a second box before the last": ("\\boxed{29}\n" + RIGHT, GOLD),
    # one step too many: 29*1 needs a 1, and none is left
    "an extra step": ("8*3=24\n24+7=31\n31-2=29\n29*1=29\n\\boxed{29}", GOLD),
    "the box alone": ("\\boxed{29}", GOLD),
    "a malformed gold": (RIGHT, "29 from 3,7,8,"),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_each_way_to_be_wrong(name):
    response, gold = WRONG[name]
    assert countdown.check(response, gold) == (False, True), name


@pytest.mark.parametrize("response", [
    "8*3=24\n24+7=31\n31-2=29\n29",                  # the answer, not boxed
    "8*3=24\n24+7=31\n31-2=29\n\\boxed{29",          # a box never closed
    "",
])
def test_no_closed_box_is_not_formatted(response):
    assert countdown.check(response, GOLD) == (False, False)


def test_an_unclosed_last_box_leaves_the_earlier_one():
    # as in arith: the last *closed* box counts; the text before it is RIGHT's steps
    assert countdown.check(RIGHT + "\n\\boxed{3", GOLD) == (True, True)


# ---------------------------------------------------------------------------------------------
# Texts and the gold string

def test_question_and_solution_text():
    assert countdown.question([3, 7, 8, 2], 29) == "Use 3, 7, 8, 2 to make 29."
    steps = [(8, "*", 3, 24), (24, "+", 7, 31), (31, "-", 2, 29)]
    assert countdown.solution(steps) == RIGHT


def test_gold_round_trip():
    assert countdown.gold({"numbers": [3, 7, 8, 2], "target": 29}) == GOLD
    assert countdown.parse_gold(GOLD) == ([3, 7, 8, 2], 29)
    for r in countdown.rows(30, seed=4):
        numbers, target = countdown.parse_gold(r["answer"])
        assert (numbers, target) == (r["numbers"], r["target"])
        assert countdown.gold({"numbers": numbers, "target": target}) == r["answer"]


@pytest.mark.parametrize("bad", [
    None, 29, b"29 from 3,7", "", "29", "29 from", "29 from ", "29 from 3,,7", "29 from 3,7,",
    "29 from 3, 7", " 29 from 3,7", "29 from 3,7\n", "x from 3", "-1 from 3", "29 from -3",
    "029 from 3", "29 from 3.5", "29 to 3,7", "\u0662\u0669 from 3",        # Arabic-Indic 29
])
def test_malformed_golds(bad):
    assert countdown.parse_gold(bad) is None
    assert countdown.check(RIGHT, bad) == (False, True)


# ---------------------------------------------------------------------------------------------
# The split

def test_split_is_a_hash_of_the_sorted_numbers_and_the_target():
    for numbers, target in [([3, 7, 8, 2], 29), ([1, 1, 5], 6), ([10, 2, 9, 4, 4], 61)]:
        key = ",".join(str(x) for x in sorted(numbers)) + f">{target}"    # "2,3,7,8>29"
        h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
        want = "test" if h % 100 < 10 else "train"
        assert countdown.split_of(numbers, target) == want
        assert countdown.split_of(numbers[::-1], target) == want
        assert countdown.split_of(sorted(numbers), target) == want


def test_split_is_disjoint():
    train = countdown.rows(2000, 0, "train") + countdown.rows(2000, 1, "train")
    test = countdown.rows(2000, 0, "test")
    assert all(countdown.split_of(r["numbers"], r["target"]) == "train" for r in train)
    assert all(countdown.split_of(r["numbers"], r["target"]) == "test" for r in test)
    train_keys = {(tuple(sorted(r["numbers"])), r["target"]) for r in train}
    test_keys = {(tuple(sorted(r["numbers"])), r["target"]) for r in test}
    assert len(test_keys) > 500                          # a real sample, not a handful repeated
    assert not train_keys & test_keys


# ---------------------------------------------------------------------------------------------
# The solver, on instances enumerated by hand

def test_solve_two_numbers():
    # 2+1 = 3, 2-1 = 1, 2*1 = 2, 2/1 = 2: only the sum makes 3
    assert countdown.solve([1, 2], 3) == [[(2, "+", 1, 3)]]
    assert countdown.solve([2, 1], 3) == [[(2, "+", 1, 3)]]
    assert countdown.solve([1, 2], 5) == []
    assert countdown.hit_fraction([1, 2], 3) == 1 / 4


def test_solve_equal_numbers_counts_each_text_once():
    # 2+2 = 4, 2-2 = 0, 2*2 = 4, 2/2 = 1: two of four derivations make 4
    assert sorted(countdown.solve([2, 2], 4)) == [[(2, "*", 2, 4)], [(2, "+", 2, 4)]]
    assert countdown.hit_fraction([2, 2], 4) == 2 / 4


# Numbers 1, 1, 2: two pairs of values, (1,1) and (2,1) (the latter at two pairs of positions,
# one text). Each first move, the pair left and its moves:
#   1+1=2 -> {2,2}: 4 0 4 1              2+1=3 -> {3,1}: 4 2 3 3
#   1-1=0 -> {2,0}: 2 2 0 (2/0 no)       2-1=1 -> {1,1}: 2 0 1 1
#   1*1=1 -> {2,1}: 3 1 2 2              2*1=2 -> {2,1}: 3 1 2 2
#   1/1=1 -> {2,1}: 3 1 2 2              2/1=2 -> {2,1}: 3 1 2 2
# derivations: 4+3+4+4 + 4+4+4+4 = 31; three end at 4.
def test_solve_repeated_numbers_counts_each_text_once():
    assert sorted(countdown.solve([1, 2, 1], 4)) == sorted([
        [(1, "+", 1, 2), (2, "+", 2, 4)],
        [(1, "+", 1, 2), (2, "*", 2, 4)],
        [(2, "+", 1, 3), (3, "+", 1, 4)],
    ])
    assert countdown.hit_fraction([1, 2, 1], 4) == 3 / 31


# Numbers 2, 3, 4: every first move, the pair left, and its valid moves (larger first; + and *
# at most 100, / exact):
#   3+2=5 -> {5,4}: 9 1 20 (5/4 no)        4+2=6 -> {6,3}: 9 3 18 2     4+3=7  -> {7,2}: 9 5 14
#   3-2=1 -> {1,4}: 5 3 4 4                4-2=2 -> {2,3}: 5 1 6        4-3=1  -> {1,2}: 3 1 2 2
#   3*2=6 -> {6,4}: 10 2 24 (6/4 no)       4*2=8 -> {8,3}: 11 5 24      4*3=12 -> {12,2}: 14 10 24 6
#   (3/2 no)                               4/2=2 -> {2,3}: 5 1 6        (4/3 no)
# derivations: 3+4+3 + 4+3+3+3 + 3+4+4 = 34; three end at 24, three at 9.
def test_solve_three_numbers():
    assert sorted(countdown.solve([2, 3, 4], 24)) == sorted([
        [(3, "*", 2, 6), (6, "*", 4, 24)],
        [(4, "*", 2, 8), (8, "*", 3, 24)],
        [(4, "*", 3, 12), (12, "*", 2, 24)],
    ])
    assert sorted(countdown.solve([4, 2, 3], 9)) == sorted([
        [(3, "+", 2, 5), (5, "+", 4, 9)],
        [(4, "+", 2, 6), (6, "+", 3, 9)],
        [(4, "+", 3, 7), (7, "+", 2, 9)],
    ])
    assert countdown.hit_fraction([2, 3, 4], 24) == 3 / 34
    assert countdown.hit_fraction([2, 3, 4], 9) == 3 / 34
    assert countdown.solve([2, 3, 4], 23) == []        # not in the lists above


def test_solve_five_numbers_is_fast():
    start = time.perf_counter()
    found = countdown.solve([10, 9, 7, 3, 2], 61)
    countdown.hit_fraction([10, 9, 7, 3, 2], 61)
    assert time.perf_counter() - start < 1.0
    # one derivation by hand: 9*7 = 63, 10/2 = 5, 5-3 = 2, 63-2 = 61
    assert [(9, "*", 7, 63), (10, "/", 2, 5), (5, "-", 3, 2), (63, "-", 2, 61)] in found
    for steps in found:                                # whatever it finds is a correct answer
        assert countdown.check(countdown.solution(steps), "61 from 10,9,7,3,2") == (True, True)


# ---------------------------------------------------------------------------------------------
# Generation

def test_random_derivation_of_two_ones():
    # 1+1 = 2, 1-1 = 0 (no target: None), 1*1 = 1, 1/1 = 1, each a quarter of the time
    possible = {None: 0, 2: 0, "*": 0, "/": 0}
    for seed in range(200):
        got = countdown.random_derivation(random.Random(seed), [1, 1])
        if got is None:
            possible[None] += 1
        elif got[1] == 2:
            assert got == ([(1, "+", 1, 2)], 2)
            possible[2] += 1
        else:
            assert got in (([(1, "*", 1, 1)], 1), ([(1, "/", 1, 1)], 1))
            possible[got[0][0][1]] += 1
    assert all(n > 20 for n in possible.values())      # about 50 each


@pytest.mark.parametrize("count,max_number", [(3, 10), (4, 10), (5, 10), (4, 25)])
def test_sample_instance(count, max_number):
    rng = random.Random(count * 100 + max_number)
    for split in ("train", "test"):
        for _ in range(50):
            inst = countdown.sample_instance(rng, count, max_number, split)
            numbers = inst["numbers"]
            target = inst["target"]
            steps = inst["steps"]
            assert len(numbers) == count and all(1 <= x <= max_number for x in numbers)
            assert 1 <= target <= 100 and countdown.split_of(numbers, target) == split
            assert len(steps) == count - 1
            for a, op, b, c in steps:
                assert a >= b and 0 <= c <= 100                    # larger first, bounded
            assert steps[-1][3] == target
            assert countdown.check(countdown.solution(steps), countdown.gold(inst)) == (True, True)


@pytest.mark.parametrize("count,max_number", [(1, 10), (0, 10), (4, 0), (4, 101)])
def test_bad_knobs(count, max_number):
    with pytest.raises(ValueError):
        countdown.sample_instance(random.Random(0), count, max_number, "train")


def test_every_test_row_is_solvable_and_its_solution_checks():
    test_rows = countdown.rows(50, split="test")
    insts = countdown.instances(50, split="test")       # the same instances, with their steps
    for r, inst in zip(test_rows, insts):
        assert (r["numbers"], r["target"]) == (inst["numbers"], inst["target"])
        found = countdown.solve(r["numbers"], r["target"])
        assert inst["steps"] in found                  # the corpus derivation is among them
        assert countdown.check(countdown.solution(inst["steps"]), r["answer"]) == (True, True)
        for steps in found:
            assert countdown.check(countdown.solution(steps), r["answer"]) == (True, True)


def test_rows():
    a = countdown.rows(30, seed=5)
    assert a == countdown.rows(30, seed=5)
    assert a != countdown.rows(30, seed=6)
    # the test split ignores the seed: the same prompts every run
    assert countdown.rows(20, 0, "test") == countdown.rows(20, 7, "test")
    r = a[0]
    assert set(r) == {"question", "answer", "numbers", "target", "count", "split"}
    assert r["count"] == 4 and r["split"] == "train" and len(r["numbers"]) == 4
    assert r["question"] == countdown.question(r["numbers"], r["target"])


def test_tasks():
    assert countdown.TASKS == {"countdown": ("train", 4), "countdown_test": ("test", 4),
                               "countdown3": ("train", 3), "countdown3_test": ("test", 3),
                               "countdown5": ("train", 5), "countdown5_test": ("test", 5)}
    assert len(countdown.task_rows("countdown_test", None, None)) == 500
    three = countdown.task_rows("countdown3", 10, 1)
    assert three == countdown.rows(10, 1, "train", 3)
    assert all(len(r["numbers"]) == 3 for r in three)
    assert countdown.task_rows("countdown5_test", 5, 9) == countdown.rows(5, 0, "test", 5)


def test_corpus_example():
    rng = random.Random(0)
    for _ in range(20):
        q, text = countdown.corpus_example(rng)
        m = re.fullmatch(r"Use (\d+), (\d+), (\d+), (\d+) to make (\d+)\.", q)
        assert m is not None
        gold = f"{m[5]} from {m[1]},{m[2]},{m[3]},{m[4]}"
        assert countdown.split_of([int(x) for x in m.groups()[:4]], int(m[5])) == "train"
        assert countdown.check(text, gold) == (True, True)
        assert text.count("\n") == 3                   # three steps, then the box


# ---------------------------------------------------------------------------------------------
# The command line

def test_check_command(capsys):
    assert countdown.main(["--check"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["overlap"] == 0 and out["unsolvable"] == 0 and out["bad_solutions"] == 0
    assert 0 < out["mean_hit_fraction"] < 1
    assert out["train"] > out["test"] > 0


def test_show_command(capsys):
    assert countdown.main(["--limit", "2", "--count", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("\\boxed{") >= 2 and out.count("Use ") == 2


@pytest.mark.parametrize("argv", [["--count", "1"], ["--max-number", "0"],
                                  ["--check", "--count", "0"]])
def test_bad_values_give_one_line(argv, capsys):
    assert countdown.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("countdown.py: error:") and err.count("\n") == 1


def test_bad_count_from_the_shell():
    proc = subprocess.run([sys.executable, "-m", "tasks.countdown", "--count", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == "countdown.py: error: count must be >= 2, got 1\n"
