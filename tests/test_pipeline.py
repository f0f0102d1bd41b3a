"""The real pipeline: `dvc repro` of a tiny curriculum in a temporary git repository, a crash and a resume, bad data
stopping the pipeline, and the Prefect flow against a real Prefect server, read back through its API."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def sh(args: list[str], cwd: Path, check: bool = True, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1", "GX_ANALYTICS_ENABLED": "False"}
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def tiny_params(model: Path) -> dict:
    params = yaml.safe_load((ROOT / "presets" / "cpu.yaml").read_text())
    sizes = {3: {"data_ratio": 0.5, "hole_ratio": 0.2, "wait_ratio": 0.5, "min_path_length": 1},
             4: {"data_ratio": 0.5, "hole_ratio": 0.2, "wait_ratio": 0.5, "min_path_length": 1}}
    params["env"].update(budget=8, sizes=sizes)
    params["validation"].update(budget=4, sizes=sizes)
    params["train"].update(model=str(model), sft_max_examples=8, sft_batch_size=4, trajectories=8, num_generations=4,
                           prompts_per_step=2, micro_batch_size=4, max_completion_length=16, lora_r=4, lora_alpha=8, threads=1)
    params["rollout"].update(max_new_tokens=16, threads=1)
    params["engineer"].update(model=str(model), max_new_tokens=400, threads=1, attempts=1)
    params["benchmark"].update(per_cell=1, wait_ratios=[0.5], agents={3: [3, 4], 4: [4]})
    params["evaluate"].update(max_new_tokens=16)
    return params


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_model_dir) -> Path:
    path = tmp_path_factory.mktemp("pipeline")
    shutil.copy(ROOT / "dvc.yaml", path / "dvc.yaml")
    (path / "params.yaml").write_text(yaml.safe_dump(tiny_params(tiny_model_dir), sort_keys=False))
    sh(["git", "init", "-q"], path)
    sh(["git", "config", "user.email", "t@example.org"], path)
    sh(["git", "config", "user.name", "test"], path)
    sh(["dvc", "init", "-q"], path)
    sh(["dvc", "config", "core.analytics", "false"], path)
    sh(["git", "add", "-A"], path)
    sh(["git", "commit", "-qm", "pipeline"], path)
    return path


@pytest.fixture(scope="module")
def reproduced(repo) -> tuple[Path, str]:
    """The repository after one `dvc repro`, committed, and that command's output: every later test starts from a
    finished pipeline, also when it runs alone."""
    out = sh(["dvc", "repro"], repo).stdout
    sh(["git", "add", "-A"], repo)
    sh(["git", "commit", "-qm", "run"], repo)
    return repo, out


def test_dvc_repro_runs_the_curriculum(reproduced):
    repo, out = reproduced
    for stage in ("validation-set", "benchmark", "init-curriculum", "generate-instances@0", "train@0", "rollout@0", "evaluate@0",
                  "summarize-failures@0", "engineer-config@0", "engineer-config@1"):
        assert f"Running stage '{stage}'" in out
    stages = repo / "data" / "stages"
    for k in (0, 1):
        for name in ("instances.parquet", "train_completions.parquet", "validation.parquet", "summary.json", "summary.md",
                     "engineer_log.json", "train_metrics.json", "validation_metrics.json", "benchmark_metrics.json", "benchmark.md"):
            assert (stages / str(k) / name).exists(), (k, name)
        assert (stages / str(k) / "adapter" / "adapter_config.json").exists()
    assert (stages / "2" / "config.yaml").exists()  # the proposal for a stage after the last one
    summary1 = json.loads((stages / "1" / "summary.json").read_text())
    assert [h["stage"] for h in summary1["history"]] == [0]
    log = json.loads((stages / "0" / "engineer_log.json").read_text())
    assert log["engineer"] == "policy" and log["constrained"] and log["config"]["seed"] == 1
    assert "Running stage" not in sh(["dvc", "repro"], repo).stdout  # all up to date
    metrics = json.loads(sh(["dvc", "metrics", "show", "--json"], repo).stdout)
    assert "validation" in json.dumps(metrics) and "train/trajectories" in json.dumps(metrics)
    plots = sh(["dvc", "plots", "show", "--json"], repo).stdout
    assert "train_history.json" in plots
    diff = sh([str(BIN / "env-engineer"), "diff-configs", "data/stages/0/config.yaml", "data/stages/1/config.yaml"], repo).stdout
    assert "seed" in diff


def test_params_diff_shows_engineered_changes_across_revisions(reproduced):
    repo, _ = reproduced
    cfg = repo / "data" / "stages" / "1" / "config.yaml"
    original = cfg.read_text()
    data = yaml.safe_load(original)
    data["sizes"][3]["hole_ratio"] = 0.35
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))
    shown = sh(["dvc", "params", "diff"], repo).stdout
    assert "data/stages/1/config.yaml" in shown and "sizes.3.hole_ratio" in shown
    cfg.write_text(original)


def test_crash_mid_stage_then_repro_finishes_with_nothing_lost(reproduced):
    repo, _ = reproduced
    stages = repo / "data" / "stages"
    before = (stages / "0" / "instances.parquet").stat().st_mtime_ns
    lock_before = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["train@0"]["outs"]
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["train"]["learning_rate"] = 1e-4  # train@0 and everything after it must run again (init-curriculum not)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1"}
    proc = subprocess.Popen(["dvc", "repro"], cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and not list((stages / "0").glob(".adapter.work-*")):
        time.sleep(0.2)
    assert list((stages / "0").glob(".adapter.work-*")), "train@0 never started"
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGKILL)  # the crash: training is mid-way
    proc.wait()
    adapter = stages / "0" / "adapter"
    # DVC removed the old output before running the stage; what is there is never a half-written adapter.
    assert not adapter.exists() or {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    sh(["rm", "-f", ".dvc/tmp/lock", ".dvc/tmp/rwlock"], repo, check=False)  # a killed DVC leaves its lock behind
    # Nothing lost: the previous adapter comes back from the DVC cache...
    params["train"]["learning_rate"] = 5e-5
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    sh(["dvc", "checkout", "train@0"], repo)
    assert (adapter / "adapter_config.json").exists()
    assert "Running stage" not in sh(["dvc", "repro"], repo).stdout
    # ... and with the new setting, `dvc repro` resumes with the stage that did not finish.
    params["train"]["learning_rate"] = 1e-4
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = sh(["dvc", "repro"], repo).stdout
    assert "Running stage 'train@0'" in out and "Running stage 'generate-instances@0'" not in out
    assert (stages / "0" / "instances.parquet").stat().st_mtime_ns == before
    assert (adapter / "adapter_config.json").exists() and lock_before
    assert "Running stage" not in sh(["dvc", "repro"], repo).stdout
    assert not list(stages.rglob(".adapter.work-*"))


def test_bad_data_stops_the_pipeline_with_a_clear_message(reproduced, tmp_path):
    repo, _ = reproduced
    bad = tmp_path / "bad"
    shutil.copytree(repo, bad, symlinks=True)
    params = yaml.safe_load((bad / "params.yaml").read_text())
    params["train"]["reward"]["unparseable"] = -20.0  # rewards leave the trajectories suite's range
    (bad / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    proc = sh(["dvc", "repro"], bad, check=False)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "expect_column_values_to_be_between" in text and "'column': 'reward'" in text
    assert "failed to reproduce 'train@0'" in text  # caught where it first appears: the GRPO completions
    assert "Running stage 'rollout@0'" not in text


def test_prefect_flow_against_a_real_server(reproduced):
    repo, _ = reproduced
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        from flows.curriculum import STEPS, curriculum

        state = curriculum(repo=str(repo), return_state=True)
        assert state.is_completed(), state
        result = state.result()
        assert result == {"stages": [0, 1]}

        import asyncio

        async def read_back():
            async with get_client() as client:
                flow_run = await client.read_flow_run(state.state_details.flow_run_id)
                task_runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
                artifacts = await client.read_artifacts()
                return flow_run, task_runs, artifacts

        flow_run, task_runs, artifacts = asyncio.run(read_back())
        assert flow_run.state.is_completed()
        names = {t.name for t in task_runs}
        for step in STEPS:
            for k in (0, 1):
                assert f"{step}@{k}" in names
        assert {"validation-set", "benchmark", "init-curriculum"} <= names
        assert all(t.state.is_completed() for t in task_runs)
        keys = {a.key for a in artifacts}
        assert {"stage-0-metrics", "stage-0-config-diff", "stage-1-metrics"} <= keys

        # A run with overrides (as from the UI) becomes a DVC experiment; the workspace is left as it was.
        params_before = (repo / "params.yaml").read_text()
        exp = curriculum(repo=str(repo), overrides={"train.trajectories": 4}, return_state=True)
        assert exp.is_completed(), exp
        assert (repo / "params.yaml").read_text() == params_before
        shown = sh(["dvc", "exp", "show", "--json"], repo).stdout
        assert '"trajectories": 4' in shown
