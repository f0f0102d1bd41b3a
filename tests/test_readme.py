"""The README's set-up commands are the ones CI runs and they name things that exist."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text(), flags=re.S)


def test_ci_runs_the_readme_test_command():
    commands = readme_commands()
    test_cmd = next(c for c in commands if "pytest" in c)
    assert test_cmd in (ROOT / ".ci" / "run").read_text()
    assert "torch==2.13.0" in test_cmd


def test_main_job_command_names_existing_files():
    main = next(c for c in readme_commands() if "pytest" not in c)
    assert "torch==2.13.0" in main
    for path in re.findall(r"--config (\S+)", main):
        assert (ROOT / path).exists(), path
