import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from experiments.compare import render
from experiments.plan import comparison_plan, shared_stages, unrestorable, waves
from experiments.records import (aggregate, config_summary, experiment_records, last_stage_result, missing, stage_config,
                                 workspace_records)
from experiments.runner import queue_args
from experiments.dvc import StageFiles, dvc_env


def stage(name: str, metrics: str) -> StageFiles:
    return StageFiles(name=name, deps=(), params_files=(), outs=(), metrics=(metrics,), plots=())


STAGES = [stage(f"{step}@{k}", f"data/stages/{k}/{file}") for k in (0, 1)
          for step, file in (("validate", "validation_metrics.json"), ("evaluate", "benchmark_metrics.json"))]
CURRICULUM = [{"stage": 0, "prev": "init", "next": 1}, {"stage": 1, "prev": 0, "next": 2}]


def test_comparison_aggregate_with_confidence_intervals():
    plan = comparison_plan(["heuristic", "fixed"], [0, 1, 2])
    assert len(plan) == 6 and plan[0].sets["engineer.engineer"] == "heuristic" and plan[0].sets["train.seed"] == 0
    assert queue_args(plan[0], {"train.trajectories": 64})[:5] == ["exp", "run", "--queue", "-n", "cmp-heuristic-s0"]
    assert "++train.trajectories=64" in queue_args(plan[0], {"train.trajectories": 64})
    show = [{"rev": "workspace", "experiments": None},
            {"rev": "abc", "experiments": [{"revs": [{"name": p.name, "data": {
                "params": {"params.yaml": {"data": {"train": {"seed": p.seed}, "curriculum": CURRICULUM}}},
                "metrics": {"data/stages/0/benchmark_metrics.json": {"data": {"bench": {"acc/3_agents": 0.0}}},
                            "data/stages/1/benchmark_metrics.json": {"data": {"bench": {"acc/3_agents": 0.1 * (i + 1)},
                                                                              "bench_size": {"3_agents/3x3": 0.5}}}}}}]}
                for i, p in enumerate(plan)]}]
    table = aggregate(experiment_records(show), plan, STAGES)
    assert table["heuristic"]["seeds"] == [0, 1, 2]
    assert table["heuristic"]["metrics"]["acc/3_agents"]["mean"] == pytest.approx(0.2)  # last stage only
    assert "heuristic | 3 |" in render(table)
    # paired by seed against fixed (seeds 0, 1, 2: 0.4, 0.5, 0.6): -0.3 on every seed, so no spread
    paired = table["heuristic"]["vs_reference"]
    assert paired["reference"] == "fixed" and "vs_reference" not in table["fixed"]
    assert paired["metrics"]["acc/3_agents"]["mean"] == pytest.approx(-0.3)
    assert paired["metrics"]["acc/3_agents"]["ci95"] == pytest.approx(0.0, abs=1e-12)
    assert paired["metrics"]["acc/3_agents"]["seeds"] == [0, 1, 2]
    text = render(table)
    assert "Difference from `fixed`, paired by seed" in text and "| heuristic | 3 | -30.0 ± 0.0 |" in text
    assert "Valid rate per map size" in text and "3_agents/3x3" in text and "size/" not in text.split("\n")[0]
    assert "vs_reference" not in aggregate(experiment_records(show), plan, STAGES, reference=None)["heuristic"]
    assert missing(experiment_records(show), plan, STAGES) == []
    partial = experiment_records(show)[1:]  # e.g. cmp-heuristic-s0 ran from an earlier commit
    assert missing(partial, plan, STAGES) == ["cmp-heuristic-s0"]
    assert aggregate(partial, plan, STAGES)["heuristic"]["seeds"] == [1, 2]
    records = experiment_records(show)
    records[0]["metrics"]["data/stages/1/validation_metrics.json"] = {"validation": {"valid": 0.25, "optimal": 0.125}}
    assert last_stage_result(records[0], STAGES) == {"acc/3_agents": pytest.approx(0.1), "size/3_agents/3x3": 0.5,
                                                     "val/valid": 0.25, "val/optimal": 0.125}
    cut = experiment_records(show)  # an experiment that stopped after evaluate@0: stage 0's numbers must not stand in
    del cut[0]["metrics"]["data/stages/1/benchmark_metrics.json"]
    assert last_stage_result(cut[0], STAGES) is None
    assert missing(cut, plan, STAGES) == ["cmp-heuristic-s0"] and aggregate(cut, plan, STAGES)["heuristic"]["seeds"] == [1, 2]
    first, rest = waves(plan)  # the first experiment of every seed first: the rest restore its shared stages
    assert [p.seed for p in first] == [0, 1, 2] and len(rest) == 3 and {p.name for p in first + rest} == {p.name for p in plan}
    left = waves(plan, {"cmp-heuristic-s0", "cmp-heuristic-s1", "cmp-heuristic-s2", "cmp-fixed-s1"})
    assert [[p.name for p in w] for w in left] == [["cmp-fixed-s0", "cmp-fixed-s2"]]  # finished ones are left out
    shared = shared_stages(STAGES + [stage("engineer-config@0", "x"), stage("benchmark", "y")])
    assert shared == ["validate@0", "evaluate@0"]  # the first item's stages but its engineer's
    table_uncached = replace(STAGES[1], uncached=("data/stages/0/benchmark.md",))  # DVC could not restore it
    assert shared_stages([STAGES[0], table_uncached]) == ["validate@0"]
    assert unrestorable([STAGES[0], table_uncached]) == [
        "evaluate@0: DVC keeps no run-cache entry for it (data/stages/0/benchmark.md: cache: false), so every "
        "experiment runs it again; in dvc.yaml drop cache: false there, or declare the file a metric or a plot"]
    assert unrestorable(STAGES) == []
    prefix, every = waves(plan, {"cmp-fixed-s1"}, shared)  # a short experiment per seed, then every one at once
    # seed 1 has one experiment left, which shares nothing: it runs whole in the second wave
    assert [p.name for p in prefix] == ["shared-cmp-heuristic-s0", "shared-cmp-heuristic-s2"]
    assert prefix[0].sets == plan[0].sets and queue_args(prefix[0], {})[-2:] == ["validate@0", "evaluate@0"]
    assert [p.name for p in every] == [p.name for p in plan if p.name != "cmp-fixed-s1"]
    assert waves(plan, {p.name for p in plan}, shared) == []
    ctx = comparison_plan([], [0], ["failures", "bookkeeping"])
    assert [p.arm for p in ctx] == ["policy/failures", "policy/bookkeeping"]


def test_the_stages_no_experiment_changes_are_found_from_their_parameters_and_what_they_depend_on():
    """Run once in the workspace before anything is queued: the stages outside the curriculum loops that read none of
    the experiments' parameters (seeds, engineer) and depend on none that does."""
    from experiments.plan import seed_free_stages

    def s(name, keys, upstream=()):
        return StageFiles(name=name, deps=(), params_files=("params.yaml",), outs=(), metrics=(), plots=(),
                          params_keys=tuple(keys), upstream=tuple(upstream))

    stages = [s("start-instances", ["start.instances"]), s("starting-policy", ["start.train", "policy.prompt"],
                                                            ["start-instances"]),
              s("validation-set", ["validation"]), s("benchmark", ["benchmark"], ["validation-set"]),
              s("init-curriculum", ["env", "train.seed"], ["starting-policy"]), s("train@0", ["train"], ["init-curriculum"]),
              s("after-init", [], ["init-curriculum"])]
    keys = comparison_plan(["fixed"], [0])[0].sets
    assert seed_free_stages(stages, list(keys)) == ["start-instances", "starting-policy", "validation-set", "benchmark"]
    assert seed_free_stages(stages, ["validation.seed"]) == ["start-instances", "starting-policy", "init-curriculum",
                                                             "after-init"]
    assert seed_free_stages(stages, ["start"]) == ["validation-set", "benchmark"]  # a whole section counts


def test_the_comparison_follows_every_engineer_across_stages_and_shows_the_environments_it_chose():
    """Per stage: the headline metrics' mean and interval across seeds, and the configuration each stage trained on
    (the generate-instances stage's params file), summarised; an experiment without its last stage does not count."""
    generate = [StageFiles(name=f"generate-instances@{k}", deps=(), params_files=(f"data/stages/{k}/config.yaml",),
                           outs=(), metrics=(), plots=()) for k in (0, 1)]
    stages = STAGES + generate
    plan = comparison_plan(["heuristic", "fixed"], [0, 1])

    def config(small_share: float, holes: float) -> dict:
        return {"num_agents": 2, "sizes": {3: {"data_ratio": small_share, "hole_ratio": holes, "wait_ratio": 0.5},
                                           9: {"data_ratio": 1 - small_share, "hole_ratio": holes, "wait_ratio": 0.5}}}

    def rev(p, i):
        heuristic = p.arm == "heuristic"
        return {"name": p.name, "data": {
            "params": {"params.yaml": {"data": {"train": {"seed": p.seed}, "curriculum": CURRICULUM}},
                       "data/stages/0/config.yaml": {"data": config(0.5, 0.2)},
                       "data/stages/1/config.yaml": {"data": config(0.75 if heuristic else 0.5, 0.1 if heuristic else 0.2)}},
            "metrics": {"data/stages/0/benchmark_metrics.json": {"data": {"bench": {"acc/3_agents": 0.1}}},
                        "data/stages/0/validation_metrics.json": {"data": {"validation": {"valid": 0.3, "optimal": 0.2}}},
                        "data/stages/1/benchmark_metrics.json": {"data": {"bench": {"acc/3_agents": 0.2 + 0.1 * heuristic,
                                                                                    "se/3_agents": 0.01}}},
                        "data/stages/1/validation_metrics.json": {"data": {"validation": {"valid": 0.4 + 0.02 * i}}}}}}

    show = [{"rev": "abc", "experiments": [{"revs": [rev(p, i)]} for i, p in enumerate(plan)]}]
    records = experiment_records(show)
    assert stage_config(records[0], stages, 1) == config(0.75, 0.1) and stage_config(records[0], STAGES, 1) is None
    assert config_summary(config(0.75, 0.1)) == {"size": pytest.approx(4.5), "hole_ratio": pytest.approx(0.1),
                                                 "wait_ratio": 0.5, "min_path_length": 0.0}
    assert config_summary({"sizes": {}}) == {}
    table = aggregate(records, plan, stages)
    heuristic = table["heuristic"]
    assert list(heuristic["stages"]) == ["0", "1"]
    assert heuristic["stages"]["0"]["acc/3_agents"]["mean"] == pytest.approx(0.1)
    assert heuristic["stages"]["1"]["acc/3_agents"]["mean"] == pytest.approx(0.3)
    assert heuristic["stages"]["1"]["val/valid"]["mean"] == pytest.approx(0.41)  # seeds 0 and 1: 0.40, 0.42
    assert "se/3_agents" not in heuristic["stages"]["1"]
    assert heuristic["configs"]["1"]["size"]["mean"] == pytest.approx(4.5)
    assert table["fixed"]["configs"]["1"]["size"]["mean"] == pytest.approx(6.0)
    text = render(table)
    assert "Across stages" in text and "| heuristic | 10.0 ± 0.0 | 30.0 ± 0.0 |" in text
    assert "| heuristic | 6.0 / 0.20 / 0.50 | 4.5 / 0.10 / 0.50 |" in text
    assert "| fixed | 6.0 / 0.20 / 0.50 | 6.0 / 0.20 / 0.50 |" in text
    del records[0]["metrics"]["data/stages/1/benchmark_metrics.json"]  # cmp-heuristic-s0 did not finish
    assert aggregate(records, plan, stages)["heuristic"]["stages"]["0"]["acc/3_agents"]["n"] == 1


SCRIPT = ("import json, pathlib, yaml; p = yaml.safe_load(open('params.yaml')); "
          "v = p['train']['seed'] / 10 + (0.5 if p['engineer']['engineer'] == 'heuristic' else 0); "
          "pathlib.Path('m').mkdir(exist_ok=True); "
          "pathlib.Path('m/{name}${{item.stage}}.json').write_text(json.dumps({metric}))")


def test_compare_runs_the_experiments_through_the_dvc_queue_and_reads_dvc_exp_show(tmp_path, capsys):
    """A stand-in pipeline with the real names (evaluate@K, validate@K) queued as DVC experiments, run two at a time,
    and the table built from `dvc exp show`; a second call only collects, and bad overrides stop before queueing."""
    from env_engineer.cli import main

    standin_repo(tmp_path)
    out_json = tmp_path / "c.json"
    args = ["compare", "--repo", str(tmp_path), "--engineers", "fixed,heuristic", "--seeds", "1,2", "--out-json", str(out_json),
            "--out-md", str(tmp_path / "c.md")]
    assert main(args + ["--run", "--jobs", "2"]) == 0
    printed = capsys.readouterr().out
    assert "queued cmp-fixed-s1" in printed and "queue:" in printed
    # each seed's shared stages first, as `dvc exp run --temp` while the others are queued; the queue's workers after
    assert printed.index("running shared-cmp-fixed-s1") < printed.index("queued cmp-fixed-s1")
    assert "queued shared-" not in printed and "runs: 2 success" in printed
    assert printed.index("runs: 2 success") < printed.index("2 experiment(s) at once")
    listed = subprocess.run(["dvc", "exp", "list", "--name-only"], cwd=tmp_path, capture_output=True, text=True,
                            env=dvc_env(), check=True).stdout
    assert "cmp-fixed-s1" in listed and "shared-" not in listed  # the scaffolding experiments are removed
    written = json.loads(out_json.read_text())
    table = written["arms"]
    assert written["run"]["seeds"] == [1, 2] and written["run"]["wall_s"] > 0 and len(written["run"]["commit"]) == 40
    assert written["run"]["gpus"]["count"] == 0 and written["run"]["params"]["train"]["seed"] == 0  # what ran, on what
    assert table["fixed"]["seeds"] == [1, 2] and table["fixed"]["metrics"]["acc/3_agents"]["mean"] == pytest.approx(0.15)
    assert table["heuristic"]["metrics"]["acc/3_agents"]["mean"] == pytest.approx(0.65)
    assert table["heuristic"]["metrics"]["val/valid"]["mean"] == pytest.approx(0.325)
    assert main(args) == 0 and json.loads(out_json.read_text())["arms"] == table  # collect only: the same table
    assert main(args + ["--set", "train.no_such_knob=1"]) == 2
    assert "train.no_such_knob" in capsys.readouterr().err
    assert main(args[:3] + ["--engineers", "seer"]) == 2
    assert "unknown engineer" in capsys.readouterr().err
    assert main(args[:3] + ["--engineers", "oracle"]) == 2  # an upper bound needs the sequence it replays
    assert "engineer.replay" in capsys.readouterr().err


def test_a_wave_goes_to_prefect_as_named_flow_runs_and_is_awaited(capsys):
    """--via prefect: every experiment of the wave is submitted as a run of the deployment with its overrides and
    name, then polled until each is final; COMPLETED counts as Success, any other final state as Failed; a crashed
    run is submitted once more, a failed one is not, and why each failed is printed."""
    from experiments.runner import run_flow_runs

    plan = comparison_plan(["fixed", "plr", "alp"], [0])
    submitted = []

    def submit(deployment, item, extra, repo):
        submitted.append((deployment, item.name, {**item.sets, **extra}))
        return f"id{len(submitted)}-{item.name}"

    polls = iter([{"cmp-fixed-s0": "RUNNING", "cmp-plr-s0": "SCHEDULED", "cmp-alp-s0": "RUNNING"},
                  {"cmp-fixed-s0": "COMPLETED", "cmp-plr-s0": "RUNNING", "cmp-alp-s0": "RUNNING"},
                  {"cmp-fixed-s0": "COMPLETED", "cmp-plr-s0": "CRASHED", "cmp-alp-s0": "FAILED"},
                  {"cmp-fixed-s0": "COMPLETED", "cmp-plr-s0": "RUNNING", "cmp-alp-s0": "FAILED"},
                  {"cmp-fixed-s0": "COMPLETED", "cmp-plr-s0": "CRASHED", "cmp-alp-s0": "FAILED"}])
    seen_ids = []

    def states(ids):
        seen_ids.append(dict(ids))
        return next(polls)

    def messages(ids):
        return {name: f"why {i}" for name, i in ids.items()}

    result = run_flow_runs("curriculum/curriculum", plan, {"train.trajectories": 64}, poll_seconds=0,
                           submit=submit, states=states, messages=messages)
    assert result == {"cmp-fixed-s0": "Success", "cmp-plr-s0": "Failed", "cmp-alp-s0": "Failed"}
    assert [s[1] for s in submitted] == ["cmp-fixed-s0", "cmp-plr-s0", "cmp-alp-s0", "cmp-plr-s0"]
    assert len(seen_ids) == 5 and seen_ids[3] == {"cmp-fixed-s0": "id1-cmp-fixed-s0", "cmp-plr-s0": "id4-cmp-plr-s0",
                                                  "cmp-alp-s0": "id3-cmp-alp-s0"}
    assert submitted[1][2] == {"engineer.engineer": "plr", "train.seed": 0, "env.seed": 0, "engineer.seed": 0,
                               "train.trajectories": 64}
    assert seen_ids[0] == {"cmp-fixed-s0": "id1-cmp-fixed-s0", "cmp-plr-s0": "id2-cmp-plr-s0",
                           "cmp-alp-s0": "id3-cmp-alp-s0"}
    out, err = capsys.readouterr()
    assert "resubmitted cmp-plr-s0 to curriculum/curriculum (crashed: why id2-cmp-plr-s0)" in out
    assert "cmp-plr-s0: flow run id4-cmp-plr-s0 crashed: why id4-cmp-plr-s0" in err
    assert "cmp-alp-s0: flow run id3-cmp-alp-s0 failed: why id3-cmp-alp-s0" in err


def test_git_lock_collisions_of_concurrent_experiments_count_as_transient(tmp_path, monkeypatch):
    """Two experiments saving at once can collide on a git lock file (DVC issue 10673): the flow retries that, like
    DVC's own repository lock, and nothing else."""
    import subprocess

    from experiments import dvc as dvc_mod

    outputs = iter(["ERROR: unexpected error - FileLocked(b'.git/packed-refs', b'.git/packed-refs.lock')",
                    "ERROR: Unable to acquire lock. Most likely another DVC process is running",
                    "ERROR: failed to reproduce 'train@0': exit code 1"])
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 255, "", next(outputs)))
    kinds = []
    for _ in range(3):
        try:
            dvc_mod.dvc(["exp", "run"], tmp_path)
        except dvc_mod.DvcError as e:
            kinds.append(type(e).__name__)
    assert kinds == ["DvcBusy", "DvcBusy", "DvcError"]


def test_a_retried_experiment_takes_the_one_its_first_attempt_saved(monkeypatch):
    """If the attempt before a retry saved the named experiment, the retry takes it; on a first attempt the same
    conflict is an error (another experiment of that name)."""
    import flows.curriculum as cur
    from experiments.dvc import DvcError

    def dvc(args, repo):
        if args[:2] == ["exp", "run"]:
            raise DvcError("dvc exp run failed (exit 255):\nERROR: Experiment conflicts with existing experiment 'x'.")
        return "{}"

    monkeypatch.setattr(cur, "dvc", dvc)
    monkeypatch.setattr(cur, "create_markdown_artifact", lambda **k: None)
    with pytest.raises(DvcError, match="conflicts"):
        cur.experiment.fn(["-n", "x"], ".")
    monkeypatch.setenv("PREFECT__RUNTIME__TASK_RUN__RUN_COUNT", "2")
    assert cur.experiment.fn(["-n", "x"], ".").startswith("saved by the attempt before this retry")


def test_the_flow_names_its_experiment(monkeypatch):
    """The curriculum flow with overrides and a name runs `dvc exp run --temp -n NAME -S ...` (checked overrides)."""
    import flows.curriculum as cur

    from tests.helpers import ROOT

    calls = []
    monkeypatch.setattr(cur, "experiment", lambda sets, repo: calls.append(sets) or "ok")
    out = cur.curriculum.fn(repo=str(ROOT), overrides={"train.seed": 2}, name="cmp-fixed-s2")
    assert out == {"experiment": "ok"} and calls == [["-n", "cmp-fixed-s2", "-S", "++train.seed=2"]]


def standin_repo(path, sleep_s: float = 0):
    """A git + DVC repository whose pipeline has the real stage names (validate@K, evaluate@K) but stand-in commands
    that write metrics from params.yaml's engineer and seed (heuristic: 0.5 more), each after ``sleep_s`` seconds."""
    from tests.helpers import ROOT

    path.mkdir(parents=True, exist_ok=True)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["curriculum"] = [{"stage": 0, "prev": "init", "next": 1}]
    (path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    def stage_body(name: str, metric: str) -> dict:
        script = SCRIPT.format(name=name, metric=metric)
        wait = f'python -c "import time; time.sleep({sleep_s})" && ' if sleep_s else ""
        return {"cmd": f'{wait}python -c "{script}"', "params": ["engineer", "train"],
                "metrics": [{f"m/{name}${{item.stage}}.json": {"cache": False}}]}

    (path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {
        "validate": {"foreach": "${curriculum}", "do": stage_body("val", "{'validation': {'valid': v / 2}}")},
        "evaluate": {"foreach": "${curriculum}", "do": stage_body("bench", "{'bench': {'acc/3_agents': v}}")},
    }}, sort_keys=False))
    env = dvc_env()
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.email=t@example.org", "-c", "user.name=t", "commit", "-qm", "pipeline"]):
        subprocess.run(cmd, cwd=path, check=True, env=env)
    return path


def test_workspaces_give_the_records_dvc_exp_show_gives(tmp_path):
    """A run stopped before DVC saved its experiments is read from their workspaces: the same records, the same table;
    a metric only one seed reached shows as one seed, not as an interval of zero width."""
    plan = comparison_plan(["heuristic", "fixed"], [0, 1, 2])
    stages = STAGES + [StageFiles(name="generate-instances@1", deps=(), params_files=("data/stages/1/config.yaml",),
                                  outs=(), metrics=(), plots=())]
    show = [{"rev": "abc", "experiments": []}]
    for i, p in enumerate(plan):
        ws = tmp_path / p.name
        (ws / "data/stages/0").mkdir(parents=True)
        (ws / "data/stages/1").mkdir(parents=True)
        params = {"train": {"seed": p.seed}, "curriculum": CURRICULUM}
        (ws / "params.yaml").write_text(yaml.safe_dump(params))
        metrics = {"data/stages/0/benchmark_metrics.json": {"bench": {"acc/3_agents": 0.0}},
                   "data/stages/1/benchmark_metrics.json": {"bench": {"acc/3_agents": 0.1 * (i + 1)}}}
        if p.seed == 0:  # only seed 0 scored its last validation set
            metrics["data/stages/1/validation_metrics.json"] = {"validation": {"valid": 0.5, "optimal": 0.25}}
        for path, data in metrics.items():
            (ws / path).write_text(json.dumps(data))
        (ws / "data/stages/1/config.yaml").write_text(yaml.safe_dump({"sizes": {3: {"data_ratio": 1.0}}}))
        show[0]["experiments"].append({"revs": [{"name": p.name, "data": {
            "params": {"params.yaml": {"data": params}, "data/stages/1/config.yaml": {"data": {"sizes": {3: {"data_ratio": 1.0}}}}},
            "metrics": {path: {"data": data} for path, data in metrics.items()}}}]})
    (tmp_path / "notes").mkdir()  # a folder without params.yaml is no experiment
    records = workspace_records(tmp_path, stages)
    assert [r["name"] for r in records] == sorted(p.name for p in plan)
    by_name = {r["name"]: r for r in experiment_records(show)}
    def same(r: dict) -> dict:  # less where each was read from
        return {k: v for k, v in r.items() if k not in ("folder", "rev")}

    assert all(same(r) == same(by_name[r["name"]]) for r in records)
    table = aggregate(records, plan, stages)
    assert table == aggregate(experiment_records(show), plan, stages)
    assert table["heuristic"]["metrics"]["val/valid"] == {"mean": 0.5, "ci95": None, "n": 1}
    assert "50.0 (one seed)" in render(table) and table["heuristic"]["configs"]["1"]["size"]["mean"] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="no experiment folder"):
        workspace_records(tmp_path / "notes", stages)


def test_every_benchmark_answer_is_kept_with_its_engineer_seed_stage_and_wait_ratio(tmp_path):
    """outcomes(): one row per answer of every planned experiment's benchmark rollouts, read from its files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from experiments.records import outcomes

    evaluate = [StageFiles(name=f"evaluate@{k}", deps=("data/benchmark/instances.parquet",), params_files=(),
                           outs=(f"data/stages/{k}/benchmark.parquet",), metrics=(), plots=()) for k in (0, 1)]
    plan = comparison_plan(["fixed", "plr"], [0])
    records = []
    for i, item in enumerate(plan):
        ws = tmp_path / item.name
        for k in (0, 1):
            (ws / f"data/stages/{k}").mkdir(parents=True)
            pq.write_table(pa.table({"content_hash": ["a", "b"], "num_agents": [2, 3], "size": [3, 4],
                                     "valid": [True, k == 1], "optimal": [i == 0, False], "completion": ["x", "y"]}),
                           ws / f"data/stages/{k}/benchmark.parquet")
        (ws / "data/benchmark").mkdir()
        pq.write_table(pa.table({"content_hash": ["a", "b"], "wait_subset": [0.25, 0.75]}),
                       ws / "data/benchmark/instances.parquet")
        records.append({"name": item.name, "params": {"curriculum": CURRICULUM}, "folder": str(ws)})
    table = outcomes(tmp_path, records + [{"name": "someone-else", "params": {}}], plan, evaluate)
    assert table.num_rows == 8 and table.column_names == ["engineer", "seed", "stage", "content_hash", "num_agents",
                                                          "size", "valid", "optimal", "wait_ratio"]
    rows = table.to_pylist()
    assert {(r["engineer"], r["stage"]) for r in rows} == {("fixed", 0), ("fixed", 1), ("plr", 0), ("plr", 1)}
    assert [r["wait_ratio"] for r in rows[:2]] == [0.25, 0.75] and rows[3]["valid"] is True


def test_experiment_process_alive_reads_dvc_tasks_process_records(tmp_path):
    """A record without a return code whose process runs: alive; one with a return code, or whose process is gone
    (a worker killed with its experiment), or half written: not."""
    from dvc_task.proc.process import ProcessInfo

    from experiments.runner import experiment_process_alive

    run = tmp_path / ".dvc" / "tmp" / "exps" / "run"

    def record(name, pid, returncode):
        (run / name).mkdir(parents=True)
        ProcessInfo(pid, None, None, None, returncode).dump(str(run / name / f"{name}.json"))

    assert not experiment_process_alive(tmp_path)  # no folder yet
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record("ended", os.getpid(), 0)
    record("killed", int(gone.stdout), None)
    (run / "partial").mkdir()
    (run / "partial" / "partial.json").write_text('{"pid": 1')
    assert not experiment_process_alive(tmp_path)
    record("running", os.getpid(), None)
    assert experiment_process_alive(tmp_path)


def test_queue_workers_are_read_from_their_process_records_and_a_wave_waits_for_them_to_leave(tmp_path, monkeypatch):
    """``dvc queue start`` records each worker as celery/dvc-exp-worker-N.json: one without a return code whose process
    runs is a worker still there. A wave is queued only once none is (a task queued while one leaves is lost), and
    waiting gives up with the pids and the way out."""
    from dvc_task.proc.process import ProcessInfo

    from experiments import runner as compare

    celery = tmp_path / ".dvc" / "tmp" / "exps" / "celery"
    celery.mkdir(parents=True)
    assert compare.queue_workers(tmp_path) == []
    ProcessInfo(os.getpid(), None, None, None, 0).dump(str(celery / "dvc-exp-worker-1.json"))  # left
    assert compare.queue_workers(tmp_path) == []
    ProcessInfo(os.getpid(), None, None, None, None).dump(str(celery / "dvc-exp-worker-2.json"))
    assert compare.queue_workers(tmp_path) == [os.getpid()]
    with pytest.raises(compare.QueueStalled, match=rf"worker\(s\) {os.getpid()} still run.*kill {os.getpid()}"):
        compare.wait_for_workers_to_leave(tmp_path, timeout=0.05, poll_seconds=0.01)
    left = iter([[7], [7], []])
    monkeypatch.setattr(compare, "queue_workers", lambda repo: next(left))
    compare.wait_for_workers_to_leave(tmp_path, timeout=5, poll_seconds=0.01)  # returns once none is left


def test_a_wave_that_the_queue_lost_is_queued_again_once(monkeypatch, capsys):
    """An experiment DVC lists as running with no worker and no process left (taken by a worker on its way out) is
    marked failed with `dvc queue kill` and queued again, workers are started again, and the wave finishes; a second
    stall raises. A name queued twice reads as its unfinished task, else the one that succeeded."""
    from experiments import runner as compare

    calls = []
    status = iter(["abc  e1  10:00  Running\ndef  e2  10:00  Success\n",  # e1 lost: no worker, no process
                   "abc  e1  10:00  Failed\nghi  e1  10:01  Success\ndef  e2  10:00  Success\n",
                   "ghi  e1  10:01  Queued\nabc  e1  10:00  Failed\n"])

    def fake_dvc(args, repo, leaves_processes=False, env=None, niceness=0):
        calls.append(args[:3] if args[:2] != ["queue", "kill"] else args)
        if args[:2] == ["queue", "status"]:
            return "Task  Name  Created  Status\n" + next(status) + "\nWorker status: 0 active, 0 idle\n"
        return "e1\ne2\n" if args[:2] == ["exp", "list"] else ""

    monkeypatch.setattr(compare, "dvc", fake_dvc)
    monkeypatch.setattr(compare, "queue_workers", lambda repo: [])
    monkeypatch.setattr(compare, "experiment_process_alive", lambda repo: False)
    monkeypatch.setattr(compare.time, "sleep", lambda s: None)
    wave = comparison_plan(["fixed"], [0, 1])
    wave = [replace(wave[0], name="e1"), replace(wave[1], name="e2")]
    assert compare.run_wave_in_queue(Path("."), 2, wave, {}, stall_seconds=-1) == {"e1": "Success", "e2": "Success"}
    queued = [c for c in calls if c[:3] == ["exp", "run", "--queue"]]
    assert len(queued) == 3 and ["queue", "kill", "e1"] in calls  # e1, e2, then e1 again
    assert calls.index(["queue", "kill", "e1"]) < len(calls) - 1 - calls[::-1].index(["exp", "run", "--queue"])
    assert sum(c[:2] == ["queue", "start"] for c in calls) == 2
    assert "queued again: e1" in capsys.readouterr().err
    assert compare.queue_status(Path(".")) == ({"e1": "Queued"}, 0)  # the task queued again speaks for e1
    status = iter(["abc  e1  10:00  Running\n"] * 10)
    with pytest.raises(compare.QueueStalled, match=r"e1 \(running\).*dvc queue kill NAME"):
        compare.run_wave_in_queue(Path("."), 2, wave[:1], {}, retries=0, stall_seconds=-1)


def test_an_experiment_the_gpu_ran_out_of_memory_for_is_queued_again_once_with_half_the_workers(monkeypatch, capsys):
    """One H200 with 24 experiments training at once: half failed with CUDA out of memory at their first engineered
    stage. Such an experiment is queued again once, after its wave, with half the workers (it resumes from DVC's
    run-cache); one that failed for a reason of its own is not, nor one that runs out of memory a second time."""
    from experiments import runner as compare

    calls = []
    logs = {"e1": "train@1\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 70.00 MiB.\nERROR: failed",
            "e2": "ValueError: train.sft_learning_rate\nERROR: failed to reproduce 'train@1'"}
    status = iter(["abc  e1  10:00  Failed\ndef  e2  10:00  Failed\nxyz  e3  10:00  Success\n",
                   "ghi  e1  10:05  Failed\nabc  e1  10:00  Failed\ndef  e2  10:00  Failed\nxyz  e3  10:00  Success\n"])

    def fake_dvc(args, repo, leaves_processes=False, env=None, niceness=0):
        calls.append(args)
        if args[:2] == ["queue", "start"]:  # the workers run below the study's shared servers
            assert niceness == compare.QUEUE_NICENESS > 0
        if args[:2] == ["queue", "status"]:
            return "Task  Name  Created  Status\n" + next(status) + "\nWorker status: 0 active, 0 idle\n"
        if args[:2] == ["queue", "logs"]:
            return logs[args[2]]
        return "e3\n" if args[:2] == ["exp", "list"] else ""

    monkeypatch.setattr(compare, "dvc", fake_dvc)
    monkeypatch.setattr(compare, "queue_workers", lambda repo: [])
    monkeypatch.setattr(compare, "experiment_process_alive", lambda repo: False)
    monkeypatch.setattr(compare.time, "sleep", lambda s: None)
    plan = comparison_plan(["fixed"], [0, 1, 2])
    wave = [replace(item, name=f"e{k}") for k, item in enumerate(plan, 1)]
    assert compare.run_wave_in_queue(Path("."), 4, wave, {}) == {"e1": "Failed", "e2": "Failed", "e3": "Success"}
    queued = [c[4] for c in calls if c[:3] == ["exp", "run", "--queue"]]
    assert queued == ["e1", "e2", "e3", "e1"]  # e1 (out of memory) again; e2 (its own error) not
    assert [c[3] for c in calls if c[:2] == ["queue", "start"]] == ["3", "1"]  # a worker per experiment at most
    # idle workers are told to leave after each run, before the retry is queued
    stops = [k for k, c in enumerate(calls) if c == ["queue", "stop"]]
    runs = [k for k, c in enumerate(calls) if c[:3] == ["exp", "run", "--queue"]]
    assert len(stops) == 2 and runs[2] < stops[0] < runs[3] < stops[1]
    assert [c[2] for c in calls if c[:2] == ["queue", "logs"]] == ["e1", "e2"]  # not read again after the retry
    assert "the GPU ran out of memory in e1; queued again with 1 worker(s)" in capsys.readouterr().err


def test_the_queue_workers_share_the_cores_among_the_experiments(monkeypatch, capsys):
    """``dvc queue start -j 4`` runs with each experiment's part of the CPU threads in its environment (every stage
    process of every experiment inherits it from the workers); a value the user set is kept."""
    from experiments import runner as compare
    from pipeline.workers import CPU_THREAD_VARIABLES, cpu_share

    envs = []

    def fake_dvc(args, repo, leaves_processes=False, env=None, niceness=0):
        if args[:2] == ["queue", "start"]:
            envs.append(env)
            return ""
        if args[:2] == ["exp", "list"]:
            return "e1\n"
        return "Task  Name  Created  Status\nabc  e1  10:00  Success\n\nWorker status: 0 active, 0 idle\n"

    for name in CPU_THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("POLARS_MAX_THREADS", "3")
    monkeypatch.setattr(compare, "dvc", fake_dvc)
    monkeypatch.setattr(compare, "cpu_share", lambda jobs: cpu_share(jobs, cores=16))
    assert compare.run_queue(Path("."), 4, ["e1"], poll_seconds=0.01) == {"e1": "Success"}
    assert envs == [{"OMP_NUM_THREADS": "4", "TORCHINDUCTOR_COMPILE_THREADS": "4", "POLARS_MAX_THREADS": "3"}]
    assert "OMP_NUM_THREADS=4" in capsys.readouterr().out


def test_run_queue_gives_up_when_no_worker_is_left(monkeypatch):
    """An unfinished experiment with no DVC worker answering for ``stall_seconds`` raises QueueStalled naming it
    (a killed worker left its task Running, which polling would read forever); a worker answering resets the wait,
    and a wave whose experiments all finished returns even after the workers stopped."""
    from experiments import runner as compare

    replies = []

    def fake_dvc(args, repo, leaves_processes=False, env=None, niceness=0):
        if args[:2] == ["queue", "start"]:
            return ""
        if args[:2] == ["exp", "list"]:
            return "e1\n"
        return replies.pop(0) if len(replies) > 1 else replies[0]

    def run_with(polls: int, workers: int, alive: bool) -> dict[str, str]:
        """``polls`` replies of e1 Running with ``workers`` answering (and its process ``alive``), then Success."""
        answers = iter([alive] * polls)
        monkeypatch.setattr(compare, "experiment_process_alive", lambda repo: next(answers, False))
        monkeypatch.setattr(compare, "queue_workers", lambda repo: [])
        replies[:] = [table.format("abc1234  e1  10:00  Running", workers, 0)] * polls + [
            table.format("abc1234  e1  10:00  Success", 0, 0)]
        return compare.run_queue(Path("."), 2, ["e1"], poll_seconds=0.01, stall_seconds=0.05)

    table = "Task     Name  Created  Status\n{}\n\nWorker status: {} active, {} idle\n"
    monkeypatch.setattr(compare, "dvc", fake_dvc)
    with pytest.raises(compare.QueueStalled, match=r"e1 \(running\).*dvc queue logs"):
        run_with(1000, 0, False)
    # no worker answering, but the experiment's process still running (a busy worker missed the ping): it waits on
    assert run_with(12, 0, True) == {"e1": "Success"}
    assert run_with(12, 1, False) == {"e1": "Success"}
    assert compare.queue_status(Path(".")) == ({"e1": "Success"}, 0)


def _git_repo(path, *config):
    path.mkdir()
    for cmd in (["git", "init", "-q"], *(["git", "config", *pair] for pair in config)):
        subprocess.run(cmd, cwd=path, check=True)
    (path / ".gitignore").write_text("/data/cached.parquet\n")
    (path / "data").mkdir()
    for name, text in (("data/start.txt", "old start"), ("dvc.lock", "old lock"), ("notes.txt", "mine"),
                       ("params.yaml", "a: 1\n")):
        (path / name).write_text(text)
    subprocess.run(["git", "add", "-A"], cwd=path, check=True)
    subprocess.run(["git", "commit", "-qm", "base"], cwd=path, check=True)
    return path


SHARED = [StageFiles(name="starting-policy", deps=(), params_files=(), outs=("data/start.txt", "data/new.txt"),
                     metrics=(), plots=()),
          StageFiles(name="benchmark", deps=(), params_files=(), outs=("data/cached.parquet",), metrics=(), plots=())]


def test_what_the_shared_stages_changed_is_committed_and_nothing_else(tmp_path, capsys):
    """Queued experiments start from a commit that holds the shared stages' files in git (else every `dvc exp run
    --queue` stashes them again); the user's other changes and git-ignored outputs stay out of it."""
    from experiments.runner import commit_shared

    repo = _git_repo(tmp_path / "r", ("user.name", "t"), ("user.email", "t@example.org"))
    assert commit_shared(repo, SHARED) == []  # nothing changed: no commit
    for name, text in (("data/start.txt", "new start"), ("data/new.txt", "made"), ("dvc.lock", "new lock"),
                       ("notes.txt", "still mine"), ("data/cached.parquet", "in DVC's cache")):
        (repo / name).write_text(text)
    assert commit_shared(repo, SHARED) == ["data/new.txt", "data/start.txt", "dvc.lock"]
    git = lambda *a: subprocess.run(["git", *a], cwd=repo, capture_output=True, text=True, check=True).stdout  # noqa: E731
    assert "starting-policy, benchmark" in git("log", "-1", "--format=%s")
    assert git("show", "HEAD:data/start.txt") == "new start" and git("show", "HEAD:notes.txt") == "mine"
    assert git("status", "--porcelain").split() == ["M", "notes.txt"]
    assert "committed what they changed (3 file(s))" in capsys.readouterr().out


def test_a_repository_where_git_cannot_commit_is_left_as_it_is_with_a_warning(tmp_path, capsys, monkeypatch):
    from experiments.runner import commit_shared

    repo = _git_repo(tmp_path / "r", ("user.name", "t"), ("user.email", "t@example.org"))
    for key in ("user.name", "user.email"):
        subprocess.run(["git", "config", "--unset", key], cwd=repo, check=True)
    subprocess.run(["git", "config", "user.useConfigOnly", "true"], cwd=repo, check=True)  # git may not guess one
    for key, value in (("GIT_CONFIG_GLOBAL", os.devnull), ("GIT_CONFIG_NOSYSTEM", "1")):
        monkeypatch.setenv(key, value)
    for key in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL", "EMAIL"):
        monkeypatch.delenv(key, raising=False)
    (repo / "dvc.lock").write_text("new lock")
    assert commit_shared(repo, SHARED) == []
    assert "slower to queue" in capsys.readouterr().err
    status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True).stdout
    assert "dvc.lock" in status  # neither committed nor lost


def test_a_queueing_that_finds_the_repository_busy_is_tried_again_a_bounded_number_of_times(monkeypatch, capsys):
    """Beside a first wave's runs, `dvc exp run --queue` may find DVC's lock or a git ref held: tried again."""
    from experiments import runner
    from experiments.dvc import DvcBusy, DvcError

    answers = iter([DvcBusy("Unable to acquire lock"), DvcBusy("cannot lock ref"), ""])
    calls = []

    def fake_dvc(args, repo, **kwargs):
        calls.append(args)
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(runner, "dvc", fake_dvc)
    item = comparison_plan(["fixed"], [0])[0]
    runner.queue_experiment(Path("."), item, {}, wait_s=0)
    assert len(calls) == 3 and f"queued {item.name}" in capsys.readouterr().out
    answers = iter([DvcBusy("Unable to acquire lock")] * 3)
    with pytest.raises(DvcBusy):
        runner.queue_experiment(Path("."), item, {}, attempts=3, wait_s=0)
    answers = iter([DvcError("ERROR: a bad parameter")])  # not worth a second try
    with pytest.raises(DvcError, match="bad parameter"):
        runner.queue_experiment(Path("."), item, {}, wait_s=0)


def test_a_first_wave_runs_while_the_next_is_queued_and_its_runs_are_stopped_if_queueing_fails(tmp_path, monkeypatch,
                                                                                              capsys):
    """`run_wave_beside_queueing` with a stand-in `dvc`: each run's status, a failed one's output on stderr, the next
    wave queued meanwhile; and when queueing fails, the runs still going are stopped, not left behind."""
    import time

    from experiments import runner
    from tests.experiments.test_dvc import stand_in_dvc

    pids = tmp_path / "pids"
    pids.mkdir()
    stand_in_dvc(tmp_path, monkeypatch, f"""#!/bin/sh
case "$*" in
  *"--temp -n ok "*) echo "ran"; exit 0;;
  *"--temp -n bad "*) echo "stage validate@0 broke"; exit 1;;
  *"--temp -n slow "*) exec sh -c 'echo $$ > {pids}/slow; exec sleep 60';;
  *"--queue -n boom "*) for i in $(seq 100); do [ -f {pids}/slow ] && break; sleep 0.05; done
                        echo "ERROR: no such parameter"; exit 1;;
  *"--queue"*) exit 0;;
esac
exit 3
""")
    import experiments.dvc as dvc_module

    monkeypatch.setattr(runner, "dvc_env", dvc_module.dvc_env)  # the stand-in's PATH for the runs the runner starts
    plan = comparison_plan(["fixed", "heuristic"], [0])
    first = [replace(plan[0], name="ok", targets=("validate@0",)),
             replace(plan[1], name="bad", targets=("validate@0",))]
    assert runner.run_wave_beside_queueing(tmp_path, first, {}, plan, poll_seconds=0.05) == {"ok": "Success",
                                                                                           "bad": "Failed"}
    printed = capsys.readouterr()
    assert "running ok (dvc exp run --temp)" in printed.out and f"queued {plan[1].name}" in printed.out
    assert "bad: dvc exp run --temp failed (exit 1):\nstage validate@0 broke" in printed.err
    slow = [replace(plan[0], name="slow", targets=("validate@0",))]
    with pytest.raises(runner.DvcError, match="no such parameter"):
        runner.run_wave_beside_queueing(tmp_path, slow, {}, [replace(plan[1], name="boom")], poll_seconds=0.05)
    pid = int((pids / "slow").read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the first wave's run {pid} was left running")
