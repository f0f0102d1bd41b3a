"""How much the environment can matter: the pipeline run under hand-set environment configurations, or sequences
of them, as DVC experiments through the comparison's runner, every run scored on the same benchmark answers.

``env-engineer sensitivity --configs presets/sensitivity/*.yaml 'a.yaml+b.yaml+c.yaml' --seeds 0,1,2 --run --jobs 6
--out reports/sensitivity.json`` plans one experiment per (configuration or sequence, seed)
(:func:`experiments.plan.sensitivity_plan`, named ``sens-<label>-s<seed>``): stage 0 trains on the first configuration
(params ``env``), stage ``k`` on the ``k``-th, replayed by the ``oracle`` engineer
(``engineer.replay``), with as many curriculum stages as the sequence has; every other knob is the workspace's
``params.yaml`` (the per-stage budget is its ``train`` section and the configurations' budget; the start is its
``start`` section), so the runs differ only in their environments. Stage ``k`` draws with the seed after stage
``k - 1``'s, as under every engineer. Experiments of one seed whose sequences begin alike share that first stage (it
runs once; DVC's run-cache restores it for the others), and an experiment already finished is kept, so a study can
be extended by running the command again with more configurations or seeds. ``--run`` runs the plan
(:func:`experiments.runner.run_plan`: DVC's queue with ``--jobs`` workers, or ``--via prefect``); without it the
command only summarises the experiments already there.

The summary is over the last stage's benchmark answers of ``--agents`` agents (default two, the agent count the
stages train on), per run (``<label>/s<seed>``), with the first configuration as the reference:
:mod:`experiments.sensitivity_summary`. ``env-engineer sensitivity-merge A.json B.json --out all.json`` joins the
summaries of one study run in parts (exactly, from the per-instance outcomes ``A.outcomes.parquet`` written beside
each).
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from envgen.core.files import atomic_write_text
from experiments import warm_engine
from experiments.dvc import DvcError, experiments_shown, pipeline_stages
from experiments.plan import sensitivity_plan
from experiments.records import experiment_records, missing, outcomes
from experiments.runner import QueueStalled, add_commit_argument, run_plan
from experiments.sensitivity_summary import (markdown, merge, outcomes_path, read_outcomes, summarise_rows,
                                             union_outcomes, write_outcomes)
from pipeline.params import ParamsError, load_params, parse_overrides


def read_sequences(patterns: list[str]) -> dict[str, list[Any]]:
    """Label -> configurations (:class:`envgen.core.config.EnvConfig`) of each ``--configs`` word: a YAML file, a glob
    of them (one single-stage sequence each), or files joined by ``+`` (a sequence of stages). A label is the files'
    stems joined by ``+``."""
    from envgen.core.config import EnvConfig

    sequences: dict[str, list[Path]] = {}
    for pattern in patterns:
        if "+" in pattern:
            paths = [Path(p) for p in pattern.split("+")]
            sequences["+".join(p.stem for p in paths)] = paths
        else:
            for p in sorted(glob.glob(pattern)) or [pattern]:
                sequences[Path(p).stem] = [Path(p)]
    absent = sorted({str(p) for paths in sequences.values() for p in paths if not p.is_file()})
    if absent:
        raise ValueError(f"--configs: {', '.join(absent)} does not exist")
    return {label: [EnvConfig.load(p) for p in paths] for label, paths in sequences.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", nargs="+", required=True,
                        help="environment configuration YAMLs (globs allowed), or sequences of them joined by '+' "
                        "(a.yaml+b.yaml+c.yaml: three stages, each from the one before); the first is the reference")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds; each sets the environment, training and "
                        "engineer seeds (default 0)")
    parser.add_argument("--run", action="store_true", help="queue the experiments not yet there, run them and wait "
                        "(else only summarise what `dvc exp show` has)")
    parser.add_argument("--jobs", type=int, default=1, help="with --run: experiments at once (`dvc queue start -j`); "
                        "with ENV_ENGINEER_GPUS (and ENV_ENGINEER_GPU_SLOTS) each step claims a GPU of that pool")
    parser.add_argument("--via", choices=("dvc-queue", "prefect"), default="dvc-queue",
                        help="with --run: DVC's own queue (default), or flow runs of a Prefect deployment")
    parser.add_argument("--deployment", default="curriculum/curriculum",
                        help="with --via prefect: the deployment of the curriculum flow (prefect.yaml)")
    add_commit_argument(parser)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="extra parameter for every experiment (as `dvc exp run -S`), e.g. train.sft_max_examples=2000")
    parser.add_argument("--agents", type=int, default=2,
                        help="the benchmark answers the summary counts: those of this many agents (default 2)")
    parser.add_argument("--repo", type=Path, default=Path("."), help="the DVC repository (default: here)")
    parser.add_argument("--out", type=Path, required=True,
                        help="summary JSON to write (S.json; S.md and the runs' per-instance outcomes, "
                        "S.outcomes.parquet, beside it)")
    warm_engine.add_arguments(parser)


def add_merge_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("parts", type=Path, nargs="+",
                        help="summary JSONs of `env-engineer sensitivity` over the same start and held-out files; with each "
                        "part's S.outcomes.parquet beside its S.json the merge is exact (every pair of runs compared on "
                        "the same instances), else it joins the summaries")
    parser.add_argument("--reference", default=None,
                        help="configuration the others are compared against (default: the first part's first)")
    parser.add_argument("--out", type=Path, required=True, help="merged summary JSON to write (and a .md beside it)")


def run_merge(args: argparse.Namespace) -> int:
    missing = [str(p) for p in args.parts if not p.exists()]
    if missing:
        print(f"error: {', '.join(missing)} does not exist", file=sys.stderr)
        return 2
    exact = all(outcomes_path(p).exists() for p in args.parts)
    parts = [json.loads(p.read_text()) for p in args.parts]
    try:
        outcomes = union_outcomes(parts, [read_outcomes(outcomes_path(p)) for p in args.parts]) if exact else None
        summary = merge(parts, args.reference, outcomes)
    except (ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if outcomes is not None:  # the merged study can be merged again, exactly
        write_outcomes(*outcomes, outcomes_path(args.out))
    atomic_write_text(args.out, json.dumps(summary, indent=2))
    atomic_write_text(args.out.with_suffix(".md"), markdown(summary))
    print(markdown(summary))
    print("merged from every part's per-instance outcomes: exact" if exact else
          "merged from the summaries (a part without its .outcomes.parquet): seed-noise pairs and paired differences "
          "only within a part")
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        sequences = read_sequences(args.configs)
        words = [s.strip() for s in args.seeds.split(",") if s.strip()]
        if not words or not all(w.isdigit() for w in words):
            raise ValueError(f"--seeds {args.seeds!r}: give comma-separated integers, e.g. 0,1")
        seeds = [int(w) for w in words]
        if args.jobs < 1:
            raise ValueError(f"--jobs {args.jobs}: give at least 1")
        params_path = args.repo / "params.yaml"
        extra = parse_overrides(args.set)
        engine = warm_engine.from_arguments(args, load_params(params_path, extra), extra, args.out.with_suffix(".serve.log"))
        trainer = warm_engine.trainer_from_arguments(args, extra, args.out.with_suffix(".train.log"))
        extra = {**extra, **(engine.overrides() if engine else {}), **(trainer.overrides() if trainer else {})}
        plan = sensitivity_plan(sequences, seeds)
        for item in plan:  # every experiment's parameters are checked before anything is queued
            load_params(params_path, {**item.sets, **extra})
        stages = pipeline_stages(args.repo)
        with warm_engine.serving(engine, trainer) as ready:
            ran = (run_plan(args.repo, plan, extra, stages, args.jobs, args.via, args.deployment, args.commit, ready)
                   if args.run else None)
        records = experiment_records(experiments_shown(args.repo))
        absent = missing(records, plan, stages)
        answers = outcomes(args.repo, records, plan, stages)
    except (ValueError, ParamsError, KeyError, OSError, DvcError, json.JSONDecodeError, QueueStalled,
            warm_engine.WarmEngineError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if absent:
        print(f"warning: no results for {', '.join(absent)} at this commit (`dvc queue logs NAME` says why one "
              "failed); run them with --run", file=sys.stderr)
    table: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)  # run -> content hash -> its last stage's answer
    origin: dict[str, str] = {}
    for row in answers.to_pylist() if answers is not None else []:
        if row["num_agents"] == args.agents and row["stage"] == len(sequences[row["engineer"]]) - 1:
            table[f"{row['engineer']}/s{row['seed']}"][row["content_hash"]] = row
            origin[row["content_hash"]] = f"wait {row['wait_ratio']}"
    if not table:
        print(f"error: no experiment of the plan has {args.agents}-agent benchmark answers of its last stage yet; "
              "run it with --run", file=sys.stderr)
        return 1
    order = [f"{label}/s{seed}" for label in sequences for seed in seeds]
    table = {name: table[name] for name in order if name in table}
    summary = summarise_rows(table, origin, next(iter(sequences)), None)
    write_outcomes(table, origin, outcomes_path(args.out))
    from experiments.compare import git_commit

    summary["not_run"] = absent
    summary["settings"] = {"configs": args.configs, "seeds": seeds, "set": args.set, "agents": args.agents,
                           "serve": args.serve, "warm_trainers": args.warm_trainers,
                           "commit": git_commit(args.repo),
                           "params": load_params(params_path, extra).model_dump(mode="json"), **(ran or {})}
    atomic_write_text(args.out, json.dumps(summary, indent=2))
    atomic_write_text(args.out.with_suffix(".md"), markdown(summary))
    print(markdown(summary))
    return 0
