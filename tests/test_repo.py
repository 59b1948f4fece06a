"""The repository's promises about itself: CI runs exactly the test command README gives, and every
command README shows names files, subcommands and flags that exist."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    """The commands of README's "Two commands" block, comments dropped."""
    block = re.search(r"## Two commands\s+```bash\n(.*?)```", (ROOT / "README.md").read_text(),
                      re.S).group(1)
    return [line.strip() for line in block.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_ci_runs_the_readme_test_command():
    setup_and_run, tests = readme_commands()
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))]
    assert ci == [tests], f".ci/run runs {ci}, README gives {tests!r}"
    assert setup_and_run.startswith("./setup.sh && ")


def test_readme_commands_name_existing_files():
    for cmd in readme_commands():
        for script in (re.findall(r"\b([\w./-]+\.(?:py|sh))\b", cmd)
                       + re.findall(r"(tests/\w+\.py)", cmd)):
            assert (ROOT / script).exists(), f"README runs {script}, which is not in the repository"


def all_readme_commands() -> list[str]:
    """Every command README shows: the lines of its bash blocks (continuations joined, comments
    dropped) and the inline `...` spans that run python."""
    text = (ROOT / "README.md").read_text()
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)                  # "\" line continuations
        for line in joined.splitlines():
            line = line.split("  #")[0].strip()                  # a trailing comment
            if line and not line.startswith("#"):
                cmds += [c.strip() for c in line.split("&&")]
    cmds += [c for c in re.findall(r"`([^`\n]*python[^`\n]*)`", text) if " " in c]
    return cmds


def flag_known(flag: str, sources: list[str]) -> bool:
    """A flag is known if a source spells it, or names the dataclass field it is made from."""
    field = flag[2:].replace("-", "_")
    return any(flag in src or re.search(rf"^\s+{field}\s*:", src, re.M) for src in sources)


def test_every_readme_command_names_what_exists():
    bench_main = (ROOT / "bench" / "__main__.py").read_text()
    own = {"dist": "bench/scaling.py", "vllm": "bench/vllm_speed.py"}
    checked = 0
    for cmd in all_readme_commands():
        words = cmd.split()
        if "-m" in words and words[words.index("-m") + 1] == "bench":  # python -m bench <what>
            rest = words[words.index("-m") + 2:]
            if not rest or rest[0].startswith("<"):
                continue
            what = rest[0]
            assert f'"{what}"' in bench_main, (
                f"README runs python -m bench {what}: no such subcommand")
            sources = [bench_main] + ([(ROOT / own[what]).read_text()] if what in own else [])
            flags = [w.split("=")[0] for w in rest[1:] if w.startswith("--")]
        elif ("-m" in words
              and words[words.index("-m") + 1] not in ("pytest", "torch.distributed.run")):
            module = words[words.index("-m") + 1]                      # python -m tasks.data ...
            path = ROOT / (module.replace(".", "/") + ".py")
            assert path.exists(), f"README runs python -m {module}, which is not in the repository"
            sources = [path.read_text()]
            flags = [w.split("=")[0] for w in words[words.index(module) + 1:] if w.startswith("--")]
        else:
            scripts = [w for w in words if re.fullmatch(r"[\w./-]+\.(py|sh)", w)]
            for script in scripts:
                assert (ROOT / script).exists(), (
                    f"README runs {script}, which is not in the repository")
            if not scripts or not scripts[0].endswith(".py"):
                continue
            script = scripts[0]
            sources = [(ROOT / script).read_text()]
            if "trainer.config" in sources[0]:  # train.py's flags (the ablation passes them on)
                sources.append((ROOT / "trainer/config.py").read_text())
            flags = [w.split("=")[0] for w in words[words.index(script) + 1:] if w.startswith("--")]
        for flag in flags:
            assert flag_known(flag, sources), f"README passes {flag} in: {cmd}"
        checked += 1
    assert checked >= 20                     # the commands above were found, not skipped
