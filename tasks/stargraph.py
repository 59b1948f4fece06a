"""stargraph.py: path finding on a star graph, a generated task with verifiable answers whose first
move is a real fork.

    python -m tasks.stargraph --limit 3   # show rows, their worked solutions and their golds
    python -m tasks.stargraph --check     # the split is disjoint, golds check, wrong arms fail

The task (after "The pitfalls of next-token prediction", Bachmann & Nagarajan 2024): a star graph
has a center node and `degree` arms, each a chain of `length` further nodes. The question lists its
directed edges (pointing away from the center) in a shuffled order and asks for the path from the
center to the last node of one arm; the worked solution writes the path one hop a line, then boxed:

    Edges: 12>7 40>3 7>33 ... Path from 12 to 40?

    12>5
    5>19
    19>40
    \\boxed{12>5>19>40}

Why this task: the first hop is a real fork (`degree` choices, worth up to ln(degree) nats) and only
one arm leads to the goal, while every later hop is forced (each node has one outgoing edge). A
model trained by teacher forcing on correct paths tends to learn the easy part, "copy the edge that
starts at the node just written" (the later hops are given away by the hop before them, the
"Clever Hans" shortcut of the paper), but not which arm to take, so its success rate starts near
1/degree: the rate of the policy that picks the first hop uniformly and then follows edges. The
rule RL has to discover is to look back from the goal: find the edge into the goal, the edge into
that node, and so on back to the center; the arm found that way is the first hop. The reward is
the checker's verdict on the box (`check`), so the model gets no credit for a plausible-looking
path into the wrong arm.

Why the format is as it is: node labels are distinct random integers from 1..max_label (default
50: one or two digit tokens, and no label says where in the graph it is), the edges are shuffled
(so the goal's arm cannot be read off the prompt's order) and the text is short (a 5x4 question is
about 140 characters, its solution about 45) because the model is tiny. The hop lines are kept.
With or without them each hop is the same look-up (find the edge that starts at the node just
written, copy where it ends), but with them every line is a verbatim copy of one edge of the prompt
("u>v", the copy a small transformer learns first), each hop gets a few more positions to compute
in, the box is a plain copy of the lines above it, and a wrong response shows which edge was
followed or made up. They cost about as much text again as the box, which a tiny model can afford,
and give nothing away: the first line is still the one real decision. Only the box is checked, so a
response without hop lines scores the same.

Difficulty knobs: `degree` (arms, default 5; chance of a blind first hop is 1/degree) and `length`
(nodes per arm after the center, default 4: how many edges must be traced back from the goal).
Train / test split: by a sha256 of a canonical form of the instance (the goal and the sorted edge
list, `split_of`), so a test graph never occurs in the train split in any edge order, whatever the
seed or the number of rows; the test rows come from a fixed seed, so every run evaluates on the same
prompts.
Leaves out: other graphs (arms of different lengths, branching arms, undirected edges), goals in the
middle of an arm, the paper's reversed-path answers (which make the task easy for teacher forcing),
and wrong corpus solutions (the corpus has only correct paths; headroom comes from the fork alone).
"""
import argparse
import hashlib
import json
import math
import random
import re
import sys

from tasks.answer_box import BOXED, last_box

TEST_PERCENT = 10     # share of the instance space that is held out (by hash), in percent
TEST_SEED = 20261127  # the held-out rows come from this fixed seed: the same prompts every run
# task name -> (split, degree, length), for a registry of tasks such as data.TASKS
TASKS = {
    "stargraph": ("train", 5, 4),
    "stargraph_test": ("test", 5, 4),
    "stargraph3": ("train", 3, 4),
    "stargraph3_test": ("test", 3, 4),
    "stargraph8": ("train", 8, 4),
    "stargraph8_test": ("test", 8, 4),
}
DEFAULT_DEGREE = 5
DEFAULT_LENGTH = 4
DEFAULT_MAX_LABEL = 50
CHECK_ROWS = 20000    # rows of each side that --check compares
FOLLOW_ROWS = 1000    # rows of each side on which --check tries every first hop


def check_knobs(degree: int, length: int, max_label: int) -> None:
    """Raise a one-line ValueError unless the knobs describe a star graph that can be labelled."""
    if degree < 2:
        raise ValueError(f"degree must be >= 2 (a fork needs two arms), got {degree}")
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    nodes = degree * length + 1
    if max_label < nodes:
        raise ValueError(f"max_label must be >= degree*length+1 = {nodes} (distinct labels), "
                         f"got {max_label}")


def canonical(instance: dict) -> str:
    """The instance with the prompt's edge order taken out: the goal, then the sorted edges."""
    edges = " ".join(f"{u}>{v}" for u, v in sorted(instance["edges"]))
    return f"{instance['goal']}|{edges}"


def split_of(instance: dict) -> str:
    """'test' or 'train', from a hash of the canonical form (the same graph and goal in any edge
    order is the same instance)."""
    digest = hashlib.sha256(canonical(instance).encode()).digest()
    h = int.from_bytes(digest[:8], "big")              # sha256, not hash(): stable across processes
    return "test" if h % 100 < TEST_PERCENT else "train"


def sample_instance(rng: random.Random, degree: int = DEFAULT_DEGREE,
                    length: int = DEFAULT_LENGTH, max_label: int = DEFAULT_MAX_LABEL,
                    split: str = "train") -> dict:
    """A star graph of the given split (rejection sampling on the hash), as
    {"edges" (prompt order), "start", "goal", "path", "degree", "length"}."""
    check_knobs(degree, length, max_label)
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    while True:
        labels = rng.sample(range(1, max_label + 1), degree * length + 1)   # distinct labels
        center = labels[0]
        arms = [labels[1 + i * length:1 + (i + 1) * length] for i in range(degree)]
        edges = []
        for arm in arms:
            prev = center
            for node in arm:
                edges.append((prev, node))
                prev = node
        goal_arm = arms[rng.randrange(degree)]
        instance = {"edges": edges, "start": center, "goal": goal_arm[-1],
                    "path": [center] + goal_arm, "degree": degree, "length": length}
        if split_of(instance) == split:
            break
    # shuffled (in place: the instance holds this list) after the split is decided, which does not
    # depend on the order, so that the arms' edges are interleaved and the goal's arm cannot be
    # read off the prompt's order
    rng.shuffle(edges)
    return instance


def question(instance: dict) -> str:
    edges = " ".join(f"{u}>{v}" for u, v in instance["edges"])
    return f"Edges: {edges} Path from {instance['start']} to {instance['goal']}?"


def solution(instance: dict) -> str:
    """The worked solution: one hop a line (each a copy of an edge of the prompt), then the boxed
    path."""
    path = instance["path"]
    lines = [f"{u}>{v}" for u, v in zip(path, path[1:])]
    boxed = ">".join(str(node) for node in path)
    return "\n".join(lines) + f"\n{BOXED}{boxed}}}"


def gold(instance: dict) -> str:
    """The compact gold string "start,goal|u>v u>v ..." (the edges in prompt order): everything
    `check` needs, and `parse_gold` gives the instance back."""
    edges = " ".join(f"{u}>{v}" for u, v in instance["edges"])
    return f"{instance['start']},{instance['goal']}|{edges}"


# a node label as the generator writes it: ASCII digits without a sign or a leading zero
_LABEL = "[1-9][0-9]*"
_EDGE = f"{_LABEL}>{_LABEL}"
_GOLD = re.compile(f"({_LABEL}),({_LABEL})[|]({_EDGE}(?: {_EDGE})*)")


def _star(edges: list, start: int, goal: int) -> dict | None:
    """The instance if `edges` form a star graph centered at `start` (at least two arms of one
    length, edges pointing away from the center) and `goal` ends an arm, else None."""
    parent = {}
    children = {}
    for u, v in edges:
        if v in parent or v == u:
            return None                                 # two parents, or a self-loop: no tree
        parent[v] = u
        children.setdefault(u, []).append(v)
    if start in parent:
        return None
    arms = []
    for head in children.get(start, []):
        arm = [head]
        # no loop guard needed: every node has one parent and the center none, so a walk from the
        # center never comes back to a node it has seen
        while arm[-1] in children:
            arm.append(children[arm[-1]][0])
        arms.append(arm)
    if len(arms) < 2 or len({len(arm) for arm in arms}) != 1:
        return None
    # each arm node took one edge; an edge left over is a branch off an arm (the walk above took
    # only the first child) or lies away from the center
    if sum(len(arm) for arm in arms) != len(edges):
        return None
    goal_arms = [arm for arm in arms if arm[-1] == goal]
    if not goal_arms:
        return None
    return {"edges": list(edges), "start": start, "goal": goal, "path": [start] + goal_arms[0],
            "degree": len(arms), "length": len(arms[0])}


def parse_gold(gold: str) -> dict | None:
    """The instance a gold string describes, or None if it is malformed (never raises)."""
    if not isinstance(gold, str):
        return None
    match = _GOLD.fullmatch(gold)
    if match is None:
        return None
    start = int(match.group(1))
    goal = int(match.group(2))
    edges = []
    for text in match.group(3).split(" "):
        u, v = text.split(">")                          # the pattern above allows exactly one ">"
        edges.append((int(u), int(v)))
    return _star(edges, start, goal)


def boxed_answer(response: str) -> str | None:
    """The content of the last complete, closed \\boxed{...} (answer_box.last_box), else None."""
    box = last_box(response)
    return None if box is None else box[1]


def parse_path(text: str) -> list[int] | None:
    """The nodes of "a>b>...>z" (spaces around a label allowed), else None."""
    nodes = []
    for part in text.split(">"):
        part = part.strip()
        if not re.fullmatch(_LABEL, part):
            return None
        nodes.append(int(part))
    return nodes


def check(response: str, gold: str) -> tuple[bool, bool]:
    """(correct, formatted): formatted means a complete closed \\boxed{...}; correct needs the last
    box to hold a path from the start to the goal whose every hop is an edge of the graph (in a
    tree with edges pointing away from the center, that is exactly the one path). A malformed gold
    is never correct."""
    got = boxed_answer(response)
    if got is None:
        return False, False
    instance = parse_gold(gold)
    path = parse_path(got)
    # a one-node path fails below as well: the goal is never the start
    if instance is None or path is None:
        return False, True
    if path[0] != instance["start"] or path[-1] != instance["goal"]:
        return False, True
    edges = set(instance["edges"])
    correct = all((u, v) in edges for u, v in zip(path, path[1:]))
    return correct, True


def rows(n: int, seed: int = 0, split: str = "train", degree: int = DEFAULT_DEGREE,
         length: int = DEFAULT_LENGTH, max_label: int = DEFAULT_MAX_LABEL) -> list[dict]:
    """n rows {"question", "answer" (the gold string), "start", "goal", "degree", "length",
    "split"}; the test split ignores `seed` (fixed prompts)."""
    check_knobs(degree, length, max_label)             # fail at once, even for n == 0
    rng = random.Random(TEST_SEED if split == "test" else seed)
    out = []
    for _ in range(n):
        instance = sample_instance(rng, degree, length, max_label, split)
        out.append({"question": question(instance), "answer": gold(instance),
                    "start": instance["start"], "goal": instance["goal"],
                    "degree": degree, "length": length, "split": split})
    return out


def task_rows(task: str, limit: int | None, seed: int | None) -> list[dict]:
    """Raw rows of a registered task (2000 train / 500 test unless `limit` says)."""
    split, degree, length = TASKS[task]
    if limit is not None:
        n = limit
    else:
        n = 2000 if split == "train" else 500
    return rows(n, seed or 0, split, degree, length)


def corpus_example(rng: random.Random, split: str = "train", degree: int = DEFAULT_DEGREE,
                   length: int = DEFAULT_LENGTH,
                   max_label: int = DEFAULT_MAX_LABEL) -> tuple[str, str]:
    """One fresh pretraining example: (question, worked solution), always a correct path."""
    instance = sample_instance(rng, degree, length, max_label, split)
    return question(instance), solution(instance)


def follow_edges(instance: dict, first: int) -> str:
    """The response of a policy that takes the hop start>first and then follows the one outgoing
    edge of each node to the end of that arm (in the worked solution's format)."""
    # a node's one outgoing edge (the center, with its several, is never looked up)
    nxt = {u: v for u, v in instance["edges"] if u != instance["start"]}
    path = [instance["start"], first]
    while path[-1] in nxt:
        path.append(nxt[path[-1]])
    return solution(dict(instance, path=path))


def instance_space(degree: int, length: int, max_label: int) -> int:
    """How many distinct (graph, goal) instances the knobs allow: ordered label draws
    perm(max_label, degree*length+1), over the degree! orders of the arms, times degree goals."""
    return math.perm(max_label, degree * length + 1) // math.factorial(degree - 1)


def run_check(seed: int, degree: int, length: int, max_label: int) -> tuple[dict, bool]:
    """The --check report and whether everything passed."""
    train_rows = rows(CHECK_ROWS, seed, "train", degree, length, max_label)
    test_rows = rows(CHECK_ROWS, 0, "test", degree, length, max_label)
    all_rows = train_rows + test_rows
    instances = [parse_gold(r["answer"]) for r in all_rows]
    unparsed = sum(x is None for x in instances)
    if unparsed:
        return {"unparsed_golds": unparsed}, False      # nothing below can be checked without them
    # canonical forms, so that one graph in two edge orders counts as overlap
    train = {canonical(x) for x in instances[:CHECK_ROWS]}
    test = {canonical(x) for x in instances[CHECK_ROWS:]}
    bad_golds = sum(not check(solution(x), r["answer"])[0] for r, x in zip(all_rows, instances))
    # every first hop in turn, on the first rows of each side: the arm that holds the goal must
    # pass, the degree-1 others (paths into the wrong arm) must fail
    follow_rows = train_rows[:FOLLOW_ROWS] + test_rows[:FOLLOW_ROWS]
    follow_instances = instances[:FOLLOW_ROWS] + instances[CHECK_ROWS:CHECK_ROWS + FOLLOW_ROWS]
    wrong_arm_passed = 0
    follow_passed = 0
    for r, instance in zip(follow_rows, follow_instances):
        for first in (v for u, v in instance["edges"] if u == instance["start"]):
            passed = check(follow_edges(instance, first), r["answer"])[0]
            follow_passed += passed
            if passed and first != instance["path"][1]:
                wrong_arm_passed += 1
    # a uniform first hop, then forced hops: one of the degree arms passes per instance, so the
    # success rate is 1/degree by construction; averaging over all first hops measures it exactly
    follow_rate = follow_passed / (len(follow_rows) * degree)
    report = {
        "train": len(train), "test": len(test), "overlap": len(train & test),
        "instance_space": float(instance_space(degree, length, max_label)),
        "bad_golds": bad_golds, "wrong_arm_passed": wrong_arm_passed,
        "mean_question_chars": round(sum(len(r["question"]) for r in all_rows) / len(all_rows), 1),
        "mean_solution_chars": round(sum(len(solution(x)) for x in instances) / len(all_rows), 1),
        "follow_edges_rate": round(follow_rate, 4),
        "one_over_degree": round(1 / degree, 4),
    }
    ok = (not (train & test) and not bad_golds and not wrong_arm_passed
          and follow_passed == len(follow_rows))
    return report, ok


def main(argv=None):
    ap = argparse.ArgumentParser(description="Show the star-graph path task's rows and worked "
                                             "solutions, or check the task (--check).")
    ap.add_argument("--degree", type=int, default=DEFAULT_DEGREE,
                    help="arms of the star (>= 2): the first hop is a choice among this many")
    ap.add_argument("--length", type=int, default=DEFAULT_LENGTH,
                    help="nodes per arm after the center (>= 1): hops from the start to the goal")
    ap.add_argument("--max-label", type=int, default=DEFAULT_MAX_LABEL,
                    help="node labels are distinct integers in 1..MAX_LABEL "
                         "(>= degree*length+1)")
    ap.add_argument("--split", default="train", choices=("train", "test"),
                    help="which side of the hash split to show")
    ap.add_argument("--limit", type=int, default=3, help="rows to show")
    ap.add_argument("--seed", type=int, default=0, help="generator seed (train split only)")
    ap.add_argument("--check", action="store_true",
                    help=f"check that the split is disjoint on {CHECK_ROWS} rows of each side, "
                         "that every row's worked solution passes the checker and that paths into "
                         "the wrong arms fail it; print one JSON line (distinct instances, mean "
                         "question and solution length in characters, the success rate of a "
                         "uniform first hop then following edges, 1/degree by construction) and "
                         "exit 1 if anything fails")
    args = ap.parse_args(argv)
    try:
        check_knobs(args.degree, args.length, args.max_label)
    except ValueError as e:
        print(f"stargraph: error: {e}", file=sys.stderr)   # one line, no traceback
        return 2
    if args.check:
        report, ok = run_check(args.seed, args.degree, args.length, args.max_label)
        print(json.dumps(report))
        return 0 if ok else 1
    for r in rows(args.limit, args.seed, args.split, args.degree, args.length, args.max_label):
        print("-" * 60)
        print(r["question"])
        print(solution(parse_gold(r["answer"])))
        print(f"[gold] {r['answer']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
