"""Benchmark of the solver: the project's CBS against the plain search and, where given, an external solver, on the
same instances. A script, not a test.

    taskset -c 1 python bench/solver.py [--sets training,dense5,jmorag] [--count 300] [--external PATH]
        [--movingai empty-16-16:random-1:20,30] [--largest random-32-32-10:random-1] [--json out.json]
        [--option rectangle_reasoning=false] [--external-args="--rectangleReasoning R"]

Sets: ``training`` (2 agents, sizes 3..10, 20% holes, half of them head-on draws, as the generator draws its wait
slots), ``dense5`` (5 agents on 10x10 with half the cells holes), ``jmorag`` (the 38 J-morag 32x32 instances of
tests/data, 5-20 agents, with their published optima), ``movingai`` (``--movingai MAP:SCEN:K1,K2``: the first K agents
of a MovingAI scenario from ../shared/mapf-benchmarks or tests/data). ``--largest MAP:SCEN`` adds agents one at a time
until a solver passes ``--cutoff`` seconds.

The project's solver (every improvement on, :class:`envgen.solver.cbs.CBSOptions`; ``--conflict-ties pairs`` for CBSH2-RTC's
choice among equal conflicts, ``--option NAME=VALUE`` for any other option) and the plain search
(:meth:`CBSOptions.plain`, with the same exhaustive back-ups) run in this process, timed by CPU time
(``time.process_time``), after the map and the goals' distance tables are built (:func:`preprocess`). The external
solver is CBSH2-RTC's ``cbs`` binary (github.com/Jiaoyang-Li/CBSH2-RTC, built from source), run with
``--corridorReasoning None`` (and ``--external-args="--rectangleReasoning R"``, say; an option given there replaces
the default) on the same instance written as MovingAI files and timed by its own clock (``runtime``:
CPU seconds of its search, without loading the map or building its heuristic tables). Printed per set: instances
solved by each, node counts (median, p95), CPU ms (median, p95, max), and the geometric mean of the per-instance
ratios project/plain and project/external over the instances both solved; sums of costs must agree (a disagreement is
reported, never hidden).
Pin the process to one core (taskset) for numbers worth comparing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from envgen.solver.cbs import CBSOptions, Solved, SolverBudget, solve  # noqa: E402
from envgen.core.config import SizeConfig  # noqa: E402
from envgen.generator import draw_instance  # noqa: E402
from envgen.core.grid import grid_of  # noqa: E402
from envgen.core.instance import HOLE, Instance  # noqa: E402
from envgen.formats.movingai import load_instance  # noqa: E402

SHARED = ROOT.parent / "shared" / "mapf-benchmarks"
TESTS = ROOT / "tests" / "data"


@dataclass(frozen=True)
class Run:
    """One solver on one instance: ``soc`` None when not solved within the cutoff (or proved unsolvable)."""

    soc: int | None
    nodes: int
    cpu_ms: float
    status: str


def draws(count: int, seed: int, agents: int, sizes: tuple[int, ...], holes: float, head_on_share: float) -> list[Instance]:
    rng = random.Random(seed)
    out: list[Instance] = []
    while len(out) < count:
        inst = draw_instance(rng, rng.choice(sizes), SizeConfig(data_ratio=1.0, hole_ratio=holes), agents,
                             head_on=rng.random() < head_on_share)
        if inst is not None:
            out.append(inst)
    return out


def bench_file(*parts: str) -> Path:
    for base in (SHARED, TESTS):
        if (path := base.joinpath(*parts)).exists():
            return path
    raise FileNotFoundError(f"{'/'.join(parts)} in neither {SHARED} nor {TESTS}")


def jmorag() -> list[Instance]:
    folder = TESTS / "jmorag-testingbenchmark"
    out = []
    for scen in sorted(folder.glob("Instance-*.scen"), key=lambda p: [int(x) for x in p.stem.split("-")[1:]]):
        agents = int(scen.stem.split("-")[3])
        out.append(load_instance(scen.with_suffix(".map"), scen, agents))
    return out


def movingai(spec: str) -> list[Instance]:
    """``MAP:SCEN:K1,K2``: e.g. ``empty-16-16:random-1:20,30``."""
    name, scen, counts = spec.split(":")
    return [load_instance(bench_file(name, f"{name}.map"), bench_file(name, f"{name}-{scen}.scen"), int(k))
            for k in counts.split(",")]


def preprocess(inst: Instance) -> None:
    """Load the map and build every goal's distance table before the clock starts, as CBSH2-RTC does: its
    ``runtime`` leaves out loading and the single-agent heuristic tables (``runtime_preprocessing``, apart). The
    grid and its tables are memoised, so :func:`solve` finds them built."""
    grid = grid_of(inst.rows)
    for goal in inst.goals:
        grid.distances_from(grid.index(goal))


def run_project(inst: Instance, options: CBSOptions, cutoff: float) -> Run:
    budget = SolverBudget(max_nodes=10**9, max_seconds=cutoff)
    preprocess(inst)
    start = time.process_time()
    result = solve(inst, budget, options)
    ms = (time.process_time() - start) * 1e3
    if isinstance(result, Solved):
        return Run(result.soc, result.nodes, ms, "solved")
    return Run(None, result.nodes, ms, result.reason.value)


def write_movingai(inst: Instance, folder: Path) -> tuple[Path, Path]:
    mp, sc = folder / "x.map", folder / "x.scen"
    rows = ["".join("@" if c == HOLE else "." for c in row) for row in inst.rows]
    mp.write_text(f"type octile\nheight {inst.height}\nwidth {inst.width}\nmap\n" + "\n".join(rows) + "\n")
    lines = ["version 1"] + [f"0\tx.map\t{inst.width}\t{inst.height}\t{s[1]}\t{s[0]}\t{g[1]}\t{g[0]}\t0"
                             for s, g in zip(inst.starts, inst.goals)]
    sc.write_text("\n".join(lines) + "\n")
    return mp, sc


def external_command(binary: str, mp: Path, sc: Path, agents: int, cutoff: float,
                     extra: tuple[str, ...] = ()) -> list[str]:
    """CBSH2-RTC's command line: corridors off unless ``extra`` sets ``--corridorReasoning`` itself (its option parser
    refuses an option given twice), then ``extra``."""
    defaults = [] if "--corridorReasoning" in extra else ["--corridorReasoning", "None"]
    return [binary, "-m", str(mp), "-a", str(sc), "-k", str(agents), "-t", str(cutoff), *defaults, "-s", "1", *extra]


def run_external(binary: str, inst: Instance, cutoff: float, extra: tuple[str, ...] = ()) -> Run:
    """CBSH2-RTC on ``inst``: its ``runtime`` (CPU seconds, its own clock) and high-level nodes expanded."""
    with tempfile.TemporaryDirectory() as tmp:
        mp, sc = write_movingai(inst, Path(tmp))
        out = subprocess.run(external_command(binary, mp, sc, inst.num_agents, cutoff, extra), capture_output=True,
                             text=True, timeout=cutoff * 3 + 30)
    for line in out.stdout.splitlines():  # "WDG+GR+T+BP with AStar : Optimal,9,5.5e-05,0,12,..."
        head, _, rest = line.rpartition(":")[2].strip().partition(",")
        if head in ("Optimal", "Timeout", "No solutions", "Nodesout"):
            fields = rest.split(",")
            cost, runtime, expanded = int(float(fields[0])), float(fields[1]), int(fields[2])
            return Run(cost if head == "Optimal" else None, expanded, runtime * 1e3, head.lower())
    raise RuntimeError(f"{binary}: no result line in its output:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")


def q95(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=20, method="inclusive")[-1] if len(xs) >= 2 else (xs[0] if xs else float("nan"))


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def bench_set(name: str, instances: list[Instance], external: str | None, cutoff: float, plain: bool,
              options: CBSOptions = CBSOptions(), external_args: tuple[str, ...] = ()) -> dict:
    solvers = {"project": lambda i: run_project(i, options, cutoff)}
    if plain:
        solvers["plain"] = lambda i: run_project(i, CBSOptions.plain(), cutoff)
    if external:
        solvers["external"] = lambda i: run_external(external, i, cutoff, external_args)
    runs = {s: [f(inst) for inst in instances] for s, f in solvers.items()}
    mismatches = [k for k in range(len(instances))
                  if len({r[k].soc for r in runs.values() if r[k].soc is not None}) > 1]
    summary: dict = {"instances": len(instances), "soc_mismatches": len(mismatches), "solvers": {}}
    for s, rs in runs.items():
        ok = [r for r in rs if r.soc is not None]
        summary["solvers"][s] = {
            "solved": len(ok),
            "nodes_median": statistics.median([r.nodes for r in ok]) if ok else None,
            "nodes_p95": q95([r.nodes for r in ok]),
            "cpu_ms_median": statistics.median([r.cpu_ms for r in ok]) if ok else None,
            "cpu_ms_p95": q95([r.cpu_ms for r in ok]),
            "cpu_ms_max": max((r.cpu_ms for r in ok), default=None),
            "cpu_ms_total": sum(r.cpu_ms for r in rs),
        }
    for other in (s for s in runs if s != "project"):
        both = [k for k in range(len(instances)) if runs["project"][k].soc is not None and runs[other][k].soc is not None]
        summary[f"project/{other}"] = {
            "both_solved": len(both),
            "cpu_ratio_geomean": geomean([max(runs["project"][k].cpu_ms, 1e-3) / max(runs[other][k].cpu_ms, 1e-3)
                                          for k in both]),
            "nodes_ratio_geomean": geomean([(runs["project"][k].nodes + 1) / (runs[other][k].nodes + 1) for k in both]),
        }
    print(f"\n== {name}: {len(instances)} instances; sum-of-costs disagreements: {len(mismatches)}")
    print(f"{'solver':<9} {'solved':>6} {'nodes med':>9} {'nodes p95':>9} {'cpu ms med':>10} {'p95':>9} {'max':>9}")
    for s, v in summary["solvers"].items():
        print(f"{s:<9} {v['solved']:>6} {v['nodes_median'] or 0:>9.0f} {v['nodes_p95']:>9.0f} "
              f"{v['cpu_ms_median'] or 0:>10.2f} {v['cpu_ms_p95']:>9.1f} {v['cpu_ms_max'] or 0:>9.1f}")
    for key, v in summary.items():
        if key.startswith("project/"):
            print(f"{key}: CPU ratio (geomean over {v['both_solved']} both solved) {v['cpu_ratio_geomean']:.2f}x, "
                  f"node ratio {v['nodes_ratio_geomean']:.2f}x")
    return summary


def largest(spec: str, external: str | None, cutoff: float, options: CBSOptions = CBSOptions(),
            external_args: tuple[str, ...] = ()) -> dict:
    """The largest agent count of ``MAP:SCEN`` each solver solves within ``cutoff`` seconds, adding one agent at a
    time (a solver stops at its first failure)."""
    name, scen = spec.split(":")
    mp, sc = bench_file(name, f"{name}.map"), bench_file(name, f"{name}-{scen}.scen")
    out = {}
    solvers = {"project": lambda i: run_project(i, options, cutoff)}
    if external:
        solvers["external"] = lambda i: run_external(external, i, cutoff, external_args)
    for s, f in solvers.items():
        k = 1
        while k < 1000:
            try:
                inst = load_instance(mp, sc, k + 1)
            except Exception:
                break
            if f(inst).soc is None:
                break
            k += 1
        out[s] = k
    print(f"\n== largest agent count within {cutoff:g} s, {spec}: " + ", ".join(f"{s} {k}" for s, k in out.items()))
    return out


def parse_options(pairs: list[str], conflict_ties: str = "earliest") -> CBSOptions:
    """:class:`CBSOptions` from ``NAME=VALUE`` strings (``--option``), each value read as its field's type (true/false
    for switches); an unknown name or a value of the wrong type raises ValueError naming the option and the fix."""
    kinds = {f.name: type(getattr(CBSOptions(), f.name)) for f in fields(CBSOptions)}
    values: dict = {"conflict_ties": conflict_ties}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in kinds:
            raise ValueError(f"--option {pair!r}: write NAME=VALUE with NAME one of {', '.join(sorted(kinds))}")
        kind = kinds[name]
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0", "on", "off"):
                raise ValueError(f"--option {pair!r}: {name} is a switch; write {name}=true or {name}=false")
            values[name] = raw.lower() in ("true", "1", "on")
        elif kind is int:
            try:
                values[name] = int(raw)
            except ValueError:
                raise ValueError(f"--option {pair!r}: {name} is a whole number, e.g. {name}=2") from None
        else:
            values[name] = raw
    return CBSOptions(**values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default="training,dense5,jmorag", help="comma-separated sets (default %(default)s)")
    parser.add_argument("--count", type=int, default=300, help="drawn instances per drawn set (default %(default)s)")
    parser.add_argument("--external", default=None, help="path of CBSH2-RTC's cbs binary (optional)")
    parser.add_argument("--cutoff", type=float, default=10.0, help="seconds per solve (default %(default)s)")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain search (slow on hard sets)")
    parser.add_argument("--movingai", action="append", default=[], help="MAP:SCEN:K1,K2 (repeatable)")
    parser.add_argument("--largest", action="append", default=[], help="MAP:SCEN (repeatable)")
    parser.add_argument("--conflict-ties", choices=["earliest", "pairs"], default="earliest",
                        help="the project's CBSOptions.conflict_ties (default %(default)s, the solver's default)")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="one of the project's CBSOptions, e.g. rectangle_reasoning=false (repeatable)")
    parser.add_argument("--external-args", default="", metavar="ARGS",
                        help='extra arguments for the external solver, given with "=": '
                             '--external-args="--rectangleReasoning R"')
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = parser.parse_args(argv)
    try:
        options = parse_options(args.option, args.conflict_ties)
    except ValueError as err:
        parser.error(str(err))
    external_args = tuple(shlex.split(args.external_args))
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, running on {cores}, "
               f"Python {platform.python_version()}")
    print(f"machine: {machine}")
    sets = {
        "training": lambda: draws(args.count, 1, 2, tuple(range(3, 11)), 0.2, 0.5),
        "dense5": lambda: draws(args.count, 2, 5, (10,), 0.5, 0.0),
        "jmorag": jmorag,
    }
    results: dict = {"machine": machine, "cutoff_s": args.cutoff, "external": args.external,
                     "external_args": list(external_args), "conflict_ties": args.conflict_ties,
                     "options": asdict(options), "sets": {}}
    for name in [s for s in args.sets.split(",") if s]:
        results["sets"][name] = bench_set(name, sets[name](), args.external, args.cutoff, not args.no_plain, options,
                                          external_args)
    for spec in args.movingai:
        results["sets"][spec] = bench_set(spec, movingai(spec), args.external, args.cutoff, not args.no_plain, options,
                                          external_args)
    results["largest"] = {spec: largest(spec, args.external, args.cutoff, options, external_args)
                          for spec in args.largest}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=lambda o: asdict(o)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
