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

from envgen.benchmark import cell_table, render_table
from envgen.formats.dataset import read_parquet
from envgen.core.files import atomic_write_text, expect_mapping, read_json
from envgen.formats.schemas import TRAJECTORIES

ANSWER_COLUMNS = ("content_hash", "num_agents", "size", "valid", "optimal", "finish_reason", "token_budget",
                  "optimal_tokens")
"""What a benchmark rollout must hold for the tables."""


def check_disjoint(benchmark: Path, training: list[Path]) -> int:
    """The number of training instances checked; raises ValueError if any is a benchmark instance."""
    bench = set(read_parquet(benchmark, "the benchmark", ["content_hash"]).column("content_hash").to_pylist())
    seen = 0
    for path in training:
        hashes = read_parquet(path, "a stage's instances", ["content_hash"]).column("content_hash").to_pylist()
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


def scored_agents(trajectories: Path) -> list[int] | None:
    """The agent counts the rollout that wrote ``trajectories`` answered, as it recorded them (None: all, or not
    recorded); [] for a stage that scores no board (``evaluate.early_agents: []``)."""
    import pyarrow.parquet as pq

    meta = pq.read_schema(trajectories).metadata or {}
    try:
        return json.loads(meta.get(b"rollout", b"{}")).get("agents")
    except (ValueError, AttributeError):
        return None


def evaluate(benchmark: Path, trajectories: Path, training: list[Path], reference: Path | None) -> dict[str, Any]:
    """Benchmark metrics of one stage's policy (greedy answers already in ``trajectories``)."""
    wait_of = {r["content_hash"]: r["wait_subset"]
               for r in read_parquet(benchmark, "the benchmark", ["content_hash", "wait_subset"]).to_pylist()}
    answers = read_parquet(trajectories, "the stage's benchmark rollout (trajectories)", list(ANSWER_COLUMNS),
                           TRAJECTORIES).to_pylist()
    if not answers and scored_agents(trajectories) != []:
        raise ValueError(f"{trajectories}: no answer; roll out the benchmark (`env-engineer rollout --evaluate`) "
                         "before scoring it")
    strangers = [r["content_hash"] for r in answers if r["content_hash"] not in wait_of]
    if strangers:
        raise ValueError(f"{trajectories}: {len(strangers)} answer(s) to instances that are not in {benchmark} (e.g. "
                         f"{str(strangers[0])[:16]}); roll out the benchmark itself")
    rows = [{**r, "wait_subset": wait_of[r["content_hash"]]} for r in answers]
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
        metrics["reference"] = read_reference(reference)
    return metrics


def read_reference(path: Path) -> dict[str, Any]:
    """The reference rows (build-benchmark's ``reference.json``: per planner, a table per agent count), checked so that
    the tables render: a mapping of names to mappings."""
    data = expect_mapping(read_json(path, "reference rows (reference.json)"), path, "reference rows (reference.json)")

    def cell(c: Any) -> bool:
        return isinstance(c, dict) and all(isinstance(c.get(k), (int, float)) and not isinstance(c.get(k), bool)
                                           for k in ("acc", "opt"))

    def agents_row(t: Any) -> bool:
        return (isinstance(t, dict) and isinstance(t.get("sizes"), dict) and isinstance(t.get("wait"), dict)
                and all(str(n).isdigit() and cell(c) for n, c in t["sizes"].items())
                and all(cell(c) for c in t["wait"].values()) and cell(t.get("sum")))

    for name, table in data.items():
        if not isinstance(table, dict) or not all(agents_row(t) for t in table.values()):
            raise ValueError(f"{path}: the reference {str(name)[:40]!r} is not a table per agent count (sizes, wait "
                             "subsets and Sum, each with acc and opt); give build-benchmark's reference.json")
    return data


def tables(metrics: dict[str, Any]) -> str:
    """The policy's table and the reference rows' tables, in markdown."""
    parts = [render_table(metrics["bench_table"], "Policy (valid / optimal, %)") if metrics["bench_table"] else
             "### Policy\n\nThis stage scored no benchmark board (evaluate.early_agents: [] before "
             "evaluate.whole_from_stage); its validation answers are in validation.parquet."]
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
        # every output made before any is written: a failure leaves none of them half done
        outputs = {args.out_metrics: json.dumps({"bench": metrics["bench"], "bench_size": metrics["bench_size"]},
                                                indent=2), args.out_table: tables(metrics)}
        if args.out_full is not None:
            outputs[args.out_full] = json.dumps(metrics, indent=2)
    except (ValueError, OSError, KeyError, RecursionError) as e:
        print(f"error: {str(e)[:500]}", file=sys.stderr)
        return 2
    for path, text in outputs.items():
        atomic_write_text(path, text)
    print("benchmark: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in metrics["bench"].items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="env-engineer evaluate", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
