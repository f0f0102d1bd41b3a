"""Optimal multi-agent path finding by Conflict-Based Search (CBS), minimising the sum of costs.

Rules (the same as :mod:`envgen.core.simulate`): 4-connected moves or wait; no two agents in one cell at one time (vertex
conflict) and no two agents swapping cells in one step (edge conflict); following and rotation cycles are allowed; an
agent's cost is the time of its last arrival at its goal, where it then stays.

The search (:mod:`envgen.solver.cbs_search`) is CBS with the improvements of the literature, as in CBSH2-RTC (Li et al.
2021), each switchable through :class:`CBSOptions`: conflicts classified by MDDs and split cardinal first (ICBS),
bypass, the WDG heuristic (pairwise dependencies solved and memoised, then a weighted vertex cover), target reasoning
and rectangle reasoning restricted to rectangles it can prove (:mod:`envgen.solver.cbs_rectangle`), incremental conflict
detection and a conflict-avoidance table kept across nodes. The low level (:mod:`envgen.solver.cbs_lowlevel`) is a space-time
A* on the exact obstacle-aware distance, ties broken toward fewer conflicts. Every option keeps the sum of costs
optimal.

Agents in different connected components never meet, so each component's agents are solved as an independent group.
CBS cannot prove that no plan exists, and crowded pockets (several agents shuffling through a few cells) make its
tree explode, so the exhaustive searches of :mod:`envgen.solver.cbs_joint` back it up. Two agents on a small board
(``SolverBudget.max_joint_work``: up to 10x10 by default) whose root conflicts are first checked for a pocket they
cannot leave (a reachability search of at most ``POCKET_STATES`` configurations), then go to the exact joint A* after
``JOINT_HANDOVER`` nodes. A
larger group (up to ``EXHAUSTIVE_AGENTS`` agents) that CBS has not solved after ``EXHAUSTIVE_AFTER`` nodes is first
checked for reachability (if the group, or some of its agents alone, cannot reach their goals at all, no plan exists:
a proof), then given to the joint A*, each within ``SolverBudget.max_joint_states`` states; only then does CBS go on.

Every search has a budget (:class:`SolverBudget`): high-level nodes and seconds. A result is typed: :class:`Solved` or
:class:`Unsolved` with its :class:`UnsolvedReason`. A plan is never returned unless it is optimal.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from enum import Enum
from itertools import combinations
from typing import NamedTuple

from envgen.solver.cbs_conflicts import pair_collides
from envgen.solver.cbs_joint import JointFailure, JointPlan, joint_search, reachable
from envgen.solver.cbs_lowlevel import NO_CONSTRAINTS, find_path, shortest_path
from envgen.solver.cbs_search import CBS, CBSOptions, Found
from envgen.core.grid import UNREACHABLE, Grid, grid_of
from envgen.core.instance import Cell, Instance

__all__ = ["CBSOptions", "EXHAUSTIVE_AFTER", "EXHAUSTIVE_AGENTS", "JOINT_HANDOVER", "SolveResult", "Solved", "SolverBudget", "Unsolved",
           "UnsolvedReason", "solve", "solve_joint"]

JOINT_HANDOVER = 8
"""CBS nodes expanded before the joint search takes over, where it applies (see ``SolverBudget.max_joint_work``)."""
POCKET_STATES = 64
"""Where the joint search applies and the root has conflicts, a time-free reachability search of at most this many
configurations runs first: it proves a pair shut in a pocket unsolvable (about 0.15 ms, where CBS's nodes and the
exhausted joint A* took about 5 ms on the training distribution) and otherwise stops undecided, changing nothing."""

NO_SEQUENCE = "no sequence of moves brings the agents from their starts to their goals (exhaustive reachability)"
"""Why a group is unsolvable when the reachability search exhausted one end (:func:`envgen.solver.cbs_joint.reachable`)."""

EXHAUSTIVE_AFTER = 64
"""CBS nodes expanded on a group of agents (beyond the two-agent handover) before the exhaustive searches try it."""

EXHAUSTIVE_AGENTS = 5
"""The largest group the exhaustive searches try (a joint state of k agents has up to 5 ** k successors)."""

INTERLEAVE_STATES = 1000
"""With ``CBSOptions.interleave``: the states of the first exhaustive round; each round after it has 4 times more, up
to ``SolverBudget.max_joint_states``."""

STATES_PER_NODE = 50
"""With ``CBSOptions.interleave``: after an exhaustive round of ``s`` states, CBS expands up to ``s / STATES_PER_NODE``
more nodes (on five agents on 10x10 boards half holes, a node took about 1.5 ms and a joint state about 25 us, so the
two searches take turns of similar time)."""


@dataclass(frozen=True)
class SolverBudget:
    """Limits of one solve. Every limit but ``max_seconds`` counts work, not time, so a solve's outcome is the same
    on every machine when ``max_seconds`` is not reached.

    Attributes:
        max_nodes: high-level CBS nodes expanded per group of agents before giving up.
        max_seconds: wall-clock seconds before giving up, counted from the start of the solve (checked while the
            agents' distance tables are built and once per high-level node).
        max_table_cells: the most agents x grid cells of distance tables a solve builds (about 8 bytes a cell): a
            larger instance is given up at once (``SIZE_BUDGET``), before any memory is taken (50 agents on a
            1,024 x 1,024 map would take 2.6 GB).
        max_joint_work: two agents go to the exhaustive joint search after ``JOINT_HANDOVER`` CBS nodes when its
            estimated work (free cells ** k * 2 ** k * 5 ** k for k agents) is at most this (measured fastest on
            2-agent boards up to 10x10, where the joint A* beats CBS on instances that need coordination and proves
            unsolvable pockets at once). 0 turns this handover off. The default (3 million) covers 2 agents on grids
            up to 10x10 (at most a second or two of Python).
        max_joint_states: for a larger group that CBS has not solved after ``EXHAUSTIVE_AFTER`` nodes, the states
            each exhaustive search (reachability of the group and of its pairs and triples, then the joint A*) may
            visit before CBS goes on. 0 turns them off.
    """

    max_nodes: int = 20_000
    max_seconds: float = 30.0
    max_table_cells: int = 20_000_000
    max_joint_work: int = 3_000_000
    max_joint_states: int = 100_000

    def __post_init__(self) -> None:
        if self.max_nodes < 1:
            raise ValueError(f"SolverBudget.max_nodes = {self.max_nodes}: must be at least 1")
        if not self.max_seconds > 0:
            raise ValueError(f"SolverBudget.max_seconds = {self.max_seconds}: must be positive")
        if self.max_table_cells < 1:
            raise ValueError(f"SolverBudget.max_table_cells = {self.max_table_cells}: must be at least 1")
        if self.max_joint_work < 0:
            raise ValueError(f"SolverBudget.max_joint_work = {self.max_joint_work}: must be 0 (off) or more")
        if self.max_joint_states < 0:
            raise ValueError(f"SolverBudget.max_joint_states = {self.max_joint_states}: must be 0 (off) or more")


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
    SIZE_BUDGET = "size_budget"
    """Not proven: the instance is larger than the budget lets a solve hold (``max_table_cells``)."""

    @property
    def proven(self) -> bool:
        return self in (UnsolvedReason.NO_PATH, UnsolvedReason.UNSOLVABLE)


@dataclass(frozen=True)
class Solved:
    """An optimal plan.

    Attributes:
        paths: per agent the cells from time 0 to its last arrival at its goal (``len = cost + 1``).
        soc: optimal sum of costs. makespan: the largest cost in this plan.
        nodes: constraint-tree nodes expanded, over all groups (0 when the agents' shortest paths already agree),
            plus the states of the exhaustive search where it ran.
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


DEFAULT_OPTIONS = CBSOptions()
"""Every improvement on (the options are immutable: one instance serves every solve)."""
DEFAULT_BUDGET = SolverBudget()
"""The default budget (immutable, shared)."""


def solve(instance: Instance, budget: SolverBudget | None = None, options: CBSOptions | None = None) -> SolveResult:
    """Solve ``instance`` optimally for the sum of costs within ``budget``, with the search ``options`` (default: every
    improvement on).

    Agents in different connected components of the grid never meet, so each component's agents are solved as an
    independent group (costs add up); the node budget applies per group, the time budget to the whole solve.

    >>> from envgen.core.instance import Instance
    >>> corridor = Instance(("FFF", "HFH"), ((0, 0), (0, 2)), ((0, 2), (0, 0)))
    >>> r = solve(corridor)
    >>> (r.soc, r.makespan, r.shortest, r.needs_wait)
    (7, 4, (2, 2), True)
    """
    # The search allocates millions of small objects and frees them by reference counting; the cyclic collector's
    # passes over the growing memo tables found next to nothing to free (a few closures) and took 15% of a 62-agent
    # solve. It is paused while the solve runs (process-wide: other threads' cycles wait until the solve returns)
    # and restored as it was.
    paused = gc.isenabled()
    gc.disable()
    try:
        return _solve(instance, budget or DEFAULT_BUDGET, options or DEFAULT_OPTIONS)
    finally:
        if paused:
            gc.enable()


AGREE_FIRST = 8
"""Up to this many agents, :func:`solve` first checks whether the agents' plain shortest paths already agree (every
pair, as :func:`shortest_paths_agree`): then that is the plan every search would return, without grouping the agents
and starting a search per group (a third of a dense 5-agent benchmark set, 22 us a solve before, 12 after). Beyond it
the check, which grows with the square of the agents, is skipped: crowded maps rarely have agreeing paths."""


def _solve(instance: Instance, budget: SolverBudget, options: CBSOptions) -> SolveResult:
    deadline = time.perf_counter() + budget.max_seconds
    n = instance.num_agents
    cells = instance.height * instance.width
    if n * cells > budget.max_table_cells:
        return Unsolved(UnsolvedReason.SIZE_BUDGET, f"{n} agents on {instance.height}x{instance.width} cells need "
                        f"{n * cells:,} cells of distance tables, more than the budget's {budget.max_table_cells:,}", 0,
                        (None,) * n)
    grid = grid_of(instance.rows)
    starts = [grid.index(c) for c in instance.starts]
    goals = [grid.index(c) for c in instance.goals]
    hs = []
    for a, g in enumerate(goals):
        if time.perf_counter() > deadline:
            return Unsolved(UnsolvedReason.TIME_BUDGET, f"{budget.max_seconds} s went on the distance tables of "
                            f"{a} of {n} agents", 0, (None,) * n)
        hs.append(grid.distances_from(g))
    shortest = tuple([h[s] for h, s in zip(hs, starts)])
    if UNREACHABLE in shortest:
        a = next(i for i, d in enumerate(shortest) if d == UNREACHABLE)
        return Unsolved(UnsolvedReason.NO_PATH, f"agent {a + 1}: goal {instance.goals[a]} cannot be reached from {instance.starts[a]}", 0,
                        tuple(None if d == UNREACHABLE else d for d in shortest))
    if n <= AGREE_FIRST:
        # What every group's search would start from and, when no two of them collide, return at once
        paths = [shortest_path(grid, h, s, g) for h, s, g in zip(hs, starts, goals)]
        if first_conflict(paths) is None:
            return _solved(grid, paths, 0, shortest, "cbs")
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
    return _solved(grid, paths, nodes, shortest, "joint" if "joint" in methods else "cbs")


def _solved(grid: Grid, paths: list[list[int]], nodes: int, shortest: tuple[int, ...], method: str) -> Solved:
    width = grid.width
    cells = tuple([tuple([divmod(p, width) for p in path]) for path in paths])
    costs = [len(p) - 1 for p in paths]
    return Solved(cells, sum(costs), max(costs), nodes, shortest, method)


def shortest_paths_agree(instance: Instance) -> bool:
    """True when one shortest path per agent (each step to the first neighbour one closer to its goal) leaves no two
    agents on one cell or swapping cells, an agent staying on its goal once there: then the optimal sum of costs is
    the sum of the shortest distances and the instance needs no wait (:attr:`Solved.needs_wait` is False), known
    without a search. False says nothing (other shortest paths may agree)."""
    grid = grid_of(instance.rows)
    width = grid.width
    paths = []
    for (sr, sc), (gr, gc) in zip(instance.starts, instance.goals):
        goal = gr * width + gc
        h = grid.distances_from(goal)
        start = sr * width + sc
        if h[start] == UNREACHABLE:
            return False
        paths.append(shortest_path(grid, h, start, goal))
    return first_conflict(paths) is None


def first_conflict(paths: list[list[int]]) -> tuple[int, int] | None:
    """The first pair of agents (in agent order) whose ``paths`` collide (:func:`envgen.solver.cbs_conflicts.pair_collides`:
    a shared cell or a swap, each agent staying on its last cell); None when the paths are conflict-free."""
    return next(((a, b) for a, b in combinations(range(len(paths)), 2) if pair_collides(paths[a], paths[b])), None)


def reorders_freely(grid: Grid, h: list[int]) -> bool:
    """Whether two agents can reach every placement of theirs in the component of the cells ``h`` reaches (the
    distances to a cell of it): yes unless the component is a simple path, where they keep their order.

    A cycle lets either agent walk round to its goal along the arc the other is not on, the other following; a cell
    with three or more neighbours is a siding where one agent waits while the other passes, and both agents can
    always walk there, the rest of the component being empty. So the pocket check (a reachability search) can only
    prove a pair unsolvable on a path, and is skipped elsewhere.
    """
    nbrs = grid.neighbors
    ends = 0
    for c, d in enumerate(h):
        if d != UNREACHABLE:
            degree = len(nbrs[c])
            if degree > 2:
                return True
            if degree < 2:
                ends += 1
    return ends == 0


def _joint_work(free_cells: int, k: int) -> int:
    """The estimated work of the joint search for ``k`` agents (see ``SolverBudget.max_joint_work``)."""
    return (10 * free_cells) ** k if k > 1 else 0


def _solve_group(instance: Instance, grid: Grid, agents: list[int], starts: list[int], goals: list[int],
                 hs: list[list[int]], budget: SolverBudget, options: CBSOptions, deadline: float) -> GroupPlan | Unsolved:
    """One independent group of agents."""
    k = len(agents)
    if k == 1:
        return GroupPlan([find_path(grid, hs[0], starts[0], goals[0], NO_CONSTRAINTS, None)], 0, "cbs")
    work = _joint_work(len(hs[0]) - hs[0].count(UNREACHABLE), k)
    handover = 0 < work <= budget.max_joint_work
    search = CBS(grid, starts, goals, hs, options, budget.max_nodes, deadline)
    got = search.start()
    extra = 0
    if got is None:
        if handover:
            # A pair whose root conflicts may be in a pocket it cannot get out of: exhausting the smaller end of the
            # time-free configuration search proves that far more cheaply than CBS's nodes and the joint A* would.
            if not (k == 2 and reorders_freely(grid, hs[0])) and reachable(grid, starts, goals, POCKET_STATES) is False:
                return Unsolved(UnsolvedReason.UNSOLVABLE, NO_SEQUENCE, 0, ())
            got = search.resume(min(budget.max_nodes, JOINT_HANDOVER))
        else:
            got = search.resume(min(budget.max_nodes, EXHAUSTIVE_AFTER))
            if not isinstance(got, Found) and got.why == "nodes" and budget.max_nodes > EXHAUSTIVE_AFTER:
                if budget.max_joint_states:
                    # the exhaustive searches in rounds of growing budgets, CBS resumed between them (interleave), or
                    # once with the whole budget
                    states = (min(INTERLEAVE_STATES, budget.max_joint_states) if options.interleave
                              else budget.max_joint_states)
                    while True:
                        hard = _exhaustive(grid, agents, starts, goals, states, options.independence)
                        if isinstance(hard, str):
                            return Unsolved(UnsolvedReason.UNSOLVABLE, hard, got.nodes + extra, ())
                        if isinstance(hard, JointPlan):
                            return GroupPlan(hard.paths, got.nodes + extra + hard.states, "joint")
                        extra += hard
                        if states >= budget.max_joint_states:
                            break
                        got = search.resume(min(budget.max_nodes, got.nodes + max(1, hard // STATES_PER_NODE)))
                        if isinstance(got, Found) or got.why != "nodes" or got.nodes >= budget.max_nodes:
                            break
                        states = min(4 * states, budget.max_joint_states)
                if not isinstance(got, Found) and got.why == "nodes":
                    got = search.resume(budget.max_nodes)
    if isinstance(got, Found):
        return GroupPlan(got.paths, got.nodes + extra, "cbs")
    nodes = got.nodes + extra
    if got.why == "exhausted":
        return Unsolved(UnsolvedReason.UNSOLVABLE, "CBS exhausted its constraint tree: no conflict-free plan exists", nodes, ())
    if handover and got.why == "nodes" and got.nodes < budget.max_nodes:
        joint = joint_search(grid, starts, goals, work)
        if isinstance(joint, JointFailure):
            if joint.unsolvable:
                return Unsolved(UnsolvedReason.UNSOLVABLE, "exhaustive joint search: no conflict-free plan reaches all "
                                "goals", nodes + joint.states, ())
            return Unsolved(UnsolvedReason.NODE_BUDGET, f"joint search passed {work} states", nodes + joint.states, ())
        return GroupPlan(joint.paths, nodes + joint.states, "joint")
    if got.why == "nodes":
        return Unsolved(UnsolvedReason.NODE_BUDGET, f"CBS found no plan within {budget.max_nodes} nodes; the instance "
                        "may be unsolvable or hard", nodes, ())
    return Unsolved(UnsolvedReason.TIME_BUDGET, f"CBS found no plan within {budget.max_seconds} s; the instance may "
                    "be unsolvable or hard", nodes, ())


def _exhaustive(grid: Grid, agents: list[int], starts: list[int], goals: list[int],
                max_states: int, independence: bool = True) -> str | JointPlan | int:
    """The exhaustive searches on a group CBS finds hard (of at most ``EXHAUSTIVE_AGENTS`` agents): a proof that no
    plan exists (its text), the optimal plan, or the states spent without an answer.

    Reachability of the whole group first; when undecided, of every pair and then every triple of its agents (if some
    agents alone cannot reach their goals, the group cannot); then the optimal joint A*; when that runs out of states
    and ``independence`` is on, :func:`independent_groups` (whose smaller searches decide groups that split)."""
    if len(agents) > EXHAUSTIVE_AGENTS:
        return 0
    spent = 0
    whole = reachable(grid, starts, goals, max_states)
    if whole is False:
        return NO_SEQUENCE
    if whole is None:
        for size in (2, 3):
            for subset in combinations(range(len(agents)), size):
                if size == len(agents):
                    continue
                if reachable(grid, [starts[i] for i in subset], [goals[i] for i in subset], max_states) is False:
                    who = " and ".join(str(agents[i] + 1) for i in subset)
                    return f"agents {who} alone cannot all reach their goals (exhaustive reachability)"
        spent += max_states
    joint = joint_search(grid, starts, goals, max_states)
    if isinstance(joint, JointFailure):
        if joint.unsolvable:
            return "exhaustive joint search: no conflict-free plan reaches all goals"
        spent += joint.states
        if not independence:
            return spent
        parted = independent_groups(grid, starts, goals, max_states)
        if isinstance(parted, JointPlan):
            return parted._replace(states=spent + parted.states)
        return parted if isinstance(parted, str) else spent + parted
    return joint


def independent_groups(grid: Grid, starts: list[int], goals: list[int], max_states: int) -> JointPlan | str | int:
    """Independence detection (Standley 2010): every agent planned alone; while two groups' plans conflict, first one
    group and then the other is planned again at its own optimal cost avoiding the other's paths (once per pair of
    groups), and only when neither can the two are merged and planned together. Every search is the joint A* within
    ``max_states``. Each group's plan stays optimal for its agents alone, a lower bound on their part of any plan, so
    conflict-free plans of the groups are an optimal plan together. Returns that plan, a proof that none exists (a
    group has no plan), or the states spent without an answer (a merged group's search ran out of states)."""
    group = list(range(len(starts)))
    members = [[a] for a in group]
    paths: list[list[int]] = [[] for _ in starts]
    tried: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    spent = 0

    def plan(g: int, avoid: list[list[int]] | None = None, max_cost: int | None = None) -> JointPlan | JointFailure:
        nonlocal spent
        agents = members[g]
        got = joint_search(grid, [starts[a] for a in agents], [goals[a] for a in agents], max_states, avoid, max_cost)
        spent += got.states
        if isinstance(got, JointPlan):
            for a, path in zip(agents, got.paths):
                paths[a] = path
        return got

    def cost(g: int) -> int:
        return sum(len(paths[a]) - 1 for a in members[g])

    for g in group:
        if isinstance(plan(g), JointFailure):
            return f"agent {g + 1} cannot reach its goal"
    while (clash := first_conflict(paths)) is not None:
        ga, gb = group[clash[0]], group[clash[1]]
        key = (tuple(members[ga]), tuple(members[gb]))
        if key not in tried:
            tried.add(key)
            if any(isinstance(plan(mine, [paths[a] for a in members[theirs]], cost(mine)), JointPlan)
                   for mine, theirs in ((ga, gb), (gb, ga))):
                continue  # one group found another plan of its cost, clear of the other's paths
        for a in members[gb]:
            group[a] = ga
        members[ga] = sorted(members[ga] + members[gb])
        members[gb] = []
        got = plan(ga)
        if isinstance(got, JointFailure):
            if got.unsolvable:
                who = " and ".join(str(a + 1) for a in members[ga])
                return f"agents {who} alone cannot all reach their goals (exhaustive joint search)"
            return spent
    return JointPlan(paths, sum(len(p) - 1 for p in paths), spent)


# ------------------------------------------------------------------------------------------- exhaustive fallback
def solve_joint(instance: Instance, max_states: int = 1_000_000) -> SolveResult:
    """Optimal sum-of-costs A* over joint configurations (:func:`envgen.solver.cbs_joint.joint_search`); exact, and proves
    unsolvability by exhausting them. Practical for 2-4 agents on small grids; ``max_states`` bounds the states
    visited and ends in ``Unsolved(NODE_BUDGET)``."""
    grid = grid_of(instance.rows)
    starts = [grid.index(c) for c in instance.starts]
    goals = [grid.index(c) for c in instance.goals]
    shortest = tuple(grid.distances_from(g)[s] for s, g in zip(starts, goals))
    if any(d == UNREACHABLE for d in shortest):
        return Unsolved(UnsolvedReason.NO_PATH, "some agent's goal is unreachable from its start", 0,
                        tuple(None if d == UNREACHABLE else d for d in shortest))
    got = joint_search(grid, starts, goals, max_states)
    if isinstance(got, JointFailure):
        if got.unsolvable:
            return Unsolved(UnsolvedReason.UNSOLVABLE, "exhaustive joint search: no conflict-free plan reaches all goals",
                            got.states, shortest)
        return Unsolved(UnsolvedReason.NODE_BUDGET, f"joint search passed {max_states} states", got.states, shortest)
    width = grid.width
    paths = tuple(tuple(divmod(c, width) for c in p) for p in got.paths)
    return Solved(paths, got.soc, max(len(p) - 1 for p in got.paths), got.states, shortest, "joint")
