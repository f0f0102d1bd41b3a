"""What a study runs: one DVC experiment per (arm, seed), typed (:class:`Experiment`), and the waves it runs in.

Two studies share this plan and its runner (:mod:`experiments.runner`): the engineer comparison
(:func:`comparison_plan`: one arm per engineer, or per context variant of the policy engineer) and the sensitivity
study (:func:`sensitivity_plan`: one arm per hand-set sequence of environment configurations, replayed by the
``oracle`` engineer). Every experiment is the pipeline itself with a few parameters set (``dvc exp run -S``), so
budgets are equal by construction and everything else is the workspace's ``params.yaml``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from experiments.dvc import StageFiles


@dataclass(frozen=True)
class Experiment:
    """One DVC experiment of a study. ``arm``: what the study compares (an engineer, ``policy/<context>``, a sequence
    of configurations); ``sets``: the parameters it sets (dotted keys, as ``dvc exp run -S``); ``group``: experiments
    of one group run the same first stage (the comparison: one seed; the sensitivity study: one seed and first
    configuration), which runs once and is restored from DVC's run-cache by the others; ``targets``: run only these
    stages (a group's shared stages, :func:`waves`), no result of its own."""

    name: str
    arm: str | None
    seed: int
    sets: Mapping[str, Any] = field(default_factory=dict)
    group: Any = None
    targets: tuple[str, ...] = ()


def comparison_plan(engineers: Sequence[str], seeds: Sequence[int], contexts: Sequence[str] | None = None) -> list[Experiment]:
    """One experiment per (engineer or context variant of the policy engineer, seed), named ``cmp-<engineer>-s<seed>``
    (``cmp-ctx-<context>-s<seed>``); the seed sets the training, environment and engineer seeds."""
    plan = []
    arms = [("policy", c) for c in contexts] if contexts else [(e, None) for e in engineers]
    for engineer, context in arms:
        for seed in seeds:
            sets: dict[str, Any] = {"engineer.engineer": engineer, "train.seed": seed, "env.seed": seed,
                                    "engineer.seed": seed}
            if context is not None:
                sets["engineer.context"] = context
            plan.append(Experiment(name=f"cmp-{engineer if context is None else 'ctx-' + context}-s{seed}",
                                   arm=engineer if context is None else f"policy/{context}", seed=seed, sets=sets,
                                   group=seed))
    return plan


def sensitivity_plan(sequences: Mapping[str, Sequence[Any]], seeds: Sequence[int]) -> list[Experiment]:
    """One experiment per (sequence, seed), named ``sens-<label>-s<seed>``: stage 0 trains on the sequence's first
    configuration (the whole ``env`` section, its seed the run's), stage ``k`` on its ``k``-th, replayed by the
    ``oracle`` engineer (``engineer.replay``), and the curriculum has as many stages as the sequence. ``sequences``:
    label -> configurations (:class:`envgen.core.config.EnvConfig`, all of one budget and agent count, since a stage's
    budget is the study's)."""
    plan = []
    for label, configs in sequences.items():
        first = configs[0]
        if any(c.budget != first.budget or c.num_agents != first.num_agents for c in configs):
            raise ValueError(f"sequence {label}: every configuration needs the first one's budget ({first.budget}) and "
                             f"agent count ({first.num_agents}): a stage's budget is the study's, not the sequence's")

        def sizes(config: Any) -> dict[int, dict[str, Any]]:
            return {n: config.sizes[n].model_dump() for n in sorted(config.sizes)}

        replay = [sizes(c) for c in configs[1:]] or [sizes(first)]  # a one-stage run's engineer decides nothing
        curriculum = [{"stage": k, "prev": "init" if k == 0 else k - 1, "next": k + 1} for k in range(len(configs))]
        for seed in seeds:
            env = {"num_agents": first.num_agents, "budget": first.budget, "seed": seed, "sizes": sizes(first)}
            plan.append(Experiment(name=f"sens-{label}-s{seed}", arm=label, seed=seed, group=(label.split("+")[0], seed),
                                   sets={"env": env, "engineer.engineer": "oracle", "engineer.replay": replay,
                                         "curriculum": curriculum, "train.seed": seed, "engineer.seed": seed}))
    return plan


SHARED_PREFIX = "shared-"
"""Name prefix of the short experiments that run a group's shared stages (``shared-<first experiment's name>``),
removed after."""


def _first_item_stages(stages: list[StageFiles]) -> list[StageFiles]:
    """The stages of the first curriculum item except its engineer's (``engineer-config``, the first decision)."""
    first = next((s.item for s in stages if s.item is not None), None)
    return [s for s in stages if first is not None and s.item == first and s.step != "engineer-config"]


def shared_stages(stages: list[StageFiles]) -> list[str]:
    """The stages every experiment of a group runs alike: those of the first curriculum item except its engineer's;
    DVC runs what they depend on with them. A stage that DVC cannot restore from its run-cache
    (:attr:`StageFiles.uncached`) is left out, since every experiment would run it again anyway (:func:`unrestorable`
    says so)."""
    return [s.name for s in _first_item_stages(stages) if not s.uncached]


def unrestorable(stages: list[StageFiles]) -> list[str]:
    """One line per stage that :func:`shared_stages` leaves out because DVC keeps no run-cache entry for it, naming
    the outputs to fix in ``dvc.yaml``; empty for the project's own pipeline."""
    return [f"{s.name}: DVC keeps no run-cache entry for it ({', '.join(s.uncached)}: cache: false), so every experiment "
            "runs it again; in dvc.yaml drop cache: false there, or declare the file a metric or a plot"
            for s in _first_item_stages(stages) if s.uncached]


def seed_free_stages(stages: list[StageFiles], keys: Sequence[str]) -> list[str]:
    """The stages outside the curriculum's ``foreach`` loops that read none of ``keys`` (the parameters the
    experiments set) and depend on no stage that does: the same in every experiment (the starting policy, the
    validation set, the benchmark). A study runs them once, in the workspace, before it queues anything, so each
    experiment finds them done instead of running them again (the starting policy's outputs are in git, which DVC's
    run-cache does not restore)."""
    def reads(stage: StageFiles) -> bool:
        return any(k == p or k.startswith(p + ".") or p.startswith(k + ".") for k in keys for p in stage.params_keys)

    free: set[str] = set()
    for s in stages:  # each after the stages it depends on
        if s.item is None and not reads(s) and all(u in free for u in s.upstream):
            free.add(s.name)
    return [s.name for s in stages if s.name in free]


def waves(plan: Sequence[Experiment], done: set[str] | frozenset[str] = frozenset(),
          shared: Sequence[str] = ()) -> list[list[Experiment]]:
    """The plan less the experiments in ``done``, in two waves, so that the stages every experiment of a group shares
    run once and the others restore them from DVC's run-cache. With ``shared`` (:func:`shared_stages`): first a short
    experiment per group of two or more that runs only those stages (``targets``; named ``shared-<name>``), then every
    remaining experiment at once. Without: the first remaining experiment of each group, whole, then the rest."""
    todo = [item for item in plan if item.name not in done]
    first: dict[Any, Experiment] = {}
    for item in todo:
        first.setdefault(item.group, item)
    members = Counter(item.group for item in todo)
    if shared:  # a group of one shares nothing: it runs whole in the second wave
        prefix = [replace(item, name=f"{SHARED_PREFIX}{item.name}", arm=None, targets=tuple(shared))
                  for group, item in first.items() if members[group] > 1]
        return [w for w in (prefix, todo) if w]
    rest = [item for item in todo if first[item.group] is not item]
    return [w for w in (list(first.values()), rest) if w]
