"""Moves and the grid graph shared by the solver, the simulator and the generator.

Cells are numbered ``index = row * width + col``. A :class:`Grid` is derived once per distinct grid (cached), and holds
flat lookup tables so that the hot loops of the solver and the simulator do list indexing only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache
from operator import getitem
from typing import NamedTuple

from envgen.core.instance import FREE, Cell


class Move(str, Enum):
    """One agent's action for one time step. ``UP`` decreases the row, ``LEFT`` decreases the column."""

    UP = "UP"
    DOWN = "DOWN"
    LEFT = "LEFT"
    RIGHT = "RIGHT"
    WAIT = "WAIT"


MOVES: tuple[Move, ...] = tuple(Move)
DELTAS: dict[Move, Cell] = {Move.UP: (-1, 0), Move.DOWN: (1, 0), Move.LEFT: (0, -1), Move.RIGHT: (0, 1), Move.WAIT: (0, 0)}
MOVE_OF_DELTA: dict[Cell, Move] = {d: m for m, d in DELTAS.items()}
UNREACHABLE = -1


@dataclass(frozen=True, eq=False)
class Grid:
    """Flat lookup tables for one grid.

    Attributes:
        height, width: the grid's shape.
        free: ``free[i]`` is True where cell ``i`` is frozen (walkable).
        neighbors: ``neighbors[i]`` lists the free 4-neighbours of free cell ``i`` (empty for holes).
        step: ``step[m][i]`` is the cell reached by move ``MOVES[m]`` from cell ``i``, or -1 when it leaves the grid.
        options: ``options[i]`` is ``(i, *neighbors[i])``: where an agent on ``i`` can be one step later.
    """

    height: int
    width: int
    free: tuple[bool, ...]
    neighbors: tuple[tuple[int, ...], ...]
    step: tuple[tuple[int, ...], ...]
    options: tuple[tuple[int, ...], ...]
    _distances: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def index(self, cell: Cell) -> int:
        return cell[0] * self.width + cell[1]

    def cell(self, index: int) -> Cell:
        return divmod(index, self.width)

    def distances_from(self, source: int) -> list[int]:
        """Breadth-first distances from ``source`` to every cell (``UNREACHABLE`` for holes and cut-off cells).

        Memoised per grid: the generator's draws and the solver share one search per goal. Do not modify the list."""
        dist = self._distances.get(source)
        if dist is None:
            dist = self._distances[source] = _bfs(self.neighbors, source, len(self.free))
        return dist

    def components(self) -> list[int]:
        """A component label for every cell (-1 for holes); free cells connected 4-wise share a label."""
        label = [-1] * len(self.free)
        nbrs = self.neighbors
        nxt = 0
        for s, ok in enumerate(self.free):
            if not ok or label[s] >= 0:
                continue
            label[s] = nxt
            stack = [s]
            while stack:
                u = stack.pop()
                for v in nbrs[u]:
                    if label[v] < 0:
                        label[v] = nxt
                        stack.append(v)
            nxt += 1
        return label


def _bfs(neighbors: tuple[tuple[int, ...], ...], source: int, n: int) -> list[int]:
    dist = [UNREACHABLE] * n
    dist[source] = 0
    frontier = [source]
    d = 0
    while frontier:
        d += 1
        nxt = []
        push = nxt.append
        for u in frontier:
            for v in neighbors[u]:
                if dist[v] < 0:
                    dist[v] = d
                    push(v)
        frontier = nxt
    return dist


class _Shape(NamedTuple):
    """What every grid of one ``h x w`` shape shares (see :func:`_tables`)."""

    neighbors_by_code: tuple[tuple[tuple[int, ...], ...], ...]
    """``neighbors_by_code[i][code]``: cell ``i``'s neighbours (in ``MOVES`` order) whose direction's bit is set in
    ``code`` (bit ``m`` for ``MOVES[m]``); a bit of a direction that leaves the grid is ignored."""
    options_by_code: tuple[tuple[tuple[int, ...], ...], ...]
    """The same with ``i`` itself first (an agent on ``i`` may wait)."""


LOOKUP_CELLS = 4096
"""Grids of up to this many cells get their neighbour tables by lookup (:func:`grid_from_free`); larger ones by a loop."""


@lru_cache(maxsize=64)
def _steps(h: int, w: int) -> tuple[tuple[int, ...], ...]:
    """``step[m][i]``: the cell move ``MOVES[m]`` leads to from ``i`` on an obstacle-free ``h x w`` grid, or -1 off it."""
    step = []
    for m in MOVES:
        dr, dc = DELTAS[m]
        table = []
        for r in range(h):
            for c in range(w):
                rr, cc = r + dr, c + dc
                table.append(rr * w + cc if 0 <= rr < h and 0 <= cc < w else -1)
        step.append(tuple(table))
    return tuple(step)


@lru_cache(maxsize=64)
def _tables(h: int, w: int) -> _Shape:
    """Move tables of an obstacle-free ``h x w`` grid and, per cell, its neighbour and option tuples for every pattern
    of free neighbours, so that a grid's own tables are looked up, not built (shared by all grids of that shape)."""
    step = _steps(h, w)
    neighbors_by_code, options_by_code = [], []
    for i in range(h * w):
        kept = [tuple(step[m][i] for m in range(4) if code >> m & 1 and step[m][i] >= 0) for code in range(16)]
        neighbors_by_code.append(tuple(kept))
        options_by_code.append(tuple((i, *nb) for nb in kept))
    return _Shape(tuple(neighbors_by_code), tuple(options_by_code))


def grid_from_free(h: int, w: int, free: tuple[bool, ...]) -> Grid:
    """A :class:`Grid` from a flat free-cell mask (no caching; for generators that build many grids).

    Each cell's free neighbours are looked up by a 4-bit code (bit ``m`` set when its neighbour in direction
    ``MOVES[m]`` is free), computed for all cells at once on an integer that holds one byte per cell: shifting it by
    one row or one column lines every cell up with a neighbour, and the codes (at most 15) never carry into the next
    byte. Several times faster than a loop over the cells; the generator builds a grid for every draw."""
    n = len(free)
    step = _steps(h, w)
    if n > LOOKUP_CELLS:  # a large map is built once: no tables of 32 tuples per cell for it
        neighbors = tuple([tuple([v for v in (step[m][i] for m in range(4)) if v >= 0 and free[v]]) if free[i] else ()
                           for i in range(n)])
        return Grid(h, w, free, neighbors, step, tuple([(i, *nb) for i, nb in enumerate(neighbors)]))
    shape = _tables(h, w)
    cells = int.from_bytes(bytes(free), "little")  # byte i: 1 when cell i is free
    # byte i of each shift: whether the cell above / below / left / right of i is free (wrapping round a row's end or
    # off the grid where there is no such neighbour: the tables ignore those bits); 0 on a hole
    up, down, left, right = cells << 8 * w, cells >> 8 * w, cells << 8, cells >> 8
    codes = ((up | down << 1 | left << 2 | right << 3) & (cells * 15)).to_bytes(n, "little")
    neighbors = tuple(map(getitem, shape.neighbors_by_code, codes))
    options = tuple(map(getitem, shape.options_by_code, codes))
    return Grid(h, w, free, neighbors, step, options)


@lru_cache(maxsize=1024)
def grid_of(rows: tuple[str, ...]) -> Grid:
    """The (cached) :class:`Grid` for an instance's rows."""
    return grid_from_free(len(rows), len(rows[0]), tuple(map(FREE.__eq__, "".join(rows))))
