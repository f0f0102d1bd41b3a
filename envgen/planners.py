"""Reference planners that are not optimal: baselines a trained model should beat.

- :func:`independent_plan`: each agent follows one shortest path of its own and ignores the others ("no
  coordination"); its plan is valid exactly when those paths happen not to conflict.
"""

from __future__ import annotations

from envgen.grid import UNREACHABLE, grid_of
from envgen.instance import Instance
from envgen.simulate import paths_to_moves


def independent_plan(instance: Instance) -> list[list[str]] | None:
    """Per agent the moves of a shortest path (ties broken in move order UP, DOWN, LEFT, RIGHT); None if some goal
    is unreachable."""
    grid = grid_of(instance.rows)
    paths = []
    for start, goal in zip(instance.starts, instance.goals):
        dist = grid.distances_from(grid.index(goal))
        u = grid.index(start)
        if dist[u] == UNREACHABLE:
            return None
        path = [u]
        while dist[u] > 0:
            u = next(v for v in grid.neighbors[u] if dist[v] == dist[u] - 1)
            path.append(u)
        paths.append([grid.cell(p) for p in path])
    return [[m.value for m in moves] for moves in paths_to_moves(paths)]
