"""Prefect flow ``curriculum``: the DVC pipeline, stage by stage, as Prefect tasks named after the pipeline steps.

Each task runs one DVC stage (``dvc repro --single-item generate-instances@0``), so DVC keeps deciding what is up to
date and caches every artifact, and Prefect shows the runs, logs, retries and artifacts. Only transient faults are
retried (DVC's repository lock held by another command); a failing step fails the flow. After each stage a table
artifact (training and validation metrics) and a markdown artifact (the engineer's configuration diff) are published.

With ``overrides`` (``{"train.trajectories": 64}``, e.g. from the UI), the flow runs the whole pipeline as a DVC
experiment instead (``dvc exp run --temp -S key=value``), leaving the workspace as it is, and publishes the
experiment's metrics.

Prefect's home is the project's ``.prefect`` folder and its analytics are off unless the environment says otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("PREFECT_HOME", str(ROOT / ".prefect"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")

import yaml  # noqa: E402
from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.artifacts import create_markdown_artifact, create_table_artifact  # noqa: E402

STEPS = ("generate-instances", "train", "rollout", "evaluate", "summarize-failures", "engineer-config")
"""The per-stage pipeline steps, in order (the names of the DVC foreach stages and of the Prefect tasks)."""
SETUP = ("validation-set", "benchmark", "init-curriculum")


class TransientError(RuntimeError):
    """A fault worth retrying: another DVC command holds the repository lock."""


def dvc(args: list[str], repo: Path) -> str:
    """Run a DVC command in ``repo``; its output, or an error carrying the output's tail."""
    from tasks.tools import tool_env

    proc = subprocess.run(["dvc", *args], cwd=repo, env=tool_env(), capture_output=True, text=True)
    output = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        tail = "\n".join(output.splitlines()[-25:])
        if "Unable to acquire lock" in output or "is busy" in output:
            raise TransientError(f"dvc {' '.join(args)}: repository busy\n{tail}")
        raise RuntimeError(f"dvc {' '.join(args)} failed (exit {proc.returncode}):\n{tail}")
    return output


def only_transient(task, task_run, state) -> bool:
    """Retry condition: retry the repository-lock fault, nothing else."""
    try:
        state.result()
    except TransientError:
        return True
    except Exception:  # noqa: BLE001 - any other failure is final
        return False
    return False


@task(retries=3, retry_delay_seconds=15, retry_condition_fn=only_transient)
def run_stage(stage_name: str, repo: str) -> str:
    """Reproduce one DVC stage (its upstream stages must be done: the flow orders them)."""
    output = dvc(["repro", "--single-item", stage_name], Path(repo))
    get_run_logger().info(output[-2000:])
    return output


def step_task(step: str, stage: int | None = None):
    return run_stage.with_options(name=step, task_run_name=step if stage is None else f"{step}@{stage}")


@task(name="publish-artifacts")
def publish_artifacts(stage: int, next_stage: int, repo: str) -> None:
    """A metrics table and the engineer's configuration diff for the UI."""
    from envgen.config import EnvConfig
    from tasks.curriculum import config_diff

    base = Path(repo) / "data" / "stages"
    rows = []
    for name in ("train_metrics.json", "validation_metrics.json", "benchmark_metrics.json"):
        path = base / str(stage) / name
        if path.exists():
            data = json.loads(path.read_text())
            data.pop("reference", None)
            data.pop("bench_table", None)
            for key, value in _flatten(data).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    rows.append({"metric": key, "value": round(float(value), 4)})
    create_table_artifact(key=f"stage-{stage}-metrics", table=rows, description=f"Training and validation metrics of stage {stage}")
    a, b = base / str(stage) / "config.yaml", base / str(next_stage) / "config.yaml"
    if a.exists() and b.exists():
        diff = config_diff(EnvConfig.load(a), EnvConfig.load(b))
        lines = [f"# Engineered change: stage {stage} -> stage {next_stage}", "", "| field | before | after |", "|---|---|---|"]
        lines += [f"| {f} | {x} | {y} |" for f, x, y in diff] or ["| (no change) | | |"]
        log = base / str(stage) / "engineer_log.json"
        if log.exists():
            entry = json.loads(log.read_text())
            lines += ["", f"Engineer: {entry.get('engineer')} ({entry.get('context')}); rationale: {entry.get('rationale') or '-'}",
                      "", "Notes: " + ("; ".join(entry.get("notes") or []) or "none")]
        create_markdown_artifact(key=f"stage-{stage}-config-diff", markdown="\n".join(lines))


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}/"))
        else:
            out[name] = value
    return out


@flow(name="curriculum", log_prints=True)
def curriculum(repo: str = str(ROOT), stages: list[int] | None = None, overrides: dict[str, Any] | None = None) -> dict:
    """Run the curriculum: every stage listed in params.yaml (or only ``stages``), or, with ``overrides``, the whole
    pipeline as a temporary DVC experiment with those parameter values."""
    root = Path(repo).resolve()
    params = yaml.safe_load((root / "params.yaml").read_text())
    if overrides:
        sets = [arg for key, value in overrides.items() for arg in ("-S", f"{key}={json.dumps(value)}")]
        output = experiment(sets, str(root))
        return {"experiment": output[-2000:]}
    for name in SETUP:
        step_task(name)(name, str(root))
    done = []
    for item in params["curriculum"]:
        k = item["stage"]
        if stages is not None and k not in stages:
            continue
        for step in STEPS:
            step_task(step, k)(f"{step}@{k}", str(root))
        publish_artifacts(k, item["next"], str(root))
        done.append(k)
    return {"stages": done}


@task(name="experiment", retries=3, retry_delay_seconds=15, retry_condition_fn=only_transient)
def experiment(sets: list[str], repo: str) -> str:
    """``dvc exp run --temp`` with the overrides, then publish the experiment's metrics."""
    output = dvc(["exp", "run", "--temp", *sets], Path(repo))
    shown = dvc(["exp", "show", "--json"], Path(repo))
    create_markdown_artifact(key="experiment", markdown=f"```\n{output[-3000:]}\n```\n\n```json\n{shown[:6000]}\n```")
    return output


if __name__ == "__main__":
    curriculum()
