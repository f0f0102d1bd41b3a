"""How much one stage's environment can matter: from one starting adapter, one curriculum stage under each of several
hand-set environment configurations (and seeds), every resulting adapter scored on the same held-out instances.

``env-engineer sensitivity --params params.yaml --start data/start/adapter --configs presets/sensitivity/*.yaml
--heldout a.parquet --heldout b.parquet --seeds 0,1 --work sens --out reports/sensitivity.json`` runs, per
(configuration, seed), the pipeline's own commands: ``generate-instances`` (the configuration with its ``seed`` set to
the run's seed, excluding the held-out instances), ``train --init-adapter START --set train.seed=SEED`` (the params
file's train section: the per-stage budget), then ``rollout`` of the held-out instances; the starting adapter is scored
too. A configuration given as ``a.yaml+b.yaml+c.yaml`` is a sequence of stages: stage k trains on its own configuration
(seed ``SEED + 1000 k``, so no two stages draw the same instances) from stage k-1's adapter, and the last stage is
scored; a stage whose sequence begins like another's (``a`` of ``a+b``, or ``a`` alone) is trained once and shared. Everything a run writes stays under ``--work`` and a finished command is not run again, so an interrupted
experiment resumes where it stopped. ``--budget-s`` stops starting new runs after that many seconds; ``--jobs N`` runs N
at once (with ``ENV_ENGINEER_GPUS=0,1 ENV_ENGINEER_GPU_SLOTS=4`` their steps share two GPUs, four processes each); a
failed run is reported, the others go on, and it is tried again at the end, alone (``--retries``, default once).

The summary, and ``env-engineer sensitivity-merge A.json B.json --out all.json`` that joins the summaries of one study
run in parts (exactly, from the per-instance outcomes ``A.outcomes.parquet`` written beside each): see
:mod:`experiments.sensitivity_summary`.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from envgen.core.files import atomic_write_text
from experiments.sensitivity_summary import (markdown, merge, outcomes_path, read_outcomes, scored, summarise_rows,
                                             union_outcomes, write_outcomes)


def combine_heldout(files: list[Path], out: Path) -> dict[str, str]:
    """One instances file of every held-out file (rows re-indexed; an instance already taken is dropped); returns
    ``content_hash -> held-out file stem`` for the per-file tables."""
    tables, origin = [], {}
    metadata = None
    for path in files:
        table = pq.read_table(path)
        metadata = metadata or table.schema.metadata
        keep = []
        for i, h in enumerate(table.column("content_hash").to_pylist()):
            if h not in origin:
                origin[h] = Path(path).stem
                keep.append(i)
        tables.append(table.take(pa.array(keep, pa.int64())).replace_schema_metadata(None))
    combined = pa.concat_tables(tables)
    combined = combined.set_column(combined.column_names.index("index"), "index",
                                   pa.array(range(combined.num_rows), combined.schema.field("index").type))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.parquet")
    pq.write_table(combined.replace_schema_metadata(metadata), tmp)
    tmp.replace(out)
    return origin


STAGE_SEED_STEP = 1000
"""Stage k of a sequence draws its configuration with seed ``SEED + STAGE_SEED_STEP * k``."""


def sequence_name(sequence: tuple[Path, ...]) -> str:
    """A run's configuration name: its stages' file stems joined by '+' (one stem for a single stage)."""
    return "+".join(path.stem for path in sequence)


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "env_engineer", *args]


def run_once(cmd: list[str], done: Path, log: Path) -> None:
    """Run ``cmd`` unless ``done`` exists (its output); its output goes to ``log``; a failure names the log."""
    if done.exists():
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd[2:5])} ...` failed (exit {proc.returncode}); its output: {log}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=Path, default=Path("params.yaml"),
                        help="parameters file whose policy, train and rollout sections every run uses (the per-stage "
                        "budget is its train section)")
    parser.add_argument("--start", type=Path, required=True, help="the starting LoRA adapter every run continues from")
    parser.add_argument("--configs", nargs="+", required=True,
                        help="environment configuration YAMLs (globs allowed), or sequences of them joined by '+' "
                        "(a.yaml+b.yaml+c.yaml: three stages, each from the one before); the first is the reference")
    parser.add_argument("--heldout", type=Path, action="append", required=True,
                        help="held-out instances Parquet (repeatable); reported per file")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds; each sets the configuration's seed and "
                        "train.seed (default 0)")
    parser.add_argument("--exclude", type=Path, action="append", default=[],
                        help="instances no run may train on besides the held-out ones (repeatable), e.g. "
                        "data/start/instances.parquet")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="parameter override passed to every train and rollout (repeatable)")
    parser.add_argument("--work", type=Path, required=True, help="folder for every run's files (resumable)")
    parser.add_argument("--out", type=Path, required=True,
                        help="summary JSON to write (S.json; S.md and the runs' per-instance outcomes, "
                        "S.outcomes.parquet, beside it)")
    parser.add_argument("--budget-s", type=float, default=None, help="start no new run after this many seconds")
    parser.add_argument("--retries", type=int, default=1,
                        help="times a failed run is tried again at the end, one at a time (default 1)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once (default 1); with ENV_ENGINEER_GPUS (and ENV_ENGINEER_GPU_SLOTS) each step "
                        "process claims a GPU of that pool (policy/devices.py)")


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
    started = time.monotonic()
    configs: list[tuple[Path, ...]] = []  # each a sequence of stage configurations
    for pattern in args.configs:
        if "+" in pattern:
            configs.append(tuple(Path(p) for p in pattern.split("+")))
        else:
            configs.extend((Path(p),) for p in sorted(glob.glob(pattern)) or [pattern])
    for path in [*(c for seq in configs for c in seq), *args.heldout, args.params, args.start]:
        if not path.exists():
            print(f"error: {path} does not exist", file=sys.stderr)
            return 2
    if args.jobs < 1:
        print(f"error: --jobs {args.jobs}: give at least 1", file=sys.stderr)
        return 2
    if args.retries < 0:
        print(f"error: --retries {args.retries}: give 0 (no retry) or more", file=sys.stderr)
        return 2
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        print(f"error: --seeds {args.seeds!r}: give comma-separated integers, e.g. 0,1", file=sys.stderr)
        return 2
    work = args.work
    heldout = work / "heldout.parquet"
    origin = combine_heldout(list(args.heldout), heldout)
    overrides = [x for s in args.set for x in ("--set", s)]
    excludes = [x for p in [*args.heldout, *args.exclude] for x in ("--exclude", str(p))]

    def score(name: str, adapter: Path) -> Path:
        out = work / name / "heldout-trajectories.parquet"
        run_once(command("rollout", "--params", str(args.params), *overrides, "--instances", str(heldout), "--adapter",
                         str(adapter), "--out", str(out)), out, work / name / "log.txt")
        return out

    runs: dict[str, Path] = {}

    def start_run() -> None:
        trajectories = score("start", args.start)
        with lock:
            runs["start"] = trajectories
        print(f"start: scored on {heldout} ({time.monotonic() - started:.0f} s)", flush=True)

    # seed-major: under --budget-s every configuration gets its first seeds before any gets a later one
    plan = [(config, seed) for seed in seeds for config in configs]
    skipped: list[str] = []
    lock = threading.Lock()
    stage_locks: dict[str, threading.Lock] = {}

    def train_stage(sequence: tuple[Path, ...], seed: int, init: Path) -> Path:
        """The last stage of ``sequence`` (its earlier stages trained already, the last from ``init``): its folder's
        adapter, trained once however many sequences begin with these stages."""
        name = f"{sequence_name(sequence)}/s{seed}"
        with lock:
            stage_lock = stage_locks.setdefault(name, threading.Lock())
        folder = work / name
        with stage_lock:
            folder.mkdir(parents=True, exist_ok=True)
            env = yaml.safe_load(sequence[-1].read_text())
            env["seed"] = seed + STAGE_SEED_STEP * (len(sequence) - 1)
            (folder / "config.yaml").write_text(yaml.safe_dump(env, sort_keys=False))
            instances = folder / "instances.parquet"
            run_once(command("generate-instances", "--config", str(folder / "config.yaml"), "--out", str(instances),
                             *excludes), instances, folder / "log.txt")
            adapter = folder / "adapter"
            run_once(command("train", "--params", str(args.params), *overrides, "--set", f"train.seed={seed}",
                             "--instances", str(instances), "--init-adapter", str(init), "--out-adapter",
                             str(adapter), "--out-completions", str(folder / "train_completions.parquet"),
                             "--out-metrics", str(folder / "train_metrics.json"), "--out-details",
                             str(folder / "train_details.json")), adapter, folder / "log.txt")
        return adapter

    def one(sequence: tuple[Path, ...], seed: int) -> None:
        name = f"{sequence_name(sequence)}/s{seed}"
        folder = work / name
        if (folder / "heldout-trajectories.parquet").exists():  # finished earlier
            with lock:
                runs[name] = folder / "heldout-trajectories.parquet"
            return
        if args.budget_s is not None and time.monotonic() - started > args.budget_s:
            with lock:
                skipped.append(name)
            return
        adapter = args.start
        for k in range(len(sequence)):
            adapter = train_stage(sequence[:k + 1], seed, adapter)
        trajectories = score(name, adapter)
        with lock:
            runs[name] = trajectories
        print(f"{name}: trained and scored ({time.monotonic() - started:.0f} s)", flush=True)

    tasks = [("start", start_run), *((f"{sequence_name(c)}/s{s}", functools.partial(one, c, s)) for c, s in plan)]
    failed: list[tuple[str, Any, str]] = []  # (run, its task, error)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for (name, task), future in [(t, pool.submit(t[1])) for t in tasks]:
            try:
                future.result()
            except RuntimeError as e:  # one failed run does not stop the others; the summary covers what finished
                failed.append((name, task, str(e)))
                print(f"error: {e}", file=sys.stderr, flush=True)
    # Runs sharing a GPU fail for want of its memory when the others peak (a vLLM engine that cannot start, an
    # out-of-memory error): each failed run is tried again, one at a time, from the commands it had not finished,
    # while the budget lasts.
    for attempt in range(args.retries):
        if not failed or (args.budget_s is not None and time.monotonic() - started > args.budget_s):
            break
        again, failed = failed, []
        for name, task, _ in again:
            print(f"retry {attempt + 1} of {args.retries}: {name}", flush=True)
            try:
                task()
            except RuntimeError as e:
                failed.append((name, task, str(e)))
                print(f"error: {e}", file=sys.stderr, flush=True)
    failures = [f"{name}: {error}" for name, _, error in failed]
    runs = {name: runs[name] for name in ["start", *(f"{sequence_name(c)}/s{s}" for c in configs for s in seeds)]
            if name in runs}
    if skipped:
        print(f"budget of {args.budget_s:.0f} s spent: {len(skipped)} run(s) not started ({', '.join(skipped)})")
    if "start" not in runs:
        print("error: the starting adapter was not scored; nothing to compare against", file=sys.stderr)
        return 1
    table = {name: scored(path) for name, path in runs.items()}  # every run's held-out outcomes, read once
    summary = summarise_rows(table, origin, sequence_name(configs[0]), "start")
    write_outcomes(table, origin, outcomes_path(args.out))
    summary["not_run"] = skipped
    summary["failed"] = failures
    summary["settings"] = {"params": str(args.params), "start": str(args.start),
                           "configs": ["+".join(map(str, c)) for c in configs],
                           "heldout": [str(h) for h in args.heldout], "seeds": seeds, "set": args.set,
                           "seconds": round(time.monotonic() - started, 1)}
    atomic_write_text(args.out, json.dumps(summary, indent=2))
    atomic_write_text(args.out.with_suffix(".md"), markdown(summary))
    print(markdown(summary))
    return 0
