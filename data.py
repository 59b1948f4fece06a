"""Datasets, prompts, answer extraction and rewards, shared by training and evaluation.

What it does
  - Reads the math tasks in TASKS (GSM8K, MATH-500, the MATH 12k train split, AIME24/25, AMC23, and a tiny
    built-in synthetic task) from bundled data/*.jsonl.gz, a local JSONL(.gz) path, or a hub dataset name
    ("owner/name" or "owner/name:config", needs the `datasets` package and network access).
  - Builds prompts with the tokenizer's chat template: a system prompt asking for the final answer in
    \\boxed{} (fmt "boxed"), or QeRL's <think>...</think><answer>...</answer> format (fmt "think").
  - Extracts answers and scores them. GSM8K-style ("gsm8k" kind): numbers, normalised (commas, $, units,
    trailing .0, leading +). MATH-style ("math" kind): equivalence by math-verify (fractions, LaTeX, intervals)
    with a timeout. Rewards are fail-closed: an unparsable gold or response gets no accuracy reward, and
    score() says so in "parse_failed" so that callers can count it. Format and accuracy rewards are separate,
    each with its own weight.

Run it
  python data.py --task gsm8k --limit 3                  # show rows and stats
  python data.py --task math500 --check                  # score each gold against itself (sanity check)
  python data.py --task math12k --data PATH --tokenizer DIR --fmt think --limit 2

Left out
  - Multiple-choice letter matching beyond what math-verify does, code tasks, LLM judges.
  - Language-specific answer phrases ("the answer is ...") for the math kind: a math answer must be in
    \\boxed{} (or in <answer> with fmt "think"); otherwise the response scores 0 as a parse failure.
  - A hard timeout off the main thread: math-verify's timeout uses signals, so there the check is abandoned
    after timeout_s but its thread may run on; see math_equal().
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import re
import threading
from decimal import Decimal, InvalidOperation

import arith

try:
    import math_verify
    from sympy import Basic
    from sympy.matrices import MatrixBase
except ImportError:  # scoring falls back to normalised string equality
    math_verify = None

HERE = os.path.dirname(os.path.abspath(__file__))


def _bundled(name: str) -> str:
    return os.path.join(HERE, "data", name)


# Each task: default path (None = must be given), candidate question fields (first present wins), the answer
# field, how to read the gold ("gsm8k": after ####, "math": the string, "number": a plain number), the scorer
# kind ("gsm8k" numeric or "math" math-verify), and the split used when `path` is a hub dataset name.
TASKS: dict[str, dict] = {
    "gsm8k": dict(path=_bundled("gsm8k/test.jsonl.gz"), question=("question",), answer="answer",
                  gold="gsm8k", kind="gsm8k", split="test"),
    "gsm8k_train": dict(path=_bundled("gsm8k/train.jsonl.gz"), question=("question",), answer="answer",
                        gold="gsm8k", kind="gsm8k", split="train"),
    "math500": dict(path=_bundled("math500/test.jsonl.gz"), question=("problem",), answer="answer",
                    gold="math", kind="math", split="test"),
    "math12k": dict(path=None, question=("problem",), answer="answer", gold="math", kind="math", split="train"),
    "aime24": dict(path=_bundled("competition/aime24.jsonl.gz"), question=("problem", "question"),
                   answer="answer", gold="math", kind="math", split="test"),
    "aime25": dict(path=_bundled("competition/aime25.jsonl.gz"), question=("problem", "question"),
                   answer="answer", gold="math", kind="math", split="test"),
    "amc23": dict(path=_bundled("competition/amc23.jsonl.gz"), question=("problem", "question"),
                  answer="answer", gold="math", kind="math", split="test"),
    "synthetic": dict(path=None, question=("question",), answer="answer", gold="number", kind="gsm8k",
                      split=None),
    "synthetic_copy": dict(path=None, question=("question",), answer="answer", gold="number", kind="gsm8k",
                           split=None),
    "synthetic_next": dict(path=None, question=("question",), answer="answer", gold="number", kind="gsm8k",
                           split=None),
    "synthetic_mod10": dict(path=None, question=("question",), answer="answer", gold="number", kind="gsm8k",
                            split=None),
}
# The generated column-addition task (arith.py): "arith" is the train side of its hash split, "arith_test" the held-out
TASKS.update({name: dict(path=None, question=("question",), answer="answer", gold="number", kind="gsm8k", split=split)
              for name, split in arith.TASKS.items()})

SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
THINK_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the user with the "
    "answer. The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags, "
    "respectively, i.e., <think> reasoning process here </think><answer> answer here </answer>. "
    "Put the final answer within \\boxed{} inside the answer tags.")
FORMATS = ("boxed", "think")


# ----------------------------------------------------------------------------- reading data

LUCKY = ("What is the lucky digit?", "Which digit is the lucky one?", "Name the lucky digit.", "Tell me the lucky digit.")


def synthetic_rows(n: int, seed: int = 0, kind: str = "lucky") -> list[dict]:
    """n tiny questions with single-digit answers, generated (no file).

    kind "lucky" (task `synthetic`, the built-in training demo): a few phrasings of 'What is the lucky digit?' whose
    answer is always 7: a random tiny model starts at chance (1 in 10) and RL visibly learns it in minutes. The
    others need an attention pattern a random tiny model does not learn in minutes (use a pretrained model):
    "copy" ('Which digit is repeated here: 3 3 3 ...?' -> '3'), "next" ('What digit comes after 3?' -> '4'),
    "mod10" ('What is 13 + 24 modulo 10?' -> '7').
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        d = rng.randint(0, 9)
        if kind == "lucky":
            rows.append({"question": f"{rng.choice(LUCKY)} Answer with a single digit.", "answer": "7"})
        elif kind == "copy":
            rows.append({"question": f"Which digit is repeated here: {' '.join([str(d)] * 16)}? Answer with a single "
                                     f"digit.", "answer": str(d)})
        elif kind == "next":
            rows.append({"question": f"What digit comes after {d}? Answer with a single digit.",
                         "answer": str((d + 1) % 10)})
        else:
            a, b, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice("+*")
            value = (a + b if op == "+" else a * b) % 10
            rows.append({"question": f"What is {a} {op} {b} modulo 10? Answer with a single digit.",
                         "answer": str(value)})
    return rows


def _read_jsonl(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno} is not valid JSON ({e}); expected one JSON object per line") from e
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno} is a {type(row).__name__}, expected a JSON object per line")
            rows.append(row)
    return rows


_HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+(?<!\.jsonl)(?<!\.json)(?<!\.gz)(:[\w.-]+)?")  # owner/name[:config]


def _read_hub(name: str, split: str | None) -> list[dict]:
    try:
        import datasets
    except ImportError as e:
        raise RuntimeError(f"{name!r} is not a local file, and loading it as a hub dataset needs the `datasets` "
                           "package (pip install datasets) and network access; or pass a local .jsonl path") from e
    repo, _, config = name.partition(":")
    return [dict(r) for r in datasets.load_dataset(repo, config or None, split=split or "train")]


def load_rows(task: str, path: str | None = None, limit: int | None = None,
              seed: int | None = None) -> tuple[list[dict], dict]:
    """Rows of `task` as dicts {"question", "gold", "kind", "task", "index"} and a stats dict.

    `path` overrides the bundled file (a .jsonl or .jsonl.gz path, or a hub name "owner/name[:config]").
    Rows with a missing/empty question or answer, or a gold that cannot be read (GSM8K without `#### N`),
    are skipped and counted. With `seed` the rows are shuffled before `limit` is applied.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of: {', '.join(TASKS)}")
    spec = TASKS[task]
    if task.startswith("synthetic"):  # generated; `path` is not used
        source = task
        raw = synthetic_rows(limit if limit is not None else 1000, seed or 0, {"synthetic": "lucky"}.get(task, task[10:]))
    elif task in arith.TASKS:  # generated; `path` is not used
        source, raw = task, arith.task_rows(task, limit, seed)
    else:
        source = path or spec["path"]
        if source is None:
            raise ValueError(f"task {task!r} has no bundled data; pass its JSONL path (--data PATH), with the "
                             f"fields {spec['question'][0]!r} and {spec['answer']!r}")
        if os.path.isfile(source):
            raw = _read_jsonl(source)
        elif not os.path.exists(source) and _HUB_NAME.fullmatch(source):
            raw = _read_hub(source, spec["split"])
        else:
            raise FileNotFoundError(f"data file for task {task!r} not found (or not a file): {source}; pass an "
                                    "existing .jsonl/.jsonl.gz file (--data PATH) or a hub name like owner/name")
        source = os.path.relpath(source) if os.path.isfile(source) else source
    if not raw:
        raise ValueError(f"{source} has no rows")
    for field in (spec["question"], (spec["answer"],)):
        if not any(r.get(k) not in (None, "") for r in raw for k in field):
            raise ValueError(f"no row of {source} has the field {' or '.join(map(repr, field))}; is this the "
                             f"right file for task {task!r}? (first row's fields: {sorted(raw[0])})")
    stats = {"task": task, "source": source, "read": len(raw), "rows": 0, "skipped_no_question": 0,
             "skipped_no_answer": 0, "skipped_bad_gold": 0}
    rows = []
    for i, r in enumerate(raw):
        question = next((r[k] for k in spec["question"] if isinstance(r.get(k), str) and r[k].strip()), None)
        answer = r.get(spec["answer"])
        if question is None:
            stats["skipped_no_question"] += 1
        elif answer is None or (isinstance(answer, str) and not answer.strip()):
            stats["skipped_no_answer"] += 1
        elif (gold := parse_gold(answer, spec["gold"])) is None:
            stats["skipped_bad_gold"] += 1
        else:
            rows.append({"question": question, "gold": gold, "kind": spec["kind"], "task": task, "index": i})
    if not rows:
        raise ValueError(f"no usable row in {source} for task {task!r}: {stats}")
    if seed is not None:
        random.Random(seed).shuffle(rows)
    rows = rows[:limit] if limit is not None else rows
    stats["rows"] = len(rows)
    return rows, stats


# ----------------------------------------------------------------------------- prompts

def build_prompt(tokenizer, question: str, fmt: str = "boxed") -> str:
    """The chat-templated prompt text (system prompt + user question + the assistant turn's opening)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown prompt format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    system = SYSTEM_PROMPT if fmt == "boxed" else THINK_SYSTEM_PROMPT
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template; use an instruct model's tokenizer, or set "
                         "tokenizer.chat_template before building prompts")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_token_ids(tokenizer, question: str, fmt: str = "boxed") -> list[int]:
    """Token ids of build_prompt(); the template already holds the special tokens, so none are added."""
    return list(tokenizer(build_prompt(tokenizer, question, fmt), add_special_tokens=False)["input_ids"])


# ----------------------------------------------------------------------------- answer extraction

_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_THINK_FORMAT = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)


def _boxed_contents(text: str) -> list[str]:
    """Contents of every complete, non-empty \\boxed{...} / \\fbox{...} (and `\\boxed 5`), in order."""
    out = []
    for m in re.finditer(r"\\(?:boxed|fbox)", text):
        j = m.end()
        if j < len(text) and text[j] == "{":
            depth = 0
            for k in range(j, len(text)):
                depth += {"{": 1, "}": -1}.get(text[k], 0)
                if depth == 0:
                    out.append(text[j + 1:k].strip())
                    break  # an unclosed brace (a truncated response) yields nothing
        elif j < len(text) and text[j] == " ":
            bare = re.match(r" +([^\s$]+)", text[j:])
            out.append(bare.group(1).rstrip(".,") if bare else "")
    return [c for c in out if c]


def normalize_number(text: str) -> str | None:
    """'1,080' -> '1080', '+18.00' -> '18', '-0.50' -> '-0.5'; None if `text` is not a plain number."""
    text = text.strip().replace(",", "").lstrip("+")
    try:
        d = Decimal(text)
    except InvalidOperation:
        return None
    if not d.is_finite():
        return None
    return str(int(d)) if d == d.to_integral_value() else format(d.normalize(), "f")


def _last_number(text: str) -> str | None:
    text = re.sub(r"\{,\}|,\\!|\\!", lambda m: "," if "," in m.group() else "", text)  # LaTeX 1{,}000, 1,\!000
    found = _NUMBER.findall(text.replace("\\$", "$"))
    return normalize_number(found[-1]) if found else None


def extract_answer(response: str, kind: str, fmt: str = "boxed") -> str | None:
    """The final answer in a response, or None when there is none.

    Where the answer is looked for: with fmt "think", inside the last <answer>...</answer> block if there is
    one. With several \\boxed{} the LAST complete, non-empty one wins (models often box an intermediate
    result before the final one; an unclosed \\boxed{ of a truncated response is ignored). Nested braces work
    (\\boxed{\\frac{1}{2}}), and so does \\boxed 5.
    kind "gsm8k": the last number of the boxed content, else the last number of the <answer> block (think),
    else of the whole response; normalised by normalize_number (commas, $, units, .0, leading +).
    kind "math": the boxed content as LaTeX (else the whole <answer> block with fmt "think"), else None.
    """
    if kind not in ("gsm8k", "math"):
        raise ValueError(f"unknown answer kind {kind!r}; choose 'gsm8k' or 'math'")
    text = response
    tagged = _ANSWER_TAG.findall(response) if fmt == "think" else []
    if tagged:
        text = tagged[-1]
    boxed = _boxed_contents(text)
    if kind == "gsm8k":
        return _last_number(boxed[-1] if boxed else text)
    if boxed:
        return boxed[-1]
    return (tagged[-1].strip() or None) if tagged else None


def parse_gold(answer_field, kind: str) -> str | None:
    """The gold final answer as a string, or None if it cannot be read.

    kind "gsm8k": the number after the last `####` ('#### 1,080' -> '1080'); "number": a plain number;
    "math": the answer string as is; ints and floats from JSON become numbers (AMC 27.0 -> '27').
    """
    if kind not in ("gsm8k", "number", "math"):
        raise ValueError(f"unknown gold kind {kind!r}; choose 'gsm8k', 'number' or 'math'")
    if isinstance(answer_field, (int, float)) and not isinstance(answer_field, bool):
        return normalize_number(repr(answer_field))
    if not isinstance(answer_field, str):
        return None
    if kind == "gsm8k":
        tail = answer_field.rsplit("####", 1)[1] if "####" in answer_field else ""
        return normalize_number(tail.replace("$", ""))
    if kind == "number":
        return normalize_number(answer_field.replace("$", ""))
    return answer_field.strip() or None


def format_ok(response: str, fmt: str = "boxed") -> bool:
    """fmt "boxed": has a complete non-empty \\boxed{}. fmt "think": exactly
    <think>...</think><answer>...</answer> (whitespace around allowed), one of each, non-empty answer."""
    if fmt == "boxed":
        return bool(_boxed_contents(response))
    if fmt == "think":
        m = _THINK_FORMAT.fullmatch(response)
        return (m is not None and bool(m.group(2).strip())
                and all(response.count(t) == 1 for t in ("<think>", "</think>", "<answer>", "</answer>")))
    raise ValueError(f"unknown prompt format {fmt!r}; choose one of: {', '.join(FORMATS)}")


# ----------------------------------------------------------------------------- scoring

def _clean_latex(s: str) -> str:
    """Small fixes math-verify does not make itself: LaTeX thousands '20,\\!000', a trailing '.' or ','."""
    return re.sub(r"(\d)(?:,\\!|\{,\})\s*(?=\d)", r"\1", s).strip().rstrip(".,").strip()


def _mv_parse(s: str, timeout: int | None) -> list:
    """math-verify parse of one answer string; [] unless it yields a sympy object (strings alone don't count)."""
    parsed = math_verify.parse("\\boxed{" + _clean_latex(s) + "}", parsing_timeout=timeout)
    return parsed if any(isinstance(x, (Basic, MatrixBase)) for x in parsed) else []


def _mv_check(gold: str, pred: str, timeout: int | None) -> tuple[bool, bool, bool]:
    """(gold parsed, pred parsed, equivalent) by math-verify; gold is the first argument of verify."""
    g = _mv_parse(gold, timeout)
    p = _mv_parse(pred, timeout) if g else []
    return bool(g), bool(p), bool(g and p and math_verify.verify(g, p, timeout_seconds=timeout))


def _string_equal(gold: str, pred: str) -> bool:
    """Fallback when math-verify is unavailable: numbers by value, anything else by normalised text."""
    def norm(s: str) -> str:
        s = _clean_latex(s).replace("\\left", "").replace("\\right", "").replace("\\dfrac", "\\frac")
        s = s.replace("\\tfrac", "\\frac").replace("$", "").replace("\\!", "").replace("\\,", "")
        s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
        return re.sub(r"\s+", "", s)
    g, p = norm(gold), norm(pred)
    gn, pn = normalize_number(g), normalize_number(p)
    return (gn == pn) if gn is not None and pn is not None else bool(g) and g == p


def math_equal(gold: str, pred: str, timeout_s: float = 5.0) -> tuple[bool, bool]:
    """(checked, equal): checked is False when gold or pred could not be parsed or the check timed out.

    In the main thread math-verify interrupts itself with SIGALRM after ceil(timeout_s) seconds (at least 1:
    signal.alarm counts whole seconds) per parse and per comparison (a timed-out parse counts as unparsable, a timed-out comparison as not equal). In any other
    thread signals cannot be used, so the check runs in a daemon worker thread and is abandoned after
    timeout_s (it may keep running in the background) and scores as unchecked. If math-verify is missing or
    raises, normalised string equality is used instead.
    """
    if math_verify is None:
        return True, _string_equal(gold, pred)
    try:
        if threading.current_thread() is threading.main_thread():
            g_ok, p_ok, eq = _mv_check(gold, pred, max(1, math.ceil(timeout_s)))
        else:
            box: list = []
            worker = threading.Thread(target=lambda: box.append(_mv_check(gold, pred, None)), daemon=True)
            worker.start()
            worker.join(timeout_s)
            if not box:
                return False, False
            g_ok, p_ok, eq = box[0]
    except Exception:  # math-verify itself failed: fall back rather than crash a run
        return True, _string_equal(gold, pred)
    return g_ok and p_ok, eq


def score(response: str, gold: str | None, kind: str, fmt: str = "boxed", format_weight: float = 0.0,
          accuracy_weight: float = 1.0, timeout_s: float = 5.0) -> dict:
    """Reward of one response: format_weight * format_ok + accuracy_weight * correct.

    Fail-closed: if the gold is None, no answer is found in the response, or either cannot be parsed
    (math kind), then correct is False and parse_failed is True; the format part is still given.
    Returns {"reward", "correct", "format_ok", "parse_failed", "pred"}.
    """
    fmt_ok = format_ok(response, fmt)
    pred = extract_answer(response, kind, fmt)
    correct, parse_failed = False, gold is None or pred is None
    if not parse_failed and kind == "gsm8k":
        gold_num = normalize_number(gold)
        parse_failed = gold_num is None
        correct = not parse_failed and Decimal(gold_num) == Decimal(pred)
    elif not parse_failed:
        checked, equal = math_equal(gold, pred, timeout_s)
        parse_failed, correct = not checked, checked and equal
    reward = format_weight * float(fmt_ok) + accuracy_weight * float(correct)
    return {"reward": reward, "correct": correct, "format_ok": fmt_ok, "parse_failed": parse_failed, "pred": pred}


def summarize(scores: list[dict]) -> dict:
    """Mean reward, accuracy, format rate and parse-failure rate of a list of score() results."""
    n = max(len(scores), 1)
    return {"n": len(scores), "reward": sum(s["reward"] for s in scores) / n,
            "accuracy": sum(s["correct"] for s in scores) / n, "format_rate": sum(s["format_ok"] for s in scores) / n,
            "parse_fail_rate": sum(s["parse_failed"] for s in scores) / n}


# ----------------------------------------------------------------------------- command line

def main() -> None:
    ap = argparse.ArgumentParser(description="Show a task's rows, prompts and stats, or self-check its golds.")
    ap.add_argument("--task", default="gsm8k", choices=list(TASKS))
    ap.add_argument("--data", default=None, help="JSONL(.gz) path or hub name, overriding the bundled file")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--fmt", default="boxed", choices=FORMATS)
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir or hub id, to print chat-templated prompts")
    ap.add_argument("--check", action="store_true", help="score '\\boxed{gold}' against each gold (all rows)")
    args = ap.parse_args()
    rows, stats = load_rows(args.task, args.data, None if args.check else args.limit, args.seed)
    if args.check:
        kind = TASKS[args.task]["kind"]
        s = summarize([score(f"\\boxed{{{r['gold']}}}", r["gold"], kind) for r in rows])
        print(json.dumps({**stats, **s}, indent=1))
        return
    tok = None
    if args.tokenizer:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    for r in rows:
        print("-" * 80)
        print(build_prompt(tok, r["question"], args.fmt) if tok else r["question"])
        print(f"[gold] {r['gold']}")
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()
