"""Small commands: ``render``, ``config-schema``, ``validate-config``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from envgen.config import DEFAULT_SIZES, MAX_SIZE, MIN_SIZE, ConfigError, EnvConfig, describe_fields, schema_json
from envgen.instance import Instance, InstanceError
from envgen.movingai import MovingAIError, load_instance


def add_render_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--instances", type=Path, help="instances Parquet; pick a row with --index")
    src.add_argument("--instance-file", type=Path, help="an instance in the text format (Instance.to_str)")
    src.add_argument("--map", type=Path, help="MovingAI .map (with --scen and --agents)")
    parser.add_argument("--index", type=int, default=0, help="row of --instances (default 0)")
    parser.add_argument("--scen", type=Path, help="MovingAI .scen (with --map)")
    parser.add_argument("--agents", type=int, help="first K agents of --scen")
    parser.add_argument("--png", type=Path, help="write a PNG of the instance here")
    parser.add_argument("--with-plan", action="store_true", help="solve and draw the optimal plan on the PNG")


def _instance(args: argparse.Namespace) -> Instance:
    if args.instances:
        from envgen.dataset import read_instances

        table = read_instances(args.instances)
        if not 0 <= args.index < table.num_rows:
            raise ValueError(f"--index {args.index}: {args.instances} has rows 0..{table.num_rows - 1}")
        return Instance.from_str(table.column("instance")[args.index].as_py())
    if args.instance_file:
        try:
            return Instance.from_str(args.instance_file.read_text(encoding="utf-8"))
        except InstanceError as e:
            raise ValueError(f"{args.instance_file}: {e}") from None
    if args.scen is None or args.agents is None:
        raise ValueError("--map needs --scen and --agents")
    return load_instance(args.map, args.scen, args.agents)


def run_render(args: argparse.Namespace) -> int:
    from envgen.render import render_ascii, render_coords, render_png

    try:
        inst = _instance(args)
    except (ValueError, OSError, MovingAIError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render_ascii(inst))
    print()
    print(render_coords(inst))
    if args.png:
        paths = None
        title = None
        if args.with_plan:
            from envgen.cbs import Solved, solve

            result = solve(inst)
            if isinstance(result, Solved):
                paths, title = result.paths, f"optimal plan: SoC {result.soc}, makespan {result.makespan}"
            else:
                title = f"unsolved: {result.reason.value}"
        render_png(inst, args.png, paths, title=title)
        print(f"\nwrote {args.png}")
    return 0


def add_schema_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=f"{DEFAULT_SIZES[0]}-{DEFAULT_SIZES[-1]}",
                        help=f"map sizes the schema requires, as 'A-B' or 'A,B,C' within {MIN_SIZE}..{MAX_SIZE} (default %(default)s)")
    parser.add_argument("--describe", action="store_true", help="print a plain-text field reference instead of the JSON schema")


def parse_sizes(text: str) -> tuple[int, ...]:
    try:
        if "-" in text:
            lo, hi = (int(v) for v in text.split("-"))
            sizes = tuple(range(lo, hi + 1))
        else:
            sizes = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--sizes {text!r}: use 'A-B' or 'A,B,C' with whole numbers") from None
    if not sizes or any(not MIN_SIZE <= n <= MAX_SIZE for n in sizes):
        raise ValueError(f"--sizes {text!r}: sizes must lie in {MIN_SIZE}..{MAX_SIZE}")
    return sizes


def run_schema(args: argparse.Namespace) -> int:
    if args.describe:
        print(describe_fields())
        return 0
    try:
        print(schema_json(parse_sizes(args.sizes)))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def add_validate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="environment configuration YAML")


def tool_env() -> dict[str, str]:
    """The environment for running ``dvc`` and ``env-engineer`` as subprocesses: this Python's ``bin`` folder first on
    PATH (so a virtualenv works without being activated) and DVC analytics off."""
    import os

    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", "DVC_NO_ANALYTICS": "1"}


def parse_overrides(items: list[str]) -> dict:
    """``--set KEY=VALUE`` items as a mapping; values are read as YAML (``64``, ``false``, ``[a, b]``)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r}: use KEY=VALUE")
        out[key.strip()] = yaml.safe_load(value)
    return out


def load_config_or_report(path: Path, section: str | None = None) -> EnvConfig | None:
    """The configuration (the whole YAML file, or one of its top-level sections such as params.yaml's ``env``), or
    None after printing its problems to stderr (the caller exits with status 2)."""
    try:
        if section is None:
            return EnvConfig.load(path)
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict) or not isinstance(data.get(section), dict):
            raise ConfigError(f"{path}: no section '{section}' holding an environment configuration")
        return EnvConfig.parse(data[section], f"{path} (section {section})")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    except (OSError, yaml.YAMLError) as e:
        print(f"error: {path}: {e}", file=sys.stderr)
        return None


def run_validate(args: argparse.Namespace) -> int:
    config = load_config_or_report(args.config)
    if config is None:
        return 2
    alloc = config.allocation()
    print(f"{args.config}: valid; {config.budget} instances, {config.num_agents} agents; per size {alloc}")
    return 0
