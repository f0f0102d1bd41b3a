"""Scoring a model's answer, and the reward function GRPO trains on.

:func:`score_completion` parses an answer (:mod:`envgen.llm.parse`) and checks the plan (:mod:`envgen.core.simulate`).
The reward (:class:`RewardConfig`, every value configurable):

- optimal plan: ``optimal`` (1.0);
- valid but longer than the optimum: ``valid`` (0.5), times ``optimal_soc / soc`` when ``scale_valid``;
- readable but invalid: ``invalid`` (0.1), plus ``progress`` times the agents' mean progress toward their goals
  before the first failure (0 by default; a graded signal for models that rarely produce valid plans);
- unreadable: ``unparseable`` (0.0).

:class:`MAPFReward` is a TRL-compatible reward function: ``(prompts, completions, **columns) -> list[float]``, reading
the dataset columns ``instance`` (text form) and ``optimal_soc``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from envgen.core.grid import MOVES, grid_of
from envgen.core.instance import Instance
from envgen.llm.parse import ParsedPlan, parse_answer
from envgen.core.simulate import Failure, Valid, check_plan


@dataclass(frozen=True)
class RewardConfig:
    """Reward values (see the module docstring)."""

    optimal: float = 1.0
    valid: float = 0.5
    scale_valid: bool = True
    invalid: float = 0.1
    progress: float = 0.0
    unparseable: float = 0.0

    def __post_init__(self) -> None:
        if not self.optimal >= self.valid >= self.invalid + self.progress >= self.unparseable - 1e-12:
            raise ValueError("RewardConfig: need optimal >= valid >= invalid + progress >= unparseable, got "
                             f"{self.optimal}, {self.valid}, {self.invalid} + {self.progress}, {self.unparseable}; "
                             "a worse answer must never earn more")


@dataclass(frozen=True)
class Score:
    """Everything known about one answer."""

    reward: float
    parsed: bool
    parse_error: str | None = None
    valid: bool = False
    optimal: bool = False
    failure: str | None = None
    failure_agent: int | None = None
    failure_step: int | None = None
    soc: int | None = None
    makespan: int | None = None
    plan: list[str] | None = field(default=None)


@lru_cache(maxsize=8192)
def instance_from_text(text: str) -> Instance:
    """Parsed instances, cached (a GRPO group scores G answers to one instance)."""
    return Instance.from_str(text)


def score_completion(instance: Instance, text: object, optimal_soc: int | None, config: RewardConfig = RewardConfig()) -> Score:
    """Parse, check and reward one answer. Never raises on any ``text``."""
    parsed = parse_answer(text, instance.num_agents)
    if not isinstance(parsed, ParsedPlan):
        return Score(config.unparseable, False, parsed.reason.value)
    words = parsed.words()
    plan = [" ".join(w) for w in words]
    result = check_plan(instance, words, optimal_soc)
    if isinstance(result, Valid):
        if result.optimal:
            reward = config.optimal
        else:
            ratio = (optimal_soc / result.soc) if (config.scale_valid and optimal_soc and result.soc) else 1.0
            reward = config.valid * min(1.0, ratio)
        return Score(reward, True, None, True, bool(result.optimal), None, None, None, result.soc, result.makespan, plan)
    reward = config.invalid + (config.progress * progress(instance, words, result) if config.progress else 0.0)
    agent = None if result.agent is None else result.agent + 1
    return Score(reward, True, None, False, False, result.category.value, agent, result.step, None, None, plan)


def progress(instance: Instance, words: list[list[str]], failure: Failure) -> float:
    """Mean over agents of how much closer to its goal each got before the first failure (0..1)."""
    if failure.agent is None:
        return 0.0
    grid = grid_of(instance.rows)
    index = {m.value: i for i, m in enumerate(MOVES)}
    steps = max(0, failure.step - 1)
    total = 0.0
    for a, moves in enumerate(words):
        dist = grid.distances_from(grid.index(instance.goals[a]))
        p = grid.index(instance.starts[a])
        d0 = dist[p]
        for word in moves[:steps]:
            q = grid.step[index[word]][p]
            if q < 0 or not grid.free[q]:
                break
            p = q
        if d0 > 0:
            total += max(0.0, (d0 - dist[p]) / d0)
        elif dist[p] == 0:
            total += 1.0  # started on its goal and is still there
    return total / len(words)


def completion_text(completion: object) -> str:
    """The text of a TRL completion: a string, or a conversational list of messages (the last one's content)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return "" if completion is None else str(completion)


class MAPFReward:
    """TRL reward function over the dataset columns ``instance`` and ``optimal_soc``. ``on_score``, when given, is
    called once per call with the :class:`Score` of every completion, their texts and the call's other keyword
    arguments (the other dataset columns, and TRL's ``trainer_state`` and ``log_metric``): how a trainer records
    what it rewarded.

    >>> from envgen.core.instance import Instance
    >>> inst = Instance(("FF", "FF"), ((0, 0),), ((1, 1),)).to_str()
    >>> MAPFReward()(prompts=["p", "p", "p"], completions=["Agent 1: RIGHT DOWN", "Agent 1: UP", "hello"],
    ...              instance=[inst] * 3, optimal_soc=[2] * 3)
    [1.0, 0.1, 0.0]
    """

    __name__ = "mapf_reward"

    def __init__(self, config: RewardConfig = RewardConfig(), on_score=None) -> None:
        self.config = config
        self.on_score = on_score

    def __call__(self, prompts=None, completions=None, instance=None, optimal_soc=None, **columns: object) -> list[float]:
        if completions is None or instance is None:
            raise ValueError("MAPFReward needs completions and the dataset column 'instance' (and 'optimal_soc')")
        socs = optimal_soc if optimal_soc is not None else [None] * len(completions)
        texts = [completion_text(c) for c in completions]
        scores = [score_completion(instance_from_text(inst), text, soc, self.config)
                  for text, inst, soc in zip(texts, instance, socs)]
        if self.on_score is not None:
            self.on_score(scores, texts, {"instance": instance, "optimal_soc": socs, **columns})
        return [s.reward for s in scores]
