"""How much one stage's environment can matter: from one starting adapter, one curriculum stage under each of several
hand-set environment configurations (and seeds), every resulting adapter scored on the same held-out instances.

``env-engineer sensitivity --params params.yaml --start data/start/adapter --configs presets/sensitivity/*.yaml
--heldout a.parquet --heldout b.parquet --seeds 0,1 --work sens --out reports/sensitivity.json`` runs, per
(configuration, seed), the pipeline's own commands: ``generate-instances`` (the configuration with its ``seed`` set to
the run's seed, excluding the held-out instances), ``train --init-adapter START --set train.seed=SEED`` (the params
file's train section: the per-stage budget), then ``rollout`` of the held-out instances; the starting adapter is scored
too. Everything a run writes stays under ``--work`` and a finished command is not run again, so an interrupted
experiment resumes where it stopped. ``--budget-s`` stops starting new runs after that many seconds; ``--jobs N`` runs N
at once (with ``ENV_ENGINEER_GPUS=0,1 ENV_ENGINEER_GPU_SLOTS=4`` their steps share two GPUs, four processes each); a
failed run is reported, the others go on, and it is tried again at the end, alone (``--retries``, default once).

The summary gives, per run, the valid and optimal rates (95% Wilson intervals) overall, per held-out file and per map
size; paired differences (same instances) against the starting adapter and against the first configuration with 95%
intervals; the *spread*, the best minus the worst configuration (seed means); and the *noise*, the difference between
two seeds of one configuration, i.e. what an engineer could gain per stage against what chance moves.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import math
import subprocess
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from envgen.files import atomic_write_text

Z95 = 1.959963984540054


def wilson(k: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a rate of ``k`` successes in ``n`` trials ((0, 1) when n is 0)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + Z95 ** 2 / (2 * n)) / (1 + Z95 ** 2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95 ** 2 / (4 * n * n)) / (1 + Z95 ** 2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference(a: list[bool], b: list[bool]) -> dict[str, float]:
    """Mean of ``a - b`` over the same instances with a 95% normal interval from the paired differences' spread."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired difference needs two equally long, non-empty lists (got {len(a)} and {len(b)})")
    d = [int(x) - int(y) for x, y in zip(a, b)]
    n = len(d)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1) if n > 1 else 0.0
    half = Z95 * math.sqrt(var / n)
    return {"diff": mean, "low": mean - half, "high": mean + half, "n": n}


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


def rates(rows: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(rows)
    valid, optimal = sum(r["valid"] for r in rows), sum(r["optimal"] for r in rows)
    return {"n": n, "valid": valid / n if n else 0.0, "valid_ci": wilson(valid, n),
            "optimal": optimal / n if n else 0.0, "optimal_ci": wilson(optimal, n)}


def scored(trajectories: Path) -> dict[str, dict[str, Any]]:
    """``content_hash -> row`` of a held-out rollout (its first sample)."""
    rows = pq.read_table(trajectories, columns=["content_hash", "sample_index", "size", "num_agents", "valid",
                                                "optimal"]).to_pylist()
    return {r["content_hash"]: r for r in rows if r["sample_index"] == 0}


def summarise(runs: dict[str, Path], origin: dict[str, str], reference: str, start: str | None) -> dict[str, Any]:
    """The summary described in the module docstring from ``run name -> held-out trajectories``; run names are
    ``<configuration>/s<seed>`` (``start`` for the starting adapter); ``reference`` is the configuration the others are
    compared against."""
    table = {name: scored(path) for name, path in runs.items()}
    hashes = sorted(set.intersection(*(set(t) for t in table.values()))) if table else []
    out: dict[str, Any] = {"instances": len(hashes), "runs": {}, "vs_start": {}, "vs_reference": {}}
    for name, rows in table.items():
        ordered = [rows[h] for h in hashes]
        groups: dict[str, list] = defaultdict(list)
        for h, r in zip(hashes, ordered):
            groups[origin.get(h, "heldout")].append(r)
            groups[f"{r['num_agents']} agents, {r['size']}x{r['size']}"].append(r)
        out["runs"][name] = {"all": rates(ordered), **{g: rates(v) for g, v in sorted(groups.items())}}

    def column(name: str, key: str) -> list[bool]:
        return [bool(table[name][h][key]) for h in hashes]

    configs: dict[str, list[str]] = defaultdict(list)
    for name in table:
        if name != start:
            configs[name.split("/")[0]].append(name)
    for name in table:
        if start and name != start:
            out["vs_start"][name] = {k: paired_difference(column(name, k), column(start, k)) for k in ("valid", "optimal")}
    ref_runs = configs.get(reference, [])
    for name in table:
        if name == start or name.split("/")[0] == reference:
            continue
        partner = next((r for r in ref_runs if r.split("/")[1] == name.split("/")[1]), None)
        if partner:
            out["vs_reference"][name] = {k: paired_difference(column(name, k), column(partner, k))
                                         for k in ("valid", "optimal")}
    means = {c: sum(out["runs"][r]["all"]["valid"] for r in rs) / len(rs) for c, rs in configs.items()}
    if len(means) >= 2:
        best, worst = max(means, key=means.get), min(means, key=means.get)
        out["spread"] = {"best": best, "worst": worst, "valid": means[best] - means[worst], "config_means": means}
    noise = []
    for c, rs in configs.items():
        for i in range(len(rs)):
            for j in range(i + 1, len(rs)):
                noise.append({"config": c, "runs": [rs[i], rs[j]],
                              "valid": paired_difference(column(rs[i], "valid"), column(rs[j], "valid"))})
    out["noise"] = noise
    if noise:
        out["noise_mean_abs_valid"] = sum(abs(x["valid"]["diff"]) for x in noise) / len(noise)
    return out


def markdown(summary: dict[str, Any]) -> str:
    """The summary as Markdown tables (rates in percent with 95% intervals)."""
    def pct(x: float) -> str:
        return f"{100 * x:.1f}"

    runs = summary["runs"]
    groups = [g for g in next(iter(runs.values()), {}) if g != "all" and "agents," not in g]
    lines = [f"Held-out instances: {summary['instances']}.", "",
             "| run | valid (95% CI) | optimal | " + " | ".join(f"valid {g}" for g in groups) + " |",
             "|---|---|---|" + "---|" * len(groups)]
    for name, r in runs.items():
        a = r["all"]
        lines.append(f"| {name} | {pct(a['valid'])} ({pct(a['valid_ci'][0])}-{pct(a['valid_ci'][1])}) | "
                     f"{pct(a['optimal'])} | " + " | ".join(pct(r[g]["valid"]) for g in groups) + " |")
    for key, title in (("vs_start", "against the starting adapter"), ("vs_reference", "against the reference configuration")):
        if summary[key]:
            lines += ["", f"Paired difference in valid rate {title} (points, 95% CI):", ""]
            for name, d in summary[key].items():
                v = d["valid"]
                lines.append(f"- {name}: {100 * v['diff']:+.1f} ({100 * v['low']:+.1f} to {100 * v['high']:+.1f})")
    if "spread" in summary:
        s = summary["spread"]
        lines += ["", f"Spread (best - worst configuration, seed means): {100 * s['valid']:.1f} points "
                      f"({s['best']} - {s['worst']})."]
    for x in summary.get("noise", []):
        v = x["valid"]
        lines.append(f"Seed noise, {x['config']} ({' - '.join(x['runs'])}): {100 * v['diff']:+.1f} points "
                     f"({100 * v['low']:+.1f} to {100 * v['high']:+.1f}).")
    return "\n".join(lines) + "\n"


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
                        help="environment configuration YAMLs (globs allowed); the first is the reference")
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
    parser.add_argument("--out", type=Path, required=True, help="summary JSON to write (and a .md beside it)")
    parser.add_argument("--budget-s", type=float, default=None, help="start no new run after this many seconds")
    parser.add_argument("--retries", type=int, default=1,
                        help="times a failed run is tried again at the end, one at a time (default 1)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at once (default 1); with ENV_ENGINEER_GPUS (and ENV_ENGINEER_GPU_SLOTS) each step "
                        "process claims a GPU of that pool (policy/devices.py)")


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    configs = [Path(p) for pattern in args.configs for p in (sorted(glob.glob(pattern)) or [pattern])]
    for path in [*configs, *args.heldout, args.params, args.start]:
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

    def one(config: Path, seed: int) -> None:
        name = f"{config.stem}/s{seed}"
        folder = work / name
        if (folder / "heldout-trajectories.parquet").exists():  # finished earlier
            with lock:
                runs[name] = folder / "heldout-trajectories.parquet"
            return
        if args.budget_s is not None and time.monotonic() - started > args.budget_s:
            with lock:
                skipped.append(name)
            return
        folder.mkdir(parents=True, exist_ok=True)
        env = yaml.safe_load(config.read_text())
        env["seed"] = seed
        (folder / "config.yaml").write_text(yaml.safe_dump(env, sort_keys=False))
        instances = folder / "instances.parquet"
        run_once(command("generate-instances", "--config", str(folder / "config.yaml"), "--out", str(instances),
                         *excludes), instances, folder / "log.txt")
        adapter = folder / "adapter"
        run_once(command("train", "--params", str(args.params), *overrides, "--set", f"train.seed={seed}",
                         "--instances", str(instances), "--init-adapter", str(args.start), "--out-adapter",
                         str(adapter), "--out-completions", str(folder / "train_completions.parquet"),
                         "--out-metrics", str(folder / "train_metrics.json"), "--out-details",
                         str(folder / "train_details.json")), adapter, folder / "log.txt")
        trajectories = score(name, adapter)
        with lock:
            runs[name] = trajectories
        print(f"{name}: trained and scored ({time.monotonic() - started:.0f} s)", flush=True)

    tasks = [("start", start_run), *((f"{c.stem}/s{s}", functools.partial(one, c, s)) for c, s in plan)]
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
    runs = {name: runs[name] for name in ["start", *(f"{c.stem}/s{s}" for c in configs for s in seeds)] if name in runs}
    if skipped:
        print(f"budget of {args.budget_s:.0f} s spent: {len(skipped)} run(s) not started ({', '.join(skipped)})")
    if "start" not in runs:
        print("error: the starting adapter was not scored; nothing to compare against", file=sys.stderr)
        return 1
    summary = summarise(runs, origin, configs[0].stem, "start")
    summary["not_run"] = skipped
    summary["failed"] = failures
    summary["settings"] = {"params": str(args.params), "start": str(args.start), "configs": [str(c) for c in configs],
                           "heldout": [str(h) for h in args.heldout], "seeds": seeds, "set": args.set,
                           "seconds": round(time.monotonic() - started, 1)}
    atomic_write_text(args.out, json.dumps(summary, indent=2))
    atomic_write_text(args.out.with_suffix(".md"), markdown(summary))
    print(markdown(summary))
    return 0
