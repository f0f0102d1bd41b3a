import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from envgen.config import EnvConfig, SizeConfig
from envgen.dataset import write_instances
from envgen.generator import generate
from tasks.cli import main
from tasks.rollout import TRAJECTORY_COLUMNS, RolloutConfig, rollout
from tasks.validate import DataValidationError, validate_file


@pytest.fixture(scope="module")
def instances_file(tmp_path_factory):
    cfg = EnvConfig(budget=5, seed=9, sizes={3: SizeConfig(data_ratio=1), 5: SizeConfig(data_ratio=1)})
    path = tmp_path_factory.mktemp("inst") / "instances.parquet"
    write_instances(path, generate(cfg), cfg)
    return path


def test_rollout_writes_scored_trajectories_that_pass_validation(tiny_model_dir, instances_file, tmp_path):
    out = tmp_path / "traj.parquet"
    cfg = RolloutConfig(model=str(tiny_model_dir), samples=3, max_new_tokens=10, threads=1, stage=2, seed=5)
    summary = rollout(instances_file, out, cfg, progress=False)
    table = pq.read_table(out)
    assert summary.rows == table.num_rows == 15
    assert summary.load_seconds > 0 and summary.seconds > 0  # loading is timed apart from generation
    assert table.column_names == [name for name, _, _ in TRAJECTORY_COLUMNS]
    rows = table.to_pylist()
    assert {r["sample_index"] for r in rows} == {0, 1, 2} and {r["stage"] for r in rows} == {2}
    assert all(r["model_id"] == str(tiny_model_dir) and r["backend"] == "transformers" for r in rows)
    assert all((r["parse_error"] is None) == r["parsed"] for r in rows)
    assert validate_file(out, "trajectories") == 15
    broken = table.set_column(table.column_names.index("reward"), "reward", pc.add(table["reward"], 100.0))
    bad = tmp_path / "bad.parquet"
    pq.write_table(broken, bad)
    with pytest.raises(DataValidationError, match="reward"):
        validate_file(bad, "trajectories")


def test_rollout_cli_and_bad_arguments(tiny_model_dir, instances_file, tmp_path, capsys):
    out = tmp_path / "t.parquet"
    code = main(["rollout", "--instances", str(instances_file), "--out", str(out), "--model", str(tiny_model_dir),
                 "--samples", "1", "--max-new-tokens", "6", "--threads", "1", "--no-progress", "--moves", "letters"])
    printed = capsys.readouterr().out
    assert code == 0 and "wrote 5 trajectories" in printed and "time: model loading" in printed
    code = main(["rollout", "--instances", str(instances_file), "--out", str(out), "--model", "no-org/no-model", "--no-progress"])
    assert code == 2 and "never downloaded" in capsys.readouterr().err
    with pytest.raises(ValueError, match="base_url"):
        RolloutConfig(backend="openai")
