"""The repository's layout: the stages at the top level, the helpers in folders, and imports that
run one way.

Every top-level .py file and every file of a folder with an __init__.py is parsed (nothing is
imported or run): its imports at module level and inside functions, `import x` and
`from x import y`, among the repository's own modules, make a graph. It must have no cycle; a stage
may import only the stages above it in README's file list (directly or through the folders it
points into), and README's arrows must be the code's.
"""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The stages in reading order (README, "Files"): the only .py files at the top level
STAGES = ["quantize", "kernels", "model", "lora", "noise", "rollout", "eval", "grpo", "ppo",
          "train", "pretrain"]
FOLDERS = ["gemm", "layers", "tasks", "trainer", "vllm_backend", "util"]


def module_name(path: Path) -> str:
    """bench/common.py -> "bench.common", bench/__init__.py -> "bench", model.py -> "model"."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def own_modules() -> dict[str, Path]:
    files = sorted(ROOT.glob("*.py"))
    for folder in sorted(p for p in ROOT.iterdir() if (p / "__init__.py").exists()):
        files += sorted(folder.glob("*.py"))
    return {module_name(f): f for f in files}


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The repository's modules that `path` (module `name`) imports anywhere in its code."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                               # from . import x, from .common import y
                up = package[: len(package) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            # from bench import sweep: the module bench.sweep
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = own_modules()
    return {name: imports(path, name, set(mods)) for name, path in mods.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One cycle of g as [a, b, ..., a], or None (depth-first search, three colours)."""
    state, stack = {}, []

    def visit(v):
        state[v] = "open"
        stack.append(v)
        for w in sorted(g.get(v, ())):
            if state.get(w) == "open":
                return stack[stack.index(w):] + [w]
            if w not in state and (c := visit(w)):
                return c
        stack.pop()
        state[v] = "done"
        return None

    for v in sorted(g):
        if v not in state and (c := visit(v)):
            return c
    return None


def all_cycles(g: dict[str, set[str]]) -> list[str]:
    """Every circle, one by one: each found is written down and its closing edge dropped, until
    none is left."""
    g, found = {v: set(ws) for v, ws in g.items()}, []
    while cycle := find_cycle(g):
        found.append(" -> ".join(cycle))
        g[cycle[-2]].discard(cycle[-1])
    return found


def stage_arrows(g: dict[str, set[str]]) -> dict[str, tuple[set[str], set[str]]]:
    """stage -> (the stages it imports, directly or through helper modules, which are followed until
    a stage; the folders it imports directly, util/ left out since every runnable stage imports
    util/versions.py)."""
    out = {}
    for s in STAGES:
        stages, seen, todo = set(), set(), [s]
        while todo:
            for w in g[todo.pop()]:
                if w in STAGES:
                    stages.add(w)
                elif w not in seen:
                    seen.add(w)
                    todo.append(w)
        folders = {w.split(".")[0] for w in g[s] if w not in STAGES} - {"util"}
        out[s] = (stages - {s}, folders)
    return out


def readme_arrows() -> dict[str, tuple[set[str], set[str]]]:
    """The arrows README's file list draws: `<- stages` and `-> folders/`, continuation lines
    included."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Files\n.*?```\n(.*?)```", text, re.S).group(1)
    out, current, side = {}, None, None
    for line in block.splitlines():
        m = re.match(r"(\w+)\.py\s", line)
        if m:
            current = m.group(1)
            out[current] = (set(), set())
        elif not line.strip() or re.match(r"\w+/\s", line):
            current = None                       # a blank line or a folder's row ends a stage
        if current is None:
            continue
        for arrow, names in re.findall(r"(<-|->)((?:\s+[\w/]+)+)\s*$", line):
            side = 0 if arrow == "<-" else 1
            line = ""
            out[current][side].update(n.rstrip("/") for n in names.split())
        # an arrow's continuation line
        if line and side is not None and re.match(r"\s{40,}\w", line):
            out[current][side].update(n.rstrip("/") for n in line.split())
    return out


def test_finder_sees_every_import_form(tmp_path):
    """The parser and the cycle finder themselves: imports inside functions and `from x import y`
    count; a two-module circle and a longer one are found and named."""
    src = tmp_path / "a.py"
    src.write_text("import os\nfrom b import f\n\n"
                   "def g():\n    import c as C\n    from bench import sweep\n")
    found = imports(src, "a", {"a", "b", "c", "bench", "bench.sweep"})
    assert found == {"b", "c", "bench", "bench.sweep"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"x": {"y"}, "y": {"z"}, "z": {"x"}}) == ["x", "y", "z", "x"]
    two = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}
    assert all_cycles(two) == ["a -> b -> a", "c -> d -> c"]


def test_the_top_level_is_the_stages_and_each_folder_says_what_it_serves():
    top = {p.stem for p in ROOT.glob("*.py")}
    extra = sorted(top - set(STAGES))
    assert top == set(STAGES), f"top-level .py files that are not stages: {extra}"
    for folder in FOLDERS:
        init = ROOT / folder / "__init__.py"
        assert init.exists(), f"{folder}/ has no __init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        opens = doc is not None and doc.startswith(f"{folder}/: ")
        assert opens, f"{folder}/__init__.py should open with what the folder serves"


def test_import_graph_has_no_cycle():
    g = graph()
    # the parser found the files, the folders' too
    assert {"model", "lora", "kernels", "gemm.warp_specialized", "tasks.data"} <= set(g)
    cycles = "; ".join(all_cycles(g))
    assert not cycles, f"import cycles (make the lower module stop importing the higher): {cycles}"
    # the benchmarks' entry point is the top
    assert all("bench.__main__" not in deps for name, deps in g.items())


def test_stages_import_only_the_stages_above_them_and_readme_draws_the_arrows():
    g = graph()
    code = stage_arrows(g)
    for i, s in enumerate(STAGES):
        below = code[s][0] - set(STAGES[:i])
        assert not below, f"{s}.py imports {sorted(below)}, which come after it in reading order"
    drawn = readme_arrows()
    assert set(drawn) == set(STAGES), sorted(set(drawn) ^ set(STAGES))
    for s in STAGES:
        for side, arrow in ((0, "<-"), (1, "->")):
            readme, imported = sorted(drawn[s][side]), sorted(code[s][side])
            assert readme == imported, f"README: {s}.py {arrow} {readme}; code: {imported}"


def test_arrows_that_existed_for_one_name_stay_cut():
    """The flags do not import an engine, ppo does not import the flags, nothing re-exports another
    module's names (a `noqa: F401` outside the tests), and no file hides imports behind a version
    check (`noqa: E402`)."""
    g = graph()
    assert not g["trainer.config"] & {"eval", "rollout", "vllm_backend.engine"}
    assert "trainer.config" not in g["ppo"]
    # rewards.score, read where it lives
    assert not any("data.score" in path.read_text() for path in own_modules().values())
    for path in own_modules().values():
        text = path.read_text()
        assert "noqa: F401" not in text and "noqa: E402" not in text, f"{path.relative_to(ROOT)}"


def test_lines_fit_in_100_columns():
    """Every Python file of the repository, kernels and tests included."""
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        if any(part.startswith(".") for part in path.relative_to(ROOT).parts):
            continue                                           # .venv and the like
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if len(line) > 100:
                long.append(f"{path.relative_to(ROOT)}:{i}")
    assert not long, f"{len(long)} lines over 100 columns, the first: {long[:5]}"
