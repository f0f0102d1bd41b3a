"""Renderers: the text views a prompt uses and PNG images for reports.

- :func:`render_ascii`: the grid with row/column numbers, ``.`` frozen, ``H`` hole, ``A``/``B``/... agent starts,
  ``a``/``b``/... their goals (a start drawn over another agent's goal), and a legend.
- :func:`render_coords`: the same information as a coordinate list (no grid picture).
- :func:`render_png`: an image of the instance, optionally with a plan's paths drawn over it.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

from PIL import Image, ImageDraw

from envgen.core.files import atomic_write_bytes
from envgen.core.instance import HOLE, Cell, Instance

MAX_LETTERS = 26
COLORS = [(228, 26, 28), (55, 126, 184), (77, 175, 74), (152, 78, 163), (255, 127, 0), (166, 86, 40), (247, 129, 191),
          (100, 100, 100)]


def agent_letter(agent: int) -> str:
    """'A' for agent 0 (shown to models as agent 1), 'B' for agent 1, ..."""
    if not 0 <= agent < MAX_LETTERS:
        raise ValueError(f"agent index {agent}: text views label at most {MAX_LETTERS} agents")
    return chr(ord("A") + agent)


def ascii_grid(instance: Instance, numbers: bool = True, positions: Sequence[Cell] | None = None) -> str:
    """The grid picture alone (see the module docstring for the symbols); agents drawn at ``positions`` (default:
    their starts)."""
    if instance.num_agents > MAX_LETTERS:
        raise ValueError(f"instance has {instance.num_agents} agents; text views label at most {MAX_LETTERS}")
    cells = [["H" if ch == HOLE else "." for ch in row] for row in instance.rows]
    for a, (r, c) in enumerate(instance.goals):
        cells[r][c] = agent_letter(a).lower()
    for a, (r, c) in enumerate(instance.starts if positions is None else positions):
        cells[r][c] = agent_letter(a)
    if not numbers:
        return "\n".join(" ".join(row) for row in cells)
    w = len(str(instance.width - 1))
    pad = len(str(instance.height - 1))
    head = " " * (pad + 1) + " ".join(f"{c:>{w}}" for c in range(instance.width))
    body = [f"{r:>{pad}} " + " ".join(f"{x:>{w}}" for x in row) for r, row in enumerate(cells)]
    return "\n".join([head, *body])


def render_ascii(instance: Instance, legend: bool = True) -> str:
    """Grid picture plus a legend that lists every agent's start and goal (so overlaps stay unambiguous).

    >>> from envgen.core.instance import Instance
    >>> print(render_ascii(Instance(("FH", "FF"), ((0, 0),), ((1, 1),))))
      0 1
    0 A H
    1 . a
    Legend: '.' frozen, 'H' hole; agent 1 starts at A (0,0) and must reach a (1,1).
    """
    text = ascii_grid(instance)
    if not legend:
        return text
    agents = "; ".join(
        f"agent {a + 1} starts at {agent_letter(a)} {_cell(s)} and must reach {agent_letter(a).lower()} {_cell(g)}"
        for a, (s, g) in enumerate(zip(instance.starts, instance.goals))
    )
    return f"{text}\nLegend: '.' frozen, 'H' hole; {agents}."


def render_coords(instance: Instance) -> str:
    """A coordinate-list view: shape, holes, and each agent's start and goal as (row,col).

    >>> from envgen.core.instance import Instance
    >>> print(render_coords(Instance(("FH", "FF"), ((0, 0),), ((1, 1),))))
    Grid 2x2, cells (row,col) from (0,0) at the top left.
    Holes: (0,1)
    Agent 1: start (0,0), goal (1,1)
    """
    holes = " ".join(_cell(c) for c in instance.holes) or "none"
    lines = [f"Grid {instance.height}x{instance.width}, cells (row,col) from (0,0) at the top left.", f"Holes: {holes}"]
    lines += [f"Agent {a + 1}: start {_cell(s)}, goal {_cell(g)}" for a, (s, g) in enumerate(zip(instance.starts, instance.goals))]
    return "\n".join(lines)


def _cell(cell: Cell) -> str:
    return f"({cell[0]},{cell[1]})"


MAX_PNG_SIDE = 4096
"""Widest and tallest board drawn in a PNG, in pixels (50 MB of pixels at most; a title adds a line): cells shrink to
fit a large board (a 1,024 x 1,024 board at 48 pixels a cell would take 7 GB)."""


def render_png(instance: Instance, path: str | Path | None = None, paths: Sequence[Sequence[Cell]] | None = None,
               cell_px: int = 48, title: str | None = None, positions: Sequence[Cell] | None = None) -> bytes:
    """A PNG of the instance (ice, holes, numbered starts as discs, goals as squares), with ``paths`` (per agent
    cells from time 0, e.g. a solver's or a model's plan) drawn as coloured lines. Returns the PNG bytes and writes
    them atomically to ``path`` when given. Agents are drawn at ``positions`` (default: their starts). Cells are
    ``cell_px`` pixels, fewer where the board would be wider or taller than :data:`MAX_PNG_SIDE`."""
    cell_px = max(1, min(cell_px, MAX_PNG_SIDE // max(instance.width, instance.height)))
    top = 22 if title else 0
    w, h = instance.width * cell_px, instance.height * cell_px + top
    if title:  # the image is widened to the title's width, so a small board's title is never cut off
        w = max(w, int(ImageDraw.Draw(Image.new("RGB", (1, 1))).textlength(title)) + 8)
    img = Image.new("RGB", (w + 1, h + 1), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    if title:
        draw.text((4, 4), title, fill=(0, 0, 0))
    for r, row in enumerate(instance.rows):
        for c, ch in enumerate(row):
            x0, y0 = c * cell_px, r * cell_px + top
            fill = (30, 45, 90) if ch == HOLE else (214, 236, 250)
            draw.rectangle([x0, y0, x0 + cell_px, y0 + cell_px], fill=fill, outline=(160, 180, 200))
    color = [COLORS[a % len(COLORS)] for a in range(instance.num_agents)]

    def center(cell: Cell, a: int = 0) -> tuple[float, float]:
        off = (a - (instance.num_agents - 1) / 2) * cell_px * 0.06
        return cell[1] * cell_px + cell_px / 2 + off, cell[0] * cell_px + top + cell_px / 2 + off

    for a, (r, c) in enumerate(instance.goals):
        m = cell_px * 0.18
        x0, y0 = c * cell_px, r * cell_px + top
        draw.rectangle([x0 + m, y0 + m, x0 + cell_px - m, y0 + cell_px - m], outline=color[a], width=3)
    for a, cells in enumerate(paths or []):
        pts = [center(tuple(cell), a) for cell in cells]
        if len(pts) > 1:
            draw.line(pts, fill=color[a], width=max(2, cell_px // 12), joint="curve")
    for a, s in enumerate(instance.starts if positions is None else positions):
        x, y = center(s)
        rad = cell_px * 0.28
        draw.ellipse([x - rad, y - rad, x + rad, y + rad], fill=color[a], outline=(0, 0, 0))
        draw.text((x - 3, y - 6), str(a + 1), fill=(255, 255, 255))
    buf = _png_bytes(img)
    if path is not None:
        atomic_write_bytes(path, buf)
    return buf


def _png_bytes(img) -> bytes:
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()
