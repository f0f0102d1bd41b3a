"""Pipeline step ``generate-instances``: an environment configuration in, a verified instances Parquet out.

Every generated instance's optimal plan is replayed through the simulator before it is written (its validity and its
SoC must match the solver's), so the file's ground truth is checked twice by independent code.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from envgen.config import EnvConfig
from envgen.dataset import write_instances
from envgen.generator import GenerationError, Generated, GeneratorOptions, generate
from envgen.simulate import Valid, check_paths
from tasks.tools import load_config_or_report


@dataclass(frozen=True)
class GenerateSummary:
    """What a run produced."""

    out: Path
    count: int
    seconds: float
    per_size: dict[int, int]
    wait_share: float


class VerificationError(RuntimeError):
    """The simulator disagreed with the solver: a bug, never a property of the data."""


def verify(g: Generated) -> None:
    """Replay the solver's plan through the simulator; raise :class:`VerificationError` on any disagreement."""
    result = check_paths(g.instance, g.solution.paths, g.solution.soc)
    if not isinstance(result, Valid) or not result.optimal or result.makespan != g.solution.makespan:
        raise VerificationError(f"slot {g.slot.index}: the simulator rejects the solver's plan ({result}) for\n{g.instance.to_str()}")


def generate_instances(config: EnvConfig, out: Path, exclude: frozenset[str] = frozenset(), progress: bool = True,
                       options: GeneratorOptions | None = None) -> GenerateSummary:
    """Generate, verify and write the stage's instances to ``out`` (atomically)."""
    from tqdm import tqdm

    start = time.perf_counter()
    bar = tqdm(total=config.budget, desc="generate-instances", unit="inst", disable=not progress, file=sys.stderr)
    rows = []
    try:
        for g in generate(config, options, exclude, on_progress=bar.update):
            verify(g)
            rows.append(g)
    finally:
        bar.close()
    write_instances(out, rows, config)
    per_size = Counter(g.slot.size for g in rows)
    waits = sum(g.solution.needs_wait for g in rows)
    return GenerateSummary(out, len(rows), time.perf_counter() - start, dict(sorted(per_size.items())), waits / max(1, len(rows)))


def read_exclusions(paths: list[Path]) -> frozenset[str]:
    """Content hashes of instances that must not be generated (for example the benchmark's)."""
    from envgen.dataset import read_instances

    hashes: set[str] = set()
    for p in paths:
        hashes.update(read_instances(p).column("content_hash").to_pylist())
    return frozenset(hashes)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, type=Path, help="environment configuration YAML (see `env-engineer config-schema`)")
    parser.add_argument("--section", default=None, help="read the configuration from this top-level section of the YAML "
                        "(e.g. --config params.yaml --section validation)")
    parser.add_argument("--out", required=True, type=Path, help="instances Parquet to write (atomically)")
    parser.add_argument("--exclude", type=Path, action="append", default=[], metavar="PARQUET",
                        help="instances file whose content hashes must not be generated (repeatable), e.g. the benchmark")
    parser.add_argument("--max-attempts", type=int, default=GeneratorOptions.max_attempts,
                        help="rejected draws allowed per instance before failing with an error that names the size (default %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    config = load_config_or_report(args.config, args.section)
    if config is None:
        return 2
    if args.max_attempts < 1:
        print(f"error: --max-attempts = {args.max_attempts}: must be at least 1", file=sys.stderr)
        return 2
    try:
        summary = generate_instances(config, args.out, read_exclusions(args.exclude), not args.no_progress,
                                     GeneratorOptions(max_attempts=args.max_attempts))
    except GenerationError as e:
        print(f"error: {args.config}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {summary.count} instances to {summary.out} in {summary.seconds:.1f} s "
          f"({summary.count / max(summary.seconds, 1e-9):.0f}/s); per size {summary.per_size}; "
          f"needs-wait share {summary.wait_share:.3f}")
    return 0
