"""``env-engineer results``: a run's headline numbers in a terminal, 100 columns wide.

Per curriculum stage: the held-out validation rates, the benchmark Sums per agent count, what training did, and the
engineer's decision (the knobs it changed for the next stage, and why); then where the report is and which DVC
commands hold the same numbers. ``--experiments`` prints one row per DVC experiment instead (its last stage), as
``dvc exp show`` would with every column but these dropped. The files are the ones ``dvc.yaml`` declares
(:func:`experiments.report.run_files`), so this reads what the pipeline wrote and nothing else.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path
from typing import Any

from experiments.dvc import DvcError, pipeline_stages
from experiments.report import load_run, run_files


def pct(value: Any) -> str:
    return f"{100 * value:.1f}%" if isinstance(value, (int, float)) else "-"


def decision(entry: dict[str, Any], following: dict[str, Any] | None) -> str:
    """The engineer's decision after a stage, in words: what changed between this stage's configuration and the next,
    and its rationale."""
    log = entry.get("engineer")
    if not log:
        return "no decision yet"
    if log.get("fallback"):
        what = "kept the previous configuration"
    else:
        before = (entry.get("config") or {}).get("sizes") or {}
        after = ((following or {}).get("config") or {}).get("sizes") or {}
        changes = []
        for size in sorted(set(before) | set(after), key=int):
            a, b = before.get(size) or {}, after.get(size) or {}
            for knob in ("data_ratio", "hole_ratio", "wait_ratio", "min_path_length"):
                if a.get(knob) != b.get(knob):
                    changes.append(f"{size}x{size} {knob.replace('_ratio', '')} {a.get(knob, '-')} -> {b.get(knob, '-')}")
        what = ", ".join(changes[:6]) + (f" and {len(changes) - 6} more" if len(changes) > 6 else "") \
            if changes else "no change"
    why = " ".join(str(log.get("rationale") or "").split())
    return f"{log.get('engineer', '?')}: {what}" + (f"; why: {why}" if why else "")


def render_run(run: list[dict[str, Any]], width: int = 100) -> str:
    """The per-stage table and the decisions, every line at most ``width`` characters."""
    trained = [e for e in run if "validation" in e or "bench" in e or "train" in e]
    if not trained:
        return "no stage has run yet: `dvc repro` runs the curriculum; `dvc status` shows what is left"
    agents = sorted({a for e in trained for a in ((e.get("bench") or {}).get("bench_table") or {})}, key=int)
    head = f"{'stage':<6}{'valid':>8}{'optimal':>9}" + "".join(f"{a + ' agents':>11}" for a in agents) + \
        f"{'train loss':>12}{'train valid':>13}"
    lines = ["Validation: held-out two-agent boards. Benchmark: valid Sum over sizes per agent count.", "",
             head[:width], "-" * min(width, len(head))]
    for e in trained:
        v = (e.get("validation") or {}).get("validation") or {}
        table = (e.get("bench") or {}).get("bench_table") or {}
        t = e.get("train") or {}
        loss = t.get("sft/loss_last")
        row = f"{e['stage']!s:<6}{pct(v.get('valid')):>8}{pct(v.get('optimal')):>9}" + "".join(
            f"{pct((table.get(a) or {}).get('sum', {}).get('acc')):>11}" for a in agents) + \
            f"{(f'{loss:.3f}' if isinstance(loss, (int, float)) else '-'):>12}{pct(t.get('train/valid_rate')):>13}"
        lines.append(row[:width])
    lines += ["", "The engineer's decisions:"]
    for e, nxt in zip(run, run[1:] + [None]):
        if "engineer" in e or "validation" in e:
            text = f"after stage {e['stage']}: {decision(e, nxt)}"
            lines += textwrap.wrap(text, width, subsequent_indent="    ")
    return "\n".join(lines)


def render_experiments(records: list[dict[str, Any]], stages: list, width: int = 100) -> str:
    """One row per experiment: its name, engineer and seed, and its last stage's numbers."""
    from experiments.records import last_stage_result

    rows = []
    for rec in records:
        result = last_stage_result(rec, stages)
        params = rec.get("params") or {}
        rows.append((rec.get("name") or "?", (params.get("engineer") or {}).get("engineer", "?"),
                     (params.get("train") or {}).get("seed", "?"), result))
    if not rows:
        return "no DVC experiments at this commit: `dvc exp run` or `env-engineer compare --run` makes some"
    keys = sorted({k for *_, r in rows if r for k in r if k.startswith(("acc/", "val/valid"))})
    head = f"{'experiment':<24}{'engineer':<13}{'seed':>5}" + "".join(f"{k:>13}" for k in keys)
    lines = [head[:width], "-" * min(width, len(head))]
    for name, engineer, seed, result in rows:
        cells = "".join(f"{pct((result or {}).get(k)):>13}" for k in keys)
        lines.append(f"{name[:23]:<24}{str(engineer)[:12]:<13}{seed!s:>5}{cells}"[:width])
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repo", type=Path, default=Path("."), help="the pipeline's repository (default: here)")
    parser.add_argument("--experiments", action="store_true",
                        help="one row per DVC experiment at this commit (its last stage) instead of this run's stages")
    parser.add_argument("--width", type=int, default=100, help="the widest line (default %(default)s)")
    parser.add_argument("--upto", type=int, default=None, metavar="K",
                        help="only the stages up to K (the run so far)")


def run(args: argparse.Namespace) -> int:
    if args.width < 60:
        print(f"error: --width {args.width}: give at least 60", file=sys.stderr)
        return 2
    try:
        stages = pipeline_stages(args.repo)
        if args.experiments:
            from experiments.records import experiment_records
            from experiments.dvc import experiments_shown

            print(render_experiments(experiment_records(experiments_shown(args.repo)), stages, args.width))
            print("\nThe source: dvc exp show (every column), dvc exp show --only-changed")
            return 0
        run = load_run(args.repo, run_files(stages))
        if args.upto is not None:  # the stages up to K, and the configuration K's engineer wrote
            run = [e for e in run if not isinstance(e["stage"], int) or e["stage"] <= args.upto + 1]
            run = [e if e["stage"] != args.upto + 1 else {"stage": e["stage"], "config": e.get("config")} for e in run]
        print(render_run(run, args.width))
    except (DvcError, OSError, ValueError) as e:
        print(f"error: {str(e)[:300]}", file=sys.stderr)
        return 2
    print()
    print(textwrap.fill("The report: env-engineer report (reports/report.html). The sources: dvc metrics show, "
                        "dvc plots show, dvc params diff, env-engineer diff-configs A B.", args.width))
    return 0
