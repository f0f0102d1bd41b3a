"""Optimal multi-agent path finding by Conflict-Based Search (CBS), minimising the sum of costs.

Rules (the same as :mod:`envgen.simulate`): 4-connected moves or wait; no two agents in one cell at one time (vertex
conflict) and no two agents swapping cells in one step (edge conflict); following and rotation cycles are allowed; an
agent's cost is the time of its last arrival at its goal, where it then stays.

The search (:mod:`envgen.cbs_search`) is CBS with the improvements of the literature, as in CBSH2-RTC (Li et al.
2021), each switchable through :class:`CBSOptions`: conflicts classified by MDDs and split cardinal first (ICBS),
bypass, the WDG heuristic (pairwise dependencies solved and memoised, then a weighted vertex cover), target reasoning
and rectangle reasoning restricted to rectangles it can prove (:mod:`envgen.cbs_rectangle`), incremental conflict
detection and a conflict-avoidance table kept across nodes. The low level (:mod:`envgen.cbs_lowlevel`) is a space-time
A* on the exact obstacle-aware distance, ties broken toward fewer conflicts. Every option keeps the sum of costs
optimal.

Agents in different connected components never meet, so each component's agents are solved as an independent group.
CBS cannot prove that no plan exists, so where the joint state space is small (``SolverBudget.max_joint_work``: two
agents on boards up to 10x10 by default) an exact joint A* (:func:`solve_joint`) takes over a group that CBS has not
solved after a few nodes: it finds the optimum or proves that there is none. In larger groups, when CBS has not
finished after ``PAIR_PROOF_AFTER`` nodes, every pair of agents small enough for the joint search is checked: if two
agents alone cannot both reach their goals, neither can the group.

Every search has a budget (:class:`SolverBudget`): high-level nodes and seconds. A result is typed: :class:`Solved` or
:class:`Unsolved` with its :class:`UnsolvedReason`. A plan is never returned unless it is optimal.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from enum import Enum
from itertools import combinations, product
from typing import NamedTuple

from envgen.cbs_lowlevel import NO_CONSTRAINTS, find_path
from envgen.cbs_search import CBS, CBSOptions, Found
from envgen.grid import UNREACHABLE, Grid, grid_of
from envgen.instance import Cell, Instance

__all__ = ["CBSOptions", "JOINT_HANDOVER", "PAIR_PROOF_AFTER", "SolveResult", "Solved", "SolverBudget", "Unsolved",
           "UnsolvedReason", "solve", "solve_joint"]

JOINT_HANDOVER = 8
"""CBS nodes expanded before the joint search takes over, where it applies (see ``SolverBudget.max_joint_work``)."""

PAIR_PROOF_AFTER = 64
"""CBS nodes expanded in a group of agents before every pair small enough for the joint search is checked for a
proof that no plan exists."""


@dataclass(frozen=True)
class SolverBudget:
    """Limits of one solve.

    Attributes:
        max_nodes: high-level CBS nodes expanded before giving up.
        max_seconds: wall-clock seconds before giving up (checked once per high-level node).
        max_joint_work: the exhaustive joint search backs CBS up when its estimated work
            (free cells ** k * 2 ** k * 5 ** k for k agents) is at most this; CBS then hands over after
            ``JOINT_HANDOVER`` nodes (measured fastest on 2-agent boards up to 10x10, where the joint A* beats CBS on
            instances that need coordination and proves unsolvable pockets at once). 0 turns the fallback off.
            The default (3 million) covers 2 agents on grids up to 10x10 (at most a second or two of Python).
    """

    max_nodes: int = 20_000
    max_seconds: float = 30.0
    max_joint_work: int = 3_000_000

    def __post_init__(self) -> None:
        if self.max_nodes < 1:
            raise ValueError(f"SolverBudget.max_nodes = {self.max_nodes}: must be at least 1")
        if not self.max_seconds > 0:
            raise ValueError(f"SolverBudget.max_seconds = {self.max_seconds}: must be positive")
        if self.max_joint_work < 0:
            raise ValueError(f"SolverBudget.max_joint_work = {self.max_joint_work}: must be 0 (off) or more")


class UnsolvedReason(str, Enum):
    """Why no plan was returned."""

    NO_PATH = "no_path"
    """Proven: some agent's goal cannot be reached from its start even alone."""
    UNSOLVABLE = "unsolvable"
    """Proven by exhaustive joint search: no conflict-free plan exists."""
    NODE_BUDGET = "node_budget"
    """Not proven: the high-level node budget ran out."""
    TIME_BUDGET = "time_budget"
    """Not proven: the time budget ran out."""

    @property
    def proven(self) -> bool:
        return self in (UnsolvedReason.NO_PATH, UnsolvedReason.UNSOLVABLE)


@dataclass(frozen=True)
class Solved:
    """An optimal plan.

    Attributes:
        paths: per agent the cells from time 0 to its last arrival at its goal (``len = cost + 1``).
        soc: optimal sum of costs. makespan: the largest cost in this plan.
        nodes: high-level nodes expanded (joint states for the exhaustive search).
        shortest: each agent's shortest-path length alone on the grid.
        method: ``"cbs"`` or ``"joint"`` (the exhaustive fallback).
    """

    paths: tuple[tuple[Cell, ...], ...]
    soc: int
    makespan: int
    nodes: int
    shortest: tuple[int, ...]
    method: str = "cbs"
    solved = True

    @property
    def sum_shortest(self) -> int:
        return sum(self.shortest)

    @property
    def needs_wait(self) -> bool:
        """True when the agents cannot all take a shortest path: the optimum needs a wait or a detour."""
        return self.soc > self.sum_shortest


@dataclass(frozen=True)
class Unsolved:
    """No plan: why, and how much search was spent."""

    reason: UnsolvedReason
    detail: str
    nodes: int
    shortest: tuple[int | None, ...]
    solved = False


SolveResult = Solved | Unsolved


class GroupPlan(NamedTuple):
    """The optimal paths of one independent group of agents, the search nodes spent, and the method that found them."""

    paths: list[list[int]]
    nodes: int
    method: str


def solve(instance: Instance, budget: SolverBudget | None = None, options: CBSOptions | None = None) -> SolveResult:
    """Solve ``instance`` optimally for the sum of costs within ``budget``, with the search ``options`` (default: every
    improvement on).

    Agents in different connected components of the grid never meet, so each component's agents are solved as an
    independent group (costs add up); the node budget applies per group, the time budget to the whole solve.

    >>> from envgen.instance import Instance
    >>> corridor = Instance(("FFF", "HFH"), ((0, 0), (0, 2)), ((0, 2), (0, 0)))
    >>> r = solve(corridor)
    >>> (r.soc, r.makespan, r.shortest, r.needs_wait)
    (7, 4, (2, 2), True)
    """
    budget = budget or SolverBudget()
    options = options or CBSOptions()
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
                           [hs[a] for a in agents], budget, options, deadline)
        if isinstance(got, Unsolved):
            who = ", ".join(str(a + 1) for a in agents)
            return Unsolved(got.reason, f"agents {who}: {got.detail}" if len(groups) > 1 else got.detail, nodes + got.nodes, shortest)
        nodes += got.nodes
        methods.add(got.method)
        for a, path in zip(agents, got.paths):
            paths[a] = path
    width = grid.width
    cells = tuple(tuple(divmod(p, width) for p in path) for path in paths)
    costs = [len(p) - 1 for p in paths]
    return Solved(cells, sum(costs), max(costs), nodes, shortest, "joint" if "joint" in methods else "cbs")


def _joint_work(free_cells: int, k: int) -> int:
    """The estimated work of the joint search for ``k`` agents (see ``SolverBudget.max_joint_work``)."""
    return (10 * free_cells) ** k if k > 1 else 0


def _solve_group(instance: Instance, grid: Grid, agents: list[int], starts: list[int], goals: list[int],
                 hs: list[list[int]], budget: SolverBudget, options: CBSOptions, deadline: float) -> GroupPlan | Unsolved:
    """One independent group of agents."""
    k = len(agents)
    if k == 1:
        return GroupPlan([find_path(grid, hs[0], starts[0], goals[0], NO_CONSTRAINTS, None)], 1, "cbs")
    free_cells = len(hs[0]) - hs[0].count(UNREACHABLE)
    work = _joint_work(free_cells, k)
    use_joint = 0 < work <= budget.max_joint_work
    search = CBS(grid, starts, goals, hs, options, budget.max_nodes, deadline)
    got = search.start()
    if got is None:
        if use_joint:
            got = search.resume(min(budget.max_nodes, JOINT_HANDOVER))
        else:
            got = search.resume(min(budget.max_nodes, PAIR_PROOF_AFTER))
            if not isinstance(got, Found) and got.why == "nodes" and budget.max_nodes > PAIR_PROOF_AFTER:
                proof = _unsolvable_pair(instance, agents, free_cells, budget)
                if proof is not None:
                    return Unsolved(UnsolvedReason.UNSOLVABLE, proof, search.expanded, ())
                got = search.resume(budget.max_nodes)
    if isinstance(got, Found):
        return GroupPlan(got.paths, got.nodes, "cbs")
    nodes = got.nodes
    if got.why == "exhausted":
        return Unsolved(UnsolvedReason.UNSOLVABLE, "CBS exhausted its constraint tree: no conflict-free plan exists", nodes, ())
    if use_joint and got.why == "nodes" and nodes < budget.max_nodes:
        sub = Instance(instance.rows, tuple(instance.starts[a] for a in agents), tuple(instance.goals[a] for a in agents))
        joint = solve_joint(sub, max_states=work)
        if isinstance(joint, Unsolved):
            return Unsolved(joint.reason, joint.detail, nodes + joint.nodes, ())
        return GroupPlan([[grid.index(c) for c in p] for p in joint.paths], nodes + joint.nodes, "joint")
    if got.why == "nodes":
        return Unsolved(UnsolvedReason.NODE_BUDGET, f"CBS found no plan within {budget.max_nodes} nodes; the instance "
                        "may be unsolvable or hard", nodes, ())
    return Unsolved(UnsolvedReason.TIME_BUDGET, f"CBS found no plan within {budget.max_seconds} s; the instance may "
                    "be unsolvable or hard", nodes, ())


def _unsolvable_pair(instance: Instance, agents: list[int], free_cells: int, budget: SolverBudget) -> str | None:
    """A proof that the group has no plan: two of its agents that cannot both reach their goals even alone (by the
    exhaustive joint search, where it is small enough); None when every pair checked has a plan."""
    work = _joint_work(free_cells, 2)
    if not 0 < work <= budget.max_joint_work:
        return None
    for a, b in combinations(agents, 2):
        pair = Instance(instance.rows, (instance.starts[a], instance.starts[b]), (instance.goals[a], instance.goals[b]))
        joint = solve_joint(pair, max_states=work)
        if isinstance(joint, Unsolved) and joint.reason is UnsolvedReason.UNSOLVABLE:
            return f"agents {a + 1} and {b + 1} alone cannot both reach their goals (exhaustive joint search)"
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
