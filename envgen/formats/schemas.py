"""Every Parquet dataset of the project, declared once: columns, types, descriptions and the rules their values obey.

- :data:`INSTANCES`: a stage's (or the validation set's) generated instances with their optimal solutions;
- :data:`BENCHMARK`: the held-out benchmark: instances plus the wait subset of their cell;
- :data:`TRAJECTORIES`: a model's answers to instances, parsed, checked and rewarded (rollout and evaluation);
- :data:`COMPLETIONS`: every GRPO completion of a training stage with its reward.

Writers take the Arrow schema from here (:attr:`Dataset.schema`, every field with its description in the field
metadata); the great-expectations suites of ``pipeline.checks`` are derived from the same rules, so a column and its
check cannot drift apart. Beside the column rules, each dataset's :class:`RowRule` s check meaning: that an instance's
text parses and hashes to its ``content_hash``, that its optimal plan replays to its ``optimal_soc`` (and, on a sample,
that the solver agrees it is optimal), that an answer marked valid was parsed, that a reward lies within the reward
configuration the file records. :data:`DATASETS` is the registry by name.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from envgen.core.instance import Instance, InstanceError
from envgen.llm.parse import ParseError
from envgen.core.simulate import FailureCategory, Valid, check_plan


@dataclass(frozen=True)
class Column:
    """One column and the rules its values obey.

    Attributes:
        name, type, description: the Arrow field (the description goes into the field's metadata).
        required: no nulls.
        lo, hi: inclusive bounds of a number (None: unbounded on that side).
        unique: no value repeats.
        regex: every non-null value matches it.
        values: every non-null value is one of these.
    """

    name: str
    type: pa.DataType
    description: str
    required: bool = False
    lo: float | None = None
    hi: float | None = None
    unique: bool = False
    regex: str | None = None
    values: tuple[str, ...] | None = None

    @property
    def field(self) -> pa.Field:
        return pa.field(self.name, self.type, metadata={"description": self.description})


@dataclass(frozen=True)
class PairRule:
    """A rule between two columns of one row: ``a >= b`` (``op="ge"``) or ``a == b`` (``op="eq"``)."""

    a: str
    op: str
    b: str


@dataclass(frozen=True)
class RowRule:
    """A rule of meaning over one row: ``check(row, metadata)`` is true for a good row (``metadata``: the file's
    key-value metadata, decoded). ``sample``: check at most this many rows (drawn with a fixed seed), for costly rules."""

    name: str
    description: str
    check: Callable[[Mapping[str, Any], Mapping[str, str]], bool]
    sample: int | None = None


@dataclass(frozen=True)
class Dataset:
    """A Parquet dataset: its columns, the rules between columns and of meaning, and its least row count."""

    name: str
    description: str
    columns: tuple[Column, ...]
    pairs: tuple[PairRule, ...] = ()
    min_rows: int = 1
    meaning: tuple[RowRule, ...] = ()

    @property
    def schema(self) -> pa.Schema:
        return pa.schema([c.field for c in self.columns])

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.columns]

    def column(self, name: str) -> Column:
        return next(c for c in self.columns if c.name == name)

    def extended(self, name: str, description: str, *columns: Column) -> Dataset:
        """This dataset with more columns (and the same rules)."""
        return Dataset(name, description, self.columns + columns, self.pairs, self.min_rows, self.meaning)


def _instance(row: Mapping[str, Any]) -> Instance | None:
    try:
        return Instance.from_str(row["instance"]) if isinstance(row.get("instance"), str) else None
    except InstanceError:
        return None


def _hash_matches(row: Mapping[str, Any], _: Mapping[str, str]) -> bool:
    text = row.get("instance")
    return isinstance(text, str) and hashlib.sha256(text.encode()).hexdigest() == row.get("content_hash")


def _parses_and_agrees(row: Mapping[str, Any], _: Mapping[str, str]) -> bool:
    inst = _instance(row)
    return inst is not None and inst.to_str() == row["instance"] and inst.height == row.get("size") \
        and inst.num_agents == row.get("num_agents")


MAX_CHECKED_AGENTS, MAX_CHECKED_SIDE = 8, 16
"""The largest instances the rules of meaning replay or solve: the columns' own bounds (``num_agents``, ``size``); a
row beyond them fails its column check, and replaying or solving it could take minutes and gigabytes."""


def _checkable(inst: Instance | None) -> bool:
    return inst is not None and inst.num_agents <= MAX_CHECKED_AGENTS and max(inst.height, inst.width) <= MAX_CHECKED_SIDE


def _plan_replays(row: Mapping[str, Any], _: Mapping[str, str]) -> bool:
    inst, plan = _instance(row), row.get("optimal_plan")
    if not _checkable(inst) or not isinstance(plan, list) or not all(isinstance(line, str) for line in plan):
        return False
    if sum(len(line) for line in plan) > 100_000:  # a 16 x 16 board's optimal plans take a few hundred characters
        return False
    result = check_plan(inst, [line.split() for line in plan], row.get("optimal_soc"))
    return isinstance(result, Valid) and result.soc == row.get("optimal_soc") and result.makespan == row.get("makespan")


def _solver_agrees(row: Mapping[str, Any], _: Mapping[str, str]) -> bool:
    from envgen.solver.cbs import Solved, SolverBudget, solve

    inst = _instance(row)
    if not _checkable(inst):
        return False
    result = solve(inst, SolverBudget(max_seconds=10))
    return not isinstance(result, Solved) and not result.reason.proven or (
        isinstance(result, Solved) and result.soc == row.get("optimal_soc"))


def _reward_range(metadata: Mapping[str, str]) -> tuple[float, float]:
    """The rewards a file's recorded reward configuration allows: [unparseable, optimal] (any rewards the metadata
    does not say: [-10, 10])."""
    for key, path in (("rollout", ("policy", "reward")), ("train", ("policy", "reward"))):
        try:
            node: Any = json.loads(metadata[key])
            for part in path:
                node = node[part]
            return float(node["unparseable"]), float(node["optimal"])
        except (KeyError, TypeError, ValueError):
            continue
    return -10.0, 10.0


def _reward_in_range(row: Mapping[str, Any], metadata: Mapping[str, str]) -> bool:
    lo, hi = _reward_range(metadata)
    reward = row.get("reward")
    return isinstance(reward, (int, float)) and lo - 1e-6 <= reward <= hi + 1e-6


def _outcome_consistent(row: Mapping[str, Any], _: Mapping[str, str]) -> bool:
    parsed, valid, optimal = row.get("parsed"), row.get("valid"), row.get("optimal")
    return (not valid or bool(parsed)) and (not optimal or bool(valid)) and (row.get("parse_error") is None) == bool(parsed) \
        and (not valid or row.get("failure_category") is None)


HASH_MATCHES = RowRule("hash_matches_instance", "content_hash is the SHA-256 of the instance text", _hash_matches)
OUTCOME_CONSISTENT = RowRule("outcome_consistent", "valid implies parsed, optimal implies valid, a parse error exactly "
                             "when unparsed, no failure for a valid plan", _outcome_consistent)
REWARD_IN_RANGE = RowRule("reward_within_configuration", "the reward lies between the recorded reward configuration's "
                          "unparseable and optimal values", _reward_in_range)


HASH = r"^[0-9a-f]{64}$"
_LIST_I16 = pa.list_(pa.int16())
_FAILURES = tuple(c.value for c in FailureCategory)
_PARSE_ERRORS = tuple(e.value for e in ParseError)

INSTANCES = Dataset("instances", "One row per generated instance, with its optimal solution and provenance.", (
    Column("index", pa.int32(), "Position of the instance in the stage (its slot), 0-based.", required=True, unique=True),
    Column("instance_id", pa.string(), "Stable id: 'i' + the first 16 hex digits of the content hash.", required=True),
    Column("content_hash", pa.string(), "SHA-256 of the canonical instance text (Instance.content_hash).", required=True,
           unique=True, regex=HASH),
    Column("instance", pa.string(), "Canonical text form; Instance.from_str(instance) rebuilds it exactly.", required=True),
    Column("size", pa.int16(), "Grid side N (the grid is N x N).", required=True, lo=3, hi=16),
    Column("num_agents", pa.int16(), "Number of agents.", required=True, lo=1, hi=8),
    Column("starts", pa.list_(_LIST_I16), "Start cell [row, col] per agent."),
    Column("goals", pa.list_(_LIST_I16), "Goal cell [row, col] per agent."),
    Column("hole_count", pa.int16(), "Number of holes."),
    Column("hole_ratio", pa.float32(), "hole_count / (N * N).", required=True, lo=0.0, hi=0.5),
    Column("free_cells", pa.int16(), "Number of frozen (walkable) cells."),
    Column("wait_target", pa.bool_(), "Whether the slot asked for an instance that needs coordination.", required=True),
    Column("needs_wait", pa.bool_(), "Whether the optimum needs a wait or detour (optimal_soc > sum_shortest); equals "
           "wait_target.", required=True),
    Column("optimal_soc", pa.int32(), "Optimal sum of costs (CBS, verified by the simulator).", required=True, lo=0),
    Column("makespan", pa.int32(), "Makespan of the stored optimal plan.", required=True),
    Column("shortest_lengths", pa.list_(pa.int32()), "Each agent's shortest path length alone on the grid."),
    Column("sum_shortest", pa.int32(), "Sum of shortest_lengths: the sum of costs if agents ignored each other.",
           required=True),
    Column("soc_gap", pa.int32(), "optimal_soc - sum_shortest: the price of coordination (difficulty feature).",
           required=True, lo=0),
    Column("optimal_plan", pa.list_(pa.string()), "Per agent its optimal moves, space-separated words "
           "(UP/DOWN/LEFT/RIGHT/WAIT)."),
    Column("solver_nodes", pa.int32(), "Search nodes the solver expanded (difficulty feature)."),
    Column("solver_method", pa.string(), "'cbs' or 'joint' (exhaustive joint A*, for hard 2-agent boards)."),
    Column("attempts", pa.int32(), "Draws needed to fill the slot (rejection sampling)."),
    Column("seed", pa.int64(), "The configuration's seed.", required=True),
    Column("draw_seed", pa.uint64(), "Seed of the slot's random stream: blake2b of 'seed:index' (generator.draw_seed).",
           required=True),
    Column("generator_version", pa.string(), "Version of the generator that drew the instance.", required=True),
), pairs=(PairRule("optimal_soc", "ge", "sum_shortest"), PairRule("needs_wait", "eq", "wait_target")), meaning=(
    HASH_MATCHES,
    RowRule("instance_parses", "the instance text parses, is canonical, and agrees with size and num_agents",
            _parses_and_agrees),
    RowRule("optimal_plan_replays", "the stored optimal plan is valid with sum of costs optimal_soc and that makespan",
            _plan_replays),
    RowRule("solver_agrees", "on a sample, the solver finds the same optimal sum of costs", _solver_agrees, sample=16),
))

BENCHMARK = INSTANCES.extended(
    "benchmark", "The held-out benchmark: instances of the paper's (agents, size, wait subset) cells.",
    Column("wait_subset", pa.float32(), "The cell's wait ratio.", required=True, lo=0.0, hi=1.0))

TRAJECTORIES = Dataset("trajectories", "One row per answer of a model to an instance: parsed, checked and rewarded.", (
    Column("instance_id", pa.string(), "The instance's id (instances file).", required=True),
    Column("content_hash", pa.string(), "The instance's content hash.", required=True, regex=HASH),
    Column("instance_index", pa.int32(), "Row of the instance in its instances file."),
    Column("stage", pa.int32(), "Curriculum stage that produced the trajectory.", required=True),
    Column("sample_index", pa.int32(), "Which of the G samples for the instance (0-based).", required=True, lo=0),
    Column("size", pa.int16(), "Grid side N."),
    Column("num_agents", pa.int16(), "Agents in the instance."),
    Column("needs_wait", pa.bool_(), "Whether the instance's optimum needs a wait or detour."),
    Column("instance", pa.string(), "Instance text form (the reward function reads it)."),
    Column("prompt", pa.string(), "The chat messages sent, as JSON."),
    Column("completion", pa.string(), "The model's answer.", required=True),
    Column("prompt_tokens", pa.int32(), "Prompt length in tokens (as the backend counted it)."),
    Column("completion_tokens", pa.int32(), "Completion length in tokens.", lo=0),
    Column("finish_reason", pa.string(), "'stop' (stop string or end of sequence) or 'length' (hit its token budget)."),
    Column("token_budget", pa.int32(), "The answer's length cap in tokens (rollout.max_new_tokens: its own, or one for "
           "all).", required=True, lo=1),
    Column("optimal_tokens", pa.int32(), "Tokens of the instance's solver-optimal answer in the answer format: no "
           "budget may be below it.", required=True, lo=1),
    Column("parsed", pa.bool_(), "Whether the answer could be read as a plan.", required=True),
    Column("parse_error", pa.string(), "Why not (envgen.llm.parse.ParseError), else null.", values=_PARSE_ERRORS),
    Column("plan", pa.list_(pa.string()), "Parsed moves per agent, space-separated; null when unparsed."),
    Column("valid", pa.bool_(), "Valid plan.", required=True),
    Column("optimal", pa.bool_(), "Valid and of optimal sum of costs.", required=True),
    Column("failure_category", pa.string(), "First failure (envgen.core.simulate.FailureCategory) of a parsed invalid plan.",
           values=_FAILURES),
    Column("failure_agent", pa.int16(), "1-based agent of that failure."),
    Column("failure_step", pa.int32(), "Time step of that failure."),
    Column("soc", pa.int32(), "Sum of costs of a valid plan."),
    Column("makespan", pa.int32(), "Makespan of a valid plan."),
    Column("optimal_soc", pa.int32(), "The instance's optimal sum of costs.", required=True),
    Column("reward", pa.float32(), "Reward (envgen.llm.reward.RewardConfig).", required=True, lo=-10.0, hi=10.0),
    Column("model_id", pa.string(), "Base model.", required=True),
    Column("adapter_hash", pa.string(), "Short SHA-256 of the LoRA adapter folder, null without one."),
    Column("backend", pa.string(), "Generation backend."),
    Column("seed", pa.int64(), "Sampling seed of the batch that produced the answer.", required=True),
    Column("latency_s", pa.float32(), "Wall time of the generate call that produced the answer (shared by its batch)."),
), pairs=(PairRule("token_budget", "ge", "optimal_tokens"),), meaning=(HASH_MATCHES, OUTCOME_CONSISTENT, REWARD_IN_RANGE))

COMPLETIONS = Dataset("completions", "Every GRPO completion of a training stage with its reward (empty without GRPO).", (
    Column("step", pa.int32(), "The trainer's step that sampled the completion.", required=True, lo=0),
    Column("instance_id", pa.string(), "The instance's id.", required=True),
    Column("size", pa.int16(), "Grid side N.", required=True),
    Column("num_agents", pa.int16(), "Agents in the instance."),
    Column("needs_wait", pa.bool_(), "Whether the instance's optimum needs a wait or detour."),
    Column("completion", pa.string(), "The sampled answer.", required=True),
    Column("reward", pa.float32(), "Reward (envgen.llm.reward.RewardConfig).", required=True, lo=-10.0, hi=10.0),
    Column("parsed", pa.bool_(), "Whether the answer could be read as a plan.", required=True),
    Column("parse_error", pa.string(), "Why not (envgen.llm.parse.ParseError), else null.", values=_PARSE_ERRORS),
    Column("valid", pa.bool_(), "Valid plan.", required=True),
    Column("optimal", pa.bool_(), "Valid and of optimal sum of costs.", required=True),
    Column("failure_category", pa.string(), "First failure of a parsed invalid plan.", values=_FAILURES),
    Column("soc", pa.int32(), "Sum of costs of a valid plan."),
    Column("optimal_soc", pa.int32(), "The instance's optimal sum of costs."),
), min_rows=0, meaning=(RowRule("outcome_consistent", "valid implies parsed, optimal implies valid, a parse error exactly "
                                "when unparsed", lambda row, _: (not row.get("valid") or bool(row.get("parsed")))
                                and (not row.get("optimal") or bool(row.get("valid")))
                                and (row.get("parse_error") is None) == bool(row.get("parsed"))), REWARD_IN_RANGE))

DATASETS: dict[str, Dataset] = {d.name: d for d in (INSTANCES, BENCHMARK, TRAJECTORIES, COMPLETIONS)}
"""Every dataset, by name (``env-engineer check-data --kind NAME``)."""
