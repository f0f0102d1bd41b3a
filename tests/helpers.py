"""Helpers shared by the tests."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from envgen.cbs import Solved, SolverBudget, solve
from envgen.config import SizeConfig
from envgen.generator import draw_instance
from envgen.instance import Instance

BENCH = Path(__file__).resolve().parent / "data"
"""Copies of the small MovingAI benchmark files the tests use (see data/SOURCES.md for their origin)."""


def bench_path(*parts: str) -> Path:
    path = BENCH.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"benchmark file {path} not present")
    return path


def random_solved(seed: int, size: int, hole_ratio: float, agents: int, head_on: bool = False) -> tuple[Instance, Solved] | None:
    """A random instance and its optimal solution, or None when the draw is unsolvable."""
    rng = random.Random(seed)
    inst = draw_instance(rng, size, SizeConfig(data_ratio=1.0, hole_ratio=hole_ratio), agents, head_on)
    if inst is None:
        return None
    result = solve(inst, SolverBudget(max_nodes=5000, max_seconds=20))
    return (inst, result) if isinstance(result, Solved) else None
