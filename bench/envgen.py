"""Benchmark of MAPF-FrozenLake: generator throughput, CBS solve times and over-budget draws, plan-check throughput. A
script, not a test.

    taskset -c 1 python bench/envgen.py [--budget 4000] [--cbs-instances 1000] [--json out.json]

Runs pinned to one CPU core. Prints each measurement against its target and writes the numbers as JSON. Every timing
is given cold (first run in the process, after the grid caches are cleared) and warm (the same work again).
Targets (issues 2 and 20): >= 3,000 verified instances/s for the paper's training distribution on one core; 0 draws
over the generator's default solver budget in 1,000 draws of 5 agents on 10x10 with 50% holes (median solve < 10 ms);
>= 100,000 plan checks/s, valid plans (checked to the end) apart from invalid ones (which stop at the first error).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envgen.solver.cbs import Solved, Unsolved, solve  # noqa: E402
from envgen.core.config import EnvConfig, SizeConfig, uniform_config  # noqa: E402
from envgen.formats.dataset import generate_verified  # noqa: E402
from envgen.generator import GeneratorOptions, draw_instance  # noqa: E402
from envgen.core.grid import _steps, _tables, grid_of  # noqa: E402
from envgen.core.simulate import check_plan, paths_to_moves  # noqa: E402


def training_configs(budget: int) -> dict[str, EnvConfig]:
    """The paper's training distribution: 2 agents, sizes 3..10, wait ratio 0.5, holes up to 0.5."""
    rising = {n: SizeConfig(data_ratio=1.0, hole_ratio=round(0.1 + 0.4 * (n - 3) / 7, 3), wait_ratio=0.5) for n in range(3, 11)}
    flat = {n: SizeConfig(data_ratio=1.0, hole_ratio=0.5, wait_ratio=0.5) for n in range(3, 11)}
    return {
        "default (holes 0.2)": uniform_config(budget=budget, seed=1),
        "holes rising 0.1->0.5 with size": EnvConfig(budget=budget, seed=1, sizes=rising),
        "holes 0.5 everywhere": EnvConfig(budget=budget, seed=1, sizes=flat),
    }


def clear_caches() -> None:
    """Forget the cached grids and move tables, as in a fresh process."""
    grid_of.cache_clear()
    _tables.cache_clear()
    _steps.cache_clear()


def bench_generator(budget: int) -> dict[str, dict[str, float]]:
    """Verified instances/s per training configuration: cold (caches cleared), then warm (the same stage again); the
    default configuration also with generator version 1 (plain CBS), for a same-run ratio."""
    out = {}
    runs = [(name, cfg, GeneratorOptions()) for name, cfg in training_configs(budget).items()]
    runs.append(("default (holes 0.2), generator version 1", runs[0][1], GeneratorOptions(version=1)))
    for name, cfg, options in runs:
        clear_caches()
        rates = {}
        for run in ("cold", "warm"):
            start = time.perf_counter()
            n = sum(1 for _ in generate_verified(cfg, options))
            rates[run] = n / (time.perf_counter() - start)
        out[name] = rates
    return out


def bench_cbs(count: int, seed: int = 0) -> dict[str, float]:
    """5 agents on 10x10 with half the cells holes, solved within the generator's default budget: how many draws are
    solved, proved unsolvable, or over the budget (those a stage would leave out), with solve times (the first pass
    cold, then all of them again warm)."""
    rng = random.Random(seed)
    knobs = SizeConfig(data_ratio=1.0, hole_ratio=0.5)
    budget = GeneratorOptions().budget
    draws = []
    while len(draws) < count:
        inst = draw_instance(rng, 10, knobs, 5)
        if inst is not None:
            draws.append(inst)
    clear_caches()
    passes = {}
    for run in ("cold", "warm"):
        solved, all_times, outcome = [], [], {"solved": 0, "unsolvable": 0, "over_budget": 0}
        for inst in draws:
            start = time.perf_counter()
            result = solve(inst, budget)
            dt = time.perf_counter() - start
            all_times.append(dt)
            if isinstance(result, Solved):
                solved.append(dt)
                outcome["solved"] += 1
            elif isinstance(result, Unsolved) and result.reason.proven:
                outcome["unsolvable"] += 1
            else:
                outcome["over_budget"] += 1
        q = statistics.quantiles
        passes[run] = {**outcome,
                       "median_ms_solved": statistics.median(solved) * 1e3,
                       "p95_ms_solved": q(solved, n=20)[-1] * 1e3,
                       "max_ms": max(all_times) * 1e3,
                       "median_ms_all": statistics.median(all_times) * 1e3,
                       "p95_ms_all": q(all_times, n=20)[-1] * 1e3,
                       "seconds_total": sum(all_times)}
    return {"instances": count, "budget": {"max_nodes": budget.max_nodes, "max_joint_states": budget.max_joint_states,
                                           "max_seconds": budget.max_seconds}, **passes}


def bench_checks(seconds: float = 2.0) -> dict[str, dict[str, float]]:
    """Plan checks/s on 2-agent training boards: optimal plans (valid, checked to the end) apart from random invalid
    ones (which stop at their first error); the first pass cold, then repeated passes for ``seconds`` warm."""
    rng = random.Random(2)
    valid, invalid = [], []
    for n in range(3, 11):
        for i in range(60):
            inst = draw_instance(rng, n, SizeConfig(data_ratio=1.0, hole_ratio=0.2), 2, head_on=i % 2 == 0)
            if inst is None:
                continue
            result = solve(inst)
            if isinstance(result, Solved):
                plan = [[m.value for m in moves] for moves in paths_to_moves(result.paths)]
                valid.append((inst, plan, result.soc))
                broken = [list(p) for p in plan]
                broken[0] = [rng.choice(["UP", "DOWN", "LEFT", "RIGHT", "WAIT"]) for _ in range(len(plan[0]) + 1)]
                invalid.append((inst, broken, result.soc))
    out = {}
    for name, cases in (("valid", valid), ("invalid", invalid)):
        clear_caches()
        start = time.perf_counter()
        for inst, plan, soc in cases:
            check_plan(inst, plan, soc)
        cold = len(cases) / (time.perf_counter() - start)
        done = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            for inst, plan, soc in cases:
                check_plan(inst, plan, soc)
            done += len(cases)
        out[name] = {"plans": len(cases), "cold_per_s": cold, "warm_per_s": done / (time.perf_counter() - start)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=4000, help="instances per generator run (default %(default)s)")
    parser.add_argument("--cbs-instances", type=int, default=1000, help="5-agent draws to solve (default %(default)s)")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    core = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (pinned to core {core}), "
               f"Python {platform.python_version()}")
    print(f"machine: {machine}")
    gen = bench_generator(args.budget)
    cbs = bench_cbs(args.cbs_instances)
    checks = bench_checks()
    rows = [(f"verified instances/s, {name}, cold / warm", f"{v['cold']:,.0f} / {v['warm']:,.0f}", ">= 3,000")
            for name, v in gen.items()]
    c, w = cbs["cold"], cbs["warm"]
    rows += [
        (f"5 agents 10x10 50% holes, {cbs['instances']} draws: solved / unsolvable (proved) / over budget",
         f"{c['solved']} / {c['unsolvable']} / {c['over_budget']}", "over budget 0"),
        ("  median ms over solved draws, cold / warm", f"{c['median_ms_solved']:.2f} / {w['median_ms_solved']:.2f}", "< 10"),
        ("  p95 / max ms over all draws (warm)", f"{w['p95_ms_all']:.1f} / {w['max_ms']:.0f}", "-"),
        ("  seconds for all draws, cold / warm", f"{c['seconds_total']:.1f} / {w['seconds_total']:.1f}", "-"),
    ]
    for name, v in checks.items():
        rows.append((f"plan checks/s, {v['plans']} {name} plans, cold / warm",
                     f"{v['cold_per_s']:,.0f} / {v['warm_per_s']:,.0f}", ">= 100,000"))
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'measured':>14}  target")
    for name, value, target in rows:
        print(f"{name:<{width}}  {value:>14}  {target}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine, "generator_per_s": gen, "cbs": cbs, "checks": checks}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
