import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from envgen.gym_env import ENV_ID, MAPFFrozenLakeEnv, register_envs
from envgen.core.instance import Instance
from envgen.core.render import render_ascii, render_coords, render_png

CORRIDOR = Instance(("FFF", "HFH", "FFF"), ((0, 0), (0, 2)), ((0, 2), (0, 0)))


def test_passes_gymnasium_env_checker():
    register_envs()
    register_envs()  # idempotent
    env = gym.make(ENV_ID, size=5, num_agents=2)
    check_env(env.unwrapped)


def test_seeded_reset_is_reproducible():
    env = MAPFFrozenLakeEnv(size=6, num_agents=3)
    a, _ = env.reset(seed=11)
    b, _ = env.reset(seed=11)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert env.optimal_soc is not None


def test_given_instance_success_and_failures():
    env = MAPFFrozenLakeEnv(size=3, num_agents=2)
    obs, info = env.reset(options={"instance": CORRIDOR.to_str()})
    assert obs["positions"].tolist() == [[0, 0], [0, 2]] and obs["holes"][1].tolist() == [1, 0, 1]
    UP, DOWN, LEFT, RIGHT, WAIT = range(5)
    # Agent 2 ducks into the pocket while agent 1 waits, then both pass.
    steps = [(WAIT, LEFT), (RIGHT, DOWN), (RIGHT, UP), (WAIT, LEFT)]
    for i, action in enumerate(steps):
        obs, reward, terminated, truncated, info = env.step(action)
        assert info["failure"] is None
    assert terminated and reward == 1.0 and info["soc"] == 7
    env.reset(options={"instance": CORRIDOR})
    *_, terminated, _, info = env.step((RIGHT, LEFT))
    assert terminated and info["failure"] == "vertex_conflict"
    env.reset(options={"instance": CORRIDOR})
    *_, info = env.step((UP, WAIT))
    assert info["failure"] == "off_grid"
    env.reset(options={"instance": CORRIDOR})
    *_, info = env.step((DOWN, WAIT))
    assert info["failure"] == "hole"
    swap = Instance(("FF", "FF"), ((0, 0), (0, 1)), ((0, 1), (0, 0)))
    env2 = MAPFFrozenLakeEnv(size=2, num_agents=2)
    env2.reset(options={"instance": swap})
    *_, info = env2.step((RIGHT, LEFT))
    assert info["failure"] == "edge_conflict"
    with pytest.raises(ValueError, match="make the env with matching"):
        env2.reset(options={"instance": CORRIDOR})
    with pytest.raises(ValueError, match="expected 2 integers"):
        env2.step((9, 0))


def test_truncation_after_max_steps():
    env = MAPFFrozenLakeEnv(size=3, num_agents=2, max_steps=2)
    env.reset(options={"instance": CORRIDOR})
    env.step((4, 4))
    *_, terminated, truncated, _ = env.step((4, 4))
    assert truncated and not terminated


def test_text_views():
    text = render_ascii(CORRIDOR)
    assert text.splitlines()[:4] == ["  0 1 2", "0 A . B", "1 H . H", "2 . . ."]
    assert "agent 2 starts at B (0,2) and must reach b (0,0)" in text
    coords = render_coords(CORRIDOR)
    assert "Holes: (1,0) (1,2)" in coords and "Agent 1: start (0,0), goal (0,2)" in coords
    wide = Instance(tuple("F" * 12 for _ in range(12)), ((0, 11),), ((11, 0),))
    lines = render_ascii(wide, legend=False).splitlines()
    assert lines[0].split() == [str(c) for c in range(12)] and len(lines) == 13


def test_png_images(tmp_path):
    path = tmp_path / "p.png"
    data = render_png(CORRIDOR, path, paths=[[(0, 0), (0, 1)], [(0, 2), (1, 1)]], title="t")
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and path.read_bytes() == data
    env = MAPFFrozenLakeEnv(size=3, num_agents=2, render_mode="rgb_array")
    env.reset(options={"instance": CORRIDOR})
    frame = env.render()
    assert frame.ndim == 3 and frame.shape[2] == 3
