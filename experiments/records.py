"""A comparison's results, read back: each experiment's record (from ``dvc exp show`` or copies of its workspace),
its stages' benchmark and validation numbers and configurations, every benchmark answer's outcome, and the aggregate
per engineer (means with 95% t-intervals across seeds, differences from a reference paired by seed)."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from experiments.dvc import StageFiles, stage_named
from experiments.plan import Experiment
from experiments.stats import mean_ci


def experiment_records(show: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Name, params and metrics of every experiment in ``dvc exp show --json`` output."""
    out = []
    for baseline in show:
        for exp in baseline.get("experiments") or []:
            for rev in exp.get("revs") or []:
                data = rev.get("data") or {}
                files = {path: (p or {}).get("data") or {} for path, p in (data.get("params") or {}).items()}
                metrics = {path: (m or {}).get("data") or {} for path, m in (data.get("metrics") or {}).items()}
                out.append({"name": rev.get("name") or exp.get("name"), "params": files.get("params.yaml") or {},
                            "metrics": metrics, "param_files": files, "rev": rev.get("rev")})
    return out


def workspace_records(folder: Path, stages: list[StageFiles]) -> list[dict[str, Any]]:
    """The same records as :func:`experiment_records`, read from experiment workspaces instead of ``dvc exp show``:
    every subfolder of ``folder`` that holds a ``params.yaml`` is one experiment, named after the subfolder
    (``cmp-fixed-s0``, as :func:`experiments.plan.comparison_plan` names them), its files at the paths ``dvc.yaml`` declares. For
    experiments that DVC never saved: a run stopped before its last stages, whose workspaces (DVC's
    ``.dvc/tmp/exps``) were copied while it ran."""
    import yaml

    metric_paths = sorted({path for s in stages for path in s.metrics})
    param_paths = sorted({path for s in stages for path in s.params_files if path != "params.yaml"})
    out = []
    for ws in sorted(p for p in folder.iterdir() if (p / "params.yaml").is_file()):
        params = yaml.safe_load((ws / "params.yaml").read_text()) or {}
        metrics = {path: json.loads((ws / path).read_text()) for path in metric_paths if (ws / path).is_file()}
        files = {path: yaml.safe_load((ws / path).read_text()) or {} for path in param_paths if (ws / path).is_file()}
        out.append({"name": ws.name, "params": params, "metrics": metrics, "param_files": {"params.yaml": params, **files},
                    "folder": str(ws)})
    if not out:
        raise ValueError(f"--workspaces {folder}: no experiment folder (a subfolder with a params.yaml) in it")
    return out


OUTCOME_COLUMNS = ("content_hash", "num_agents", "size", "valid", "optimal")
"""The columns of a benchmark rollout every outcome row keeps."""


def _read_parquet(repo: Path, record: dict[str, Any], path: str, columns: list[str]) -> Any:
    """``path`` of one experiment as an Arrow table: from its workspace folder, or through DVC at its revision."""
    import io

    import pyarrow.parquet as pq

    if record.get("folder"):
        return pq.read_table(Path(record["folder"]) / path, columns=columns)
    import dvc.api

    with dvc.api.open(path, repo=str(repo), rev=record.get("rev"), mode="rb") as f:
        return pq.read_table(io.BytesIO(f.read()), columns=columns)


def outcomes(repo: Path, records: list[dict[str, Any]], plan: list[Experiment], stages: list[StageFiles]) -> Any:
    """Every benchmark answer of the planned experiments, one row each: arm, seed, stage, content hash, agents, size,
    wait ratio, valid, optimal (Arrow table), so a comparison's tables and figures can be derived again; a stage whose
    rollout cannot be read (not run, not in DVC's cache) is left out."""
    import pyarrow as pa
    from dvc.exceptions import DvcException

    arms = {item.name: item for item in plan}
    tables, waits = [], None
    for rec in records:
        item = arms.get(rec["name"])
        if item is None or item.targets:
            continue
        for k in curriculum_stages(rec["params"]):
            evaluate = stage_named(stages, "evaluate", str(k))
            path = evaluate.out("benchmark.parquet") if evaluate else None
            if path is None:
                continue
            try:
                table = _read_parquet(repo, rec, path, list(OUTCOME_COLUMNS))
                if waits is None:
                    bench = next(d for d in evaluate.deps if d.endswith("instances.parquet") and "benchmark" in d)
                    rows = _read_parquet(repo, rec, bench, ["content_hash", "wait_subset"]).to_pylist()
                    waits = {r["content_hash"]: r["wait_subset"] for r in rows}
            except (OSError, StopIteration, ValueError, DvcException) as e:
                print(f"warning: {rec['name']} stage {k}: no benchmark answers ({type(e).__name__})", file=sys.stderr)
                continue
            n = table.num_rows
            tables.append(pa.table({"engineer": [item.arm] * n, "seed": [item.seed] * n, "stage": [k] * n,
                                    **{c: table.column(c) for c in OUTCOME_COLUMNS},
                                    "wait_ratio": [waits.get(h) for h in table.column("content_hash").to_pylist()]}))
    return pa.concat_tables(tables) if tables else None


def stage_config(record: dict[str, Any], stages: list[StageFiles], stage: int) -> dict[str, Any] | None:
    """The environment configuration curriculum stage ``stage`` of the experiment trained on: the params file of its
    ``generate-instances@K`` stage (written by the engineer of the stage before); None when absent."""
    generate = stage_named(stages, "generate-instances", str(stage))
    files = record.get("param_files") or {}
    for path in generate.params_files if generate else ():
        if path != "params.yaml" and files.get(path):
            return files[path]
    return None


def config_summary(config: dict[str, Any]) -> dict[str, float]:
    """A configuration in four numbers, each weighted by the share of instances of every map size: mean board side
    (``size``), hole ratio, wait ratio (share of instances that need a wait) and minimum path length."""
    sizes = {int(k): v for k, v in (config.get("sizes") or {}).items() if isinstance(v, dict)}
    total = sum(float(v.get("data_ratio", 0)) for v in sizes.values())
    if not total:
        return {}
    def mean(key: str) -> float:
        return sum(float(v.get("data_ratio", 0)) * float(v.get(key, 0)) for v in sizes.values()) / total
    return {"size": sum(float(v.get("data_ratio", 0)) * n for n, v in sizes.items()) / total,
            "hole_ratio": mean("hole_ratio"), "wait_ratio": mean("wait_ratio"), "min_path_length": mean("min_path_length")}


def curriculum_stages(params: dict[str, Any]) -> list[int]:
    """The stages of the experiment's curriculum (``params.yaml``'s ``curriculum``), in order."""
    stages = [row.get("stage") for row in params.get("curriculum") or [] if isinstance(row, dict)]
    return sorted(s for s in stages if isinstance(s, int))


def final_stage(params: dict[str, Any]) -> int | None:
    """The last stage of the experiment's curriculum, or None when it has none."""
    stages = curriculum_stages(params)
    return stages[-1] if stages else None


def last_stage_result(record: dict[str, Any], stages: list[StageFiles]) -> dict[str, float] | None:
    """The benchmark Sums of the experiment's last curriculum stage plus that stage's held-out two-agent validation
    rates (``val/valid``, ``val/optimal``), read from the metrics files ``dvc.yaml`` declares for ``evaluate@K`` and
    ``validate@K``; None when that stage has no benchmark metrics (not run, unfinished or failed)."""
    final = final_stage(record["params"])
    return None if final is None else stage_result(record, stages, final)


def stage_results(record: dict[str, Any], stages: list[StageFiles]) -> dict[int, dict[str, float]]:
    """:func:`stage_result` of every curriculum stage of the experiment that has one, by stage."""
    results = {k: stage_result(record, stages, k) for k in curriculum_stages(record["params"])}
    return {k: r for k, r in results.items() if r is not None}


def stage_result(record: dict[str, Any], stages: list[StageFiles], stage: int) -> dict[str, float] | None:
    """Curriculum stage ``stage``'s benchmark Sums (and per map size, ``size/...``) and held-out two-agent validation
    rates of the experiment; None when that stage has no benchmark metrics."""
    evaluate = stage_named(stages, "evaluate", str(stage))
    if evaluate is None or not evaluate.metrics or not record["metrics"].get(evaluate.metrics[0]):
        return None
    data = record["metrics"][evaluate.metrics[0]]
    out = dict(data.get("bench") or {})
    out.update({f"size/{key}": value for key, value in (data.get("bench_size") or {}).items()})
    validate = stage_named(stages, "validate", str(stage))
    validation = (record["metrics"].get(validate.metrics[0]) or {}).get("validation") if validate and validate.metrics else None
    for key in ("valid", "optimal"):
        if validation and validation.get(key) is not None:
            out[f"val/{key}"] = validation[key]
    return out


def aggregate(records: list[dict[str, Any]], plan: list[Experiment], stages: list[StageFiles],
              reference: str | None = "fixed") -> dict[str, Any]:
    """Per arm: its seeds and, per metric, mean and 95% interval across seeds (last stage); the same per curriculum
    stage for the headline metrics (``stages``: the curve across stages); the configuration each stage trained on,
    summarised (:func:`config_summary`) and averaged across seeds (``configs``); and, for every arm but
    ``reference``, the difference from ``reference`` paired by seed (the same seeds, hence the same stage 0 and data
    draws), with its 95% t-interval across seeds (``vs_reference``). Only experiments that finished their last stage
    count, so every arm is compared at equal budget."""
    arms = {item.name: item.arm for item in plan}
    values: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    by_seed: dict[str, dict[str, dict[Any, float]]] = defaultdict(lambda: defaultdict(dict))
    per_stage: dict[str, dict[int, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    chosen: dict[str, dict[int, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    seeds: dict[str, list[int]] = defaultdict(list)
    for rec in records:
        arm = arms.get(rec["name"])
        per = stage_results(rec, stages) if arm else {}
        result = per.get(final_stage(rec["params"]))
        if arm is None or result is None:
            continue
        seed = rec["params"].get("train", {}).get("seed")
        seeds[arm].append(seed)
        for key, value in result.items():
            values[arm][key].append(float(value))
            by_seed[arm][key][seed] = float(value)
        for k, stage in per.items():
            for key, value in stage.items():
                if not key.startswith(("size/", "se/")):
                    per_stage[arm][k][key].append(float(value))
            config = stage_config(rec, stages, k)
            for key, value in (config_summary(config) if config else {}).items():
                chosen[arm][k][key].append(value)
    table = {arm: {"seeds": sorted(seeds[arm]), "metrics": {k: mean_ci(v) for k, v in sorted(ms.items())},
                   "stages": {str(k): {key: mean_ci(v) for key, v in sorted(m.items())}
                              for k, m in sorted(per_stage[arm].items())},
                   "configs": {str(k): {key: mean_ci(v) for key, v in m.items()} for k, m in sorted(chosen[arm].items())}}
             for arm, ms in values.items()}
    if reference in by_seed:
        for arm, row in table.items():
            if arm == reference:
                continue
            row["vs_reference"] = {"reference": reference, "metrics": {}}
            for key, per_seed in sorted(by_seed[arm].items()):
                common = sorted(set(per_seed) & set(by_seed[reference].get(key, {})))
                if common:
                    diffs = [per_seed[s] - by_seed[reference][key][s] for s in common]
                    row["vs_reference"]["metrics"][key] = {**mean_ci(diffs), "seeds": common}
    return table


def missing(records: list[dict[str, Any]], plan: list[Experiment], stages: list[StageFiles]) -> list[str]:
    """Planned experiments with no final-stage results among ``records``."""
    found = {rec["name"] for rec in records if last_stage_result(rec, stages) is not None}
    return [item.name for item in plan if item.name not in found]
