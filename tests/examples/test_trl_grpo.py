"""examples/trl_grpo.py runs as written: GRPO through TRL on MAPF-FrozenLake, an engineer between stages."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_trl_example_trains_two_stages_and_lets_the_engineer_write_the_second(tiny_model_dir, tmp_path):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import trl_grpo
    finally:
        sys.path.remove(str(ROOT / "examples"))
    history = trl_grpo.run(str(tiny_model_dir), stages=2, budget=8, out=str(tmp_path / "out"))
    first, second = history[0]["config"], history[1]["config"]
    assert len(history) == 2 and all(h["rationale"].startswith("learnability:") for h in history)
    assert second.seed == first.seed + 1  # the engineer's configuration: new draws, the same budget and agents
    assert (second.budget, second.num_agents, set(second.sizes)) == (first.budget, first.num_agents, set(first.sizes))
    assert all(0.0 <= h["mean_reward"] <= 1.0 for h in history)
