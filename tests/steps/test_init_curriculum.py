import json

from envgen.core.config import EnvConfig
from pipeline.params import load_params
from steps.init_curriculum import main

from tests.helpers import tiny_params, write_params


def test_init_writes_round_zero_a_seeded_fresh_adapter_and_the_initial_summary(tmp_path, tiny_model_dir):
    params = write_params(tmp_path / "params.yaml", tiny_params(tiny_model_dir))
    files = []
    for run in ("a", "b"):
        assert main(["--params", str(params), "--set", "train.init=fresh", "--out-dir", str(tmp_path / run),
                     "--out-config", str(tmp_path / run / "c.yaml")]) == 0
        files.append({p.name: p.read_bytes() for p in sorted((tmp_path / run / "adapter").iterdir())})
    assert files[0] == files[1]  # same train.seed, same adapter bytes (target modules stored sorted)
    assert "adapter_model.safetensors" in files[0]
    config = json.loads(files[0]["adapter_config.json"])
    assert config["target_modules"] == sorted(config["target_modules"])
    assert EnvConfig.load(tmp_path / "a" / "c.yaml") == load_params(params).env
    assert json.loads((tmp_path / "a" / "summary.json").read_text()) == {"schema_version": 1, "stage": -1, "history": []}
    assert (tmp_path / "a" / "summary.json").read_text() == '{\n  "schema_version": 1,\n  "stage": -1,\n  "history": []\n}'
    assert main(["--params", str(params), "--set", "train.lora_r=0", "--out-dir", str(tmp_path / "c"),
                 "--out-config", str(tmp_path / "c.yaml")]) == 2


def test_init_from_the_starting_policy_copies_it_or_says_how_to_make_it(tmp_path, tiny_model_dir, capsys):
    params = write_params(tmp_path / "params.yaml", tiny_params(tiny_model_dir))
    start = tmp_path / "start"
    assert main(["--params", str(params), "--set", "train.init=fresh", "--out-dir", str(start),
                 "--out-config", str(tmp_path / "s.yaml")]) == 0  # any adapter stands in for the starting policy
    assert main(["--params", str(params), "--out-dir", str(tmp_path / "a"), "--out-config", str(tmp_path / "a.yaml"),
                 "--start-adapter", str(start / "adapter")]) == 0
    copied = {p.name: p.read_bytes() for p in (tmp_path / "a" / "adapter").iterdir()}
    assert copied == {p.name: p.read_bytes() for p in (start / "adapter").iterdir()}
    assert main(["--params", str(params), "--out-dir", str(tmp_path / "b"), "--out-config", str(tmp_path / "b.yaml"),
                 "--start-adapter", str(tmp_path / "missing")]) == 2
    assert "dvc repro starting-policy" in capsys.readouterr().err
    assert main(["--params", str(params), "--set", "policy.model=embedded", "--out-dir", str(tmp_path / "c"),
                 "--out-config", str(tmp_path / "c.yaml"), "--start-adapter", str(start / "adapter")]) == 2
    assert "set train.init: fresh" in capsys.readouterr().err
