"""Pipeline step ``rollout``: the policy (+ adapter) answers every instance of an instances Parquet G times; every answer
is parsed, checked, rewarded and written to a trajectories Parquet (:data:`envgen.formats.schemas.TRAJECTORIES`, atomically).

Every answer has a token budget of its own (``rollout.max_new_tokens: auto``): its instance's solver-optimal answer,
written in the prompt's answer format, counted in the model's tokens, times ``1 + rollout.budget_margin``, plus
:data:`BUDGET_SLACK`; so an answer as good as the solver's is never cut, and a long board is not scored by a cap.
Each row records its budget and the optimal answer's length (``token_budget``, ``optimal_tokens``); the trajectories
check refuses a file where a budget is below its optimal answer (a fixed ``max_new_tokens`` that cuts optima).

Settings: params.yaml's ``policy`` (model, prompt, reward: the policy is evaluated exactly as it is trained) and
``rollout`` sections (:class:`pipeline.params.RolloutSettings`); the benchmark evaluation runs this step with
``--evaluate``, which takes the budgets from ``evaluate.max_new_tokens`` and, before ``evaluate.whole_from_stage``,
answers only the boards of ``evaluate.early_agents`` agents (none, with no model loaded, when it is empty). Imports
no Prefect, DVC, polars or great-expectations (``env-engineer check-data --kind trajectories`` checks the output, as
the pipeline does).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import pyarrow.parquet as pq

from envgen.formats.dataset import parse_instances, read_instances, write_dataset
from envgen.core.files import atomic_write_text
from envgen.core.instance import Instance
from envgen.llm.prompt import PromptStyle, build_messages, format_answer
from envgen.llm.rates import rates, rates_by
from envgen.llm.reward import score_completion
from envgen.formats.schemas import TRAJECTORIES
from pipeline.params import ParamsError, PolicySettings, RolloutSettings, add_params_arguments, load_params
from pipeline.progress import Progress
from policy.backends import SamplingParams, make_backend


BUDGET_SLACK = 8
"""Tokens every automatic budget gets beyond ``optimal answer x (1 + budget_margin)`` (the answer's closing tag and
end of sequence, on a short board)."""


def token_budget(optimal_tokens: int, margin: float) -> int:
    """An answer's token budget from its optimal answer's length: ``ceil(optimal_tokens * (1 + margin)) + BUDGET_SLACK``.

    >>> token_budget(100, 0.5), token_budget(41, 0.0)
    (158, 49)
    """
    return math.ceil(optimal_tokens * (1 + margin)) + BUDGET_SLACK


def optimal_answer_tokens(rows: list[dict[str, Any]], instances: list[Instance], style: PromptStyle,
                          count: Any, source: str | Path) -> list[int]:
    """Per instance, the tokens (``count``: the backend's) of its solver-optimal plan written as the answer."""
    out = []
    for row, inst in zip(rows, instances):
        plan = row.get("optimal_plan")
        if not isinstance(plan, list):
            raise ValueError(f"{source}: instance {row.get('instance_id')} has no optimal_plan, which sets its answer's "
                             "token budget; regenerate the file, or set rollout.max_new_tokens to a number")
        out.append(count(format_answer(inst, [line.split() for line in plan], style)))
    return out


@dataclass(frozen=True)
class RolloutSummary:
    """What a rollout produced: rows, rates, and where its time went."""

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


def rollout(instances_path: str | Path, out: str | Path, policy: PolicySettings = PolicySettings(),
            settings: RolloutSettings = RolloutSettings(), adapter: str | None = None, stage: int = 0,
            limit: int | None = None, backend: Any = None, progress: bool = True,
            agents: Sequence[int] | None = None) -> RolloutSummary:
    """Run the rollout and write the trajectories Parquet. ``agents``: only the instances of these agent counts;
    ``limit``: only the first instances; ``backend`` may be passed to reuse a loaded model."""
    table = read_instances(instances_path)
    rows_in = [r for r in table.to_pylist() if agents is None or r["num_agents"] in agents][:limit]
    if agents and not rows_in:  # a filter that leaves nothing is a settings mistake, not an empty file
        raise ValueError(f"{instances_path}: no instance of {sorted(agents)} agents to answer; "
                         "set evaluate.early_agents to agent counts the benchmark has")
    record = {"policy": policy.model_dump(mode="json"), "rollout": settings.model_dump(mode="json"), "adapter": adapter,
              "stage": stage, "limit": limit, "agents": None if agents is None else sorted(agents)}
    if agents == []:  # this stage scores no benchmark board (evaluate.early_agents: []): no model is loaded
        write_dataset(out, [], TRAJECTORIES, {"rollout": json.dumps(record)})
        return RolloutSummary(Path(out), 0, 0.0, 0, 0.0, 0.0, 0.0, 0.0)
    instances = parse_instances([r["instance"] for r in rows_in], instances_path)
    loading = time.perf_counter()
    backend = backend or make_backend(settings.backend, **settings.backend_options(policy.model, adapter))
    load_seconds = time.perf_counter() - loading
    conversations = [build_messages(inst, policy.prompt) for inst in instances]
    optimal = optimal_answer_tokens(rows_in, instances, policy.prompt, backend.count_tokens, instances_path)
    fixed = settings.max_new_tokens != "auto"
    budgets = [settings.max_new_tokens if fixed else token_budget(t, settings.budget_margin) for t in optimal]
    params = SamplingParams(max_new_tokens=max(budgets, default=1), temperature=settings.temperature,
                            top_p=settings.top_p, seed=settings.seed)
    start = time.perf_counter()
    with Progress(len(conversations), "rollout", "instances", progress) as bar:
        generations = backend.generate(conversations, settings.samples, params, on_progress=bar.update,
                                       budgets=budgets)
    seconds = time.perf_counter() - start
    rows = []
    for row, inst, conv, gens, budget, optimal_tokens in zip(rows_in, instances, conversations, generations, budgets,
                                                             optimal):
        prompt = json.dumps(conv)
        for j, g in enumerate(gens):
            s = score_completion(inst, g.text, row["optimal_soc"], policy.reward)
            rows.append({
                "instance_id": row["instance_id"], "content_hash": row["content_hash"], "instance_index": row["index"],
                "stage": stage, "sample_index": j, "size": row["size"], "num_agents": row["num_agents"],
                "needs_wait": row["needs_wait"], "instance": row["instance"], "prompt": prompt, "completion": g.text,
                "prompt_tokens": g.prompt_tokens, "completion_tokens": g.completion_tokens, "finish_reason": g.finish_reason,
                "token_budget": budget, "optimal_tokens": optimal_tokens,
                "parsed": s.parsed, "parse_error": s.parse_error, "plan": s.plan, "valid": s.valid, "optimal": s.optimal,
                "failure_category": s.failure, "failure_agent": s.failure_agent, "failure_step": s.failure_step,
                "soc": s.soc, "makespan": s.makespan, "optimal_soc": row["optimal_soc"], "reward": s.reward,
                "model_id": backend.model_id, "adapter_hash": backend.adapter_hash, "backend": settings.backend,
                "seed": g.seed, "latency_s": g.latency_s,
            })
    write_dataset(out, rows, TRAJECTORIES, {"rollout": json.dumps(record)})
    rate = rates(rows, means=("reward",))
    return RolloutSummary(Path(out), len(rows), seconds, sum(r["completion_tokens"] for r in rows),
                          rate["parsed"], rate["valid"], rate["optimal"], rate["reward"], load_seconds)


def write_metrics(metrics_path: str | Path, trajectories: str | Path) -> dict:
    """Validation metrics of a trajectories file (DVC metrics, headline numbers only): overall valid, optimal, parsed
    and reward rates and count; the valid rate per map size."""
    table = pq.read_table(trajectories).to_pylist()

    metrics = {"validation": rates(table, means=("reward",)), "validation_by_size": {
        str(size): {"valid": r["valid"]} for size, r in rates_by(table, "size", ("valid",)).items()}}
    atomic_write_text(metrics_path, json.dumps(metrics, indent=2))
    return metrics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_params_arguments(parser)
    parser.add_argument("--instances", required=True, type=Path, help="instances Parquet (generate-instances)")
    parser.add_argument("--out", required=True, type=Path, help="trajectories Parquet to write (atomically)")
    parser.add_argument("--adapter", default=None, help="LoRA adapter folder (PEFT) to apply")
    parser.add_argument("--stage", type=int, default=0, help="curriculum stage recorded with each row (default 0)")
    parser.add_argument("--evaluate", action="store_true",
                        help="answer as the benchmark evaluation after stage --stage: the evaluate section's budgets "
                             "(evaluate.max_new_tokens) and, before evaluate.whole_from_stage, only the boards of "
                             "evaluate.early_agents agents")
    parser.add_argument("--limit", type=int, default=None, help="only the first N instances")
    parser.add_argument("--out-metrics", type=Path, default=None, help="also write validation metrics JSON here")
    parser.add_argument("--no-progress", action="store_true", help="no progress (a bar in a terminal, else a line every 15 s)")


def run(args: argparse.Namespace) -> int:
    from policy.backends import BackendError
    from policy.devices import claim_gpu
    from policy.models import ModelNotFoundError

    started = time.perf_counter()
    try:
        if args.limit is not None and args.limit < 1:
            raise ValueError(f"--limit {args.limit}: must be at least 1")
        params = load_params(args.params, args.set)
        settings, agents = params.rollout, None
        if args.evaluate:
            settings = settings.model_copy(update={"max_new_tokens": params.evaluate.max_new_tokens})
            agents = params.evaluate.agents_for(args.stage)
        if params.rollout.backend != "openai" and agents != []:  # [] answers nothing: no model, no GPU
            claim_gpu()
        summary = rollout(args.instances, args.out, params.policy, settings, args.adapter, args.stage, args.limit,
                          progress=not args.no_progress, agents=agents)
    except (ParamsError, ValueError, ModelNotFoundError, BackendError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {summary.rows} trajectories to {summary.out} in {summary.seconds:.1f} s "
          f"({summary.tokens_per_s:.1f} completion tokens/s); parsed {summary.parsed_rate:.3f}, valid {summary.valid_rate:.3f}, "
          f"optimal {summary.optimal_rate:.3f}, mean reward {summary.mean_reward:.3f}")
    print(f"time: model loading {summary.load_seconds:.1f} s, generation {summary.seconds:.1f} s, "
          f"{time.perf_counter() - started:.1f} s since the command started")
    if args.out_metrics:
        write_metrics(args.out_metrics, args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="env-engineer rollout", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
