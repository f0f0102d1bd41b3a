"""Every engineer, by name: :data:`ENGINEERS` maps a name to a factory that builds it from the engineer and policy
settings (:class:`EngineerBuild`).

- ``policy``: the current checkpoint (base model + the latest adapter) reads the stage summary and proposes (the
  paper's engineer);
- ``base``: the same model without the adapter;
- ``api``: any OpenAI-compatible endpoint (a proprietary model, or ``env-engineer serve``);
- ``heuristic``, ``random``, ``fixed``: :mod:`engineers.baselines`;
- ``plr``, ``alp``, ``learnability``: level samplers from unsupervised environment design and LLM RL
  (:mod:`engineers.level_samplers`);
- ``oracle``: replays ``engineer.replay``, a sequence chosen in advance (:mod:`engineers.baselines`): an upper bound for
  comparisons, never an engineer (:data:`UPPER_BOUNDS`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engineers.baselines import FixedEngineer, HeuristicEngineer, OracleEngineer, RandomEngineer
from engineers.level_samplers import ALPEngineer, LearnabilityEngineer, PLREngineer
from engineers.llm import CONTEXTS, LLMEngineer
from engineers.proposal import Engineer
from pipeline.params import EngineerSettings, PolicySettings, RolloutSettings


@dataclass(frozen=True)
class EngineerBuild:
    """What a factory builds an engineer from. ``backend``: an already loaded generation backend to use instead of
    loading one (reuse of a model, tests). ``served``: the rollout's settings; where they point at a served policy
    (``rollout.backend: openai``, as a study's warm engine sets), the policy and base engineers ask that server (the
    stage's adapter loaded into it at runtime, as the rollouts' is) instead of loading the model in their own process."""

    settings: EngineerSettings
    policy: PolicySettings
    adapter: str | None = None
    backend: Any = None
    served: RolloutSettings | None = None


def _llm(name: str, build: EngineerBuild, backend: Any) -> LLMEngineer:
    s = build.settings
    return LLMEngineer(name, backend, CONTEXTS[s.context], s.attempts, s.max_new_tokens, s.temperature, s.constrained, s.seed)


def asks_a_server(served: RolloutSettings | None) -> bool:
    """Whether the policy and base engineers ask a served policy (the rollout's ``openai`` backend) rather than load
    the model in their own process (and take a GPU)."""
    return served is not None and served.backend == "openai"


def _local(name: str, with_adapter: bool) -> Callable[[EngineerBuild], Engineer]:
    """A factory of an engineer on the policy's base model, with the stage's adapter or without."""

    def factory(build: EngineerBuild) -> Engineer:
        backend = build.backend
        adapter = build.adapter if with_adapter else None
        if backend is None:
            from policy.backends import make_backend

            if asks_a_server(build.served):
                backend = make_backend("openai", **build.served.backend_options(build.policy.model, adapter))
            else:
                backend = make_backend("transformers", model=build.policy.model, adapter=adapter, batch_size=1,
                                       threads=build.settings.threads)
        return _llm(name, build, backend)

    return factory


def _api(build: EngineerBuild) -> Engineer:
    backend = build.backend
    if backend is None:
        from policy.backends import make_backend

        s = build.settings
        if not s.base_url:
            raise ValueError("engineer 'api' needs engineer.base_url (and engineer.api_model, engineer.api_key_env)")
        backend = make_backend("openai", base_url=s.base_url, model=s.api_model, api_key_env=s.api_key_env)
    return _llm("api", build, backend)


ENGINEERS: dict[str, Callable[[EngineerBuild], Engineer]] = {
    "policy": _local("policy", with_adapter=True),
    "base": _local("base", with_adapter=False),
    "api": _api,
    "heuristic": lambda build: HeuristicEngineer(),
    "random": lambda build: RandomEngineer(),
    "fixed": lambda build: FixedEngineer(),
    "plr": lambda build: PLREngineer(),
    "alp": lambda build: ALPEngineer(),
    "learnability": lambda build: LearnabilityEngineer(),
    "oracle": lambda build: OracleEngineer(build.settings.replay or ()),
}
"""Every engineer's factory, by name."""

UPPER_BOUNDS = frozenset({"oracle"})
"""Registered names that are reference arms, not engineers: a comparison labels them as upper bounds."""


def make_engineer(build: EngineerBuild) -> Engineer:
    """The engineer ``build.settings.engineer`` names."""
    name = build.settings.engineer
    if name not in ENGINEERS:
        raise ValueError(f"engineer.engineer = {name!r}: choose one of {sorted(ENGINEERS)}")
    return ENGINEERS[name](build)
