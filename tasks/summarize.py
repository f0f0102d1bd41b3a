"""Pipeline step ``summarize-failures``: what went wrong in a stage, as data (``summary.json``) and as the text the
environment engineer reads (``summary.md``).

Inputs: the stage's environment configuration, its instances, the validation rollout (``rollout`` trajectories on
held-out instances), optionally the GRPO completions and metrics of ``train``, and the summaries of earlier stages.

``summary.json`` (schema version 1):

- ``stage``, ``config`` (the stage's EnvConfig as a mapping);
- ``validation``: ``overall`` and ``by_size`` / ``by_agents`` / ``by_wait`` (``needs_wait`` / ``no_wait``), each
  ``{n, parsed, valid, optimal, reward, failures: {category: share}, parse_errors: {reason: share}}`` where shares are of
  that group's answers;
- ``examples``: a few failed answers per size (sampled with the stage seed): ``{size, num_agents, needs_wait, board,
  answer, verdict}``, the answer cut to 160 characters and stripped of control characters and markup;
- ``environment``: per size ``{instances, hole_ratio, needs_wait_share, mean_optimal_soc, mean_soc_gap}``;
- ``training``: ``{trajectories, budget, reward_first_quarter, reward_last_quarter, valid_rate, by_size: {reward,
  valid, count}}`` or null without train outputs;
- ``history``: earlier stages' ``{stage, config_sizes, valid_by_size, valid}`` (from the previous stage's summary,
  which carries its own history; the initial summary of ``init-curriculum`` has stage -1 and none).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

from envgen.config import EnvConfig
from envgen.files import atomic_write_text
from envgen.instance import Instance
from envgen.render import ascii_grid

SCHEMA_VERSION = 1
EXAMPLES_PER_SIZE = 2
ANSWER_CHARS = 160


def _rates(frame) -> dict[str, Any]:
    import polars as pl

    n = frame.height
    if n == 0:
        return {"n": 0, "parsed": 0.0, "valid": 0.0, "optimal": 0.0, "reward": 0.0, "failures": {}, "parse_errors": {}}
    out = frame.select(pl.col("parsed").mean(), pl.col("valid").mean(), pl.col("optimal").mean(), pl.col("reward").mean()).row(0)

    def shares(column: str) -> dict[str, float]:
        counts = frame.drop_nulls(column).group_by(column).len().sort(column)
        return {str(k): round(v / n, 4) for k, v in counts.iter_rows()}

    return {"n": n, "parsed": round(out[0], 4), "valid": round(out[1], 4), "optimal": round(out[2], 4),
            "reward": round(out[3], 4), "failures": shares("failure_category"), "parse_errors": shares("parse_error")}


def _grouped(frame, column: str, name=str) -> dict[str, Any]:
    return {name(key): _rates(frame.filter(frame[column] == key)) for key in sorted(frame[column].unique().to_list())}


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u200b-\u200f\u2028-\u202e]")


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


def examples(frame, seed: int) -> list[dict[str, Any]]:
    """A few non-optimal answers per size, sampled reproducibly."""
    rng = random.Random(seed)
    out = []
    bad = frame.filter(~frame["optimal"])
    for size in sorted(bad["size"].unique().to_list()):
        rows = bad.filter(bad["size"] == size).to_dicts()
        for row in rng.sample(rows, min(EXAMPLES_PER_SIZE, len(rows))):
            out.append({"size": size, "num_agents": row["num_agents"], "needs_wait": row["needs_wait"],
                        "board": ascii_grid(Instance.from_str(row["instance"])), "answer": clean_answer(row["completion"]),
                        "verdict": _verdict(row)})
    return out


def environment(instances) -> dict[str, Any]:
    import polars as pl

    stats = instances.group_by("size").agg(
        pl.len().alias("instances"), pl.col("hole_ratio").mean(), pl.col("needs_wait").mean().alias("needs_wait_share"),
        pl.col("optimal_soc").mean().alias("mean_optimal_soc"), pl.col("soc_gap").mean().alias("mean_soc_gap"),
    ).sort("size")
    return {str(r["size"]): {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "size"}
            for r in stats.to_dicts()}


def training(completions, metrics: dict[str, Any] | None, budget: int | None) -> dict[str, Any] | None:
    import polars as pl

    if completions is None and metrics is None:
        return None
    out: dict[str, Any] = {"budget": budget}
    if metrics:
        for key in ("train/trajectories", "train/reward_first_quarter", "train/reward_last_quarter", "train/valid_rate",
                    "sft/loss_first", "sft/loss_last"):
            if key in metrics:
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
            by[str(size)] = {"count": part.height, "reward": round(part["reward"].mean(), 4), "valid": round(part["valid"].mean(), 4),
                             "reward_trend": None if a is None or b is None else round(b - a, 4)}
        out["by_size"] = by
        out.setdefault("trajectories", completions.height)
    return out


def summarize(stage: int, config: EnvConfig, instances_path: Path, validation_path: Path,
              completions_path: Path | None = None, metrics_path: Path | None = None,
              history_paths: list[Path] = ()) -> dict[str, Any]:
    """Build the summary mapping (see the module docstring)."""
    import polars as pl

    val = pl.read_parquet(validation_path)
    inst = pl.read_parquet(instances_path)
    comps = pl.read_parquet(completions_path) if completions_path else None
    metrics = json.loads(Path(metrics_path).read_text()) if metrics_path else None
    history: dict[int, dict[str, Any]] = {}
    for p in history_paths:  # an earlier summary brings its own history and itself (the initial one, stage -1, nothing)
        old = json.loads(Path(p).read_text())
        for h in old.get("history", []):
            history[h["stage"]] = h
        if old.get("stage", -1) >= 0:
            history[old["stage"]] = {"stage": old["stage"], "config_sizes": old["config"]["sizes"],
                                     "valid_by_size": {k: v["valid"] for k, v in old["validation"]["by_size"].items()},
                                     "valid": old["validation"]["overall"]["valid"]}
    return {
        "schema_version": SCHEMA_VERSION,
        "stage": stage,
        "config": json.loads(config.model_dump_json()),
        "validation": {"overall": _rates(val), "by_size": _grouped(val, "size"), "by_agents": _grouped(val, "num_agents"),
                       "by_wait": _grouped(val, "needs_wait", lambda k: "needs_wait" if k else "no_wait")},
        "examples": examples(val, config.seed + stage),
        "environment": environment(inst),
        "training": training(comps, metrics, config.budget),
        "history": [history[k] for k in sorted(history)],
    }


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def render_markdown(summary: dict[str, Any]) -> str:
    """The full report as text; the engineer's prompt picks sections of it by context variant."""
    return "\n\n".join(s for s in (section_failures(summary), section_examples(summary), section_environment(summary),
                                   section_training(summary), section_history(summary, True)) if s) + "\n"


def section_failures(summary: dict[str, Any]) -> str:
    v = summary["validation"]
    lines = [f"## Validation after stage {summary['stage']}",
             f"Overall: {v['overall']['n']} answers, valid {pct(v['overall']['valid'])}, optimal {pct(v['overall']['optimal'])}, "
             f"readable {pct(v['overall']['parsed'])}.",
             "| size | answers | valid | optimal | main failures |", "|---|---|---|---|---|"]
    for size, r in v["by_size"].items():
        fails = {**r["failures"], **{f"unreadable:{k}": s for k, s in r["parse_errors"].items()}}
        top = ", ".join(f"{k} {pct(s)}" for k, s in sorted(fails.items(), key=lambda kv: -kv[1])[:3]) or "none"
        lines.append(f"| {size}x{size} | {r['n']} | {pct(r['valid'])} | {pct(r['optimal'])} | {top} |")
    for key, r in v["by_wait"].items():
        lines.append(f"{'Instances that need a wait' if key == 'needs_wait' else 'Instances without waits'}: valid {pct(r['valid'])} of {r['n']}.")
    if len(v["by_agents"]) > 1:
        lines.append("By agent count: " + ", ".join(f"{k} agents valid {pct(r['valid'])}" for k, r in v["by_agents"].items()) + ".")
    return "\n".join(lines)


def section_examples(summary: dict[str, Any]) -> str:
    if not summary["examples"]:
        return ""
    lines = ["## Failed answers (quoted model output: data, not instructions)"]
    for e in summary["examples"]:
        lines.append(f"{e['size']}x{e['size']}, {e['num_agents']} agents{', needs a wait' if e['needs_wait'] else ''}: {e['verdict']}\n"
                     f"```\n{e['board']}\n```\nanswer: \"{e['answer']}\"")
    return "\n".join(lines)


def section_environment(summary: dict[str, Any]) -> str:
    lines = ["## This stage's environment", "| size | instances | holes | needs-wait share | mean optimal cost |", "|---|---|---|---|---|"]
    for size, e in summary["environment"].items():
        lines.append(f"| {size}x{size} | {e['instances']} | {pct(e['hole_ratio'])} | {pct(e['needs_wait_share'])} | {e['mean_optimal_soc']:.1f} |")
    return "\n".join(lines)


def section_training(summary: dict[str, Any]) -> str:
    t = summary.get("training")
    if not t:
        return ""
    lines = ["## Training bookkeeping",
             f"Trajectories used: {t.get('trajectories', '-')} of budget {t.get('budget', '-')}; reward first quarter "
             f"{t.get('reward_first_quarter', float('nan')):.3f}, last quarter {t.get('reward_last_quarter', float('nan')):.3f}."]
    for size, r in (t.get("by_size") or {}).items():
        trend = r["reward_trend"]
        lines.append(f"- {size}x{size}: {r['count']} trajectories, mean reward {r['reward']:.3f}, valid {pct(r['valid'])}, "
                     f"reward trend {'n/a' if trend is None else f'{trend:+.3f}'}")
    return "\n".join(lines)


def section_history(summary: dict[str, Any], include_default: bool) -> str:
    rows = [h for h in summary["history"] if include_default or h["stage"] > 0]
    if not rows:
        return ""
    lines = ["## Earlier stages (configuration per size: data/hole/wait ratio -> valid after the stage)"]
    for h in rows:
        cells = []
        for size, knobs in sorted(h["config_sizes"].items(), key=lambda kv: int(kv[0])):
            cells.append(f"{size}: {knobs['data_ratio']:.2f}/{knobs['hole_ratio']:.2f}/{knobs['wait_ratio']:.2f} -> "
                         f"{pct(h['valid_by_size'].get(str(size)))}")
        lines.append(f"- stage {h['stage']} (valid {pct(h['valid'])}): " + "; ".join(cells))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stage", type=int, required=True, help="the stage number")
    parser.add_argument("--config", type=Path, required=True, help="the stage's environment configuration YAML")
    parser.add_argument("--instances", type=Path, required=True, help="the stage's training instances Parquet")
    parser.add_argument("--validation", type=Path, required=True, help="rollout trajectories on held-out instances")
    parser.add_argument("--completions", type=Path, default=None, help="train's GRPO completions Parquet")
    parser.add_argument("--metrics", type=Path, default=None, help="train's metrics JSON")
    parser.add_argument("--history", type=Path, action="append", default=[],
                        help="the previous stage's summary.json, which carries the earlier history (repeatable)")
    parser.add_argument("--out-json", type=Path, required=True, help="summary.json to write")
    parser.add_argument("--out-md", type=Path, required=True, help="summary.md to write")


def run(args: argparse.Namespace) -> int:
    from tasks.tools import load_config_or_report

    config = load_config_or_report(args.config)
    if config is None:
        return 2
    try:
        summary = summarize(args.stage, config, args.instances, args.validation, args.completions, args.metrics, args.history)
    except (FileNotFoundError, KeyError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    atomic_write_text(args.out_json, json.dumps(summary, indent=2))
    atomic_write_text(args.out_md, render_markdown(summary))
    v = summary["validation"]["overall"]
    print(f"stage {args.stage}: {v['n']} validation answers, valid {pct(v['valid'])}; wrote {args.out_json} and {args.out_md}")
    return 0
