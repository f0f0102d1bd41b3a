"""The testbed's own commands: ``solve`` and ``check-plan`` (MovingAI ``.map``/``.scen`` files), ``render``,
``config-schema``, ``validate-config`` and ``diff-configs``.

Exit status: 0 success (solved / valid), 1 unsolvable or invalid plan, 2 bad input (the message names the file and
line). ``--json`` prints one JSON object: ``soc``, ``makespan``, ``paths`` for ``solve``; ``valid``, ``failure``,
``soc``, ``makespan`` (plus ``agent``, ``step``, ``detail`` of the failure) for ``check-plan``; a list of
``{field, a, b}`` for ``diff-configs``. Paths are per agent lists of ``[row, col]`` from time 0; agent numbers in
messages are 1-based.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from envgen.solver.cbs import Solved, SolverBudget, solve
from envgen.core.config import (DEFAULT_SIZES, MAX_SIZE, MIN_SIZE, ConfigError, EnvConfig, config_diff, describe_fields,
                           schema_json, shorten)
from envgen.core.instance import Instance
from envgen.formats.movingai import MovingAIError, load_instance
from envgen.core.simulate import Valid, check_paths


class PlanFileError(ValueError):
    """A malformed plan file; the message names the file and the line."""


def add_instance_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--map", required=True, type=Path, help="MovingAI .map file")
    parser.add_argument("--scen", required=True, type=Path, help="MovingAI .scen file (x is the column, y the row)")
    parser.add_argument("--agents", required=True, type=int, help="use the first K agents of the scenario")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def add_solve_arguments(parser: argparse.ArgumentParser) -> None:
    add_instance_arguments(parser)
    parser.add_argument("--max-nodes", type=int, default=SolverBudget.max_nodes, help="CBS node budget (default %(default)s)")
    parser.add_argument("--max-seconds", type=float, default=SolverBudget.max_seconds, help="time budget (default %(default)s)")


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    add_instance_arguments(parser)
    parser.add_argument("--plan", required=True, type=Path,
                        help="JSON plan: per agent a list of [row, col] cells from t=0, e.g. [[[0,0],[0,1]], [[1,1],[1,0]]]")


def _load(args: argparse.Namespace) -> Instance:
    return load_instance(args.map, args.scen, args.agents)


def run_solve(args: argparse.Namespace) -> int:
    try:
        inst = _load(args)
        budget = SolverBudget(max_nodes=args.max_nodes, max_seconds=args.max_seconds)
    except (MovingAIError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = solve(inst, budget)
    if isinstance(result, Solved):
        if args.json:
            print(json.dumps({"soc": result.soc, "makespan": result.makespan, "paths": [[list(c) for c in p] for p in result.paths]}))
        else:
            print(f"soc {result.soc}\nmakespan {result.makespan}")
            for a, p in enumerate(result.paths, start=1):
                print(f"agent {a}: " + " ".join(f"({r},{c})" for r, c in p))
        return 0
    if args.json:
        print(json.dumps({"soc": None, "makespan": None, "paths": None, "reason": result.reason.value, "detail": result.detail}))
    else:
        print(f"unsolved ({result.reason.value}): {result.detail}")
    return 1


MAX_PLAN_BYTES = 10_000_000
"""Largest plan file read (a plan of 100 agents over 10,000 steps is about 10 MB)."""


def load_plan(path: Path, num_agents: int) -> list[list[tuple[int, int]]]:
    """Read a JSON plan; raise :class:`PlanFileError` naming the file and line of the first problem."""
    from envgen.core.files import InputFileError, read_text_bounded

    try:
        text = read_text_bounded(path, MAX_PLAN_BYTES, "plan file (JSON)")
    except InputFileError as e:
        raise PlanFileError(str(e)) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanFileError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise PlanFileError(f"{path}: nested too deeply; a plan is a list of lists of [row, col] cells") from None
    except ValueError as e:  # a number of more than 4,300 digits
        raise PlanFileError(f"{path}: a value cannot be read ({str(e)[:120]})") from None
    if isinstance(data, dict) and "paths" in data:
        data = data["paths"]
    if not isinstance(data, list):
        raise PlanFileError(f"{path}:1: expected a list with one list of [row, col] cells per agent")
    cells = list(re.finditer(r"\[\s*-?\d+\s*,\s*-?\d+\s*\]", text))
    k = 0
    plan = []
    for a, agent in enumerate(data, start=1):
        if not isinstance(agent, list):
            raise PlanFileError(f"{path}:{_line(text, cells, k)}: agent {a}: expected a list of [row, col] cells, got {shorten(agent, 40)}")
        path_cells = []
        for t, cell in enumerate(agent):
            ok = isinstance(cell, list) and len(cell) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in cell)
            if not ok:
                raise PlanFileError(f"{path}:{_line(text, cells, k)}: agent {a} step {t}: expected [row, col] integers, got {shorten(cell, 40)}")
            path_cells.append((cell[0], cell[1]))
            k += 1
        plan.append(path_cells)
    return plan


def _line(text: str, cells: list[re.Match], k: int) -> int:
    """Line of the first token after the k well-formed cells read so far: where the malformed element starts."""
    pos = cells[k - 1].end() if k else 0
    while pos < len(text) and text[pos] in " \t\r\n,[]":
        pos += 1
    return text.count("\n", 0, pos) + 1


def run_check(args: argparse.Namespace) -> int:
    try:
        inst = _load(args)
        plan = load_plan(args.plan, inst.num_agents)
    except (MovingAIError, PlanFileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = check_paths(inst, plan)
    if isinstance(result, Valid):
        out = {"valid": True, "failure": None, "soc": result.soc, "makespan": result.makespan}
    else:
        out = {"valid": False, "failure": result.category.value, "soc": None, "makespan": None,
               "agent": None if result.agent is None else result.agent + 1, "step": result.step, "detail": result.detail}
    if args.json:
        print(json.dumps(out))
    elif result.valid:
        print(f"valid\nsoc {result.soc}\nmakespan {result.makespan}")
    else:
        print(f"invalid: {result.category.value}\n{result.detail}\nsoc -\nmakespan -")
    return 0 if result.valid else 1


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
        from envgen.formats.dataset import parse_instances, read_parquet

        table = read_parquet(args.instances, "an instances file", ["instance"])
        if not 0 <= args.index < table.num_rows:
            raise ValueError(f"--index {args.index}: {args.instances} has rows 0..{table.num_rows - 1}")
        return parse_instances([table.column("instance")[args.index].as_py()], f"{args.instances} (--index)")[0]
    if args.instance_file:
        from envgen.formats.dataset import MAX_INSTANCE_CHARS, parse_instances
        from envgen.core.files import read_text_bounded

        return parse_instances([read_text_bounded(args.instance_file, 4 * MAX_INSTANCE_CHARS, "instance file")],
                               args.instance_file)[0]
    if args.scen is None or args.agents is None:
        raise ValueError("--map needs --scen and --agents")
    return load_instance(args.map, args.scen, args.agents)


def run_render(args: argparse.Namespace) -> int:
    from envgen.core.render import render_ascii, render_coords, render_png

    try:
        inst = _instance(args)
        text = render_ascii(inst) + "\n\n" + render_coords(inst)
    except (ValueError, OSError, MovingAIError) as e:  # a text view labels at most 26 agents, A to Z
        print(f"error: {e}" + ("; give --agents 26 or fewer" if "at most" in str(e) and args.map else ""),
              file=sys.stderr)
        return 2
    print(text)
    if args.png:
        paths = None
        title = None
        if args.with_plan:
            from envgen.solver.cbs import Solved, solve

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
    """Map sizes from ``A-B`` or ``A,B,C``, each within MIN_SIZE..MAX_SIZE (checked before any range is built)."""
    shown = shorten(text, 40)
    try:
        if len(text) > 200:
            raise ValueError
        if "-" in text:
            lo, hi = (int(v) for v in text.split("-"))
            bounds = [lo, hi]
        else:
            bounds = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"--sizes {shown}: use 'A-B' or 'A,B,C' with whole numbers") from None
    if not bounds or any(not MIN_SIZE <= n <= MAX_SIZE for n in bounds):
        raise ValueError(f"--sizes {shown}: sizes must lie in {MIN_SIZE}..{MAX_SIZE}")
    return tuple(range(bounds[0], bounds[1] + 1)) if "-" in text else tuple(bounds)


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


def run_validate(args: argparse.Namespace) -> int:
    try:
        config = EnvConfig.load(args.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    alloc = config.allocation()
    print(f"{args.config}: valid; {config.budget} instances, {config.num_agents} agents; per size {alloc}")
    return 0


def add_diff_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", type=Path, help="a configuration YAML (e.g. data/stages/0/config.yaml)")
    parser.add_argument("b", type=Path, help="another one (e.g. data/stages/1/config.yaml)")
    parser.add_argument("--json", action="store_true", help="print a JSON list of {field, a, b}")


def run_diff(args: argparse.Namespace) -> int:
    try:
        a, b = EnvConfig.load(args.a), EnvConfig.load(args.b)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = config_diff(a, b)
    if args.json:
        print(json.dumps([{"field": f, "a": x, "b": y} for f, x, y in rows]))
        return 0
    if not rows:
        print(f"{args.a} and {args.b}: same configuration")
        return 0
    width = max(len(f) for f, _, _ in rows)
    print(f"{'field':<{width}}  {str(args.a):>14}  {str(args.b):>14}")
    for field, x, y in rows:
        arrow = "" if not isinstance(x, (int, float)) or not isinstance(y, (int, float)) else (" +" if y > x else " -")
        print(f"{field:<{width}}  {str(x):>14}  {str(y):>14}{arrow}")
    return 0
