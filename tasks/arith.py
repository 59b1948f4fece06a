"""arith.py: column addition with carries, a generated task with verifiable answers and worked
solutions.

    python arith.py --digits 4 --limit 3   # show rows, their worked solutions and a slipped one
    python arith.py --check                # the split is disjoint and every gold checks

The task: "What is 4738+2591?" -> a number (data.py scores it with the "gsm8k" number scorer; no
new kind). The worked solution adds the columns right to left, one line per column: the column sum
(with the carry of the column before as "+1"), then the answer so far; the last column writes its
whole sum:

    8+1=9 9
    3+9=12 29
    7+5+1=13 329
    4+2+1=7 7329
    \\boxed{7329}

Why this task (and not Countdown): a model small enough to ship (about a million parameters) and
to pretrain in minutes on two CPU cores learns column addition reliably, while Countdown needs it to
check products and search, which it cannot learn in that budget; and the answer is one number,
scored by the existing fail-closed number scorer. Headroom comes from the corpus (see
`solution(slip=...)`): at each column that owes a carry, a corpus solution forgets the "+1" with
probability `slip` (a plausible slip; the rest of that solution follows from what it wrote, so its
answer is wrong). With slip > 0.5 the pretrained model's most likely move is to forget: greedy
decoding is right only when no carry is owed (about 0.55^(digits-1) of the instances) while
sampling is right with about (1 - slip) at each carry. The rule RL has to find is local and
checkable ("a two-digit sum on the line before means +1 on this line"), so rewards for the right
answer sharpen it within minutes.

Difficulty knob: `digits` (digits of each operand; a carry is owed at about 45% of the columns).
Train / test split: by a hash of the unordered pair {a, b} (`split_of`), so a test instance (or its
swap b+a) never occurs in the train split, whatever the seed or the number of rows.
Leaves out: subtraction, more than two operands, numbers of different lengths.
"""
import argparse
import hashlib
import json
import random

from tasks.answer_box import BOXED, last_box

TEST_PERCENT = 10     # share of the instance space that is held out (by hash), in percent
TEST_SEED = 20261126  # the held-out rows come from this fixed seed: the same prompts every run
TASKS = {"arith": "train", "arith_test": "test"}  # task name -> split (registered in data.TASKS)
DEFAULT_DIGITS = 4


def split_of(a: int, b: int) -> str:
    """'test' or 'train', from a hash of the unordered pair (a + b and b + a are the same
    instance)."""
    lo, hi = sorted((a, b))
    digest = hashlib.sha256(f"{lo}+{hi}".encode()).digest()
    h = int.from_bytes(digest[:8], "big")              # sha256, not hash(): stable across processes
    return "test" if h % 100 < TEST_PERCENT else "train"


def question(a: int, b: int) -> str:
    return f"What is {a}+{b}?"


def sample_pair(rng: random.Random, digits: int, split: str) -> tuple[int, int]:
    """A pair of `digits`-digit numbers of the given split (rejection sampling on the hash)."""
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    lo = 0 if digits == 1 else 10 ** (digits - 1)      # no leading zero, but 0 is a 1-digit number
    hi = 10 ** digits - 1
    while True:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if split_of(a, b) == split:
            return a, b


def solution(a: int, b: int, rng: random.Random | None = None,
             slip: float = 0.0) -> tuple[str, int]:
    """The worked solution text and the answer it arrives at (a + b unless a carry was forgotten).

    At each column that owes a carry, the "+1" is left out with probability `slip` (drawn from
    `rng`); the rest of the solution is computed from what was written, so a slip makes a
    consistent but wrong answer."""
    xs = str(a)[::-1]                                           # digits, lowest column first
    ys = str(b)[::-1]
    n = max(len(xs), len(ys))
    lines = []
    so_far = ""                                                 # the answer's digits written so far
    carry = 0
    for i in range(n):
        x = int(xs[i]) if i < len(xs) else 0
        y = int(ys[i]) if i < len(ys) else 0
        if carry and rng is not None and rng.random() < slip:
            carry = 0                                           # the slip: the carry is forgotten
        s = x + y + carry
        digit = str(s) if i == n - 1 else str(s % 10)           # the last column: its whole sum
        so_far = digit + so_far
        lines.append(f"{x}+{y}{'+1' if carry else ''}={s} {so_far}")
        carry = s // 10
    return "\n".join(lines) + f"\n{BOXED}{so_far}}}", int(so_far)


def rows(n: int, seed: int = 0, split: str = "train", digits: int = DEFAULT_DIGITS) -> list[dict]:
    """n rows {"question", "answer", "a", "b", "digits", "split"}; the test split ignores `seed`
    (fixed prompts)."""
    rng = random.Random(TEST_SEED if split == "test" else seed)
    out = []
    for _ in range(n):
        a, b = sample_pair(rng, digits, split)
        out.append({"question": question(a, b), "answer": str(a + b),
                    "a": a, "b": b, "digits": digits, "split": split})
    return out


def task_rows(task: str, limit: int | None, seed: int | None) -> list[dict]:
    """Raw rows of a registered task for data.load_rows (2000 train / 500 test unless `limit`
    says)."""
    split = TASKS[task]
    if limit is not None:
        n = limit
    else:
        n = 2000 if split == "train" else 500
    return rows(n, seed or 0, split)


def corpus_example(rng: random.Random, split: str = "train", digits: int = DEFAULT_DIGITS,
                   slip: float = 0.0) -> tuple[str, str]:
    """One fresh pretraining example: (question, worked solution), the solution slipping each
    owed carry with probability `slip`."""
    a, b = sample_pair(rng, digits, split)
    return question(a, b), solution(a, b, rng, slip)[0]


def boxed_answer(response: str) -> str | None:
    """The content of the last complete, closed \\boxed{...} (answer_box.last_box), else None."""
    box = last_box(response)
    return None if box is None else box[1]


def check(response: str, gold: str) -> tuple[bool, bool]:
    """(correct, formatted): formatted means a complete closed \\boxed{...}; correct needs exactly
    the gold digits (pretrain.py's strict checker; train.py scores with rewards.py's number
    scorer, which also reads "7,329")."""
    got = boxed_answer(response)
    return got is not None and got == str(gold), got is not None


def main(argv=None):
    ap = argparse.ArgumentParser(description="Show the column-addition task's rows and worked "
                                             "solutions.")
    ap.add_argument("--digits", type=int, default=DEFAULT_DIGITS,
                    help="digits of each operand (difficulty)")
    ap.add_argument("--split", default="train", choices=("train", "test"),
                    help="which side of the hash split")
    ap.add_argument("--limit", type=int, default=3, help="rows to show")
    ap.add_argument("--seed", type=int, default=0, help="generator seed (train split only)")
    ap.add_argument("--slip", type=float, default=0.6,
                    help="carry-slip rate of the extra, slipped solution shown")
    ap.add_argument("--check", action="store_true",
                    help="check the split on 20000 rows of each side, and the golds")
    args = ap.parse_args(argv)
    if args.check:
        # unordered pairs, so that b+a in one split and a+b in the other counts as overlap
        train_rows = rows(20000, args.seed, "train", args.digits)
        test_rows = rows(20000, 0, "test", args.digits)
        train = {frozenset((r["a"], r["b"])) for r in train_rows}
        test = {frozenset((r["a"], r["b"])) for r in test_rows}
        # without slips, the worked solution must arrive at a + b
        gold_rows = rows(2000, args.seed, "train", args.digits)
        bad = [r for r in gold_rows if solution(r["a"], r["b"])[1] != r["a"] + r["b"]]
        print(json.dumps({"train": len(train), "test": len(test),
                          "overlap": len(train & test), "bad_golds": len(bad)}))
        return 0 if not (train & test) and not bad else 1
    rng = random.Random(args.seed)
    for r in rows(args.limit, args.seed, args.split, args.digits):
        print("-" * 60)
        print(r["question"])
        print(solution(r["a"], r["b"])[0])
        print(f"[with slip {args.slip}]\n{solution(r['a'], r['b'], rng, args.slip)[0]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
