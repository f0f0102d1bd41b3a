import pyarrow.parquet as pq

from env_engineer.cli import main
from envgen.formats.dataset import generator_stats_of


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_instances_cli_and_config_errors(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("num_agents: 2\nbudget: 12\nseed: 5\nsizes:\n  4: {data_ratio: 1, hole_ratio: 0.2, wait_ratio: 0.5}\n")
    out_file = tmp_path / "out" / "i.parquet"
    code, out, _ = run(capsys, "generate-instances", "--config", cfg, "--out", out_file, "--no-progress")
    assert code == 0 and "wrote 12 instances" in out and "needs-wait share 0.500" in out and out_file.exists()
    stats = generator_stats_of(out_file)
    assert stats["accepted"] == 12 and stats["over_budget"] == 0
    assert f"{stats['draws']} draws, rejected: " in out and "over solver budget (possibly solvable, left out): 0" in out
    code, _, err = run(capsys, "generate-instances", "--config", cfg, "--out", out_file, "--solver-nodes", 0)
    assert code == 2 and "--solver-nodes = 0: must be at least 1" in err
    cfg.write_text("num_agents: 2\nbudget: 12\nsizes:\n  4: {data_ratio: 1, hole_ratio: 0.9}\n")
    code, _, err = run(capsys, "generate-instances", "--config", cfg, "--out", out_file)
    assert code == 2 and "sizes.4.hole_ratio = 0.9" in err and "[0.0, 0.5]" in err
    code, _, err = run(capsys, "validate-config", cfg)
    assert code == 2 and "sizes.4.hole_ratio" in err


def test_generate_instances_excludes_instances_of_other_files(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("num_agents: 2\nbudget: 30\nseed: 1\nsizes:\n  3: {data_ratio: 1, hole_ratio: 0.2, wait_ratio: 0.5}\n")
    first, second = tmp_path / "a.parquet", tmp_path / "b.parquet"
    assert main(["generate-instances", "--config", str(cfg), "--out", str(first), "--no-progress"]) == 0
    assert main(["generate-instances", "--config", str(cfg), "--out", str(second), "--exclude", str(first), "--no-progress"]) == 0
    a = set(pq.read_table(first).column("content_hash").to_pylist())
    b = set(pq.read_table(second).column("content_hash").to_pylist())
    assert len(a) == len(b) == 30 and not a & b
