"""Admissible high-level heuristics for CBS (Felner et al. 2018; Li et al. 2019, "Improved Heuristics for Multi-Agent
Path Finding with Conflict-Based Search").

Every conflicting pair of agents gets a weight: a lower bound on how much their two costs must rise together. The
minimum weighted vertex cover of that graph (a value per agent such that each pair's two values add up to at least its
weight) then bounds the rise of the sum of costs, so ``g + h`` never overestimates.

- **CG** (cardinal conflict graph): weight 1 for a pair with a cardinal conflict.
- **WDG** (weighted dependency graph): the pair's exact extra cost, by solving the two agents alone under their
  constraints (memoised on those constraints, see :mod:`envgen.solver.cbs_search`), after a cheap test of the pair's MDDs:
  if some pair of optimal paths is conflict-free the weight is 0.
"""

from __future__ import annotations

from envgen.solver.cbs_lowlevel import MDD
from envgen.core.grid import Grid

EXACT_COMPONENT = 8
"""Components of the conflict graph up to this many agents get an exact vertex cover; larger ones a greedy matching
(also a lower bound)."""

SYNC_LIMIT = 20_000
"""Joint MDD moves examined by :func:`compatible` before it gives up."""


def vertex_cover(weights: dict[tuple[int, int], int]) -> int:
    """The minimum weighted vertex cover of a graph given by its edge weights (edges of weight 0 are ignored)."""
    adj: dict[int, dict[int, int]] = {}
    for (a, b), w in weights.items():
        if w > 0:
            adj.setdefault(a, {})[b] = w
            adj.setdefault(b, {})[a] = w
    total = 0
    seen: set[int] = set()
    for root in adj:
        if root in seen:
            continue
        comp = [root]
        seen.add(root)
        i = 0
        while i < len(comp):
            for v in adj[comp[i]]:
                if v not in seen:
                    seen.add(v)
                    comp.append(v)
            i += 1
        if len(comp) == 2:
            total += adj[comp[0]][comp[1]]
        elif len(comp) <= EXACT_COMPONENT:
            total += _exact_cover(comp, adj)
        else:
            total += _greedy_matching(comp, adj)
    return total


def _exact_cover(comp: list[int], adj: dict[int, dict[int, int]]) -> int:
    """Branch and bound over each agent's value 0..its largest edge weight, in order (Li et al. 2019's DP)."""
    index = {v: i for i, v in enumerate(comp)}
    n = len(comp)
    rng = [max(adj[v].values()) for v in comp]
    earlier = [[(index[u], w) for u, w in adj[v].items() if index[u] < i] for i, v in enumerate(comp)]
    x = [0] * n
    best = [sum(rng)]

    def go(i: int, total: int) -> None:
        if total >= best[0]:
            return
        if i == n:
            best[0] = total
            return
        need = 0
        for j, w in earlier[i]:
            if w - x[j] > need:
                need = w - x[j]
        for value in range(need, rng[i] + 1):
            x[i] = value
            go(i + 1, total + value)
        x[i] = 0

    go(0, 0)
    go = None  # the closure refers to itself: left to the cyclic collector otherwise, which solve() pauses
    return best[0]


def _greedy_matching(comp: list[int], adj: dict[int, dict[int, int]]) -> int:
    """The weight of a greedy matching (heaviest edges first): disjoint edges need disjoint cover, so a lower bound."""
    edges = sorted(((w, a, b) for a in comp for b, w in adj[a].items() if a < b), reverse=True)
    used: set[int] = set()
    total = 0
    for w, a, b in edges:
        if a not in used and b not in used:
            used.add(a)
            used.add(b)
            total += w
    return total


def merge_mdds(grid: Grid, mdd_a: MDD, mdd_b: MDD, ncell: int, edges_a: frozenset[int] = frozenset(),
               edges_b: frozenset[int] = frozenset(), depth_first: bool = False) -> tuple[list[int], list[int]] | bool | None:
    """A conflict-free pair of paths, one from each MDD, when there is one; False when there is none; None when
    undecided within :data:`SYNC_LIMIT`.

    A breadth-first sweep over joint MDD states level by level (the MDDs merged, Felner et al. 2018); the agent with
    the shorter MDD then stays on its goal. ``edges_*`` are the agents' edge constraints (an MDD's levels alone allow
    every move between adjacent cells). ``depth_first``: the same joint states searched depth first, each visited
    once, so a pair that has a conflict-free way usually shows it after a few states per level, where the sweep
    builds every level whole; the same answer whenever both decide, with another pair of paths.
    """
    if depth_first:
        return _merge_depth_first(grid, mdd_a, mdd_b, ncell, edges_a, edges_b)
    options = grid.options
    la, lb = mdd_a.levels, mdd_b.levels
    len_a, len_b = len(la), len(lb)
    end = max(len_a, len_b)
    start = next(iter(la[0])) * ncell + next(iter(lb[0]))  # a joint state (u, w) is the number u * ncell + w
    layers: list[dict[int, int]] = [{start: start}]
    work = 0
    for t in range(1, end):
        nxt: dict[int, int] = {}
        level_a = la[t] if t < len_a else None
        level_b = lb[t] if t < len_b else None
        base = t * ncell
        kids_a: dict[int, list[int] | tuple[int]] = {}
        kids_b: dict[int, list[int] | tuple[int]] = {}
        for state in layers[-1]:
            u, w = divmod(state, ncell)
            moves_a = kids_a.get(u)
            if moves_a is None:
                moves_a = kids_a[u] = _moves(options, u, level_a, edges_a, base, ncell)
            moves_b = kids_b.get(w)
            if moves_b is None:
                moves_b = kids_b[w] = _moves(options, w, level_b, edges_b, base, ncell)
            for v in moves_a:
                joint = v * ncell
                swap = v == w
                for y in moves_b:
                    if v != y and not (swap and y == u):
                        key = joint + y
                        if key not in nxt:
                            nxt[key] = state
            work += len(moves_a) * len(moves_b)
        if not nxt:
            return False
        if work > SYNC_LIMIT:
            return None
        layers.append(nxt)
    state = next(iter(layers[-1]))
    path_a, path_b = [], []
    for t in range(end - 1, -1, -1):
        u, w = divmod(state, ncell)
        if t < len_a:
            path_a.append(u)
        if t < len_b:
            path_b.append(w)
        state = layers[t][state]
    path_a.reverse()
    path_b.reverse()
    return path_a, path_b


def _moves(options: tuple[tuple[int, ...], ...], u: int, level: frozenset[int] | None, edges: frozenset[int], base: int,
           ncell: int) -> list[int] | tuple[int]:
    """An agent's moves from ``u`` into its MDD's ``level`` at the time ``base // ncell``, less its edge constraints;
    staying on ``u`` (its goal) once its MDD has ended (``level`` None)."""
    if level is None:
        return (u,)
    return [v for v in options[u] if v in level and not (edges and v != u and (base + u) * ncell + v in edges)]


def _merge_depth_first(grid: Grid, mdd_a: MDD, mdd_b: MDD, ncell: int, edges_a: frozenset[int],
                       edges_b: frozenset[int]) -> tuple[list[int], list[int]] | bool | None:
    """:func:`merge_mdds` depth first: joint states ``t * ncell**2 + u * ncell + w`` on a stack, each pushed once,
    their moves tried in the grid's order; the work counted as the sweep counts it."""
    options = grid.options
    la, lb = mdd_a.levels, mdd_b.levels
    len_a, len_b = len(la), len(lb)
    last = max(len_a, len_b) - 1
    square = ncell * ncell
    start = next(iter(la[0])) * ncell + next(iter(lb[0]))
    parent: dict[int, int] = {start: -1}
    stack = [start]
    kids_a: dict[int, list[int] | tuple[int]] = {}
    kids_b: dict[int, list[int] | tuple[int]] = {}
    work = 0
    while stack:
        key = stack.pop()
        t, state = divmod(key, square)
        if t == last:
            path_a, path_b = [], []
            while key >= 0:
                t, state = divmod(key, square)
                u, w = divmod(state, ncell)
                if t < len_a:
                    path_a.append(u)
                if t < len_b:
                    path_b.append(w)
                key = parent[key]
            path_a.reverse()
            path_b.reverse()
            return path_a, path_b
        u, w = divmod(state, ncell)
        nt = t + 1
        base = nt * ncell
        moves_a = kids_a.get(base + u)
        if moves_a is None:
            moves_a = kids_a[base + u] = _moves(options, u, la[nt] if nt < len_a else None, edges_a, base, ncell)
        moves_b = kids_b.get(base + w)
        if moves_b is None:
            moves_b = kids_b[base + w] = _moves(options, w, lb[nt] if nt < len_b else None, edges_b, base, ncell)
        work += len(moves_a) * len(moves_b)
        if work > SYNC_LIMIT:
            return None
        head = nt * square
        for v in reversed(moves_a):
            joint = head + v * ncell
            swap = v == w
            for y in reversed(moves_b):
                if v != y and not (swap and y == u):
                    child = joint + y
                    if child not in parent:
                        parent[child] = key
                        stack.append(child)
    return False
