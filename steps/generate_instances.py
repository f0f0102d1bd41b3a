"""Pipeline step ``generate-instances``: a stage's environment configuration in, a verified instances Parquet out.

Every instance is drawn by :mod:`envgen.generator`, solved optimally within the solver budget (``--solver-nodes``,
``--solver-joint-states``, ``--solver-seconds``), and its plan replayed through the simulator before it is written
(:func:`envgen.formats.dataset.generate_verified`). Instances of the ``--exclude`` files (the validation set, the benchmark) are
never drawn. The file's metadata and the report line say what the draws came to: how many were rejected and why, the
draws over the solver budget (possibly solvable instances left out) among them.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from envgen.core.config import ConfigError, EnvConfig
from envgen.formats.dataset import generate_verified, read_exclusions, write_instances
from envgen.generator import GenerationError, GeneratorOptions, draw_statistics
from pipeline.progress import Progress


@dataclass(frozen=True)
class GenerateSummary:
    """What a run produced."""

    out: Path
    count: int
    seconds: float
    per_size: dict[int, int]
    wait_share: float
    draws: dict[str, Any]
    """:func:`envgen.generator.draw_statistics` of the run."""


def generate_instances(config: EnvConfig, out: Path, exclude: frozenset[str] = frozenset(), progress: bool = True,
                       options: GeneratorOptions | None = None, label: str = "generate-instances") -> GenerateSummary:
    """Generate, verify and write the instances of ``config`` to ``out`` (atomically)."""
    start = time.perf_counter()
    with Progress(config.budget, label, "instances", progress) as bar:
        rows = list(generate_verified(config, options, exclude, on_progress=bar.update))
    write_instances(out, rows, config, options)
    per_size = Counter(g.slot.size for g in rows)
    waits = sum(g.solution.needs_wait for g in rows)
    return GenerateSummary(out, len(rows), time.perf_counter() - start, dict(sorted(per_size.items())),
                           waits / max(1, len(rows)), draw_statistics(rows, options))


def report(summary: GenerateSummary) -> str:
    """One line about a finished run, with what its draws came to."""
    draws = summary.draws
    why = ", ".join(f"{reason} {count}" for reason, count in sorted(draws["rejected"].items())) or "none"
    return (f"wrote {summary.count} instances to {summary.out} in {summary.seconds:.1f} s "
            f"({summary.count / max(summary.seconds, 1e-9):.0f}/s); per size {summary.per_size}; "
            f"needs-wait share {summary.wait_share:.3f}; {draws['draws']} draws, rejected: {why}; "
            f"over solver budget (possibly solvable, left out): {draws['over_budget']}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, type=Path, help="environment configuration YAML (see `env-engineer config-schema`)")
    parser.add_argument("--out", required=True, type=Path, help="instances Parquet to write (atomically)")
    parser.add_argument("--exclude", type=Path, action="append", default=[], metavar="PARQUET",
                        help="instances file whose instances must not be generated (repeatable), e.g. the benchmark")
    parser.add_argument("--max-attempts", type=int, default=GeneratorOptions.max_attempts,
                        help="rejected draws allowed per instance before failing with an error that names the size (default %(default)s)")
    budget = GeneratorOptions().budget
    parser.add_argument("--solver-nodes", type=int, default=budget.max_nodes,
                        help="CBS nodes each draw's solve may expand per group of agents (default %(default)s)")
    parser.add_argument("--solver-joint-states", type=int, default=budget.max_joint_states,
                        help="states each exhaustive search of a hard draw may visit; 0: none (default %(default)s)")
    parser.add_argument("--solver-seconds", type=float, default=budget.max_seconds,
                        help="safety time limit of each draw's solve; a draw that reaches it makes the file depend on "
                        "the machine (default %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress (a bar in a terminal, else a line every 15 s)")


def options_of(args: argparse.Namespace) -> GeneratorOptions:
    """The generator options the command line asks for; ValueError names a bad flag and its allowed range."""
    checks = (("--max-attempts", args.max_attempts, 1), ("--solver-nodes", args.solver_nodes, 1),
              ("--solver-joint-states", args.solver_joint_states, 0))
    for flag, value, low in checks:
        if value < low:
            raise ValueError(f"{flag} = {value}: must be at least {low}")
    if not args.solver_seconds > 0:
        raise ValueError(f"--solver-seconds = {args.solver_seconds}: must be positive")
    solver = replace(GeneratorOptions().budget, max_nodes=args.solver_nodes, max_joint_states=args.solver_joint_states,
                     max_seconds=args.solver_seconds)
    return GeneratorOptions(max_attempts=args.max_attempts, solver=solver)


def run(args: argparse.Namespace) -> int:
    try:
        options = options_of(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        config = EnvConfig.load(args.config)
        summary = generate_instances(config, args.out, read_exclusions(args.exclude), not args.no_progress, options)
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
