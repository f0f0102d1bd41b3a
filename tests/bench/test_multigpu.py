"""bench/multigpu.py on the CPU: its arguments, the launch command it builds for N GPUs, the scaling arithmetic, and
one real 1-process train run of the step through it (its real use is on a machine with several GPUs)."""

import json
import sys
from pathlib import Path

import pytest

from envgen.core.config import EnvConfig, SizeConfig
from envgen.formats.dataset import write_instances
from envgen.generator import generate

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench import multigpu  # noqa: E402


def test_gpu_counts_are_checked():
    assert multigpu.parse_counts("1,2,4", "--gpus") == [1, 2, 4]
    for bad in ("", "0", "1,x"):
        with pytest.raises(ValueError, match="--gpus"):
            multigpu.parse_counts(bad, "--gpus")
    assert multigpu.main(["vllm", "--model", "m", "--tp", "two"]) == 2


def test_launch_command_for_several_gpus_is_accelerate_data_parallel(tmp_path):
    one = multigpu.train_command(1, "m", Path("i.parquet"), tmp_path, Path("p.yaml"), 64, 32, 8, [])
    two = multigpu.train_command(2, "m", Path("i.parquet"), tmp_path, Path("p.yaml"), 64, 32, 8, ["train.lora_r=8"])
    assert one[1:4] == ["-m", "env_engineer", "train"]
    assert two[1:3] == ["-m", "accelerate.commands.launch"] and "--multi_gpu" in two
    assert two[two.index("--num_processes") + 1] == "2" and two[two.index("env_engineer") - 1] == "-m"
    assert "train.recipe=distill" in two and "train.sft_batch_size=32" in two and two[-1] == "train.lora_r=8"
    assert str(tmp_path / "gpus2" / "metrics.json") in two


def test_scaling_is_against_the_one_gpu_row():
    rows = multigpu.scaling([{"gpus": 1, "tok_per_s": 100.0}, {"gpus": 2, "tok_per_s": 180.0}], "tok_per_s", "gpus")
    assert rows[1]["speedup"] == 1.8 and rows[1]["efficiency"] == 0.9 and rows[0]["efficiency"] == 1.0


def test_train_on_one_process_reads_the_steps_metrics(tiny_model_dir, tmp_path):
    from tests.helpers import tiny_params, write_params

    cfg = EnvConfig(budget=8, seed=4, sizes={3: SizeConfig(data_ratio=1)})
    instances = tmp_path / "i.parquet"
    write_instances(instances, generate(cfg), cfg)
    params = write_params(tmp_path / "params.yaml", tiny_params(tiny_model_dir))
    report = tmp_path / "r.json"
    assert multigpu.main(["train", "--model", str(tiny_model_dir), "--instances", str(instances), "--gpus", "1",
                          "--examples", "8", "--batch", "4", "--micro", "2", "--params", str(params), "--work",
                          str(tmp_path / "w"), "--json", str(report), "--set", "train.threads=1"]) == 0
    row = json.loads(report.read_text())["rows"][0]
    assert row["gpus"] == 1 and row["processes"] == 1 and row["steps"] == 2 and row["tokens"] > 0
    assert row["tok_per_s"] > 0 and "error" not in row
