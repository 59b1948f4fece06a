"""Tests of tasks/stargraph.py: the checker on a graph written out by hand, the gold string, the
hash split, the generated rows and the command line.

Expected values are worked out here (by hand, or by a small independent reading of the question
text: a regex and a depth-first search), never taken from the module under test. Runs on one CPU
core in a few seconds.
"""
import hashlib
import json
import random
import re
from pathlib import Path

import pytest

from tasks import stargraph

ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- a graph by hand
# center 12, three arms of three nodes each:
#   12>5>19>40    12>7>33>2    12>3>8>21
# the goal is 40, the end of the first arm; the edges below are in the (shuffled) prompt order
EDGES = [(19, 40), (12, 7), (3, 8), (12, 5), (33, 2), (8, 21), (5, 19), (7, 33), (12, 3)]
INSTANCE = {"edges": EDGES, "start": 12, "goal": 40, "path": [12, 5, 19, 40],
            "degree": 3, "length": 3}
GOLD = "12,40|19>40 12>7 3>8 12>5 33>2 8>21 5>19 7>33 12>3"
QUESTION = "Edges: 19>40 12>7 3>8 12>5 33>2 8>21 5>19 7>33 12>3 Path from 12 to 40?"
SOLUTION = "12>5\n5>19\n19>40\n\\boxed{12>5>19>40}"
# the edges sorted as pairs of numbers: (3,8) (5,19) (7,33) (8,21) (12,3) (12,5) (12,7) (19,40)
# (33,2); with the goal in front, that is the canonical form the split hashes
CANONICAL = "40|3>8 5>19 7>33 8>21 12>3 12>5 12>7 19>40 33>2"


def hash_split(canonical: str) -> str:
    """The split rule written out independently: the first 8 bytes of sha256, mod 100, < 10."""
    h = int(hashlib.sha256(canonical.encode()).hexdigest()[:16], 16)
    return "test" if h % 100 < 10 else "train"


def read_question(text: str) -> tuple[list, int, int]:
    """(edges, start, goal) read off a question's text, independently of the module."""
    match = re.fullmatch(r"Edges: ([0-9> ]+) Path from ([0-9]+) to ([0-9]+)\?", text)
    assert match, text
    edges = [tuple(int(x) for x in e.split(">")) for e in match.group(1).split(" ")]
    return edges, int(match.group(2)), int(match.group(3))


def all_paths(edges: list, start: int, goal: int) -> list[list[int]]:
    """Every simple directed path from start to goal, by depth-first search."""
    found = []
    stack = [[start]]
    while stack:
        path = stack.pop()
        if path[-1] == goal:
            found.append(path)
            continue
        for u, v in edges:
            if u == path[-1] and v not in path:
                stack.append(path + [v])
    return found


def test_hand_written_graph_question_solution_and_gold():
    assert stargraph.question(INSTANCE) == QUESTION
    assert stargraph.solution(INSTANCE) == SOLUTION
    assert stargraph.gold(INSTANCE) == GOLD
    assert stargraph.parse_gold(GOLD) == INSTANCE        # path, degree and length rebuilt
    assert stargraph.check(SOLUTION, GOLD) == (True, True)


@pytest.mark.parametrize("response, correct, formatted", [
    ("\\boxed{12>5>19>40}", True, True),                 # hop lines are optional
    ("12>5 then 5>19 then 19>40: \\boxed{ 12 > 5 > 19 > 40 }", True, True),  # spaces allowed
    ("\\boxed{12>7>33>2}", False, True),                  # the wrong arm: ends at 2, not 40
    ("\\boxed{12>7>33>40}", False, True),                 # wrong arm, then 33>40 is no edge
    ("\\boxed{12>3>8>21>40}", False, True),               # wrong arm, then 21>40 is no edge
    ("\\boxed{12>5>40}", False, True),                    # skips 19: 5>40 is no edge
    ("\\boxed{12>40}", False, True),                      # skips the whole arm
    ("\\boxed{12>5>12>5>19>40}", False, True),            # 5>12 is an edge backwards
    ("\\boxed{12>5>19>2>40}", False, True),               # 19>2 and 2>40 are no edges
    ("\\boxed{12>5>19}", False, True),                    # stops before the goal
    ("\\boxed{12}", False, True),                         # only the start
    ("\\boxed{5>19>40}", False, True),                    # does not start at the start
    ("\\boxed{40>19>5>12}", False, True),                 # the path backwards
    ("\\boxed{}", False, True),                           # empty box
    ("\\boxed{12->5->19->40}", False, True),              # unparsable
    ("\\boxed{12>05>19>40}", False, True),                # a leading zero is not a label
    ("\\boxed{12>>5>19>40}", False, True),                # an empty label
    ("\\boxed{12>5>19>40>}", False, True),                # a trailing ">"
    ("\\boxed{twelve>5>19>40}", False, True),
    ("12>5\n5>19\n19>40\n12>5>19>40", False, False),      # no box at all
    ("\\boxed{12>5>19>40", False, False),                 # an unclosed box is no box
    ("\\boxed{12>7>33>2}\n\\boxed{12>5>19>40}", True, True),   # the last box counts
    ("\\boxed{12>5>19>40}\n\\boxed{12>7>33>2}", False, True),  # the last box counts
    ("\\boxed{12>5>19>40}\n\\boxed{12>7", True, True),    # an unclosed last box: the one before
])
def test_checker_on_the_hand_written_graph(response, correct, formatted):
    assert stargraph.check(response, GOLD) == (correct, formatted)


@pytest.mark.parametrize("bad", [
    "",
    "12,40",                                               # no edges
    "12|19>40 12>7 3>8 12>5 33>2 8>21 5>19 7>33 12>3",     # no goal
    "12,40|",                                              # empty edge list
    "12,40|19>40 12>7 3>8 12>5 33>2 8>21 5>19 7>33 12>3 ",  # trailing space
    "12,40|19>40  12>7 3>8 12>5 33>2 8>21 5>19 7>33 12>3",  # double space
    "12,40|19-40 12>7 3>8 12>5 33>2 8>21 5>19 7>33 12>3",  # not an edge
    "12,040|19>40 12>7 3>8 12>5 33>2 8>21 5>19 7>33 12>3",  # leading zero
    "12,4\u00b2|12>5 5>4\u00b2 12>7 7>9",                  # a digit int() rejects
    "12,19|19>40 12>7 3>8 12>5 33>2 8>21 5>19 7>33 12>3",  # the goal is inside an arm
    "12,99|19>40 12>7 3>8 12>5 33>2 8>21 5>19 7>33 12>3",  # the goal is not in the graph
    "5,40|19>40 12>7 3>8 12>5 33>2 8>21 5>19 7>33 12>3",   # the start is not the center
    "12,40|12>5 5>19 19>40",                               # one arm: no fork
    "12,40|12>5 5>19 19>40 12>7",                          # arms of different lengths
    "12,40|12>5 5>40 12>7 7>40",                           # 40 has two parents
    "12,40|12>5 5>40 5>9 12>7 7>8",                        # a branching arm
    "12,40|12>5 5>40 12>7 7>9 3>4 4>3",                    # a cycle away from the center
    "12,40|12>5 5>40 12>7 7>7",                            # a self-loop
    "12,40|12>5 5>12 12>7 7>40",                           # a cycle through the center
    "12,40|9>12 12>5 5>40 12>7 7>8",                       # an edge into the center
    "12,40|40>5 5>12 7>12 9>7",                            # edges toward the center
])
def test_malformed_golds_parse_to_none_and_never_check(bad):
    assert stargraph.parse_gold(bad) is None
    # a box that would be right for the hand-written graph: formatted, but never correct
    assert stargraph.check("\\boxed{12>5>19>40}", bad) == (False, True)


def test_parse_gold_of_non_strings_is_none():
    assert stargraph.parse_gold(None) is None
    assert stargraph.parse_gold(GOLD.encode()) is None


def test_gold_round_trip_on_generated_instances():
    rng = random.Random(5)
    for degree, length in [(2, 1), (3, 4), (5, 4), (8, 4), (4, 7)]:
        for _ in range(20):
            x = stargraph.sample_instance(rng, degree, length, 60, "train")
            assert stargraph.parse_gold(stargraph.gold(x)) == x


# ----------------------------------------------------------------------------- the split

def test_split_is_a_hash_of_the_goal_and_sorted_edges_not_of_their_order():
    expected = hash_split(CANONICAL)
    rng = random.Random(0)
    for _ in range(10):
        edges = list(EDGES)
        rng.shuffle(edges)
        assert stargraph.split_of(dict(INSTANCE, edges=edges)) == expected
    assert stargraph.split_of(dict(INSTANCE, edges=EDGES[::-1])) == expected


def test_train_and_test_rows_never_overlap():
    train = [r for seed in (0, 1) for r in stargraph.rows(2000, seed, "train")]
    test = stargraph.rows(1000, 123, "test")
    forms = {"train": set(), "test": set()}
    for side, side_rows in (("train", train), ("test", test)):
        for r in side_rows:
            assert r["split"] == side
            edges, start, goal = read_question(r["question"])
            canonical = f"{goal}|" + " ".join(f"{u}>{v}" for u, v in sorted(edges))
            assert hash_split(canonical) == side                # each row is on its own side
            forms[side].add(canonical)
    assert len(forms["train"]) == 4000 and len(forms["test"]) == 1000   # no repeats at 5x4 on 50
    assert not forms["train"] & forms["test"]


# ----------------------------------------------------------------------------- generated rows

def test_test_rows_have_one_path_and_their_corpus_solution_checks():
    for r in stargraph.rows(50, split="test"):
        edges, start, goal = read_question(r["question"])
        assert (r["start"], r["goal"], r["degree"], r["length"]) == (start, goal, 5, 4)
        assert len(edges) == 5 * 4
        paths = all_paths(edges, start, goal)
        assert len(paths) == 1 and len(paths[0]) == 4 + 1    # one path: the center and one arm
        # the center has five out-edges; every other node at most one
        assert sum(u == start for u, v in edges) == 5
        text = stargraph.solution(stargraph.parse_gold(r["answer"]))
        hops = "\n".join(f"{u}>{v}" for u, v in zip(paths[0], paths[0][1:]))
        assert text == hops + "\n\\boxed{" + ">".join(map(str, paths[0])) + "}"
        assert stargraph.check(text, r["answer"]) == (True, True)
        # the uniform-first-hop policy's other four choices go into wrong arms and fail
        for u, first in edges:
            if u == start and first != paths[0][1]:
                wrong = [start, first]
                while any(a == wrong[-1] for a, b in edges):
                    wrong.append(next(b for a, b in edges if a == wrong[-1]))
                box = "\\boxed{" + ">".join(map(str, wrong)) + "}"
                assert stargraph.check(box, r["answer"]) == (False, True)


@pytest.mark.parametrize("degree, length, max_label", [(5, 4, 50), (3, 4, 13), (8, 4, 33)])
def test_labels_are_distinct_and_in_range(degree, length, max_label):
    for r in stargraph.rows(100, 0, "train", degree, length, max_label):
        edges, start, goal = read_question(r["question"])
        labels = [start] + [v for u, v in edges]                # each node once: the center, heads
        assert len(labels) == len(set(labels)) == degree * length + 1
        assert all(1 <= x <= max_label for x in labels)
        if max_label == degree * length + 1:                    # tight: every label is used
            assert set(labels) == set(range(1, max_label + 1))


def test_edges_are_shuffled():
    # 5 of the 20 edges leave the center, so a shuffled prompt starts with one of them in about a
    # quarter of the rows (about 50 of 200); edges written arm by arm would start so in all 200
    rows = stargraph.rows(200, 0)
    first_from_center = 0
    for r in rows:
        edges, start, goal = read_question(r["question"])
        first_from_center += edges[0][0] == start
    assert 20 < first_from_center < 90


def test_rows_are_deterministic_and_the_test_side_ignores_the_seed():
    assert stargraph.rows(20, 3) == stargraph.rows(20, 3)
    assert stargraph.rows(20, 3) != stargraph.rows(20, 4)
    assert stargraph.rows(20, 0, "test") == stargraph.rows(20, 7, "test")
    keys = {"question", "answer", "start", "goal", "degree", "length", "split"}
    assert set(stargraph.rows(1)[0]) == keys


def test_registered_tasks_and_their_sizes():
    assert stargraph.TASKS == {
        "stargraph": ("train", 5, 4), "stargraph_test": ("test", 5, 4),
        "stargraph3": ("train", 3, 4), "stargraph3_test": ("test", 3, 4),
        "stargraph8": ("train", 8, 4), "stargraph8_test": ("test", 8, 4),
    }
    assert len(stargraph.task_rows("stargraph", None, None)) == 2000
    test = stargraph.task_rows("stargraph3_test", None, 9)
    assert len(test) == 500 and {(r["degree"], r["split"]) for r in test} == {(3, "test")}
    few = stargraph.task_rows("stargraph8", 4, 1)
    assert len(few) == 4 and all(len(read_question(r["question"])[0]) == 8 * 4 for r in few)


def test_corpus_example_is_a_correct_worked_solution():
    rng = random.Random(0)
    for _ in range(20):
        q, text = stargraph.corpus_example(rng, degree=3, length=2)
        edges, start, goal = read_question(q)
        (path,) = all_paths(edges, start, goal)
        lines = text.split("\n")
        assert lines[:-1] == [f"{u}>{v}" for u, v in zip(path, path[1:])]
        assert all(tuple(map(int, line.split(">"))) in edges for line in lines[:-1])
        assert lines[-1] == "\\boxed{" + ">".join(map(str, path)) + "}"


@pytest.mark.parametrize("kwargs", [dict(degree=1), dict(length=0), dict(max_label=20),
                                    dict(split="dev")])
def test_bad_knobs_raise_value_error(kwargs):
    # 5 arms of 4 nodes and a center need 21 labels, so max_label=20 is one short
    with pytest.raises(ValueError):
        stargraph.sample_instance(random.Random(0), **kwargs)


# ----------------------------------------------------------------------------- the command line

def test_check_command_passes(monkeypatch, capsys):
    # fewer rows than the command's 20000 a side, to keep this file fast; the logic is the same
    monkeypatch.setattr(stargraph, "CHECK_ROWS", 1500)
    monkeypatch.setattr(stargraph, "FOLLOW_ROWS", 200)
    assert stargraph.main(["--check"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert report["train"] == report["test"] == 1500 and report["overlap"] == 0
    assert report["bad_golds"] == 0 and report["wrong_arm_passed"] == 0
    assert report["follow_edges_rate"] == 0.2                 # one arm in five
    assert stargraph.main(["--check", "--degree", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["follow_edges_rate"] == 0.125   # one in eight


def test_show_rows(capsys):
    assert stargraph.main(["--limit", "2", "--degree", "3", "--length", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("\\boxed{") == 2 and out.count("Path from") == 2


@pytest.mark.parametrize("argv, word", [
    (["--degree", "1"], "degree"),
    (["--length", "0", "--check"], "length"),
    (["--max-label", "20"], "max_label"),                  # 5x4 needs 21 labels
])
def test_bad_values_give_a_one_line_error(argv, word, capsys):
    assert stargraph.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1 and word in captured.err
    assert "Traceback" not in captured.err


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        stargraph.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--degree", "--length", "--max-label", "--split", "--limit", "--seed", "--check"):
        assert flag in out
