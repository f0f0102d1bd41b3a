"""Prefect flow ``curriculum``: the DVC pipeline, stage by stage, as Prefect tasks named after the pipeline's stages.

The stages and their order come from ``dvc.yaml`` through DVC (:func:`experiments.dvc.pipeline_stages`): there is no
second list of them. Each task runs one DVC stage (``dvc repro --single-item train@0``), so DVC keeps deciding what is
up to date and caches every artifact, and Prefect shows the runs, logs, retries and artifacts. Only transient faults
are retried (DVC's repository lock held by another command); a failing stage fails the flow. After each curriculum
stage a table artifact (the metrics its stages declare) and, after an engineer's decision, a markdown artifact (the
configuration diff, the rationale and the notes) are published.

With ``overrides`` (``{"train.trajectories": 64}``, e.g. from the UI), the overrides are first checked against the
typed parameters (:func:`pipeline.params.load_params`, reading ``params.yaml`` under DVC's lock, which other
experiments' ``dvc exp run`` hold while they rewrite it; a bad one fails the run before anything runs), then the
whole pipeline runs as a DVC experiment (``dvc exp run --temp -S key=value``), leaving the workspace as it is. Several
such runs at once (one Prefect worker per GPU, ``env-engineer workers``) each run in a temporary copy of the workspace
and share DVC's cache and run-cache; ``env-engineer compare --via prefect`` submits a whole comparison this way.

Prefect's home is the project's ``.prefect`` folder and its analytics are off unless the environment says otherwise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("PREFECT_HOME", str(ROOT / ".prefect"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")

from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.artifacts import create_markdown_artifact, create_table_artifact  # noqa: E402

from experiments.dvc import (DvcBusy, DvcError, StageFiles, dvc, experiments_shown, pipeline_stages,  # noqa: E402
                             repository_locked, set_words)


def only_transient(task, task_run, state) -> bool:
    """Retry condition: retry the repository-lock fault, nothing else."""
    try:
        state.result()
    except DvcBusy:
        return True
    except Exception:  # noqa: BLE001 - any other failure is final
        return False
    return False


@task(retries=3, retry_delay_seconds=15, retry_condition_fn=only_transient)
def run_stage(stage_name: str, repo: str) -> str:
    """Reproduce one DVC stage (its upstream stages must be done: the flow runs them in DVC's order)."""
    output = dvc(["repro", "--single-item", stage_name], Path(repo))
    get_run_logger().info(output[-2000:])
    return output


@task(name="publish-artifacts")
def publish_artifacts(item: str, stages: list[StageFiles], repo: str) -> None:
    """The curriculum stage's metrics as a table, and the engineer's configuration diff, for the UI."""
    from envgen.core.config import EnvConfig, config_diff

    root = Path(repo)
    rows = []
    for stage in stages:
        for path in stage.metrics:
            if (root / path).exists():
                data = json.loads((root / path).read_text())
                data.pop("reference", None)
                data.pop("bench_table", None)
                for key, value in _flatten(data).items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        rows.append({"metric": key, "value": round(float(value), 4)})
    create_table_artifact(key=f"stage-{item}-metrics", table=rows,
                          description=f"Metrics of curriculum stage {item} (training, validation, benchmark)")
    for stage in stages:
        if stage.step != "engineer-config":
            continue
        before = next((root / p for p in stage.deps if p.endswith(".yaml")), None)
        after = next((root / p for p in stage.outs if p.endswith(".yaml")), None)
        log = next((root / p for p in stage.outs if p.endswith(".json")), None)
        if before is None or after is None or not before.exists() or not after.exists():
            continue
        diff = config_diff(EnvConfig.load(before), EnvConfig.load(after))
        lines = [f"# Engineered change: {before} -> {after}", "", "| field | before | after |", "|---|---|---|"]
        lines += [f"| {f} | {x} | {y} |" for f, x, y in diff] or ["| (no change) | | |"]
        if log is not None and log.exists():
            entry = json.loads(log.read_text())
            lines += ["", f"Engineer: {entry.get('engineer')} ({entry.get('context')}); rationale: {entry.get('rationale') or '-'}",
                      "", "Notes: " + ("; ".join(entry.get("notes") or []) or "none")]
        create_markdown_artifact(key=f"stage-{item}-config-diff", markdown="\n".join(lines))


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
def curriculum(repo: str = str(ROOT), stages: list[int] | None = None, overrides: dict[str, Any] | None = None,
               name: str | None = None, targets: list[str] | None = None) -> dict:
    """Run the curriculum: every stage of ``dvc.yaml`` (or, of the curriculum's stages, only those in ``stages``), or,
    with ``overrides``, the whole pipeline as a temporary DVC experiment with those parameter values (named ``name``,
    e.g. by ``env-engineer compare --via prefect``, else by DVC; with ``targets``, only those DVC stages and what they
    depend on)."""
    root = Path(repo).resolve()
    if overrides:
        check_overrides(overrides, str(root))  # a bad override stops here, naming the field and the fix
        sets = set_words(overrides)
        output = experiment((["-n", name] if name else []) + sets + list(targets or []), str(root))
        return {"experiment": output[-2000:]}
    plan = pipeline_stages(root)
    done: list[int] = []
    for i, stage in enumerate(plan):
        if stages is not None and stage.item is not None and int(stage.item) not in stages:
            continue
        run_stage.with_options(name=stage.step, task_run_name=stage.name)(stage.name, str(root))
        last_of_item = stage.item is not None and all(s.item != stage.item for s in plan[i + 1:])
        if last_of_item:
            publish_artifacts(stage.item, [s for s in plan if s.item == stage.item], str(root))
            done.append(int(stage.item))
    return {"stages": done}


@task(name="check-overrides", retries=3, retry_delay_seconds=5, retry_condition_fn=only_transient)
def check_overrides(overrides: dict[str, Any], repo: str) -> None:
    """Validate ``params.yaml`` with the overrides as typed parameters (:func:`pipeline.params.load_params`), reading
    it under DVC's lock: another worker's ``dvc exp run`` in the same repository rewrites it while stashing its
    experiment."""
    from pipeline.params import load_params

    with repository_locked(repo):
        load_params(Path(repo) / "params.yaml", overrides)


@task(name="experiment", retries=3, retry_delay_seconds=15, retry_condition_fn=only_transient)
def experiment(sets: list[str], repo: str) -> str:
    """``dvc exp run --temp`` with the overrides, then publish the experiment's metrics. A retry (after a transient
    fault) that finds its named experiment already saved by the attempt before takes that one."""
    from prefect.runtime import task_run

    try:
        output = dvc(["exp", "run", "--temp", *sets], Path(repo))
    except DvcError as e:
        if task_run.run_count <= 1 or "conflicts with existing experiment" not in str(e):
            raise
        output = f"saved by the attempt before this retry:\n{e}"
    shown = json.dumps(experiments_shown(Path(repo)), indent=1)  # other workers' experiments may be running beside it
    create_markdown_artifact(key="experiment", markdown=f"```\n{output[-3000:]}\n```\n\n```json\n{shown[:6000]}\n```")
    return output


if __name__ == "__main__":
    curriculum()
