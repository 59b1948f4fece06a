"""Tests of tasks/data.py: readers, prompts, answer extraction and fail-closed scoring, on real
cases of each format.

Golds are read from the bundled files by row index and checked against the value written here, so
the cases are the datasets' own answers, not invented ones. Runs on CPU in a few seconds.
"""
import json
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tasks import data  # noqa: E402
from tasks import rewards  # noqa: E402

TOKENIZER_DIR = Path(__file__).resolve().parent / "assets" / "qwen2.5-tokenizer"


@pytest.fixture(scope="module")
def rows():
    """Bundled rows per task, read once."""
    return {t: data.load_rows(t)[0]
            for t in ("gsm8k", "gsm8k_train", "math500", "aime24", "aime25", "amc23")}


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)


# ---------------------------------------------------------------- reading the bundled data

def test_bundled_tasks_load_with_expected_sizes_and_no_skips():
    for task, n in [("gsm8k", 1319), ("gsm8k_train", 7473), ("math500", 500), ("aime24", 30),
                    ("aime25", 30), ("amc23", 40)]:
        got, stats = data.load_rows(task)
        assert len(got) == n and stats["rows"] == n and stats["read"] == n
        assert (stats["skipped_no_answer"] == stats["skipped_no_question"]
                == stats["skipped_bad_gold"] == 0)
        assert all(r["question"].strip() and r["gold"] for r in got)
        assert {r["kind"] for r in got} == {data.TASKS[task]["kind"]}


def test_limit_and_seed():
    first, _ = data.load_rows("math500", limit=5)
    assert [r["index"] for r in first] == [0, 1, 2, 3, 4]
    a, _ = data.load_rows("math500", limit=5, seed=1)
    b, _ = data.load_rows("math500", limit=5, seed=1)
    c, _ = data.load_rows("math500", limit=5, seed=2)
    assert a == b and a != c


# GSM8K gold lines as they end in the files (split, row index, the answer's last line, parsed gold).
GSM8K_GOLDS = [
    ("gsm8k", 0, "#### 18", "18"),
    ("gsm8k", 146, "#### 2,125", "2125"),            # thousands separator
    ("gsm8k", 611, "#### 1,450,000", "1450000"),     # two separators
    ("gsm8k", 1113, "#### -3", "-3"),                # negative
    ("gsm8k_train", 345, "#### 1,080", "1080"),
    ("gsm8k_train", 5715, "#### -7", "-7"),
]


@pytest.mark.parametrize("task,index,last_line,gold", GSM8K_GOLDS)
def test_gsm8k_gold_lines(rows, task, index, last_line, gold):
    raw = data._read_jsonl(data.TASKS[task]["path"])[index]["answer"]
    assert raw.splitlines()[-1] == last_line
    assert rewards.parse_gold(raw, "gsm8k") == gold
    assert rows[task][index]["gold"] == gold


def test_competition_golds(rows):
    assert rows["aime24"][7]["gold"] == "025"   # AIME24 answers are zero-padded strings
    assert rows["aime25"][0]["gold"] == "70"    # AIME25 answers are ints
    assert rows["amc23"][0]["gold"] == "27"     # AMC23 answers are floats: 27.0
    assert rows["amc23"][15]["gold"] == "-1"    # -1.0
    assert rewards.score("\\boxed{25}", "025", "math")["correct"]
    assert rewards.score("\\boxed{025}", "025", "math")["correct"]
    assert not rewards.score("\\boxed{250}", "025", "math")["correct"]
    assert rewards.score("so the distance is \\boxed{27}.", rows["amc23"][0]["gold"],
                         "math")["correct"]
    assert rewards.score("\\boxed{27.0}", "27", "math")["correct"]


# ---------------------------------------------------------------- GSM8K-style extraction

GSM8K_RESPONSES = [
    ("She makes 9 * 2 = $18 every day.\nThe answer is \\boxed{18}.", "18"),
    ("In total he earns \\boxed{\\$1,080}", "1080"),
    ("So the total cost was \\boxed{\\$1,450,000}.", "1450000"),        # commas, $
    ("The average temperature was \\boxed{-7 \\text{ degrees}}", "-7"),  # negative, unit word
    ("It was 2 - 5 = -3 degrees, so \\boxed{-3}", "-3"),
    ("10 - 3 = 7, so the answer is \\boxed{7 dollars}", "7"),           # units
    ("\\boxed{18.00}", "18"),                                          # trailing .00
    ("\\boxed{+18.0}", "18"),                                         # leading +, trailing .0
    ("\\boxed{2.50}", "2.5"),
    ("\\boxed{18 \\text{ dollars}}", "18"),
    ("\\boxed{1{,}080}", "1080"),                                     # LaTeX thousands separator
    ("The answer is \\boxed 5", "5"),                                 # \boxed without braces
    # several boxed: the LAST wins
    ("First \\boxed{12}, but that was wrong; finally \\boxed{18}.", "18"),
    # an empty box is no answer, skipped
    ("I put it in \\boxed{}: \\boxed{18}", "18"),
    ("I am not sure how to solve this.", None),                      # no answer at all
    ("\\boxed{C}", None),                                             # a box without a number
    # Fail-closed: without a closed last box there is no answer, whatever numbers the text holds.
    # Each of these scored before (the last number anywhere, or an earlier box).
    ("So the total cost was $1,450,000.", None),
    ("The average temperature was -7 degrees Fahrenheit.", None),
    ("10 - 3 = 7, so the answer is 7 dollars", None),
    ("The answer is 18.00", None),
    ("Answer: \\boxed{12} ... recheck: \\boxed{1", None),             # the last box is cut off
    ("The answer is \\boxed", None),
]


@pytest.mark.parametrize("response,expected", GSM8K_RESPONSES)
def test_gsm8k_extraction(response, expected):
    assert rewards.extract_answer(response, "gsm8k") == expected


def test_gsm8k_scoring_and_fail_closed():
    assert rewards.score("\\boxed{1,080}", "1080", "gsm8k")["correct"]
    assert rewards.score("\\boxed{1080.0}", "1080", "gsm8k")["correct"]
    wrong = rewards.score("\\boxed{1081}", "1080", "gsm8k")
    assert wrong == {"reward": 0.0, "correct": False, "format_ok": True, "parse_failed": False,
                     "pred": "1081"}
    none = rewards.score("I give up.", "1080", "gsm8k")
    assert none["reward"] == 0.0 and none["parse_failed"] and none["pred"] is None
    # An unparsable gold scores 0, never 1, even when the response holds the "right" number.
    for bad_answer in ["She makes 18 dollars.", "#### eighteen", "####"]:
        gold = rewards.parse_gold(bad_answer, "gsm8k")
        assert gold is None
        s = rewards.score("\\boxed{18}", gold, "gsm8k", format_weight=0.0)
        assert s["reward"] == 0.0 and not s["correct"] and s["parse_failed"]
    s = rewards.score("\\boxed{18}", "not a number", "gsm8k")
    assert s["reward"] == 0.0 and s["parse_failed"]


# Issue 40's cases: (response, right gold, gold of what it scored before): right with the first,
# wrong with the second.
ISSUE_CASES = [
    ("\\boxed{16}", "16", None),
    ("\\boxed{\\frac{1}{2}}", "0.5", "2"),        # was 2: the last number of the box
    ("\\boxed{-\\$5}", "-5", "5"),                # was 5: \$ hid the sign
    ("\\boxed{.5}", "0.5", None),                 # was a parse failure
    ("\\boxed{1e3}", "1000", "1"),
    ("\\boxed{10^3}", "1000", "3"),
    ("\\boxed{2\\times10^3}", "2000", "3"),
]


@pytest.mark.parametrize("response,gold,old", ISSUE_CASES)
def test_gsm8k_box_contents_from_the_issue(response, gold, old):
    s = rewards.score(response, gold, "gsm8k")
    assert s["correct"] and not s["parse_failed"] and s["pred"] == gold and s["reward"] == 1.0
    if old is not None:
        s = rewards.score(response, old, "gsm8k")
        assert not s["correct"] and not s["parse_failed"] and s["reward"] == 0.0


@pytest.mark.parametrize("response,gold,fmt_ok", [
    # echoes the question (GSM8K test row 0): was correct
    ("Janet's ducks lay 16 eggs per day.", "16", False),
    ("\\boxed{7", "7", False),                            # truncated, no closing brace: was correct
    ("\\boxed{10:30}", "30", True),                       # a time is not a number: was 30
])
def test_gsm8k_no_answer_scores_zero_as_parse_failure(response, gold, fmt_ok):
    s = rewards.score(response, gold, "gsm8k", format_weight=0.5)
    assert s == {"reward": 0.5 * fmt_ok, "correct": False, "format_ok": fmt_ok,
                 "parse_failed": True, "pred": None}


# Box contents: a number, possibly with unit words or as an expression of one value, else not a
# number (None).
BOX_CONTENTS = [
    ("16 eggs per day", "16"),
    ("\\text{16 eggs}", "16"),
    ("25\\%", "25"),
    ("90^\\circ", "90"),
    ("\\$1,080.00", "1080"),
    ("\\$-5", "-5"),
    ("\\frac{3}{4}", "0.75"),
    ("\\dfrac{1}{2} \\text{ cup}", "0.5"),        # a unit after an expression
    ("12 - 7", "5"),
    ("1.5 \\times 10^{2}", "150"),
    ("\\frac{1}{3}", "1/3"),                      # exact, never rounded
    ("5 and 7", None),                             # two different numbers
    ("5, 7", None),
    ("16 or 18", None),
    ("1,08", None),                                # not a thousands separator: a list
    ("x = 18", None),                              # a variable
    ("The answer is 18.", None),                   # words before the number
    ("3:1", None),                                 # a ratio
    ("2\\pi", None),                               # irrational
    ("10^{10^{10}}", None),                        # too large to be a GSM8K answer (and to expand)
    ("1e999", None),
]


@pytest.mark.parametrize("content,expected", BOX_CONTENTS)
def test_gsm8k_box_contents(content, expected):
    assert rewards.extract_answer(f"so \\boxed{{{content}}}", "gsm8k") == expected


def test_gsm8k_values_compare_exactly():
    assert not rewards.score("\\boxed{\\frac{1}{3}}", "0.33", "gsm8k")["correct"]
    assert rewards.score("\\boxed{\\frac{6}{12}}", "0.5", "gsm8k")["correct"]
    assert rewards.score("\\boxed{\\frac{6}{2}}", "3", "gsm8k")["pred"] == "3"


# fmt "think": the answer is the last closed <answer> block (its last box if it has one); nothing
# else counts.
THINK_ANSWERS = [
    ("<think>9*2=18</think><answer>\\boxed{18}</answer>", "18"),
    ("<think>9*2=18</think><answer> 18 </answer>", "18"),                # QeRL's bare answer
    ("<think>\\boxed{18}</think><answer>\\boxed{17}</answer>", "17"),
    # a box outside any answer block
    ("<think>so 18</think>\\boxed{18}", None),
    # the block is not closed (truncated)
    ("<think>so 18</think><answer>\\boxed{18}", None),
    # the last block is not closed
    ("<answer>\\boxed{18}</answer> wait: <answer>\\boxed{19}", None),
    ("<think>x</think><answer>\\boxed{18</answer>", None),              # its box is not closed
    ("<think>x</think><answer>The answer is 18.</answer>", None),
    ("<think>x</think><answer> </answer>", None),
]


@pytest.mark.parametrize("response,expected", THINK_ANSWERS)
def test_think_answers_are_fail_closed(response, expected):
    assert rewards.extract_answer(response, "gsm8k", fmt="think") == expected


def test_gsm8k_expressions_off_the_main_thread():
    box = []
    t = threading.Thread(
        target=lambda: box.append(rewards.score("\\boxed{\\frac{1}{2}}", "0.5", "gsm8k")))
    t.start()
    t.join(30)
    assert box and box[0]["correct"] and not box[0]["parse_failed"]


# ---------------------------------------------------------------- MATH-style extraction and scoring

def test_math_extraction():
    # nested braces
    assert rewards.extract_answer("so $p = \\boxed{\\frac{1}{2}}$.", "math") == "\\frac{1}{2}"
    # MATH-500 row 0's own solution ending
    r = "are $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$"
    assert rewards.extract_answer(r, "math") == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert (rewards.extract_answer("\\boxed{\\frac{1}{3}} no, \\boxed{\\frac{1}{2}}", "math")
            == "\\frac{1}{2}")
    assert rewards.extract_answer("\\fbox{7}", "math") == "7"
    # empty boxes don't count
    assert rewards.extract_answer("\\boxed{} then \\boxed{x^{2}}", "math") == "x^{2}"
    # math answers must be boxed
    assert rewards.extract_answer("The answer is 1/2.", "math") is None
    # last box cut off
    assert rewards.extract_answer("\\boxed{\\frac{1}{2}} or \\boxed{\\frac{1}{", "math") is None
    # no <answer>
    assert rewards.extract_answer("<think>x</think>\\boxed{\\frac{1}{2}}", "math",
                                  fmt="think") is None


def test_math500_solutions_boxed_answer_matches_gold(rows):
    """Every MATH-500 solution's last \\boxed{} is scored correct against the row's gold (same
    formatting family)."""
    raw = data._read_jsonl(data.TASKS["math500"]["path"])
    sample = raw[::25]   # 20 rows spread over subjects and levels
    results = [rewards.score(r["solution"], r["answer"], "math") for r in sample]
    assert all(s["correct"] and not s["parse_failed"] for s in results), \
        [(r["answer"], s["pred"]) for r, s in zip(sample, results) if not s["correct"]]


# (MATH-500 row index, gold as in the file, response, correct?)
MATH_CASES = [
    (219, "\\frac{1}{2}", "\\boxed{0.5}", True),                      # fraction vs decimal
    (219, "\\frac{1}{2}", "\\boxed{\\dfrac{1}{2}}", True),
    (219, "\\frac{1}{2}", "\\boxed{1/2}", True),
    (219, "\\frac{1}{2}", "\\boxed{0.6}", False),
    (2, "\\frac{14}{3}", "\\boxed{\\frac{28}{6}}", True),
    # rounded decimal is not equal
    (2, "\\frac{14}{3}", "\\boxed{4.67}", False),
    # intervals: open/closed ends matter
    (103, "(3,4]", "\\boxed{(3, 4]}", True),
    (103, "(3,4]", "\\boxed{(3,4)}", False),
    (383, "x \\in [-2,7]", "\\boxed{[-2,7]}", True),
    (383, "x \\in [-2,7]", "\\boxed{[-2, 7)}", False),
    (435, "(-\\infty, 2) \\cup (3, \\infty)", "\\boxed{(-\\infty,2)\\cup(3,\\infty)}", True),
    (435, "(-\\infty, 2) \\cup (3, \\infty)", "\\boxed{(-\\infty,3)\\cup(2,\\infty)}", False),
    (227, "\\text{(C)}", "\\boxed{\\text{(C)}}", True),
    (227, "\\text{(C)}", "\\boxed{\\text{(D)}}", False),
    (459, "\\$18.90", "\\boxed{18.9}", True),
    (198, "10,\\!080", "\\boxed{10080}", True),                      # LaTeX thousands in the gold
    (198, "10,\\!080", "\\boxed{10,080}", True),
    (16, "-50", "\\boxed{-50}", True),                               # negative
    (16, "-50", "\\boxed{50}", False),
    (16, "-50", "First \\boxed{-50}, no wait: \\boxed{50}", False),   # several boxed: the last wins
    (16, "-50", "First \\boxed{50}, no wait: \\boxed{-50}", True),
]


@pytest.mark.parametrize("index,gold,response,correct", MATH_CASES)
def test_math_scoring_on_math500_golds(rows, index, gold, response, correct):
    assert rows["math500"][index]["gold"] == gold
    s = rewards.score(response, gold, "math")
    assert s["correct"] is correct and not s["parse_failed"]
    assert s["reward"] == (1.0 if correct else 0.0)


def test_math_fail_closed():
    # No answer in the response.
    s = rewards.score("I could not finish.", "\\frac{1}{2}", "math", format_weight=0.5)
    assert s["reward"] == 0.0 and s["parse_failed"] and not s["correct"]
    # Gold missing, or golds that math-verify cannot parse (the last two are real MATH 12k train
    # answers): 0 even for a response that repeats them exactly, and counted as a parse failure.
    for gold in [None, "}{", "a + b + c", "\\sin^2 t"]:
        s = rewards.score(f"\\boxed{{{gold}}}", gold, "math")
        assert s["reward"] == 0.0 and not s["correct"] and s["parse_failed"], gold
    # A response that cannot be parsed.
    s = rewards.score("\\boxed{}}{}", "5", "math")
    assert s["reward"] == 0.0 and not s["correct"]


# Real MATH 12k train golds that math-verify alone cannot parse: LaTeX thousands and a trailing
# period.
MATH12K_GOLDS = [
    ("\\dfrac{2469}{20,\\!000}", "\\boxed{0.12345}"),
    ("\\frac{12}{5,\\!525}", "\\boxed{\\frac{24}{11050}}"),
    ("30^\\circ.", "\\boxed{30^\\circ}"),
    ("7\\text{ hours}.", "\\boxed{7}"),
]


@pytest.mark.parametrize("gold,response", MATH12K_GOLDS)
def test_math12k_golds_that_need_cleaning(gold, response):
    s = rewards.score(response, gold, "math")
    assert s["correct"] and not s["parse_failed"]


def test_math_fallback_without_math_verify(monkeypatch):
    monkeypatch.setattr(rewards, "math_verify", None)
    assert rewards.math_equal("\\frac{1}{2}", "\\dfrac{1}{2}") == (True, True)
    assert rewards.math_equal("27", "27.0") == (True, True)
    assert rewards.math_equal("\\left( 3, \\frac{\\pi}{2} \\right)",
                              "(3,\\frac{\\pi}{2})") == (True, True)
    # string equality knows no fractions
    assert rewards.math_equal("\\frac{1}{2}", "0.5") == (True, False)


def test_math_verify_works_off_the_main_thread():
    box = []
    t = threading.Thread(
        target=lambda: box.append(rewards.score("\\boxed{0.5}", "\\frac{1}{2}", "math")))
    t.start()
    t.join(30)
    assert box and box[0]["correct"] and not box[0]["parse_failed"]


def test_timeout_off_the_main_thread(monkeypatch):
    monkeypatch.setattr(rewards, "_mv_check",
                        lambda g, p, t: (time.sleep(3), (True, True, True))[1])
    box = []
    start = time.time()
    t = threading.Thread(
        target=lambda: box.append(rewards.score("\\boxed{1}", "1", "math", timeout_s=0.2)))
    t.start()
    t.join(10)
    assert time.time() - start < 2.0
    assert box[0]["reward"] == 0.0 and box[0]["parse_failed"]   # abandoned check: fail-closed


def test_timeout_in_the_main_thread(monkeypatch):
    import math_verify.parser
    if not hasattr(math_verify.parser, "extract_target_from_pred"):
        pytest.skip("this math-verify version has no extract_target_from_pred to slow down")
    monkeypatch.setattr(math_verify.parser, "extract_target_from_pred",
                        lambda *a, **k: time.sleep(10))
    start = time.time()
    s = rewards.score("\\boxed{1}", "1", "math", timeout_s=1)
    assert time.time() - start < 5.0   # math-verify's SIGALRM interrupted the parse after 1 s
    assert s["reward"] == 0.0 and s["parse_failed"]


# ---------------------------------------------------------------- format and weights

THINK_CASES = [
    ("<think>9*2=18</think><answer>\\boxed{18}</answer>", True),
    # bare answer, whitespace around
    ("<think>\n9*2=18\n</think>\n<answer>18</answer>\n", True),
    ("<answer>18</answer>", False),                                    # no think block
    ("<think>x</think><answer>18</answer> and more text", False),      # text after the answer
    ("<think>x</think><answer>1</answer><answer>2</answer>", False),   # two answers
    ("<think>x</think><answer> </answer>", False),                     # empty answer
    ("<think>x<think>y</think><answer>1</answer>", False),             # nested think
]


@pytest.mark.parametrize("response,ok", THINK_CASES)
def test_think_format(response, ok):
    assert rewards.format_ok(response, "think") is ok


def test_boxed_format():
    assert rewards.format_ok("so \\boxed{\\frac{1}{2}}", "boxed")
    assert not rewards.format_ok("so 1/2", "boxed")
    assert not rewards.format_ok("so \\boxed{}", "boxed")
    assert not rewards.format_ok("so \\boxed{\\frac{1}{2}", "boxed")    # unclosed
    # the last one is unclosed
    assert not rewards.format_ok("so \\boxed{\\frac{1}{2}} or \\boxed{\\frac{1}{", "boxed")


def test_think_extraction_prefers_the_answer_block():
    r = "<think>maybe \\boxed{3}? no.</think><answer>5</answer>"
    assert rewards.extract_answer(r, "gsm8k", fmt="think") == "5"
    assert rewards.extract_answer(r, "gsm8k", fmt="boxed") == "3"
    assert rewards.extract_answer("<think>x</think><answer>\\frac{1}{2}</answer>", "math",
                                  fmt="think") == "\\frac{1}{2}"


def test_format_and_accuracy_weights_are_separate():
    good = "<think>9*2</think><answer>\\boxed{18}</answer>"
    assert rewards.score(good, "18", "gsm8k", "think", 0.2, 1.0)["reward"] == pytest.approx(1.2)
    assert rewards.score(good, "17", "gsm8k", "think", 0.2, 1.0)["reward"] == pytest.approx(0.2)
    # right answer, no <think>
    s = rewards.score("<answer>\\boxed{18}</answer>", "18", "gsm8k", "think", 0.2, 1.0)
    assert s["correct"] and not s["format_ok"] and s["reward"] == pytest.approx(1.0)
    # no <answer> block: no answer at all
    s = rewards.score("\\boxed{18}", "18", "gsm8k", "think", 0.2, 1.0)
    assert not s["correct"] and s["parse_failed"] and s["reward"] == 0.0
    assert rewards.score(good, "18", "gsm8k", "think", 0.0, 0.5)["reward"] == pytest.approx(0.5)
    summary = rewards.summarize([rewards.score(good, "18", "gsm8k", "think"),
                                 rewards.score("no", "18", "gsm8k", "think")])
    assert summary == {"n": 2, "reward": 0.5, "accuracy": 0.5, "format_rate": 0.5,
                       "parse_fail_rate": 0.5}


# ---------------------------------------------------------------- synthetic task

def test_synthetic_rows():
    lucky = data.synthetic_rows(200, seed=0)
    assert lucky == data.synthetic_rows(200, seed=0) and lucky != data.synthetic_rows(200, seed=1)
    assert ({r["answer"] for r in lucky} == {"7"}
            and len({r["question"] for r in lucky}) == len(data.LUCKY))
    cp = data.synthetic_rows(200, seed=0, kind="copy")
    for r in cp:
        assert r["question"] == (f"Which digit is repeated here: {' '.join([r['answer']] * 16)}? "
                                 "Answer with a single digit.")
    assert len({r["answer"] for r in cp}) == 10
    nxt = data.synthetic_rows(200, seed=0, kind="next")
    assert data.load_rows("synthetic_next", limit=200)[0][0]["question"] == nxt[0]["question"]
    for r in nxt:
        d = int(r["question"].split()[4].rstrip("?"))
        assert (r["answer"] == str((d + 1) % 10)
                and r["question"].startswith("What digit comes after"))
    assert len({r["question"] for r in nxt}) == 10
    a = data.synthetic_rows(200, seed=0, kind="mod10")
    b = data.synthetic_rows(200, seed=0, kind="mod10")
    assert a == b and a != data.synthetic_rows(200, seed=1, kind="mod10")
    for r in a:
        x, op, y = r["question"].split()[2:5]
        expected = {"+": int(x) + int(y), "*": int(x) * int(y)}[op] % 10
        assert r["answer"] == str(expected) and len(r["answer"]) == 1
        assert r["question"].endswith("modulo 10? Answer with a single digit.")
    assert data.load_rows("synthetic_mod10", limit=5)[0][0]["question"].endswith(
        "modulo 10? Answer with a single digit.")
    got, stats = data.load_rows("synthetic", limit=20, seed=3)
    assert len(got) == 20 and stats["rows"] == 20 and got[0]["kind"] == "gsm8k"
    assert rewards.score(f"The result is \\boxed{{{got[0]['gold']}}}", got[0]["gold"],
                         "gsm8k")["correct"]


# ---------------------------------------------------------------- prompts

def test_build_prompt(tokenizer):
    q = "What is 2+3?"
    p = data.build_prompt(tokenizer, q)
    assert p == (f"<|im_start|>system\n{data.SYSTEM_PROMPT}<|im_end|>\n"
                 f"<|im_start|>user\n{q}<|im_end|>\n"
                 "<|im_start|>assistant\n")
    assert "\\boxed{}" in data.SYSTEM_PROMPT
    t = data.build_prompt(tokenizer, q, "think")
    assert data.THINK_SYSTEM_PROMPT in t and "<think>" in t and "<answer>" in t
    ids = data.prompt_token_ids(tokenizer, q)
    assert tokenizer.decode(ids) == p
    # no special tokens added twice
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    # the question's own tokens
    assert [3838, 374, 220, 17, 10, 18, 30] == ids[-12:-5]
    with pytest.raises(ValueError, match="format"):
        data.build_prompt(tokenizer, q, "xml")


def test_build_prompt_without_chat_template():
    class Bare:
        chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        data.build_prompt(Bare(), "q")


# ---------------------------------------------------------------- bad input

def _write(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_math12k_empty_answers_are_skipped_and_counted(tmp_path):
    # Rows in the MATH 12k train layout; the two with "" mirror its real empty-answer rows
    # (lines 1166, 8126).
    p = _write(tmp_path / "train_12k.jsonl", [
        {"problem": "How many vertical asymptotes does the graph of $y=\\frac{2}{x^2+x-6}$ have?",
         "answer": "2"},
        {"problem": "For any integer $n>1$, the number of prime numbers greater than $n!+1$ ...",
         "answer": ""},
        {"problem": "If $5x - 3 = 12$, what is the value of $5x + 3$?", "answer": "18"},
        {"problem": "You are given a sequence of $58$ terms; ...", "answer": ""},
        {"problem": "A row whose answer field is missing altogether"},
    ])
    got, stats = data.load_rows("math12k", p)
    assert [r["gold"] for r in got] == ["2", "18"] and [r["index"] for r in got] == [0, 2]
    assert stats["skipped_no_answer"] == 3 and stats["rows"] == 2 and stats["read"] == 5


def test_gzip_and_skipped_bad_gsm8k_gold(tmp_path):
    import gzip
    p = tmp_path / "g.jsonl.gz"
    with gzip.open(p, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"question": "q1", "answer": "x\n#### 1,000"}) + "\n\n")
        f.write(json.dumps({"question": "q2", "answer": "no final line"}) + "\n")
        f.write(json.dumps({"answer": "#### 3"}) + "\n")
    got, stats = data.load_rows("gsm8k", str(p))
    assert [r["gold"] for r in got] == ["1000"]
    assert stats["skipped_bad_gold"] == 1 and stats["skipped_no_question"] == 1


def test_unknown_task():
    with pytest.raises(ValueError, match="unknown task 'gsm9k'.*gsm8k.*math500"):
        data.load_rows("gsm9k")


def test_missing_file(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl.*--data"):
        data.load_rows("gsm8k", missing)


def test_math12k_needs_a_path():
    with pytest.raises(ValueError, match="math12k.*--data"):
        data.load_rows("math12k")


def test_rows_without_the_needed_field(tmp_path):
    p = _write(tmp_path / "wrong.jsonl", [{"problem": "p", "solution": "s"}] * 3)
    with pytest.raises(ValueError, match="'answer'"):
        data.load_rows("math500", p)
    with pytest.raises(ValueError, match="'question'"):
        data.load_rows("gsm8k", p)


def test_bad_json_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"question": "q", "answer": "#### 1"}\n{not json\n', encoding="utf-8")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        data.load_rows("gsm8k", str(p))


def test_unknown_kind_and_format():
    with pytest.raises(ValueError, match="kind"):
        rewards.extract_answer("\\boxed{1}", "code")
    with pytest.raises(ValueError, match="format"):
        rewards.format_ok("\\boxed{1}", "xml")
    with pytest.raises(ValueError, match="gold kind"):
        rewards.parse_gold("1", "code")


# ---------------------------------------------------------------- stop tokens

LLAMA3_TEMPLATE = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                   "{{ m['content'] }}<|eot_id|>{% endfor %}"
                   "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>"
                   "\n\n{% endif %}")
WORDS = ["[UNK]", "What", "is", "2", "+", "3", "?", "system", "user", "assistant"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]
# ids of the special tokens, added after the words
END_OF_TEXT, EOT = len(WORDS) + 1, len(WORDS) + 4


def llama3_style_tokenizer(folder: Path, eos_token="<|end_of_text|>", template=LLAMA3_TEMPLATE):
    """A tiny tokenizer laid out like Llama 3's: eos <|end_of_text|>, turns end with <|eot_id|>, no
    <|im_end|>."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    tk = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tk.add_special_tokens(LLAMA3_SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]",
                                   bos_token="<|begin_of_text|>", eos_token=eos_token)
    fast.chat_template = template
    fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def test_stop_tokens_of_a_llama3_style_tokenizer(tmp_path):
    tok = llama3_style_tokenizer(tmp_path)
    assert tok.convert_tokens_to_ids("<|eot_id|>") == EOT and tok.eos_token_id == END_OF_TEXT
    # what the old code looked for
    assert tok.convert_tokens_to_ids("<|im_end|>") in (None, tok.unk_token_id)
    assert data.stop_token_ids(tok) == [END_OF_TEXT, EOT]
    # a folder without generation_config.json
    assert data.stop_token_ids(tok, tmp_path) == [END_OF_TEXT, EOT]
    assert data.build_prompt(tok, "What is 2 + 3 ?").endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("eos,expected", [
    # a list, as Llama 3.1's generation_config.json has
    ([EOT, END_OF_TEXT, 7], [EOT, END_OF_TEXT, 7]),
    (EOT, [EOT, END_OF_TEXT]),                         # an int
    (None, [END_OF_TEXT, EOT]),
])
def test_stop_tokens_from_generation_config(tmp_path, eos, expected):
    tok = llama3_style_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos, "temperature": 0.6}))
    assert data.stop_token_ids(tok, tmp_path) == expected


def test_stop_tokens_of_the_bundled_qwen_tokenizer(tokenizer):
    # tests/assets/qwen2.5-tokenizer/generation_config.json lists [151645, 151643]:
    # <|im_end|>, <|endoftext|>
    assert data.stop_token_ids(tokenizer, TOKENIZER_DIR) == [151645, 151643]
    # eos is <|im_end|>, also the template's end of turn
    assert data.stop_token_ids(tokenizer) == [151645]


def test_stop_tokens_for_a_hub_id(tokenizer, monkeypatch):
    import transformers
    asked = []

    def offline(name, *a, **k):
        asked.append(name)
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")
    monkeypatch.setattr(transformers.GenerationConfig, "from_pretrained", offline)
    # the tokenizer alone
    assert data.stop_token_ids(tokenizer, "Qwen/Qwen2.5-7B-Instruct") == [151645]
    assert asked == ["Qwen/Qwen2.5-7B-Instruct"]
    monkeypatch.setattr(
        transformers.GenerationConfig, "from_pretrained",
        lambda name, *a, **k: transformers.GenerationConfig(eos_token_id=[151643, 151645]))
    assert data.stop_token_ids(tokenizer, "Qwen/Qwen2.5-7B-Instruct") == [151643, 151645]


def test_no_stop_token_is_an_error(tmp_path):
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"   # no end-of-turn token
    tok = llama3_style_tokenizer(tmp_path, eos_token=None, template=plain)
    assert tok.eos_token_id is None
    with pytest.raises(ValueError, match="no stop token.*eos_token"):
        data.stop_token_ids(tok, tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["<|eot_id|>"]}))
    with pytest.raises(ValueError, match="eos_token_id must be a token id"):
        data.stop_token_ids(tok, tmp_path)


def test_readme_example_rows_load_whole():
    """data/example/rows.jsonl (README, "Your own data"): every row usable, golds as written."""
    root = Path(__file__).resolve().parent.parent
    rows, stats = data.load_rows("gsm8k_train", str(root / "data" / "example" / "rows.jsonl"))
    assert stats["read"] == stats["rows"] == 8
    assert (sorted(r["gold"] for r in rows)
            == sorted(["25", "112", "44", "6", "63", "12", "9", "340"]))
