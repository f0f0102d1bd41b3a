"""The solver of generator version 1 (``mapf-frozenlake-gen/1``), kept unchanged so that files written by that version
regenerate byte for byte (:class:`envgen.generator.GeneratorOptions` ``version=1``). Why it is kept: the shipped
starting policy's demonstrations (``data/start/instances.parquet``, in git) were drawn by version 1 and ``dvc.lock``
records that version, so without it the start stages would be out of date and ``dvc repro`` would retrain the start.

Plain CBS as it was before :mod:`envgen.solver.cbs_search`: best-first over constraint-tree nodes ordered by (sum of costs,
number of conflicts), split on the earliest conflict, a space-time A* low level whose conflict-avoidance table is
rebuilt on every call; two agents on boards up to 10x10 go to an exact joint A* after ``JOINT_HANDOVER`` nodes
(:func:`solve_joint`). Its plans are optimal (same sums of costs as :func:`envgen.solver.cbs.solve`), but which optimal plan
it returns, how many nodes it counts, and which draws it leaves over budget differ from the current solver, and those
are written into every instance file. Use :func:`envgen.solver.cbs.solve` for anything else.

The budget is :class:`envgen.solver.cbs.SolverBudget` (``max_nodes``, ``max_seconds``, ``max_joint_work``; not
``max_joint_states``); results are :class:`envgen.solver.cbs.Solved` / :class:`envgen.solver.cbs.Unsolved`.
"""

from __future__ import annotations

import heapq
import time
from itertools import product
from typing import NamedTuple

from envgen.solver.cbs import Solved, SolveResult, SolverBudget, Unsolved, UnsolvedReason
from envgen.core.grid import UNREACHABLE, Grid, grid_of
from envgen.core.instance import Instance

JOINT_HANDOVER = 8
"""CBS nodes expanded before the joint search takes over, where it applies (``SolverBudget.max_joint_work``)."""



class Conflict(NamedTuple):
    """The earliest conflict between two agents' paths (cells as grid indices): a vertex conflict (``edge`` false: both
    in cell ``u`` at time ``t``) or an edge conflict (agent ``a`` moves ``u -> v`` while agent ``b`` moves ``v -> u``,
    both arriving at ``t``)."""

    edge: bool
    a: int
    b: int
    u: int
    v: int
    t: int


class HighLevelNode(NamedTuple):
    """A node of the constraint tree. Compared as a heap entry by ``soc``, then ``conflicts`` (fewer first), then
    ``order`` (unique: creation order), so the other fields are never compared.

    ``vertex_constraints[a]`` holds ``t * ncell + cell`` (agent ``a`` may not be in ``cell`` at ``t``);
    ``edge_constraints[a]`` holds ``(t * ncell + from) * ncell + to`` (nor move ``from -> to`` arriving at ``t``)."""

    soc: int
    conflicts: int
    order: int
    paths: list[list[int]]
    vertex_constraints: list[frozenset[int]]
    edge_constraints: list[frozenset[int]]
    conflict: Conflict | None


class GroupPlan(NamedTuple):
    """The optimal paths of one independent group of agents, the search nodes spent, and the method that found them."""

    paths: list[list[int]]
    nodes: int
    method: str


class Found(NamedTuple):
    """CBS found conflict-free optimal paths after expanding ``nodes`` nodes."""

    paths: list[list[int]]
    nodes: int


class NotFound(NamedTuple):
    """CBS stopped without a plan: ``reason`` (a budget ran out, or the tree was exhausted) after ``nodes`` nodes."""

    reason: UnsolvedReason
    nodes: int


def solve(instance: Instance, budget: SolverBudget | None = None) -> SolveResult:
    """Solve ``instance`` optimally for the sum of costs within ``budget``.

    Agents in different connected components of the grid never meet, so each component's agents are solved as an
    independent group (costs add up); the node budget applies per group, the time budget to the whole solve.

    >>> from envgen.core.instance import Instance
    >>> corridor = Instance(("FFF", "HFH"), ((0, 0), (0, 2)), ((0, 2), (0, 0)))
    >>> r = solve(corridor)
    >>> (r.soc, r.makespan, r.shortest, r.needs_wait)
    (7, 4, (2, 2), True)
    """
    budget = budget or SolverBudget()
    grid = grid_of(instance.rows)
    n = instance.num_agents
    starts = [grid.index(c) for c in instance.starts]
    goals = [grid.index(c) for c in instance.goals]
    hs = [grid.distances_from(g) for g in goals]
    shortest = tuple(h[s] for h, s in zip(hs, starts))
    if any(d == UNREACHABLE for d in shortest):
        a = next(i for i, d in enumerate(shortest) if d == UNREACHABLE)
        return Unsolved(UnsolvedReason.NO_PATH, f"agent {a + 1}: goal {instance.goals[a]} cannot be reached from {instance.starts[a]}", 0,
                        tuple(None if d == UNREACHABLE else d for d in shortest))
    deadline = time.perf_counter() + budget.max_seconds
    # Agent b shares agent a's component iff b's start is reachable from a's goal.
    group_of = list(range(n))
    for a in range(n):
        for b in range(a + 1, n):
            if hs[a][starts[b]] != UNREACHABLE:
                group_of[b] = group_of[a]
    groups: dict[int, list[int]] = {}
    for a in range(n):
        groups.setdefault(group_of[a], []).append(a)
    paths: list[list[int]] = [[] for _ in range(n)]
    nodes = 0
    methods = set()
    for agents in groups.values():
        got = _solve_group(instance, grid, agents, [starts[a] for a in agents], [goals[a] for a in agents],
                           [hs[a] for a in agents], budget, deadline)
        if isinstance(got, Unsolved):
            who = ", ".join(str(a + 1) for a in agents)
            return Unsolved(got.reason, f"agents {who}: {got.detail}" if len(groups) > 1 else got.detail, nodes + got.nodes, shortest)
        nodes += got.nodes
        methods.add(got.method)
        for a, path in zip(agents, got.paths):
            paths[a] = path
    cells = tuple(tuple(grid.cell(p) for p in path) for path in paths)
    costs = [len(p) - 1 for p in paths]
    return Solved(cells, sum(costs), max(costs), nodes, shortest, "joint" if "joint" in methods else "cbs")


def _solve_group(instance: Instance, grid: Grid, agents: list[int], starts: list[int], goals: list[int],
                 hs: list[list[int]], budget: SolverBudget, deadline: float) -> GroupPlan | Unsolved:
    """One independent group of agents."""
    k = len(agents)
    work = (10 * (len(hs[0]) - hs[0].count(UNREACHABLE))) ** k if k > 1 else 0
    use_joint = 0 < work <= budget.max_joint_work
    cap = min(budget.max_nodes, JOINT_HANDOVER) if use_joint else budget.max_nodes
    searched = _cbs(grid, starts, goals, hs, cap, deadline)
    if isinstance(searched, Found):
        return GroupPlan(searched.paths, searched.nodes, "cbs")
    reason, nodes = searched.reason, searched.nodes
    if reason is UnsolvedReason.UNSOLVABLE:
        return Unsolved(reason, "CBS exhausted its constraint tree: no conflict-free plan exists", nodes, ())
    if use_joint and reason is UnsolvedReason.NODE_BUDGET:
        sub = Instance(instance.rows, tuple(instance.starts[a] for a in agents), tuple(instance.goals[a] for a in agents))
        joint = solve_joint(sub, max_states=work)
        if isinstance(joint, Unsolved):
            return Unsolved(joint.reason, joint.detail, nodes + joint.nodes, ())
        return GroupPlan([[grid.index(c) for c in p] for p in joint.paths], nodes + joint.nodes, "joint")
    what = f"{cap} nodes" if reason is UnsolvedReason.NODE_BUDGET else f"{budget.max_seconds} s"
    return Unsolved(reason, f"CBS found no plan within {what}; the instance may be unsolvable or hard", nodes, ())


# ---------------------------------------------------------------------------------------------------- high level
def _cbs(grid: Grid, starts: list[int], goals: list[int], hs: list[list[int]], max_nodes: int,
         deadline: float) -> Found | NotFound:
    """Best-first search of the constraint tree."""
    n = len(starts)
    ncell = len(grid.free)
    options = grid.options
    empty: frozenset[int] = frozenset()
    vcons = [empty] * n
    econs = [empty] * n
    paths: list[list[int]] = []
    for a in range(n):
        path = _astar(options, hs[a], starts[a], goals[a], empty, empty, -1, -1, paths, ncell)
        assert path is not None  # unconstrained and reachable: A* always finds a path
        paths.append(path)
    conflict, count = _first_conflict(paths)
    if conflict is None:
        return Found(paths, 1)
    counter = 0
    open_list = [HighLevelNode(sum(len(p) - 1 for p in paths), count, counter, paths, vcons, econs, conflict)]
    expanded = 0
    while open_list:
        if expanded >= max_nodes:
            return NotFound(UnsolvedReason.NODE_BUDGET, expanded)
        if time.perf_counter() > deadline:
            return NotFound(UnsolvedReason.TIME_BUDGET, expanded)
        soc, _, _, paths, vcons, econs, conflict = heapq.heappop(open_list)
        expanded += 1
        if conflict is None:
            return Found(paths, expanded)
        edge, a, b, u, v, t = conflict
        # Vertex conflict at cell u: each agent in turn is forbidden from u at time t.
        # Edge conflict: agent a is forbidden to move u->v at t, agent b to move v->u at t.
        for agent, key, is_edge in (
            ((a, (t * ncell + u) * ncell + v, True), (b, (t * ncell + v) * ncell + u, True)) if edge
            else ((a, t * ncell + u, False), (b, t * ncell + u, False))
        ):
            cv, ce = vcons[agent], econs[agent]
            if is_edge:
                ce = ce | {key}
            else:
                cv = cv | {key}
            goal = goals[agent]
            goal_block = max((k // ncell for k in cv if k % ncell == goal), default=-1)
            last = max(max((k // ncell for k in cv), default=-1), max((k // (ncell * ncell) for k in ce), default=-1))
            others = [p for i, p in enumerate(paths) if i != agent]
            path = _astar(options, hs[agent], starts[agent], goal, cv, ce, goal_block, last, others, ncell)
            if path is None:
                continue
            child = list(paths)
            child[agent] = path
            nv, ne = list(vcons), list(econs)
            nv[agent], ne[agent] = cv, ce
            conflict2, count2 = _first_conflict(child)
            counter += 1
            heapq.heappush(open_list, HighLevelNode(soc - len(paths[agent]) + len(path), count2, counter, child, nv, ne,
                                                    conflict2))
    return NotFound(UnsolvedReason.UNSOLVABLE, expanded)  # constraint tree exhausted: CBS is complete, so no plan exists


def _first_conflict(paths: list[list[int]]) -> tuple[Conflict | None, int]:
    """The earliest :class:`Conflict` and the number of conflicting time steps, or ``(None, 0)``."""
    n = len(paths)
    if n == 2:
        return _first_conflict_pair(paths[0], paths[1])
    last = [len(p) - 1 for p in paths]
    horizon = max(last)
    first = None
    count = 0
    prev: list[int] = []
    for t in range(horizon + 1):
        cur = [p[t] if t <= lp else p[lp] for p, lp in zip(paths, last)]
        if len(set(cur)) < n:
            seen: dict[int, int] = {}
            for a, c in enumerate(cur):
                if c in seen:
                    count += 1
                    if first is None:
                        first = Conflict(False, seen[c], a, c, -1, t)
                else:
                    seen[c] = a
        if t:
            where = {c: a for a, c in enumerate(prev)}
            for a in range(n):
                if cur[a] != prev[a]:
                    b = where.get(cur[a])
                    if b is not None and b > a and cur[b] == prev[a]:
                        count += 1
                        if first is None:
                            first = Conflict(True, a, b, prev[a], cur[a], t)
        prev = cur
    return first, count


def _first_conflict_pair(p: list[int], q: list[int]) -> tuple[Conflict | None, int]:
    """:func:`_first_conflict` for two agents (the training boards' case), without per-step containers."""
    lp, lq = len(p) - 1, len(q) - 1
    if lp < lq:
        p = p + [p[lp]] * (lq - lp)
    elif lq < lp:
        q = q + [q[lq]] * (lp - lq)
    first = None
    count = 0
    a0, b0 = p[0], q[0]
    for t in range(1, len(p)):
        a, b = p[t], q[t]
        if a == b:
            count += 1
            if first is None:
                first = Conflict(False, 0, 1, a, -1, t)
        elif a == b0 and b == a0:
            count += 1
            if first is None:
                first = Conflict(True, 0, 1, a0, a, t)
        a0, b0 = a, b
    return first, count


# ----------------------------------------------------------------------------------------------------- low level
def _astar(options, h, start, goal, vcons, econs, goal_block, last_constraint, others, ncell) -> list[int] | None:
    """Space-time A* for one agent: cell indices from t=0 to arrival, or None when its constraints trap it (the
    caller then drops that child of the constraint tree).

    ``vcons`` holds ``t * ncell + cell``; ``econs`` holds ``(t * ncell + from) * ncell + to`` (arrival time ``t``).
    The agent may finish only after ``goal_block`` (its last vertex constraint on its goal). Ties between equal
    ``f`` go to fewer conflicts with ``others`` (paths of the other agents, who stay at their goals afterwards).
    ``options[u]`` is ``(u, *neighbours of u)``: wait first, then the moves.
    """
    cat: dict[int, int] = {}
    parked: dict[int, int] = {}
    horizon = -1
    for p in others:
        lp = len(p) - 1
        horizon = max(horizon, lp)
        for t, c in enumerate(p):
            k = t * ncell + c
            cat[k] = cat.get(k, 0) + 1
        parked[p[lp]] = lp
    shortcut = max(last_constraint, horizon)
    cells = [start]
    parents = [-1]
    seen = {start}
    heap = [(h[start], 0, 0, 0)]
    pop, push = heapq.heappop, heapq.heappush
    while heap:
        _, conf, negt, idx = pop(heap)
        u = cells[idx]
        t = -negt
        if t >= shortcut or (u == goal and t > goal_block):
            path = []
            while idx >= 0:
                path.append(cells[idx])
                idx = parents[idx]
            path.reverse()
            # Past every constraint: finish along a shortest path (exact, as h is the true distance).
            while u != goal:
                du = h[u] - 1
                u = next(v for v in options[u] if h[v] == du)
                path.append(u)
            return path
        nt = t + 1
        base = nt * ncell
        for v in options[u]:
            key = base + v
            if key in seen or key in vcons:
                continue
            if v != u and econs and (base + u) * ncell + v in econs:
                continue
            seen.add(key)
            c = conf + cat.get(key, 0)
            if v in parked and parked[v] <= nt:
                c += 1
            cells.append(v)
            parents.append(idx)
            push(heap, (nt + h[v], c, -nt, len(cells) - 1))
    return None


# ------------------------------------------------------------------------------------------- exhaustive fallback
def solve_joint(instance: Instance, max_states: int = 1_000_000) -> SolveResult:
    """Optimal sum-of-costs A* over joint configurations; exact, and proves unsolvability by exhausting them.

    A state is every agent's cell and whether it has finished (parked on its goal for good). A step costs the number
    of unfinished agents; finishing costs nothing. The heuristic, the sum of the unfinished agents' distances to their
    goals, is consistent, so the first finished state popped is optimal. Practical for 2-3 agents on small grids; ``max_states`` bounds the
    states visited and ends in ``Unsolved(NODE_BUDGET)``.
    """
    grid = grid_of(instance.rows)
    n = instance.num_agents
    starts = tuple(grid.index(c) for c in instance.starts)
    goals = tuple(grid.index(c) for c in instance.goals)
    hs = [grid.distances_from(g) for g in goals]
    shortest = tuple(h[s] for h, s in zip(hs, starts))
    if any(d == UNREACHABLE for d in shortest):
        return Unsolved(UnsolvedReason.NO_PATH, "some agent's goal is unreachable from its start", 0,
                        tuple(None if d == UNREACHABLE else d for d in shortest))
    options = grid.options
    all_done = (1 << n) - 1
    start_state = (starts, 0)
    dist = {start_state: 0}
    parent: dict = {start_state: None}
    heap = [(sum(shortest), 0, 0, start_state)]
    counter = 0
    while heap:
        _, negd, _, state = heapq.heappop(heap)
        d = -negd
        if d > dist[state]:
            continue
        pos, done = state
        if done == all_done:
            return _joint_result(instance, grid, state, parent, d, len(dist), shortest)
        if len(dist) > max_states:
            return Unsolved(UnsolvedReason.NODE_BUDGET, f"joint search passed {max_states} states", len(dist), shortest)
        succ = []
        for a in range(n):  # finishing: free of cost and time
            if not done >> a & 1 and pos[a] == goals[a]:
                succ.append(((pos, done | 1 << a), 0))
        step_cost = n - bin(done).count("1")
        if step_cost:
            choices = [(pos[a],) if done >> a & 1 else options[pos[a]] for a in range(n)]
            for nxt in product(*choices):
                if _joint_move_ok(pos, nxt, n):
                    succ.append(((nxt, done), step_cost))
        for s2, c in succ:
            d2 = d + c
            if d2 < dist.get(s2, 1 << 60):
                dist[s2] = d2
                parent[s2] = state
                counter += 1
                p2, done2 = s2
                h2 = d2
                for a in range(n):
                    if not done2 >> a & 1:
                        h2 += hs[a][p2[a]]
                heapq.heappush(heap, (h2, -d2, counter, s2))
    return Unsolved(UnsolvedReason.UNSOLVABLE, "exhaustive joint search: no conflict-free plan reaches all goals", len(dist), shortest)


def _joint_move_ok(pos: tuple[int, ...], nxt: tuple[int, ...], n: int) -> bool:
    """No two agents in one cell and no two agents swapping cells."""
    if n == 2:
        a, b = nxt
        return a != b and not (a == pos[1] and b == pos[0])
    if len(set(nxt)) < n:
        return False
    for a in range(n):
        if nxt[a] != pos[a]:
            for b in range(a + 1, n):
                if nxt[a] == pos[b] and nxt[b] == pos[a]:
                    return False
    return True


def _joint_result(instance: Instance, grid: Grid, state, parent, soc: int, nodes: int, shortest) -> Solved:
    """Rebuild per-agent paths from the chain of joint states (a changed ``done`` mask marks a finish, else a step)."""
    chain = []
    while state is not None:
        chain.append(state)
        state = parent[state]
    chain.reverse()
    n = instance.num_agents
    timeline = [chain[0][0]]
    finish = [0] * n
    for (_, done0), (pos1, done1) in zip(chain, chain[1:]):
        if done1 != done0:
            for a in range(n):
                if done1 >> a & 1 and not done0 >> a & 1:
                    finish[a] = len(timeline) - 1
        else:
            timeline.append(pos1)
    paths = tuple(tuple(grid.cell(timeline[t][a]) for t in range(finish[a] + 1)) for a in range(n))
    return Solved(paths, soc, max(finish), nodes, shortest, "joint")
