"""Immutable MAPF-FrozenLake instances and their text format.

An :class:`Instance` is pure data: a rectangular grid of frozen cells and holes, and for every agent a start and a
goal cell. Cells are ``(row, col)`` pairs with ``(0, 0)`` the top-left corner. Simulation and solving live elsewhere
(:mod:`envgen.core.simulate`, :mod:`envgen.solver.cbs`); they read instances and never change them.

Text format (``Instance.to_str`` / ``Instance.from_str``), one line each, ``#`` starts a comment::

    mapf-frozenlake v1
    grid 3x4
    FFHF
    FHFF
    FFFF
    agent 1: 0,0 -> 2,3
    agent 2: 2,0 -> 0,3

``F`` is a frozen (free) cell and ``H`` a hole (an obstacle). ``agent i: r,c -> r,c`` gives start and goal.

The content hash (:attr:`Instance.content_hash`) is the SHA-256 of the canonical text, so two instances with the same
grid, starts and goals have the same hash whatever their origin; it is used for de-duplication and to prove that
training and benchmark instances are disjoint.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

Cell = tuple[int, int]

FREE = "F"
HOLE = "H"
HEADER = "mapf-frozenlake v1"
MAX_SIDE = 1024
"""Largest grid side accepted (MovingAI maps go up to a few hundred cells a side)."""


class InstanceError(ValueError):
    """An instance is malformed: the message names the line or the field and what is wrong."""


@dataclass(frozen=True)
class Instance:
    """A MAPF-FrozenLake level: grid, starts and goals. Immutable and hashable.

    Attributes:
        rows: the grid, one string per row, ``F`` free and ``H`` hole; all rows have the same length.
        starts: the start cell of each agent, ``(row, col)``; pairwise distinct, all free.
        goals: the goal cell of each agent, ``(row, col)``; pairwise distinct, all free.
    """

    rows: tuple[str, ...]
    starts: tuple[Cell, ...]
    goals: tuple[Cell, ...]
    _hash: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        rows = tuple(self.rows)
        starts = tuple([(int(r), int(c)) for r, c in self.starts])
        goals = tuple([(int(r), int(c)) for r, c in self.goals])
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "starts", starts)
        object.__setattr__(self, "goals", goals)
        if not rows or not rows[0]:
            raise InstanceError("rows: the grid is empty; give at least one row of 'F'/'H' cells")
        width = len(rows[0])
        if len(rows) > MAX_SIDE or width > MAX_SIDE:
            raise InstanceError(f"rows: grid {len(rows)}x{width} is larger than {MAX_SIDE}x{MAX_SIDE}")
        well_formed = (all([len(row) == width for row in rows])
                       and not "".join(rows).replace(FREE, "").replace(HOLE, ""))
        for i, row in enumerate(() if well_formed else rows):  # the slow look only to say what is wrong
            if len(row) != width:
                raise InstanceError(f"rows[{i}]: has {len(row)} cells, row 0 has {width}; all rows must be equally long")
            bad = set(row) - {FREE, HOLE}
            if bad:
                raise InstanceError(f"rows[{i}]: unknown cell symbol(s) {sorted(bad)}; use 'F' (frozen) or 'H' (hole)")
        if len(starts) != len(goals):
            raise InstanceError(f"starts/goals: {len(starts)} starts but {len(goals)} goals; give one of each per agent")
        if not starts:
            raise InstanceError("starts: no agents; give at least one start and goal")
        for name, cells in (("starts", starts), ("goals", goals)):
            for i, (r, c) in enumerate(cells):
                if not (0 <= r < len(rows) and 0 <= c < width):
                    raise InstanceError(f"{name}[{i}] = ({r}, {c}) is outside the {len(rows)}x{width} grid")
                if rows[r][c] != FREE:
                    raise InstanceError(f"{name}[{i}] = ({r}, {c}) is a hole; agents start and end on frozen cells")
            if len(set(cells)) != len(cells):
                raise InstanceError(f"{name}: two agents share a cell ({list(cells)}); each agent needs its own")

    # ----------------------------------------------------------------- shape
    @property
    def height(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        return len(self.rows[0])

    @property
    def num_agents(self) -> int:
        return len(self.starts)

    def is_free(self, cell: Cell) -> bool:
        r, c = cell
        return 0 <= r < self.height and 0 <= c < self.width and self.rows[r][c] == FREE

    @property
    def holes(self) -> tuple[Cell, ...]:
        return tuple((r, c) for r, row in enumerate(self.rows) for c, ch in enumerate(row) if ch == HOLE)

    @property
    def hole_count(self) -> int:
        return sum(row.count(HOLE) for row in self.rows)

    # ------------------------------------------------------------ text form
    def to_str(self) -> str:
        """The canonical text form (see the module docstring); ``from_str(to_str(x)) == x``."""
        lines = [HEADER, f"grid {self.height}x{self.width}", *self.rows]
        for i, ((sr, sc), (gr, gc)) in enumerate(zip(self.starts, self.goals), start=1):
            lines.append(f"agent {i}: {sr},{sc} -> {gr},{gc}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_str(cls, text: str) -> Instance:
        """Parse the text form. Errors name the line number and say what was expected."""
        lines = []
        for n, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if line:
                lines.append((n, line))
        if not lines or lines[0][1] != HEADER:
            got = lines[0][1] if lines else "nothing"
            raise InstanceError(f"line {lines[0][0] if lines else 1}: expected '{HEADER}', got {got!r}")
        if len(lines) < 2 or not lines[1][1].startswith("grid "):
            raise InstanceError(f"line {lines[1][0] if len(lines) > 1 else 2}: expected 'grid HxW'")
        n, spec = lines[1]
        try:
            h, w = (int(v) for v in spec[5:].lower().split("x"))
        except ValueError:
            raise InstanceError(f"line {n}: expected 'grid HxW' with two integers, got {spec!r}") from None
        if not (1 <= h <= MAX_SIDE and 1 <= w <= MAX_SIDE):
            raise InstanceError(f"line {n}: grid {h}x{w} out of range 1..{MAX_SIDE}")
        grid_lines = lines[2 : 2 + h]
        if len(grid_lines) < h:
            raise InstanceError(f"line {lines[-1][0]}: the grid has {len(grid_lines)} rows, the header says {h}")
        for n, row in grid_lines:
            if len(row) != w or set(row) - {FREE, HOLE}:
                raise InstanceError(f"line {n}: expected {w} cells of 'F'/'H', got {row!r}")
        starts, goals = [], []
        for n, line in lines[2 + h :]:
            head, sep, rest = line.partition(":")
            parts = head.split()
            if not sep or len(parts) != 2 or parts[0] != "agent" or parts[1] != str(len(starts) + 1):
                raise InstanceError(f"line {n}: expected 'agent {len(starts) + 1}: r,c -> r,c', got {line!r}")
            try:
                s, g = (tuple(int(v) for v in side.split(",")) for side in rest.split("->"))
                if len(s) != 2 or len(g) != 2:
                    raise ValueError
            except ValueError:
                raise InstanceError(f"line {n}: expected 'agent {len(starts) + 1}: r,c -> r,c', got {line!r}") from None
            starts.append(s)
            goals.append(g)
        try:
            return cls(tuple(r for _, r in grid_lines), tuple(starts), tuple(goals))
        except InstanceError as e:
            raise InstanceError(f"in instance text: {e}") from None

    @property
    def content_hash(self) -> str:
        """Hex SHA-256 of the canonical text: equal for equal content, whatever the origin."""
        if not self._hash:
            object.__setattr__(self, "_hash", hashlib.sha256(self.to_str().encode()).hexdigest())
        return self._hash

    def with_agents(self, k: int) -> Instance:
        """The same grid with only the first ``k`` agents (MovingAI convention for scenario prefixes)."""
        if not 1 <= k <= self.num_agents:
            raise InstanceError(f"agents: asked for {k}, the instance has 1..{self.num_agents}")
        return Instance(self.rows, self.starts[:k], self.goals[:k])


__all__ = ["Cell", "Instance", "InstanceError", "FREE", "HOLE"]
