"""Pipeline step ``build-benchmark``: the held-out benchmark in the paper's layout, and its reference rows.

For each agent count and wait subset (:func:`envgen.benchmark.cell_configs`, params.yaml's ``benchmark`` section,
its own seed), ``per_cell`` instances per map size, every one distinct from every other and from the ``--exclude``
files (the validation set). Training stages exclude the benchmark in turn, and ``evaluate`` re-checks that no
training instance is in it. Reference rows (``reference.json``): the optimal CBS plan and the reference planners on
every benchmark instance (:func:`envgen.benchmark.reference_rows`). What each cell's draws came to (accepted, rejected
and why, over the solver budget) is kept in the file's metadata (``generator_stats``) and printed
(:func:`envgen.benchmark.render_draws`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from envgen.benchmark import cell_configs, cell_label, reference_rows, render_draws
from envgen.dataset import generate_verified, generator_stats_of, read_exclusions, record_of, write_dataset
from envgen.files import atomic_write_text
from envgen.generator import GenerationError, draw_statistics
from envgen.schemas import BENCHMARK
from pipeline.params import BenchmarkSettings, ParamsError, add_params_arguments, load_params
from pipeline.progress import Progress


def build_benchmark(settings: BenchmarkSettings, out: Path, exclude: frozenset[str] = frozenset(),
                    progress: bool = True) -> list[dict[str, Any]]:
    """Generate, verify and write the benchmark instances; returns their rows."""
    cells = cell_configs(settings.seed, settings.per_cell, settings.wait_ratios, settings.hole_ratio, settings.agents)
    taken = set(exclude)
    rows: list[dict[str, Any]] = []
    draws: dict[str, dict[str, Any]] = {}
    with Progress(sum(c.config.budget for c in cells), "build-benchmark", "instances", progress) as bar:
        for cell in cells:
            made = []
            for g in generate_verified(cell.config, exclude=taken, on_progress=bar.update):
                taken.add(g.instance.content_hash)
                made.append(g)
                rows.append({**record_of(g, cell.config.seed), "index": len(rows), "wait_subset": cell.wait_ratio})
            draws[cell_label(cell)] = draw_statistics(made)
    write_dataset(out, rows, BENCHMARK, {"benchmark": settings.model_dump_json(),
                                         "generator_stats": json.dumps(draws, sort_keys=True)})
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_params_arguments(parser)
    parser.add_argument("--out", type=Path, required=True, help="benchmark instances Parquet")
    parser.add_argument("--out-reference", type=Path, required=True, help="reference rows JSON (CBS and the reference planners)")
    parser.add_argument("--exclude", type=Path, action="append", default=[], help="instances that must not appear (validation)")
    parser.add_argument("--no-progress", action="store_true", help="no progress (a bar in a terminal, else a line every 15 s)")


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    try:
        settings = load_params(args.params, args.set).benchmark
        rows = build_benchmark(settings, args.out, read_exclusions(args.exclude), not args.no_progress)
    except (ParamsError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except GenerationError as e:
        print(f"error: {args.params} (section benchmark): {e}", file=sys.stderr)
        return 1
    reference = reference_rows(rows)
    atomic_write_text(args.out_reference, json.dumps(reference, indent=2))
    print(f"benchmark: {len(rows)} instances in {time.perf_counter() - start:.1f} s; reference rows in {args.out_reference}")
    print("draws per cell (over solver budget: neither solved nor proved unsolvable, possibly solvable, left out):")
    print(render_draws(generator_stats_of(args.out)))
    for name, table in reference.items():
        print(f"  {name}: " + ", ".join(f"{a} agents {100 * t['sum']['acc']:.1f}% valid" for a, t in table.items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="env-engineer build-benchmark", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
