import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from envgen.cbs import Solved, solve
from envgen.config import SizeConfig
from envgen.generator import draw_instance
from envgen.planners import independent_plan, prioritized_plan
from envgen.simulate import Valid, check_plan
from tasks.benchmark import BenchmarkSettings, build_benchmark, cell_table, check_disjoint, evaluate, reference_rows, render_table
from tasks.compare import aggregate, experiment_plan, experiment_records, last_stage_bench, mean_ci, missing, render, waves
from tasks.report import build_report


def test_prioritized_plans_are_always_valid_when_found():
    found = 0
    for seed in range(150):
        rng = random.Random(seed)
        inst = draw_instance(rng, 4 + seed % 5, SizeConfig(data_ratio=1, hole_ratio=0.25), 2 + seed % 4, head_on=seed % 2 == 0)
        if inst is None:
            continue
        plan = prioritized_plan(inst)
        result = solve(inst)
        if plan is None:
            continue
        found += 1
        check = check_plan(inst, plan, result.soc if isinstance(result, Solved) else None)
        assert isinstance(check, Valid), (inst.to_str(), check)
        if isinstance(result, Solved):
            assert check.soc >= result.soc
    assert found > 100


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    settings = BenchmarkSettings(seed=5, per_cell=2, wait_ratios=[0.25, 0.75], agents={3: [3, 4], 4: [4, 5]})
    n = build_benchmark(settings, root / "b.parquet", progress=False)
    return root, settings, n


def test_benchmark_layout_is_the_papers_and_distinct(bench):
    root, settings, n = bench
    rows = pq.read_table(root / "b.parquet").to_pylist()
    assert n == len(rows) == 2 * 2 * (2 + 2)
    cells = {(r["num_agents"], r["size"], r["wait_subset"]) for r in rows}
    assert cells == {(a, s, w) for a, sizes in settings.agents.items() for s in sizes for w in (0.25, 0.75)}
    assert len({r["content_hash"] for r in rows}) == len(rows) and [r["index"] for r in rows] == list(range(len(rows)))
    waits = [r for r in rows if r["wait_subset"] == 0.75]
    assert sum(r["needs_wait"] for r in waits) / len(waits) >= 0.5
    again = root / "again.parquet"
    build_benchmark(settings, again, progress=False)
    assert again.read_bytes() == (root / "b.parquet").read_bytes()


def test_reference_rows_and_tables(bench):
    root, _, _ = bench
    ref = reference_rows(root / "b.parquet")
    assert ref["optimal (CBS)"]["3"]["sum"] == {"acc": 1.0, "opt": 1.0}
    assert set(ref) == {"optimal (CBS)", "prioritized", "independent"}
    waits = ref["independent"]["3"]["wait"]
    assert waits["0.75"]["acc"] <= 0.25 + 1e-9  # at most the no-wait quarter: independent paths never wait
    text = render_table(ref["prioritized"], "Reference: prioritized")
    assert "| 3 |" in text and "Sum" in text and "wait 0.25" in text


def test_cell_table_sum_is_mean_over_sizes():
    rows = ([{"num_agents": 3, "size": 3, "wait_subset": 0.5, "valid": True, "optimal": True}] * 2 +
            [{"num_agents": 3, "size": 4, "wait_subset": 0.5, "valid": False, "optimal": False},
             {"num_agents": 3, "size": 4, "wait_subset": 0.5, "valid": True, "optimal": False}])
    t = cell_table(rows)["3"]
    assert t["sizes"]["3"]["acc"] == 1.0 and t["sizes"]["4"]["acc"] == 0.5 and t["sum"]["acc"] == 0.75 and t["sum"]["opt"] == 0.5
    assert t["wait"]["0.50"] == {"acc": 0.75, "opt": 0.5, "n": 4}


def test_evaluate_checks_disjointness(bench, tmp_path):
    root, _, _ = bench
    table = pq.read_table(root / "b.parquet")
    rows = [{"instance_id": r["instance_id"], "content_hash": r["content_hash"], "num_agents": r["num_agents"], "size": r["size"],
             "valid": r["size"] == 3, "optimal": False} for r in table.to_pylist()]
    traj = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist(rows), traj)
    train = tmp_path / "train.parquet"
    pq.write_table(table.slice(0, 1).select(["content_hash"]), train)
    with pytest.raises(ValueError, match="in the benchmark"):
        evaluate(root / "b.parquet", traj, [train], None)
    pq.write_table(pa.table({"content_hash": ["0" * 64]}), train)
    metrics = evaluate(root / "b.parquet", traj, [train], None)
    assert metrics["bench"]["acc/3_agents"] == 0.5 and metrics["disjoint"]["training_instances_checked"] == 1
    assert check_disjoint(root / "b.parquet", []) == 0


def test_comparison_aggregate_with_confidence_intervals():
    assert mean_ci([1.0]) == {"mean": 1.0, "ci95": 0.0, "n": 1}
    m = mean_ci([0.2, 0.4, 0.6])
    assert m["mean"] == pytest.approx(0.4) and m["ci95"] == pytest.approx(4.303 * 0.2 / 3 ** 0.5)
    plan = experiment_plan(["heuristic", "fixed"], [0, 1, 2])
    assert len(plan) == 6 and plan[0]["set"]["engineer.engineer"] == "heuristic" and plan[0]["set"]["train.seed"] == 0
    show = [{"rev": "workspace", "experiments": None},
            {"rev": "abc", "experiments": [{"revs": [{"name": p["name"], "data": {
                "params": {"params.yaml": {"data": {"train": {"seed": p["seed"]}}}},
                "metrics": {"data/stages/0/benchmark_metrics.json": {"data": {"bench": {"acc/3_agents": 0.0}}},
                            "data/stages/1/benchmark_metrics.json": {"data": {"bench": {"acc/3_agents": 0.1 * (i + 1)}}}}}}]}
                for i, p in enumerate(plan)]}]
    table = aggregate(experiment_records(show), plan)
    assert table["heuristic"]["seeds"] == [0, 1, 2]
    assert table["heuristic"]["metrics"]["acc/3_agents"]["mean"] == pytest.approx(0.2)  # last stage only
    assert "heuristic | 3 |" in render(table)
    assert missing(experiment_records(show), plan) == []
    partial = experiment_records(show)[1:]  # e.g. cmp-heuristic-s0 ran from an earlier commit
    assert missing(partial, plan) == ["cmp-heuristic-s0"]
    assert aggregate(partial, plan)["heuristic"]["seeds"] == [1, 2]
    records = experiment_records(show)
    records[0]["metrics"]["data/stages/1/validation_metrics.json"] = {"validation": {"valid": 0.25, "optimal": 0.125}}
    assert last_stage_bench(records[0]["metrics"]) == {"acc/3_agents": pytest.approx(0.1), "val/valid": 0.25,
                                                       "val/optimal": 0.125}
    cut = experiment_records(show)  # a run folder cut off after evaluate@0: stage 0's numbers must not stand in
    for rec in cut:
        rec["params"]["curriculum"] = [{"stage": 0, "prev": "init", "next": 1}, {"stage": 1, "prev": 0, "next": 2}]
    del cut[0]["metrics"]["data/stages/1/benchmark_metrics.json"]
    assert last_stage_bench(cut[0]["metrics"], cut[0]["params"]) is None
    assert last_stage_bench(cut[1]["metrics"], cut[1]["params"]) == {"acc/3_agents": pytest.approx(0.2)}
    assert missing(cut, plan) == ["cmp-heuristic-s0"] and aggregate(cut, plan)["heuristic"]["seeds"] == [1, 2]
    first, rest = waves(plan)  # the first experiment of every seed first: the rest reuse its shared stages
    assert [p["seed"] for p in first] == [0, 1, 2] and len(rest) == 3 and {p["name"] for p in first + rest} == {p["name"] for p in plan}
    left = waves(plan, {"cmp-heuristic-s0", "cmp-heuristic-s1", "cmp-heuristic-s2", "cmp-fixed-s1"})
    assert [[p["name"] for p in w] for w in left] == [["cmp-fixed-s0", "cmp-fixed-s2"]]  # finished ones are left out
    ctx = experiment_plan([], [0], ["failures", "bookkeeping"])
    assert [p["arm"] for p in ctx] == ["policy/failures", "policy/bookkeeping"]


def test_report_is_self_contained(tmp_path):
    import yaml

    stages = tmp_path / "stages"
    for k in (0, 1):
        d = stages / str(k)
        d.mkdir(parents=True)
        (d / "config.yaml").write_text(yaml.safe_dump({"num_agents": 2, "budget": 4, "seed": k,
                                                       "sizes": {3: {"data_ratio": 0.5, "hole_ratio": 0.1 * k, "wait_ratio": 0.5}}}))
        table = {"3": {"sizes": {"3": {"acc": 0.1 * k, "opt": 0.0, "n": 2}}, "sum": {"acc": 0.1 * k, "opt": 0.0}, "wait": {}}}
        (d / "benchmark_metrics.json").write_text(json.dumps({"bench": {"acc/3_agents": 0.1 * k}, "bench_table": table,
                                                              "reference": {"prioritized": table, "independent": table}}))
        (d / "benchmark.md").write_text(render_table(table, "Policy"))
        (d / "validation_metrics.json").write_text(json.dumps({"validation": {"valid": 0.5}, "validation_by_size": {"3": {"valid": 0.5}}}))
        (d / "train_metrics.json").write_text("{}")
        (d / "engineer_log.json").write_text(json.dumps({"engineer": "heuristic", "context": "bookkeeping", "rationale": "<b>bold</b>",
                                                         "notes": ["size 3: clamped"], "fallback": False}))
        (d / "summary.json").write_text(json.dumps({"stage": k, "validation": {"overall": {"valid": 0.5, "failures": {"hole": 0.3},
                                                    "parse_errors": {"empty": 0.2}}}, "examples": [
            {"size": 3, "num_agents": 2, "verdict": "hole", "board": "A . b", "answer": "<script>alert(1)</script>"}]}))
    out = tmp_path / "r.html"
    files = build_report(stages, out)
    text = out.read_text()
    assert files[0] == out and len(files) > 4 and all(p.exists() for p in files)
    for section in ("Benchmark curves", "Configuration evolution", "Failure breakdown", "The engineer's decisions", "Sampled failed answers"):
        assert section in text
    assert "<script" not in text and "&lt;b&gt;bold&lt;/b&gt;" in text
    assert "http://" not in text and "https://" not in text and text.count("data:image/png;base64,") >= 4


def test_compare_cli_collects_from_a_dvc_repository(tmp_path, capsys):
    import subprocess

    from tasks.cli import main

    from tasks.tools import tool_env

    env = tool_env()
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["dvc", "init", "-q"], cwd=tmp_path, check=True, env=env)
    out_json, out_md = tmp_path / "c.json", tmp_path / "c.md"
    code = main(["compare", "--repo", str(tmp_path), "--engineers", "fixed,heuristic", "--seeds", "0,1", "--out-json", str(out_json),
                 "--out-md", str(out_md)])
    assert code == 0 and json.loads(out_json.read_text()) == {} and "| engineer | seeds |" in out_md.read_text()
    assert main(["compare", "--repo", str(tmp_path), "--engineers", "oracle"]) == 2
    assert "unknown engineer" in capsys.readouterr().err


def test_compare_without_dvc_runs_and_collects_run_folders(tmp_path):
    """``--without-dvc``: each (engineer, seed) runs as a run-stages folder with its parameters set, and the table is
    the same aggregate over the folders' last-stage benchmark metrics; a second call collects without rerunning."""
    import yaml

    from tasks.cli import main

    repo = tmp_path / "repo"
    repo.mkdir()
    script = ("import json, os, pathlib, yaml; p = yaml.safe_load(open('params.yaml')); "
              "pathlib.Path('device.txt').write_text(os.environ.get('CUDA_VISIBLE_DEVICES', '')); "
              "v = p['train']['seed'] / 10 + (0.5 if p['engineer']['engineer'] == 'heuristic' else 0); "
              "pathlib.Path('data/stages/1/benchmark_metrics.json').write_text(json.dumps({'bench': {'acc/3_agents': v}}))")
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"bench": {
        "cmd": f'python -c "{script}"', "params": ["engineer", "train"],  # declared, as DVC needs them declared
        "metrics": [{"data/stages/1/benchmark_metrics.json": {"cache": False}}]}}}))
    (repo / "params.yaml").write_text(yaml.safe_dump({"engineer": {"engineer": "policy", "seed": 0}, "train": {"seed": 0},
                                                      "env": {"seed": 0}}))
    runs, out_json = tmp_path / "runs", tmp_path / "c.json"
    args = ["compare", "--repo", str(repo), "--engineers", "fixed,heuristic", "--seeds", "0,1,2", "--without-dvc",
            str(runs), "--out-json", str(out_json), "--out-md", str(tmp_path / "c.md")]
    assert main(args + ["--run", "--jobs", "2", "--devices", "5,7"]) == 0
    assert {(runs / f"cmp-{e}-s{k}" / "device.txt").read_text() for e in ("fixed", "heuristic") for k in (0, 1, 2)} <= {"5", "7"}
    table = json.loads(out_json.read_text())
    assert table["fixed"]["seeds"] == [0, 1, 2] and table["fixed"]["metrics"]["acc/3_agents"]["mean"] == pytest.approx(0.1)
    assert table["heuristic"]["metrics"]["acc/3_agents"]["mean"] == pytest.approx(0.6)
    assert yaml.safe_load((runs / "cmp-heuristic-s2" / "params.yaml").read_text())["env"]["seed"] == 2
    (runs / "cmp-fixed-s0" / "data" / "stages" / "1" / "benchmark_metrics.json").write_text('{"bench": {"acc/3_agents": 1.0}}')
    assert main(args) == 0  # collect only: the edited folder is read, nothing reruns
    import shutil
    shutil.rmtree(runs / "cmp-heuristic-s1")  # a finished folder restored from an archive is reported, never rerun
    for marker in (runs / "cmp-fixed-s2" / ".done").iterdir():
        marker.unlink()
    for name in ("cmp-fixed-s0", "cmp-fixed-s2"):
        (runs / name / "stages.json").unlink()  # every run of a folder writes it
    assert main(args + ["--run", "--jobs", "2", "--devices", "5,7"]) == 0
    assert not (runs / "cmp-fixed-s0" / "stages.json").exists()  # finished: not run again
    assert (runs / "cmp-fixed-s2" / "stages.json").exists() and (runs / "cmp-heuristic-s1" / "stages.json").exists()
    assert json.loads(out_json.read_text())["heuristic"]["seeds"] == [0, 1, 2]
    from tasks.compare import prune_unfinished
    (runs / "cmp-fixed-s1" / ".done" / "bench").unlink()  # cut off: its outputs would be missing in an archive
    assert prune_unfinished(runs) == [f"cmp-{e}-s{k}" for e in ("fixed", "heuristic") for k in (0, 1, 2) if (e, k) != ("fixed", 1)]
    assert not (runs / "cmp-fixed-s1").exists()
    assert json.loads(out_json.read_text())["fixed"]["metrics"]["acc/3_agents"]["mean"] == pytest.approx((1.0 + 0.1 + 0.2) / 3)
