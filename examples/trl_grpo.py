"""GRPO with TRL on MAPF-FrozenLake, the training environment rewritten between stages by an engineer: the testbed
and one engineer, without DVC or the pipeline.

    python examples/trl_grpo.py --model PATH_OR_CACHED_ID --stages 3 --budget 64

Each stage draws its instances from an environment configuration (``envgen.generator``), trains on them with TRL's
``GRPOTrainer`` rewarded by ``envgen.llm.reward.MAPFReward``, and at the stage's end a ``TrainerCallback`` hands what
the stage's completions showed (the valid rate per map size) to an engineer (``learnability`` by default: the
budget goes where about half the answers are valid), whose proposal becomes the next stage's configuration through
``engineers.proposal.finalize``: budget and agents unchanged, every knob within range. The full pipeline does the same
with held-out validation, a benchmark, DVC's caching and any engineer (``dvc repro``).
"""

from __future__ import annotations

import argparse
import random
from collections import defaultdict
from typing import Any

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from engineers.proposal import EngineerInput, finalize
from engineers.registry import ENGINEERS, EngineerBuild
from engineers.summary import Rates, Summary, Validation
from envgen.core.config import EnvConfig, uniform_config
from envgen.generator import generate
from envgen.llm.prompt import PromptStyle, build_messages
from envgen.llm.reward import MAPFReward
from pipeline.params import EngineerSettings, PolicySettings


def stage_dataset(config: EnvConfig, style: PromptStyle) -> Dataset:
    """The stage's instances as a TRL dataset: a prompt per instance, with the columns MAPFReward reads."""
    return Dataset.from_list([{"prompt": build_messages(g.instance, style), "instance": g.instance.to_str(),
                               "optimal_soc": g.solution.soc, "size": g.instance.height} for g in generate(config)])


class Outcomes:
    """MAPFReward's ``on_score``: each completion's size and validity, for the stage's summary."""

    def __init__(self) -> None:
        self.valid_by_size: dict[int, list[bool]] = defaultdict(list)

    def __call__(self, scores: list[Any], texts: list[str], columns: dict[str, Any]) -> None:
        for size, score in zip(columns["size"], scores):
            self.valid_by_size[size].append(score.valid)


class EngineerBetweenStages(TrainerCallback):
    """At the end of a stage's training, asks the engineer for the next configuration (``self.next_config``)."""

    def __init__(self, engineer: Any, config: EnvConfig, outcomes: Outcomes, stage: int, seed: int) -> None:
        self.engineer, self.config, self.outcomes, self.stage, self.seed = engineer, config, outcomes, stage, seed
        self.next_config: EnvConfig | None = None
        self.rationale = ""

    def on_train_end(self, args, state, control, **kwargs):
        by_size = {str(n): Rates(n=len(v), parsed=0.0, valid=sum(v) / len(v), optimal=0.0, reward=0.0)
                   for n, v in self.outcomes.valid_by_size.items() if v}
        overall = [x for v in self.outcomes.valid_by_size.values() for x in v]
        summary = Summary(stage=self.stage, config=self.config, validation=Validation(
            overall=Rates(n=len(overall), parsed=0.0, valid=sum(overall) / max(1, len(overall)), optimal=0.0,
                          reward=0.0), by_size=by_size, by_agents={}, by_wait={}))
        proposal = self.engineer.propose(EngineerInput(summary, self.config, self.stage, random.Random(self.seed)))
        self.next_config, self.rationale = finalize(proposal, self.config).config, proposal.rationale


def run(model: str, stages: int, budget: int, engineer: str = "learnability", seed: int = 0,
        out: str = "trl-grpo-out") -> list[dict[str, Any]]:
    """Train ``stages`` stages; returns per stage its configuration, mean reward and the engineer's rationale."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model)
    style = PromptStyle(moves="letters", trace=True)
    chooser = ENGINEERS[engineer](EngineerBuild(EngineerSettings(engineer=engineer), PolicySettings(model=model)))
    config = uniform_config(budget=budget, seed=seed, sizes=(3, 4, 5))
    history = []
    for stage in range(stages):
        outcomes = Outcomes()
        callback = EngineerBetweenStages(chooser, config, outcomes, stage, seed)
        args = GRPOConfig(output_dir=f"{out}/stage-{stage}", num_generations=4, per_device_train_batch_size=4,
                          max_completion_length=64, max_steps=max(1, budget // 4), learning_rate=1e-5, seed=seed,
                          report_to="none", save_strategy="no", use_cpu=True, logging_steps=1, disable_tqdm=True)
        trainer = GRPOTrainer(model=policy, args=args, train_dataset=stage_dataset(config, style),
                              reward_funcs=[MAPFReward(on_score=outcomes)], processing_class=tokenizer,
                              callbacks=[callback])
        trainer.train()
        rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
        history.append({"stage": stage, "config": config, "mean_reward": sum(rewards) / max(1, len(rewards)),
                        "rationale": callback.rationale})
        print(f"stage {stage}: mean reward {history[-1]['mean_reward']:.3f}; {callback.rationale}")
        config = callback.next_config
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a local model folder or a Hugging Face id in the local cache")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--budget", type=int, default=64, help="instances (prompts) per stage")
    parser.add_argument("--engineer", default="learnability", choices=sorted(set(ENGINEERS) - {"policy", "base",
                                                                                                "api", "oracle"}))
    parser.add_argument("--out", default="trl-grpo-out")
    args = parser.parse_args()
    run(args.model, args.stages, args.budget, args.engineer, out=args.out)


if __name__ == "__main__":
    main()
