"""``env-engineer report``: one self-contained HTML file (and its PNGs) about a curriculum run. Works offline: every
image is embedded, there is no script and no external address. The run's files are found through ``dvc.yaml``
(:func:`run_files`), so the report reads what the pipeline declares.

Sections: benchmark curves per stage (Sum over sizes per agent count, with the reference planners); training curves
(warm-start loss and GRPO reward per step, per stage); validation valid rate per stage and size (heatmap); the last stage's benchmark per agent count and size (heatmap); the configuration's
evolution (per-size data share, hole ratio, wait ratio across stages); failure breakdowns per stage; the engineers'
rationales and validation notes; rendered failure cases; the engineer comparison when given (each engineer's
curve across stages with 95% intervals, the tables of `env-engineer compare`: differences from `fixed` paired by
seed, the environments each engineer chose); the sensitivity study when given.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import sys
from pathlib import Path
from typing import Any


from envgen.core import safe_yaml
from envgen.core.files import atomic_write_bytes, atomic_write_text
from experiments.dvc import StageFiles, curriculum_items, pipeline_stages, stage_named


def run_files(stages: list[StageFiles]) -> list[dict[str, Any]]:
    """Per curriculum stage, the files of its run as ``dvc.yaml`` declares them: ``config`` (generate-instances' params
    file), ``train`` (train's metrics), ``sft_history`` and ``grpo_history`` (train's plots), ``validation`` and
    ``trajectories`` (rollout's metrics and Parquet), ``bench`` and ``tables`` (evaluate's whole table and markdown), ``summary`` (summarize-failures' JSON), ``engineer`` (the
    engineer's log). The stage after the last gets the engineer's proposed ``config`` alone."""
    out = []
    items = curriculum_items(stages)
    for item in items:
        def pick(step: str, kind: str, suffix: str = "") -> str | None:
            s = stage_named(stages, step, item)
            if s is None:
                return None
            paths = {"metrics": s.metrics, "outs": s.outs, "params": s.params_files, "plots": s.plots}[kind]
            return next((p for p in paths if p.endswith(suffix)), None)

        out.append({"stage": int(item) if item.isdigit() else item, "config": pick("generate-instances", "params", ".yaml"),
                    "train": pick("train", "metrics"), "sft_history": pick("train", "plots", "sft_history.json"),
                    "grpo_history": pick("train", "plots", "grpo_history.json"), "validation": pick("validate", "metrics"),
                    "trajectories": pick("validate", "outs", ".parquet"), "bench": pick("evaluate", "outs", "_table.json"),
                    "tables": pick("evaluate", "outs", ".md"), "summary": pick("summarize-failures", "outs", ".json"),
                    "engineer": pick("engineer-config", "outs", ".json")})
    last = stage_named(stages, "engineer-config", items[-1]) if items else None
    proposal = next((p for p in last.outs if p.endswith(".yaml")), None) if last else None
    if proposal and out and isinstance(out[-1]["stage"], int):
        out.append({"stage": out[-1]["stage"] + 1, "config": proposal})
    return out


def load_run(root: Path, files: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Everything a report needs, per stage: the JSON files read, the configuration as a mapping, the paths of the
    trajectories and tables (files not there are simply absent)."""
    out = []
    for spec in files:
        entry: dict[str, Any] = {"stage": spec["stage"]}
        for key in ("summary", "validation", "bench", "train", "engineer", "sft_history", "grpo_history"):
            path = spec.get(key) and root / spec[key]
            if path and path.exists():
                entry[key] = json.loads(path.read_text())
        config = spec.get("config") and root / spec["config"]
        if config and config.exists():
            entry["config"] = safe_yaml.read(config)
        for key in ("trajectories", "tables"):
            path = spec.get(key) and root / spec[key]
            if path and path.exists():
                entry[key] = path
        out.append(entry)
    return out


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def figures(run: list[dict[str, Any]]) -> dict[str, bytes]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figs: dict[str, bytes] = {}
    trained = [e for e in run if "bench" in e]
    if trained:
        fig, ax = plt.subplots(figsize=(6.5, 3.6))
        agents = sorted({a for e in trained for a in e["bench"]["bench_table"]}, key=int)
        for i, a in enumerate(agents):  # a stage before evaluate.whole_from_stage scores some agent counts only
            scored = [e for e in trained if a in e["bench"]["bench_table"]]
            xs = [e["stage"] for e in scored]
            ax.plot(xs, [100 * e["bench"]["bench_table"][a]["sum"]["acc"] for e in scored], "o-", color=f"C{i}", label=f"{a} agents: valid")
            ax.plot(xs, [100 * e["bench"]["bench_table"][a]["sum"]["opt"] for e in scored], "s--", color=f"C{i}", alpha=0.6, label=f"{a} agents: optimal")
            for name, style in (("prioritized", ":"), ("independent", "-.")):
                ref = (trained[-1]["bench"].get("reference") or {}).get(name, {}).get(a)
                if ref:
                    ax.axhline(100 * ref["sum"]["acc"], color=f"C{i}", linestyle=style, linewidth=0.8)
        ax.set_xlabel("stage")
        ax.set_ylabel("benchmark rate, % (Sum over sizes)")
        ax.set_ylim(-2, 102)
        ax.set_xticks([e["stage"] for e in trained])
        ax.legend(fontsize=7, ncol=2)
        ax.set_title("Benchmark per stage (dotted: prioritized planner, dash-dot: independent)", fontsize=9)
        figs["benchmark_curves"] = _png(fig)

        last = trained[-1]["bench"]["bench_table"]
        sizes = sorted({int(n) for a in last.values() for n in a["sizes"]})
        grid = np.full((len(agents), len(sizes)), np.nan)
        for i, a in enumerate(agents):
            for j, n in enumerate(sizes):
                cell = last.get(a, {}).get("sizes", {}).get(str(n))
                if cell:
                    grid[i, j] = 100 * cell["acc"]
        figs["benchmark_heatmap"] = _heatmap(grid, [f"{a} agents" for a in agents], [f"{n}x{n}" for n in sizes],
                                             f"Benchmark valid rate after stage {trained[-1]['stage']}, %")
    curves = [e for e in run if e.get("sft_history") or e.get("grpo_history")]
    if curves:
        figs["training_curves"] = training_curves(curves)
    validated = [e for e in run if "validation" in e]
    if validated:
        sizes = sorted({int(n) for e in validated for n in e["validation"]["validation_by_size"]})
        grid = np.array([[100 * e["validation"]["validation_by_size"].get(str(n), {}).get("valid", np.nan) for n in sizes] for e in validated])
        figs["validation_heatmap"] = _heatmap(grid, [f"stage {e['stage']}" for e in validated], [f"{n}x{n}" for n in sizes],
                                              "Validation valid rate, %")
    configs = [e for e in run if "config" in e]
    if configs:
        fig, axes = plt.subplots(1, 3, figsize=(10, 3.0), sharex=True)
        sizes = sorted({int(n) for e in configs for n in e["config"]["sizes"]})
        xs = [e["stage"] for e in configs]
        for j, (knob, title) in enumerate((("share", "data share"), ("hole_ratio", "hole ratio"), ("wait_ratio", "wait ratio"))):
            for i, n in enumerate(sizes):
                ys = []
                for e in configs:
                    s = e["config"]["sizes"]
                    total = sum(v["data_ratio"] for v in s.values()) or 1
                    k = s.get(n) or s.get(str(n))
                    ys.append(np.nan if k is None else (k["data_ratio"] / total if knob == "share" else k[knob]))
                axes[j].plot(xs, ys, "o-", color=f"C{i % 10}", label=f"{n}x{n}")
            axes[j].set_title(title, fontsize=9)
            axes[j].set_xlabel("stage")
            axes[j].set_xticks(xs)
            axes[j].set_ylim(-0.02, (0.5 if knob == "hole_ratio" else 1.0) + 0.02)  # the knob's whole range
        axes[2].legend(fontsize=7, ncol=2)
        fig.suptitle("Configuration per stage (the last one is the engineer's proposal for the next stage)", fontsize=9)
        figs["config_evolution"] = _png(fig)
    summaries = [e for e in run if "summary" in e and e["summary"].get("stage", -1) >= 0]
    if summaries:
        cats = sorted({c for e in summaries for c in e["summary"]["validation"]["overall"]["failures"]} |
                      {f"unreadable:{c}" for e in summaries for c in e["summary"]["validation"]["overall"]["parse_errors"]})
        fig, ax = plt.subplots(figsize=(6.5, 3.2))
        bottom = np.zeros(len(summaries))
        for i, cat in enumerate(cats + ["valid"]):
            vals = []
            for e in summaries:
                o = e["summary"]["validation"]["overall"]
                vals.append(100 * (o["valid"] if cat == "valid" else o["parse_errors"].get(cat.split(":", 1)[1], 0) if cat.startswith("unreadable:")
                                   else o["failures"].get(cat, 0)))
            palette = ["C0", "C1", "C3", "C4", "C5", "C6", "C7", "C8", "C9"]  # green is kept for valid answers
            color = "tab:green" if cat == "valid" else palette[i % len(palette)]
            ax.bar([str(e["stage"]) for e in summaries], vals, bottom=bottom, label=cat, color=color)
            bottom += np.array(vals)
        ax.set_xlabel("stage")
        ax.set_ylabel("% of validation answers")
        ax.legend(fontsize=7, bbox_to_anchor=(1.02, 1), loc="upper left")
        ax.set_title("Outcome of validation answers per stage", fontsize=9)
        figs["failures"] = _png(fig)
    return figs


def training_curves(run: list[dict[str, Any]]) -> bytes:
    """Supervised loss and GRPO mean reward (and valid rate) per optimizer step, one line per stage."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2))
    for i, e in enumerate(run):
        sft, grpo = e.get("sft_history") or [], e.get("grpo_history") or []
        if sft:
            left.plot([r["step"] for r in sft], [r["loss"] for r in sft], "-", color=f"C{i % 10}", label=f"stage {e['stage']}")
        if grpo:
            right.plot([r["step"] for r in grpo], [r["reward"] for r in grpo], "o-", color=f"C{i % 10}", markersize=3,
                       label=f"stage {e['stage']}: reward")
            right.plot([r["step"] for r in grpo], [r["valid"] for r in grpo], ":", color=f"C{i % 10}",
                       label=f"stage {e['stage']}: valid rate")
    left.set_title("supervised (distillation) loss per step", fontsize=9)
    left.set_xlabel("step")
    right.set_title("GRPO mean reward and valid rate per step", fontsize=9)
    right.set_xlabel("step")
    right.set_ylim(-0.02, 1.02)
    for ax in (left, right):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no 0.25 ticks for a 2-step stage
        if ax.lines:
            ax.legend(fontsize=7)
    return _png(fig)


def _heatmap(grid, rows: list[str], cols: list[str], title: str) -> bytes:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.0 + 0.7 * len(cols), 0.8 + 0.45 * len(rows)))
    im = ax.imshow(grid, vmin=0, vmax=100, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(cols)), cols, fontsize=8)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    for i in range(len(rows)):
        for j in range(len(cols)):
            if grid[i, j] == grid[i, j]:
                ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", color="w" if grid[i, j] < 60 else "k", fontsize=7)
    fig.colorbar(im, ax=ax, fraction=0.04)
    ax.set_title(title, fontsize=9)
    return _png(fig)


def failure_cases(run: list[dict[str, Any]], limit: int = 4) -> list[tuple[str, bytes]]:
    """PNG renders of failed validation answers of the last stage whose trajectories are on disk."""
    import pyarrow.parquet as pq

    from envgen.core.instance import Instance
    from envgen.core.render import render_png
    from envgen.core.simulate import moves_to_paths

    for e in reversed(run):
        path = e.get("trajectories")
        if path is None:
            continue
        out = []
        for row in pq.read_table(path).to_pylist():
            if row["valid"] or not row["parsed"] or len(out) >= limit:
                continue
            inst = Instance.from_str(row["instance"])
            plan = [line.split() for line in row["plan"]]
            try:
                paths = [[c for c in p if 0 <= c[0] < inst.height and 0 <= c[1] < inst.width] for p in moves_to_paths(inst, plan)]
            except ValueError:
                continue
            title = f"stage {e['stage']}: {row['failure_category']} (agent {row['failure_agent']}, step {row['failure_step']})"
            out.append((title, render_png(inst, paths=paths, cell_px=40, title=title)))
        return out
    return []


def _img(data: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'


def _md_table(text: str) -> str:
    """The markdown tables this project writes, as HTML (headings, pipes; nothing else)."""
    out, rows = [], []

    def flush():
        if rows:
            head, *body = rows
            out.append("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in head) + "</tr>" +
                       "".join("<tr>" + "".join(f"<td>{html.escape(c).replace('**', '')}</td>" for c in r) + "</tr>" for r in body) + "</table>")
            rows.clear()

    for line in text.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if not all(set(c) <= set("-: ") for c in cells):
                rows.append(cells)
        else:
            flush()
            if line.startswith("#"):
                out.append(f"<h4>{html.escape(line.lstrip('#').strip())}</h4>")
            elif line.strip():
                out.append(f"<p>{html.escape(line)}</p>")
    flush()
    return "\n".join(out)


def sensitivity_figure(summary: dict[str, Any]) -> bytes:
    """Held-out valid rate per hand-set configuration: each seed's run (dots), the configuration's mean (bar) and the
    starting adapter (dashed line), from an ``env-engineer sensitivity`` summary."""
    import matplotlib.pyplot as plt

    runs = summary["runs"]
    configs: dict[str, list[float]] = {}
    for name, r in runs.items():
        if name != "start":
            configs.setdefault(name.split("/")[0], []).append(100 * r["all"]["valid"])
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = list(configs)
    ax.bar(range(len(names)), [sum(v) / len(v) for v in configs.values()], color="C0", alpha=0.5, label="mean over seeds")
    for i, values in enumerate(configs.values()):
        ax.plot([i] * len(values), values, "ko", ms=4, label="one seed" if i == 0 else None)
    if "start" in runs:
        ax.axhline(100 * runs["start"]["all"]["valid"], color="C3", ls="--", label="starting adapter")
    ax.set_xticks(range(len(names)), names, rotation=15)
    ax.set_ylabel("held-out valid (%)")
    ax.set_title(f"One stage per environment, {summary['instances']} held-out instances")
    ax.legend(fontsize=8, loc="lower right")
    return _png(fig)


def comparison_figure(table: dict[str, Any]) -> bytes | None:
    """Each engineer's curve across curriculum stages from an ``env-engineer compare`` table: one panel per headline
    metric (two-agent validation, then the benchmark Sum of each agent count), mean across seeds with its 95%
    t-interval; None when no arm has per-stage results."""
    staged = {arm: row["stages"] for arm, row in table.items() if row.get("stages")}
    keys = sorted({k for st in staged.values() for m in st.values() for k in m if k.startswith(("acc/", "val/valid"))},
                  key=lambda k: (not k.startswith("val/"), k))
    if not keys:
        return None
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.0), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for i, (arm, st) in enumerate(staged.items()):
            points = sorted((int(k), m[key]) for k, m in st.items() if key in m)
            if points:
                x = [k + 0.04 * (i - len(staged) / 2) for k, _ in points]  # side by side, so the intervals stay apart
                bars = [100 * m["ci95"] if m["ci95"] is not None else 0.0 for _, m in points]  # one seed: no bar
                ax.errorbar(x, [100 * m["mean"] for _, m in points], yerr=bars,
                            marker="o", ms=3, capsize=2, label=arm)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("stage")
        ax.set_xticks(sorted({int(k) for st in staged.values() for k in st}))
    axes[0][0].set_ylabel("percent (mean, 95% interval over seeds)")
    axes[0][-1].legend(fontsize=7)
    return _png(fig)


def stage_count(n: int) -> str:
    """``1 stage``, ``2 stages``."""
    return f"{n} stage{'' if n == 1 else 's'}"


def build_report(run: list[dict[str, Any]], out: Path, comparison: Path | None = None, title: str = "env-engineer run",
                 source: str = ".", sensitivity: Path | None = None) -> list[Path]:
    """Write the HTML report of ``run`` (:func:`load_run`) to ``out`` and its PNGs beside it; returns the files. With
    ``sensitivity`` (an ``env-engineer sensitivity`` summary JSON) the report shows how much one stage's environment
    moved the policy: the spread between configurations against the seed noise."""
    figs = figures(run)
    sens = json.loads(sensitivity.read_text()) if sensitivity is not None else None
    if sens is not None:
        figs["sensitivity"] = sensitivity_figure(sens)
    compared = json.loads(comparison.read_text()) if comparison is not None and comparison.exists() else None
    if compared is not None and "arms" in compared:  # what `compare` writes; earlier files hold the arms alone
        compared = compared["arms"]
    curves = comparison_figure(compared) if compared else None
    if curves is not None:
        figs["comparison"] = curves
    cases = failure_cases(run)
    assets = out.with_suffix("").with_name(out.stem + "_assets")
    written = []
    for name, data in list(figs.items()) + [(f"failure_{i}", d) for i, (_, d) in enumerate(cases)]:
        atomic_write_bytes(assets / f"{name}.png", data)
        written.append(assets / f"{name}.png")
    parts = [f"<h1>{html.escape(title)}</h1>",
             f"<p>{stage_count(len([e for e in run if 'train' in e]))} trained, in {html.escape(source)}.</p>"]
    captions = {"benchmark_curves": "Benchmark curves", "training_curves": "Training curves",
                "benchmark_heatmap": "Benchmark by agents and size",
                "validation_heatmap": "Validation by stage and size", "config_evolution": "Configuration evolution",
                "failures": "Failure breakdown"}
    for key, caption in captions.items():
        if key in figs:
            parts.append(f"<h2>{caption}</h2>{_img(figs[key], caption)}")
    last_bench = next((e for e in reversed(run) if "tables" in e), None)
    if last_bench is not None:
        parts.append(f"<h2>Benchmark tables after stage {last_bench['stage']}</h2>" + _md_table(last_bench["tables"].read_text()))
    rows = []
    for e in run:
        log = e.get("engineer")
        if log:
            notes = "; ".join(log.get("notes") or []) or "none"
            rows.append(f"<tr><td>{e['stage']}</td><td>{html.escape(str(log.get('engineer')))} / {html.escape(str(log.get('context')))}"
                        f"</td><td>{html.escape(log.get('rationale') or '-')}</td><td>{html.escape(notes)}</td>"
                        f"<td>{'yes' if log.get('fallback') else 'no'}</td></tr>")
    if rows:
        parts.append("<h2>The engineer's decisions</h2><table><tr><th>stage</th><th>engineer / context</th><th>rationale</th>"
                     "<th>validation notes</th><th>kept previous</th></tr>" + "".join(rows) + "</table>")
    if cases:
        parts.append("<h2>Failure cases</h2>" + "".join(f"<figure>{_img(d, t)}<figcaption>{html.escape(t)}</figcaption></figure>" for t, d in cases))
    for e in run:
        ex = (e.get("summary") or {}).get("examples") or []
        if ex:
            items = "".join(f"<li><b>{x['size']}x{x['size']}, {x['num_agents']} agents</b>: {html.escape(x['verdict'])}"
                            f"<pre>{html.escape(x['board'])}</pre>answer: <code>{html.escape(x['answer'])}</code></li>" for x in ex[:4])
            parts.append(f"<h3>Sampled failed answers, stage {e['stage']}</h3><ul>{items}</ul>")
    if compared is not None:
        from experiments.compare import render

        parts.append("<h2>Engineer comparison</h2>" + (_img(curves, "engineers across stages") if curves else "")
                     + _md_table(render(compared)))
    if sens is not None:
        from experiments.sensitivity_summary import config_effect_lines, markdown

        lines = [line for line in markdown(sens).splitlines() if line.startswith("|")]
        spread = sens.get("spread") or {}
        noise = sens.get("noise_mean_abs_valid")
        said = (f"Best minus worst configuration (seed means): {100 * spread['valid']:.1f} points "
                f"({html.escape(spread['best'])} - {html.escape(spread['worst'])})" if spread else "")
        if noise is not None:
            said += f"; two seeds of one configuration differ by {100 * noise:.1f} points on average"
        parts.append("<h2>How much one stage's environment can matter (sensitivity)</h2>"
                     + _img(figs["sensitivity"], "sensitivity") + f"<p>{said}.</p>" + _md_table("\n".join(lines)))
        if "config_effect" in sens:  # configurations against seed noise (several seeds per configuration)
            parts.append(_md_table("\n".join(config_effect_lines(sens["config_effect"]))))
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}img{max-width:100%}"
             "table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;padding:3px 7px}"
             "pre{background:#f4f4f4;padding:4px;display:inline-block}figure{display:inline-block;margin:8px}")
    document = f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>{style}</style></head><body>{''.join(parts)}</body></html>"
    atomic_write_text(out, document)
    return [out, *written]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repo", type=Path, default=Path("."), help="the pipeline's repository (default: here); the "
                        "files are those its dvc.yaml declares")
    parser.add_argument("--comparison", type=Path, default=None, help="comparison.json from `env-engineer compare`")
    parser.add_argument("--out", type=Path, default=Path("reports/report.html"),
                        help="HTML file to write (default: %(default)s, ignored by git); PNGs go to <name>_assets/")
    parser.add_argument("--title", default="env-engineer run")
    parser.add_argument("--sensitivity", type=Path, default=None,
                        help="summary JSON of `env-engineer sensitivity` to show beside the run")


def run(args: argparse.Namespace) -> int:
    from experiments.dvc import DvcError

    try:
        run_ = load_run(args.repo, run_files(pipeline_stages(args.repo)))
    except (DvcError, OSError, ValueError) as e:
        print(f"error: {args.repo}: cannot read the pipeline ({e})", file=sys.stderr)
        return 2
    if not any(len(e) > 2 for e in run_):
        print(f"error: {args.repo}: no stage has results yet (run the pipeline first: dvc repro)", file=sys.stderr)
        return 2
    if args.sensitivity is not None and not args.sensitivity.exists():
        print(f"error: --sensitivity {args.sensitivity}: no such file (a summary JSON of `env-engineer sensitivity`)",
              file=sys.stderr)
        return 2
    files = build_report(run_, args.out, args.comparison, args.title, str(args.repo.resolve()), args.sensitivity)
    print(f"wrote {files[0]} and {len(files) - 1} PNG(s)")
    return 0
