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
from pathlib import Path
from typing import Any

from envgen.benchmark import cell_configs, cell_label, reference_rows, render_draws
from envgen.core.config import EnvConfig
from envgen.formats.dataset import generator_stats_of, read_exclusions, record_of, verify, write_dataset
from envgen.core.files import atomic_write_text
from envgen.generator import GenerationError, Generated, GeneratorOptions, Slot, draw_statistics, fill_slot, slot_layout
from envgen.formats.schemas import BENCHMARK
from pipeline.params import BenchmarkSettings, ParamsError, add_params_arguments, load_params
from pipeline.progress import Progress
from pipeline.workers import worker_pool


def slot_instance(slot: Slot, config: EnvConfig, taken: set[str], drawn: list[str] | None = None) -> Generated:
    """One slot of a cell, drawn as :func:`envgen.generator.generate` draws it (its own random stream, nothing in
    ``taken``; the instance's hash is added to it; ``drawn`` gets every draw's hash) and verified by the simulator."""
    g = fill_slot(slot, config, GeneratorOptions(), taken, drawn)
    verify(g)
    return g


def slot_instances(slots: list[tuple[Slot, EnvConfig]],
                   exclude: frozenset[str]) -> list[tuple[Generated, list[str]]]:
    """Slots (each with its cell's configuration), each drawn excluding only ``exclude``, with the hash of every
    instance it drew: a process pool's task."""
    out = []
    for slot, config in slots:
        drawn: list[str] = []
        out.append((slot_instance(slot, config, set(exclude), drawn), drawn))
    return out


def default_workers() -> int:
    """Processes for building the benchmark when ``--workers`` is not given: the cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def build_benchmark(settings: BenchmarkSettings, out: Path, exclude: frozenset[str] = frozenset(),
                    progress: bool = True, workers: int = 1) -> list[dict[str, Any]]:
    """Generate, verify and write the benchmark instances; returns their rows.

    Slot by slot in order (cell by cell, each cell's slots as :func:`envgen.generator.generate` lays them out), each
    slot's draws excluding every instance taken before it. With ``workers`` > 1 the slots are drawn at once in a process
    pool, each excluding only ``exclude`` (every slot has a random stream of its own); then, in order, a slot that drew
    an instance this build took before it is drawn again here with everything taken so far excluded. The others made
    every decision the one-by-one build makes (the solver's limits count work, not time), so the file is the same byte
    for byte whatever ``workers`` is; one heavy cell (five agents, few boards needing a wait) no longer sets the
    time."""
    if workers < 1:
        raise ValueError(f"--workers {workers}: give at least 1 process")
    cells = cell_configs(settings.seed, settings.per_cell, settings.wait_ratios, settings.hole_ratio, settings.agents)
    slots = [(cell, slot) for cell in cells for slot in slot_layout(cell.config)]
    taken = set(exclude)
    accepted: set[str] = set()  # taken by this build: a slot drawn in the pool did not see these
    rows: list[dict[str, Any]] = []
    made: dict[str, list[Generated]] = {cell_label(cell): [] for cell in cells}
    with Progress(len(slots), "build-benchmark", "instances", progress) as bar:
        drawn: list[tuple[Generated, list[str]] | None] = [None] * len(slots)
        pool = worker_pool(min(workers, len(slots))) if workers > 1 and len(slots) > 1 else None
        try:
            if pool is not None:  # tasks of every k-th slot, so that the heavy cells' slots spread over the workers
                tasks = min(len(slots), 8 * workers)
                frozen = frozenset(exclude)
                futures = [pool.submit(slot_instances, [(slot, cell.config) for cell, slot in slots[k::tasks]], frozen)
                           for k in range(tasks)]
                for future in futures:
                    future.add_done_callback(lambda f: bar.update(len(f.result())) if not f.exception() else None)
                for k, future in enumerate(futures):
                    drawn[k::tasks] = future.result()
            for (cell, slot), pooled in zip(slots, drawn):
                if pooled is None or any(digest in accepted for digest in pooled[1]):
                    g = slot_instance(slot, cell.config, taken)
                    if pool is None:
                        bar.update(1)
                else:
                    g = pooled[0]
                    taken.add(g.instance.content_hash)
                accepted.add(g.instance.content_hash)
                rows.append({**record_of(g, cell.config.seed), "index": len(rows), "wait_subset": cell.wait_ratio})
                made[cell_label(cell)].append(g)
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)
    draws = {label: draw_statistics(generated) for label, generated in made.items()}
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
