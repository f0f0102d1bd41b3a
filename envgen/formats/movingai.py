"""Read standard MAPF benchmarks in the MovingAI format (Sturtevant 2012; Stern et al. 2019).

``.map``: a header ``type octile`` / ``height H`` / ``width W`` / ``map`` followed by H rows of W symbols. Passable:
``.`` ``G`` ``S``; blocked: ``@`` ``O`` ``T`` ``W`` (water is blocked here, as in MAPF benchmarks' 4-connected use).
``.scen``: ``version 1`` then one tab-separated line per agent: bucket, map file, width, height, start x, start y,
goal x, goal y, optimal octile distance. **x is the column and y the row.** An instance with K agents is the first K
lines of a scenario.

Errors are :class:`MovingAIError`, which names the file and the line.
"""

from __future__ import annotations

import re
from pathlib import Path

from envgen.core.instance import FREE, HOLE, MAX_SIDE, Instance, InstanceError

PASSABLE = frozenset(".GS")
BLOCKED = frozenset("@OTW")


class MovingAIError(ValueError):
    """A malformed map or scenario file. ``path`` and ``line`` (1-based, 0 for the whole file) say where."""

    def __init__(self, path: str | Path, line: int, message: str) -> None:
        self.path, self.line = str(path), line
        where = f"{path}:{line}" if line else str(path)
        if len(message) > 300:  # a message quotes the file: never all of a hostile one
            message = message[:297] + "..."
        super().__init__(f"{where}: {message}")


MAX_FILE_BYTES = 16_000_000
"""Largest map or scenario file read: a 1,024 x 1,024 map (this project's largest side) is about 1 MB."""


def _read(path: str | Path) -> list[str]:
    from envgen.core.files import InputFileError, read_bytes_bounded

    try:
        data = read_bytes_bounded(path, MAX_FILE_BYTES, "MovingAI map or scenario file")
    except InputFileError as e:
        raise MovingAIError(path, 0, str(e).removeprefix(f"{path}: ")) from None
    return data.decode("utf-8", errors="replace").splitlines()


_NUMBER = re.compile(r"[0-9]{1,9}")
"""A whole number in a header: ASCII digits only (``int`` would take other scripts' digits too)."""


def load_map(path: str | Path) -> tuple[str, ...]:
    """The map's rows in this project's alphabet (``F`` free, ``H`` blocked)."""
    lines = _read(path)
    header: dict[str, str] = {}
    n = 0
    while n < len(lines):
        text = lines[n].strip()
        n += 1
        if text == "map":
            break
        if not text:
            continue
        key, _, value = text.partition(" ")
        if key not in ("type", "height", "width"):
            raise MovingAIError(path, n, f"unexpected header line {text[:60]!r}; expected type/height/width/map")
        if key in header:
            raise MovingAIError(path, n, f"a second '{key}' line; the header gives each of type, height and width once")
        header[key] = value.strip()
    else:
        raise MovingAIError(path, n, "no 'map' line: the header must end with a line reading 'map'")
    missing = [k for k in ("height", "width") if k not in header]
    if missing:
        raise MovingAIError(path, 0, f"header lacks '{missing[0]} N'")
    if not all(_NUMBER.fullmatch(header[k]) for k in ("height", "width")):
        raise MovingAIError(path, 0, f"height/width must be whole numbers written in digits 0-9, got "
                                     f"{header['height'][:20]!r}/{header['width'][:20]!r}")
    height, width = int(header["height"]), int(header["width"])
    if not (1 <= height <= MAX_SIDE and 1 <= width <= MAX_SIDE):
        raise MovingAIError(path, 0, f"a {width}x{height} map; this project reads maps of 1..{MAX_SIDE} cells a side")
    rows = []
    for i in range(height):
        if n + i >= len(lines):
            raise MovingAIError(path, n + i + 1, f"the map has {i} rows, the header says height {height}")
        raw = lines[n + i].rstrip("\r\n")
        if len(raw) != width:
            raise MovingAIError(path, n + i + 1, f"row {i} has {len(raw)} symbols, the header says width {width}")
        bad = set(raw) - PASSABLE - BLOCKED
        if bad:
            raise MovingAIError(path, n + i + 1, f"unknown map symbol(s) {sorted(bad)}; passable {sorted(PASSABLE)}, blocked {sorted(BLOCKED)}")
        rows.append("".join(FREE if ch in PASSABLE else HOLE for ch in raw))
    extra = next((k for k in range(n + height, len(lines)) if lines[k].strip()), None)
    if extra is not None:
        raise MovingAIError(path, extra + 1, f"more rows than the header's height {height}; fix the height or remove "
                                             "the rows after the map")
    return tuple(rows)


def load_scen(path: str | Path) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Agents of a scenario as ``((start_row, start_col), (goal_row, goal_col))``, in file order."""
    lines = _read(path)
    agents = []
    for n, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text or (n == 1 and text.startswith("version")):
            continue
        cols = raw.split("\t") if "\t" in raw else raw.split()
        if len(cols) < 8:
            raise MovingAIError(path, n, f"expected 9 tab-separated columns (bucket, map, width, height, sx, sy, gx, gy, dist), got {len(cols)}")
        if not all(_NUMBER.fullmatch(v.strip()) for v in cols[4:8]):
            raise MovingAIError(path, n, f"start/goal coordinates must be whole numbers written in digits 0-9, got "
                                         f"{[c[:20] for c in cols[4:8]]}")
        sx, sy, gx, gy = (int(v) for v in cols[4:8])
        agents.append(((sy, sx), (gy, gx)))
    if not agents:
        raise MovingAIError(path, 0, "the scenario lists no agents")
    return agents


def load_instance(map_path: str | Path, scen_path: str | Path, agents: int) -> Instance:
    """The first ``agents`` agents of a scenario on its map."""
    rows = load_map(map_path)
    scen = load_scen(scen_path)
    if not 1 <= agents <= len(scen):
        raise MovingAIError(scen_path, 0, f"asked for {agents} agents; the scenario has {len(scen)} (use 1..{len(scen)})")
    chosen = scen[:agents]
    height, width = len(rows), len(rows[0])
    lines = [n for n, raw in enumerate(_read(scen_path), start=1) if raw.strip() and not (n == 1 and raw.strip().startswith("version"))]
    for i, (s, g) in enumerate(chosen):
        for what, (r, c) in (("start", s), ("goal", g)):
            if not (0 <= r < height and 0 <= c < width):
                raise MovingAIError(scen_path, lines[i], f"agent {i + 1} {what} (x={c}, y={r}) is outside the {width}x{height} map")
            if rows[r][c] != FREE:
                raise MovingAIError(scen_path, lines[i], f"agent {i + 1} {what} (x={c}, y={r}) is on a blocked cell of {map_path}")
    try:
        return Instance(rows, tuple(s for s, _ in chosen), tuple(g for _, g in chosen))
    except InstanceError as e:
        raise MovingAIError(scen_path, 0, str(e)) from None
