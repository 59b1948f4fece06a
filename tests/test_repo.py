"""The repository's promises about itself: CI runs exactly the test command README gives, and README's commands name
files that exist."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    """The commands of README's "Two commands" block, comments dropped."""
    block = re.search(r"## Two commands\s+```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    return [line.strip() for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_ci_runs_the_readme_test_command():
    setup_and_run, tests = readme_commands()
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))]
    assert ci == [tests], f".ci/run runs {ci}, README gives {tests!r}"
    assert setup_and_run.startswith("./setup.sh && ")


def test_readme_commands_name_existing_files():
    for cmd in readme_commands():
        for script in re.findall(r"\b([\w./-]+\.(?:py|sh))\b", cmd) + re.findall(r"(tests/\w+\.py)", cmd):
            assert (ROOT / script).exists(), f"README runs {script}, which is not in the repository"
