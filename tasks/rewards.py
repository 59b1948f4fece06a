"""rewards.py: answer extraction and fail-closed scoring, shared by training (train.py) and
evaluation (eval.py).

    python -m tasks.data --task gsm8k --check   # score '\\boxed{gold}' against each gold

Fail-closed: only a closed answer in the asked-for form earns accuracy credit, and score() says
"parse_failed" when there is none, so callers can count it.
  - fmt "boxed": the LAST \\boxed{...}; none, or a cut-off last one ("\\boxed{7"), is no answer,
    whatever numbers the prose holds ("Janet's ducks lay 16 eggs per day." echoes the question).
    fmt "think": the last closed <answer>...</answer> block (its last box if it has one, else its
    whole text); nothing outside it counts.
  - GSM8K-style ("gsm8k" kind): the answer must BE a number: a plain one (commas, $, leading +,
    trailing .0, .5, 1e3), also followed by unit words ("18 dollars", "25%": common in GSM8K
    outputs, and unambiguous); else one real value by math-verify (\\frac{1}{2} = 0.5,
    2\\times10^3 = 2000). Words around or between numbers ("The answer is 18", "5 and 7"),
    variables, times ("10:30"), lists and irrationals are parse failures.
  - MATH-style ("math" kind): equivalence by math-verify (fractions, LaTeX, intervals) with a
    timeout.
  - The generated tasks whose answer is a piece of work, not a value ("countdown": a derivation,
    "stargraph": a path; fmt "boxed" only): their own checker (CHECKED) verifies the work, and the
    gold is the instance it is checked against.
  - Format and accuracy rewards are separate, each with its own weight.

Left out
  - Multiple-choice letter matching beyond what math-verify does, code tasks, LLM judges.
  - Language-specific answer phrases ("the answer is ..."): an answer must be in \\boxed{} (or in
    <answer> with fmt "think"); otherwise the response scores 0 as a parse failure, whatever its
    kind.
  - A hard timeout off the main thread: math-verify's timeout uses signals, so there the check is
    abandoned after timeout_s but its thread may run on; see math_equal().
"""
from __future__ import annotations

import math
import re
import threading
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from tasks import countdown, stargraph

try:
    import math_verify
    from sympy import Basic, Float, Rational
    from sympy.matrices import MatrixBase
except ImportError:  # scoring falls back to normalised string equality
    math_verify = None

FORMATS = ("boxed", "think")
# kind -> the module whose check(response, gold) -> (correct, formatted) judges the whole answer
CHECKED = {"countdown": countdown, "stargraph": stargraph}
KINDS = ("gsm8k", "math") + tuple(CHECKED)


# ----------------------------------------------------------------------------- answer extraction

_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_THINK_FORMAT = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_BOX = re.compile(r"\\(?:boxed|fbox)")
# A plain number: 1,080 / 18 / 18.50 / .5 / 1e3 (exponents of at most 2 digits: a huge 1e999999 is
# no GSM8K answer and would be expanded digit by digit), then optional unit words: "dollars",
# "eggs per day", "%", "cm/s", "°".
_NUM = r"[-+]?(?:\d{1,3}(?:,\d{3})+(?:\.\d*)?|\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,2})?"
_UNIT = r"[A-Za-z%°][A-Za-z%°'./\s]*"
_PLAIN = re.compile(rf"({_NUM})\s*(?:{_UNIT})?")
# LaTeX commands that only wrap text; their braced content is kept
_WRAPPER = re.compile(
    r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")


def _boxes(text: str) -> list[str | None]:
    """Every \\boxed{...} / \\fbox{...} (and `\\boxed 5`) in order: its stripped content, or None
    when the box is not closed (a response cut off inside it). Nested braces work
    (\\boxed{\\frac{1}{2}})."""
    out = []
    for m in _BOX.finditer(text):
        j = m.end()                                   # the character after \boxed
        if j == len(text):  # the response ends right after \boxed
            out.append(None)
        elif text[j] == "{":
            # scan to the brace that closes the box; content stays None when none does
            depth = 0
            content = None
            for k in range(j, len(text)):
                depth += {"{": 1, "}": -1}.get(text[k], 0)
                if depth == 0:
                    content = text[j + 1:k].strip()
                    break
            out.append(content)
        elif text[j] == " ":
            # `\boxed 5`: the next word up to a space or `$`, without a sentence's final . or ,
            bare = re.match(r" +([^\s$]+)", text[j:])
            out.append(bare.group(1).rstrip(".,") if bare else None)
        # any other character after \boxed (a newline, \boxedx): no box is read
    return out


def _final_box(text: str) -> str | None:
    """The content of the LAST box, or None when there is none or it is not closed. An earlier
    closed box does not stand in for a truncated last one: it was an intermediate result the
    response went on to revise. Empty boxes are skipped (a response that repeats 'put the answer in
    \\boxed{}' has answered nothing yet)."""
    boxes = [b for b in _boxes(text) if b != ""]      # None (unclosed) stays: it can be the last
    return boxes[-1] if boxes else None


def _answer_text(response: str, fmt: str) -> str | None:
    """The text holding the final answer, or None when the response gives none in the asked-for
    form.

    fmt "boxed": the content of the last closed \\boxed{}. fmt "think": the last <answer> block,
    which must be closed by </answer>; with a box inside, that box's content (as above), else the
    block's whole text (QeRL's plain '<answer> 18 </answer>'). Anything outside the answer block,
    boxes in <think> included, is never read."""
    if fmt == "boxed":
        return _final_box(response)
    if fmt != "think":
        raise ValueError(f"unknown prompt format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    if "<answer>" not in response:
        return None
    # match at the LAST <answer> only: an earlier closed block must not stand in for it
    m = _ANSWER_BLOCK.match(response, response.rfind("<answer>"))
    if m is None:  # the last <answer> is not closed (truncated)
        return None
    block = m.group(1)
    if _BOX.search(block):
        return _final_box(block)
    return block.strip() or None


def normalize_number(text: str) -> str | None:
    """'1,080' -> '1080', '+18.00' -> '18', '-0.50' -> '-0.5'; None if `text` is not a plain
    number."""
    text = text.strip().replace(",", "").lstrip("+")
    try:
        d = Decimal(text)                             # exact: no binary rounding of '0.1'
    except InvalidOperation:
        return None
    if not d.is_finite():                             # Decimal reads 'inf' and 'nan'
        return None
    if d == d.to_integral_value():
        return str(int(d))                            # '18.00' and '1e3' -> '18', '1000'
    return format(d.normalize(), "f")                 # 'f': never exponent notation


def _fraction_text(f: Fraction) -> str:
    """'0.5' for 1/2, '2000' for 2000/1: the exact decimal when there is one (the denominator
    divides 10^60; the Decimal constructor does not round), else the fraction: '1/3'."""
    if 10 ** 60 % f.denominator:
        return f"{f.numerator}/{f.denominator}"
    # f = numerator * (10^60 / denominator) * 10^-60, all integers: an exact decimal
    scaled = f.numerator * (10 ** 60 // f.denominator)
    return normalize_number(str(Decimal(f"{scaled}E-60")))


def _clean_box(s: str) -> str:
    """A box's content with the LaTeX that only dresses a number removed: \\text{} wrappers (their
    words kept), currency signs, \\% and ^\\circ, LaTeX thousands separators (1{,}080, 1,\\!080) and
    LaTeX spaces."""
    s = _WRAPPER.sub(r" \1 ", s)
    s = s.replace("\\%", "%")
    s = s.replace("\u2212", "-")  # U+2212 is a minus sign
    s = re.sub(r"\^\s*\{?\\circ\}?", "°", s)
    s = re.sub(r"\\\$|\$|\\(?:pounds|euro)(?![A-Za-z])|[£€¥]", "", s)
    s = re.sub(r"(?<=\d)(?:\{,\}|,\\!)(?=\d)", ",", s)          # 1{,}080 -> 1,080
    return re.sub(r"\\[,;:! ]|~", " ", s).strip()               # LaTeX spaces: \, \; \: \! ~


def _mv_number(s: str, timeout: int | None) -> str | None:
    """s parsed by math-verify, when it is ONE finite real number: its exact value as by
    _fraction_text. None for sets and lists ('5, 7'), equations, symbols, complex or infinite
    values, irrationals (2\\pi)."""
    expr = next((x for x in _mv_parse(s, timeout) if isinstance(x, Basic)), None)
    # is_number: no free symbols; False for sets
    if expr is None or not getattr(expr, "is_number", False):
        return None
    # cheap even for 10^{10^{10}}, which doit() would expand digit by digit
    approx = expr.evalf(20)
    if approx.is_real is not True or approx.is_finite is not True:
        return None
    if abs(approx) > 1e30:                            # no GSM8K answer; too costly to expand
        return None
    value = expr.doit()  # math-verify keeps 2\times10^3 unevaluated
    if isinstance(value, Float):
        return normalize_number(str(value))
    if isinstance(value, Rational):
        return _fraction_text(Fraction(int(value.p), int(value.q)))
    return None                                       # e.g. sqrt(2): real and finite, not rational


def _gsm8k_number(content: str, timeout_s: float = 5.0) -> str | None:
    """The number a GSM8K-kind answer states, normalised ('1080', '0.5', '-5', or '1/3'), or None.

    A plain number (commas, $, a leading +, trailing .0, .5, 1e3) optionally followed by unit words
    ('18 dollars', '16 eggs per day', '25%') is read directly. Anything else goes to math-verify
    (\\frac{1}{2}, 10^3, 2\\times10^3, 12-7) and counts only when it is one real number. Never a
    number: words before or between numbers ('The answer is 18', '5 and 7'), variables ('x = 18'),
    times or ratios with ':' (10:30), lists (5, 7)."""
    s = _clean_box(content)
    m = _PLAIN.fullmatch(s)
    if m:
        return normalize_number(m.group(1))

    # a unit after an expression: '\frac{1}{2} cup'
    expr = re.sub(rf"(?<=[\d}}])\s*{_UNIT}$", "", s)
    # words left once LaTeX commands are gone: not a number
    letters = re.sub(r"\\[A-Za-z]+", "", expr)
    if math_verify is None:
        return None
    if ":" in expr:                                   # a time or a ratio (10:30)
        return None
    if re.search(r"[A-Za-z]", letters):               # words or variables
        return None
    if not re.search(r"\d", expr):
        return None
    try:
        return _limited(lambda t: _mv_number(expr, t), timeout_s)
    except Exception:  # math-verify itself failed: not a number we can trust
        return None


def extract_answer(response: str, kind: str, fmt: str = "boxed",
                   timeout_s: float = 5.0) -> str | None:
    """The final answer of a response, or None when there is none (fail-closed: None scores 0 as a
    parse failure).

    Where: see _answer_text (the last closed \\boxed{}; with fmt "think" the last closed <answer>
    block, or the last box in it). Text outside that is never searched for an answer: a number in
    the prose, an unclosed box of a truncated response, a box in <think>, earn nothing.
    kind "gsm8k": the number in it by _gsm8k_number, else None. kind "math": the text as LaTeX.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown answer kind {kind!r}; choose one of: {', '.join(KINDS)}")
    text = _answer_text(response, fmt)
    if text is None or kind != "gsm8k":
        return text
    return _gsm8k_number(text, timeout_s)


def parse_gold(answer_field, kind: str) -> str | None:
    """The gold final answer as a string, or None if it cannot be read.

    kind "gsm8k": the number after the last `####` ('#### 1,080' -> '1080'); "number": a plain
    number; "math": the answer string as is; ints and floats from JSON become numbers
    (AMC 27.0 -> '27').
    """
    golds = ("gsm8k", "number", "math") + tuple(CHECKED)
    if kind not in golds:
        raise ValueError(f"unknown gold kind {kind!r}; choose one of: {', '.join(golds)}")
    if kind in CHECKED:   # the instance the answer is checked against, as its module writes it
        ok = isinstance(answer_field, str) and CHECKED[kind].parse_gold(answer_field) is not None
        return answer_field if ok else None
    # bool is an int subclass; a JSON true is no number
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
    """fmt "boxed": the last \\boxed is closed and non-empty (the answer _answer_text reads). fmt
    "think": exactly <think>...</think><answer>...</answer> (whitespace around allowed), one of
    each, non-empty answer."""
    if fmt == "boxed":
        return _final_box(response) is not None
    if fmt == "think":
        m = _THINK_FORMAT.fullmatch(response)
        if m is None:
            return False
        answered = bool(m.group(2).strip())
        # the regex alone would accept a tag repeated inside the (.*?) groups
        tags = ("<think>", "</think>", "<answer>", "</answer>")
        one_each = all(response.count(t) == 1 for t in tags)
        return answered and one_each
    raise ValueError(f"unknown prompt format {fmt!r}; choose one of: {', '.join(FORMATS)}")


# ----------------------------------------------------------------------------- scoring

def _clean_latex(s: str) -> str:
    """Small fixes math-verify does not make itself: LaTeX thousands '20,\\!000', a trailing '.' or
    ','."""
    s = re.sub(r"(\d)(?:,\\!|\{,\})\s*(?=\d)", r"\1", s)       # 20,\!000 and 20{,}000 -> 20000
    return s.strip().rstrip(".,").strip()


def _mv_parse(s: str, timeout: int | None) -> list:
    """math-verify parse of one answer string; [] unless it yields a sympy object (strings alone
    don't count)."""
    # wrapped in \boxed{} so math-verify reads the whole string as the answer
    parsed = math_verify.parse("\\boxed{" + _clean_latex(s) + "}", parsing_timeout=timeout)
    return parsed if any(isinstance(x, (Basic, MatrixBase)) for x in parsed) else []


def _mv_check(gold: str, pred: str, timeout: int | None) -> tuple[bool, bool, bool]:
    """(gold parsed, pred parsed, equivalent) by math-verify; gold is the first argument of
    verify."""
    g = _mv_parse(gold, timeout)
    p = _mv_parse(pred, timeout) if g else []         # an unreadable gold decides: skip the pred
    equal = bool(g and p and math_verify.verify(g, p, timeout_seconds=timeout))
    return bool(g), bool(p), equal


def _string_equal(gold: str, pred: str) -> bool:
    """Fallback when math-verify is unavailable: numbers by value, anything else by normalised
    text."""
    def norm(s: str) -> str:
        s = _clean_latex(s)
        s = s.replace("\\left", "").replace("\\right", "")
        s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
        s = s.replace("$", "").replace("\\!", "").replace("\\,", "")
        s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
        return re.sub(r"\s+", "", s)

    g = norm(gold)
    p = norm(pred)
    gn = normalize_number(g)
    pn = normalize_number(p)
    if gn is not None and pn is not None:
        return gn == pn
    return bool(g) and g == p                         # an empty gold matches nothing


def math_equal(gold: str, pred: str, timeout_s: float = 5.0) -> tuple[bool, bool]:
    """(checked, equal): checked is False when gold or pred could not be parsed or the check timed
    out.

    In the main thread math-verify interrupts itself with SIGALRM after ceil(timeout_s) seconds (at
    least 1: signal.alarm counts whole seconds) per parse and per comparison (a timed-out parse
    counts as unparsable, a timed-out comparison as not equal). In any other thread signals cannot
    be used, so the check runs in a daemon worker thread and is abandoned after timeout_s (it may
    keep running in the background) and scores as unchecked. If math-verify is missing or raises,
    normalised string equality is used instead.
    """
    if math_verify is None:
        return True, _string_equal(gold, pred)
    try:
        checked = _limited(lambda t: _mv_check(gold, pred, t), timeout_s)
    except Exception:  # math-verify itself failed: fall back rather than crash a run
        return True, _string_equal(gold, pred)
    if checked is None:  # abandoned after timeout_s
        return False, False
    g_ok, p_ok, eq = checked
    return g_ok and p_ok, eq


def _limited(fn, timeout_s: float):
    """fn(seconds) with math_equal's time limit; None when it was abandoned. In the main thread fn
    gets ceil(timeout_s) to pass to math-verify, which interrupts itself with SIGALRM; in any other
    thread fn(None) runs in a daemon worker that is abandoned after timeout_s (its exceptions are
    lost: None as well)."""
    if threading.current_thread() is threading.main_thread():
        return fn(max(1, math.ceil(timeout_s)))
    box: list = []                                    # the worker's result, if it finishes in time
    # daemon: an abandoned worker never keeps the process alive at exit
    worker = threading.Thread(target=lambda: box.append(fn(None)), daemon=True)
    worker.start()
    worker.join(timeout_s)
    return box[0] if box else None


def score(response: str, gold: str | None, kind: str, fmt: str = "boxed",
          format_weight: float = 0.0, accuracy_weight: float = 1.0,
          timeout_s: float = 5.0) -> dict:
    """Reward of one response: format_weight * format_ok + accuracy_weight * correct.

    Fail-closed: if the gold is None, the response has no final answer in the asked-for form
    (extract_answer), or either cannot be parsed, then correct is False and parse_failed is True;
    the format part is still given.
    gsm8k kind: equal values, exactly (Fractions: '0.5' == '1/2', '0.33' != '1/3').
    Returns {"reward", "correct", "format_ok", "parse_failed", "pred"}.
    """
    fmt_ok = format_ok(response, fmt)
    pred = extract_answer(response, kind, fmt, timeout_s)
    correct = False
    parse_failed = gold is None or pred is None

    if kind in CHECKED:
        if fmt != "boxed":
            raise ValueError(f"answers of kind {kind!r} are read from \\boxed{{}} only (fmt boxed)")
        correct, _ = CHECKED[kind].check(response, gold) if gold is not None else (False, False)
    elif not parse_failed and kind == "gsm8k":
        gold_num = normalize_number(gold)
        parse_failed = gold_num is None
        # Fraction compares exactly: pred may be '1/3', '0.33' is not equal to it
        correct = not parse_failed and Fraction(gold_num) == Fraction(pred)
    elif not parse_failed:
        checked, equal = math_equal(gold, pred, timeout_s)
        parse_failed = not checked
        correct = checked and equal

    reward = format_weight * float(fmt_ok) + accuracy_weight * float(correct)
    return {"reward": reward, "correct": correct, "format_ok": fmt_ok,
            "parse_failed": parse_failed, "pred": pred}


def summarize(scores: list[dict]) -> dict:
    """Mean reward, accuracy, format rate and parse-failure rate of a list of score() results."""
    n = max(len(scores), 1)                           # an empty list gives rates of 0, not a crash
    return {
        "n": len(scores),
        "reward": sum(s["reward"] for s in scores) / n,
        "accuracy": sum(s["correct"] for s in scores) / n,
        "format_rate": sum(s["format_ok"] for s in scores) / n,
        "parse_fail_rate": sum(s["parse_failed"] for s in scores) / n,
    }
