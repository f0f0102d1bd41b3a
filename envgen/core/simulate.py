"""Plan simulator and scorer: is a joint plan valid for an instance, and is it optimal?

A joint plan gives every agent a sequence of moves (``UP``/``DOWN``/``LEFT``/``RIGHT``/``WAIT``, see
:class:`envgen.core.grid.Move`) or, equivalently, a sequence of cells from time 0. All agents move simultaneously; an agent
whose sequence has ended stays where it is (it waits at its goal). The plan is valid when no agent leaves the grid,
enters a hole or jumps, no two agents occupy one cell at one time (vertex conflict), no two agents swap cells in one
step (edge conflict), and every agent ends on its goal. Following (moving into a cell another agent leaves in the same
step) and rotation cycles are allowed.

Costs follow the MAPF convention: an agent's cost is the time of its last arrival at its goal (0 if it starts there and
never leaves); the sum of costs (SoC) adds them up and the makespan is their maximum. A valid plan is optimal when its
SoC equals the optimum (from :func:`envgen.solver.cbs.solve` or a stored ``optimal_soc``).

The result is typed: :class:`Valid` or :class:`Failure` with the category and the first failing agent and time step.
Failures are ordered by time step; at one time step an agent's own fault (off grid, illegal move, hole) comes before a
conflict, and a lower agent index first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from envgen.core.grid import DELTAS, MOVE_OF_DELTA, MOVES, Grid, Move, grid_of
from envgen.core.instance import Cell, Instance


class FailureCategory(str, Enum):
    """Why a plan is invalid."""

    WRONG_AGENT_COUNT = "wrong_agent_count"
    """The plan has a different number of agents than the instance."""
    OFF_GRID = "off_grid"
    """A move leaves the grid."""
    ILLEGAL_MOVE = "illegal_move"
    """An unknown move word, a jump between non-adjacent cells, or a cell path that does not begin at the start."""
    HOLE = "hole"
    """An agent enters a hole."""
    VERTEX_CONFLICT = "vertex_conflict"
    """Two agents occupy the same cell at the same time."""
    EDGE_CONFLICT = "edge_conflict"
    """Two agents swap cells in one step."""
    GOAL_NOT_REACHED = "goal_not_reached"
    """An agent's sequence ends away from its goal."""


@dataclass(frozen=True)
class Valid:
    """A valid plan. ``optimal`` is None when no optimum was given to compare with."""

    soc: int
    makespan: int
    costs: tuple[int, ...]
    optimal: bool | None = None
    valid = True


@dataclass(frozen=True)
class Failure:
    """An invalid plan: the first failure in time order.

    Attributes:
        category: what went wrong.
        agent: 0-based index of the failing agent (for conflicts, the lower index); None for a wrong agent count.
        step: the time step at which it happens (move ``step`` of the agent's sequence, 1-based); 0 for a wrong agent
            count or a wrong start cell; for ``goal_not_reached`` the length of the agent's sequence.
        other: the other agent of a conflict (0-based), else None.
        detail: one readable sentence, with 1-based agent numbers as a prompt shows them.
    """

    category: FailureCategory
    agent: int | None
    step: int
    other: int | None = None
    detail: str = ""
    valid = False
    optimal = False


Result = Valid | Failure

_MOVE_INDEX: dict[str, int] = {m.value: i for i, m in enumerate(MOVES)}
_INF = 1 << 30


def check_plan(instance: Instance, plan: Sequence[Sequence[Move | str]], optimal_soc: int | None = None) -> Result:
    """Check a joint plan of move words. Unknown words are an ``illegal_move`` failure; this never raises on bad plans.

    >>> from envgen.core.instance import Instance
    >>> inst = Instance(("FF", "FF"), ((0, 0),), ((1, 1),))
    >>> check_plan(inst, [["RIGHT", "DOWN"]], optimal_soc=2)
    Valid(soc=2, makespan=2, costs=(2,), optimal=True)
    >>> check_plan(inst, [["UP"]]).category.value
    'off_grid'
    """
    n = instance.num_agents
    if len(plan) != n:
        return _wrong_count(len(plan), n)
    grid = grid_of(instance.rows)
    step, free, width = grid.step, grid.free, grid.width
    paths: list[list[int]] = []
    first_bad = _INF
    bad: Failure | None = None
    for a in range(n):
        r, c = instance.starts[a]
        p = r * width + c
        path = [p]
        for t, word in enumerate(plan[a], start=1):
            if t >= first_bad:
                break
            m = _MOVE_INDEX.get(word)
            if m is None:
                first_bad, bad = t, Failure(FailureCategory.ILLEGAL_MOVE, a, t, None, f"agent {a + 1} step {t}: unknown move {str(word)[:20]!r}")
                break
            q = step[m][p]
            if q < 0:
                first_bad, bad = t, _off_grid(a, t, grid.cell(p), MOVES[m].value)
                break
            if not free[q]:
                first_bad, bad = t, _hole(a, t, grid.cell(q))
                break
            p = q
            path.append(p)
        paths.append(path)
    return _finish(instance, grid, paths, first_bad, bad, optimal_soc)


def check_paths(instance: Instance, paths: Sequence[Sequence[Cell]], optimal_soc: int | None = None) -> Result:
    """Check a joint plan given as cells: per agent ``[(row, col), ...]`` from time 0 (the start) onward."""
    n = instance.num_agents
    if len(paths) != n:
        return _wrong_count(len(paths), n)
    grid = grid_of(instance.rows)
    h, w, free = grid.height, grid.width, grid.free
    out: list[list[int]] = []
    first_bad = _INF
    bad: Failure | None = None
    for a, cells in enumerate(paths):
        path: list[int] = []
        if not cells or tuple(cells[0]) != instance.starts[a]:
            got = tuple(cells[0]) if cells else "nothing"
            first_bad, bad = 0, Failure(FailureCategory.ILLEGAL_MOVE, a, 0, None, f"agent {a + 1}: path begins at {got}, its start is {instance.starts[a]}")
            out.append([grid.index(instance.starts[a])])
            continue
        prev = None
        for t, (r, c) in enumerate(cells):
            if t >= first_bad:
                break
            if not (0 <= r < h and 0 <= c < w):
                first_bad, bad = t, _off_grid(a, t, grid.cell(prev), f"to ({r}, {c})")
                break
            if prev is not None and MOVE_OF_DELTA.get((r - prev // w, c - prev % w)) is None:
                first_bad, bad = t, Failure(FailureCategory.ILLEGAL_MOVE, a, t, None, f"agent {a + 1} step {t}: jump from {grid.cell(prev)} to ({r}, {c})")
                break
            q = r * w + c
            if not free[q]:
                first_bad, bad = t, _hole(a, t, (r, c))
                break
            path.append(q)
            prev = q
        out.append(path)
    return _finish(instance, grid, out, first_bad, bad, optimal_soc)


def _finish(instance: Instance, grid: Grid, paths: list[list[int]], first_bad: int, bad: Failure | None, optimal_soc: int | None) -> Result:
    """Conflicts up to the first own fault, then goals and costs."""
    conflict = _first_conflict(paths, first_bad, grid)
    if conflict is not None:
        return conflict
    if bad is not None:
        return bad
    costs = []
    width = grid.width
    for a, path in enumerate(paths):
        gr, gc = instance.goals[a]
        goal = gr * width + gc
        if path[-1] != goal:
            return Failure(FailureCategory.GOAL_NOT_REACHED, a, len(path) - 1, None, f"agent {a + 1} ends at {grid.cell(path[-1])}, its goal is {(gr, gc)}")
        k = len(path) - 1
        while k > 0 and path[k - 1] == goal:
            k -= 1
        costs.append(k)
    soc = sum(costs)
    return Valid(soc, max(costs), tuple(costs), None if optimal_soc is None else soc == optimal_soc)


def _first_conflict(paths: list[list[int]], limit: int, grid: Grid) -> Failure | None:
    """The earliest vertex or edge conflict at a time step ``<= limit - 1`` (own faults win ties), or None."""
    n = len(paths)
    if n < 2:
        return None
    horizon = min(max(len(p) for p in paths) - 1, limit - 1)
    if n == 2:
        p, q = paths
        lp, lq = len(p) - 1, len(q) - 1
        for t in range(horizon + 1):
            a = p[t] if t <= lp else p[lp]
            b = q[t] if t <= lq else q[lq]
            if a == b:
                return _vertex(0, 1, t, grid.cell(a))
            if t and a == (q[t - 1] if t - 1 <= lq else q[lq]) and b == (p[t - 1] if t - 1 <= lp else p[lp]):
                return _edge(0, 1, t, grid.cell(b), grid.cell(a))
        return None
    last = [len(p) - 1 for p in paths]
    prev: list[int] = []
    for t in range(horizon + 1):
        cur = [paths[a][t] if t <= last[a] else paths[a][last[a]] for a in range(n)]
        if len(set(cur)) < n:
            # Report the pair whose lower index is smallest, then the smallest partner.
            for a, c in enumerate(cur):
                b = next((b for b in range(a + 1, n) if cur[b] == c), None)
                if b is not None:
                    return _vertex(a, b, t, grid.cell(c))
        if t:
            where = {c: a for a, c in enumerate(prev)}
            for a in range(n):
                if cur[a] != prev[a]:
                    b = where.get(cur[a])
                    if b is not None and cur[b] == prev[a]:
                        lo, hi = min(a, b), max(a, b)
                        return _edge(lo, hi, t, grid.cell(prev[lo]), grid.cell(cur[lo]))
        prev = cur
    return None


def _wrong_count(got: int, want: int) -> Failure:
    return Failure(FailureCategory.WRONG_AGENT_COUNT, None, 0, None, f"the plan has {got} agents, the instance has {want}")


def _off_grid(a: int, t: int, at: Cell, how: str) -> Failure:
    return Failure(FailureCategory.OFF_GRID, a, t, None, f"agent {a + 1} step {t}: moves {how} off the grid from {at}")


def _hole(a: int, t: int, cell: Cell) -> Failure:
    return Failure(FailureCategory.HOLE, a, t, None, f"agent {a + 1} step {t}: falls into the hole at {cell}")


def _vertex(a: int, b: int, t: int, cell: Cell) -> Failure:
    return Failure(FailureCategory.VERTEX_CONFLICT, a, t, b, f"agents {a + 1} and {b + 1} are both at {cell} at step {t}")


def _edge(a: int, b: int, t: int, frm: Cell, to: Cell) -> Failure:
    return Failure(FailureCategory.EDGE_CONFLICT, a, t, b, f"agents {a + 1} and {b + 1} swap {frm} and {to} at step {t}")


def paths_to_moves(paths: Sequence[Sequence[Cell]]) -> list[list[Move]]:
    """Convert cell paths (from time 0) to move words. Raises ValueError on a jump between non-adjacent cells."""
    plan = []
    for a, cells in enumerate(paths):
        moves = []
        for t in range(1, len(cells)):
            d = (cells[t][0] - cells[t - 1][0], cells[t][1] - cells[t - 1][1])
            m = MOVE_OF_DELTA.get(d)
            if m is None:
                raise ValueError(f"agent {a + 1} step {t}: {tuple(cells[t - 1])} -> {tuple(cells[t])} is not one move")
            moves.append(m)
        plan.append(moves)
    return plan


def moves_to_paths(instance: Instance, plan: Sequence[Sequence[Move | str]]) -> list[list[Cell]]:
    """Cells visited by each agent from its start (no validity check: off-grid cells are returned as computed)."""
    out = []
    for (r, c), moves in zip(instance.starts, plan):
        cells = [(r, c)]
        for m in moves:
            dr, dc = DELTAS[Move(m)]
            r, c = r + dr, c + dc
            cells.append((r, c))
        out.append(cells)
    return out
