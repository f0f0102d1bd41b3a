"""Conflicts between two agents' paths: detection, classification (ICBS) and the constraints that resolve them.

Kinds: a **vertex** conflict (both agents on cell ``u`` at ``t``), an **edge** conflict (agent ``a`` moves ``u -> v``
while agent ``b`` moves ``v -> u``, both arriving at ``t``), and a **target** conflict (agent ``a`` has settled on its
goal ``u`` by ``t`` and agent ``b`` is there at ``t``: a vertex conflict with more to say, Li et al. 2021). Every
conflict of a pair is kept; the pair's most useful one is chosen by :func:`priority_key`: cardinal before
semi-cardinal before non-cardinal (Boyarski et al. 2015: a cardinal conflict raises the cost of both children), then
target before rectangle before plain conflicts, then the earliest.
"""

from __future__ import annotations

import zlib
from enum import IntEnum
from typing import NamedTuple

from envgen.solver.cbs_lowlevel import MDD, ConflictAvoidanceTable


class Kind(IntEnum):
    """What two agents do wrong; the value ranks conflict kinds for choosing (lower first)."""

    TARGET = 0
    RECTANGLE = 1
    VERTEX = 2
    EDGE = 3


class Priority(IntEnum):
    """How a conflict's resolution raises costs: in both children (cardinal), one (semi) or neither (non)."""

    CARDINAL = 0
    SEMI = 1
    NON = 2


class Conflict(NamedTuple):
    """One conflict. Vertex: ``a``, ``b`` on ``u`` at ``t``. Edge: ``a`` moves ``u -> v`` and ``b`` moves ``v -> u``,
    arriving at ``t``. Target: ``a`` is on its goal ``u`` for good, ``b`` is there at ``t``. Rectangle: the vertex
    conflict of ``a`` and ``b`` on ``u`` at ``t``, resolved by ``barriers`` (the space-time keys forbidden to ``a`` in
    one child and to ``b`` in the other, see :mod:`envgen.solver.cbs_rectangle`)."""

    kind: Kind
    a: int
    b: int
    t: int
    u: int
    v: int = -1
    barriers: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())


def pair_key(a: int, b: int) -> tuple[int, int]:
    return (a, b) if a < b else (b, a)


def conflicts_of(a: int, path: list[int], paths: list[list[int]], goal_owner: dict[int, int],
                 cat: ConflictAvoidanceTable) -> dict[tuple[int, int], list[Conflict]]:
    """Every conflict of agent ``a`` on ``path`` with the agents loaded in ``cat`` (whose paths are ``paths``),
    grouped by pair, in time order. Costs the length of the paths plus the agents at each hit, not a scan of every
    other path: the table says where someone is."""
    nc = cat.ncell
    occ, tlen, park, moves = cat.occ, cat.tlen, cat.park, cat.moves
    loaded = cat.paths
    out: dict[tuple[int, int], list[Conflict]] = {}
    last = len(path) - 1
    prev = path[0]
    for t in range(last + 1):
        c = path[t]
        if t < tlen and occ[t * nc + c]:
            for b, q in enumerate(loaded):
                if q is not None and t < len(q) and q[t] == c:
                    if t == last:
                        found = Conflict(Kind.TARGET, a, b, t, c)
                    elif t == len(q) - 1:
                        found = Conflict(Kind.TARGET, b, a, t, c)
                    else:
                        found = Conflict(Kind.VERTEX, a, b, t, c)
                    out.setdefault(pair_key(a, b), []).append(found)
        if park[c] <= t:
            b = goal_owner[c]
            out.setdefault(pair_key(a, b), []).append(Conflict(Kind.TARGET, b, a, t, c))
        if t and c != prev and moves and (t * nc + c) * nc + prev in moves:
            for b, q in enumerate(loaded):
                if q is not None and t < len(q) and q[t] == prev and q[t - 1] == c:
                    out.setdefault(pair_key(a, b), []).append(Conflict(Kind.EDGE, a, b, t, prev, c))
        prev = c
    goal = path[last]
    for t in range(last + 1, tlen):
        if occ[t * nc + goal]:
            for b, q in enumerate(loaded):
                if q is not None and t < len(q) and q[t] == goal:
                    out.setdefault(pair_key(a, b), []).append(Conflict(Kind.TARGET, a, b, t, goal))
    for found in out.values():
        found.sort(key=lambda c: c.t)
    return out


def pair_conflicts(a: int, p: list[int], b: int, q: list[int]) -> list[Conflict]:
    """Every conflict between agent ``a`` on ``p`` and agent ``b`` on ``q`` by a plain scan (each stays on its goal
    after its last step), in time order."""
    lp, lq = len(p) - 1, len(q) - 1
    out = []
    for t in range(max(lp, lq) + 1):
        x = p[t] if t <= lp else p[lp]
        y = q[t] if t <= lq else q[lq]
        if x == y:
            if t >= lp:
                out.append(Conflict(Kind.TARGET, a, b, t, x))
            elif t >= lq:
                out.append(Conflict(Kind.TARGET, b, a, t, x))
            else:
                out.append(Conflict(Kind.VERTEX, a, b, t, x))
        elif t and x != (x0 := p[t - 1] if t - 1 <= lp else p[lp]) and x == (q[t - 1] if t - 1 <= lq else q[lq]) \
                and y == x0:
            out.append(Conflict(Kind.EDGE, a, b, t, x0, x))
    return out


def pair_collides(p: list[int], q: list[int]) -> bool:
    """Whether two paths (each agent then staying on its goal) have any conflict: :func:`pair_conflicts` without
    collecting them."""
    lp, lq = len(p) - 1, len(q) - 1
    x0, y0 = p[0], q[0]
    for t in range(1, max(lp, lq) + 1):
        x = p[t] if t <= lp else p[lp]
        y = q[t] if t <= lq else q[lq]
        if x == y or (x == y0 and y == x0):
            return True
        x0, y0 = x, y
    return False


def cardinality(conflict: Conflict, mdd_a: MDD, mdd_b: MDD) -> Priority:
    """Cardinal, semi-cardinal or non-cardinal, from the agents' MDDs at their current costs (a level of width one is
    a cell every optimal path of the agent occupies then). The settled agent of a target conflict is cardinal: keeping
    it off its goal at ``t`` costs it at least one step."""
    t = conflict.t
    if conflict.kind is Kind.EDGE:
        one = mdd_a.width(t) == 1 and mdd_a.width(t - 1) == 1
        two = mdd_b.width(t) == 1 and mdd_b.width(t - 1) == 1
    elif conflict.kind is Kind.TARGET:
        one = True
        two = mdd_b.width(t) == 1
    else:
        one = mdd_a.width(t) == 1
        two = mdd_b.width(t) == 1
    if one and two:
        return Priority.CARDINAL
    return Priority.SEMI if one or two else Priority.NON


def priority_key(priority: Priority, conflict: Conflict) -> tuple[int, int, int]:
    """Smaller is chosen first: cardinality, then kind (target, rectangle, vertex/edge), then time."""
    kind = Kind.VERTEX if conflict.kind is Kind.EDGE else conflict.kind
    return (priority, kind, conflict.t)


def pair_order(pair: tuple[int, int]) -> int:
    """A fixed pseudo-random rank of an agent pair (CRC-32 of ``"(a, b)"``): CBSOptions.conflict_ties = 'pairs'
    splits, among pairs whose conflicts rank alike, the pair of the smallest, an order unrelated to time or agent
    numbers, and the same on every machine."""
    return zlib.crc32(b"(%d, %d)" % pair)
