"""Engineer comparison through DVC experiments: equal budgets, several seeds, means with 95% confidence intervals.

``env-engineer compare --engineers policy,base,heuristic,random,fixed --seeds 0,1,2 --run`` runs one DVC experiment per
(engineer, seed) (``dvc exp run --temp -n cmp-<engineer>-s<seed> -S engineer.engineer=... -S train.seed=... -S env.seed=...
-S engineer.seed=...``): every knob but the engineer and the seed is the workspace's, so budgets are equal. Without
``--run`` it only collects the experiments already there. ``--contexts`` compares context variants of the ``policy``
engineer instead (the paper's ablation). The aggregate is over each experiment's last stage's benchmark metrics
(``bench/acc/<A>_agents``, ``bench/opt/<A>_agents``) and its validation rates (``val/valid``, ``val/optimal``): mean
and a 95% t-interval across seeds.

``--without-dvc FOLDER`` runs the same plan as run folders with ``env-engineer run-stages`` (``tasks/stages.py``), for
machines without DVC, such as a GPU worker; the table is computed the same way. Finished folders are never rerun (an
archive of them, without datasets and adapters, resumes a comparison on another machine: :func:`prune_unfinished`), and
an experiment counts in the table only once its curriculum's last stage has been evaluated.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from envgen.files import atomic_write_text

# Two-sided 95% Student t quantiles by degrees of freedom (1..30); 1.96 beyond.
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def mean_ci(values: list[float]) -> dict[str, float]:
    """Mean and the 95% t-interval half-width (0 for a single value)."""
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return {"mean": mean, "ci95": 0.0, "n": n}
    t = _T95[n - 2] if n - 1 <= len(_T95) else 1.96
    return {"mean": mean, "ci95": t * statistics.stdev(values) / math.sqrt(n), "n": n}


def experiment_plan(engineers: list[str], seeds: list[int], contexts: list[str] | None = None) -> list[dict[str, Any]]:
    plan = []
    arms = [("policy", c) for c in contexts] if contexts else [(e, None) for e in engineers]
    for engineer, context in arms:
        for seed in seeds:
            name = f"cmp-{engineer if context is None else 'ctx-' + context}-s{seed}"
            sets = {"engineer.engineer": engineer, "train.seed": seed, "env.seed": seed, "engineer.seed": seed}
            if context is not None:
                sets["engineer.context"] = context
            plan.append({"name": name, "arm": engineer if context is None else f"policy/{context}", "seed": seed, "set": sets})
    return plan


def run_plan(plan: list[dict[str, Any]], repo: Path, extra: dict[str, Any] | None = None) -> None:
    from tasks.tools import tool_env

    env = tool_env()
    for item in plan:
        args = ["dvc", "exp", "run", "--temp", "-n", item["name"], "--force"]  # --temp: the workspace stays as it is
        for key, value in {**item["set"], **(extra or {})}.items():
            args += ["-S", f"{key}={json.dumps(value)}"]
        print(f"running experiment {item['name']}", flush=True)
        proc = subprocess.run(args, cwd=repo, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")


def waves(plan: list[dict[str, Any]], done: set[str] | frozenset[str] = frozenset()) -> list[list[dict[str, Any]]]:
    """The plan less the experiments in ``done``, in two waves: the first remaining experiment of each seed, then the
    rest, so that the stages every engineer of a seed shares (everything before the first engineer's decision) run once
    and are reused from the stage cache."""
    todo = [item for item in plan if item["name"] not in done]
    first: dict[Any, dict[str, Any]] = {}
    for item in todo:
        first.setdefault(item["seed"], item)
    rest = [item for item in todo if first[item["seed"]] is not item]
    return [w for w in (list(first.values()), rest) if w]


def prune_unfinished(root: Path | str) -> list[str]:
    """Remove the unfinished run folders under ``root`` (an archive of earlier runs holds their markers but not their
    datasets and adapters, so they could not resume) and return the names of those kept; prints each decision."""
    import shutil

    from tasks.stages import finished

    kept = []
    for folder in sorted(Path(root).glob("cmp-*")):
        if finished(folder):
            kept.append(folder.name)
            print(f"{folder.name}: finished, kept")
        else:
            shutil.rmtree(folder)
            print(f"{folder.name}: unfinished, dropped")
    return kept


def run_folders(plan: list[dict[str, Any]], repo: Path, root: Path, extra: dict[str, Any], run: bool,
                validate: bool, jobs: int = 1, devices: list[str] | None = None) -> list[dict[str, Any]]:
    """The plan as run folders ``root/<name>`` (``env-engineer run-stages``; run first with ``run``, resuming any
    folder left unfinished; identical stages, such as those before the engineers' first decision for one seed, run
    once through ``root/.stage-cache``), and their records in :func:`experiment_records`' shape.

    ``jobs`` experiments run at once, each on its own device from ``devices`` (``CUDA_VISIBLE_DEVICES`` values; default
    0..jobs-1); a failed experiment is reported and the others go on."""
    import queue
    from concurrent.futures import ThreadPoolExecutor

    from tasks.stages import finished, folder_record, run_stages

    if jobs < 1:
        raise ValueError(f"--jobs {jobs}: must be at least 1")
    devices = devices or [str(i) for i in range(jobs)]
    if len(devices) < jobs:
        raise ValueError(f"--devices {','.join(devices)}: fewer than --jobs {jobs}")
    free: queue.Queue[str] = queue.Queue()
    for device in devices[:jobs]:
        free.put(device)
    failures: list[str] = []

    def one(item: dict[str, Any]) -> None:
        device = free.get()
        try:
            print(f"running experiment {item['name']} in {root / item['name']}"
                  + (f" on device {device}" if jobs > 1 else ""), flush=True)
            env = {"CUDA_VISIBLE_DEVICES": device} if jobs > 1 else None
            run_stages(repo.resolve(), (root / item["name"]).resolve(), {**item["set"], **extra}, validate=validate,
                       cache=(root / ".stage-cache").resolve(), env=env)
        except (RuntimeError, ValueError, KeyError, OSError) as e:
            failures.append(f"{item['name']}: {e}")
            print(f"experiment {item['name']} failed: {e}", file=sys.stderr, flush=True)
        finally:
            free.put(device)

    if run:
        done = {item["name"] for item in plan if finished(root / item["name"])}
        for wave in waves(plan, done):
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                list(pool.map(one, wave))
    records = [folder_record(item["name"], root / item["name"]) for item in plan
               if (root / item["name"] / "params.yaml").exists()]
    if failures:
        print(f"{len(failures)} experiments failed (rerun with --run to resume them)", file=sys.stderr)
    return records


def experiment_records(show: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Name, params and metrics of every experiment in ``dvc exp show --json`` output."""
    out = []
    for baseline in show:
        for exp in baseline.get("experiments") or []:
            for rev in exp.get("revs") or []:
                data = rev.get("data") or {}
                params = ((data.get("params") or {}).get("params.yaml") or {}).get("data") or {}
                metrics = {path: (m or {}).get("data") or {} for path, m in (data.get("metrics") or {}).items()}
                out.append({"name": rev.get("name") or exp.get("name"), "params": params, "metrics": metrics})
    return out


def final_stage(params: dict[str, Any]) -> int | None:
    """The last stage of the experiment's curriculum (``params.yaml``'s ``curriculum``), or None when it has none."""
    stages = [row.get("stage") for row in params.get("curriculum") or [] if isinstance(row, dict)]
    stages = [s for s in stages if isinstance(s, int)]
    return max(stages) if stages else None


def last_stage_bench(metrics: dict[str, dict[str, Any]], params: dict[str, Any] | None = None) -> dict[str, float] | None:
    """The last stage's benchmark Sums (``acc/<A>_agents``, ``opt/<A>_agents``) plus its held-out two-agent validation
    rates (``val/valid``, ``val/optimal``: the training distribution's own test, where small budgets already show), or
    None when no stage has benchmark metrics. With ``params``, the last stage is the curriculum's: an experiment that
    stopped before evaluating it (a run folder cut off mid-way) gives None, not an earlier stage's numbers."""
    stages = [(int(m.group(1)), path) for path in metrics if (m := re.search(r"stages/(\d+)/benchmark_metrics\.json$", path))]
    if not stages:
        return None
    stage, path = max(stages)
    final = final_stage(params or {})
    if final is not None and stage != final:
        return None
    out = dict(metrics[path].get("bench") or {})
    validation = next((m.get("validation") for p, m in metrics.items()
                       if re.search(rf"stages/{stage}/validation_metrics\.json$", p)), None)
    for key in ("valid", "optimal"):
        if validation and validation.get(key) is not None:
            out[f"val/{key}"] = validation[key]
    return out


def aggregate(records: list[dict[str, Any]], plan: list[dict[str, Any]]) -> dict[str, Any]:
    arms = {item["name"]: item["arm"] for item in plan}
    values: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    seeds: dict[str, list[int]] = defaultdict(list)
    for rec in records:
        arm = arms.get(rec["name"])
        bench = last_stage_bench(rec["metrics"], rec["params"]) if arm else None
        if arm is None or bench is None:
            continue
        seeds[arm].append(rec["params"].get("train", {}).get("seed"))
        for key, value in bench.items():
            values[arm][key].append(float(value))
    return {arm: {"seeds": sorted(seeds[arm]), "metrics": {k: mean_ci(v) for k, v in sorted(ms.items())}}
            for arm, ms in values.items()}


def missing(records: list[dict[str, Any]], plan: list[dict[str, Any]]) -> list[str]:
    """Planned experiments with no final-stage benchmark metrics among ``records`` (not run, unfinished, failed, or run
    from another commit)."""
    found = {rec["name"] for rec in records if last_stage_bench(rec["metrics"], rec["params"]) is not None}
    return [item["name"] for item in plan if item["name"] not in found]


def render(table: dict[str, Any]) -> str:
    keys = sorted({k for arm in table.values() for k in arm["metrics"]})
    lines = ["| engineer | seeds | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for arm, row in table.items():
        cells = []
        for k in keys:
            m = row["metrics"].get(k)
            cells.append("" if m is None else f"{100 * m['mean']:.1f} ± {100 * m['ci95']:.1f}")
        lines.append(f"| {arm} | {len(row['seeds'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + ("\n\nValues: percent, mean ± 95% t-interval half-width across seeds (last stage; acc/opt: "
                                "benchmark Sums per agent count, val: the two-agent validation set).\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engineers", default="policy,base,heuristic,random,fixed", help="comma-separated engineers")
    parser.add_argument("--contexts", default=None, help="compare these context variants of the policy engineer instead")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (at least 3 for an interval)")
    parser.add_argument("--run", action="store_true", help="run the experiments (else only collect existing ones)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra parameter for every run")
    parser.add_argument("--repo", type=Path, default=Path("."), help="the DVC repository (default: here)")
    parser.add_argument("--without-dvc", type=Path, default=None, metavar="FOLDER",
                        help="run and collect the experiments as run folders FOLDER/<name> with `env-engineer "
                        "run-stages` instead of DVC experiments (machines without DVC)")
    parser.add_argument("--no-validate", action="store_true", help="with --without-dvc: skip great-expectations checks")
    parser.add_argument("--jobs", type=int, default=1, help="with --without-dvc: experiments at once, one GPU each")
    parser.add_argument("--devices", default=None, help="with --jobs: CUDA_VISIBLE_DEVICES values, comma-separated "
                        "(default 0..jobs-1)")
    parser.add_argument("--out-json", type=Path, default=Path("comparison.json"))
    parser.add_argument("--out-md", type=Path, default=Path("comparison.md"))


def run(args: argparse.Namespace) -> int:
    from tasks.engineers import CONTEXTS, ENGINEERS
    from tasks.tools import parse_overrides, tool_env

    try:
        engineers = [e.strip() for e in args.engineers.split(",") if e.strip()]
        contexts = [c.strip() for c in args.contexts.split(",")] if args.contexts else None
        seeds = [int(s) for s in args.seeds.split(",")]
        bad = [e for e in engineers if e not in ENGINEERS] + [c for c in contexts or [] if c not in CONTEXTS]
        if bad:
            raise ValueError(f"unknown engineer/context {bad}; engineers {sorted(ENGINEERS)}, contexts {sorted(CONTEXTS)}")
        plan = experiment_plan(engineers, seeds, contexts)
        if args.without_dvc is not None:
            devices = [d.strip() for d in args.devices.split(",")] if args.devices else None
            records = run_folders(plan, args.repo, args.without_dvc, parse_overrides(args.set), args.run,
                                  not args.no_validate, args.jobs, devices)
        else:
            if args.run:
                run_plan(plan, args.repo, parse_overrides(args.set))
            shown = subprocess.run(["dvc", "exp", "show", "--json"], cwd=args.repo, env=tool_env(), capture_output=True,
                                   text=True, check=True)
            records = experiment_records(json.loads(shown.stdout))
        table = aggregate(records, plan)
        absent = missing(records, plan)
        if absent and args.without_dvc is not None:
            print(f"warning: no benchmark results for {', '.join(absent)} under {args.without_dvc}; run them with --run "
                  "(an unfinished folder resumes)", file=sys.stderr)
        elif absent:
            print(f"warning: no results for {', '.join(absent)} at this commit: experiments belong to the commit they "
                  "started from (a commit made during a comparison hides the earlier ones; `dvc exp list -A` lists all); "
                  "run them again with --run", file=sys.stderr)
    except (ValueError, KeyError, OSError, RuntimeError, subprocess.CalledProcessError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    atomic_write_text(args.out_json, json.dumps(table, indent=2))
    atomic_write_text(args.out_md, render(table))
    print(render(table))
    return 0
