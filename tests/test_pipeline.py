"""The real pipeline: `dvc repro` of a tiny curriculum in a temporary git repository (tests/conftest.py), a crash and a
resume, bad data stopping the pipeline, and a queued experiment (the Prefect flow: tests/flows)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import yaml

from tests.conftest import BIN, ROOT, sh
from tests.helpers import free_port


def test_dvc_repro_runs_the_curriculum(reproduced):
    repo, out = reproduced
    for stage in ("start-instances", "starting-policy", "validation-set", "benchmark", "init-curriculum", "generate-instances@0", "train@0", "validate@0", "evaluate@0",
                  "summarize-failures@0", "engineer-config@0", "engineer-config@1"):
        assert f"Running stage '{stage}'" in out
    stages = repo / "data" / "stages"
    for k in (0, 1):
        for name in ("instances.parquet", "train_completions.parquet", "validation.parquet", "summary.json", "summary.md",
                     "engineer_log.json", "train_metrics.json", "train_details.json", "validation_metrics.json",
                     "benchmark_metrics.json", "benchmark_table.json", "benchmark.md"):
            assert (stages / str(k) / name).exists(), (k, name)
        assert (stages / str(k) / "adapter" / "adapter_config.json").exists()
    assert (stages / "2" / "config.yaml").exists()  # the proposal for a stage after the last one
    summary1 = json.loads((stages / "1" / "summary.json").read_text())
    assert [h["stage"] for h in summary1["history"]] == [0]
    log = json.loads((stages / "0" / "engineer_log.json").read_text())
    assert log["engineer"] == "policy" and log["constrained"] and log["config"]["seed"] == 1
    assert "Running stage" not in sh(["dvc", "repro"], repo).stdout  # all up to date
    metrics = sh(["dvc", "metrics", "show", "--json"], repo).stdout
    assert "validation" in metrics and "train/trajectories" in metrics and "bench_table" not in metrics
    shown = sh(["dvc", "metrics", "show"], repo).stdout.splitlines()
    assert len(shown[0].split()) < 40, shown[0]  # headline numbers, not whole tables (451 columns before)
    plots = json.loads(sh(["dvc", "plots", "show", "--json"], repo).stdout)
    assert not plots.get("errors"), plots.get("errors")
    for k in (0, 1):
        for name, y in (("sft_history.json", "loss"), ("grpo_history.json", "reward")):
            rendered = plots["data"][f"data/stages/{k}/{name}"]
            points = [p for r in rendered for p in r["content"]["data"]["values"]]
            assert points and all(isinstance(p[y], float) for p in points), (k, name)
    diff = sh([str(BIN / "env-engineer"), "diff-configs", "data/stages/0/config.yaml", "data/stages/1/config.yaml"], repo).stdout
    assert "seed" in diff


def test_the_starting_policy_is_computed_once_and_every_curriculum_starts_from_it(reproduced, tmp_path):
    """The shared starting policy is a DVC stage whose outputs, demonstrations included, live in git: a fresh clone
    (no DVC cache, and maybe a pyarrow that would write the demonstrations as other bytes) finds both start stages up
    to date and never regenerates or retrains them; stage 0 continues from a copy of the adapter."""
    repo, _ = reproduced
    start, init = repo / "data" / "start" / "adapter", repo / "data" / "stages" / "init" / "adapter"
    assert (start / "adapter_model.safetensors").read_bytes() == (init / "adapter_model.safetensors").read_bytes()
    tracked = sh(["git", "ls-files", "data/start"], repo).stdout.split()
    assert "data/start/instances.parquet" in tracked and "data/start/adapter/adapter_model.safetensors" in tracked
    clone = tmp_path / "clone"
    sh(["git", "clone", "-q", str(repo), str(clone)], tmp_path)
    assert not (clone / ".dvc" / "cache").exists()
    status = sh(["dvc", "status", "start-instances", "starting-policy"], clone).stdout
    assert "up to date" in status, status


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
    params["policy"]["reward"]["unparseable"] = -20.0  # rewards leave the completions suite's range
    (bad / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    proc = sh(["dvc", "repro"], bad, check=False)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "expect_column_values_to_be_between" in text and "'column': 'reward'" in text
    assert "failed to reproduce 'train@0'" in text  # caught where it first appears: the GRPO completions
    assert "Running stage 'validate@0'" not in text


def test_compare_queues_experiments_of_the_real_pipeline_and_restores_shared_stages(reproduced, tmp_path):
    """`env-engineer compare --run --serve env-engineer --warm-trainers 1` on the tiny pipeline: one warm server answers
    the rollouts of every experiment, each stage's adapter loaded into it, and one warm trainer trains every stage;
    DVC's queue runs each engineer's experiment; the stages
    before the engineers' first decision are not computed again, and the table comes from `dvc exp show`."""
    repo, _ = reproduced
    out = tmp_path / "c.json"
    proc = sh([str(BIN / "env-engineer"), "compare", "--repo", str(repo), "--engineers", "fixed,heuristic", "--seeds", "0",
               "--run", "--jobs", "2", "--out-json", str(out), "--out-md", str(tmp_path / "c.md"),
               "--serve", "env-engineer", "--serve-port", str(free_port()),
               "--warm-trainers", "1", "--warm-trainers-port", str(free_port())], repo)
    run = json.loads(out.read_text())["run"]
    assert run["serve"] == "env-engineer" and run["params"]["rollout"]["backend"] == "openai" and run["warm_engine_up_s"] > 0
    # every stage the experiments trained (the shared stage 0, then stage 1 of each) went to the one warm trainer
    assert run["warm_trainers"] == 1 and run["params"]["train"]["server"].startswith("http://127.0.0.1:")
    assert (tmp_path / "c.train.log").read_text().count(" trained ") >= 2
    loads = (tmp_path / "c.serve.log").read_text().count("loaded adapter adapter-")
    logs = {name: sh(["dvc", "queue", "logs", name], repo).stdout for name in ("cmp-fixed-s0", "cmp-heuristic-s0")}
    # the shared stage 0's adapter once (validate@0 loads it, evaluate@0 finds it loaded), then the stage-1 adapter of
    # each experiment that answered with it; one whose stage-1 rollouts DVC restored from its run-cache (the other
    # experiment, finished first, trained the same weights on the same boards) asks the server nothing
    answered = sum(any(f"Running stage '{s}@1'" in log for s in ("evaluate", "validate")) for log in logs.values())
    assert answered >= 1 and loads == 1 + answered, (loads, answered)
    table = json.loads(out.read_text())["arms"]
    assert set(table) == {"fixed", "heuristic"} and all(row["seeds"] == [0] for row in table.values())
    assert {"acc/3_agents", "val/valid"} <= set(table["fixed"]["metrics"]), proc.stdout
    for name, log in logs.items():
        assert "Running stage 'engineer-config@0'" in log and "stage 'train@1'" in log.lower()  # run, or restored
        for shared in ("generate-instances@0", "train@0", "evaluate@0", "validate@0", "summarize-failures@0"):
            assert f"Running stage '{shared}'" not in log, (shared, log[-2000:])


def test_each_stage_is_scored_before_the_next_stage_trains(tmp_path):
    """DVC runs the stages of an experiment in one depth-first order: every ``evaluate@K`` must come right after
    ``train@K`` (before stage K+1), so a comparison stopped part-way has benchmark scores for every stage it finished.
    Checked on the GPU preset's four stages."""
    from dvc.repo import Repo
    from dvc.repo.reproduce import plan_repro

    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    shutil.copy(ROOT / "presets" / "gpu-embedded.yaml", tmp_path / "params.yaml")
    sh(["git", "init", "-q"], cwd=tmp_path)
    sh([str(BIN / "dvc"), "init", "-q"], cwd=tmp_path)
    with Repo(str(tmp_path)) as repo:
        order = [s.name for s in plan_repro(repo.index.graph)]
    stages = [row["stage"] for row in yaml.safe_load((tmp_path / "params.yaml").read_text())["curriculum"]]
    assert len(stages) == 4
    for k in stages:
        after = order[order.index(f"train@{k}") + 1:]
        assert after[0] == f"evaluate@{k}", order
        assert after.index(f"evaluate@{k}") < after.index(f"engineer-config@{k}")


def test_a_stage_answered_through_one_warm_server_matches_its_own_process(reproduced, tiny_model_dir, tmp_path):
    """The warm-engine path of a comparison: `env-engineer rollout` with the openai backend loads the stage's adapter
    into a running `env-engineer serve --adapters-from REPO` and gets, answer for answer, what validate@0 got in a
    process of its own (greedy, the same budgets: counted with the model's own tokenizer)."""
    import pyarrow.parquet as pq

    from policy.backends import TransformersBackend
    from policy.serve import RunningServer, make_app
    from policy.serve_adapters import AdapterShelf

    repo, _ = reproduced

    def make(folder=None):
        return TransformersBackend(str(tiny_model_dir), folder and str(folder), device="cpu", batch_size=1, threads=1)

    server = RunningServer(make_app(make(), "tiny", adapters=AdapterShelf(repo, make)))
    out = tmp_path / "served.parquet"
    try:
        sh([str(BIN / "env-engineer"), "rollout", "--params", "params.yaml", "--instances",
            "data/validation/instances.parquet", "--adapter", "data/stages/0/adapter", "--stage", "0", "--out", str(out),
            "--no-progress", "--set", "rollout.backend=openai", "--set", f"rollout.base_url={server.url}",
            "--set", "rollout.api_key_env=null", "--set", "rollout.concurrency=4"], repo)
    finally:
        server.stop()
    served, local = pq.read_table(out).to_pylist(), pq.read_table(repo / "data/stages/0/validation.parquet").to_pylist()
    assert len(served) == len(local) > 0
    assert [r["token_budget"] for r in served] == [r["token_budget"] for r in local]
    assert [r["completion"] for r in served] == [r["completion"] for r in local]
    assert {r["backend"] for r in served} == {"openai"} and served[0]["adapter_hash"] == local[0]["adapter_hash"]
    assert served[0]["model_id"] == local[0]["model_id"]  # the base model, as the local rows name it
