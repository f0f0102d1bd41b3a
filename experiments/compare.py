"""Engineer comparison through DVC experiments: equal budgets, several seeds, means with 95% confidence intervals.

``env-engineer compare --engineers policy,base,heuristic,random,fixed,plr,alp,learnability --seeds 0,1,2 --run --jobs 2``
queues one DVC experiment per (engineer, seed) (``dvc exp run --queue -n cmp-<engineer>-s<seed> -S engineer.engineer=...
-S train.seed=... -S env.seed=... -S engineer.seed=...``, :func:`experiments.plan.comparison_plan`: every other knob is
the workspace's, so budgets are equal), runs
the queue with ``dvc queue start -j N``, waits for it, and builds the table from ``dvc exp show``. With ``--via prefect``
each experiment is instead a run of the Prefect deployment of the ``curriculum`` flow (``dvc exp run --temp -n NAME
-S ...``), taken by whichever worker of the pool is free (``env-engineer workers --gpus 0,1``: one worker per GPU), so
the comparison shows in the Prefect UI and spreads over the GPUs; a flow run that crashed (its worker's process died)
is submitted once more, and why each failed run failed is printed; the results are read back the same way. Without ``--run`` it
only collects the experiments already there; with ``--workspaces DIR`` it reads them from copies of their
workspaces instead (a run stopped before DVC saved its experiments). ``--contexts`` compares context variants of the ``policy`` engineer
instead (the paper's ablation).

First, once, in the workspace, the stages no experiment changes (the starting policy, the held-out sets:
:func:`experiments.plan.seed_free_stages`); then two waves: per seed, a short experiment (``shared-cmp-...``, removed
afterwards) that runs only the stages every engineer of that seed shares (everything before the engineers' first
decision), then every experiment at once, each restoring those stages from DVC's run-cache. The plan and its waves:
:mod:`experiments.plan`; how they run: :mod:`experiments.runner`; what is read back and aggregated:
:mod:`experiments.records`.
Each queued experiment's stages run in processes of their own; with ``ENV_ENGINEER_GPUS`` set (:mod:`policy.devices`)
each claims a GPU of that pool, or shares them (``ENV_ENGINEER_GPU_SLOTS``).

The aggregate is over each experiment's last curriculum stage: its benchmark Sums (``acc/<A>_agents``,
``opt/<A>_agents``) and its two-agent validation rates (``val/valid``, ``val/optimal``), found through the metrics files
``dvc.yaml`` declares for ``evaluate@K`` and ``validate@K``: mean and a 95% t-interval across seeds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from envgen.core.files import atomic_write_text
from experiments import warm_engine
from experiments.dvc import DvcError, experiments_shown, pipeline_stages
from experiments.plan import comparison_plan
from experiments.records import aggregate, experiment_records, missing, outcomes, workspace_records
from experiments.runner import QueueStalled, add_commit_argument, run_plan
from pipeline.params import ParamsError, load_params, parse_overrides


def _cell(m: dict[str, float] | None, sign: bool = False) -> str:
    if m is None:
        return ""
    if m["ci95"] is None:
        return f"{100 * m['mean']:{'+' if sign else ''}.1f} (one seed)"
    return f"{100 * m['mean']:{'+' if sign else ''}.1f} ± {100 * m['ci95']:.1f}"


def render(table: dict[str, Any]) -> str:
    """The comparison as markdown (percent, mean ± 95% half-width): the headline metrics per engineer; the differences
    from the reference engineer paired by seed; the valid rate per map size."""
    every = sorted({k for arm in table.values() for k in arm["metrics"]})
    keys = [k for k in every if not k.startswith(("size/", "se/"))]
    lines = ["| engineer | seeds | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    from engineers.registry import UPPER_BOUNDS

    for arm, row in table.items():
        cells = [_cell(row["metrics"].get(k)) for k in keys]
        label = f"{arm} (upper bound)" if arm in UPPER_BOUNDS else arm
        lines.append(f"| {label} | {len(row['seeds'])} | " + " | ".join(cells) + " |")
    lines.append("\nValues: percent, mean ± 95% t-interval half-width across seeds (last stage; acc/opt: benchmark "
                 "Sums per agent count, val: the two-agent validation set).")
    if UPPER_BOUNDS & set(table):
        lines.append("An upper bound replays a sequence of configurations chosen in advance (engineer.replay, e.g. the "
                     "sensitivity study's best): the most an engineer could gain, not an engineer.")
    paired = {arm: row["vs_reference"] for arm, row in table.items() if row.get("vs_reference")}
    if paired:
        reference = next(iter(paired.values()))["reference"]
        diff_keys = [k for k in keys if k.startswith(("acc/", "val/valid"))]
        lines += ["", f"Difference from `{reference}`, paired by seed (points, mean ± 95% t-interval across seeds):", "",
                  "| engineer | seeds | " + " | ".join(diff_keys) + " |", "|---|---|" + "---|" * len(diff_keys)]
        for arm, d in paired.items():
            n = max((m["n"] for m in d["metrics"].values()), default=0)
            lines.append(f"| {arm} | {n} | " + " | ".join(_cell(d["metrics"].get(k), sign=True) for k in diff_keys) + " |")
    staged = {arm: row["stages"] for arm, row in table.items() if row.get("stages")}
    if staged:
        numbers = sorted({int(k) for st in staged.values() for k in st})
        curve_keys = [k for k in keys if k.startswith(("acc/", "val/valid"))]
        lines += ["", "Across stages (percent, mean ± 95% t-interval across seeds; stage 0 is the first after the start):"]
        for key in curve_keys:
            lines += ["", f"`{key}`", "", "| engineer | " + " | ".join(f"stage {k}" for k in numbers) + " |",
                      "|---|" + "---|" * len(numbers)]
            for arm, st in staged.items():
                lines.append(f"| {arm} | " + " | ".join(_cell(st.get(str(k), {}).get(key)) for k in numbers) + " |")
    chosen = {arm: row["configs"] for arm, row in table.items() if row.get("configs")}
    if chosen:
        numbers = sorted({int(k) for c in chosen.values() for k in c})
        lines += ["", "The environment each stage trained on (means across seeds, weighted by each size's share: board "
                  "side, hole ratio, wait ratio):", "", "| engineer | " + " | ".join(f"stage {k}" for k in numbers) + " |",
                  "|---|" + "---|" * len(numbers)]
        for arm, c in chosen.items():
            cells = []
            for k in numbers:
                m = c.get(str(k))
                cells.append(f"{m['size']['mean']:.1f} / {m['hole_ratio']['mean']:.2f} / {m['wait_ratio']['mean']:.2f}"
                             if m and {"size", "hole_ratio", "wait_ratio"} <= set(m) else "")
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    sizes = [k for k in every if k.startswith("size/")]
    if sizes:
        names = [k.removeprefix("size/") for k in sizes]
        lines += ["", "Valid rate per map size (percent, mean ± 95% t-interval across seeds):", "",
                  "| engineer | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for arm, row in table.items():
            lines.append(f"| {arm} | " + " | ".join(_cell(row["metrics"].get(k)) for k in sizes) + " |")
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engineers", default="policy,base,heuristic,random,fixed,plr,alp,learnability",
                        help="comma-separated engineers (oracle too, with engineer.replay set: an upper bound)")
    parser.add_argument("--contexts", default=None, help="compare these context variants of the policy engineer instead")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (at least 3 for an interval)")
    parser.add_argument("--run", action="store_true", help="queue the experiments not yet there, run the queue and wait "
                        "(else only collect what `dvc exp show` has)")
    parser.add_argument("--jobs", type=int, default=1, help="with --run: experiments at once (`dvc queue start -j`)")
    parser.add_argument("--via", choices=("dvc-queue", "prefect"), default="dvc-queue",
                        help="with --run: DVC's own queue (default), or flow runs of a Prefect deployment that the "
                        "pool's workers take (`env-engineer workers --gpus 0,1`: one per GPU), each a `dvc exp run --temp`")
    parser.add_argument("--deployment", default="curriculum/curriculum",
                        help="with --via prefect: the deployment of the curriculum flow (prefect.yaml)")
    add_commit_argument(parser)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="extra parameter for every experiment (as `dvc exp run -S`)")
    parser.add_argument("--reference", default="fixed",
                        help="the arm every other is compared with, paired by seed (default fixed)")
    parser.add_argument("--repo", type=Path, default=Path("."), help="the DVC repository (default: here)")
    parser.add_argument("--workspaces", type=Path, default=None, metavar="DIR",
                        help="read the experiments from DIR's subfolders (one per experiment, named cmp-ENGINEER-sSEED, "
                        "each a workspace: params.yaml and the files dvc.yaml declares) instead of `dvc exp show`; "
                        "for a run stopped before DVC saved its experiments")
    parser.add_argument("--out-json", type=Path, default=Path("comparison.json"),
                        help="the table, and what ran on what (commit, settings, wall time, GPUs); every benchmark "
                        "answer's outcome goes beside it as NAME.outcomes.parquet")
    parser.add_argument("--out-md", type=Path, default=Path("comparison.md"))
    warm_engine.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from engineers.llm import CONTEXTS
    from engineers.registry import ENGINEERS

    try:
        engineers = [e.strip() for e in args.engineers.split(",") if e.strip()]
        contexts = [c.strip() for c in args.contexts.split(",")] if args.contexts else None
        seeds = [int(s) for s in args.seeds.split(",")]
        bad = [e for e in engineers if e not in ENGINEERS] + [c for c in contexts or [] if c not in CONTEXTS]
        if bad:
            raise ValueError(f"unknown engineer/context {bad}; engineers {sorted(ENGINEERS)}, contexts {sorted(CONTEXTS)}")
        if args.run and args.workspaces:
            raise ValueError("--run and --workspaces: give one (--workspaces only reads experiments already run)")
        if args.jobs < 1:
            raise ValueError(f"--jobs {args.jobs}: must be at least 1")
        extra = parse_overrides(args.set)
        engine = warm_engine.from_arguments(args, load_params(args.repo / "params.yaml", extra), extra,
                                            args.out_json.with_suffix(".serve.log"))
        trainer = warm_engine.trainer_from_arguments(args, extra, args.out_json.with_suffix(".train.log"))
        extra = {**extra, **(engine.overrides() if engine else {}), **(trainer.overrides() if trainer else {})}
        plan = comparison_plan(engineers, seeds, contexts)
        for item in plan:  # every experiment's parameters are checked before anything is queued
            load_params(args.repo / "params.yaml", {**item.sets, **extra})
        stages = pipeline_stages(args.repo)
        with warm_engine.serving(engine, trainer) as ready:
            ran = (run_plan(args.repo, plan, extra, stages, args.jobs, args.via, args.deployment, args.commit, ready)
                   if args.run else None)
        if args.workspaces:
            records = workspace_records(args.workspaces, stages)
        else:
            records = experiment_records(experiments_shown(args.repo))
        table = aggregate(records, plan, stages, args.reference)
        absent = missing(records, plan, stages)
        if absent:
            print(f"warning: no results for {', '.join(absent)} at this commit: experiments belong to the commit they "
                  "started from (`dvc exp list -A` lists all; `dvc queue logs NAME` says why one failed); run them "
                  "with --run", file=sys.stderr)
    except (ValueError, ParamsError, KeyError, OSError, DvcError, json.JSONDecodeError, QueueStalled,
            warm_engine.WarmEngineError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = {"commit": git_commit(args.repo), "engineers": engineers, "seeds": seeds, "contexts": contexts,
            "set": args.set, "reference": args.reference, "via": args.via, "jobs": args.jobs, "serve": args.serve, "warm_trainers": args.warm_trainers,
            "params": load_params(args.repo / "params.yaml", extra).model_dump(mode="json"), **(ran or {})}
    answers = outcomes(args.repo, records, plan, stages)
    if answers is not None:
        import pyarrow.parquet as pq

        path = args.out_json.with_suffix(".outcomes.parquet")
        tmp = path.with_suffix(".tmp")
        pq.write_table(answers, tmp)
        tmp.replace(path)
        print(f"{answers.num_rows} benchmark answers' outcomes in {path}")
    atomic_write_text(args.out_json, json.dumps({"run": meta, "arms": table}, indent=2))
    atomic_write_text(args.out_md, render(table))
    print(render(table))
    return 0


def git_commit(repo: Path) -> str | None:
    """The commit checked out in ``repo`` (None outside git)."""
    import subprocess

    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True)
    return out.stdout.strip() or None if out.returncode == 0 else None
