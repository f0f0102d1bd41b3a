"""Benchmark of MAPF-FrozenLake: generator throughput, CBS solve times, plan-check throughput. A script, not a test.

    python bench/envgen.py [--budget 4000] [--cbs-instances 300] [--json bench/envgen.json]

Runs pinned to one CPU core. Prints each measurement against its target and writes the numbers as JSON.
Targets (issue 2): >= 2,000 verified instances/s for the paper's training distribution; median CBS solve < 10 ms for
5 agents on 10x10 with 50% holes; >= 100,000 plan checks/s.
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

from envgen.cbs import Solved, Unsolved, solve  # noqa: E402
from envgen.config import EnvConfig, SizeConfig, uniform_config  # noqa: E402
from envgen.dataset import generate_verified  # noqa: E402
from envgen.generator import draw_instance  # noqa: E402
from envgen.simulate import check_plan, paths_to_moves  # noqa: E402


def training_configs(budget: int) -> dict[str, EnvConfig]:
    """The paper's training distribution: 2 agents, sizes 3..10, wait ratio 0.5, holes up to 0.5."""
    rising = {n: SizeConfig(data_ratio=1.0, hole_ratio=round(0.1 + 0.4 * (n - 3) / 7, 3), wait_ratio=0.5) for n in range(3, 11)}
    flat = {n: SizeConfig(data_ratio=1.0, hole_ratio=0.5, wait_ratio=0.5) for n in range(3, 11)}
    return {
        "default (holes 0.2)": uniform_config(budget=budget, seed=1),
        "holes rising 0.1->0.5 with size": EnvConfig(budget=budget, seed=1, sizes=rising),
        "holes 0.5 everywhere": EnvConfig(budget=budget, seed=1, sizes=flat),
    }


def bench_generator(budget: int) -> dict[str, float]:
    out = {}
    for name, cfg in training_configs(budget).items():
        start = time.perf_counter()
        n = 0
        for _ in generate_verified(cfg):
            n += 1
        out[name] = n / (time.perf_counter() - start)
    return out


def bench_cbs(count: int, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    knobs = SizeConfig(data_ratio=1.0, hole_ratio=0.5)
    solved, unsolved_proven, unsolved_budget, all_times = [], [], [], []
    while len(all_times) < count:
        inst = draw_instance(rng, 10, knobs, 5)
        if inst is None:
            continue
        start = time.perf_counter()
        result = solve(inst)
        dt = time.perf_counter() - start
        all_times.append(dt)
        if isinstance(result, Solved):
            solved.append(dt)
        elif isinstance(result, Unsolved) and result.reason.proven:
            unsolved_proven.append(dt)
        else:
            unsolved_budget.append(dt)
    q = statistics.quantiles
    return {
        "instances": count,
        "solved": len(solved),
        "unsolvable_proven": len(unsolved_proven),
        "unsolved_budget": len(unsolved_budget),
        "median_ms_solved": statistics.median(solved) * 1e3,
        "p95_ms_solved": q(solved, n=20)[-1] * 1e3,
        "median_ms_all": statistics.median(all_times) * 1e3,
        "p95_ms_all": q(all_times, n=20)[-1] * 1e3,
        "seconds_on_budget_outs": sum(unsolved_budget),
    }


def bench_checks(seconds: float = 3.0) -> dict[str, float]:
    rng = random.Random(2)
    cases = []
    for n in range(3, 11):
        for i in range(60):
            inst = draw_instance(rng, n, SizeConfig(data_ratio=1.0, hole_ratio=0.2), 2, head_on=i % 2 == 0)
            if inst is None:
                continue
            result = solve(inst)
            if isinstance(result, Solved):
                plan = [[m.value for m in moves] for moves in paths_to_moves(result.paths)]
                cases.append((inst, plan, result.soc))
                broken = [list(p) for p in plan]
                broken[0] = [rng.choice(["UP", "DOWN", "LEFT", "RIGHT", "WAIT"]) for _ in range(len(plan[0]) + 1)]
                cases.append((inst, broken, result.soc))
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for inst, plan, soc in cases:
            check_plan(inst, plan, soc)
        done += len(cases)
    return {"checks_per_s": done / (time.perf_counter() - start), "plans": len(cases), "valid_share": 0.5}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=4000, help="instances per generator run (default %(default)s)")
    parser.add_argument("--cbs-instances", type=int, default=300, help="5-agent instances to time (default %(default)s)")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (pinned to 1), Python {platform.python_version()}"
    print(f"machine: {machine}")
    gen = bench_generator(args.budget)
    cbs = bench_cbs(args.cbs_instances)
    checks = bench_checks()
    rows = [(f"verified instances/s, {name}", f"{v:,.0f}", ">= 2,000") for name, v in gen.items()]
    rows += [
        (f"CBS 5 agents 10x10 50% holes, median ms (solved {cbs['solved']}/{cbs['instances']})", f"{cbs['median_ms_solved']:.2f}", "< 10"),
        ("CBS 5 agents 10x10 50% holes, p95 ms (solved)", f"{cbs['p95_ms_solved']:.1f}", "-"),
        ("CBS 5 agents 10x10 50% holes, median / p95 ms (all draws)", f"{cbs['median_ms_all']:.2f} / {cbs['p95_ms_all']:.1f}", "-"),
        ("  unsolvable proven / over budget (seconds spent on those)", f"{cbs['unsolvable_proven']} / {cbs['unsolved_budget']} ({cbs['seconds_on_budget_outs']:.1f} s)", "-"),
        ("plan checks/s (half valid, half random-invalid)", f"{checks['checks_per_s']:,.0f}", ">= 100,000"),
    ]
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
