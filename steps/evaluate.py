"""Pipeline step ``evaluate``: score a stage's greedy answers on the benchmark in the paper's layout.

Inputs: the benchmark, the stage's rollout on it (``env-engineer rollout``, run just before in the same DVC stage),
the stage's training instances (re-checked: none may be a benchmark instance) and the reference rows. Outputs:
``benchmark_metrics.json`` (DVC metrics, the headline numbers only: ``bench/acc/<A>_agents``, ``bench/opt/<A>_agents``
= the Sum over sizes per agent count, ``bench/se/<A>_agents`` = the valid Sum's standard error, and
``bench_size/<A>_agents/<N>xN`` = the valid rate per map size), ``benchmark_table.json`` (the whole table per agent count and size, the
overlap check and the reference rows) and ``benchmark.md`` (the tables in the paper's layout).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from envgen.benchmark import cell_table, render_table
from envgen.files import atomic_write_text


def check_disjoint(benchmark: Path, training: list[Path]) -> int:
    """The number of training instances checked; raises ValueError if any is a benchmark instance."""
    bench = set(pq.read_table(benchmark, columns=["content_hash"]).column("content_hash").to_pylist())
    seen = 0
    for path in training:
        hashes = pq.read_table(path, columns=["content_hash"]).column("content_hash").to_pylist()
        overlap = bench.intersection(hashes)
        if overlap:
            raise ValueError(f"{path}: {len(overlap)} training instance(s) are in the benchmark, e.g. {sorted(overlap)[0][:16]}")
        seen += len(hashes)
    return seen


def sum_standard_error(agents_table: dict[str, Any]) -> float:
    """Standard error of an agent count's valid Sum (the mean over its sizes of each size's rate), from each size's
    binomial variance: sqrt(sum p(1-p)/n) / sizes. The benchmark's per_cell decides it (issue: at most 0.02)."""
    sizes = agents_table["sizes"].values()
    var = sum(c["acc"] * (1 - c["acc"]) / c["n"] for c in sizes if c["n"])
    return math.sqrt(var) / max(1, len(sizes))


def evaluate(benchmark: Path, trajectories: Path, training: list[Path], reference: Path | None) -> dict[str, Any]:
    """Benchmark metrics of one stage's policy (greedy answers already in ``trajectories``)."""
    wait_of = {r["content_hash"]: r["wait_subset"] for r in pq.read_table(benchmark, columns=["content_hash", "wait_subset"]).to_pylist()}
    rows = [{**r, "wait_subset": wait_of[r["content_hash"]]} for r in pq.read_table(trajectories).to_pylist()]
    table = cell_table(rows)
    checked = check_disjoint(benchmark, training)
    cut = [r for r in rows if r.get("token_budget") is not None and r["token_budget"] < r["optimal_tokens"]]
    if cut:
        raise ValueError(f"{trajectories}: {len(cut)} answer(s) had a token budget below their optimal answer's length "
                         f"(e.g. {cut[0]['token_budget']} < {cut[0]['optimal_tokens']}), which scores truncation, not "
                         "planning; set rollout.max_new_tokens and evaluate.max_new_tokens to 'auto'")
    metrics = {"bench": {f"acc/{a}_agents": t["sum"]["acc"] for a, t in table.items()}
               | {f"opt/{a}_agents": t["sum"]["opt"] for a, t in table.items()}
               | {f"se/{a}_agents": sum_standard_error(t) for a, t in table.items()},
               "bench_size": {f"{a}_agents/{n}x{n}": cell["acc"] for a, t in table.items()
                              for n, cell in t["sizes"].items()},
               "bench_table": table, "disjoint": {"training_instances_checked": checked, "overlap": 0},
               "budgets": {"answers": len(rows), "stopped_at_budget": sum(r.get("finish_reason") == "length" for r in rows),
                           "optimal_above_budget": 0}}
    if reference is not None:
        metrics["reference"] = json.loads(Path(reference).read_text())
    return metrics


def tables(metrics: dict[str, Any]) -> str:
    """The policy's table and the reference rows' tables, in markdown."""
    parts = [render_table(metrics["bench_table"], "Policy (valid / optimal, %)")]
    for name, table in (metrics.get("reference") or {}).items():
        parts.append(render_table(table, f"Reference: {name}"))
    parts.append(f"Training instances checked for overlap with the benchmark: {metrics['disjoint']['training_instances_checked']}, overlap 0.")
    budgets = metrics.get("budgets")
    if budgets:
        parts.append(f"Answers that stopped at their token budget: {budgets['stopped_at_budget']} of {budgets['answers']} "
                     "(no budget below its instance's optimal answer).")
    return "\n\n".join(parts) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--benchmark", type=Path, required=True, help="benchmark instances Parquet")
    parser.add_argument("--trajectories", type=Path, required=True, help="the stage's rollout on the benchmark")
    parser.add_argument("--training", type=Path, action="append", default=[], help="training instances so far (repeatable)")
    parser.add_argument("--reference", type=Path, default=None, help="reference rows JSON to include")
    parser.add_argument("--out-metrics", type=Path, required=True, help="headline metrics JSON (dvc metrics)")
    parser.add_argument("--out-full", type=Path, default=None,
                        help="the whole table, overlap check and reference rows JSON")
    parser.add_argument("--out-table", type=Path, required=True, help="markdown tables in the paper's layout")


def run(args: argparse.Namespace) -> int:
    try:
        metrics = evaluate(args.benchmark, args.trajectories, args.training, args.reference)
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    atomic_write_text(args.out_metrics, json.dumps({"bench": metrics["bench"], "bench_size": metrics["bench_size"]},
                                                   indent=2))
    if args.out_full is not None:
        atomic_write_text(args.out_full, json.dumps(metrics, indent=2))
    atomic_write_text(args.out_table, tables(metrics))
    print("benchmark: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in metrics["bench"].items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="env-engineer evaluate", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
