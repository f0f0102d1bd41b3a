"""Rectangle reasoning (Li et al. 2019, "Symmetry-Breaking Constraints for Grid-Based Multi-Agent Path Finding"),
restricted to rectangles whose barrier split is proved sound.

Two agents cross an obstacle-light region moving monotonically in the same quadrant (rows one way, columns one way);
every shortest way through has a conflict, and plain CBS enumerates them one vertex at a time. A rectangle conflict
resolves them in one split: agent ``A`` may not stand on the rectangle's far side across its way (its *barrier*) at
the times it would reach it, or agent ``B`` may not stand on its own barrier.

Let ``tau(u) = tau0 + x + y`` for a cell ``u`` at ``(x, y)`` steps from the rectangle's first corner in the direction
of travel (both agents are at the conflict cell at ``tau``). The split is **sound** (every conflict-free plan obeys
one of the two children) when, for each agent, with ``LB(u)`` its shortest distance from its start:

1. ``LB(u) >= tau(u)`` for every cell of the rectangle: it is never inside earlier than ``tau``;
2. every neighbour ``z`` outside the rectangle of a border cell ``u``, except across its own entry side, has
   ``LB(z) >= tau(u)``: it cannot step into ``u`` from there at ``tau(u)``.

Then an agent on its barrier at ``tau`` got there by a monotone staircase, each cell at its ``tau``, from its entry
side (``A`` from the west side to the east side, ``B`` from the north side to the south side, in the rectangle's own
orientation); two such staircases share a cell, at the same time: a vertex conflict. This holds for any paths, of any
cost, under the project's rules (agents stay on their goals; only vertex meetings are used), so no optimal plan is
lost. The classic case (both agents on shortest paths from their starts, Li et al.'s "R") satisfies both conditions;
an agent that has been delayed does not, and its conflicts are left to the other splits.

**Second split: from the starts** (``CBSOptions.rectangle_starts``; the barriers of Li et al.'s ``R``). It is tried
when the first fails and both agents have moved every step since time 0 towards the conflict, from starts ``s_N``
and ``s_W`` on the two side lines of the corner ``Rs`` (in travel coordinates ``x_N < x_W = Rs.x`` and
``y_W < y_N = Rs.y``) at the same distance from it (``x_N + y_N = x_W + y_W``; true when they meet on time). For a far
corner ``F >= Rs``, ``N`` may not stand on row ``x = F.x`` at any column ``y_N <= y <= F.y`` at time
``|s_N - (F.x, y)|`` (the Manhattan distance), and ``W`` may not stand on column ``y = F.y`` at any row
``x_W <= x <= F.x`` at time ``|s_W - (x, F.y)|``. Proof that every pair of plans obeys one child: an agent on such a
cell at that time has moved towards it every step, a monotone staircase from its start, whatever the obstacles.
``N``'s, from the time it reaches row ``x_W``, stays in the rectangle ``[x_W, F.x] x [y_N, F.y]`` and crosses it from
its top row to its bottom row; ``W``'s, from the time it reaches column ``y_N``, crosses it from its left column to
its right column. Two such 4-connected paths share a cell ``u``, where each is at its Manhattan distance from its
start, equal for both since the starts' coordinate sums are: a vertex conflict. This holds for any ``F >= Rs`` and
any paths, so ``F`` is chosen for use, not for soundness: the largest of ``Rg``, ``(Rg.x, u.y)``, ``(u.x, Rg.y)`` and
the conflict's cell ``u`` whose barriers both current paths cross (at ``u`` itself they always do). This catches the
rectangles whose first split fails on condition 2 (a start on a side line lets that agent enter across the other
side as well) or because one path leaves across the other far side.
"""

from __future__ import annotations

from typing import Any, Protocol

from envgen.core.grid import Grid
from envgen.solver.cbs_conflicts import Conflict, Kind, Priority
from envgen.solver.cbs_lowlevel import MDD, AgentConstraints


class CBS(Protocol):
    """What rectangle reasoning reads of the search (:class:`envgen.solver.cbs_search.CBS`), named here so that this
    module does not import the search that calls it."""

    grid: Grid
    starts: Any  # each agent's start cell
    ncell: int
    options: Any  # CBSOptions (its rectangle_starts)


class Node(Protocol):
    """What rectangle reasoning reads of a constraint-tree node (:class:`envgen.solver.cbs_search.Node`)."""

    paths: list[list[int]]
    cons: list[AgentConstraints]


def rectangle_conflict(search: CBS, node: Node, conflict: Conflict, mdd_a: MDD,
                       mdd_b: MDD) -> tuple[Conflict, tuple[int, int, int]] | None:
    """The rectangle conflict behind a vertex ``conflict`` and its rank, or None when there is no provable one."""
    grid = search.grid
    width = grid.width
    t = conflict.t
    p1, p2 = node.paths[conflict.a], node.paths[conflict.b]
    if t >= len(p1) - 1 or t >= len(p2) - 1:
        return None
    seg1, seg2 = _segment(p1, t, width), _segment(p2, t, width)
    if seg1 is None or seg2 is None:
        return None
    dr = seg1[2] or seg2[2]
    dc = seg1[3] or seg2[3]
    if (seg1[2] and seg2[2] and seg1[2] != seg2[2]) or (seg1[3] and seg2[3] and seg1[3] != seg2[3]):
        return None
    dr, dc = dr or 1, dc or 1

    def prog(cell: int) -> tuple[int, int]:
        r, c = divmod(cell, width)
        return dr * r, dc * c

    s1, g1 = prog(p1[seg1[0]]), prog(p1[seg1[1]])
    s2, g2 = prog(p2[seg2[0]]), prog(p2[seg2[1]])
    rs = (max(s1[0], s2[0]), max(s1[1], s2[1]))
    rg = (min(g1[0], g2[0]), min(g1[1], g2[1]))
    size_x, size_y = rg[0] - rs[0], rg[1] - rs[1]
    if size_x < 0 or size_y < 0 or size_x + size_y == 0:
        return None
    cx, cy = prog(conflict.u)
    tau0 = t - (cx - rs[0]) - (cy - rs[1])
    if tau0 < 0:
        return None
    rect = _Rectangle(grid.height, width, dr, dc, rs, size_x, size_y, tau0)
    for west, north in ((conflict.a, conflict.b), (conflict.b, conflict.a)):
        if not (rect.provable(grid.distances_from(search.starts[west]), entry="west")
                and rect.provable(grid.distances_from(search.starts[north]), entry="north")):
            continue
        ncell = search.ncell
        free = grid.free
        bar_w = tuple(k for k in rect.side("east", ncell) if free[k % ncell])
        bar_n = tuple(k for k in rect.side("south", ncell) if free[k % ncell])
        found = _split(search, node, conflict, (west, north), (bar_w, bar_n), mdd_a, mdd_b)
        if found is not None:
            return found
    if search.options.rectangle_starts and seg1[0] == 0 and seg2[0] == 0:
        return _from_starts(search, node, conflict, (s1, s2), rg, (cx, cy), (dr, dc), mdd_a, mdd_b)
    return None


def _from_starts(search: CBS, node: Node, conflict: Conflict, starts: tuple[tuple[int, int], tuple[int, int]],
                 rg: tuple[int, int], meet: tuple[int, int], direction: tuple[int, int], mdd_a: MDD,
                 mdd_b: MDD) -> tuple[Conflict, tuple[int, int, int]] | None:
    """The second split of the module docstring, for two agents that have moved every step since time 0 towards their
    meeting cell ``meet``: the far corner is the largest of ``rg``, ``(rg.x, meet.y)``, ``(meet.x, rg.y)`` and ``meet``
    whose barriers both current paths cross (at ``meet`` they always do); None when the starts are not on the two side
    lines at the same distance from the corner."""
    (s1, s2), a, b = starts, conflict.a, conflict.b
    if s1[0] < s2[0] and s1[1] > s2[1]:
        north, west, sn, sw = a, b, s1, s2
    elif s2[0] < s1[0] and s2[1] > s1[1]:
        north, west, sn, sw = b, a, s2, s1
    else:
        return None
    if sn[0] + sn[1] != sw[0] + sw[1]:
        return None
    ncell, free, width = search.ncell, search.grid.free, search.grid.width
    dr, dc = direction

    def key(x: int, y: int, time: int) -> int | None:
        cell = (dr * x) * width + dc * y
        return time * ncell + cell if free[cell] else None

    for far in (rg, (rg[0], meet[1]), (meet[0], rg[1]), meet):
        if far[0] < sw[0] or far[1] < sn[1] or far == (sw[0], sn[1]):
            continue
        bar_n = tuple(k for y in range(sn[1], far[1] + 1)
                      if (k := key(far[0], y, far[0] - sn[0] + y - sn[1])) is not None)
        bar_w = tuple(k for x in range(sw[0], far[0] + 1)
                      if (k := key(x, far[1], x - sw[0] + far[1] - sw[1])) is not None)
        found = _split(search, node, conflict, (west, north), (bar_w, bar_n), mdd_a, mdd_b)
        if found is not None:
            return found
    return None


def _split(search: CBS, node: Node, conflict: Conflict, agents: tuple[int, int], barriers: tuple[tuple[int, ...], ...],
           mdd_a: MDD, mdd_b: MDD) -> tuple[Conflict, tuple[int, int, int]] | None:
    """The rectangle conflict forbidding ``barriers[i]`` to ``agents[i]`` (west, then north) in one child each, ranked
    by whether every path of each agent's MDD crosses its barrier; None unless both current paths cross theirs."""
    ncell = search.ncell
    if not all(_violates(node.paths[agent], bar, ncell) for agent, bar in zip(agents, barriers)):
        return None
    mdds = {conflict.a: mdd_a, conflict.b: mdd_b}
    one, two = (_blocks(search.grid, mdds[agent], bar, ncell, node.cons[agent].edge)
                for agent, bar in zip(agents, barriers))
    priority = Priority.CARDINAL if one and two else Priority.SEMI if one or two else Priority.NON
    return (Conflict(Kind.RECTANGLE, *agents, conflict.t, conflict.u, -1, tuple(barriers)),
            (priority, Kind.RECTANGLE, conflict.t))


def _segment(path: list[int], t: int, width: int) -> tuple[int, int, int, int] | None:
    """The longest stretch of ``path`` around ``t`` that moves every step, never reversing a direction:
    ``(first time, last time, row direction, column direction)`` (a direction is 0 when unused)."""
    vert = horiz = 0
    ends = [t, t]
    for step, stop in ((-1, 0), (1, len(path) - 1)):
        s = t
        while s != stop:
            d = path[s + step] - path[s] if step > 0 else path[s] - path[s - 1]
            if d == 0:
                break
            if d in (width, -width):
                v = 1 if d == width else -1
                if vert and v != vert:
                    break
                vert = v
            else:
                h = 1 if d == 1 else -1
                if horiz and h != horiz:
                    break
                horiz = h
            s += step
        ends[step > 0] = s
    if ends[0] == ends[1]:
        return None
    return ends[0], ends[1], vert, horiz


class _Rectangle:
    """A rectangle in travel coordinates: ``x`` along the row direction ``dr``, ``y`` along the column direction
    ``dc``, from the first corner ``rs`` (x 0..size_x, y 0..size_y); ``tau(x, y) = tau0 + x + y``."""

    def __init__(self, height: int, width: int, dr: int, dc: int, rs: tuple[int, int], size_x: int, size_y: int,
                 tau0: int) -> None:
        self.height, self.width = height, width
        self.dr, self.dc = dr, dc
        self.rs = rs
        self.size_x, self.size_y = size_x, size_y
        self.tau0 = tau0

    def cell(self, x: int, y: int) -> int | None:
        r = self.dr * (self.rs[0] + x)
        c = self.dc * (self.rs[1] + y)
        return r * self.width + c if 0 <= r < self.height and 0 <= c < self.width else None

    def provable(self, lb: list[int], entry: str) -> bool:
        """Conditions 1 and 2 of the module docstring for an agent with start distances ``lb`` entering across
        ``entry`` ("west": the side ``y = 0``; "north": the side ``x = 0``)."""
        tau0, sx, sy = self.tau0, self.size_x, self.size_y

        def early(cell: int | None, tau: int) -> bool:
            return cell is not None and 0 <= lb[cell] < tau

        for x in range(sx + 1):
            for y in range(sy + 1):
                if early(self.cell(x, y), tau0 + x + y):
                    return False
        for y in range(sy + 1):
            if entry != "north" and early(self.cell(-1, y), tau0 + y):
                return False
            if early(self.cell(sx + 1, y), tau0 + sx + y):
                return False
        for x in range(sx + 1):
            if entry != "west" and early(self.cell(x, -1), tau0 + x):
                return False
            if early(self.cell(x, sy + 1), tau0 + x + sy):
                return False
        return True

    def side(self, which: str, ncell: int) -> list[int]:
        """The space-time keys of the far side ("east": ``y = size_y``; "south": ``x = size_x``) at their ``tau``."""
        if which == "east":
            spots = [(x, self.size_y) for x in range(self.size_x + 1)]
        else:
            spots = [(self.size_x, y) for y in range(self.size_y + 1)]
        return [(self.tau0 + x + y) * ncell + self.cell(x, y) for x, y in spots]


def _violates(path: list[int], keys: tuple[int, ...], ncell: int) -> bool:
    """Whether ``path`` (then its goal, for good) occupies one of the space-time ``keys``."""
    last = len(path) - 1
    for k in keys:
        t, cell = divmod(k, ncell)
        if (path[t] if t <= last else path[last]) == cell:
            return True
    return False


def _blocks(grid, mdd: MDD, keys: tuple[int, ...], ncell: int, edges: frozenset[int]) -> bool:
    """Whether every path of ``mdd`` occupies one of ``keys`` (then forbidding them raises the agent's cost)."""
    banned = set(keys)
    options = grid.options
    levels = mdd.levels
    reach = {c for c in levels[0] if c not in banned}
    for t in range(1, len(levels)):
        base = t * ncell
        nxt = set()
        for u in reach:
            for v in options[u]:
                if v in levels[t] and base + v not in banned and not (
                        edges and v != u and (base + u) * ncell + v in edges):
                    nxt.add(v)
        if not nxt:
            return True
        reach = nxt
    goal = next(iter(levels[-1]))
    last = len(levels) - 1
    return any(k // ncell > last and k % ncell == goal for k in banned)
