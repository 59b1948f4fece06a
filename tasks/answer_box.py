"""answer_box.py: where a generated task's answer is read: the last complete, closed
\\boxed{...} of a response (these tasks' answers hold no braces), shared by arith.py, countdown.py
and stargraph.py.

    python -m tasks.countdown --check       # every checker reads its answer through last_box

Leaves out: nested braces (rewards.py reads LaTeX answers for the math tasks).
"""
BOXED = "\\boxed{"


def last_box(response: str) -> tuple[int, str] | None:
    """(start, content) of the last complete, closed \\boxed{...}, else None. An unclosed last
    box (a cut-off response) does not hide an earlier closed one."""
    start = response.rfind(BOXED)
    while start >= 0:
        end = response.find("}", start + len(BOXED))
        if end >= 0:
            return start, response[start + len(BOXED):end].strip()
        start = response.rfind(BOXED, 0, start)
    return None
