import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from envgen.config import EnvConfig
from envgen.dataset import generate_verified, write_instances
from env_engineer.cli import main
from experiments.sensitivity import combine_heldout, markdown, paired_difference, summarise, wilson
from tests.helpers import tiny_params, write_params

SIZES = {3: {"data_ratio": 0.5, "hole_ratio": 0.2, "wait_ratio": 0.5, "min_path_length": 1},
         4: {"data_ratio": 0.5, "hole_ratio": 0.2, "wait_ratio": 0.5, "min_path_length": 1}}


def test_wilson_interval_and_paired_difference():
    low, high = wilson(50, 100)
    assert low == pytest.approx(0.4038, abs=1e-3) and high == pytest.approx(0.5962, abs=1e-3)
    assert wilson(0, 0) == (0.0, 1.0) and wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == pytest.approx(1.0)
    d = paired_difference([True, True, False, True], [False, True, False, False])
    assert d["diff"] == pytest.approx(0.5) and d["low"] < 0.5 < d["high"] and d["n"] == 4
    assert paired_difference([True] * 3, [True] * 3) == {"diff": 0.0, "low": 0.0, "high": 0.0, "n": 3}
    with pytest.raises(ValueError, match="equally long"):
        paired_difference([True], [True, False])


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
