"""Pipeline step ``summarize-failures``: what went wrong in a stage, as data (``summary.json``) and as the text the
environment engineer reads (``summary.md``); the format is :class:`engineers.summary.Summary`.

Inputs: the stage's environment configuration, its instances, the validation rollout (``rollout`` trajectories on
held-out instances), optionally the GRPO completions and metrics of ``train``, and the previous stage's summary, which
carries the history before it.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from pathlib import Path
from typing import Any

from engineers.summary import (ANSWER_CHARS, Example, Rates, SizeEnvironment, SizeTraining, Summary, Training,
                               Validation, pct)
from envgen.core.config import ConfigError, EnvConfig
from envgen.core.files import atomic_write_text
from envgen.core.instance import Instance
from envgen.llm.rates import OUTCOMES
from envgen.llm.rates import rates as outcome_rates
from envgen.core.render import ascii_grid

EXAMPLES_PER_SIZE = 2
VALIDATION_COLUMNS = ["size", "num_agents", "needs_wait", "instance", "completion", "parsed", "parse_error", "valid",
                      "optimal", "failure_category", "failure_agent", "failure_step", "soc", "optimal_soc", "reward"]
INSTANCE_COLUMNS = ["size", "hole_ratio", "needs_wait", "optimal_soc", "soc_gap"]
COMPLETION_COLUMNS = ["step", "size", "reward", "valid"]
"""The columns each input must have (the steps that wrote them: rollout, generate-instances, train)."""
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u200b-\u200f\u2028-\u202e]")


def rates(frame) -> Rates:
    """Outcome shares of a frame of trajectories."""
    n = frame.height
    shares = outcome_rates(frame.select(*OUTCOMES, "reward").to_dicts(), means=("reward",))

    def breakdown(column: str) -> dict[str, float]:
        counts = frame.drop_nulls(column).group_by(column).len().sort(column)
        return {str(k): round(v / n, 4) for k, v in counts.iter_rows()}

    return Rates(n=n, **{k: round(shares[k], 4) for k in (*OUTCOMES, "reward")},
                 failures=breakdown("failure_category") if n else {}, parse_errors=breakdown("parse_error") if n else {})


def _grouped(frame, column: str, name=str) -> dict[str, Rates]:
    return {name(key): rates(frame.filter(frame[column] == key)) for key in sorted(frame[column].unique().to_list())}


def clean_answer(text: str | None) -> str:
    """A model answer made safe to quote: one line, no control characters or markup, at most ``ANSWER_CHARS``."""
    text = _CONTROL.sub(" ", text or "")
    text = re.sub(r"</?\w+>|`", " ", text)
    text = " ".join(text.split())
    return text if len(text) <= ANSWER_CHARS else text[: ANSWER_CHARS - 1] + "…"


def _verdict(row: dict[str, Any]) -> str:
    if not row["parsed"]:
        return f"unreadable ({row['parse_error']})"
    if row["valid"]:
        return f"valid, sum of costs {row['soc']} vs optimal {row['optimal_soc']}"
    return f"{row['failure_category']} by agent {row['failure_agent']} at step {row['failure_step']}"


def examples(frame, seed: int) -> list[Example]:
    """A few non-optimal answers per size, sampled reproducibly."""
    rng = random.Random(seed)
    out = []
    bad = frame.filter(~frame["optimal"])
    for size in sorted(bad["size"].unique().to_list()):
        rows = bad.filter(bad["size"] == size).to_dicts()
        for row in rng.sample(rows, min(EXAMPLES_PER_SIZE, len(rows))):
            out.append(Example(size=size, num_agents=row["num_agents"], needs_wait=row["needs_wait"],
                               board=ascii_grid(Instance.from_str(row["instance"])), answer=clean_answer(row["completion"]),
                               verdict=_verdict(row)))
    return out


def environment(instances) -> dict[str, SizeEnvironment]:
    import polars as pl

    stats = instances.group_by("size").agg(
        pl.len().alias("instances"), pl.col("hole_ratio").mean(), pl.col("needs_wait").mean().alias("needs_wait_share"),
        pl.col("optimal_soc").mean().alias("mean_optimal_soc"), pl.col("soc_gap").mean().alias("mean_soc_gap"),
    ).sort("size")
    return {str(r["size"]): SizeEnvironment(**{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "size"})
            for r in stats.to_dicts()}


def training(completions, metrics: dict[str, Any] | None, budget: int | None) -> Training | None:
    import polars as pl

    if completions is None and metrics is None:
        return None
    out: dict[str, Any] = {"budget": budget}
    for key in ("train/trajectories", "train/reward_first_quarter", "train/reward_last_quarter", "train/valid_rate",
                "sft/loss_first", "sft/loss_last"):
        if metrics and key in metrics:
            out[key.split("/", 1)[1] if key.startswith("train/") else key.replace("/", "_")] = metrics[key]
    if completions is not None and completions.height:
        steps = completions["step"].max()
        half = completions.filter(pl.col("step") > steps // 2)
        first = completions.filter(pl.col("step") <= steps // 2)
        by = {}
        for size in sorted(completions["size"].unique().to_list()):
            a = first.filter(pl.col("size") == size)["reward"].mean()
            b = half.filter(pl.col("size") == size)["reward"].mean()
            part = completions.filter(pl.col("size") == size)
            by[str(size)] = SizeTraining(count=part.height, reward=round(part["reward"].mean(), 4),
                                         valid=round(part["valid"].mean(), 4),
                                         reward_trend=None if a is None or b is None else round(b - a, 4))
        out["by_size"] = by
        out.setdefault("trajectories", completions.height)
    return Training(**out)


def summarize(stage: int, config: EnvConfig, instances_path: Path, validation_path: Path,
              completions_path: Path | None = None, metrics_path: Path | None = None,
              previous: Summary | None = None) -> Summary:
    """The stage's :class:`Summary` (see :mod:`engineers.summary`)."""
    import polars as pl

    from envgen.formats.dataset import read_parquet
    from envgen.core.files import expect_mapping, read_json
    from envgen.formats.schemas import COMPLETIONS, INSTANCES, TRAJECTORIES

    val = pl.from_arrow(read_parquet(validation_path, "a validation rollout (trajectories)", VALIDATION_COLUMNS,
                                     TRAJECTORIES))
    inst = pl.from_arrow(read_parquet(instances_path, "the stage's instances", INSTANCE_COLUMNS, INSTANCES))
    comps = pl.from_arrow(read_parquet(completions_path, "the stage's GRPO completions", COMPLETION_COLUMNS,
                                       COMPLETIONS)) if completions_path else None
    metrics = expect_mapping(read_json(metrics_path, "train metrics JSON"), metrics_path, "train metrics JSON") \
        if metrics_path else None
    validation = Validation(overall=rates(val), by_size=_grouped(val, "size"), by_agents=_grouped(val, "num_agents"),
                            by_wait=_grouped(val, "needs_wait", lambda k: "needs_wait" if k else "no_wait"))
    return Summary(stage=stage, config=config, validation=validation, examples=examples(val, config.seed + stage),
                   environment=environment(inst), training=training(comps, metrics, config.budget),
                   history=previous.as_history() if previous is not None else [])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stage", type=int, required=True, help="the stage number")
    parser.add_argument("--config", type=Path, required=True, help="the stage's environment configuration YAML")
    parser.add_argument("--instances", type=Path, required=True, help="the stage's training instances Parquet")
    parser.add_argument("--validation", type=Path, required=True, help="rollout trajectories on held-out instances")
    parser.add_argument("--completions", type=Path, default=None, help="train's GRPO completions Parquet")
    parser.add_argument("--metrics", type=Path, default=None, help="train's metrics JSON")
    parser.add_argument("--history", type=Path, default=None,
                        help="the previous stage's summary.json, which carries the earlier history")
    parser.add_argument("--out-json", type=Path, required=True, help="summary.json to write")
    parser.add_argument("--out-md", type=Path, required=True, help="summary.md to write")


def run(args: argparse.Namespace) -> int:
    try:
        config = EnvConfig.load(args.config)
        previous = Summary.read(args.history) if args.history else None
        summary = summarize(args.stage, config, args.instances, args.validation, args.completions, args.metrics, previous)
    except (ConfigError, FileNotFoundError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    atomic_write_text(args.out_json, summary.to_json())
    atomic_write_text(args.out_md, summary.render_markdown())
    v = summary.validation.overall
    print(f"stage {args.stage}: {v.n} validation answers, valid {pct(v.valid)}; wrote {args.out_json} and {args.out_md}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="env-engineer summarize-failures", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
