"""countdown.py: Countdown, reach a target from a few numbers with + - * /, a generated task with
verifiable answers and worked solutions.

    python -m tasks.countdown --limit 3   # show rows, their worked solutions and other derivations
    python -m tasks.countdown --check     # the split is disjoint and every test row is solvable

The task: "Use 3, 7, 8, 2 to make 29." -> a derivation that uses every given number exactly once.
The worked solution writes one step a line, "a op b=c" without spaces: each step combines two
numbers still available (a given number or an earlier result, each used once), and its result
becomes available; with n numbers there are n-1 steps, then the boxed target:

    8*3=24
    24+7=31
    31-2=29
    \\boxed{29}

Why this task: it has real forks. At every step several moves are plausible and only some of them
lead to the target, so which move the policy samples decides the reward. A policy that picks moves
at random succeeds about as often as `hit_fraction` says (the share of all derivations that hit
the target; `--check` prints its mean), which is what makes exploration matter for RL here.
Why it is built as it is:
- The target is the value of a random derivation of the numbers (`random_derivation`), so every
  instance is solvable by construction, and the corpus solution is that derivation: a sample from
  "random derivations that hit this target". The pretrained model learns plausible moves, not the
  search; finding the moves that lead to the target is left to RL.
- Every number stays in 0..MAX_VALUE (100) and the given numbers are small (1..10 by default), so a
  model of a few million parameters can learn each step's arithmetic; the step lines are short.
- Steps are written larger operand first, so no step has a negative result and each move has one
  spelling in the corpus. The checker accepts either order (2+8=10 as well as 8+2=10): it checks
  that the arithmetic is true, not the style.
- `check` re-verifies the whole derivation: the box alone earns nothing (no reward hacking), and an
  arithmetic slip anywhere, a number used twice, one not given or one left unused make it wrong.
Difficulty knobs: `count` (3, 4 or 5 numbers; the default is 4) and `max_number` (numbers are
drawn from 1..max_number).
Train / test split: by a hash of (sorted numbers, target) (`split_of`), so a test instance, in any
order of its numbers, never occurs in the train split, whatever the seed or the number of rows.
Leaves out: parentheses and expressions (the step lines are the expression, one operation a line),
fractions and negative numbers, intermediate results over MAX_VALUE in generated derivations (the
checker accepts them: they are true arithmetic), instances without a solution, partial credit for
getting close, and the search itself (no backtracking is ever written down).
"""
import argparse
import hashlib
import json
import random
import re
import sys

from tasks.answer_box import BOXED, last_box

MAX_VALUE = 100       # no generated number (given, intermediate or target) is larger
TEST_PERCENT = 10     # share of the instance space that is held out (by hash), in percent
TEST_SEED = 20261126  # the held-out rows come from this fixed seed: the same prompts every run
DEFAULT_COUNT = 4
DEFAULT_MAX_NUMBER = 10
MAX_TRIES = 100_000   # sample_instance gives up after this many draws (a tiny instance space)
TASKS = {             # task name -> (split, count of numbers)
    "countdown": ("train", 4),
    "countdown_test": ("test", 4),
    "countdown3": ("train", 3),
    "countdown3_test": ("test", 3),
    "countdown5": ("train", 5),
    "countdown5_test": ("test", 5),
}
# at most 18 digits a number: int() stays cheap and far from Python's limit on digits it parses
_NUMBER = r"[0-9]{1,18}"
_STEP = re.compile(rf"({_NUMBER})([-+*/])({_NUMBER})=({_NUMBER})")
# a gold's numbers have no leading zeros, so that gold(parse_gold(text)) gives text back
_GOLD_NUMBER = r"(?:0|[1-9][0-9]{0,17})"
_GOLD = re.compile(rf"({_GOLD_NUMBER}) from ({_GOLD_NUMBER}(?:,{_GOLD_NUMBER})*)")


def split_of(numbers: list[int], target: int) -> str:
    """'test' or 'train', from a hash of the sorted numbers and the target (the order in which the
    numbers are given does not make another instance)."""
    key = ",".join(str(x) for x in sorted(numbers)) + f">{target}"
    digest = hashlib.sha256(key.encode()).digest()
    h = int.from_bytes(digest[:8], "big")              # sha256, not hash(): stable across processes
    return "test" if h % 100 < TEST_PERCENT else "train"


def question(numbers: list[int], target: int) -> str:
    return f"Use {', '.join(str(x) for x in numbers)} to make {target}."


def gold(instance: dict) -> str:
    """The gold string of an instance (a dict with "numbers" and "target"): "29 from 3,7,8,2"."""
    return f"{instance['target']} from {','.join(str(x) for x in instance['numbers'])}"


def parse_gold(text) -> tuple[list[int], int] | None:
    """(numbers, target) of a gold string, or None when it is malformed (never raises)."""
    if not isinstance(text, str):
        return None
    m = _GOLD.fullmatch(text)
    if m is None:
        return None
    numbers = [int(x) for x in m[2].split(",")]
    return numbers, int(m[1])


def moves(x: int, y: int) -> list[tuple[int, str, int, int]]:
    """The valid steps (a, op, b, c) that combine x and y, larger operand first: the result must be
    a non-negative integer no larger than MAX_VALUE. - and / of numbers in 0..MAX_VALUE stay in
    that range, so only + and * are bounded; / needs an exact quotient and a divisor other than 0
    (0/y is left out: it equals 0*y, and larger first it would be y/0)."""
    hi = max(x, y)
    lo = min(x, y)
    out = []
    if hi + lo <= MAX_VALUE:
        out.append((hi, "+", lo, hi + lo))
    out.append((hi, "-", lo, hi - lo))
    if hi * lo <= MAX_VALUE:
        out.append((hi, "*", lo, hi * lo))
    if lo != 0 and hi % lo == 0:
        out.append((hi, "/", lo, hi // lo))
    return out


def random_derivation(rng: random.Random,
                      numbers: list[int]) -> tuple[list[tuple], int] | None:
    """A random derivation of `numbers` (each in 0..MAX_VALUE): (steps, final value), or None when
    the final value is not in 1..MAX_VALUE (0 is no target). Each step picks an unordered pair of
    the remaining numbers uniformly, then one of its valid moves uniformly."""
    pool = list(numbers)
    steps = []
    while len(pool) > 1:
        i = rng.randrange(len(pool))
        j = rng.randrange(len(pool) - 1)
        if j >= i:
            j += 1                                     # j != i; each ordered pair equally likely
        step = rng.choice(moves(pool[i], pool[j]))     # never empty: - is always valid
        pool.pop(max(i, j))                            # the higher position first: the other stays
        pool.pop(min(i, j))
        pool.append(step[3])
        steps.append(step)
    value = pool[0]
    if not 1 <= value <= MAX_VALUE:
        return None
    return steps, value


def _check_knobs(count: int, max_number: int, split: str) -> None:
    if count < 2:
        raise ValueError(f"count must be >= 2, got {count}")
    if not 1 <= max_number <= MAX_VALUE:
        raise ValueError(f"max_number must be in 1..{MAX_VALUE}, got {max_number}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")


def sample_instance(rng: random.Random, count: int = DEFAULT_COUNT,
                    max_number: int = DEFAULT_MAX_NUMBER, split: str = "train") -> dict:
    """An instance {"numbers", "target", "steps"} of the given split: `count` numbers drawn from
    1..max_number, the target and the steps of the random derivation that made it (rejection
    sampling on the final value and on the hash)."""
    _check_knobs(count, max_number, split)
    for _ in range(MAX_TRIES):
        numbers = [rng.randint(1, max_number) for _ in range(count)]
        made = random_derivation(rng, numbers)
        if made is None:
            continue
        steps, target = made
        if split_of(numbers, target) == split:
            return {"numbers": numbers, "target": target, "steps": steps}
    # only a tiny instance space (say 2 numbers from 1..1) can have no instance on one side
    raise ValueError(f"no {split} instance of {count} numbers from 1..{max_number} in "
                     f"{MAX_TRIES} draws: the instance space is too small")


def solution(steps: list[tuple]) -> str:
    """The worked solution text of a derivation: one "a op b=c" line a step, then the boxed final
    value."""
    if not steps:
        raise ValueError("a solution needs at least one step")
    lines = [f"{a}{op}{b}={c}" for a, op, b, c in steps]
    lines.append(f"{BOXED}{steps[-1][3]}}}")
    return "\n".join(lines)


def instances(n: int, seed: int = 0, split: str = "train", count: int = DEFAULT_COUNT,
              max_number: int = DEFAULT_MAX_NUMBER) -> list[dict]:
    """n instances (with their steps), the ones `rows` makes; the test split ignores `seed`."""
    rng = random.Random(TEST_SEED if split == "test" else seed)
    return [sample_instance(rng, count, max_number, split) for _ in range(n)]


def rows(n: int, seed: int = 0, split: str = "train", count: int = DEFAULT_COUNT,
         max_number: int = DEFAULT_MAX_NUMBER) -> list[dict]:
    """n rows {"question", "answer", "numbers", "target", "count", "split"}; "answer" is the gold
    string; the test split ignores `seed` (fixed prompts)."""
    out = []
    for inst in instances(n, seed, split, count, max_number):
        out.append({"question": question(inst["numbers"], inst["target"]),
                    "answer": gold(inst),
                    "numbers": inst["numbers"],
                    "target": inst["target"],
                    "count": count,
                    "split": split})
    return out


def task_rows(task: str, limit: int | None, seed: int | None) -> list[dict]:
    """Raw rows of a registered task (2000 train / 500 test unless `limit` says)."""
    split, count = TASKS[task]
    if limit is not None:
        n = limit
    else:
        n = 2000 if split == "train" else 500
    return rows(n, seed or 0, split, count)


def corpus_example(rng: random.Random, split: str = "train", count: int = DEFAULT_COUNT,
                   max_number: int = DEFAULT_MAX_NUMBER) -> tuple[str, str]:
    """One fresh pretraining example: (question, worked solution)."""
    inst = sample_instance(rng, count, max_number, split)
    return question(inst["numbers"], inst["target"]), solution(inst["steps"])


def _splits(pool: tuple):
    """(step, the sorted multiset after it) for every move from the sorted multiset `pool`. Equal
    values give the same moves, so each distinct pair of values is tried once: the derivations
    built from these are distinct texts."""
    tried = set()
    for i in range(len(pool)):
        for j in range(i + 1, len(pool)):
            pair = (pool[i], pool[j])
            if pair in tried:
                continue
            tried.add(pair)
            rest = pool[:i] + pool[i + 1:j] + pool[j + 1:]
            for step in moves(pool[i], pool[j]):
                yield step, tuple(sorted(rest + (step[3],)))


def _derivations(pool: tuple, target: int, memo: dict) -> list[list[tuple]]:
    """Every derivation of the sorted multiset `pool` that ends at `target` (distinct texts).
    Memoized on the multiset, since many orders of steps reach the same one."""
    if len(pool) == 1:
        return [[]] if pool[0] == target else []
    if pool not in memo:
        memo[pool] = [[step] + tail for step, after in _splits(pool)
                      for tail in _derivations(after, target, memo)]
    return memo[pool]


def _count(pool: tuple, target: int, memo: dict) -> tuple[int, int]:
    """(derivations that hit `target`, all derivations) of the sorted multiset `pool`, counted
    as `_derivations` lists them."""
    if len(pool) == 1:
        return int(pool[0] == target), 1
    if pool not in memo:
        counts = [_count(after, target, memo) for _, after in _splits(pool)]
        memo[pool] = (sum(h for h, _ in counts), sum(t for _, t in counts))
    return memo[pool]


def solve(numbers: list[int], target: int) -> list[list[tuple]]:
    """Every valid derivation of `numbers` (by the rules of `moves`) that ends at `target`: a list
    of step lists, each a list of (a, op, b, c). Exhaustive; 5 numbers take milliseconds."""
    return _derivations(tuple(sorted(numbers)), target, {})


def hit_fraction(numbers: list[int], target: int) -> float:
    """The share of all derivations of `numbers` that end at `target`: roughly the success rate of
    a policy that picks its moves at random."""
    hits, total = _count(tuple(sorted(numbers)), target, {})
    return hits / total


def _true(a: int, op: str, b: int, c: int) -> bool:
    """Whether a op b = c holds in the integers (division exact, never by 0)."""
    if op == "+":
        return a + b == c
    if op == "-":
        return a - b == c
    if op == "*":
        return a * b == c
    return b != 0 and b * c == a                       # "/": b*c == a alone would pass 0/0=7


def _take(pool: list[int], a: int, b: int) -> bool:
    """Remove a and b from the multiset `pool`; False when either is not there (a number used
    twice, or one that was never given nor made)."""
    for x in (a, b):
        if x not in pool:
            return False
        pool.remove(x)
    return True


def check(response: str, gold_text: str) -> tuple[bool, bool]:
    """(correct, formatted): formatted means a complete closed \\boxed{...}; correct needs a valid
    derivation before the last box (only step lines and blank lines, each step true and made of
    available numbers, every given number used, one number left and it is the target) and exactly
    the target in the box. A malformed gold makes no answer correct."""
    box = last_box(response)
    if box is None:
        return False, False
    start, content = box
    parsed = parse_gold(gold_text)
    if parsed is None:
        return False, True
    numbers, target = parsed
    if content != str(target):
        return False, True
    pool = list(numbers)
    for line in response[:start].splitlines():
        line = line.strip()
        if not line:
            continue
        m = _STEP.fullmatch(line)
        if m is None:
            return False, True                          # prose, an expression, an earlier box
        a = int(m[1])
        op = m[2]
        b = int(m[3])
        c = int(m[4])
        if not _true(a, op, b, c):
            return False, True
        if not _take(pool, a, b):
            return False, True
        pool.append(c)
    return pool == [target], True


def _run_check(seed: int, count: int, max_number: int) -> int:
    """The checks of --check, printed as one JSON line; 0 when all pass, else 1."""
    train_rows = rows(20000, seed, "train", count, max_number)
    test_insts = instances(20000, 0, "test", count, max_number)     # the rows, with their steps
    # keys of sorted numbers, so that one order in train and another in test counts as overlap
    train = {(tuple(sorted(r["numbers"])), r["target"]) for r in train_rows}
    test = {(tuple(sorted(x["numbers"])), x["target"]) for x in test_insts}
    texts = [solution(x["steps"]) for x in test_insts]
    bad = [x for x, t in zip(test_insts, texts) if check(t, gold(x)) != (True, True)]
    # the 500 rows an evaluation uses (task_rows; the test rng is fixed, so they come first):
    # solve finds them solvable on its own, and how often a random policy would hit them
    evaluated = test_insts[:500]
    unsolvable = [x for x in evaluated if not solve(x["numbers"], x["target"])]
    hits = [hit_fraction(x["numbers"], x["target"]) for x in evaluated]
    # distinct instances: how much each side (and the evaluated rows) repeats itself
    distinct_evaluated = len({(tuple(sorted(x["numbers"])), x["target"]) for x in evaluated})
    print(json.dumps({"train": len(train), "test": len(test), "overlap": len(train & test),
                      "evaluated_distinct": distinct_evaluated,
                      "bad_solutions": len(bad), "unsolvable": len(unsolvable),
                      "mean_hit_fraction": round(sum(hits) / len(hits), 4),
                      "mean_solution_chars": round(sum(len(t) for t in texts) / len(texts), 1)}))
    return 0 if not (train & test) and not bad and not unsolvable else 1


def _show(limit: int, seed: int, split: str, count: int, max_number: int) -> None:
    rng = random.Random(seed)                          # picks which other derivations to show
    for inst in instances(limit, seed, split, count, max_number):
        numbers = inst["numbers"]
        target = inst["target"]
        print("-" * 60)
        print(f"{question(numbers, target)}   [gold: {gold(inst)}]")
        print(solution(inst["steps"]))
        found = solve(numbers, target)
        others = [s for s in found if s != inst["steps"]]
        print(f"[{len(found)} derivations hit {target}; hit fraction "
              f"{hit_fraction(numbers, target):.3f}]")
        for steps in rng.sample(others, min(2, len(others))):    # up to two of the others
            print(" | ".join(f"{a}{op}{b}={c}" for a, op, b, c in steps))


def main(argv=None):
    ap = argparse.ArgumentParser(description="Show the Countdown task's rows, worked solutions "
                                             "and other derivations, or check the task.")
    ap.add_argument("--count", type=int, default=DEFAULT_COUNT,
                    help="numbers an instance gives (difficulty; 3, 4 or 5 are the tasks)")
    ap.add_argument("--max-number", type=int, default=DEFAULT_MAX_NUMBER,
                    help=f"given numbers are drawn from 1..this (at most {MAX_VALUE})")
    ap.add_argument("--split", default="train", choices=("train", "test"),
                    help="which side of the hash split to show")
    ap.add_argument("--limit", type=int, default=3, help="rows to show")
    ap.add_argument("--seed", type=int, default=0, help="generator seed (train split only)")
    ap.add_argument("--check", action="store_true",
                    help="check the split on 20000 rows of each side, that every evaluated test "
                         "row is solvable and its solution checks; print hit fraction and sizes")
    args = ap.parse_args(argv)
    try:
        _check_knobs(args.count, args.max_number, args.split)
        if args.check:
            return _run_check(args.seed, args.count, args.max_number)
        _show(args.limit, args.seed, args.split, args.count, args.max_number)
    except ValueError as e:                            # a bad knob: one line, no traceback
        print(f"countdown.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
