"""The low level of CBS: one agent's constraints, the conflict-avoidance table, space-time A* and MDDs.

Cells are grid indices (``row * width + col``); a space-time key is ``t * ncell + cell``, an edge key is
``(t * ncell + frm) * ncell + to`` (the move ``frm -> to`` arriving at ``t``). An agent's cost is the time of its last
arrival at its goal, where it then stays (the rules of :mod:`envgen.core.simulate`).
"""

from __future__ import annotations

import bisect
import heapq
from functools import lru_cache
from typing import NamedTuple

from envgen.core.grid import Grid

INF = 1 << 40
"""An unbounded time or cost."""


class AgentConstraints(NamedTuple):
    """Everything the constraint tree forbids one agent (immutable, hashable: nodes share unchanged ones, and MDDs and
    pairwise heuristic values are memoised on them).

    Attributes:
        vertex: space-time keys ``t * ncell + cell`` the agent may not occupy.
        edge: edge keys ``(t * ncell + frm) * ncell + to``: moves it may not make.
        min_cost: its cost is at least this (target reasoning: it may not have settled on its goal before).
        max_cost: its cost is at most this (target reasoning: it must have settled on its goal by then).
        blocked: ``(cell, t)`` pairs: the cell is forbidden at ``t`` and every later time (another agent has settled
            on its goal there).
        last: the latest time at which any of the above can bite (-1: none); later the agent's world is static.
        goal_block: the latest vertex constraint on the agent's own goal (-1: none).
    """

    vertex: frozenset[int] = frozenset()
    edge: frozenset[int] = frozenset()
    min_cost: int = 0
    max_cost: int = INF
    blocked: tuple[tuple[int, int], ...] = ()
    last: int = -1
    goal_block: int = -1

    @property
    def hold(self) -> int:
        """The earliest time the agent may settle on its goal."""
        return max(self.goal_block + 1, self.min_cost)

    def with_vertices(self, keys: tuple[int, ...], ncell: int, goal: int) -> AgentConstraints:
        times = [k // ncell for k in keys]
        on_goal = [k // ncell for k in keys if k % ncell == goal]
        return self._replace(vertex=self.vertex | set(keys), last=max(self.last, *times),
                             goal_block=max(self.goal_block, *on_goal) if on_goal else self.goal_block)

    def with_edge(self, key: int, ncell: int) -> AgentConstraints:
        return self._replace(edge=self.edge | {key}, last=max(self.last, key // (ncell * ncell)))

    def with_min_cost(self, cost: int) -> AgentConstraints:
        return self._replace(min_cost=max(self.min_cost, cost), last=max(self.last, cost))

    def with_max_cost(self, cost: int) -> AgentConstraints:
        return self._replace(max_cost=min(self.max_cost, cost))

    def with_blocked(self, cell: int, t: int) -> AgentConstraints:
        blocked = add_block(self.blocked, cell, t)
        return self if blocked is self.blocked else self.with_blocks(blocked, t)

    def with_blocks(self, blocked: tuple[tuple[int, int], ...], t: int) -> AgentConstraints:
        """These constraints with ``blocked`` (from :func:`add_block`, its latest addition at ``t``) as the blocks."""
        # positional, as _replace would be, without its keyword handling (a settle branch calls this for every agent)
        return AgentConstraints(self.vertex, self.edge, self.min_cost, self.max_cost, blocked, max(self.last, t),
                                self.goal_block)

    def allows(self, path: list[int], ncell: int) -> bool:
        """Whether ``path`` (cells from time 0 to the arrival) obeys every constraint."""
        cost = len(path) - 1
        if not self.min_cost <= cost <= self.max_cost or cost < self.goal_block + 1:
            return False
        goal = path[-1]
        horizon = max(self.last, cost)
        for t in range(horizon + 1):
            c = path[t] if t <= cost else goal
            if t * ncell + c in self.vertex:
                return False
            if t and self.edge and (t * ncell + (path[t - 1] if t - 1 <= cost else goal)) * ncell + c in self.edge:
                return False
        for cell, since in self.blocked:
            if cell == goal or any(path[t] == cell for t in range(since, cost + 1)):
                return False
        return True


NO_CONSTRAINTS = AgentConstraints()


def add_block(blocked: tuple[tuple[int, int], ...], cell: int, t: int) -> tuple[tuple[int, int], ...]:
    """``blocked`` (``(cell, since)`` pairs sorted by cell) with ``cell`` forbidden from ``t`` on; the same tuple when
    the cell already is from ``t`` or earlier."""
    for i, (c, since) in enumerate(blocked):
        if c == cell:
            if since <= t:
                return blocked
            blocked = blocked[:i] + blocked[i + 1:]
            break
    i = bisect.bisect(blocked, (cell, t))
    return blocked[:i] + ((cell, t),) + blocked[i:]


class ConflictAvoidanceTable:
    """Where the loaded agents are, for tie-breaking toward fewer conflicts and for finding the conflicts of a new path.

    Kept across constraint-tree nodes: :meth:`load` updates only the agents whose path differs (by identity) from the
    one loaded, so a child costs the replanned agents' paths, not a rebuild. ``occ[t * ncell + c]`` counts loaded
    agents on ``c`` at ``t`` up to their arrival; ``park[c]`` is the time from which the agent whose goal is ``c``
    stays there (after its arrival); ``moves`` counts moves by their edge key.
    """

    def __init__(self, ncell: int, n: int) -> None:
        self.ncell = ncell
        # One byte per (time, cell) while no count can pass 255 (an agent is on one cell at a time): growing it is a
        # memset, where a list of 0s cost 4% of a small J-morag solve; a list past 255 agents.
        self.occ: bytearray | list[int] = bytearray() if n < 256 else []
        self.tlen = 0
        self.park = [INF] * ncell
        self.moves: dict[int, int] = {}
        self.paths: list[list[int] | None] = [None] * n
        self.lengths: dict[int, int] = {}

    @property
    def horizon(self) -> int:
        """The longest loaded path's length (times ``0 .. horizon - 1`` are in ``occ``); 0 when none is loaded."""
        return max(self.lengths) if self.lengths else 0

    def add(self, a: int, path: list[int]) -> None:
        nc = self.ncell
        n = len(path)
        if n > self.tlen:
            grow = (n - self.tlen) * nc
            self.occ += bytes(grow) if type(self.occ) is bytearray else [0] * grow
            self.tlen = n
        occ, moves = self.occ, self.moves
        prev = path[0]
        occ[prev] += 1
        for t in range(1, n):
            c = path[t]
            occ[t * nc + c] += 1
            if c != prev:
                k = (t * nc + prev) * nc + c
                moves[k] = moves.get(k, 0) + 1
            prev = c
        self.park[prev] = n
        self.paths[a] = path
        self.lengths[n] = self.lengths.get(n, 0) + 1

    def remove(self, a: int) -> None:
        path = self.paths[a]
        if path is None:
            return
        nc = self.ncell
        occ, moves = self.occ, self.moves
        prev = path[0]
        occ[prev] -= 1
        for t in range(1, len(path)):
            c = path[t]
            occ[t * nc + c] -= 1
            if c != prev:
                k = (t * nc + prev) * nc + c
                if moves[k] == 1:
                    del moves[k]
                else:
                    moves[k] -= 1
            prev = c
        if self.park[prev] == len(path):
            self.park[prev] = INF
        self.paths[a] = None
        n = len(path)
        if self.lengths[n] == 1:
            del self.lengths[n]
        else:
            self.lengths[n] -= 1

    def load(self, paths: list[list[int]], skip: tuple[int, ...] | list[int] = ()) -> None:
        """Make the table hold ``paths`` (agents beyond its end, or in ``skip``, are taken out)."""
        mine = self.paths
        have = len(paths)
        for a in range(len(mine)):
            p = paths[a] if a < have and a not in skip else None
            if mine[a] is not p:
                if mine[a] is not None:
                    self.remove(a)
                if p is not None:
                    self.add(a, p)

    def clear(self) -> None:
        for a in range(len(self.paths)):
            self.remove(a)


def find_path(grid: Grid, h: list[int], start: int, goal: int, cons: AgentConstraints,
              cat: ConflictAvoidanceTable | None, lower_bound: int = 0) -> list[int] | None:
    """A shortest path (cells from time 0 to the arrival) that obeys ``cons``, with ties broken toward fewer conflicts
    with the paths in ``cat``; None when the constraints leave no path.

    Best-first on ``(max(f, L), conflicts, -g)`` with ``f = g + h`` and ``L`` a lower bound on the cost (the agent's
    previous cost, or when it may settle on its goal): every node with ``f <= L`` ties on the first key, so among the
    paths of the optimal cost the search follows fewest conflicts (a focal search with weight 1). ``h`` is the exact
    obstacle-aware distance to the goal. After the last time any constraint or loaded path can matter, the world is
    static: states stop carrying time and, without permanent blocks, the rest of the path is a shortest path.
    """
    ncell = len(h)
    vcons, econs = cons.vertex, cons.edge
    hold = cons.hold
    max_cost = cons.max_cost
    if start in vcons:  # time 0
        return None
    blocked = dict(cons.blocked) if cons.blocked else None
    if blocked is not None and blocked.get(start, INF) <= 0:
        return None
    bound = max(lower_bound, hold, h[start])
    if bound > max_cost:
        return None
    if blocked is not None and not may_pass_blocks(grid, start, goal, cons.blocked):
        return None
    last = cons.last
    if cat is not None:
        occ, tlen, park, moves = cat.occ, cat.tlen, cat.park, cat.moves
        static = max(last, cat.horizon - 1) + 1
    else:
        occ, tlen, park, moves = (), 0, None, None
        static = last + 1
    options = grid.options
    if static <= 0 and blocked is None:
        return shortest_path(grid, h, start, goal)
    cells = [start]
    parents = [-1]
    keys = [start]
    best = {start: 0}  # key -> g * _SCALE + conflicts of its best entry (time-free keys can be reached at several g)
    # Open states by level: the heap holds those with f <= level, ordered by (conflicts, -g, order of admission). A
    # move to f > level waits in `later`, by f, unchecked, until the level rises to f (most never do: the first level
    # usually has a path); then the moves of that level are checked in the order they were made and admitted.
    level = bound
    heap: list[tuple[int, int, int]] = [(0, 0, 0)]
    later: dict[int, list[tuple[int, int, int, int, int, int]]] = {}
    batch: list[tuple[int, int, int, int, int, int]] = []
    pop, push = heapq.heappop, heapq.heappush
    while True:
        if heap:
            conf, negt, idx = pop(heap)
            key = keys[idx]
            t = -negt
            if best[key] < t * _SCALE + conf:
                continue  # reached again, earlier or with fewer conflicts
            u = cells[idx]
            if u == goal and t >= hold and key >= 0:
                return _trace(cells, parents, idx)
            if t >= static:
                if blocked is None and u != goal:
                    path = _trace(cells, parents, idx)
                    while u != goal:
                        du = h[u] - 1
                        u = next(v for v in options[u] if h[v] == du)
                        path.append(u)
                    return path
                tt = static
            else:
                tt = t + 1
            nt = t + 1
            base = tt * ncell
            waits = t < static
            on_goal = u == goal
            batch.clear()
            for v in options[u]:
                if v == u:
                    if not waits:
                        continue
                    k = -base - v - 1 if on_goal else base + v  # waiting on the goal is not an arrival
                else:
                    k = base + v
                f = nt + h[v]
                move = (conf, nt, u, v, k, idx)
                if f <= level:
                    batch.append(move)
                elif f <= max_cost:
                    if f in later:
                        later[f].append(move)
                    else:
                        later[f] = [move]
            moves_now = batch
        elif later:
            level = min(later)
            moves_now = later.pop(level)
        else:
            return None
        for conf, nt, u, v, k, idx in moves_now:
            here = nt * ncell
            if nt <= last:
                if here + v in vcons:
                    continue
                if econs and v != u and (here + u) * ncell + v in econs:
                    continue
            if blocked is not None:
                since = blocked.get(v)
                if since is not None and nt >= since:
                    continue
            c = conf
            if park is not None:
                if nt < tlen:
                    c += occ[here + v]
                if park[v] <= nt:
                    c += 1
                if v != u and moves:
                    c += moves.get((here + v) * ncell + u, 0)
            rank = nt * _SCALE + c
            old = best.get(k)
            if old is not None and old <= rank:
                continue
            best[k] = rank
            push(heap, (c, -nt, len(cells)))
            cells.append(v)
            parents.append(idx)
            keys.append(k)


@lru_cache(maxsize=16384)  # an agent's blocks are shared by many constraint-tree nodes
def may_pass_blocks(grid: Grid, start: int, goal: int, blocked: tuple[tuple[int, int], ...]) -> bool:
    """False when no path from ``start`` to ``goal`` can obey the ``blocked`` constraints (each cell forbidden from
    its time on), whatever the other constraints: a quick proof that :func:`find_path` would return None, which it
    would otherwise reach only by exhausting every (time, cell) state.

    A relaxation: at ``T``, the latest block's time, any such path is on a cell no block covers (or on its goal,
    never a blocked cell), reachable from ``start`` within ``T`` steps, and from there reaches ``goal`` without
    entering a blocked cell. If no cell is all three, no path exists. True says nothing (the search decides)."""
    walls = frozenset([cell for cell, _ in blocked])
    if _walk_round(grid, start, goal, walls):
        return True  # it may wait on its start until T, then walk round the blocked cells
    side = _goal_side(grid, goal, walls)
    latest = max(t for _, t in blocked)
    reach = grid.distances_from(start)
    return any(side[u] and 0 <= reach[u] <= latest for u in range(len(reach)))


def _walk_round(grid: Grid, start: int, goal: int, walls: frozenset[int]) -> bool:
    """Whether ``start`` reaches ``goal`` without entering a wall (the goal itself may be one), i.e. ``_goal_side(grid,
    goal, walls)[start]``, found by a depth-first walk that tries the cells nearer the goal first: where the walls
    leave a way, it follows it in about the distance's steps instead of flooding the whole map."""
    if start == goal:
        return True
    if start in walls:
        return False
    h = grid.distances_from(goal)
    if h[start] < 0:
        return False
    nbrs = grid.neighbors
    seen = {start}
    stack = [start]
    while stack:
        u = stack.pop()
        down = h[u] - 1
        nearer = -1
        for v in nbrs[u]:
            if v == goal:
                return True
            if v not in seen and v not in walls:
                seen.add(v)
                if nearer < 0 and h[v] == down:
                    nearer = v
                else:
                    stack.append(v)
        if nearer >= 0:
            stack.append(nearer)  # popped next: a step toward the goal
    return False


@lru_cache(maxsize=4096)
def _goal_side(grid: Grid, goal: int, walls: frozenset[int]) -> bytes:
    """``side[u]`` is 1 when cell ``u`` (not a wall) reaches ``goal`` without entering a wall."""
    side = bytearray(len(grid.free))
    nbrs = grid.neighbors
    side[goal] = 1
    stack = [goal]
    while stack:
        u = stack.pop()
        for v in nbrs[u]:
            if not side[v] and v not in walls:
                side[v] = 1
                stack.append(v)
    return bytes(side)


_SCALE = 1 << 24
"""Ranks a search state by its time, then its conflicts."""


def _trace(cells: list[int], parents: list[int], idx: int) -> list[int]:
    path = []
    while idx >= 0:
        path.append(cells[idx])
        idx = parents[idx]
    path.reverse()
    return path


def shortest_path(grid: Grid, h: list[int], start: int, goal: int) -> list[int]:
    """A shortest path along ``h`` (the distances to ``goal``): the first neighbour one step closer, every step."""
    options = grid.options
    path = [start]
    u = start
    while u != goal:
        du = h[u] - 1
        for v in options[u]:
            if h[v] == du:
                u = v
                break
        path.append(u)
    return path


class MDD(NamedTuple):
    """The multi-valued decision diagram of one agent at one cost: ``levels[t]`` is the set of cells the agent can
    occupy at ``t`` on some path of exactly that cost obeying its constraints (``levels[cost] == {goal}``; the agent
    is off its goal at ``cost - 1``, since its cost is its last arrival)."""

    levels: tuple[frozenset[int], ...]

    def width(self, t: int) -> int:
        return len(self.levels[t]) if t < len(self.levels) else 1


def build_mdd(grid: Grid, h: list[int], start: int, goal: int, cost: int, cons: AgentConstraints) -> MDD | None:
    """The MDD of the paths of exactly ``cost`` (None when there is none)."""
    ncell = len(h)
    options = grid.options
    vcons, econs = cons.vertex, cons.edge
    blocked = dict(cons.blocked) if cons.blocked else {}
    if cost > cons.max_cost or cost < cons.hold or h[start] > cost:
        return None
    if cost == 1 and start == goal:
        return None  # an agent on its goal at time 0 cannot arrive there last at time 1
    forward: list[set[int]] = [{start}]
    free_after = INF if blocked else cons.last  # from here on no constraint applies: no checks but the distance
    for t in range(1, cost + 1):
        room = cost - t
        base = t * ncell
        if t > free_after:
            nxt = {v for u in forward[-1] for v in options[u] if h[v] <= room}
        else:
            nxt = set()
            for u in forward[-1]:
                for v in options[u]:
                    if v in nxt or h[v] > room or base + v in vcons:
                        continue
                    if econs and v != u and (base + u) * ncell + v in econs:
                        continue
                    since = blocked.get(v)
                    if since is not None and t >= since:
                        continue
                    nxt.add(v)
        if t == cost - 1:
            nxt.discard(goal)
        if not nxt:
            return None
        forward.append(nxt)
    if goal not in forward[cost]:
        return None
    levels: list[frozenset[int]] = [frozenset()] * (cost + 1)
    levels[cost] = frozenset((goal,))
    edges_until = cons.last if econs else -1  # moves into t + 1 beyond it are never forbidden
    for t in range(cost - 1, -1, -1):
        after = levels[t + 1]
        if t + 1 > edges_until:
            levels[t] = frozenset([u for u in forward[t] if not after.isdisjoint(options[u])])
            continue
        base = (t + 1) * ncell
        keep = set()
        for u in forward[t]:
            for v in options[u]:
                if v in after and not (econs and v != u and (base + u) * ncell + v in econs):
                    keep.add(u)
                    break
        levels[t] = frozenset(keep)
    return MDD(tuple(levels))
