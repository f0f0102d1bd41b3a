"""Pipeline step ``validation-set``: the held-out validation instances, from params.yaml's ``validation`` section.

Generated once per pipeline (its own seed), verified like every instance (:func:`envgen.formats.dataset.generate_verified`);
every training stage and the benchmark exclude them, and they exclude the starting policy's demonstrations
(``--exclude``), so the policy is validated on boards it never trained on.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from envgen.core.config import EnvConfig
from envgen.formats.dataset import generate_verified, read_exclusions, write_instances
from envgen.generator import GenerationError
from pipeline.params import ParamsError, add_params_arguments, load_params
from pipeline.progress import Progress


def validation_set(config: EnvConfig, out: Path, progress: bool = True, exclude: frozenset[str] = frozenset()) -> int:
    """Generate, verify and write the validation instances of ``config``, none of them in ``exclude`` (content
    hashes); returns their number."""
    with Progress(config.budget, "validation-set", "instances", progress) as bar:
        rows = list(generate_verified(config, exclude=exclude, on_progress=bar.update))
    return write_instances(out, rows, config)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_params_arguments(parser)
    parser.add_argument("--out", required=True, type=Path, help="validation instances Parquet to write (atomically)")
    parser.add_argument("--exclude", type=Path, action="append", default=[], metavar="PARQUET",
                        help="instances file whose instances must not be drawn (repeatable), e.g. the starting policy's")
    parser.add_argument("--no-progress", action="store_true", help="no progress (a bar in a terminal, else a line every 15 s)")


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    try:
        config = load_params(args.params, args.set).validation
        count = validation_set(config, args.out, not args.no_progress, read_exclusions(args.exclude))
    except (ParamsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except GenerationError as e:
        print(f"error: {args.params} (section validation): {e}", file=sys.stderr)
        return 1
    print(f"wrote {count} validation instances to {args.out} in {time.perf_counter() - start:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="env-engineer validation-set", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
