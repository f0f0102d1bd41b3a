"""Helpers shared by the tests."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from envgen.solver.cbs import Solved, SolverBudget, solve
from envgen.core.config import SizeConfig
from envgen.generator import draw_instance
from envgen.core.instance import Instance

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


ROOT = Path(__file__).resolve().parents[1]


def tiny_params(model: Path) -> dict:
    """The CPU preset shrunk to seconds: a tiny model, 2 board sizes, a few instances and steps."""
    import yaml

    params = yaml.safe_load((ROOT / "presets" / "cpu.yaml").read_text())
    sizes = {3: {"data_ratio": 0.5, "hole_ratio": 0.2, "wait_ratio": 0.5, "min_path_length": 1},
             4: {"data_ratio": 0.5, "hole_ratio": 0.2, "wait_ratio": 0.5, "min_path_length": 1}}
    params["env"].update(budget=8, sizes=sizes)
    params["validation"].update(budget=4, sizes=sizes)
    params["policy"].update(model=str(model))
    params["train"].update(recipe="distill+grpo", sft_max_examples=8, sft_batch_size=4, trajectories=8, num_generations=4, prompts_per_step=2,
                           micro_batch_size=4, max_completion_length=16, lora_r=4, lora_alpha=8, threads=1)
    params["rollout"].update(max_new_tokens="auto", budget_margin=0.0, threads=1)  # each answer its optimal length + 8
    params["engineer"].update(engineer="policy", max_new_tokens=400, threads=1, attempts=1)  # the paper's engineer: the policy itself
    params["benchmark"].update(per_cell=1, wait_ratios=[0.5], agents={3: [3, 4], 4: [4]})
    params["evaluate"].update(max_new_tokens="auto")
    # the starting policy: a few demonstrations of two and three agents, a warm start of a few steps on the tiny model
    params["start"].update(model=str(model))
    params["start"]["instances"][0].update(budget=6, sizes=sizes)
    params["start"]["instances"][1].update(budget=4, sizes={4: sizes[4]})
    params["start"]["train"].update(lora_r=4, lora_alpha=8, sft_batch_size=4, sft_micro_batch_size=2, threads=1)
    return params


def write_params(path: Path, params: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def train_settings(**keys):
    """:class:`pipeline.train_settings.TrainSettings` from flat keys, the speed settings (``AccelSettings``) put under
    ``accel`` as params.yaml nests them."""
    from pipeline.train_settings import AccelSettings, TrainSettings

    accel = {**keys.pop("accel", {}), **{k: keys.pop(k) for k in list(keys) if k in AccelSettings.model_fields}}
    return TrainSettings(**keys, accel=accel)


def free_port() -> int:
    """A port nothing listens on now at 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
