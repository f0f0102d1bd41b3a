"""The folders are the architecture: each imports only the folders below it, and no pipeline step imports another."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAY_IMPORT = {
    "envgen": set(),
    "policy": {"envgen"},
    "pipeline": {"envgen"},
    "engineers": {"envgen", "policy", "pipeline"},
    "steps": {"envgen", "policy", "pipeline", "engineers"},
    "experiments": {"envgen", "policy", "pipeline", "engineers"},
    "flows": {"envgen", "pipeline", "experiments"},
    "env_engineer": {"envgen", "policy", "pipeline", "engineers", "steps", "experiments", "flows"},
}
"""Per code folder, the project folders it may import (lazily inside a function, too)."""


def project_imports(path: Path) -> set[str]:
    """Dotted names of the project's modules that ``path`` imports, anywhere in the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in names if n.split(".")[0] in MAY_IMPORT}


@pytest.mark.parametrize("folder", sorted(MAY_IMPORT))
def test_each_folder_imports_only_the_folders_below_it(folder):
    for path in sorted((ROOT / folder).rglob("*.py")):  # subpackages too
        used = {name.split(".")[0] for name in project_imports(path)} - {folder}
        assert used <= MAY_IMPORT[folder], f"{path.relative_to(ROOT)} imports {sorted(used - MAY_IMPORT[folder])}"


def test_no_step_imports_another_step():
    steps = {p.stem for p in (ROOT / "steps").glob("*.py") if p.stem != "__init__"}
    for name in steps:
        imported = {n.split(".")[1] for n in project_imports(ROOT / "steps" / f"{name}.py") if n.startswith("steps.")}
        assert not imported & (steps - {name}), f"steps/{name}.py imports {sorted(imported & steps)}"


def test_every_dvc_stage_runs_a_step_module():
    import yaml

    from env_engineer.cli import commands

    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name, body in stages.items():
        cmd = (body.get("do") or body)["cmd"]
        used = [part.split()[0] for part in cmd.split("env-engineer ")[1:]]
        modules = {commands()[u][1].__name__ for u in used}
        assert any(m.startswith("steps.") for m in modules), (name, used)


def test_the_testbed_installs_and_imports_without_the_pipelines_dependencies():
    """`pip install env-engineer` is the testbed: its requirements hold no torch, DVC or Prefect (they are the
    `pipeline` extra), and every envgen module imports without them."""
    import subprocess
    import sys
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"]).lower()
    assert not any(name in core for name in ("torch", "dvc", "prefect", "transformers", "polars", "great-expectations"))
    assert "torch>=2.4" in project["optional-dependencies"]["pipeline"]
    modules = sorted(p.stem for p in (ROOT / "envgen").glob("*.py") if p.stem != "__init__")
    code = "\n".join([
        "import sys",
        "blocked = ('torch', 'dvc', 'prefect', 'polars', 'transformers', 'great_expectations')",
        "class Block:",
        "    def find_spec(self, name, path=None, target=None):",
        "        if name.split('.')[0] in blocked:",
        "            raise ImportError(f'{name} is not part of the testbed')",
        "sys.meta_path.insert(0, Block())",
        *(f"import envgen.{m}" for m in modules),
        "from envgen.gym_env import register_envs",
        "register_envs()",
        "import gymnasium",
        "gymnasium.make('MAPFFrozenLake-v0').reset(seed=0)",
        "print('ok')"])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


ENVGEN_MAY_IMPORT = {
    "core": set(),
    "solver": {"core"},
    "llm": {"core"},
    "formats": {"core", "solver", "llm", "generator"},
}
"""Per subpackage of the testbed, the parts of envgen it may import (envgen/__init__.py says why)."""


@pytest.mark.parametrize("part", sorted(ENVGEN_MAY_IMPORT))
def test_each_testbed_part_imports_only_the_parts_below_it(part):
    for path in sorted((ROOT / "envgen" / part).rglob("*.py")):
        used = {n.split(".")[1] for n in project_imports(path) if n.startswith("envgen.")} - {part}
        assert used <= ENVGEN_MAY_IMPORT[part], f"{path.relative_to(ROOT)} imports envgen {sorted(used - ENVGEN_MAY_IMPORT[part])}"
