import pytest

from envgen.core.instance import Instance
from envgen.llm.reward import MAPFReward, RewardConfig, progress, score_completion
from envgen.core.simulate import check_plan

# Corridor swap with a pocket: optimum 7 (see test_solver).
INST = Instance(("FFF", "HFH"), ((0, 0), (0, 2)), ((0, 2), (0, 0)))
OPTIMAL = "Agent 1: WAIT RIGHT RIGHT\nAgent 2: LEFT DOWN UP LEFT"
LONGER = "Agent 1: WAIT WAIT RIGHT RIGHT\nAgent 2: LEFT DOWN WAIT UP LEFT"
INVALID = "Agent 1: RIGHT RIGHT\nAgent 2: LEFT LEFT"


def test_reward_levels():
    assert score_completion(INST, OPTIMAL, 7).reward == 1.0
    longer = score_completion(INST, LONGER, 7)
    assert longer.valid and not longer.optimal and longer.soc == 9 and longer.reward == pytest.approx(0.5 * 7 / 9)
    assert score_completion(INST, LONGER, 7, RewardConfig(scale_valid=False)).reward == 0.5
    bad = score_completion(INST, INVALID, 7)
    assert (bad.parsed, bad.valid, bad.failure, bad.failure_agent, bad.failure_step, bad.reward) == (True, False, "vertex_conflict", 1, 1, 0.1)
    junk = score_completion(INST, "no idea", 7)
    assert (junk.parsed, junk.parse_error, junk.reward) == (False, "no_agent_lines", 0.0)


def test_progress_shaping_grades_invalid_plans():
    cfg = RewardConfig(invalid=0.1, progress=0.2)
    # Agent 1 moves one step of two, then both collide at step 2: progress (1/2 + 1/2) / 2 for agents 1 and 2.
    text = "Agent 1: RIGHT RIGHT\nAgent 2: WAIT LEFT"
    words = [["RIGHT", "RIGHT"], ["WAIT", "LEFT"]]
    failure = check_plan(INST, words)
    assert failure.step == 2
    assert progress(INST, words, failure) == pytest.approx(0.25)
    assert score_completion(INST, text, 7, cfg).reward == pytest.approx(0.1 + 0.2 * 0.25)
    assert score_completion(INST, text, 7).reward == 0.1


def test_reward_config_must_be_monotone():
    with pytest.raises(ValueError, match="never earn more"):
        RewardConfig(valid=1.5)
    with pytest.raises(ValueError):
        RewardConfig(invalid=0.4, progress=0.2, valid=0.5)


def test_trl_reward_function_signature_and_conversational_completions():
    fn = MAPFReward()
    text = INST.to_str()
    completions = [[{"role": "assistant", "content": OPTIMAL}], [{"role": "assistant", "content": "??"}], LONGER]
    rewards = fn(prompts=["p"] * 3, completions=completions, instance=[text] * 3, optimal_soc=[7] * 3, extra_column=[1, 2, 3])
    assert rewards == [1.0, 0.0, pytest.approx(0.5 * 7 / 9)]
    assert fn.__name__ == "mapf_reward"
    with pytest.raises(ValueError, match="instance"):
        fn(prompts=["p"], completions=["x"])
