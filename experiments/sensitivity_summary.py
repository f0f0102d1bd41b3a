"""The summary of a sensitivity study (``env-engineer sensitivity``, :mod:`experiments.sensitivity`) and the merge of
one run in parts.

The summary gives, per run, the valid and optimal rates (95% Wilson intervals) overall, per held-out file and per map
size; paired differences (same instances) against the starting adapter and against the first configuration with 95%
intervals; the *spread*, the best minus the worst configuration (seed means); and the *noise*, the difference between
two seeds of one configuration, i.e. what an engineer could gain per stage against what chance moves. With two or more
configurations of two or more seeds, *config_effect* weighs the configurations against the seed-to-seed variation of
the runs' valid rates: a one-way ANOVA (F test and permutation test), the seed and between-configuration standard
deviations, and seed-mean differences (against the reference, best minus worst) with 95% t intervals.

:func:`merge` joins the summaries of one study run in parts (work folders of their own, e.g. seeds added later);
each summary's per-instance outcomes (``S.outcomes.parquet``, :func:`write_outcomes`) make the join exact.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from envgen.llm.rates import rates
from experiments.stats import anova, paired_difference, permutation_p, seed_mean_difference


def scored(trajectories: Path) -> dict[str, dict[str, Any]]:
    """``content_hash -> row`` of a held-out rollout (its first sample)."""
    rows = pq.read_table(trajectories, columns=["content_hash", "sample_index", "size", "num_agents", "valid",
                                                "optimal"]).to_pylist()
    return {r["content_hash"]: r for r in rows if r["sample_index"] == 0}


def summarise(runs: dict[str, Path], origin: dict[str, str], reference: str, start: str | None) -> dict[str, Any]:
    """The summary described in the module docstring from ``run name -> held-out trajectories``; run names are
    ``<configuration>/s<seed>`` (``start`` for the starting adapter); ``reference`` is the configuration the others are
    compared against."""
    return summarise_rows({name: scored(path) for name, path in runs.items()}, origin, reference, start)


def summarise_rows(table: dict[str, dict[str, dict[str, Any]]], origin: dict[str, str], reference: str,
                   start: str | None) -> dict[str, Any]:
    """:func:`summarise` from the runs' outcomes already read: ``run name -> content_hash -> row``."""
    hashes = sorted(set.intersection(*(set(t) for t in table.values()))) if table else []
    out: dict[str, Any] = {"instances": len(hashes), "runs": {}, "vs_start": {}, "vs_reference": {}}
    for name, rows in table.items():
        ordered = [rows[h] for h in hashes]
        groups: dict[str, list] = defaultdict(list)
        for h, r in zip(hashes, ordered):
            groups[origin.get(h, "heldout")].append(r)
            groups[f"{r['num_agents']} agents, {r['size']}x{r['size']}"].append(r)
        out["runs"][name] = {g: rates(v, ("valid", "optimal"), intervals=True)
                             for g, v in {"all": ordered, **dict(sorted(groups.items()))}.items()}

    def column(name: str, key: str) -> list[bool]:
        return [bool(table[name][h][key]) for h in hashes]

    configs: dict[str, list[str]] = defaultdict(list)
    for name in table:
        if name != start:
            configs[name.split("/")[0]].append(name)
    for name in table:
        if start and name != start:
            out["vs_start"][name] = {k: paired_difference(column(name, k), column(start, k)) for k in ("valid", "optimal")}
    ref_runs = configs.get(reference, [])
    for name in table:
        if name == start or name.split("/")[0] == reference:
            continue
        partner = next((r for r in ref_runs if r.split("/")[1] == name.split("/")[1]), None)
        if partner:
            out["vs_reference"][name] = {k: paired_difference(column(name, k), column(partner, k))
                                         for k in ("valid", "optimal")}
    noise = []
    for c, rs in configs.items():
        for i in range(len(rs)):
            for j in range(i + 1, len(rs)):
                noise.append({"config": c, "runs": [rs[i], rs[j]],
                              "valid": paired_difference(column(rs[i], "valid"), column(rs[j], "valid"))})
    out["noise"] = noise
    if noise:
        out["noise_mean_abs_valid"] = sum(abs(x["valid"]["diff"]) for x in noise) / len(noise)
    out.update(across_configurations(out["runs"], reference, start))
    return out


def across_configurations(runs: dict[str, Any], reference: str, start: str | None) -> dict[str, Any]:
    """What needs only each run's overall valid rate (``runs``: run name -> its rates): the ``spread`` (best minus
    worst configuration, seed means; with two or more configurations) and the ``config_effect`` (:func:`config_effect`;
    with two or more configurations of two or more seeds)."""
    valid: dict[str, list[float]] = defaultdict(list)
    for name, r in runs.items():
        if name != start:
            valid[name.split("/")[0]].append(r["all"]["valid"])
    out: dict[str, Any] = {}
    means = {c: sum(v) / len(v) for c, v in valid.items()}
    if len(means) >= 2:
        best, worst = max(means, key=means.get), min(means, key=means.get)
        out["spread"] = {"best": best, "worst": worst, "valid": means[best] - means[worst], "config_means": means}
    effect = config_effect(dict(valid), reference)
    if effect is not None:
        out["config_effect"] = effect
    return out


OUTCOME_COLUMNS = ("content_hash", "size", "num_agents", "valid", "optimal")
Outcomes = tuple[dict[str, dict[str, dict[str, Any]]], dict[str, str]]
"""``(run -> content_hash -> outcome row, content_hash -> held-out file)``: a study's per-instance outcomes."""


def outcomes_path(summary: Path) -> Path:
    """Where the per-instance outcomes of the summary ``summary`` lie: ``S.json`` -> ``S.outcomes.parquet``."""
    return summary.with_suffix(".outcomes.parquet")


def write_outcomes(table: dict[str, dict[str, dict[str, Any]]], origin: dict[str, str], out: Path) -> None:
    """Every run's outcome on every held-out instance (``run -> content_hash -> row``, its first sample) with the
    held-out file it came from: a few hundred kB that let :func:`merge` join parts of a study exactly."""
    rows = [{"run": name, "heldout": origin.get(h, "heldout"), **{k: r[k] for k in OUTCOME_COLUMNS}}
            for name, by_hash in table.items() for h, r in by_hash.items()]
    tmp = out.with_suffix(".tmp.parquet")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    tmp.replace(out)


def read_outcomes(path: Path) -> Outcomes:
    """``(run -> content_hash -> row, content_hash -> held-out file)`` from :func:`write_outcomes`' file."""
    table: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    origin: dict[str, str] = {}
    for r in pq.read_table(path).to_pylist():
        table[r["run"]][r["content_hash"]] = {k: r[k] for k in OUTCOME_COLUMNS}
        origin[r["content_hash"]] = r["heldout"]
    return dict(table), origin


def _recipe(summary: dict[str, Any]) -> dict[str, Any]:
    """What a part's runs were trained and scored with: its params file and overrides (as its settings record them)."""
    settings = summary.get("settings", {})
    return {"params": settings.get("params"), "set": sorted(settings.get("set", []))}


def merge(summaries: list[dict[str, Any]], reference: str | None = None,
          outcomes: Outcomes | None = None) -> dict[str, Any]:
    """One summary of several summaries of the same study run in parts (work folders of their own, e.g. more seeds
    added later): the same starting adapter on the same held-out instances, so every part's ``start`` run must have
    the same rates, a run that appears in two parts the same rates in both, and every part the same params file and
    overrides (else ValueError, naming the part). Runs, their paired differences against the start, the
    against-the-reference differences and the seed-noise pairs are taken from the parts (they need two runs' outcomes
    side by side, which only a part has); the spread and the configuration effect are computed again over all runs.
    With ``outcomes`` (the parts' outcomes together, :func:`union_outcomes`) the merge is exact instead: their summary,
    every pair of runs compared on the same instances, as if one study had run them.
    ``reference`` defaults to the first part's first configuration."""
    if not summaries:
        raise ValueError("merge needs at least one summary")
    summaries = [json.loads(json.dumps(s)) for s in summaries]  # as read from JSON: intervals are lists, not tuples
    first = summaries[0]
    out: dict[str, Any] = {"instances": first["instances"], "runs": {}, "vs_start": {}, "vs_reference": {},
                           "noise": [], "not_run": [], "failed": [], "parts": []}
    recipe = _recipe(first)
    for i, part in enumerate(summaries):
        if _recipe(part) != recipe:
            raise ValueError(f"part {i + 1} trained with {_recipe(part)}, part 1 with {recipe}: merge only parts of one "
                             "recipe (the same params file and --set overrides)")
        if part["instances"] != first["instances"]:
            raise ValueError(f"part {i + 1} has {part['instances']} held-out instances, part 1 {first['instances']}: "
                             "merge only summaries of the same held-out files")
        for name, rates_ in part["runs"].items():
            if name in out["runs"] and out["runs"][name] != rates_:
                raise ValueError(f"part {i + 1}: run {name!r} differs from an earlier part's; for the start that means "
                                 "another starting adapter or other held-out instances, for a run a rerun: keep one")
            out["runs"][name] = rates_
        for key in ("vs_start", "vs_reference"):
            out[key].update(part.get(key, {}))
        out["noise"] += part.get("noise", [])
        out["not_run"] += [n for n in part.get("not_run", []) if n not in out["runs"]]
        out["failed"] += part.get("failed", [])
        out["parts"].append(part.get("settings", {}))
    if reference is None:
        configs = first.get("settings", {}).get("configs") or [n.split("/")[0] for n in first["runs"] if n != "start"]
        reference = Path(configs[0]).stem
    out["not_run"] = [n for n in dict.fromkeys(out["not_run"]) if n not in out["runs"]]
    if outcomes is not None:
        exact = _summarise_outcomes(summaries, outcomes, reference)
        return {**exact, "not_run": out["not_run"], "failed": out["failed"], "parts": out["parts"]}
    if out["noise"]:
        out["noise_mean_abs_valid"] = sum(abs(x["valid"]["diff"]) for x in out["noise"]) / len(out["noise"])
    out.update(across_configurations(out["runs"], reference, "start"))
    return out


def union_outcomes(summaries: list[dict[str, Any]], outcomes: list[Outcomes]) -> Outcomes:
    """The per-instance outcomes of several parts (each part's :func:`read_outcomes`, in the order of ``summaries``)
    together; ValueError when a part's outcomes lack a run of its summary or a run's outcomes differ between parts."""
    if len(outcomes) != len(summaries):
        raise ValueError(f"{len(outcomes)} outcome sets for {len(summaries)} parts: give one per part")
    table: dict[str, dict[str, dict[str, Any]]] = {}
    origin: dict[str, str] = {}
    for i, (rows, part_origin) in enumerate(outcomes):
        lacking = sorted(set(summaries[i]["runs"]) - set(rows))
        if lacking:
            raise ValueError(f"part {i + 1}: its outcomes lack run(s) {', '.join(lacking)} of its summary: merge "
                             "without that part's outcomes file")
        for name, by_hash in rows.items():
            if name in table and table[name] != by_hash:
                raise ValueError(f"part {i + 1}: the outcomes of run {name!r} differ from an earlier part's")
            table[name] = by_hash
        origin.update(part_origin)
    return table, origin


def _summarise_outcomes(summaries: list[dict[str, Any]], outcomes: Outcomes, reference: str) -> dict[str, Any]:
    """:func:`merge`'s exact case: the summary of the parts' outcomes, runs in the parts' configuration order, then by
    seed."""
    table, origin = outcomes
    configs = [Path(c).stem for part in summaries for c in part.get("settings", {}).get("configs", [])]
    rank = {c: i for i, c in enumerate(dict.fromkeys([*configs, *sorted(n.split("/")[0] for n in table)]))}

    def position(name: str) -> tuple[int, int]:  # runs are named <configuration>/s<seed>
        config, seed = name.split("/s")
        return rank[config], int(seed)

    order = ["start", *sorted((n for n in table if n != "start"), key=position)]
    return summarise_rows({n: table[n] for n in order if n in table}, origin, reference, "start")


def config_effect(valid: dict[str, list[float]], reference: str) -> dict[str, Any] | None:
    """Whether the configurations differ beyond seed noise, from ``configuration -> its runs' valid rates`` (one per
    seed); only configurations with at least two seeds count, and None unless at least two have them.

    ``F``, ``p_f``: one-way ANOVA of run valid rate on configuration (``df`` [k-1, N-k]; F is None when the seeds of
    every configuration agree exactly and the means differ); ``p_permutation``: the same
    F under shuffled configuration labels (:func:`permutation_p`). ``seed_sd``: standard deviation of one run's valid
    rate between seeds of one configuration (sqrt MS_within); ``between_sd``: estimated standard deviation of the
    configurations' true mean valid rates, sqrt(max(0, (MS_between - MS_within) / n0)) with n0 the effective group
    size. ``vs_reference_seed_means``: each configuration's seed mean minus the reference's, 95% t interval with the
    pooled seed variance; ``best_vs_worst``: the same for the best minus the worst seed mean."""
    from scipy import stats

    used = {c: v for c, v in valid.items() if len(v) >= 2}
    if len(used) < 2:
        return None
    groups = list(used.values())
    k, n = len(groups), sum(len(g) for g in groups)
    ms_between, ms_within, f = anova(groups)
    p_perm, count, exact = permutation_p(groups)
    n0 = (n - sum(len(g) ** 2 for g in groups) / n) / (k - 1)
    means = {c: sum(v) / len(v) for c, v in used.items()}
    best, worst = max(means, key=means.get), min(means, key=means.get)
    vs_reference = {c: seed_mean_difference(v, used[reference], ms_within, n - k)
                    for c, v in used.items() if c != reference} if reference in used else {}
    return {"configs": list(used), "k": k, "N": n, "seeds": {c: len(v) for c, v in used.items()}, "config_means": means,
            "ms_between": ms_between, "ms_within": ms_within, "F": f if math.isfinite(f) else None, "df": [k - 1, n - k],
            "p_f": float(stats.f.sf(f, k - 1, n - k)), "p_permutation": p_perm, "permutations": count,
            "permutations_exact": exact, "seed_sd": math.sqrt(ms_within), "n0": n0,
            "between_sd": math.sqrt(max(0.0, (ms_between - ms_within) / n0)), "reference": reference,
            "vs_reference_seed_means": vs_reference,
            "best_vs_worst": {"best": best, "worst": worst, **seed_mean_difference(used[best], used[worst], ms_within, n - k),
                              "note": "best and worst are picked after seeing the data, so this interval is optimistic"}}


def markdown(summary: dict[str, Any]) -> str:
    """The summary as Markdown tables (rates in percent with 95% intervals)."""
    def pct(x: float) -> str:
        return f"{100 * x:.1f}"

    runs = summary["runs"]
    groups = [g for g in next(iter(runs.values()), {}) if g != "all" and "agents," not in g]
    lines = [f"Held-out instances: {summary['instances']}.", "",
             "| run | valid (95% CI) | optimal | " + " | ".join(f"valid {g}" for g in groups) + " |",
             "|---|---|---|" + "---|" * len(groups)]
    for name, r in runs.items():
        a = r["all"]
        lines.append(f"| {name} | {pct(a['valid'])} ({pct(a['valid_ci'][0])}-{pct(a['valid_ci'][1])}) | "
                     f"{pct(a['optimal'])} | " + " | ".join(pct(r[g]["valid"]) for g in groups) + " |")
    for key, title in (("vs_start", "against the starting adapter"), ("vs_reference", "against the reference configuration")):
        if summary[key]:
            lines += ["", f"Paired difference in valid rate {title} (points, 95% CI):", ""]
            for name, d in summary[key].items():
                v = d["valid"]
                lines.append(f"- {name}: {100 * v['diff']:+.1f} ({100 * v['low']:+.1f} to {100 * v['high']:+.1f})")
    if "spread" in summary:
        s = summary["spread"]
        lines += ["", f"Spread (best - worst configuration, seed means): {100 * s['valid']:.1f} points "
                      f"({s['best']} - {s['worst']})."]
    for x in summary.get("noise", []):
        v = x["valid"]
        lines.append(f"Seed noise, {x['config']} ({' - '.join(x['runs'])}): {100 * v['diff']:+.1f} points "
                     f"({100 * v['low']:+.1f} to {100 * v['high']:+.1f}).")
    if "config_effect" in summary:
        lines += ["", *config_effect_lines(summary["config_effect"])]
    return "\n".join(lines) + "\n"


def config_effect_lines(e: dict[str, Any]) -> list[str]:
    """The configuration effect (:func:`config_effect`) as Markdown lines, differences in points."""
    def interval(d: dict[str, float]) -> str:
        return f"{100 * d['diff']:+.1f} ({100 * d['low']:+.1f} to {100 * d['high']:+.1f})"

    how = "exact over" if e["permutations_exact"] else "sampled,"
    lines = [f"Configuration effect ({e['k']} configurations with 2+ seeds, {e['N']} runs; one-way ANOVA of run valid "
             f"rate): F = {'infinite' if e['F'] is None else format(e['F'], '.2f')} (df {e['df'][0]}, {e['df'][1]}), p = {e['p_f']:.3g} (F test), "
             f"p = {e['p_permutation']:.3g} (permutation, {how} {e['permutations']} relabelings).",
             f"Seed-to-seed SD of one run's valid rate: {100 * e['seed_sd']:.1f} points; SD of the configurations' true "
             f"means: {100 * e['between_sd']:.1f} points."]
    if e["vs_reference_seed_means"]:
        lines += ["", f"Seed-mean difference in valid rate against {e['reference']} (points, 95% t interval with the "
                      f"pooled seed variance):", ""]
        lines += [f"- {c}: {interval(d)}" for c, d in e["vs_reference_seed_means"].items()]
    b = e["best_vs_worst"]
    lines += ["", f"Best - worst seed mean ({b['best']} - {b['worst']}): {interval(b)} points; optimistic, as both "
                  f"are picked after the fact."]
    return lines
