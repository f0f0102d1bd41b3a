import json

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from envgen.core.config import EnvConfig, SizeConfig
from envgen.formats.dataset import write_instances
from envgen.generator import generate
from envgen.formats.schemas import TRAJECTORIES
from pipeline.checks import DataValidationError, validate_file
from pipeline.params import PolicySettings, RolloutSettings
from steps.rollout import main, rollout, token_budget

from tests.helpers import tiny_params, write_params


@pytest.fixture(scope="module")
def instances_file(tmp_path_factory):
    cfg = EnvConfig(budget=5, seed=9, sizes={3: SizeConfig(data_ratio=1), 5: SizeConfig(data_ratio=1)})
    path = tmp_path_factory.mktemp("inst") / "instances.parquet"
    write_instances(path, generate(cfg), cfg)
    return path


def test_rollout_writes_scored_trajectories_that_pass_validation(tiny_model_dir, instances_file, tmp_path):
    out = tmp_path / "traj.parquet"
    policy = PolicySettings(model=str(tiny_model_dir))
    settings = RolloutSettings(samples=3, threads=1, seed=5, temperature=1.0)  # each answer its own token budget
    summary = rollout(instances_file, out, policy, settings, stage=2, progress=False)
    table = pq.read_table(out)
    assert summary.rows == table.num_rows == 15
    assert summary.load_seconds > 0 and summary.seconds > 0  # loading is timed apart from generation
    assert table.column_names == TRAJECTORIES.names
    rows = table.to_pylist()
    assert {r["sample_index"] for r in rows} == {0, 1, 2} and {r["stage"] for r in rows} == {2}
    assert all(r["model_id"] == str(tiny_model_dir) and r["backend"] == "transformers" for r in rows)
    assert all((r["parse_error"] is None) == r["parsed"] for r in rows)
    # the budget comes from the instance: its optimal answer in the model's tokens, half as long again, plus 8
    assert all(r["token_budget"] == token_budget(r["optimal_tokens"], 0.5) and r["optimal_tokens"] > 10 for r in rows)
    assert len({r["token_budget"] for r in rows}) > 1 and all(r["completion_tokens"] <= r["token_budget"] for r in rows)
    assert all(r["finish_reason"] == "stop" or r["completion_tokens"] == r["token_budget"] for r in rows)
    record = json.loads(table.schema.metadata[b"rollout"])  # the file says how it was made
    assert record["rollout"]["samples"] == 3 and record["policy"]["model"] == str(tiny_model_dir) and record["stage"] == 2
    assert validate_file(out, "trajectories") == 15
    broken = table.set_column(table.column_names.index("reward"), "reward", pc.add(table["reward"], 100.0))
    bad = tmp_path / "bad.parquet"
    pq.write_table(broken, bad)
    with pytest.raises(DataValidationError, match="reward"):
        validate_file(bad, "trajectories")
    # one cap for every answer, below the optimal answers: the check refuses the file
    capped = rollout(instances_file, tmp_path / "capped.parquet", policy, RolloutSettings(max_new_tokens=10, threads=1),
                     limit=2, progress=False)
    assert set(pq.read_table(capped.out).column("token_budget").to_pylist()) == {10}
    with pytest.raises(DataValidationError, match="token_budget"):
        validate_file(capped.out, "trajectories")


def test_rollout_command_reads_params_and_overrides(tiny_model_dir, instances_file, tmp_path, capsys):
    params = write_params(tmp_path / "params.yaml", tiny_params(tiny_model_dir))
    out = tmp_path / "t.parquet"
    base = ["--params", str(params), "--instances", str(instances_file), "--out", str(out), "--no-progress"]
    assert main(base + ["--set", "rollout.max_new_tokens=6", "--limit", "2", "--out-metrics", str(tmp_path / "m.json")]) == 0
    printed = capsys.readouterr().out
    assert "wrote 2 trajectories" in printed and "time: model loading" in printed
    assert json.loads((tmp_path / "m.json").read_text())["validation"]["n"] == 2
    assert max(pq.read_table(out).column("completion_tokens").to_pylist()) <= 6
    assert main(base + ["--set", "policy.model=no-org/no-model", "--set", "start.model=no-org/no-model"]) == 2
    assert "never downloaded" in capsys.readouterr().err
    assert main(base + ["--set", "rollout.backend=openai"]) == 2
    assert "rollout.base_url" in capsys.readouterr().err
    assert main(base + ["--set", "rollout.sampels=2"]) == 2
    assert "rollout.sampels" in capsys.readouterr().err


def test_the_benchmark_evaluation_scores_the_early_agent_counts_before_whole_from_stage(tiny_model_dir, instances_file,
                                                                                      tmp_path, capsys):
    """``--evaluate``: evaluate.max_new_tokens for the budgets, and before evaluate.whole_from_stage only the boards
    of evaluate.early_agents agents (the instances here are all two-agent boards)."""
    params = write_params(tmp_path / "params.yaml", tiny_params(tiny_model_dir))
    out = tmp_path / "b.parquet"
    base = ["--params", str(params), "--instances", str(instances_file), "--out", str(out), "--no-progress", "--evaluate",
            "--set", "benchmark.agents={2: [3, 5], 3: [3, 5]}", "--set", "evaluate.whole_from_stage=1",
            "--set", "evaluate.max_new_tokens=7"]
    assert main(base + ["--stage", "0", "--set", "evaluate.early_agents=[2]"]) == 0
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == 5 and {r["num_agents"] for r in rows} == {2} and {r["token_budget"] for r in rows} == {7}
    assert main(base + ["--stage", "0", "--set", "evaluate.early_agents=[3]"]) == 2  # nothing left to answer
    assert "no instance of [3] agents" in capsys.readouterr().err
    assert main(base + ["--stage", "1", "--set", "evaluate.early_agents=[3]"]) == 0  # from stage 1 on: every board
    assert pq.read_table(out).num_rows == 5
    assert main(base + ["--stage", "0", "--set", "evaluate.early_agents=[4]"]) == 2  # not a count the benchmark has
    assert "evaluate.early_agents: the benchmark has no boards of [4] agents" in capsys.readouterr().err


def test_a_stage_before_whole_from_stage_may_score_no_benchmark_board(tiny_model_dir, instances_file, tmp_path,
                                                                    monkeypatch, capsys):
    """evaluate.early_agents: [] -- the stages before whole_from_stage answer no benchmark board: an empty answer table
    that passes its data check (check-data --allow-empty), written without loading the model or claiming a GPU; from
    whole_from_stage on, every board as before."""
    from steps import rollout as rollout_step

    params = write_params(tmp_path / "params.yaml", tiny_params(tiny_model_dir))
    out = tmp_path / "b.parquet"
    base = ["--params", str(params), "--instances", str(instances_file), "--out", str(out), "--no-progress", "--evaluate",
            "--set", "benchmark.agents={2: [3, 5], 3: [3, 5]}", "--set", "evaluate.whole_from_stage=1",
            "--set", "evaluate.early_agents=[]"]

    def no_model(*args, **kwargs):
        raise AssertionError("a stage that answers nothing loaded a model")

    monkeypatch.setattr(rollout_step, "make_backend", no_model)
    monkeypatch.setattr("policy.devices.claim_gpu", no_model)
    assert main(base + ["--stage", "0"]) == 0
    assert pq.read_table(out).num_rows == 0 and "wrote 0 trajectories" in capsys.readouterr().out
    assert validate_file(out, "trajectories", allow_empty=True) == 0  # the DVC stage's check-data --allow-empty
    with pytest.raises(DataValidationError, match="row_count"):
        validate_file(out, "trajectories")
    assert json.loads(pq.read_schema(out).metadata[b"rollout"])["agents"] == []  # evaluate reads it
    monkeypatch.undo()
    assert main(base + ["--stage", "1"]) == 0 and pq.read_table(out).num_rows == 5  # whole_from_stage: every board
