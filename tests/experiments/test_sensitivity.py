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
from experiments.sensitivity import combine_heldout
from experiments.sensitivity_summary import (markdown, merge, outcomes_path, read_outcomes, scored, summarise,
                                             union_outcomes, write_outcomes)
from tests.helpers import tiny_params, write_params

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


def test_heldout_files_are_combined_reindexed_and_deduplicated(tmp_path):
    a, b = heldout_files(tmp_path)
    origin = combine_heldout([a, a, b], tmp_path / "all.parquet")  # a twice: its rows are taken once
    table = pq.read_table(tmp_path / "all.parquet")
    assert table.num_rows == 10 and table.column("index").to_pylist() == list(range(10))
    assert sorted(set(origin.values())) == ["a", "b"] and len(origin) == 10
    assert table.schema.metadata == pq.read_table(a).schema.metadata


def test_sensitivity_command_runs_the_steps_and_resumes(tiny_model_dir, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    start = tmp_path / "start"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.save_pretrained(start)
    params = write_params(tmp_path / "params.yaml", tiny_params(tiny_model_dir))
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({"num_agents": 2, "budget": 4, "seed": 0, "sizes": SIZES}))
    a, b = heldout_files(tmp_path)
    args = ["sensitivity", "--params", str(params), "--start", str(start), "--configs", str(config), "--heldout", str(a),
            "--heldout", str(b), "--seeds", "0", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "s.json"),
            "--set", "train.trajectories=4", "--set", "rollout.max_new_tokens=4", "--set", "train.max_completion_length=8"]
    assert main(args) == 0
    summary = json.loads((tmp_path / "s.json").read_text())
    assert set(summary["runs"]) == {"start", "tiny/s0"} and summary["instances"] == 10
    assert summary["settings"]["seeds"] == [0] and summary["not_run"] == []
    assert (tmp_path / "s.md").read_text().startswith("Held-out instances: 10.")
    table, _ = read_outcomes(tmp_path / "s.outcomes.parquet")  # per-instance outcomes for an exact merge later
    assert set(table) == {"start", "tiny/s0"} and len(table["tiny/s0"]) == 10
    details = json.loads((tmp_path / "work" / "tiny" / "s0" / "train_details.json").read_text())
    assert "train/phase_seconds" in details  # where each run's GRPO time went
    trained = (tmp_path / "work" / "tiny" / "s0" / "adapter" / "adapter_model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    # a second run with one more seed and no budget left: nothing is recomputed, the missing run is named
    assert main(args[:args.index("--seeds")] + ["--seeds", "0,1", "--budget-s", "0"] + args[args.index("--work"):]) == 0
    assert "1 run(s) not started (tiny/s1)" in capsys.readouterr().out
    assert (tmp_path / "work" / "tiny" / "s0" / "adapter" / "adapter_model.safetensors").stat().st_mtime_ns == trained
    assert json.loads((tmp_path / "s.json").read_text())["not_run"] == ["tiny/s1"]
    assert main(args[:args.index("--seeds")] + ["--seeds", "0,x"] + args[args.index("--work"):]) == 2
    assert "--seeds" in capsys.readouterr().err
    # two at once: the missing seed runs beside the finished one, and the summary lists every run in plan order
    assert main(args[:args.index("--seeds")] + ["--seeds", "0,1", "--jobs", "2"] + args[args.index("--work"):]) == 0
    summary = json.loads((tmp_path / "s.json").read_text())
    assert list(summary["runs"]) == ["start", "tiny/s0", "tiny/s1"]
    assert summary["not_run"] == [] and summary["failed"] == [] and len(summary["noise"]) == 1
    assert main(args + ["--jobs", "0"]) == 2
    assert "--jobs 0" in capsys.readouterr().err


def test_a_failed_run_is_tried_again_alone_and_a_lasting_failure_is_reported(tmp_path, monkeypatch, capsys):
    """The steps stubbed (each command's output written at once): the train command of `b/s0` fails on its first
    call, as a run does when the GPU it shares is full; the retry finishes it. With --retries 0 it stays a failure."""
    import experiments.sensitivity as sensitivity

    calls: dict[str, int] = {}
    heldout_rows = 10

    def fake_run_once(cmd, done, log):
        if done.exists():
            return
        done.parent.mkdir(parents=True, exist_ok=True)
        step = cmd[3]
        key = f"{done.parent.parent.name}/{done.parent.name}/{step}"
        calls[key] = calls.get(key, 0) + 1
        if key == "b/s0/train" and calls[key] == 1:
            raise RuntimeError(f"`{' '.join(cmd[2:5])} ...` failed (exit 1); its output: {log}")
        if step == "rollout":
            trajectories(done, [i % 2 == 0 for i in range(heldout_rows)])
        elif step == "train":
            done.mkdir()
        else:
            done.write_bytes(b"")

    monkeypatch.setattr(sensitivity, "run_once", fake_run_once)
    monkeypatch.setattr(sensitivity, "combine_heldout", lambda files, out: {f"h{i}": "heldout" for i in range(10)})
    configs = []
    for name in ("a", "b"):
        configs.append(tmp_path / f"{name}.yaml")
        configs[-1].write_text(yaml.safe_dump({"num_agents": 2, "budget": 4, "seed": 0, "sizes": SIZES}))
    (tmp_path / "start").mkdir()
    heldout = trajectories(tmp_path / "h.parquet", [True])
    params = write_params(tmp_path / "params.yaml", {})
    base = ["sensitivity", "--params", str(params), "--start", str(tmp_path / "start"), "--configs", *map(str, configs),
            "--heldout", str(heldout), "--seeds", "0", "--jobs", "2"]
    assert main([*base, "--work", str(tmp_path / "w1"), "--out", str(tmp_path / "s1.json")]) == 0
    out = capsys.readouterr()
    assert "retry 1 of 1: b/s0" in out.out and "failed (exit 1)" in out.err
    summary = json.loads((tmp_path / "s1.json").read_text())
    assert list(summary["runs"]) == ["start", "a/s0", "b/s0"] and summary["failed"] == []
    calls.clear()
    assert main([*base, "--retries", "0", "--work", str(tmp_path / "w2"), "--out", str(tmp_path / "s2.json")]) == 0
    summary = json.loads((tmp_path / "s2.json").read_text())
    assert list(summary["runs"]) == ["start", "a/s0"] and len(summary["failed"]) == 1
    assert summary["failed"][0].startswith("b/s0: `env_engineer train")
    assert main([*base, "--retries", "-1", "--work", str(tmp_path / "w3"), "--out", str(tmp_path / "s3.json")]) == 2
    assert "--retries -1" in capsys.readouterr().err


def test_a_sequence_of_stages_trains_each_from_the_last_and_shares_the_stages_it_begins_with(tmp_path, monkeypatch):
    """`a.yaml+b.yaml` is two stages: b trains from a's adapter on b's configuration drawn with seed SEED + 1000; the
    stage `a/s0` that the sequence and the single `a` begin with is trained once; only the runs given are scored."""
    import experiments.sensitivity as sensitivity

    calls: list[tuple[str, str, list[str]]] = []

    def fake_run_once(cmd, done, log):
        if done.exists():
            return
        done.parent.mkdir(parents=True, exist_ok=True)
        calls.append((f"{done.parent.parent.name}/{done.parent.name}", cmd[3], cmd))
        if cmd[3] == "rollout":
            trajectories(done, [True] * 10)
        elif cmd[3] == "train":
            done.mkdir()
        else:
            done.write_bytes(b"")

    monkeypatch.setattr(sensitivity, "run_once", fake_run_once)
    monkeypatch.setattr(sensitivity, "combine_heldout", lambda files, out: {f"h{i}": "heldout" for i in range(10)})
    for name in ("a", "b"):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({"num_agents": 2, "budget": 4, "seed": 0, "sizes": SIZES}))
    (tmp_path / "start").mkdir()
    params = write_params(tmp_path / "params.yaml", {})
    sequence = f"{tmp_path / 'a.yaml'}+{tmp_path / 'b.yaml'}"
    assert main(["sensitivity", "--params", str(params), "--start", str(tmp_path / "start"), "--configs", sequence,
                 str(tmp_path / "a.yaml"), "--heldout", str(trajectories(tmp_path / "h.parquet", [True])), "--seeds",
                 "2", "--jobs", "2", "--work", str(tmp_path / "w"), "--out", str(tmp_path / "s.json")]) == 0
    trained = [(where, cmd) for where, step, cmd in calls if step == "train"]
    assert sorted(where for where, _ in trained) == ["a+b/s2", "a/s2"]  # a/s2 once, for both runs
    second = dict(trained)["a+b/s2"]
    assert second[second.index("--init-adapter") + 1] == str(tmp_path / "w" / "a" / "s2" / "adapter")
    assert dict(trained)["a/s2"][dict(trained)["a/s2"].index("--init-adapter") + 1] == str(tmp_path / "start")
    assert yaml.safe_load((tmp_path / "w" / "a+b" / "s2" / "config.yaml").read_text())["seed"] == 1002
    assert yaml.safe_load((tmp_path / "w" / "a" / "s2" / "config.yaml").read_text())["seed"] == 2
    scored_where = sorted(where for where, step, _ in calls if step == "rollout")
    assert scored_where == ["a+b/s2", "a/s2", "w/start"]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert list(summary["runs"]) == ["start", "a+b/s2", "a/s2"] and summary["vs_reference"]["a/s2"]
    assert summary["settings"]["configs"][0] == sequence
