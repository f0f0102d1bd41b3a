import random

import pytest

from envgen.core import grid as grid_module
from envgen.core.grid import DELTAS, MOVES, grid_from_free, grid_of


@pytest.mark.parametrize("lookup_cells", [4096, 0], ids=["lookup", "loop"])
def test_neighbour_tables_match_their_definition_on_random_grids(lookup_cells, monkeypatch):
    """grid_from_free (by the byte-per-cell lookup, and by the loop large maps take) gives, for every free cell, its
    free 4-neighbours in MOVES order (options: the cell itself first), () and (i,) on a hole, on shapes from 1x1 to
    12x12, rectangles included."""
    monkeypatch.setattr(grid_module, "LOOKUP_CELLS", lookup_cells)
    rng = random.Random(3)
    for _ in range(600):
        h, w = rng.randint(1, 12), rng.randint(1, 12)
        p = rng.random()
        free = tuple(rng.random() > p for _ in range(h * w))
        grid = grid_from_free(h, w, free)
        for i in range(h * w):
            r, c = divmod(i, w)
            want = tuple((r + dr) * w + c + dc for m in MOVES[:4] for dr, dc in [DELTAS[m]]
                         if 0 <= r + dr < h and 0 <= c + dc < w and free[(r + dr) * w + c + dc]) if free[i] else ()
            assert grid.neighbors[i] == want, (h, w, i)
            assert grid.options[i] == (i, *want)
            for m, move in enumerate(MOVES):
                dr, dc = DELTAS[move]
                inside = 0 <= r + dr < h and 0 <= c + dc < w
                assert grid.step[m][i] == ((r + dr) * w + c + dc if inside else -1)


def test_grid_of_reads_the_rows():
    grid = grid_of(("FH", "FF"))
    assert grid.free == (True, False, True, True)
    assert grid.neighbors == ((2,), (), (0, 3), (2,))
