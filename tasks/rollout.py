"""Pipeline step ``rollout``: a model (+ adapter) answers every instance of an instances Parquet G times; every answer
is parsed, checked, rewarded and written to a trajectories Parquet (:data:`TRAJECTORY_COLUMNS`, atomically).

Imports no Prefect, DVC, polars or great-expectations, so it runs on the GPU image; ``env-engineer validate --kind
trajectories`` checks the file afterwards (the CLI runs it when great-expectations is installed).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from envgen.dataset import read_instances
from envgen.files import atomic_write_bytes
from envgen.instance import Instance
from envgen.prompt import PromptStyle, build_messages
from envgen.reward import RewardConfig, score_completion
from policy.backends import BACKENDS, SamplingParams, make_backend

TRAJECTORY_COLUMNS: list[tuple[str, pa.DataType, str]] = [
    ("instance_id", pa.string(), "The instance's id (instances file)."),
    ("content_hash", pa.string(), "The instance's content hash."),
    ("instance_index", pa.int32(), "Row of the instance in its instances file."),
    ("stage", pa.int32(), "Curriculum stage that produced the trajectory."),
    ("sample_index", pa.int32(), "Which of the G samples for the instance (0-based)."),
    ("size", pa.int16(), "Grid side N."),
    ("num_agents", pa.int16(), "Agents in the instance."),
    ("needs_wait", pa.bool_(), "Whether the instance's optimum needs a wait or detour."),
    ("instance", pa.string(), "Instance text form (the reward function reads it)."),
    ("prompt", pa.string(), "The chat messages sent, as JSON."),
    ("completion", pa.string(), "The model's answer."),
    ("prompt_tokens", pa.int32(), "Prompt length in tokens (as the backend counted it)."),
    ("completion_tokens", pa.int32(), "Completion length in tokens."),
    ("finish_reason", pa.string(), "'stop' (stop string or end of sequence) or 'length' (hit max_new_tokens)."),
    ("parsed", pa.bool_(), "Whether the answer could be read as a plan."),
    ("parse_error", pa.string(), "Why not (envgen.parse.ParseError), else null."),
    ("plan", pa.list_(pa.string()), "Parsed moves per agent, space-separated; null when unparsed."),
    ("valid", pa.bool_(), "Valid plan."),
    ("optimal", pa.bool_(), "Valid and of optimal sum of costs."),
    ("failure_category", pa.string(), "First failure (envgen.simulate.FailureCategory) of a parsed invalid plan."),
    ("failure_agent", pa.int16(), "1-based agent of that failure."),
    ("failure_step", pa.int32(), "Time step of that failure."),
    ("soc", pa.int32(), "Sum of costs of a valid plan."),
    ("makespan", pa.int32(), "Makespan of a valid plan."),
    ("optimal_soc", pa.int32(), "The instance's optimal sum of costs."),
    ("reward", pa.float32(), "Reward (envgen.reward.RewardConfig)."),
    ("model_id", pa.string(), "Base model."),
    ("adapter_hash", pa.string(), "Short SHA-256 of the LoRA adapter folder, null without one."),
    ("backend", pa.string(), "Generation backend."),
    ("seed", pa.int64(), "Sampling seed of the batch that produced the answer."),
    ("latency_s", pa.float32(), "Wall time of the generate call that produced the answer (shared by its batch)."),
]
TRAJECTORY_SCHEMA = pa.schema([pa.field(n, t, metadata={"description": d}) for n, t, d in TRAJECTORY_COLUMNS])


@dataclass(frozen=True)
class RolloutConfig:
    """Settings of a rollout.

    Attributes:
        model: 'embedded', a local folder, or a Hugging Face id in the local cache.
        adapter: LoRA adapter folder applied on top (merged), or None.
        backend: one of ``policy.backends.BACKENDS``.
        samples: answers per instance (GRPO's group size G).
        max_new_tokens, temperature, top_p, seed: sampling (temperature 0 is greedy).
        batch_size: instances per generate call (times ``samples`` sequences).
        threads: torch CPU threads (None: torch's default).
        cache, compile_backend: the transformers backend's KV cache ('auto': static and compiled on CUDA, dynamic on
            CPU) and compiler ('inductor', 'cudagraphs', 'none'); see ``policy.backends.TransformersBackend``.
        limit: only the first ``limit`` instances (None: all).
        stage: recorded with every row.
        prompt: how instances are shown. reward: how answers are rewarded.
        base_url, api_key_env: the ``openai`` backend's endpoint and key variable.
    """

    model: str = "embedded"
    adapter: str | None = None
    backend: str = "transformers"
    samples: int = 1
    max_new_tokens: int = 96
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 8
    threads: int | None = None
    cache: str = "auto"
    compile_backend: str = "inductor"
    limit: int | None = None
    stage: int = 0
    prompt: PromptStyle = field(default_factory=PromptStyle)
    reward: RewardConfig = field(default_factory=RewardConfig)
    base_url: str | None = None
    api_key_env: str = "OPENAI_API_KEY"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend = {self.backend!r}: choose one of {sorted(BACKENDS)}")
        if self.samples < 1:
            raise ValueError(f"samples = {self.samples}: must be at least 1")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit = {self.limit}: must be at least 1 (or None for all)")
        if self.backend == "openai" and not self.base_url:
            raise ValueError("backend 'openai' needs base_url (e.g. http://127.0.0.1:8000/v1)")

    def backend_options(self) -> dict:
        if self.backend == "openai":
            return {"base_url": self.base_url, "model": self.model, "api_key_env": self.api_key_env}
        options = {"model": self.model, "adapter": self.adapter, "batch_size": self.batch_size, "threads": self.threads}
        if self.backend == "transformers":
            options.update(cache=self.cache, compile_backend=self.compile_backend)
        return options


@dataclass(frozen=True)
class RolloutSummary:
    out: Path
    rows: int
    seconds: float
    completion_tokens: int
    parsed_rate: float
    valid_rate: float
    optimal_rate: float
    mean_reward: float
    load_seconds: float = 0.0
    """Seconds spent loading the model (0 when a loaded backend was passed in); ``seconds`` is generation alone."""

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / max(self.seconds, 1e-9)


def rollout(instances_path: str | Path, out: str | Path, config: RolloutConfig = RolloutConfig(), backend=None,
            progress: bool = True) -> RolloutSummary:
    """Run the rollout and write the trajectories Parquet. ``backend`` may be passed to reuse a loaded model."""
    from tqdm import tqdm

    table = read_instances(instances_path)
    rows_in = table.to_pylist()[: config.limit]
    instances = [Instance.from_str(r["instance"]) for r in rows_in]
    loading = time.perf_counter()
    backend = backend or make_backend(config.backend, **config.backend_options())
    load_seconds = time.perf_counter() - loading
    conversations = [build_messages(inst, config.prompt) for inst in instances]
    params = SamplingParams(max_new_tokens=config.max_new_tokens, temperature=config.temperature, top_p=config.top_p,
                            seed=config.seed)
    start = time.perf_counter()
    with tqdm(total=len(conversations), desc="rollout", unit="inst", disable=not progress, file=sys.stderr) as bar:
        generations = backend.generate(conversations, config.samples, params, on_progress=bar.update)
    seconds = time.perf_counter() - start
    rows = []
    for k, (row, inst, conv, gens) in enumerate(zip(rows_in, instances, conversations, generations)):
        prompt = json.dumps(conv)
        for j, g in enumerate(gens):
            s = score_completion(inst, g.text, row["optimal_soc"], config.reward)
            rows.append({
                "instance_id": row["instance_id"], "content_hash": row["content_hash"], "instance_index": row["index"],
                "stage": config.stage, "sample_index": j, "size": row["size"], "num_agents": row["num_agents"],
                "needs_wait": row["needs_wait"], "instance": row["instance"], "prompt": prompt, "completion": g.text,
                "prompt_tokens": g.prompt_tokens, "completion_tokens": g.completion_tokens, "finish_reason": g.finish_reason,
                "parsed": s.parsed, "parse_error": s.parse_error, "plan": s.plan, "valid": s.valid, "optimal": s.optimal,
                "failure_category": s.failure, "failure_agent": s.failure_agent, "failure_step": s.failure_step,
                "soc": s.soc, "makespan": s.makespan, "optimal_soc": row["optimal_soc"], "reward": s.reward,
                "model_id": backend.model_id, "adapter_hash": backend.adapter_hash, "backend": config.backend,
                "seed": g.seed, "latency_s": g.latency_s,
            })
    write_trajectories(out, rows, config)
    n = max(1, len(rows))
    return RolloutSummary(Path(out), len(rows), seconds, sum(r["completion_tokens"] for r in rows),
                          sum(r["parsed"] for r in rows) / n, sum(r["valid"] for r in rows) / n,
                          sum(r["optimal"] for r in rows) / n, sum(r["reward"] for r in rows) / n, load_seconds)


def write_trajectories(path: str | Path, rows: list[dict], config: RolloutConfig) -> None:
    meta = {"rollout_config": json.dumps(asdict(config), default=str)}
    table = pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA).replace_schema_metadata(meta)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    atomic_write_bytes(path, buf.getvalue())


def config_from_params(path: str | Path | None) -> RolloutConfig:
    """The ``rollout`` section of ``params.yaml``, with the model, prompt style and reward of its ``train`` section
    (the policy is evaluated exactly as it is trained)."""
    if path is None:
        return RolloutConfig()
    import yaml

    from tasks.train import TrainConfig

    params = yaml.safe_load(Path(path).read_text()) or {}
    section = dict(params.get("rollout") or {})
    train = TrainConfig.from_params(path)
    allowed = set(RolloutConfig.__dataclass_fields__) - {"prompt", "reward", "model", "adapter", "stage", "limit"}
    unknown = sorted(set(section) - allowed)
    if unknown:
        raise ValueError(f"{path}: rollout: unknown setting(s) {unknown}; allowed {sorted(allowed)}")
    return RolloutConfig(model=train.model, prompt=train.prompt, reward=train.reward, **section)


def write_metrics(metrics_path: str | Path, trajectories: str | Path) -> dict:
    """Validation metrics of a trajectories file (DVC metrics): overall and per size, namespaced."""
    table = pq.read_table(trajectories).to_pylist()
    def rates(rows: list[dict]) -> dict:
        n = max(1, len(rows))
        return {"valid": sum(r["valid"] for r in rows) / n, "optimal": sum(r["optimal"] for r in rows) / n,
                "parsed": sum(r["parsed"] for r in rows) / n, "reward": sum(r["reward"] for r in rows) / n, "n": len(rows)}
    metrics = {"validation": rates(table), "validation_by_size": {
        str(size): rates([r for r in table if r["size"] == size]) for size in sorted({r["size"] for r in table})}}
    from envgen.files import atomic_write_text

    atomic_write_text(metrics_path, json.dumps(metrics, indent=2))
    return metrics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instances", required=True, type=Path, help="instances Parquet (generate-instances)")
    parser.add_argument("--out", required=True, type=Path, help="trajectories Parquet to write (atomically)")
    parser.add_argument("--params", type=Path, default=None,
                        help="params.yaml: its 'rollout' section, and the model/prompt/reward of its 'train' section; "
                        "flags below override it")
    parser.add_argument("--out-metrics", type=Path, default=None, help="also write validation metrics JSON here")
    parser.add_argument("--model", default=None, help="'embedded' (default), a local folder, or a cached Hugging Face id")
    parser.add_argument("--adapter", default=None, help="LoRA adapter folder (PEFT) to apply")
    parser.add_argument("--backend", default=None, choices=sorted(BACKENDS), help="generation backend (default transformers)")
    parser.add_argument("--samples", type=int, default=None, help="answers per instance, G (default 1)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default 96")
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (default 1.0)")
    parser.add_argument("--top-p", type=float, default=None, help="default 1.0")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default 0)")
    parser.add_argument("--batch-size", type=int, default=None, help="instances per generate call (default 8)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--cache", default=None, choices=["auto", "static", "dynamic"],
                        help="KV cache of the transformers backend: static compiles the decode step on CUDA (default auto: "
                        "static on CUDA, dynamic on CPU)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N instances")
    parser.add_argument("--stage", type=int, default=None, help="curriculum stage recorded with each row")
    parser.add_argument("--view", default=None, choices=["grid", "coords"], help="map view in the prompt (default grid)")
    parser.add_argument("--moves", default=None, choices=["words", "letters"], help="move vocabulary (default words)")
    parser.add_argument("--think", action="store_true", help="ask for reasoning in <think></think> first")
    parser.add_argument("--trace", action="store_true", help="ask for the cell reached after every move (as train's default)")
    parser.add_argument("--base-url", default=None, help="openai backend: endpoint, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key-env", default=None, help="openai backend: variable holding the API key")
    parser.add_argument("--no-validate", action="store_true", help="skip the great-expectations check of the output")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from policy.backends import BackendError
    from policy.models import ModelNotFoundError

    started = time.perf_counter()
    try:
        config = config_from_params(args.params)
        flags = {"model": args.model, "adapter": args.adapter, "backend": args.backend, "samples": args.samples,
                 "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
                 "seed": args.seed, "batch_size": args.batch_size, "threads": args.threads, "cache": args.cache, "limit": args.limit,
                 "stage": args.stage, "base_url": args.base_url, "api_key_env": args.api_key_env}
        config = replace(config, **{k: v for k, v in flags.items() if v is not None})
        style = {"view": args.view, "moves": args.moves}
        style = {k: v for k, v in style.items() if v is not None}
        if args.think:
            style["think"] = True
        if args.trace:
            style["trace"] = True
        if style:
            config = replace(config, prompt=replace(config.prompt, **style))
        summary = rollout(args.instances, args.out, config, progress=not args.no_progress)
    except (ValueError, ModelNotFoundError, BackendError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {summary.rows} trajectories to {summary.out} in {summary.seconds:.1f} s "
          f"({summary.tokens_per_s:.1f} completion tokens/s); parsed {summary.parsed_rate:.3f}, valid {summary.valid_rate:.3f}, "
          f"optimal {summary.optimal_rate:.3f}, mean reward {summary.mean_reward:.3f}")
    print(f"time: model loading {summary.load_seconds:.1f} s, generation {summary.seconds:.1f} s, "
          f"{time.perf_counter() - started:.1f} s since the command started")
    if not args.no_validate:
        from tasks.validate import DataValidationError, validate_file

        try:
            validate_file(args.out, "trajectories")
        except ModuleNotFoundError as e:
            print(f"note: {e.name} is not installed here: validate {args.out} where it is", file=sys.stderr)
        except DataValidationError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    if args.out_metrics:
        write_metrics(args.out_metrics, args.out)
    return 0
