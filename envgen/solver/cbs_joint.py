"""Exhaustive searches over joint configurations of a small group of agents: what CBS cannot do.

- :func:`joint_search`: optimal sum-of-costs A* over joint states; it finds the optimum, or proves by exhausting them
  that no plan exists.
- :func:`reachable`: whether the agents' goal configuration can be reached at all, ignoring time (a breadth-first
  search from both ends over configurations). Much smaller than the joint A*'s space, so it proves unsolvable groups
  (and sub-groups: if some of the agents cannot reach their goals even alone, neither can all of them) cheaply.

Cells are grid indices; both searches follow the project's rules (no shared cell, no swap; following and rotations
allowed; an agent's cost is its last arrival at its goal).
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

from envgen.core.grid import Grid


class JointPlan(NamedTuple):
    """Optimal paths (cells from time 0 to each agent's last arrival), their sum of costs, and the states visited."""

    paths: list[list[int]]
    soc: int
    states: int


class JointFailure(NamedTuple):
    """No plan: ``unsolvable`` when the joint states were exhausted (proof), else the state budget ran out."""

    unsolvable: bool
    states: int


def joint_search(grid: Grid, starts: list[int], goals: list[int], max_states: int,
                 avoid: list[list[int]] | None = None, max_cost: int | None = None) -> JointPlan | JointFailure:
    """Optimal sum-of-costs A* over joint configurations; exact, and proves unsolvability by exhausting them.

    A state is every agent's cell and whether it has finished (settled on its goal for good). A step costs the number
    of unfinished agents; finishing costs nothing. The heuristic, the sum of the unfinished agents' distances to their
    goals, is consistent, so the first finished state popped is optimal. ``max_states`` bounds the states visited.
    (Moving the agents one at a time, operator decomposition, visits several times more states here: the heuristic is
    weak in the crowded pockets this search is for.)

    ``avoid``: paths of other agents (each stays on its last cell) that the plan must not conflict with; the state then
    carries the time up to the longest of them. ``max_cost``: only plans of at most that sum of costs. With either, a
    failure that exhausts the states proves only that no such plan exists.
    """
    n = len(starts)
    hs = [grid.distances_from(g) for g in goals]
    options = grid.options
    all_done = (1 << n) - 1
    avoid = avoid or []
    horizon = max((len(q) - 1 for q in avoid), default=0)  # past it the time no longer matters: t stays there
    at = [frozenset(q[min(t, len(q) - 1)] for q in avoid) for t in range(horizon + 1)]
    moved = [frozenset((q[t - 1], q[t]) for q in avoid if 0 < t < len(q)) for t in range(horizon + 1)]
    last_visit: dict[int, float] = {}
    for q in avoid:
        for t, c in enumerate(q):
            last_visit[c] = t
        last_visit[q[-1]] = float("inf")
    limit = (1 << 60) if max_cost is None else max_cost
    start = (tuple(starts), 0, 0)
    if any(c in at[0] for c in starts):
        return JointFailure(True, 1)
    dist = {start: 0}
    parent: dict = {start: None}
    heap = [(sum(h[s] for h, s in zip(hs, starts)), 0, 0, start)]
    counter = 0
    pop, push = heapq.heappop, heapq.heappush
    while heap:
        _, negd, _, state = pop(heap)
        d = -negd
        if d > dist[state]:
            continue
        pos, done, t = state
        if done == all_done:
            return JointPlan(*_joint_paths(state, parent, n), len(dist))
        if len(dist) > max_states:
            return JointFailure(False, len(dist))
        succ = []
        for a in range(n):  # finishing: free of cost and time (and no avoided agent comes by the goal afterwards)
            if not done >> a & 1 and pos[a] == goals[a] and last_visit.get(goals[a], -1) < t:
                succ.append(((pos, done | 1 << a, t), 0))
        step_cost = n - bin(done).count("1")
        if step_cost:
            t2 = min(t + 1, horizon)
            busy, swaps = at[t2], moved[t2] if t < horizon else ()
            for nxt in _joint_moves(pos, [(pos[a],) if done >> a & 1 else options[pos[a]] for a in range(n)]):
                if avoid and any(v in busy or (v, u) in swaps for u, v in zip(pos, nxt)):
                    continue
                succ.append(((nxt, done, t2), step_cost))
        for s2, c in succ:
            d2 = d + c
            if d2 < dist.get(s2, 1 << 60):
                p2, done2, _ = s2
                h2 = d2
                for a in range(n):
                    if not done2 >> a & 1:
                        h2 += hs[a][p2[a]]
                if h2 > limit:
                    continue
                dist[s2] = d2
                parent[s2] = state
                counter += 1
                push(heap, (h2, -d2, counter, s2))
    return JointFailure(True, len(dist))


def _joint_moves(pos: tuple[int, ...], choices: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Every joint move with no two agents in one cell and no two swapping, built agent by agent."""
    partial: list[tuple[int, ...]] = [()]
    for a, options in enumerate(choices):
        here = pos[a]
        grown = []
        for chosen in partial:
            for v in options:
                if v in chosen:
                    continue
                if v != here and any(chosen[b] == here and pos[b] == v for b in range(a)):
                    continue
                grown.append((*chosen, v))
        partial = grown
    return partial


def _joint_paths(state, parent, n: int) -> tuple[list[list[int]], int]:
    """Per-agent paths from the chain of joint states (a changed ``done`` mask marks a finish, else a step)."""
    chain = []
    while state is not None:
        chain.append(state)
        state = parent[state]
    chain.reverse()
    timeline = [chain[0][0]]
    finish = [0] * n
    for (_, done0, _), (pos1, done1, _) in zip(chain, chain[1:]):
        if done1 != done0:
            for a in range(n):
                if done1 >> a & 1 and not done0 >> a & 1:
                    finish[a] = len(timeline) - 1
        else:
            timeline.append(pos1)
    return [[timeline[t][a] for t in range(finish[a] + 1)] for a in range(n)], sum(finish)


def reachable(grid: Grid, starts: list[int], goals: list[int], max_states: int) -> bool | None:
    """Whether the agents can all get from ``starts`` to ``goals`` at all (None: undecided within ``max_states``).

    Any conflict-free joint move is a sequence of single moves into empty cells (a line of agents following each
    other moves front first) and rotations of cycles whose every cell holds an agent (a grid cycle has at least 4
    cells, so only with 4 agents or more); so the configurations reachable by those steps are exactly the reachable
    ones. The search alternates between the two ends, always growing the smaller frontier: an unsolvable group is
    proved by exhausting the smaller side.
    """
    start, goal = tuple(starts), tuple(goals)
    if start == goal:
        return True
    neighbors = grid.neighbors
    k = len(start)
    sides = [({start}, [start]), ({goal}, [goal])]
    while sides[0][1] and sides[1][1]:
        i = 0 if len(sides[0][1]) <= len(sides[1][1]) else 1
        seen, frontier = sides[i]
        other = sides[1 - i][0]
        grown = []
        for conf in frontier:
            occupied = set(conf)
            for a in range(k):
                for v in neighbors[conf[a]]:
                    if v not in occupied:
                        nxt = (*conf[:a], v, *conf[a + 1:])
                        if nxt not in seen:
                            if nxt in other:
                                return True
                            seen.add(nxt)
                            grown.append(nxt)
            if k >= 4:
                for nxt in _rotations(conf, occupied, neighbors):
                    if nxt not in seen:
                        if nxt in other:
                            return True
                        seen.add(nxt)
                        grown.append(nxt)
        sides[i] = (seen, grown)
        if len(sides[0][0]) + len(sides[1][0]) > max_states:
            return None
    return False


def _rotations(conf: tuple[int, ...], occupied: set[int], neighbors) -> list[tuple[int, ...]]:
    """The configurations one rotation away: every simple cycle of occupied cells, turned one step either way."""
    core = {c: [v for v in neighbors[c] if v in occupied] for c in occupied}
    changed = True
    while changed:  # peel to the 2-core: only cells with two occupied neighbours can lie on a cycle
        changed = False
        for c in [c for c, around in core.items() if len(around) < 2]:
            del core[c]
            for around in core.values():
                if c in around:
                    around.remove(c)
            changed = True
    if not core:
        return []
    out = []
    for cycle in _cycles(core):
        for turn in (1, -1):
            step = {cycle[j]: cycle[(j + turn) % len(cycle)] for j in range(len(cycle))}
            out.append(tuple(step.get(c, c) for c in conf))
    return out


def _cycles(adjacent: dict[int, list[int]]) -> list[list[int]]:
    """Every simple cycle (length 4 or more) of a small graph, once each: it starts at its smallest cell and goes
    first toward the smaller of that cell's two cycle neighbours."""
    out = []
    for root in sorted(adjacent):
        stack = [(root, [root])]
        while stack:
            c, path = stack.pop()
            for v in adjacent[c]:
                if v == root and len(path) >= 4 and path[1] < path[-1]:
                    out.append(path)
                elif v > root and v not in path:
                    stack.append((v, [*path, v]))
    return out
