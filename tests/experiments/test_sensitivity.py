import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from envgen.core.config import EnvConfig
from envgen.formats.dataset import generate_verified, write_instances
from env_engineer.cli import main
from experiments.sensitivity_summary import (markdown, merge, outcomes_path, read_outcomes, scored, summarise,
                                             union_outcomes, write_outcomes)

SIZES = {3: {"data_ratio": 0.5, "hole_ratio": 0.2, "wait_ratio": 0.5, "min_path_length": 1},
         4: {"data_ratio": 0.5, "hole_ratio": 0.2, "wait_ratio": 0.5, "min_path_length": 1}}


def trajectories(path: Path, valid: list[bool], agents: int = 2) -> Path:
    n = len(valid)
    pq.write_table(pa.table({"content_hash": [f"h{i}" for i in range(n)], "sample_index": [0] * n,
                             "size": [3 + i % 2 for i in range(n)], "num_agents": [agents] * n, "valid": valid,
                             "optimal": valid}), path)
    return path


def test_summary_spread_noise_and_paired_differences(tmp_path):
    n = 40
    runs = {"start": trajectories(tmp_path / "start.parquet", [i % 4 == 0 for i in range(n)]),
            "uniform/s0": trajectories(tmp_path / "u0.parquet", [i % 2 == 0 for i in range(n)]),
            "uniform/s1": trajectories(tmp_path / "u1.parquet", [i % 2 == 0 or i == 1 for i in range(n)]),
            "small/s0": trajectories(tmp_path / "s0.parquet", [i % 4 != 3 for i in range(n)])}
    origin = {f"h{i}": ("a" if i < 20 else "b") for i in range(n)}
    s = summarise(runs, origin, reference="uniform", start="start")
    assert s["instances"] == n
    assert s["runs"]["start"]["all"]["valid"] == pytest.approx(0.25) and s["runs"]["small/s0"]["all"]["valid"] == 0.75
    assert set(s["runs"]["start"]) >= {"all", "a", "b", "2 agents, 3x3", "2 agents, 4x4"}
    assert s["vs_start"]["small/s0"]["valid"]["diff"] == pytest.approx(0.5)
    assert s["vs_reference"]["small/s0"]["valid"]["diff"] == pytest.approx(0.25)  # paired with uniform/s0
    assert s["spread"]["best"] == "small" and s["spread"]["worst"] == "uniform"
    assert s["spread"]["valid"] == pytest.approx(0.75 - (0.5 + 21 / 40) / 2)
    assert [x["config"] for x in s["noise"]] == ["uniform"] and s["noise_mean_abs_valid"] == pytest.approx(1 / 40)
    text = markdown(s)
    assert "| small/s0 | 75.0" in text and "Spread (best - worst configuration, seed means)" in text
    assert "config_effect" not in s and "Configuration effect" not in text  # only one configuration has two seeds


def seeded_runs(tmp_path: Path, counts: dict[str, list[int]], n: int) -> dict[str, Path]:
    """``configuration -> valid count per seed`` as runs named ``<configuration>/s<seed>`` (plus ``start``), each
    valid on its first ``count`` of ``n`` instances."""
    runs = {"start": trajectories(tmp_path / "start.parquet", [i < n // 2 for i in range(n)])}
    for config, per_seed in counts.items():
        for seed, k in enumerate(per_seed):
            runs[f"{config}/s{seed}"] = trajectories(tmp_path / f"{config}{seed}.parquet", [i < k for i in range(n)])
    return runs


def test_config_effect_separates_configurations_from_seed_noise(tmp_path):
    n = 40
    origin = {f"h{i}": "heldout" for i in range(n)}
    # far apart, seeds one instance apart: the observed split is the most extreme of the 9!/(3!)^3 = 1680 relabelings,
    # tied only by the 3! relabelings that swap whole configurations
    far = summarise(seeded_runs(tmp_path, {"a": [8, 9, 10], "b": [20, 21, 22], "c": [32, 33, 34]}, n), origin, "a", "start")
    e = far["config_effect"]
    assert e["k"] == 3 and e["N"] == 9 and e["df"] == [2, 6] and e["permutations"] == 1680 and e["permutations_exact"]
    assert e["p_permutation"] == pytest.approx(6 / 1680) and e["p_f"] < 1e-5
    # MS_within = 1/40^2 (deviations -1, 0, 1 instance in each), MS_between = 3 * (12^2 + 0 + 12^2) / 2 / 40^2
    assert e["ms_within"] == pytest.approx(1 / 1600) and e["F"] == pytest.approx(432) and e["seed_sd"] == pytest.approx(1 / 40)
    assert e["between_sd"] == pytest.approx(math.sqrt((432 - 1) / 1600 / 3))
    assert e["vs_reference_seed_means"]["c"]["diff"] == pytest.approx(0.6) and e["vs_reference_seed_means"]["c"]["low"] > 0.5
    assert (e["best_vs_worst"]["best"], e["best_vs_worst"]["worst"]) == ("c", "a") and "optimistic" in e["best_vs_worst"]["note"]
    # the same nine run rates dealt out so every configuration gets a low, a middle and a high one: no effect
    same = summarise(seeded_runs(tmp_path, {"a": [8, 20, 34], "b": [9, 22, 33], "c": [10, 21, 32]}, n), origin, "a", "start")
    e = same["config_effect"]
    assert e["F"] < 0.1 and e["p_permutation"] > 0.9 and e["p_f"] > 0.9 and e["between_sd"] == 0.0
    assert all(d["low"] < 0 < d["high"] for d in e["vs_reference_seed_means"].values())


def test_config_effect_by_hand_and_in_markdown(tmp_path):
    n = 10
    origin = {f"h{i}": "heldout" for i in range(n)}
    # reference a: 0.3, 0.5; b: 0.6, 0.7, 0.9; c has one seed and is left out
    s = summarise(seeded_runs(tmp_path, {"a": [3, 5], "b": [6, 7, 9], "c": [4]}, n), origin, "a", "start")
    e = s["config_effect"]
    a, b = [0.3, 0.5], [0.6, 0.7, 0.9]
    ms_within = (sum((x - 0.4) ** 2 for x in a) + sum((x - 2.2 / 3) ** 2 for x in b)) / (5 - 2)  # = 1/45
    ms_between = (2 * (0.4 - 0.6) ** 2 + 3 * (2.2 / 3 - 0.6) ** 2) / (2 - 1)  # = 2/15
    assert e["configs"] == ["a", "b"] and e["N"] == 5 and e["df"] == [1, 3]
    assert abs(e["ms_within"] - ms_within) < 1e-9 and abs(e["ms_between"] - ms_between) < 1e-9
    assert e["F"] == pytest.approx(6.0) and e["n0"] == pytest.approx(2.4)
    assert e["between_sd"] == pytest.approx(math.sqrt((ms_between - ms_within) / 2.4))
    # two groups: the F test is the pooled two-sample t test (t^2 = F), p = P(|T_3| >= sqrt 6)
    from scipy import stats
    assert e["p_f"] == pytest.approx(stats.ttest_ind(b, a).pvalue)
    # of the 10 ways to pick 2 of the 5 rates, {0.3, 0.5} and {0.7, 0.9} give the largest mean gap
    assert e["p_permutation"] == pytest.approx(2 / 10) and e["permutations"] == 10
    d = e["vs_reference_seed_means"]["b"]
    half = 3.182446305284263 * math.sqrt(ms_within * (1 / 3 + 1 / 2))  # t_{0.975, 3}
    true_difference = 2.2 / 3 - 0.4
    assert abs(d["diff"] - true_difference) < 1e-9 and d["df"] == 3
    assert abs(d["low"] - (true_difference - half)) < 1e-9 and abs(d["high"] - (true_difference + half)) < 1e-9
    assert d["low"] < true_difference < d["high"]
    text = markdown(s)
    assert "F = 6.00 (df 1, 3)" in text and "p = 0.2 (permutation, exact over 10 relabelings)" in text
    assert "Seed-to-seed SD of one run's valid rate: 14.9 points" in text
    assert f"- b: +33.3 ({100 * (true_difference - half):+.1f} to {100 * (true_difference + half):+.1f})" in text
    assert json.loads(json.dumps(s))["config_effect"]["p_permutation"] == pytest.approx(0.2)
    # no reference with two seeds: no reference differences, the rest stays
    e = summarise(seeded_runs(tmp_path, {"a": [3, 5], "b": [6, 7, 9], "c": [4]}, n), origin, "c", "start")["config_effect"]
    assert e["vs_reference_seed_means"] == {} and e["F"] == pytest.approx(6.0)


def test_a_study_run_in_parts_merges_into_the_summary_of_all_its_runs(tmp_path):
    n = 40
    origin = {f"h{i}": "heldout" for i in range(n)}
    counts = {"a": [8, 9, 11], "b": [20, 21, 22], "c": [12, 15, 10]}
    runs = seeded_runs(tmp_path, counts, n)
    whole = summarise(runs, origin, "a", "start")
    seeds01 = {k: v for k, v in runs.items() if not k.endswith("/s2")}
    seed2 = {k: v for k, v in runs.items() if k == "start" or k.endswith("/s2")}
    parts = [summarise(seeds01, origin, "a", "start"), summarise(seed2, origin, "a", "start")]
    merged = merge(parts, "a")
    assert merged["runs"] == json.loads(json.dumps(whole["runs"]))
    assert merged["vs_start"] == json.loads(json.dumps(whole["vs_start"]))
    assert merged["spread"]["valid"] == pytest.approx(whole["spread"]["valid"]) and merged["spread"]["best"] == "b"
    # the configuration effect needs only the runs' rates: the same over the parts as over the whole
    for key in ("F", "p_f", "p_permutation", "seed_sd", "between_sd", "df"):
        assert merged["config_effect"][key] == pytest.approx(whole["config_effect"][key]), key
    assert "config_effect" not in parts[1]  # one seed per configuration alone says nothing about seed noise
    # seed-noise pairs need two runs' outcomes side by side: only those within one part
    assert {tuple(x["runs"]) for x in merged["noise"]} == {(f"{c}/s0", f"{c}/s1") for c in counts}
    # the reference defaults to the first part's first configuration (the runs' order when no settings are stored)
    assert merge(parts)["config_effect"]["reference"] == "a"

    other_start = summarise({**seed2, "start": trajectories(tmp_path / "o.parquet", [True] * n)}, origin, "a", "start")
    with pytest.raises(ValueError, match="part 2: run 'start' differs"):
        merge([parts[0], other_start])
    other_recipe = {**parts[1], "settings": {"params": "params.yaml", "set": ["train.learning_rate=0.0002"]}}
    with pytest.raises(ValueError, match="part 2 trained with .*learning_rate"):
        merge([{**parts[0], "settings": {"params": "params.yaml", "set": []}}, other_recipe])
    fewer = summarise({k: trajectories(tmp_path / f"f{i}.parquet", [True] * 10) for i, k in enumerate(seed2)},
                      {f"h{i}": "heldout" for i in range(10)}, "a", "start")
    with pytest.raises(ValueError, match="part 2 has 10 held-out instances"):
        merge([parts[0], fewer])


def test_parts_with_their_outcomes_merge_exactly(tmp_path):
    n = 40
    origin = {f"h{i}": ("a" if i < 20 else "b") for i in range(n)}
    runs = seeded_runs(tmp_path, {"u": [8, 9, 11], "v": [20, 21, 22]}, n)
    whole = summarise(runs, origin, "u", "start")
    names = [["start", "u/s0", "u/s1", "v/s0"], ["start", "v/s1", "u/s2", "v/s2"]]
    parts, outcomes = [], []
    for i, part in enumerate(names):
        path = tmp_path / f"part{i}.outcomes.parquet"
        write_outcomes({k: scored(runs[k]) for k in part}, origin, path)
        outcomes.append(read_outcomes(path))
        parts.append(summarise({k: runs[k] for k in part}, origin, "u", "start"))
    exact = merge(parts, "u", union_outcomes(parts, outcomes))
    assert list(exact["runs"]) == list(whole["runs"])  # start, then by configuration and seed
    for key in ("runs", "vs_start", "vs_reference", "noise", "spread", "config_effect"):
        assert json.loads(json.dumps(exact[key])) == json.loads(json.dumps(whole[key])), key
    # from the summaries alone, the pairs that cross parts are missing
    assert len(merge(parts, "u")["noise"]) < len(whole["noise"]) == 6
    bad = read_outcomes(tmp_path / "part1.outcomes.parquet")
    bad[0]["start"]["h0"] = {**bad[0]["start"]["h0"], "valid": not bad[0]["start"]["h0"]["valid"]}
    with pytest.raises(ValueError, match="outcomes of run 'start' differ"):
        union_outcomes(parts, [outcomes[0], bad])
    del bad[0]["v/s2"]
    with pytest.raises(ValueError, match="part 2: its outcomes lack run.s. v/s2"):
        union_outcomes(parts, [outcomes[0], bad])


def test_sensitivity_merge_command(tmp_path, capsys):
    n = 40
    origin = {f"h{i}": "heldout" for i in range(n)}
    runs = seeded_runs(tmp_path, {"a": [8, 9], "b": [20, 22]}, n)
    part = tmp_path / "part.json"
    part.write_text(json.dumps(summarise(runs, origin, "a", "start")))
    out = tmp_path / "merged.json"
    assert main(["sensitivity-merge", str(part), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["config_effect"]["k"] == 2 and "Configuration effect" in out.with_suffix(".md").read_text()
    assert "merged from the summaries" in capsys.readouterr().out and not outcomes_path(out).exists()
    write_outcomes({k: scored(v) for k, v in runs.items()}, origin, outcomes_path(part))
    assert main(["sensitivity-merge", str(part), "--out", str(out)]) == 0
    assert "exact" in capsys.readouterr().out.splitlines()[-1]
    assert read_outcomes(outcomes_path(out)) == read_outcomes(outcomes_path(part))  # merged again, exactly
    assert main(["sensitivity-merge", str(tmp_path / "missing.json"), "--out", str(out)]) == 2
    assert "missing.json does not exist" in capsys.readouterr().err


def heldout_files(tmp_path: Path) -> tuple[Path, Path]:
    paths = []
    for name, budget, seed in (("a", 6, 31), ("b", 4, 32)):
        config = EnvConfig.model_validate({"num_agents": 2, "budget": budget, "seed": seed, "sizes": SIZES})
        write_instances(tmp_path / f"{name}.parquet", generate_verified(config), config)
        paths.append(tmp_path / f"{name}.parquet")
    return paths[0], paths[1]


def config_file(path: Path, share3: float, budget: int = 4) -> Path:
    sizes = {3: {**SIZES[3], "data_ratio": share3}, 4: {**SIZES[4], "data_ratio": round(1 - share3, 4)}}
    path.write_text(yaml.safe_dump({"num_agents": 2, "budget": budget, "seed": 0, "sizes": sizes}))
    return path


def test_a_sequence_is_planned_as_the_pipeline_with_its_first_configuration_and_the_rest_replayed(tmp_path):
    """`dvc exp run -S` with a plan's words gives the params file that the settings checker builds from the same
    overrides: the first configuration as the whole env section (seed the run's), the rest as the oracle's replay,
    one curriculum stage per configuration; sequences that begin alike share a group, so their first stage runs once."""
    from dvc.utils.hydra import apply_overrides

    from experiments.dvc import set_words
    from experiments.plan import sensitivity_plan
    from experiments.sensitivity import read_sequences
    from pipeline.params import load_params
    from tests.helpers import ROOT

    a, b = config_file(tmp_path / "a.yaml", 0.5), config_file(tmp_path / "b.yaml", 0.8)
    sequences = read_sequences([str(tmp_path / "a.yaml"), f"{a}+{b}+{b}"])
    assert list(sequences) == ["a", "a+b+b"] and [len(v) for v in sequences.values()] == [1, 3]
    plan = sensitivity_plan(sequences, [0, 7])
    assert [e.name for e in plan] == ["sens-a-s0", "sens-a-s7", "sens-a+b+b-s0", "sens-a+b+b-s7"]
    assert plan[0].group == plan[2].group == ("a", 0) and plan[1].group != plan[0].group
    params = tmp_path / "params.yaml"
    params.write_text((ROOT / "presets" / "gpu-distill.yaml").read_text())  # the plan replaces its engineer.replay
    item = plan[3]
    apply_overrides(str(params), [w for w in set_words(dict(item.sets)) if w != "-S"])
    written = load_params(params)
    assert written.model_dump() == load_params(ROOT / "presets" / "gpu-distill.yaml", dict(item.sets)).model_dump()
    assert written.env == EnvConfig.load(a).model_copy(update={"seed": 7})
    assert written.engineer.engineer == "oracle" and len(written.engineer.replay) == 2
    assert written.engineer.replay[0][3].data_ratio == 0.8 and [c.stage for c in written.curriculum] == [0, 1, 2]
    with pytest.raises(ValueError, match="budget"):
        sensitivity_plan({"x": [EnvConfig.load(a), EnvConfig.load(config_file(tmp_path / "c.yaml", 0.5, budget=8))]}, [0])
    with pytest.raises(ValueError, match="nope.yaml does not exist"):
        read_sequences([f"{a}+{tmp_path / 'nope.yaml'}"])


EVALUATE = """import json, sys, pathlib, yaml, pyarrow as pa, pyarrow.parquet as pq
k = int(sys.argv[1])
sizes = yaml.safe_load(open(f"data/stages/{k}/config.yaml"))["sizes"]
share = float({int(n): v for n, v in sizes.items()}[3]["data_ratio"])
hashes = pq.read_table("data/benchmark/instances.parquet").column("content_hash").to_pylist()
valid = [i < round(10 * share) + k for i in range(len(hashes))]
d = pathlib.Path(f"data/stages/{k}")
pq.write_table(pa.table({"content_hash": hashes, "num_agents": [2] * 10, "size": [3] * 10, "valid": valid,
                         "optimal": valid}), d / "benchmark.parquet")
(d / "benchmark_metrics.json").write_text(json.dumps({"bench": {"acc/2_agents": sum(valid) / 10}}))
"""

STAGES_SCRIPT = """import sys, pathlib, yaml, pyarrow as pa, pyarrow.parquet as pq
p = yaml.safe_load(open("params.yaml"))
if sys.argv[1] == "benchmark":
    pathlib.Path("data/benchmark").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"content_hash": [f"h{i}" for i in range(10)], "wait_subset": [0.5] * 10}),
                   "data/benchmark/instances.parquet")
elif sys.argv[1] == "init":
    pathlib.Path("data/stages/0").mkdir(parents=True, exist_ok=True)
    pathlib.Path("data/stages/0/config.yaml").write_text(yaml.safe_dump(p["env"]))
else:  # engineer-config K NEXT: the oracle's replay[K]
    k, nxt = int(sys.argv[2]), sys.argv[3]
    pathlib.Path(f"data/stages/{nxt}").mkdir(parents=True, exist_ok=True)
    replay = p["engineer"]["replay"]
    pathlib.Path(f"data/stages/{nxt}/config.yaml").write_text(yaml.safe_dump({"sizes": replay[min(k, len(replay) - 1)]}))
"""


def test_sensitivity_runs_its_sequences_as_dvc_experiments_and_summarises_their_last_stage(tmp_path, capsys):
    """A stand-in pipeline with the real stage names (benchmark, init-curriculum, evaluate@K, engineer-config@K) whose
    benchmark answers are valid in proportion to the 3x3 share of the stage's configuration (plus one per stage):
    `env-engineer sensitivity --run` queues one DVC experiment per sequence, the stage a sequence begins with runs
    once per seed, and the summary compares the last stages' answers."""
    import subprocess

    from tests.experiments.test_compare import dvc_env

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "ev.py").write_text(EVALUATE)
    (repo / "st.py").write_text(STAGES_SCRIPT)
    params = yaml.safe_load((Path(__file__).resolve().parents[2] / "presets" / "gpu-distill.yaml").read_text())
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {
        "benchmark": {"cmd": "python st.py benchmark", "outs": ["data/benchmark/instances.parquet"]},
        "init-curriculum": {"cmd": "python st.py init", "params": ["env"],
                            "outs": [{"data/stages/0/config.yaml": {"cache": False}}]},
        "evaluate": {"foreach": "${curriculum}", "do": {
            "cmd": "python ev.py ${item.stage}", "deps": ["data/benchmark/instances.parquet",
                                                          "data/stages/${item.stage}/config.yaml"],
            "outs": ["data/stages/${item.stage}/benchmark.parquet"],
            "metrics": [{"data/stages/${item.stage}/benchmark_metrics.json": {"cache": False}}]}},
        "engineer-config": {"foreach": "${curriculum}", "do": {
            "cmd": "python st.py engineer ${item.stage} ${item.next}", "params": ["engineer"],
            "deps": ["data/stages/${item.stage}/benchmark.parquet"],
            "outs": [{"data/stages/${item.next}/config.yaml": {"cache": False}}]}},
    }}, sort_keys=False))
    env = dvc_env()
    for cmd in (["git", "init", "-q"], ["git", "config", "user.email", "t@example.org"], ["git", "config", "user.name", "t"],
                ["dvc", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "pipeline"]):
        subprocess.run(cmd, cwd=repo, check=True, env=env)
    a, b = config_file(tmp_path / "a.yaml", 0.5), config_file(tmp_path / "b.yaml", 0.8)
    out = tmp_path / "s.json"
    args = ["sensitivity", "--repo", str(repo), "--configs", str(a), str(b), f"{a}+{b}", "--seeds", "0", "--out", str(out)]
    assert main(args + ["--run", "--jobs", "2"]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    # a group per first configuration; only a's has two members (a, a+b), so only it runs a shared stage first
    assert "wave 1: 1 experiment(s)" in printed and "wave 2: 3 experiment(s)" in printed
    git = lambda *a: subprocess.run(["git", *a], cwd=repo, capture_output=True, text=True, env=env).stdout  # noqa: E731
    assert "shares: benchmark" in git("log", "-1", "--format=%s") and git("status", "--porcelain", "dvc.lock") == ""
    summary = json.loads(out.read_text())
    valid = {name: run["all"]["valid"] for name, run in summary["runs"].items()}
    assert valid == {"a/s0": 0.5, "b/s0": 0.8, "a+b/s0": 0.9}  # a+b: its second stage, on b, one better than b's first
    assert summary["spread"]["best"] == "a+b" and summary["spread"]["worst"] == "a"
    assert summary["vs_reference"]["a+b/s0"]["valid"]["diff"] == pytest.approx(0.4)
    assert summary["settings"]["seeds"] == [0] and summary["not_run"] == []
    table, origin = read_outcomes(outcomes_path(out))
    assert set(table) == {"a/s0", "b/s0", "a+b/s0"} and set(origin.values()) == {"wait 0.5"}
    log = subprocess.run(["dvc", "queue", "logs", "sens-a+b-s0"], cwd=repo, capture_output=True, text=True, env=env).stdout
    assert "Running stage 'evaluate@1'" in log and "Running stage 'evaluate@0'" not in log, log[-2000:]
    capsys.readouterr()
    assert main(args) == 0  # only collects: the same summary
    assert json.loads(out.read_text())["runs"].keys() == summary["runs"].keys()
    assert main(args[:-2] + ["--seeds", "x", "--out", str(out)]) == 2 and "--seeds" in capsys.readouterr().err
