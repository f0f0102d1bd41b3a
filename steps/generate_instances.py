"""Pipeline step ``generate-instances``: a stage's environment configuration in, a verified instances Parquet out.

Every instance is drawn by :mod:`envgen.generator`, solved optimally, and its plan replayed through the simulator
before it is written (:func:`envgen.dataset.generate_verified`). Instances of the ``--exclude`` files (the validation
set, the benchmark) are never drawn.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from envgen.config import ConfigError, EnvConfig
from envgen.dataset import generate_verified, read_exclusions, write_instances
from envgen.generator import GenerationError, GeneratorOptions
from pipeline.progress import Progress


@dataclass(frozen=True)
class GenerateSummary:
    """What a run produced."""

    out: Path
    count: int
    seconds: float
    per_size: dict[int, int]
    wait_share: float


def generate_instances(config: EnvConfig, out: Path, exclude: frozenset[str] = frozenset(), progress: bool = True,
                       options: GeneratorOptions | None = None, label: str = "generate-instances") -> GenerateSummary:
    """Generate, verify and write the instances of ``config`` to ``out`` (atomically)."""
    start = time.perf_counter()
    with Progress(config.budget, label, "instances", progress) as bar:
        rows = list(generate_verified(config, options, exclude, on_progress=bar.update))
    write_instances(out, rows, config)
    per_size = Counter(g.slot.size for g in rows)
    waits = sum(g.solution.needs_wait for g in rows)
    return GenerateSummary(out, len(rows), time.perf_counter() - start, dict(sorted(per_size.items())), waits / max(1, len(rows)))


def report(summary: GenerateSummary) -> str:
    """One line about a finished run."""
    return (f"wrote {summary.count} instances to {summary.out} in {summary.seconds:.1f} s "
            f"({summary.count / max(summary.seconds, 1e-9):.0f}/s); per size {summary.per_size}; "
            f"needs-wait share {summary.wait_share:.3f}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, type=Path, help="environment configuration YAML (see `env-engineer config-schema`)")
    parser.add_argument("--out", required=True, type=Path, help="instances Parquet to write (atomically)")
    parser.add_argument("--exclude", type=Path, action="append", default=[], metavar="PARQUET",
                        help="instances file whose instances must not be generated (repeatable), e.g. the benchmark")
    parser.add_argument("--max-attempts", type=int, default=GeneratorOptions.max_attempts,
                        help="rejected draws allowed per instance before failing with an error that names the size (default %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress (a bar in a terminal, else a line every 15 s)")


def run(args: argparse.Namespace) -> int:
    if args.max_attempts < 1:
        print(f"error: --max-attempts = {args.max_attempts}: must be at least 1", file=sys.stderr)
        return 2
    try:
        config = EnvConfig.load(args.config)
        summary = generate_instances(config, args.out, read_exclusions(args.exclude), not args.no_progress,
                                     GeneratorOptions(max_attempts=args.max_attempts))
    except GenerationError as e:
        print(f"error: {args.config}: {e}", file=sys.stderr)
        return 1
    except (ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="env-engineer generate-instances", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
