"""Pipeline step ``start-instances``: the demonstrations of the shared starting policy, from params.yaml's ``start``
section.

Every environment of ``start.instances`` (e.g. two-agent boards 3x3..10x10 and three-agent boards 4x4..7x7) is
generated with its own seed, verified like every instance (:func:`envgen.formats.dataset.generate_verified`) and pooled into
one instances file; no instance repeats across them. The generator version is ``start.generator_version`` (1: the
version the kept starting policy was trained on, so the file regenerates byte for byte; its draw counts are printed,
not stored, as when that version wrote it). The validation set and the benchmark exclude these instances
(their stages read this file), so the starting policy is never evaluated on a board it was trained on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from envgen.core.config import EnvConfig
from envgen.formats.dataset import generate_verified, record_of, write_dataset
from envgen.generator import GenerationError, GeneratorOptions, draw_statistics
from envgen.formats.schemas import INSTANCES
from pipeline.params import ParamsError, add_params_arguments, load_params
from pipeline.progress import Progress


def start_instances(configs: list[EnvConfig], out: Path, progress: bool = True,
                    options: GeneratorOptions | None = None) -> tuple[int, dict]:
    """Generate, verify and write the pooled instances of ``configs`` (in order) with the generator ``options``;
    returns their number and what the draws came to (:func:`envgen.generator.draw_statistics`)."""
    options = options or GeneratorOptions(version=1)
    rows: list[dict] = []
    made = []
    taken: set[str] = set()
    with Progress(sum(c.budget for c in configs), "start-instances", "instances", progress) as bar:
        for config in configs:
            for g in generate_verified(config, options, exclude=taken, on_progress=bar.update):
                taken.add(g.instance.content_hash)
                made.append(g)
                rows.append({**record_of(g, config.seed), "index": len(rows)})
    metadata = {"env_configs": json.dumps([c.to_yaml() for c in configs]), "generator_version": options.version_name}
    if options.version > 1:
        metadata["generator_stats"] = json.dumps(draw_statistics(made, options), sort_keys=True)
    return write_dataset(out, rows, INSTANCES, metadata, row_group_size=max(1, len(rows))), draw_statistics(made, options)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_params_arguments(parser)
    parser.add_argument("--out", required=True, type=Path, help="instances Parquet to write (atomically)")
    parser.add_argument("--no-progress", action="store_true", help="no progress (a bar in a terminal, else a line every 15 s)")


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    try:
        start_settings = load_params(args.params, args.set).start
        count, draws = start_instances(start_settings.instances, args.out, not args.no_progress,
                                       GeneratorOptions(version=start_settings.generator_version))
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except GenerationError as e:
        print(f"error: {args.params} (section start.instances): {e}", file=sys.stderr)
        return 1
    why = ", ".join(f"{reason} {n}" for reason, n in sorted(draws["rejected"].items())) or "none"
    print(f"wrote {count} starting-policy demonstrations to {args.out} in {time.perf_counter() - start:.1f} s "
          f"(generator {draws['generator_version']}); {draws['draws']} draws, rejected: {why}; over solver budget "
          f"(possibly solvable, left out): {draws['over_budget']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="env-engineer start-instances", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
