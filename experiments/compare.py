"""Engineer comparison through DVC experiments: equal budgets, several seeds, means with 95% confidence intervals.

``env-engineer compare --engineers policy,base,heuristic,random,fixed,plr,alp,learnability --seeds 0,1,2 --run --jobs 2``
queues one DVC experiment per (engineer, seed) (``dvc exp run --queue -n cmp-<engineer>-s<seed> -S engineer.engineer=...
-S train.seed=... -S env.seed=... -S engineer.seed=...``: every other knob is the workspace's, so budgets are equal), runs
the queue with ``dvc queue start -j N``, waits for it, and builds the table from ``dvc exp show``. With ``--via prefect``
each experiment is instead a run of the Prefect deployment of the ``curriculum`` flow (``dvc exp run --temp -n NAME
-S ...``), taken by whichever worker of the pool is free (``env-engineer workers --gpus 0,1``: one worker per GPU), so
the comparison shows in the Prefect UI and spreads over the GPUs; a flow run that crashed (its worker's process died)
is submitted once more, and why each failed run failed is printed; the results are read back the same way. Without ``--run`` it
only collects the experiments already there; with ``--workspaces DIR`` it reads them from copies of their
workspaces instead (a run stopped before DVC saved its experiments). ``--contexts`` compares context variants of the ``policy`` engineer
instead (the paper's ablation).

First, once, in the workspace, the stages no experiment changes (the starting policy, the held-out sets:
:func:`seed_free_stages`); then two waves: per seed, a short experiment (``cmp-shared-s<seed>``, removed afterwards)
that runs only the stages every engineer of that seed shares (everything before the engineers' first decision), then
every experiment at once, each restoring those stages from DVC's run-cache. How the waves run:
:mod:`experiments.runner`; what is read back and aggregated: :mod:`experiments.records`.
Each queued experiment's stages run in processes of their own; with ``ENV_ENGINEER_GPUS`` set (:mod:`policy.devices`)
each claims a GPU of that pool, or shares them (``ENV_ENGINEER_GPU_SLOTS``).

The aggregate is over each experiment's last curriculum stage: its benchmark Sums (``acc/<A>_agents``,
``opt/<A>_agents``) and its two-agent validation rates (``val/valid``, ``val/optimal``), found through the metrics files
``dvc.yaml`` declares for ``evaluate@K`` and ``rollout@K``: mean and a 95% t-interval across seeds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from envgen.core.files import atomic_write_text
from experiments.dvc import DvcError, StageFiles, dvc, experiments_shown, pipeline_stages
from experiments.records import aggregate, experiment_records, last_stage_result, missing, outcomes, workspace_records
from experiments.runner import QueueStalled, run_flow_runs, run_wave_in_queue
from pipeline.params import ParamsError, load_params, parse_overrides


def experiment_plan(engineers: list[str], seeds: list[int], contexts: list[str] | None = None) -> list[dict[str, Any]]:
    """One experiment per (engineer or context, seed): its name, arm, seed and parameter overrides."""
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


SHARED_PREFIX = "cmp-shared-s"
"""Name prefix of the short experiments that run a seed's shared stages (``cmp-shared-s<seed>``), removed after."""


def shared_stages(stages: list[StageFiles]) -> list[str]:
    """The stages every engineer of a seed runs alike: those of the first curriculum item except its engineer's
    (``engineer-config``, the first decision); DVC runs what they depend on with them."""
    first = next((s.item for s in stages if s.item is not None), None)
    return [s.name for s in stages if first is not None and s.item == first and s.step != "engineer-config"]


def seed_free_stages(stages: list[StageFiles], keys: list[str] | tuple[str, ...]) -> list[str]:
    """The stages outside the curriculum's ``foreach`` loops that read none of ``keys`` (the parameters the
    experiments set: engineer and seeds) and depend on no stage that does: the same in every experiment (the starting
    policy, the validation set, the benchmark). The comparison runs them once, in the workspace, before it queues
    anything, so each experiment finds them done instead of running them again (the starting policy's outputs are in
    git, which DVC's run-cache does not restore)."""
    def reads(stage: StageFiles) -> bool:
        return any(k == p or k.startswith(p + ".") or p.startswith(k + ".") for k in keys for p in stage.params_keys)

    free: set[str] = set()
    for s in stages:  # each after the stages it depends on
        if s.item is None and not reads(s) and all(u in free for u in s.upstream):
            free.add(s.name)
    return [s.name for s in stages if s.name in free]


def waves(plan: list[dict[str, Any]], done: set[str] | frozenset[str] = frozenset(),
          shared: list[str] | tuple[str, ...] = ()) -> list[list[dict[str, Any]]]:
    """The plan less the experiments in ``done``, in two waves, so that the stages every engineer of a seed shares run
    once and the others restore them from DVC's run-cache. With ``shared`` (:func:`shared_stages`): first a short
    experiment per seed that runs only those stages (``targets``; named ``cmp-shared-s<seed>``), then every remaining
    experiment at once. Without: the first remaining experiment of each seed, whole, then the rest."""
    todo = [item for item in plan if item["name"] not in done]
    first: dict[Any, dict[str, Any]] = {}
    for item in todo:
        first.setdefault(item["seed"], item)
    if shared:
        prefix = [{**item, "name": f"{SHARED_PREFIX}{seed}", "arm": None, "targets": list(shared)}
                  for seed, item in first.items()]
        return [w for w in (prefix, todo) if w]
    rest = [item for item in todo if first[item["seed"]] is not item]
    return [w for w in (list(first.values()), rest) if w]


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


def run_experiments(args: argparse.Namespace, plan: list[dict[str, Any]], extra: dict[str, Any],
                    stages: list[StageFiles]) -> dict[str, Any]:
    """``--run``: the stages no experiment changes once in the workspace (:func:`seed_free_stages`), then the plan's
    unfinished experiments wave by wave (:func:`waves`) through DVC's queue or Prefect; returns what ran on what:
    wall seconds, the GPUs (kind, count) and how busy they were."""
    from experiments.machine import BusySampler, describe_gpus

    began = time.monotonic()
    with BusySampler() as busy:
        done = {rec["name"] for rec in experiment_records(experiments_shown(args.repo))
                if last_stage_result(rec, stages) is not None}
        common = seed_free_stages(stages, sorted({k for item in plan for k in item["set"]} | set(extra)))
        if common and len(done) < len(plan):
            print(f"{time.strftime('%H:%M:%S')} in the workspace, the stages every experiment shares: "
                  f"{', '.join(common)}", flush=True)
            dvc(["repro", *common], args.repo)
        for number, wave in enumerate(waves(plan, done, shared_stages(stages)), 1):
            wave_began = time.monotonic()
            print(f"{time.strftime('%H:%M:%S')} wave {number}: {len(wave)} experiment(s)", flush=True)
            if args.via == "prefect":
                states = run_flow_runs(args.deployment, wave, extra, repo=args.repo)
            else:
                states = run_wave_in_queue(args.repo, args.jobs, wave, extra)
            failed = [name for name, state in states.items() if state == "Failed"]
            if failed:
                where = "the flow runs' logs in Prefect show why" if args.via == "prefect" else "`dvc queue logs NAME` shows why"
                print(f"failed: {', '.join(failed)} ({where})", file=sys.stderr, flush=True)
            print(f"{time.strftime('%H:%M:%S')} wave {number} done in {time.monotonic() - wave_began:.0f} s", flush=True)
            scaffolding = [item["name"] for item in wave if item.get("targets")]
            if scaffolding:  # their stages are in the run-cache now; the experiments themselves are no result
                try:
                    dvc(["exp", "remove", *scaffolding], args.repo)
                except DvcError as e:
                    print(f"warning: could not remove {', '.join(scaffolding)}: {e}", file=sys.stderr, flush=True)
    return {"wall_s": round(time.monotonic() - began, 1), "gpus": describe_gpus(), "gpu_busy": busy.summary()}


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
        plan = experiment_plan(engineers, seeds, contexts)
        for item in plan:  # every experiment's parameters are checked before anything is queued
            load_params(args.repo / "params.yaml", {**item["set"], **extra})
        stages = pipeline_stages(args.repo)
        ran = run_experiments(args, plan, extra, stages) if args.run else None
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
    except (ValueError, ParamsError, KeyError, OSError, DvcError, json.JSONDecodeError, QueueStalled) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = {"commit": git_commit(args.repo), "engineers": engineers, "seeds": seeds, "contexts": contexts,
            "set": args.set, "reference": args.reference, "via": args.via, "jobs": args.jobs,
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
