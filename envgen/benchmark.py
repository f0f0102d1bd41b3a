"""The held-out benchmark in the paper's layout: its cells, its tables, and its reference planners.

Cells: for each agent count A and its map sizes (paper: 3 agents on 3x3..10x10, 4 on 4x4..10x10, 5 on 5x5..10x10) and
each wait-ratio subset w (0.25 / 0.50 / 0.75), ``per_cell`` instances per (A, size, w). :func:`cell_configs` gives one
environment configuration per (A, w), with a seed derived from the benchmark's own seed.

Every cell's draws are counted (:func:`envgen.generator.draw_statistics`): the benchmark file keeps the counts and
:func:`render_draws` says how many draws were left out and why, over-budget ones (possibly solvable) apart.

Tables follow the paper: valid rate ("acc") and optimal rate ("opt") per (agents, size) cell, "Sum" = the mean over
map sizes per agent count, and per wait subset (:func:`cell_table`, :func:`render_table`). Reference rows
(:func:`reference_rows`): the optimal CBS plan (100% valid and optimal by construction: a check of the benchmark
itself) and the planners of :data:`envgen.solver.planners.PLANNERS` (prioritized planning, independent shortest paths).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from envgen.solver.cbs import Solved, SolverBudget, solve
from envgen.core.config import EnvConfig, SizeConfig
from envgen.generator import draw_seed
from envgen.core.instance import Instance
from envgen.solver.planners import PLANNERS, Planned
from envgen.llm.rates import share
from envgen.core.simulate import Valid, check_plan


@dataclass(frozen=True)
class Cell:
    """One agent count and wait subset of the benchmark, with the configuration that generates its instances."""

    agents: int
    wait_ratio: float
    config: EnvConfig


def cell_configs(seed: int, per_cell: int | Mapping[int, int], wait_ratios: Sequence[float], hole_ratio: float,
                 agents: Mapping[int, Sequence[int]]) -> list[Cell]:
    """One :class:`Cell` per (agent count, wait subset): ``per_cell`` instances (one number, or one per agent count)
    on each of the agent count's sizes."""
    out = []
    for a, sizes in sorted(agents.items()):
        count = per_cell if isinstance(per_cell, int) else per_cell[a]
        for w in wait_ratios:
            cell_seed = draw_seed(seed, a * 1000 + round(w * 100)) >> 1  # within EnvConfig.seed
            out.append(Cell(a, w, EnvConfig(num_agents=a, budget=count * len(sizes), seed=cell_seed,
                                             sizes={n: SizeConfig(data_ratio=1.0, hole_ratio=hole_ratio, wait_ratio=w)
                                                    for n in sizes})))
    return out


def cell_label(cell: Cell) -> str:
    """The key of a cell's draw statistics: ``"3 agents, wait 0.50"``."""
    return f"{cell.agents} agents, wait {cell.wait_ratio:.2f}"


def render_draws(stats: Mapping[str, Mapping[str, Any]]) -> str:
    """Markdown: per cell (its :func:`cell_label`) the draws made, accepted, and rejected by reason, with the draws
    over the solver budget (neither solved nor proved unsolvable: instances possibly left out) in a column of their
    own; then the totals."""
    lines = ["| cell | draws | accepted | rejected (why) | over solver budget |", "|---|---|---|---|---|"]
    totals: dict[str, int] = {"draws": 0, "accepted": 0, "over_budget": 0}
    for label, c in stats.items():
        why = ", ".join(f"{reason} {count}" for reason, count in sorted(c["rejected"].items())) or "none"
        lines.append(f"| {label} | {c['draws']} | {c['accepted']} | {why} | {c['over_budget']} |")
        for key in totals:
            totals[key] += c[key]
    lines.append(f"| all | {totals['draws']} | {totals['accepted']} | {totals['draws'] - totals['accepted']} | "
                 f"{totals['over_budget']} |")
    return "\n".join(lines)


def cell_table(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Valid/optimal per (agents, size), "Sum" per agent count (mean over sizes), and per wait subset. ``rows`` need
    ``num_agents``, ``size``, ``wait_subset``, ``valid`` and ``optimal``."""
    cells: dict[tuple[int, int], list[Mapping]] = defaultdict(list)
    waits: dict[tuple[int, float], list[Mapping]] = defaultdict(list)
    for r in rows:
        cells[(r["num_agents"], r["size"])].append(r)
        waits[(r["num_agents"], round(float(r["wait_subset"]), 2))].append(r)

    def rate(rs: list[Mapping], key: str) -> float:
        return share(r[key] for r in rs)

    by_agents: dict[str, Any] = {}
    for a in sorted({k[0] for k in cells}):
        sizes = sorted(n for (aa, n) in cells if aa == a)
        per_size = {str(n): {"acc": rate(cells[(a, n)], "valid"), "opt": rate(cells[(a, n)], "optimal"), "n": len(cells[(a, n)])}
                    for n in sizes}
        by_agents[str(a)] = {
            "sizes": per_size,
            "sum": {"acc": sum(v["acc"] for v in per_size.values()) / len(per_size),
                    "opt": sum(v["opt"] for v in per_size.values()) / len(per_size)},
            "wait": {f"{w:.2f}": {"acc": rate(rs, "valid"), "opt": rate(rs, "optimal"), "n": len(rs)}
                     for (aa, w), rs in sorted(waits.items()) if aa == a},
        }
    return by_agents


def reference_outcome(row: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """One benchmark row (its Parquet row) answered by the optimal CBS plan and by every reference planner: per name,
    the row's cell (agents, size, wait subset) with whether the answer is valid and optimal."""
    inst = Instance.from_str(row["instance"])
    base = {"num_agents": row["num_agents"], "size": row["size"], "wait_subset": row["wait_subset"]}
    cbs = solve(inst, SolverBudget(max_seconds=60))
    ok = isinstance(cbs, Solved) and cbs.soc == row["optimal_soc"]
    out = {"optimal (CBS)": {**base, "valid": ok, "optimal": ok}}
    for name, planner in PLANNERS.items():
        plan = planner(inst)
        result = check_plan(inst, plan.moves, row["optimal_soc"]) if isinstance(plan, Planned) else None
        valid = isinstance(result, Valid)
        out[name] = {**base, "valid": valid, "optimal": valid and bool(result.optimal)}
    return out


def reference_rows(rows: Sequence[Mapping[str, Any]], mapper: Callable[..., Iterable[Any]] = map) -> dict[str, Any]:
    """The optimal CBS plan and every reference planner on the benchmark ``rows`` (its Parquet rows), as
    :func:`cell_table` tables by name. ``mapper`` applies :func:`reference_outcome` to the rows (``map``, or a process
    pool's ``map``: each row is answered on its own, so the tables are the same)."""
    out: dict[str, list[dict]] = {"optimal (CBS)": [], **{name: [] for name in PLANNERS}}
    for answered in mapper(reference_outcome, rows):
        for name, outcome in answered.items():
            out[name].append(outcome)
    return {name: cell_table(rs) for name, rs in out.items()}


def render_table(table: Mapping[str, Any], title: str) -> str:
    """Markdown in the paper's layout: one row per agent count, acc/opt per size and Sum; then per wait subset."""
    sizes = sorted({int(n) for a in table.values() for n in a["sizes"]})
    lines = [f"### {title}", "", "| agents | " + " | ".join(f"{n}x{n}" for n in sizes) + " | Sum |",
             "|---|" + "---|" * (len(sizes) + 1)]
    for a, row in table.items():
        cells = [f"{100 * row['sizes'][str(n)]['acc']:.1f} / {100 * row['sizes'][str(n)]['opt']:.1f}" if str(n) in row["sizes"] else ""
                 for n in sizes]
        lines.append(f"| {a} | " + " | ".join(cells) + f" | **{100 * row['sum']['acc']:.2f} / {100 * row['sum']['opt']:.2f}** |")
    waits = sorted({w for a in table.values() for w in a["wait"]})
    lines += ["", "| agents | " + " | ".join(f"wait {w}" for w in waits) + " |", "|---|" + "---|" * len(waits)]
    for a, row in table.items():
        lines.append(f"| {a} | " + " | ".join(f"{100 * row['wait'][w]['acc']:.1f} / {100 * row['wait'][w]['opt']:.1f}"
                                              if w in row["wait"] else "" for w in waits) + " |")
    return "\n".join(lines)
