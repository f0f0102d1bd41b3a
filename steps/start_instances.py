"""Pipeline step ``start-instances``: the demonstrations of the shared starting policy, from params.yaml's ``start``
section.

Every environment of ``start.instances`` (e.g. two-agent boards 3x3..10x10 and three-agent boards 4x4..7x7) is
generated with its own seed, verified like every instance (:func:`envgen.dataset.generate_verified`) and pooled into
one instances file; no instance repeats across them. The validation set and the benchmark exclude these instances
(their stages read this file), so the starting policy is never evaluated on a board it was trained on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from envgen.config import EnvConfig
from envgen.dataset import generate_verified, record_of, write_dataset
from envgen.generator import GENERATOR_VERSION, GenerationError
from envgen.schemas import INSTANCES
from pipeline.params import ParamsError, add_params_arguments, load_params
from pipeline.progress import Progress


def start_instances(configs: list[EnvConfig], out: Path, progress: bool = True) -> int:
    """Generate, verify and write the pooled instances of ``configs`` (in order); returns their number."""
    rows: list[dict] = []
    taken: set[str] = set()
    with Progress(sum(c.budget for c in configs), "start-instances", "instances", progress) as bar:
        for config in configs:
            for g in generate_verified(config, exclude=taken, on_progress=bar.update):
                taken.add(g.instance.content_hash)
                rows.append({**record_of(g, config.seed), "index": len(rows)})
    metadata = {"env_configs": json.dumps([c.to_yaml() for c in configs]), "generator_version": GENERATOR_VERSION}
    return write_dataset(out, rows, INSTANCES, metadata, row_group_size=max(1, len(rows)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_params_arguments(parser)
    parser.add_argument("--out", required=True, type=Path, help="instances Parquet to write (atomically)")
    parser.add_argument("--no-progress", action="store_true", help="no progress (a bar in a terminal, else a line every 15 s)")


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    try:
        configs = load_params(args.params, args.set).start.instances
        count = start_instances(configs, args.out, not args.no_progress)
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except GenerationError as e:
        print(f"error: {args.params} (section start.instances): {e}", file=sys.stderr)
        return 1
    print(f"wrote {count} starting-policy demonstrations to {args.out} in {time.perf_counter() - start:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="env-engineer start-instances", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
