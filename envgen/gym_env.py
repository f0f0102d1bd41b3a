"""Gymnasium environment ``MAPFFrozenLake-v0``: all agents act at once, one joint action per step.

Call :func:`register_envs` once, then ``gymnasium.make("MAPFFrozenLake-v0", size=5, num_agents=2)``.

Action Space
    ``MultiDiscrete([5] * num_agents)``: per agent 0 UP, 1 DOWN, 2 LEFT, 3 RIGHT, 4 WAIT (the order of
    :class:`envgen.core.grid.Move`).

Observation Space
    ``Dict``: ``holes`` (``MultiBinary((size, size))``, 1 for a hole), ``positions`` and ``goals``
    (``Box(0, size - 1, (num_agents, 2), int64)``, each row ``(row, col)``).

Rewards
    1.0 on the step where every agent stands on its goal; 0 otherwise (as in FrozenLake). ``info`` reports the
    running sum of costs and, for generated instances, the optimal one.

Episode End
    Terminated when every agent is on its goal, or when a joint action is invalid: an agent leaves the grid or
    enters a hole, or two agents collide (vertex) or swap cells (edge); ``info["failure"]`` then names the category
    as in :class:`envgen.core.simulate.FailureCategory`. Truncated after ``max_steps`` steps.

Instances come from the generator (``config`` or the defaults; seeded by ``reset(seed=...)``) or are given as
``reset(options={"instance": Instance | str})`` with the env's size and agent count.
"""

from __future__ import annotations

import io
import random
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from PIL import Image

from envgen.solver.cbs import Solved, SolverBudget, solve
from envgen.core.config import SizeConfig
from envgen.generator import draw_instance
from envgen.core.grid import MOVES, grid_of
from envgen.core.instance import HOLE, Instance
from envgen.core.render import ascii_grid, render_png
from envgen.core.simulate import FailureCategory

ENV_ID = "MAPFFrozenLake-v0"


class MAPFFrozenLakeEnv(gym.Env):
    """Multi-agent path finding on a FrozenLake grid (see the module docstring)."""

    metadata = {"render_modes": ["ansi", "rgb_array"], "render_fps": 4}

    def __init__(self, size: int = 4, num_agents: int = 2, knobs: SizeConfig | None = None, max_steps: int | None = None,
                 render_mode: str | None = None) -> None:
        if not 2 <= size <= 64:
            raise ValueError(f"size = {size}: must be in 2..64")
        if not 1 <= num_agents <= 26:
            raise ValueError(f"num_agents = {num_agents}: must be in 1..26")
        if render_mode not in (None, *self.metadata["render_modes"]):
            raise ValueError(f"render_mode = {render_mode!r}: use one of {self.metadata['render_modes']} or None")
        self.size, self.num_agents = size, num_agents
        self.knobs = knobs or SizeConfig(data_ratio=1.0, hole_ratio=0.2, wait_ratio=0.5)
        self.max_steps = max_steps or 4 * size * size
        self.render_mode = render_mode
        self.action_space = spaces.MultiDiscrete([len(MOVES)] * num_agents)
        self.observation_space = spaces.Dict({
            "holes": spaces.MultiBinary((size, size)),
            "positions": spaces.Box(0, size - 1, (num_agents, 2), np.int64),
            "goals": spaces.Box(0, size - 1, (num_agents, 2), np.int64),
        })
        self.instance: Instance | None = None
        self.optimal_soc: int | None = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        given = (options or {}).get("instance")
        if given is not None:
            inst = Instance.from_str(given) if isinstance(given, str) else given
            if (inst.height, inst.width, inst.num_agents) != (self.size, self.size, self.num_agents):
                raise ValueError(f"options['instance'] is {inst.height}x{inst.width} with {inst.num_agents} agents; this env is "
                                 f"{self.size}x{self.size} with {self.num_agents}: make the env with matching size/num_agents")
            self.instance, self.optimal_soc = inst, None
        else:
            self.instance, self.optimal_soc = self._draw()
        self._holes = np.array([[ch == HOLE for ch in row] for row in self.instance.rows], dtype=np.int8)
        self._pos = [tuple(c) for c in self.instance.starts]
        self._arrived = [0 if p == g else None for p, g in zip(self._pos, self.instance.goals)]
        self._t = 0
        return self._obs(), self._info(None)

    def _draw(self) -> tuple[Instance, int]:
        rng = random.Random(int(self.np_random.integers(2**63)))
        for _ in range(1000):
            inst = draw_instance(rng, self.size, self.knobs, self.num_agents)
            if inst is None:
                continue
            result = solve(inst, SolverBudget(max_nodes=2000, max_seconds=5.0))
            if isinstance(result, Solved):
                return inst, result.soc
        raise RuntimeError(f"no solvable {self.size}x{self.size} instance in 1000 draws with {self.knobs}; lower hole_ratio")

    def step(self, action):
        action = np.asarray(action)
        if action.shape != (self.num_agents,) or not self.action_space.contains(action.astype(np.int64)):
            raise ValueError(f"action {action!r}: expected {self.num_agents} integers in 0..{len(MOVES) - 1}")
        grid = grid_of(self.instance.rows)
        prev = self._pos
        nxt = []
        failure = None
        for a, m in enumerate(action):
            idx = grid.step[int(m)][grid.index(prev[a])]
            if idx < 0:
                failure = failure or FailureCategory.OFF_GRID
                nxt.append(prev[a])
                continue
            cell = grid.cell(idx)
            if not grid.free[idx]:
                failure = failure or FailureCategory.HOLE
            nxt.append(cell)
        if failure is None:
            if len(set(nxt)) < len(nxt):
                failure = FailureCategory.VERTEX_CONFLICT
            elif any(nxt[a] == prev[b] and nxt[b] == prev[a] and nxt[a] != prev[a]
                     for a in range(self.num_agents) for b in range(a + 1, self.num_agents)):
                failure = FailureCategory.EDGE_CONFLICT
        self._t += 1
        self._pos = nxt
        for a, (p, g) in enumerate(zip(nxt, self.instance.goals)):
            if p != g:
                self._arrived[a] = None
            elif self._arrived[a] is None:
                self._arrived[a] = self._t
        done = failure is None and all(x is not None for x in self._arrived)
        terminated = failure is not None or done
        truncated = not terminated and self._t >= self.max_steps
        reward = 1.0 if done else 0.0
        if self.render_mode == "ansi":
            self.render()
        return self._obs(), reward, terminated, truncated, self._info(failure)

    def _obs(self) -> dict[str, np.ndarray]:
        return {
            "holes": self._holes.copy(),
            "positions": np.array(self._pos, dtype=np.int64).reshape(self.num_agents, 2),
            "goals": np.array(self.instance.goals, dtype=np.int64).reshape(self.num_agents, 2),
        }

    def _info(self, failure: FailureCategory | None) -> dict[str, Any]:
        soc = sum(x if x is not None else self._t for x in self._arrived)
        return {"t": self._t, "soc": soc, "optimal_soc": self.optimal_soc, "failure": failure.value if failure else None,
                "instance_hash": self.instance.content_hash}

    def render(self):
        if self.render_mode == "ansi":
            return ascii_grid(self.instance, positions=self._pos)
        if self.render_mode == "rgb_array":
            png = render_png(self.instance, positions=self._pos)
            return np.array(Image.open(io.BytesIO(png)).convert("RGB"))
        return None


def register_envs() -> None:
    """Register ``MAPFFrozenLake-v0`` with Gymnasium (idempotent)."""
    if ENV_ID not in gym.registry:
        gym.register(id=ENV_ID, entry_point="envgen.gym_env:MAPFFrozenLakeEnv")
