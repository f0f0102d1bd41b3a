import json

from envgen.config import EnvConfig, SizeConfig
from tasks.cli import main
from tasks.curriculum import config_diff


def test_config_diff_lists_changed_knobs_and_shares(tmp_path, capsys):
    a = EnvConfig(budget=10, seed=0, sizes={3: SizeConfig(data_ratio=0.5), 4: SizeConfig(data_ratio=0.5)})
    b = EnvConfig(budget=10, seed=1, sizes={3: SizeConfig(data_ratio=0.5, hole_ratio=0.3), 4: SizeConfig(data_ratio=1.5 / 2)})
    rows = {f: (x, y) for f, x, y in config_diff(a, b)}
    assert rows["seed"] == (0, 1) and rows["sizes.3.hole_ratio"] == (0.2, 0.3)
    assert rows["sizes.3.share"] == (0.5, 0.4) and rows["sizes.4.data_ratio"] == (0.5, 0.75)
    assert "sizes.4.hole_ratio" not in rows and config_diff(a, a) == []
    a.save(tmp_path / "a.yaml")
    b.save(tmp_path / "b.yaml")
    assert main(["diff-configs", str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml"), "--json"]) == 0
    assert {"field": "seed", "a": 0, "b": 1} in json.loads(capsys.readouterr().out)
    assert main(["diff-configs", str(tmp_path / "a.yaml"), str(tmp_path / "a.yaml")]) == 0
    assert "same configuration" in capsys.readouterr().out
    assert main(["diff-configs", str(tmp_path / "a.yaml"), str(tmp_path / "missing.yaml")]) == 2


def test_generate_instances_reads_a_params_section(tmp_path, capsys):
    params = tmp_path / "params.yaml"
    params.write_text("validation:\n  budget: 3\n  sizes: {3: {data_ratio: 1}}\nother: 1\n")
    out = tmp_path / "v.parquet"
    assert main(["generate-instances", "--config", str(params), "--section", "validation", "--out", str(out), "--no-progress"]) == 0
    assert main(["generate-instances", "--config", str(params), "--section", "missing", "--out", str(out)]) == 2
    assert "no section 'missing'" in capsys.readouterr().err
