"""The held-out benchmark in the paper's layout, its reference rows, and ``evaluate`` after each stage.

``build-benchmark`` (its own DVC stage, its own seed): for each agent count A and its sizes (paper: 3 agents on 3x3..10x10,
4 on 4x4..10x10, 5 on 5x5..10x10) and each wait-ratio subset w (0.25 / 0.50 / 0.75), ``per_cell`` instances per
(A, size, w), every one distinct from every other and from the excluded files (the validation set). Training stages
exclude the benchmark in turn, and ``evaluate`` re-checks that no training instance of any stage so far is in it.

Reference rows, computed once on the benchmark (``reference.json``): the optimal CBS plan (100% valid and optimal by
construction: a check of the benchmark itself), prioritized planning, and independent shortest paths ("no
coordination").

Tables follow the paper: valid rate ("acc") and optimal rate ("opt") per cell, "Sum" = the mean over map sizes per
agent count, and per wait subset.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from envgen.config import EnvConfig, SizeConfig, format_validation_error
from envgen.dataset import INSTANCE_SCHEMA, record_of
from envgen.files import atomic_write_bytes, atomic_write_text
from envgen.generator import draw_seed, generate
from envgen.instance import Instance
from envgen.planners import independent_plan, prioritized_plan
from envgen.simulate import Valid, check_plan


class BenchmarkSettings(BaseModel):
    """``params.yaml``, section ``benchmark``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = Field(2026, ge=0, description="The benchmark's own seed.")
    per_cell: int = Field(50, ge=1, description="Instances per (agents, size, wait subset) cell (paper: 50).")
    wait_ratios: list[float] = Field([0.25, 0.5, 0.75], description="Wait-ratio subsets.")
    hole_ratio: float = Field(0.2, ge=0, le=0.5, description="Hole ratio of every benchmark board.")
    agents: dict[int, list[int]] = Field({3: list(range(3, 11)), 4: list(range(4, 11)), 5: list(range(5, 11))},
                                         description="Per agent count, its map sizes.")

    @classmethod
    def from_params(cls, path: str | Path) -> BenchmarkSettings:
        data = (yaml.safe_load(Path(path).read_text()) or {}).get("benchmark") or {}
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ValueError(format_validation_error(e, f"{path} (section benchmark)")) from None

    def configs(self) -> list[tuple[int, float, EnvConfig]]:
        out = []
        for a, sizes in sorted(self.agents.items()):
            for w in self.wait_ratios:
                seed = draw_seed(self.seed, a * 1000 + round(w * 100)) >> 1  # within EnvConfig.seed
                out.append((a, w, EnvConfig(num_agents=a, budget=self.per_cell * len(sizes), seed=seed,
                                            sizes={n: SizeConfig(data_ratio=1.0, hole_ratio=self.hole_ratio, wait_ratio=w) for n in sizes})))
        return out


BENCHMARK_SCHEMA = INSTANCE_SCHEMA.append(pa.field("wait_subset", pa.float32(), metadata={"description": "The cell's wait ratio."}))


def build_benchmark(settings: BenchmarkSettings, out: Path, exclude: frozenset[str] = frozenset(), progress: bool = True) -> int:
    from tqdm import tqdm

    from tasks.generate_instances import verify

    taken = set(exclude)
    rows = []
    total = sum(c.budget for _, _, c in settings.configs())
    with tqdm(total=total, desc="build-benchmark", unit="inst", disable=not progress, file=sys.stderr) as bar:
        for a, w, config in settings.configs():
            for g in generate(config, exclude=taken, on_progress=bar.update):
                verify(g)
                taken.add(g.instance.content_hash)
                rows.append({**record_of(g, config.seed), "index": len(rows), "wait_subset": w})
    table = pa.Table.from_pylist(rows, schema=BENCHMARK_SCHEMA).replace_schema_metadata(
        {"benchmark": settings.model_dump_json()})
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    atomic_write_bytes(out, buf.getvalue())
    return len(rows)


def cell_table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Valid/optimal per (agents, size), "Sum" per agent count (mean over sizes), and per wait subset."""
    cells: dict[tuple[int, int], list[dict]] = defaultdict(list)
    waits: dict[tuple[int, float], list[dict]] = defaultdict(list)
    for r in rows:
        cells[(r["num_agents"], r["size"])].append(r)
        waits[(r["num_agents"], round(float(r["wait_subset"]), 2))].append(r)

    def rate(rs: list[dict], key: str) -> float:
        return sum(bool(r[key]) for r in rs) / len(rs) if rs else 0.0

    by_agents: dict[str, Any] = {}
    for a in sorted({k[0] for k in cells}):
        sizes = sorted(n for (aa, n) in cells if aa == a)
        per_size = {str(n): {"acc": rate(cells[(a, n)], "valid"), "opt": rate(cells[(a, n)], "optimal"), "n": len(cells[(a, n)])}
                    for n in sizes}
        by_agents[str(a)] = {
            "sizes": per_size,
            "sum": {"acc": sum(v["acc"] for v in per_size.values()) / len(per_size),
                    "opt": sum(v["opt"] for v in per_size.values()) / len(per_size)},
            "wait": {f"{w:.2f}": {"acc": rate(rs, "valid"), "opt": rate(rs, "optimal"), "n": len(rs)}
                     for (aa, w), rs in sorted(waits.items()) if aa == a},
        }
    return by_agents


def reference_rows(benchmark: Path) -> dict[str, Any]:
    """The three reference planners on every benchmark instance."""
    from envgen.cbs import Solved, SolverBudget, solve

    rows = pq.read_table(benchmark).to_pylist()
    out: dict[str, list[dict]] = {"optimal (CBS)": [], "prioritized": [], "independent": []}
    for r in rows:
        inst = Instance.from_str(r["instance"])
        base = {"num_agents": r["num_agents"], "size": r["size"], "wait_subset": r["wait_subset"]}
        cbs = solve(inst, SolverBudget(max_seconds=60))
        ok = isinstance(cbs, Solved) and cbs.soc == r["optimal_soc"]
        out["optimal (CBS)"].append({**base, "valid": ok, "optimal": ok})
        for name, planner in (("prioritized", prioritized_plan), ("independent", independent_plan)):
            plan = planner(inst)
            result = check_plan(inst, plan, r["optimal_soc"]) if plan is not None else None
            valid = isinstance(result, Valid)
            out[name].append({**base, "valid": valid, "optimal": valid and bool(result.optimal)})
    return {name: cell_table(rs) for name, rs in out.items()}


def check_disjoint(benchmark: Path, training: list[Path]) -> int:
    """The number of training instances checked; raises if any is a benchmark instance."""
    bench = set(pq.read_table(benchmark, columns=["content_hash"]).column("content_hash").to_pylist())
    seen = 0
    for path in training:
        hashes = pq.read_table(path, columns=["content_hash"]).column("content_hash").to_pylist()
        overlap = bench.intersection(hashes)
        if overlap:
            raise ValueError(f"{path}: {len(overlap)} training instance(s) are in the benchmark, e.g. {sorted(overlap)[0][:16]}")
        seen += len(hashes)
    return seen


def render_table(table: dict[str, Any], title: str) -> str:
    """Markdown in the paper's layout: one row per agent count, acc/opt per size and Sum."""
    sizes = sorted({int(n) for a in table.values() for n in a["sizes"]})
    lines = [f"### {title}", "", "| agents | " + " | ".join(f"{n}x{n}" for n in sizes) + " | Sum |",
             "|---|" + "---|" * (len(sizes) + 1)]
    for a, row in table.items():
        cells = [f"{100 * row['sizes'][str(n)]['acc']:.1f} / {100 * row['sizes'][str(n)]['opt']:.1f}" if str(n) in row["sizes"] else ""
                 for n in sizes]
        lines.append(f"| {a} | " + " | ".join(cells) + f" | **{100 * row['sum']['acc']:.2f} / {100 * row['sum']['opt']:.2f}** |")
    waits = sorted({w for a in table.values() for w in a["wait"]})
    lines += ["", "| agents | " + " | ".join(f"wait {w}" for w in waits) + " |", "|---|" + "---|" * len(waits)]
    for a, row in table.items():
        lines.append(f"| {a} | " + " | ".join(f"{100 * row['wait'][w]['acc']:.1f} / {100 * row['wait'][w]['opt']:.1f}"
                                              if w in row["wait"] else "" for w in waits) + " |")
    return "\n".join(lines)


def evaluate(benchmark: Path, trajectories: Path, training: list[Path], reference: Path | None) -> dict[str, Any]:
    """Benchmark metrics of one stage's policy (greedy answers already in ``trajectories``)."""
    wait_of = {r["content_hash"]: r["wait_subset"] for r in pq.read_table(benchmark, columns=["content_hash", "wait_subset"]).to_pylist()}
    rows = [{**r, "wait_subset": wait_of[r["content_hash"]]} for r in pq.read_table(trajectories).to_pylist()]
    table = cell_table(rows)
    checked = check_disjoint(benchmark, training)
    metrics = {"bench": {f"acc/{a}_agents": t["sum"]["acc"] for a, t in table.items()}
               | {f"opt/{a}_agents": t["sum"]["opt"] for a, t in table.items()},
               "bench_table": table, "disjoint": {"training_instances_checked": checked, "overlap": 0}}
    if reference is not None:
        metrics["reference"] = json.loads(Path(reference).read_text())
    return metrics


# ---------------------------------------------------------------------------------------------------------- CLI
def add_build_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=Path, required=True, help="params.yaml (section benchmark)")
    parser.add_argument("--out", type=Path, required=True, help="benchmark instances Parquet")
    parser.add_argument("--out-reference", type=Path, required=True, help="reference rows JSON (CBS, prioritized, independent)")
    parser.add_argument("--exclude", type=Path, action="append", default=[], help="instances that must not appear (validation)")
    parser.add_argument("--no-progress", action="store_true")


def run_build(args: argparse.Namespace) -> int:
    from tasks.generate_instances import read_exclusions

    try:
        settings = BenchmarkSettings.from_params(args.params)
        start = time.perf_counter()
        n = build_benchmark(settings, args.out, read_exclusions(args.exclude), not args.no_progress)
        reference = reference_rows(args.out)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    atomic_write_text(args.out_reference, json.dumps(reference, indent=2))
    print(f"benchmark: {n} instances in {time.perf_counter() - start:.1f} s; reference rows in {args.out_reference}")
    for name, table in reference.items():
        print(f"  {name}: " + ", ".join(f"{a} agents {100 * t['sum']['acc']:.1f}% valid" for a, t in table.items()))
    return 0


def add_evaluate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--benchmark", type=Path, required=True, help="benchmark instances Parquet")
    parser.add_argument("--trajectories", type=Path, required=True, help="the stage's rollout on the benchmark")
    parser.add_argument("--training", type=Path, action="append", default=[], help="training instances so far (repeatable)")
    parser.add_argument("--reference", type=Path, default=None, help="reference rows JSON to include")
    parser.add_argument("--out-metrics", type=Path, required=True, help="metrics JSON (dvc metrics)")
    parser.add_argument("--out-table", type=Path, required=True, help="markdown tables in the paper's layout")


def run_evaluate(args: argparse.Namespace) -> int:
    try:
        metrics = evaluate(args.benchmark, args.trajectories, args.training, args.reference)
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    atomic_write_text(args.out_metrics, json.dumps(metrics, indent=2))
    parts = [render_table(metrics["bench_table"], "Policy (valid / optimal, %)")]
    for name, table in (metrics.get("reference") or {}).items():
        parts.append(render_table(table, f"Reference: {name}"))
    parts.append(f"Training instances checked for overlap with the benchmark: {metrics['disjoint']['training_instances_checked']}, overlap 0.")
    atomic_write_text(args.out_table, "\n\n".join(parts) + "\n")
    print("benchmark: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in metrics["bench"].items()))
    return 0
