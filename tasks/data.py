"""data.py: datasets, prompts and stop tokens, shared by training and evaluation (answers and
rewards: rewards.py).

What it does
  - Reads the math tasks in TASKS (GSM8K, MATH-500, the MATH 12k train split, AIME24/25, AMC23,
    and a tiny built-in synthetic task) from bundled data/*.jsonl.gz, a local JSONL(.gz) path, or
    a hub dataset name ("owner/name" or "owner/name:config", needs the `datasets` package and
    network access). Rows whose question or gold answer cannot be read are skipped and counted in
    the stats; a file that cannot be read as JSONL (missing, empty, binary, a malformed line) is a
    ValueError or FileNotFoundError naming it, and one "error: ..." line from the command line.
  - Builds prompts with the tokenizer's chat template: a system prompt asking for the final answer
    in \\boxed{} (fmt "boxed"), or QeRL's <think>...</think><answer>...</answer> format
    (fmt "think").
  - stop_token_ids(): the token ids that end a reply, from the model folder's
    generation_config.json and the tokenizer (eos and the chat template's end-of-turn token), so
    that generation stops on any chat model.
  - Answers and rewards are rewards.py's (callers use rewards.score).

Run it
  python -m tasks.data --task gsm8k --limit 3        # show rows and stats (rows read, usable
                                                     # and shown, skipped by reason)
  python -m tasks.data --task math500 --check        # score each gold against itself (sanity)
  python -m tasks.data --task math12k --data PATH --tokenizer DIR --fmt think --limit 2

Left out: streaming datasets too large for memory, and dataset mixtures (pass one task at a time).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import sys

from tasks import arith, countdown, stargraph
from tasks.rewards import FORMATS, parse_gold, score, summarize

# the repository root, whose data/ folder holds the bundled datasets
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bundled(name: str) -> str:
    return os.path.join(HERE, "data", name)


# Each task: default path (None = must be given), candidate question fields (first present wins),
# the answer field, how to read the gold ("gsm8k": after ####, "math": the string, "number": a
# plain number), the scorer kind ("gsm8k" numeric or "math" math-verify), and the split used when
# `path` is a hub dataset name.
TASKS: dict[str, dict] = {
    "gsm8k": dict(path=_bundled("gsm8k/test.jsonl.gz"), question=("question",),
                  answer="answer", gold="gsm8k", kind="gsm8k", split="test"),
    "gsm8k_train": dict(path=_bundled("gsm8k/train.jsonl.gz"), question=("question",),
                        answer="answer", gold="gsm8k", kind="gsm8k", split="train"),
    "math500": dict(path=_bundled("math500/test.jsonl.gz"), question=("problem",),
                    answer="answer", gold="math", kind="math", split="test"),
    "math12k": dict(path=None, question=("problem",),
                    answer="answer", gold="math", kind="math", split="train"),
    "aime24": dict(path=_bundled("competition/aime24.jsonl.gz"), question=("problem", "question"),
                   answer="answer", gold="math", kind="math", split="test"),
    "aime25": dict(path=_bundled("competition/aime25.jsonl.gz"), question=("problem", "question"),
                   answer="answer", gold="math", kind="math", split="test"),
    "amc23": dict(path=_bundled("competition/amc23.jsonl.gz"), question=("problem", "question"),
                  answer="answer", gold="math", kind="math", split="test"),
    # generated in code (synthetic_rows): no path, and a single-digit gold scored as a number
    "synthetic": dict(path=None, question=("question",),
                      answer="answer", gold="number", kind="gsm8k", split=None),
    "synthetic_copy": dict(path=None, question=("question",),
                           answer="answer", gold="number", kind="gsm8k", split=None),
    "synthetic_next": dict(path=None, question=("question",),
                           answer="answer", gold="number", kind="gsm8k", split=None),
    "synthetic_mod10": dict(path=None, question=("question",),
                            answer="answer", gold="number", kind="gsm8k", split=None),
}
# The generated column-addition task (arith.py): "arith" is the train side of its hash split,
# "arith_test" the held-out
TASKS.update({
    name: dict(path=None, question=("question",),
               answer="answer", gold="number", kind="gsm8k", split=split)
    for name, split in arith.TASKS.items()
})
# Countdown and star-graph paths (countdown.py, stargraph.py): the gold is the instance, and the
# task's own checker verifies the derivation or the path (rewards.CHECKED)
GENERATED = {"countdown": countdown, "stargraph": stargraph}
for kind, module in GENERATED.items():
    TASKS.update({name: dict(path=None, question=("question",), answer="answer", gold=kind,
                             kind=kind, split=spec[0])
                  for name, spec in module.TASKS.items()})

SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
THINK_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The Assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer. The reasoning process and answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process "
    "here </think><answer> answer here </answer>. "
    "Put the final answer within \\boxed{} inside the answer tags.")


# ----------------------------------------------------------------------------- reading data

LUCKY = (
    "What is the lucky digit?",
    "Which digit is the lucky one?",
    "Name the lucky digit.",
    "Tell me the lucky digit.",
)


def synthetic_rows(n: int, seed: int = 0, kind: str = "lucky") -> list[dict]:
    """n tiny questions with single-digit answers, generated (no file).

    kind "lucky" (task `synthetic`, the built-in training demo): a few phrasings of 'What is the
    lucky digit?' whose answer is always 7: a random tiny model starts at chance (1 in 10) and RL
    visibly learns it in minutes. The others need an attention pattern a random tiny model does not
    learn in minutes (use a pretrained model): "copy" ('Which digit is repeated here: 3 3 3 ...?'
    -> '3'), "next" ('What digit comes after 3?' -> '4'), "mod10" ('What is 13 + 24 modulo 10?'
    -> '7').
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        d = rng.randint(0, 9)        # drawn for every kind, used or not: a seed gives the same rows
        if kind == "lucky":
            question = f"{rng.choice(LUCKY)} Answer with a single digit."
            rows.append({"question": question, "answer": "7"})
        elif kind == "copy":
            digits = " ".join([str(d)] * 16)
            question = f"Which digit is repeated here: {digits}? Answer with a single digit."
            rows.append({"question": question, "answer": str(d)})
        elif kind == "next":
            rows.append({"question": f"What digit comes after {d}? Answer with a single digit.",
                         "answer": str((d + 1) % 10)})
        else:
            # drawn in this order (a, b, op): the rows of a seed stay the same
            a = rng.randint(0, 99)
            b = rng.randint(0, 99)
            op = rng.choice("+*")
            value = (a + b if op == "+" else a * b) % 10
            rows.append({"question": f"What is {a} {op} {b} modulo 10? Answer with a single digit.",
                         "answer": str(value)})
    return rows


def _read_jsonl(path: str) -> list[dict]:
    """The rows of a JSONL(.gz) file; ValueError naming the file (and line) for a file that is not
    UTF-8 JSONL: a binary file, a .gz that is not gzip, a malformed line."""
    opener = gzip.open if path.endswith(".gz") else open
    rows = []
    lineno = 0                                # the line being read, for the errors below
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue                  # blank lines (a trailing newline) are no rows
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno} is not valid JSON ({e}); "
                                     f"expected one JSON object per line") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{lineno} is a {type(row).__name__}, "
                                     f"expected a JSON object per line")
                rows.append(row)
    except UnicodeDecodeError as e:           # the line that failed is the one after the last read
        raise ValueError(f"{path}:{lineno + 1} is not UTF-8 text (byte {e.object[e.start]:#04x}): "
                         "expected a JSONL file, one JSON object a line (gzipped as .jsonl.gz)"
                         ) from None
    except gzip.BadGzipFile:
        raise ValueError(f"{path} is not a gzip file: rename it without .gz if it is plain "
                         "JSONL") from None
    return rows


# owner/name[:config]; a name ending in .jsonl, .json or .gz is a missing file, not a hub dataset
_HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+(?<!\.jsonl)(?<!\.json)(?<!\.gz)(:[\w.-]+)?")
# a hub model id: name or owner/name, each starting with a letter or digit (so "./x", "../x",
# "/x" and "~/x" are paths)
_HUB_ID = re.compile(r"\w[\w.-]*(/\w[\w.-]*)?")


def _read_hub(name: str, split: str | None) -> list[dict]:
    try:
        import datasets                       # optional: only hub names need it
    except ImportError as e:
        raise RuntimeError(f"{name!r} is not a local file, and loading it as a hub dataset needs "
                           "the `datasets` package (pip install datasets) and network access; "
                           "or pass a local .jsonl path") from e
    repo, _, config = name.partition(":")
    rows = datasets.load_dataset(repo, config or None, split=split or "train")
    return [dict(r) for r in rows]


def is_generated(task: str) -> bool:
    """True for a task whose rows are generated in code (it reads no file, so --data means nothing
    to it)."""
    generated = [arith.TASKS] + [module.TASKS for module in GENERATED.values()]
    return task.startswith("synthetic") or any(task in names for names in generated)


def load_rows(task: str, path: str | None = None, limit: int | None = None,
              seed: int | None = None) -> tuple[list[dict], dict]:
    """Rows of `task` as dicts {"question", "gold", "kind", "task", "index"} and a stats dict.

    `path` overrides the bundled file (a .jsonl or .jsonl.gz path, or a hub name
    "owner/name[:config]"). Rows with a missing/empty question or answer, or a gold that cannot be
    read (GSM8K without `#### N`), are skipped and counted. With `seed` the rows are shuffled before
    `limit` is applied.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of: {', '.join(TASKS)}")
    spec = TASKS[task]

    # the raw rows: generated, read from a file, or loaded from the hub
    if task.startswith("synthetic"):  # generated; `path` is not used
        source = task
        n = limit if limit is not None else 1000
        kind = {"synthetic": "lucky"}.get(task, task[10:])   # "synthetic_copy" -> "copy"
        raw = synthetic_rows(n, seed or 0, kind)
    elif is_generated(task):  # generated; `path` is not used
        source = task
        module = next((m for m in GENERATED.values() if task in m.TASKS), arith)
        raw = module.task_rows(task, limit, seed)
    else:
        source = path or spec["path"]
        if source is None:
            raise ValueError(f"task {task!r} has no bundled data; pass its JSONL path "
                             f"(--data PATH), with the fields {spec['question'][0]!r} and "
                             f"{spec['answer']!r}")
        if os.path.isfile(source):
            raw = _read_jsonl(source)
        elif not os.path.exists(source) and _HUB_NAME.fullmatch(source):
            raw = _read_hub(source, spec["split"])
        else:
            raise FileNotFoundError(f"data file for task {task!r} not found (or not a file): "
                                    f"{source}; pass an existing .jsonl/.jsonl.gz file "
                                    "(--data PATH) or a hub name like owner/name")

    # a file without the task's fields is the wrong file: say so rather than skip every row
    if not raw:
        raise ValueError(f"{source} has no rows: expected one JSON object a line")
    for field in (spec["question"], (spec["answer"],)):
        has_field = any(r.get(k) not in (None, "") for r in raw for k in field)
        if not has_field:
            raise ValueError(f"no row of {source} has the field {' or '.join(map(repr, field))}; "
                             f"is this the right file for task {task!r}? "
                             f"(first row's fields: {sorted(raw[0])})")

    # keep the rows with a question and a readable gold; count the others by reason. "read": the
    # rows of the source, "usable": those kept, "rows": those returned (after `limit`)
    shown = os.path.relpath(source) if os.path.isfile(source) else source
    stats = {"task": task, "source": shown, "read": len(raw), "usable": 0, "rows": 0,
             "skipped_no_question": 0, "skipped_no_answer": 0, "skipped_bad_gold": 0}
    rows = []
    for i, r in enumerate(raw):
        question = None
        for k in spec["question"]:            # the first field holding a non-blank string
            if isinstance(r.get(k), str) and r[k].strip():
                question = r[k]
                break
        answer = r.get(spec["answer"])
        if question is None:
            stats["skipped_no_question"] += 1
        elif answer is None or (isinstance(answer, str) and not answer.strip()):
            stats["skipped_no_answer"] += 1
        elif (gold := parse_gold(answer, spec["gold"])) is None:
            stats["skipped_bad_gold"] += 1
        else:
            # index: the row's place in the source, kept through the shuffle
            rows.append({"question": question, "gold": gold, "kind": spec["kind"], "task": task,
                         "index": i})
    if not rows:
        raise ValueError(f"no usable row in {source} for task {task!r}: {stats}")

    if seed is not None:
        random.Random(seed).shuffle(rows)     # its own generator: the global one is left alone
    stats["usable"] = len(rows)
    rows = rows[:limit] if limit is not None else rows
    stats["rows"] = len(rows)
    return rows, stats


# ----------------------------------------------------------------------------- prompts

def build_prompt(tokenizer, question: str, fmt: str = "boxed") -> str:
    """The chat-templated prompt text (system prompt + user question + the assistant turn's
    opening)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown prompt format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    system = SYSTEM_PROMPT if fmt == "boxed" else THINK_SYSTEM_PROMPT
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template; use an instruct model's tokenizer, "
                         "or set tokenizer.chat_template before building prompts")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    # add_generation_prompt: end with the assistant turn's header, so the model writes the reply
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_token_ids(tokenizer, question: str, fmt: str = "boxed") -> list[int]:
    """Token ids of build_prompt(); the template already holds the special tokens, so none are
    added."""
    text = build_prompt(tokenizer, question, fmt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# End-of-turn tokens of known chat templates (ChatML/Qwen, Llama 3, Gemma, Phi-3, Command R). A
# tokenizer's eos is often the end of a whole document instead (Llama 3's <|end_of_text|>), which a
# chat model never emits mid-chat.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|END_OF_TURN_TOKEN|>")


def _generation_eos(model_dir) -> list[int]:
    """eos_token_id of the model's generation config (an int or a list), [] when there is none.

    A local folder: its generation_config.json, read as is. Anything else (a hub id): transformers'
    GenerationConfig.from_pretrained, and [] when that fails (offline, or no such file in the
    repo)."""
    if os.path.isdir(model_dir):
        path = os.path.join(model_dir, "generation_config.json")
        if not os.path.isfile(path):
            return []
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
    else:
        from transformers import GenerationConfig
        try:
            eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
        except OSError:
            # what from_pretrained raises offline and for a missing file: the tokenizer decides
            # alone
            return []

    if eos is None:
        eos = []
    elif isinstance(eos, int):
        eos = [eos]
    else:
        eos = list(eos)
    # bool is an int subclass: `true` in the JSON is no token id
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos):
        raise ValueError(f"{model_dir}: generation config eos_token_id must be a token id or a "
                         f"list of them, got {eos!r}; fix generation_config.json")
    return eos


def stop_token_ids(tokenizer, model_dir=None) -> list[int]:
    """Token ids that end a reply: the generation config's eos_token_id (model_dir: a folder or a
    hub id; None: not read), then tokenizer.eos_token_id, then the chat template's end-of-turn token
    when it is one of END_OF_TURN and a token of this vocabulary. Deduplicated, in that order.
    Raises ValueError when empty: sampling would then run every response to the length limit."""
    ids = _generation_eos(str(model_dir)) if model_dir else []
    if isinstance(getattr(tokenizer, "eos_token_id", None), int):
        ids.append(tokenizer.eos_token_id)

    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = "\n".join(template.values())   # named templates: search them all
    else:
        template = template or ""
    for tok in END_OF_TURN:
        tid = tokenizer.convert_tokens_to_ids(tok) if tok in template else None
        # round trip: an unknown token maps to the unk id (or None), which does not map back to
        # `tok`
        if isinstance(tid, int) and tokenizer.convert_ids_to_tokens(tid) == tok:
            ids.append(tid)

    ids = list(dict.fromkeys(ids))            # deduplicated, first occurrence first
    if not ids:
        where = f"{model_dir} has no generation_config.json eos_token_id, " if model_dir else ""
        raise ValueError(f"no stop token: {where}the tokenizer has no eos_token, and its chat "
                         f"template ends turns with none of {', '.join(END_OF_TURN)}; set the "
                         "tokenizer's eos_token (tokenizer_config.json) or eos_token_id in the "
                         "model's generation_config.json to the token that ends a reply")
    return ids


# ----------------------------------------------------------------------------- command line

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tasks.data",
        description="Show a task's rows, prompts and stats, or self-check its golds.")
    ap.add_argument("--task", default="gsm8k", choices=list(TASKS))
    ap.add_argument("--data", default=None,
                    help="JSONL(.gz) path or hub name, overriding the bundled file")
    ap.add_argument("--limit", type=int, default=3,
                    help="show at most this many rows (a file is read and counted whole)")
    ap.add_argument("--seed", type=int, default=None,
                    help="shuffle the rows with this seed first (as train.py does); "
                         "none: file order")
    ap.add_argument("--fmt", default="boxed", choices=FORMATS,
                    help="prompt / answer format: boxed (the answer in \\boxed{}) or think "
                         "(<think> reasoning, then <answer>)")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer dir or hub id, to print chat-templated prompts")
    ap.add_argument("--check", action="store_true",
                    help="score '\\boxed{gold}' against each gold (all rows)")
    args = ap.parse_args(argv)
    limit = None if args.check else args.limit            # --check reads every row
    try:
        rows, stats = load_rows(args.task, args.data, limit, args.seed)
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)             # bad input: one line, no traceback
        return 2
    # "rows" (what load_rows returned) is what this command shows or checks: say so
    done = stats.pop("rows")

    # --check: each gold, boxed, must score as correct against itself (1.0 when all parse)
    if args.check:
        kind = TASKS[args.task]["kind"]
        s = summarize([score(f"\\boxed{{{r['gold']}}}", r["gold"], kind) for r in rows])
        print(json.dumps({**stats, "checked": done, **s}, indent=1))
        return 0

    prompts = [r["question"] for r in rows]
    if args.tokenizer:
        from transformers import AutoTokenizer
        fix = ("pass a model folder holding tokenizer files (tokenizer.json, "
               "tokenizer_config.json) or a hub id (owner/name)")
        # a path that is no folder would reach the hub as a malformed repo id: say what it is
        if not os.path.isdir(args.tokenizer) and not _HUB_ID.fullmatch(args.tokenizer):
            print(f"error: --tokenizer {args.tokenizer}: no such folder, and not a hub id; {fix}",
                  file=sys.stderr)
            return 2
        try:
            tok = AutoTokenizer.from_pretrained(args.tokenizer)
        except (OSError, ValueError) as e:    # no tokenizer files there, offline, ...
            first = (str(e).strip() or type(e).__name__).splitlines()[0].rstrip(".:; ")
            print(f"error: --tokenizer {args.tokenizer}: {first}; {fix}", file=sys.stderr)
            return 2
        try:
            prompts = [build_prompt(tok, q, args.fmt) for q in prompts]
        except ValueError as e:                # a tokenizer without a chat template
            print(f"error: --tokenizer {args.tokenizer}: {e}", file=sys.stderr)
            return 2
    for r, prompt in zip(rows, prompts):
        print("-" * 80)
        print(prompt)
        print(f"[gold] {r['gold']}")
    print(json.dumps({**stats, "shown": done}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
