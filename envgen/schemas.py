"""Every Parquet dataset of the project, declared once: columns, types, descriptions and the rules their values obey.

- :data:`INSTANCES`: a stage's (or the validation set's) generated instances with their optimal solutions;
- :data:`BENCHMARK`: the held-out benchmark: instances plus the wait subset of their cell;
- :data:`TRAJECTORIES`: a model's answers to instances, parsed, checked and rewarded (rollout and evaluation);
- :data:`COMPLETIONS`: every GRPO completion of a training stage with its reward.

Writers take the Arrow schema from here (:attr:`Dataset.schema`, every field with its description in the field
metadata); the great-expectations suites of ``pipeline.checks`` are derived from the same rules, so a column and its
check cannot drift apart. :data:`DATASETS` is the registry by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from envgen.parse import ParseError
from envgen.simulate import FailureCategory


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
class Dataset:
    """A Parquet dataset: its columns, the rules between columns, and its least row count."""

    name: str
    description: str
    columns: tuple[Column, ...]
    pairs: tuple[PairRule, ...] = ()
    min_rows: int = 1

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
        return Dataset(name, description, self.columns + columns, self.pairs, self.min_rows)


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
    Column("hole_ratio", pa.float32(), "hole_count / (N * N).", lo=0.0, hi=0.5),
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
), pairs=(PairRule("optimal_soc", "ge", "sum_shortest"), PairRule("needs_wait", "eq", "wait_target")))

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
    Column("finish_reason", pa.string(), "'stop' (stop string or end of sequence) or 'length' (hit max_new_tokens)."),
    Column("parsed", pa.bool_(), "Whether the answer could be read as a plan.", required=True),
    Column("parse_error", pa.string(), "Why not (envgen.parse.ParseError), else null.", values=_PARSE_ERRORS),
    Column("plan", pa.list_(pa.string()), "Parsed moves per agent, space-separated; null when unparsed."),
    Column("valid", pa.bool_(), "Valid plan.", required=True),
    Column("optimal", pa.bool_(), "Valid and of optimal sum of costs.", required=True),
    Column("failure_category", pa.string(), "First failure (envgen.simulate.FailureCategory) of a parsed invalid plan.",
           values=_FAILURES),
    Column("failure_agent", pa.int16(), "1-based agent of that failure."),
    Column("failure_step", pa.int32(), "Time step of that failure."),
    Column("soc", pa.int32(), "Sum of costs of a valid plan."),
    Column("makespan", pa.int32(), "Makespan of a valid plan."),
    Column("optimal_soc", pa.int32(), "The instance's optimal sum of costs.", required=True),
    Column("reward", pa.float32(), "Reward (envgen.reward.RewardConfig).", required=True, lo=-10.0, hi=10.0),
    Column("model_id", pa.string(), "Base model.", required=True),
    Column("adapter_hash", pa.string(), "Short SHA-256 of the LoRA adapter folder, null without one."),
    Column("backend", pa.string(), "Generation backend."),
    Column("seed", pa.int64(), "Sampling seed of the batch that produced the answer.", required=True),
    Column("latency_s", pa.float32(), "Wall time of the generate call that produced the answer (shared by its batch)."),
))

COMPLETIONS = Dataset("completions", "Every GRPO completion of a training stage with its reward (empty without GRPO).", (
    Column("step", pa.int32(), "The trainer's step that sampled the completion.", required=True, lo=0),
    Column("instance_id", pa.string(), "The instance's id.", required=True),
    Column("size", pa.int16(), "Grid side N.", required=True),
    Column("num_agents", pa.int16(), "Agents in the instance."),
    Column("needs_wait", pa.bool_(), "Whether the instance's optimum needs a wait or detour."),
    Column("completion", pa.string(), "The sampled answer.", required=True),
    Column("reward", pa.float32(), "Reward (envgen.reward.RewardConfig).", required=True, lo=-10.0, hi=10.0),
    Column("parsed", pa.bool_(), "Whether the answer could be read as a plan.", required=True),
    Column("parse_error", pa.string(), "Why not (envgen.parse.ParseError), else null.", values=_PARSE_ERRORS),
    Column("valid", pa.bool_(), "Valid plan.", required=True),
    Column("optimal", pa.bool_(), "Valid and of optimal sum of costs.", required=True),
    Column("failure_category", pa.string(), "First failure of a parsed invalid plan.", values=_FAILURES),
    Column("soc", pa.int32(), "Sum of costs of a valid plan."),
    Column("optimal_soc", pa.int32(), "The instance's optimal sum of costs."),
), min_rows=0)

DATASETS: dict[str, Dataset] = {d.name: d for d in (INSTANCES, BENCHMARK, TRAJECTORIES, COMPLETIONS)}
"""Every dataset, by name (``env-engineer validate --kind NAME``)."""
