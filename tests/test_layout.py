"""The repository's layout: its own modules import one another one way only, so they read in one order.

Every top-level .py file and every file of bench/ is parsed (nothing is imported or run): its imports at module
level and inside functions, `import x` and `from x import y`, among the repository's own modules, make a graph
that must have no cycle.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Import edges that are known and about to go, each with the reason it is still here.
KNOWN: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    """bench/common.py -> "bench.common", bench/__init__.py -> "bench", model.py -> "model"."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def own_modules() -> dict[str, Path]:
    files = sorted(ROOT.glob("*.py")) + sorted((ROOT / "bench").glob("*.py"))
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
            if node.level:                                   # from . import x, from .common import y
                up = package[: len(package) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}  # from bench import sweep: the module bench.sweep
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
    """Every circle, one by one: each found is written down and its closing edge dropped, until none is left."""
    g, found = {v: set(ws) for v, ws in g.items()}, []
    while cycle := find_cycle(g):
        found.append(" -> ".join(cycle))
        g[cycle[-2]].discard(cycle[-1])
    return found


def test_finder_sees_every_import_form(tmp_path):
    """The parser and the cycle finder themselves: imports inside functions and `from x import y` count; a
    two-module circle and a longer one are found and named."""
    src = tmp_path / "a.py"
    src.write_text("import os\nfrom b import f\n\ndef g():\n    import c as C\n    from bench import sweep\n")
    assert imports(src, "a", {"a", "b", "c", "bench", "bench.sweep"}) == {"b", "c", "bench", "bench.sweep"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert find_cycle({"x": {"y"}, "y": {"z"}, "z": {"x"}}) == ["x", "y", "z", "x"]
    assert all_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}) == ["a -> b -> a", "c -> d -> c"]


def test_import_graph_has_no_cycle():
    g = graph()
    assert {"model", "lora", "kernels", "kernels_ws"} <= set(g)                   # the parser found the files
    for a, b in KNOWN:
        g[a].discard(b)
    cycles = all_cycles(g)
    assert not cycles, f"import cycles (make the lower module stop importing the higher): {'; '.join(cycles)}"
    # the lower module of each circle the layout once had imports nothing above it
    assert "model" not in g["lora"] and "kernels" not in g["kernels_ws"]
    assert all("bench.__main__" not in deps for name, deps in g.items())        # the entry point is the top
