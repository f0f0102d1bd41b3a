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
import os
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from envgen.benchmark import cell_configs, cell_label, reference_rows, render_draws
from envgen.core.config import EnvConfig
from envgen.formats.dataset import generate_verified, generator_stats_of, read_exclusions, record_of, write_dataset
from envgen.core.files import atomic_write_text
from envgen.generator import GenerationError, Generated, draw_statistics
from envgen.formats.schemas import BENCHMARK
from pipeline.params import BenchmarkSettings, ParamsError, add_params_arguments, load_params
from pipeline.progress import Progress
from pipeline.workers import worker_pool


def cell_instances(config: EnvConfig, exclude: frozenset[str]) -> list[Generated]:
    """One cell's verified instances, drawn without the ``exclude`` hashes (a process pool's task)."""
    return list(generate_verified(config, exclude=exclude))


def default_workers() -> int:
    """Processes for building the benchmark when ``--workers`` is not given: the cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def build_benchmark(settings: BenchmarkSettings, out: Path, exclude: frozenset[str] = frozenset(),
                    progress: bool = True, workers: int = 1) -> list[dict[str, Any]]:
    """Generate, verify and write the benchmark instances; returns their rows.

    Cell by cell in order, each cell's draws excluding every instance taken before it. With ``workers`` > 1 the cells
    are drawn at once in a process pool, each excluding only ``exclude``; then, in order, a cell that drew an instance
    an earlier cell took is drawn again here with everything taken so far excluded. A cell that drew none made every
    decision the one-by-one build makes (the solver's limits count work, not time), so the file is the same byte for
    byte whatever ``workers`` is."""
    if workers < 1:
        raise ValueError(f"--workers {workers}: give at least 1 process")
    cells = cell_configs(settings.seed, settings.per_cell, settings.wait_ratios, settings.hole_ratio, settings.agents)
    taken = set(exclude)
    rows: list[dict[str, Any]] = []
    draws: dict[str, dict[str, Any]] = {}
    with Progress(sum(c.config.budget for c in cells), "build-benchmark", "instances", progress) as bar:
        drawn: list[Future[list[Generated]] | None] = [None] * len(cells)
        pool = worker_pool(min(workers, len(cells))) if workers > 1 and len(cells) > 1 else None
        try:
            if pool is not None:
                frozen = frozenset(exclude)
                drawn = [pool.submit(cell_instances, cell.config, frozen) for cell in cells]
                for future in drawn:
                    future.add_done_callback(lambda f: bar.update(len(f.result())) if not f.exception() else None)
            for cell, future in zip(cells, drawn):
                made = future.result() if future is not None else None
                if made is None or any(g.instance.content_hash in taken for g in made):
                    made = list(generate_verified(cell.config, exclude=taken,
                                                  on_progress=bar.update if future is None else None))
                for g in made:
                    taken.add(g.instance.content_hash)
                    rows.append({**record_of(g, cell.config.seed), "index": len(rows), "wait_subset": cell.wait_ratio})
                draws[cell_label(cell)] = draw_statistics(made)
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)
    write_dataset(out, rows, BENCHMARK, {"benchmark": settings.model_dump_json(),
                                         "generator_stats": json.dumps(draws, sort_keys=True)})
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_params_arguments(parser)
    parser.add_argument("--out", type=Path, required=True, help="benchmark instances Parquet")
    parser.add_argument("--out-reference", type=Path, required=True, help="reference rows JSON (CBS and the reference planners)")
    parser.add_argument("--exclude", type=Path, action="append", default=[], help="instances that must not appear (validation)")
    parser.add_argument("--no-progress", action="store_true", help="no progress (a bar in a terminal, else a line every 15 s)")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes that draw the cells and answer the reference rows at once (default: the cores "
                        "this process may use); the files are the same whatever the number")


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    try:
        settings = load_params(args.params, args.set).benchmark
        workers = args.workers if args.workers is not None else default_workers()
        rows = build_benchmark(settings, args.out, read_exclusions(args.exclude), not args.no_progress, workers)
    except (ParamsError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except GenerationError as e:
        print(f"error: {args.params} (section benchmark): {e}", file=sys.stderr)
        return 1
    if workers > 1:
        with worker_pool(workers) as pool:
            reference = reference_rows(rows, lambda f, xs: pool.map(f, xs, chunksize=32))
    else:
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
