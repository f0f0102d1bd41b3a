"""The high level of CBS: best-first search of the constraint tree, with the improvements of the literature, each
switchable through :class:`CBSOptions`.

A node holds every agent's path and constraints, its cost ``g`` (sum of costs), an admissible estimate ``h`` of how
much more any solution below it costs, and its conflicts grouped by pair of agents. Nodes are ordered by ``g + h``,
then by fewer conflicting pairs, then newest first. A child copies its parent's conflicts except those of the agents it
replans, whose conflicts are found against the conflict-avoidance table (kept across nodes, updated by the paths that
differ). ``h`` and the conflicts' classification are computed when a node is first popped (lazily, as in CBSH2-RTC); a
node whose ``g + h`` then rose goes back into the open list.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

from envgen.solver.cbs_conflicts import (Conflict, Kind, Priority, cardinality, conflicts_of, pair_collides, pair_conflicts,
                                  pair_key, pair_order, priority_key)
from envgen.solver.cbs_heuristics import merge_mdds, vertex_cover
from envgen.solver.cbs_lowlevel import (INF, MDD, NO_CONSTRAINTS, AgentConstraints, ConflictAvoidanceTable, add_block,
                                 build_mdd, find_path, shortest_path)
from envgen.solver.cbs_rectangle import rectangle_conflict
from envgen.core.grid import Grid

Heuristic = Literal["none", "cg", "wdg"]


@dataclass(frozen=True)
class CBSOptions:
    """Which improvements of plain CBS (Sharon et al. 2015) the search uses. Every setting keeps the sum of costs
    optimal; they change how many constraint-tree nodes it takes. :meth:`plain` turns all of them off.

    Attributes:
        prioritize_conflicts: ICBS (Boyarski et al. 2015): classify each conflict by the agents' MDDs and split on a
            cardinal one first, then semi-cardinal, then non-cardinal. Off: split on the earliest conflict.
        heuristic: the admissible high-level heuristic: ``"none"``, ``"cg"`` (cardinal conflict graph) or ``"wdg"``
            (weighted pairwise dependency graph, Li et al. 2019), see :mod:`envgen.solver.cbs_heuristics`.
        bypass: adopt a child's path instead of splitting when it has the same cost and fewer conflicting pairs
            (Boyarski et al. 2015).
        bypass_conflicts: which chosen conflicts a bypass may resolve: ``"non-cardinal"`` (default), only those whose
            split raises neither agent's cost, or ``"all"``, semi-cardinal ones too, adopting the child whose agent
            keeps its cost (the generator's versions 2 and 3). On random-32-32-10 random-1 at 93 agents ``"all"`` took
            17,868 nodes where ``"non-cardinal"`` takes 5,638 (no bypass: 5,773), while the even scenarios need bypasses
            (docs/lab-notes/solver.md, "Bypasses on non-cardinal conflicts only").
        target_reasoning: resolve an agent standing on its goal with length constraints (it settles by ``t`` and
            nobody enters its goal from ``t`` on, or it settles after ``t``) instead of two vertex constraints.
        rectangle_reasoning: resolve the conflicts of two agents crossing an open rectangle with barrier constraints
            in one split, where the rectangle is provably entered on time (see :mod:`envgen.solver.cbs_rectangle`).
        incremental: a child finds only the conflicts of the agents it replans, against a conflict-avoidance table kept
            across nodes. Off: every child rescans every pair of paths and every low-level search builds its own
            table (the search is the same; only slower).
        pair_cost: WDG weights up to this many extra steps are found by merging the two agents' MDDs; a pair that needs
            more gets ``pair_cost + 1`` (a lower bound).
        pair_nodes: node budget of the two-agent search behind a WDG weight when an MDD merge is too large to decide;
            past it the search's lower bound is the weight (still admissible).
        inherit_weights: a child's WDG weight for a pair starts from the bound on the pair's joint cost found in its
            ancestors (constraints only accumulate down the tree, so that cost never falls): splits of fewer extra
            steps are not merged again, and a pair that needed more than ``pair_cost`` keeps its bound at no cost.
        independence: not CBS itself but the solver's last resort (:func:`envgen.solver.cbs.solve`): a group that CBS and the
            exhaustive joint A* leave undecided is split by independence detection (Standley 2010), the agents planned
            alone and merged only where their plans conflict (:func:`envgen.solver.cbs.independent_groups`).
        conflict_ties: which pair's conflict to split among pairs whose best conflicts have the same cardinality and
            kind (with prioritize_conflicts). ``"earliest"``: the earliest such conflict, then the lowest agents;
            ``"pairs"``: a fixed pseudo-random order of the agent pairs (CRC-32 of the pair), the time left out, as
            CBSH2-RTC's random choice among equals. Within a pair the earliest of its best conflicts is split either
            way. Which conflict is split first can decide whether a large instance takes a second or minutes, in
            both directions: over twelve MovingAI scenarios neither rule solved more agents within 10 s on every one
            (docs/lab-notes/solver.md), so the default keeps the plans the generator has always stored.
        rectangle_starts: with rectangle_reasoning, also the rectangles of two agents that have moved every step
            since their starts on the two side lines of a corner, with barriers reaching back to the starts (the second
            split of :mod:`envgen.solver.cbs_rectangle`, sound for any paths). Off: the first split only, as the generator's
            versions 2 and 3 search (their stored plans and node limits came from that search).
        merge_order: how the MDD merges behind WDG weights search the two agents' joint states: ``"breadth"``, level by
            level (the generator's versions 2 and 3), or ``"depth"``, depth first, which usually finds a conflict-free
            pair after a few states per level and so decides within :data:`envgen.solver.cbs_heuristics.SYNC_LIMIT` more
            often; the same weights whenever both decide, other witness plans.
        interleave: not CBS itself but the solver's back-ups (:func:`envgen.solver.cbs.solve`): a group of up to five
            agents that CBS has not solved after ``EXHAUSTIVE_AFTER`` nodes gets the exhaustive searches in rounds of
            growing state budgets (``INTERLEAVE_STATES``, four times more each round, up to
            ``SolverBudget.max_joint_states``), CBS resumed for more nodes between rounds, so whichever search
            decides the group first ends the solve. Off: one round with the whole budget, then CBS (the generator's
            versions 2 and 3): a group CBS would solve in a few more nodes waited for the whole joint search first
            (2.8 s against 0.07 s in rounds on one five-agent 10x10 draw; docs/lab-notes/solver.md).
    """

    prioritize_conflicts: bool = True
    heuristic: Heuristic = "wdg"
    bypass: bool = True
    bypass_conflicts: Literal["non-cardinal", "all"] = "non-cardinal"
    target_reasoning: bool = True
    rectangle_reasoning: bool = True
    incremental: bool = True
    pair_cost: int = 2
    pair_nodes: int = 10
    inherit_weights: bool = True
    independence: bool = True
    conflict_ties: Literal["earliest", "pairs"] = "earliest"
    rectangle_starts: bool = True
    merge_order: Literal["breadth", "depth"] = "breadth"
    interleave: bool = True

    def __post_init__(self) -> None:
        if self.heuristic not in ("none", "cg", "wdg"):
            raise ValueError(f"CBSOptions.heuristic = {self.heuristic!r}: use 'none', 'cg' or 'wdg'")
        if self.heuristic != "none" and not self.prioritize_conflicts:
            raise ValueError(f"CBSOptions.heuristic = {self.heuristic!r} needs prioritize_conflicts (it reads the "
                             "conflicts' cardinality); set heuristic='none' or prioritize_conflicts=True")
        if self.rectangle_reasoning and not self.prioritize_conflicts:
            raise ValueError("CBSOptions.rectangle_reasoning needs prioritize_conflicts (it reads the agents' MDDs); "
                             "turn one on or the other off")
        if self.pair_cost < 0:
            raise ValueError(f"CBSOptions.pair_cost = {self.pair_cost}: must be 0 or more")
        if self.pair_nodes < 1:
            raise ValueError(f"CBSOptions.pair_nodes = {self.pair_nodes}: must be at least 1")
        if self.conflict_ties not in ("pairs", "earliest"):
            raise ValueError(f"CBSOptions.conflict_ties = {self.conflict_ties!r}: use 'pairs' or 'earliest'")
        if self.bypass_conflicts not in ("non-cardinal", "all"):
            raise ValueError(f"CBSOptions.bypass_conflicts = {self.bypass_conflicts!r}: use 'non-cardinal' or 'all'")
        if self.merge_order not in ("breadth", "depth"):
            raise ValueError(f"CBSOptions.merge_order = {self.merge_order!r}: use 'breadth' or 'depth'")

    @classmethod
    def plain(cls) -> CBSOptions:
        """CBS as first published: the earliest conflict, no heuristic, no bypass, no symmetry reasoning, full rescans."""
        return cls(prioritize_conflicts=False, heuristic="none", bypass=False, target_reasoning=False,
                   rectangle_reasoning=False, incremental=False)


class Found(NamedTuple):
    """Conflict-free optimal paths, after expanding ``nodes`` constraint-tree nodes."""

    paths: list[list[int]]
    nodes: int


class NotFound(NamedTuple):
    """No plan: ``why`` is ``"nodes"`` or ``"time"`` (a budget ran out; ``lower`` bounds the optimum from below) or
    ``"exhausted"`` (the constraint tree has no more nodes: no plan obeys the root's constraints)."""

    why: str
    nodes: int
    lower: int


# A branch of a split: (operation, agent, argument, argument)
VERTICES, EDGE, MIN_COST, SETTLE = range(4)


class Node:
    """A constraint-tree node (see the module docstring)."""

    __slots__ = ("paths", "cons", "g", "h", "conflicts", "classified", "ready", "bounds")

    def __init__(self, paths: list[list[int]], cons: list[AgentConstraints], g: int, h: int,
                 conflicts: dict[tuple[int, int], list[Conflict]],
                 classified: dict[tuple[int, int], tuple[tuple[int, int, int], Conflict]],
                 bounds: dict[tuple[int, int], int] | None = None) -> None:
        self.paths = paths
        self.cons = cons
        self.g = g
        self.h = h
        self.conflicts = conflicts
        self.classified = classified
        self.ready = False
        self.bounds = bounds if bounds is not None else {}
        """Pair -> a lower bound on the two agents' joint cost under this node's constraints (WDG weights found
        here or in an ancestor: a child only adds constraints, so its pairs cost at least as much)."""


class CBS:
    """One search over a group of agents (also the two-agent searches behind WDG weights)."""

    def __init__(self, grid: Grid, starts: list[int], goals: list[int], hs: list[list[int]], options: CBSOptions,
                 max_nodes: int, deadline: float) -> None:
        self.grid = grid
        self.starts, self.goals, self.hs = starts, goals, hs
        self.n = len(starts)
        self.ncell = len(grid.free)
        self.options = options
        self.max_nodes = max_nodes
        self.deadline = deadline
        self.goal_owner = {g: a for a, g in enumerate(goals)}
        self.cat = ConflictAvoidanceTable(self.ncell, self.n)
        self.ds: list[list[int] | None] = [None] * self.n  # distances from each start, found when first needed
        # MDDs, WDG weights and their witnesses are memoised on the part of an agent's constraints that can matter at
        # the costs they look at (:meth:`_relevant`): a settle branch blocks a cell for every other agent, and most
        # of them can never be there.
        self.mdds: dict[tuple, MDD | None] = {}
        self.weights: dict[tuple, int] = {}
        self.witnesses: dict[tuple, tuple[list[int], list[int]]] = {}
        self.expanded = 0
        self.pair_searches = 0

    # ------------------------------------------------------------------------------------------------ the search
    def run(self, paths: list[list[int]] | None = None, cons: list[AgentConstraints] | None = None,
            lower: int = 0) -> Found | NotFound:
        """Search from a root with ``paths`` (optimal under ``cons``; planned here when None) within ``max_nodes``."""
        done = self.start(paths, cons, lower)
        return done if done is not None else self.resume(self.max_nodes)

    def start(self, paths: list[list[int]] | None = None, cons: list[AgentConstraints] | None = None,
              lower: int = 0) -> Found | NotFound | None:
        """Make the root; the answer when it already is one (or no path exists), else None (then :meth:`resume`)."""
        if paths is None and cons is None:
            # Every agent's plain shortest path first: when they happen not to conflict, that is the answer; else the
            # agents in conflicts are replanned in turn, each avoiding the others' paths where it can at no cost.
            paths = [shortest_path(self.grid, h, s, g) for h, s, g in zip(self.hs, self.starts, self.goals)]
            if self.n == 2:
                if not pair_collides(*paths):
                    return Found(paths, 0)
                again = [0, 1]
            else:
                found = self._all_conflicts(paths)
                if not found:
                    return Found(paths, 0)
                again = sorted({a for pair in found for a in pair})
            for a in again:
                paths[a] = self._plan(a, paths, NO_CONSTRAINTS, 0)
        cons = cons or [NO_CONSTRAINTS] * self.n
        if paths is None:
            paths = []
            for a in range(self.n):
                path = self._plan(a, paths, cons[a], 0)
                if path is None:
                    return NotFound("exhausted", 0, INF)
                paths.append(path)
        root = Node(paths, cons, sum(len(p) - 1 for p in paths), 0, self._all_conflicts(paths), {})
        if not root.conflicts:
            return Found(paths, 0)
        self.counter = 0
        self.open_list = [(max(root.g, lower), len(root.conflicts), 0, root)]
        return None

    def resume(self, max_nodes: int) -> Found | NotFound:
        """Expand nodes until a solution, ``max_nodes`` expansions in all, the deadline, or an empty open list."""
        open_list = self.open_list
        pop, push = heapq.heappop, heapq.heappush
        while open_list:
            f, _, _, node = open_list[0]
            if self.expanded >= max_nodes:
                return NotFound("nodes", self.expanded, f)
            if time.perf_counter() > self.deadline:
                return NotFound("time", self.expanded, f)
            pop(open_list)
            if not node.ready:
                node.ready = True
                if not self._evaluate(node):
                    continue
                if node.g + node.h > f:
                    self.counter -= 1
                    push(open_list, (node.g + node.h, len(node.conflicts), self.counter, node))
                    continue
            if not node.conflicts:
                return Found(node.paths, self.expanded)
            witnessed = self._witness_plan(node, f)
            if witnessed is not None:
                return Found(witnessed, self.expanded)
            self.expanded += 1
            found, children = self._expand(node, max(f, node.g + node.h))
            if found is not None:
                return Found(found.paths, self.expanded)
            for child in children:
                self.counter -= 1
                push(open_list, (child.g + child.h, len(child.conflicts), self.counter, child))
        return NotFound("exhausted", self.expanded, INF)

    def _expand(self, node: Node, bound: int) -> tuple[Node | None, list[Node]]:
        """Split ``node`` on its chosen conflict; a child of the same cost with fewer conflicting pairs is adopted
        in place (bypass) and the node split again."""
        while True:
            conflict = self._choose(node)
            children: list[Node] = []
            adopted = False
            bypass = self.options.bypass and (self.options.bypass_conflicts == "all"
                                              or self._priority(node, conflict) == Priority.NON)
            for i, branch in enumerate(self._split(conflict)):
                child = self._child(node, branch)
                if child is None:
                    continue
                if not child.conflicts and child.g <= bound:
                    return child, []
                if (bypass and child.g == node.g and len(child.conflicts) < len(node.conflicts)
                        and (i == 0 or children)):
                    node.paths, node.conflicts, node.classified = child.paths, child.conflicts, child.classified
                    adopted = True
                    break
                children.append(child)
            if not adopted:
                return None, children
            if not node.conflicts:
                return node, []

    # --------------------------------------------------------------------------------------------- splitting
    def _split(self, c: Conflict) -> tuple[tuple, tuple]:
        nc = self.ncell
        if c.kind is Kind.VERTEX:
            key = c.t * nc + c.u
            return (VERTICES, c.a, (key,)), (VERTICES, c.b, (key,))
        if c.kind is Kind.EDGE:
            return (EDGE, c.a, (c.t * nc + c.u) * nc + c.v), (EDGE, c.b, (c.t * nc + c.v) * nc + c.u)
        if c.kind is Kind.TARGET:
            if self.options.target_reasoning:
                return (SETTLE, c.a, c.t, c.u), (MIN_COST, c.a, c.t + 1)
            key = c.t * nc + c.u
            return (VERTICES, c.a, (key,)), (VERTICES, c.b, (key,))
        return (VERTICES, c.a, c.barriers[0]), (VERTICES, c.b, c.barriers[1])

    def _child(self, node: Node, branch: tuple) -> Node | None:
        """The child of ``node`` under one more constraint, with the affected agents replanned; None when one of
        them has no path left."""
        nc = self.ncell
        op, agent = branch[0], branch[1]
        cons = list(node.cons)
        paths = node.paths
        if op == VERTICES:
            cons[agent] = cons[agent].with_vertices(branch[2], nc, self.goals[agent])
            replan = [agent]
        elif op == EDGE:
            cons[agent] = cons[agent].with_edge(branch[2], nc)
            replan = [agent]
        elif op == MIN_COST:
            cons[agent] = cons[agent].with_min_cost(branch[2])
            replan = [agent]
        else:  # SETTLE: the agent is on its goal cell by t for good; nobody else enters it from t on
            t, cell = branch[2], branch[3]
            cons[agent] = cons[agent].with_max_cost(t)
            replan = []
            grown: dict[tuple, tuple] = {}  # most agents share one set of blocks: grow each set once
            for x in range(self.n):
                if x != agent:
                    old = cons[x]
                    blocked = grown.get(old.blocked)
                    if blocked is None:
                        blocked = grown[old.blocked] = add_block(old.blocked, cell, t)
                    if blocked is not old.blocked:
                        cons[x] = old.with_blocks(blocked, t)
                    if cell in paths[x][t:]:
                        replan.append(x)
        paths = list(paths)
        g = node.g
        for x in replan:
            old = paths[x]
            path = self._plan(x, paths, cons[x], len(old) - 1)
            if path is None:
                return None
            paths[x] = path
            g += len(path) - len(old)
        done = set(replan)
        conflicts = {k: v for k, v in node.conflicts.items() if k[0] not in done and k[1] not in done}
        classified = {k: v for k, v in node.classified.items() if k[0] not in done and k[1] not in done}
        conflicts.update(self._new_conflicts(paths, replan))
        h = max(0, node.g + node.h - g)
        return Node(paths, cons, g, h, conflicts, classified,
                    dict(node.bounds) if self.options.inherit_weights else None)

    # -------------------------------------------------------------------------------------- low level, conflicts
    def _plan(self, a: int, paths: list[list[int]], cons: AgentConstraints, lower: int) -> list[int] | None:
        """Agent ``a``'s optimal path under ``cons``, avoiding the other agents' ``paths`` where it can."""
        if self.options.incremental:
            cat = self.cat
            cat.load(paths, skip=(a,))
        else:
            cat = ConflictAvoidanceTable(self.ncell, self.n)
            for b, p in enumerate(paths):
                if b != a and p:
                    cat.add(b, p)
        return find_path(self.grid, self.hs[a], self.starts[a], self.goals[a], cons, cat, lower)

    def _all_conflicts(self, paths: list[list[int]]) -> dict[tuple[int, int], list[Conflict]]:
        return self._new_conflicts(paths, list(range(self.n)))

    def _new_conflicts(self, paths: list[list[int]], agents: list[int]) -> dict[tuple[int, int], list[Conflict]]:
        """The conflicts of ``agents`` (with everyone) in ``paths``."""
        out: dict[tuple[int, int], list[Conflict]] = {}
        if self.options.incremental:
            cat = self.cat
            cat.load(paths, skip=agents)
            for a in reversed(agents):  # each pair once, named as the scan below names it
                out.update(conflicts_of(a, paths[a], paths, self.goal_owner, cat))
                cat.add(a, paths[a])
            return out
        done: set[int] = set()
        for a in agents:
            for b in range(self.n):
                if b != a and b not in done:
                    found = pair_conflicts(a, paths[a], b, paths[b])
                    if found:
                        out[pair_key(a, b)] = found
            done.add(a)
        return out

    # ------------------------------------------------------------------------------ choosing, classifying, h
    def _relevant(self, a: int, cons: AgentConstraints, cost: int) -> tuple:
        """What of ``cons`` can matter to agent ``a``'s paths of cost at most ``cost``: all of it but the blocked
        cells the agent cannot stand on at or after their times within that cost (it reaches the cell no earlier
        than its distance from its start, and must still walk to its goal from there)."""
        blocked = cons.blocked
        if blocked:
            h, d, goal = self.hs[a], self.ds[a], self.goals[a]
            if d is None:
                d = self.ds[a] = self.grid.distances_from(self.starts[a])
            blocked = tuple(e for e in blocked if e[0] == goal or (
                d[e[0]] >= 0 and max(e[1], d[e[0]]) + h[e[0]] <= cost))
        return cons.vertex, cons.edge, cons.min_cost, cons.max_cost, cons.goal_block, blocked

    def _merged_key(self, node: Node, a: int, b: int) -> tuple:
        """The memo key of a WDG weight found by MDD merges alone (which never look at a path longer than
        ``pair_cost`` more): the agents' costs and their constraints relevant within that. A weight that needed a
        two-agent search is kept on the agents' whole constraints instead."""
        ca, cb = len(node.paths[a]) - 1, len(node.paths[b]) - 1
        extra = self.options.pair_cost
        return (a, b, ca, cb, self._relevant(a, node.cons[a], ca + extra), self._relevant(b, node.cons[b], cb + extra))

    def _mdd(self, a: int, node: Node, extra: int = 0) -> MDD | None:
        """Agent ``a``'s MDD in ``node`` at its cost plus ``extra`` (None when no path has that cost)."""
        cons = node.cons[a]
        cost = len(node.paths[a]) - 1 + extra
        whole = (a, cons, cost)  # looked up first: cheaper to hash than the relevant part is to find
        mdds = self.mdds
        if whole in mdds:
            return mdds[whole]
        key = (a, cost, self._relevant(a, cons, cost))
        if key in mdds:
            mdd = mdds[whole] = mdds[key]
            return mdd
        if len(mdds) > 100_000:
            mdds.clear()
        mdd = mdds[key] = mdds[whole] = build_mdd(self.grid, self.hs[a], self.starts[a], self.goals[a], cost, cons)
        if mdd is None and not extra:
            raise RuntimeError(f"agent {a}: no MDD at its own path's cost {cost}; the path breaks its constraints")
        return mdd

    def _classify(self, node: Node) -> None:
        """Give every conflicting pair its most useful conflict and that conflict's rank (cardinality, kind, time)."""
        classified = node.classified
        rectangles = self.options.rectangle_reasoning
        for key, found in node.conflicts.items():
            if key in classified:
                continue
            best = None
            for c in found:
                mdd_a, mdd_b = self._mdd(c.a, node), self._mdd(c.b, node)
                rank = priority_key(cardinality(c, mdd_a, mdd_b), c)
                if rectangles and c.kind is Kind.VERTEX and rank[0] != Priority.CARDINAL:
                    rect = rectangle_conflict(self, node, c, mdd_a, mdd_b)
                    if rect is not None:
                        c, rank = rect
                if best is None or rank < best[0]:
                    best = (rank, c)
            classified[key] = best

    def _choose(self, node: Node) -> Conflict:
        if self.options.prioritize_conflicts:
            self._classify(node)
            if self.options.conflict_ties == "pairs":
                return min(node.classified.items(), key=lambda kv: (kv[1][0][0], kv[1][0][1], pair_order(kv[0])))[1][1]
            return min(node.classified.items(), key=lambda kv: (kv[1][0], kv[0]))[1][1]
        return min(((c.t, key), c) for key, found in node.conflicts.items() for c in found)[1]

    def _priority(self, node: Node, conflict: Conflict) -> Priority:
        """The cardinality of ``conflict``, the one :meth:`_choose` took for its pair (NON without classification)."""
        if not self.options.prioritize_conflicts:
            return Priority.NON
        ranked = node.classified.get(pair_key(conflict.a, conflict.b))
        return Priority.NON if ranked is None else ranked[0][0]

    def _evaluate(self, node: Node) -> bool:
        """Classify ``node``'s conflicts and raise its ``h`` to the heuristic's; False when a pair of its agents
        provably has no plan under their constraints (the node's subtree holds no solution)."""
        kind = self.options.heuristic
        if kind == "none":
            return True
        self._classify(node)
        weights: dict[tuple[int, int], int] = {}
        for key, (rank, _) in node.classified.items():
            if kind == "cg":
                if rank[0] == Priority.CARDINAL:
                    weights[key] = 1
                continue
            w = self._pair_weight(node, key, rank[0] == Priority.CARDINAL)
            if w >= INF:
                return False
            node.bounds[key] = _pair_cost(node, *key) + w
            if w:
                weights[key] = w
        if weights:
            node.h = max(node.h, vertex_cover(weights))
        return True

    def _pair_weight(self, node: Node, key: tuple[int, int], cardinal: bool) -> int:
        """How much agents ``key`` must add to their costs together (a lower bound; INF when they cannot both reach
        their goals under their constraints), memoised on their constraints.

        By merging MDDs (ICTS for two agents): the weight is the least ``k`` such that some split of ``k`` extra steps
        between the two agents leaves a conflict-free pair of paths; every smaller ``k`` refuted is a lower bound, so
        past ``pair_cost`` extra steps the weight is ``pair_cost + 1``. Only when a merge is too large to decide are the
        two agents solved by CBS, within ``pair_nodes`` nodes.
        """
        a, b = key
        cons_a, cons_b = node.cons[a], node.cons[b]
        whole = (a, b, cons_a, cons_b)
        bound = node.bounds.get(key)
        at_least = 0 if bound is None else max(0, bound - _pair_cost(node, a, b))
        w = self.weights.get(whole)
        if w is not None:
            return max(w, at_least)
        if at_least > self.options.pair_cost:
            self.weights[whole] = at_least
            return at_least
        memo = self._merged_key(node, a, b)
        w = self.weights.get(memo)
        if w is not None:
            self._keep_weight(whole, memo, w)
            return max(w, at_least)
        w = -1
        depth = self.options.merge_order == "depth"
        for k in range(max(int(cardinal), at_least), self.options.pair_cost + 1):
            undecided = False
            for i in range(k + 1):
                mdd_a, mdd_b = self._mdd(a, node, i), self._mdd(b, node, k - i)
                if mdd_a is None or mdd_b is None:
                    continue
                fits = merge_mdds(self.grid, mdd_a, mdd_b, self.ncell, cons_a.edge, cons_b.edge, depth)
                if fits:
                    w = k
                    self.witnesses[memo] = fits
                    break
                undecided = undecided or fits is None
            if w >= 0:
                break
            if undecided:
                memo = whole
                w = self._pair_search(node, a, b, k, memo)
                break
        if w < 0:  # every split of up to pair_cost extra steps refuted: that bound, without a search
            w = self.options.pair_cost + 1
        self._keep_weight(whole, memo, w)
        return w

    def _keep_weight(self, whole: tuple, memo: tuple, w: int) -> None:
        """Memoise a pair's weight ``w`` under its whole constraints and under ``memo`` (its merged key, or the whole
        again), with the witness found under ``memo`` where there is one."""
        self.weights[memo] = self.weights[whole] = w
        if memo is not whole and memo in self.witnesses:
            self.witnesses[whole] = self.witnesses[memo]

    def _witness_plan(self, node: Node, bound: int) -> list[list[int]] | None:
        """A conflict-free plan of cost at most ``bound`` (the least ``g + h`` of the open list, so a lower bound on
        every plan: such a plan is optimal) from the pairwise searches behind ``node``'s WDG weights, when its
        conflicting pairs are disjoint and each was solved with a witness; else None."""
        if self.options.heuristic != "wdg":
            return None
        paths = list(node.paths)
        changed: list[int] = []
        for a, b in node.conflicts:
            found = self.witnesses.get((a, b, node.cons[a], node.cons[b]))
            if found is None or a in changed or b in changed:
                return None
            paths[a], paths[b] = found
            changed += (a, b)
        if sum(len(p) - 1 for p in paths) > bound or self._new_conflicts(paths, changed):
            return None
        return paths

    def _pair_search(self, node: Node, a: int, b: int, at_least: int, memo: tuple) -> int:
        """The two agents' extra cost by a CBS of their own (at least ``at_least``, a bound already proved); its plan,
        when it finds one, is kept as the pair's witness."""
        base = _pair_cost(node, a, b)
        sub = CBS(self.grid, [self.starts[a], self.starts[b]], [self.goals[a], self.goals[b]],
                  [self.hs[a], self.hs[b]], replace(self.options, heuristic="cg", bypass=False),
                  self.options.pair_nodes, self.deadline)
        got = sub.run([node.paths[a], node.paths[b]], [node.cons[a], node.cons[b]], base + at_least)
        self.pair_searches += 1
        if isinstance(got, Found):
            self.witnesses[memo] = (got.paths[0], got.paths[1])
            return max(at_least, sum(len(p) - 1 for p in got.paths) - base)
        return INF if got.lower >= INF else max(at_least, got.lower - base)


def _pair_cost(node: Node, a: int, b: int) -> int:
    """The sum of agents ``a`` and ``b``'s costs in ``node`` (what a WDG weight is counted from)."""
    return len(node.paths[a]) + len(node.paths[b]) - 2
