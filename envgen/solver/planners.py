"""Reference planners that are not optimal: baselines a trained model should beat.

- :func:`independent_plan`: each agent follows one shortest path of its own and ignores the others ("no
  coordination"); its plan is valid exactly when those paths happen not to conflict.
- :func:`prioritized_plan`: agents plan one after another around the reservations of those before them.

Each returns a :class:`Planned` plan (move words per agent, to be checked by :func:`envgen.core.simulate.check_plan`) or
:class:`NoPlan` with its reason. The optimal reference is :func:`envgen.solver.cbs.solve`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from envgen.core.grid import UNREACHABLE, grid_of
from envgen.core.instance import Instance
from envgen.core.simulate import paths_to_moves


@dataclass(frozen=True)
class Planned:
    """A plan: per agent its moves (``UP``, ``DOWN``, ``LEFT``, ``RIGHT``, ``WAIT``). Not necessarily valid."""

    moves: list[list[str]]


@dataclass(frozen=True)
class NoPlan:
    """The planner found no plan; ``reason`` says why (an unreachable goal, a blocked agent, the search budget)."""

    reason: str


PlanResult = Planned | NoPlan


def independent_plan(instance: Instance) -> PlanResult:
    """Per agent the moves of a shortest path (ties broken in move order UP, DOWN, LEFT, RIGHT); :class:`NoPlan` if
    some goal is unreachable."""
    grid = grid_of(instance.rows)
    paths = []
    for a, (start, goal) in enumerate(zip(instance.starts, instance.goals)):
        dist = grid.distances_from(grid.index(goal))
        u = grid.index(start)
        if dist[u] == UNREACHABLE:
            return NoPlan(f"agent {a + 1}: goal unreachable")
        path = [u]
        while dist[u] > 0:
            u = next(v for v in grid.neighbors[u] if dist[v] == dist[u] - 1)
            path.append(u)
        paths.append([grid.cell(p) for p in path])
    return Planned([[m.value for m in moves] for moves in paths_to_moves(paths)])


def prioritized_plan(instance: Instance, order: list[int] | None = None, max_expansions: int = 200_000) -> PlanResult:
    """Prioritized planning: agents in ``order`` (default 0, 1, ...) each take a shortest path in space and time that
    avoids the cells and swaps reserved by the agents before them, including the goals they park on. Fast and often
    valid, but neither optimal nor complete: :class:`NoPlan` when some agent finds no path (or the search budget of
    ``max_expansions`` per agent runs out)."""
    import heapq

    grid = grid_of(instance.rows)
    n_cells = len(grid.free)
    order = list(range(instance.num_agents)) if order is None else order
    vertex: set[tuple[int, int]] = set()
    edges: set[tuple[int, int, int]] = set()
    parked: dict[int, int] = {}
    last_use: dict[int, int] = {}
    paths: dict[int, list[int]] = {}
    horizon_base = 0
    for a in order:
        start, goal = grid.index(instance.starts[a]), grid.index(instance.goals[a])
        h = grid.distances_from(goal)
        if h[start] == UNREACHABLE:
            return NoPlan(f"agent {a + 1}: goal unreachable")
        if parked.get(start, 1 << 30) <= 0:
            return NoPlan(f"agent {a + 1}: its start is an earlier agent's goal")
        horizon = horizon_base + n_cells + h[start]
        heap = [(h[start], 0, start)]
        parent: dict[tuple[int, int], tuple[int, int] | None] = {(start, 0): None}
        found = None
        expansions = 0
        while heap and expansions < max_expansions:
            _, t, u = heapq.heappop(heap)
            expansions += 1
            if u == goal and t > last_use.get(goal, -1) and goal not in parked:
                found = (u, t)
                break
            if t >= horizon:
                continue
            nt = t + 1
            for v in grid.options[u]:
                if (nt, v) in vertex or parked.get(v, 1 << 30) <= nt or (nt, v, u) in edges or (v, nt) in parent:
                    continue
                parent[(v, nt)] = (u, t)
                heapq.heappush(heap, (nt + h[v], nt, v))
        if found is None:
            return NoPlan(f"agent {a + 1}: no path around the earlier agents' reservations"
                          + (f" within {max_expansions} expansions" if expansions >= max_expansions else ""))
        path, node = [], found
        while node is not None:
            path.append(node[0])
            node = parent[node]
        path.reverse()
        for t, c in enumerate(path):
            vertex.add((t, c))
            last_use[c] = max(last_use.get(c, -1), t)
            if t:
                edges.add((t, path[t - 1], c))
        parked[goal] = len(path) - 1
        horizon_base = max(horizon_base, len(path))
        paths[a] = path
    cells = [[grid.cell(p) for p in paths[a]] for a in range(instance.num_agents)]
    return Planned([[m.value for m in moves] for moves in paths_to_moves(cells)])


PLANNERS: dict[str, Callable[[Instance], PlanResult]] = {"prioritized": prioritized_plan, "independent": independent_plan}
"""The reference planners of the benchmark, by the name its tables give them."""
