"""The warm trainer (``env-engineer train-server``: steps/train.py's job on policy/warm_workers.py's processes): a stage
handed to it is the stage the step trains itself, a job it must not run is refused with the field named, and its
workers end with it."""

import json
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from safetensors.torch import load_file
from torch._dynamo.utils import counters

from envgen.core.config import EnvConfig, SizeConfig
from envgen.formats.dataset import write_instances
from envgen.generator import generate
from pipeline.params import PolicySettings
from pipeline.train_settings import TrainSettings
from policy.serve import RunningServer
from policy.warm_workers import Workers, make_app
from steps.train import main as train_main, parse_job, train, train_elsewhere, train_job, trained_line, warm_worker
from tests.helpers import free_port, tiny_params, write_params


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_model_dir):
    """A folder with a stage's instances and the tiny parameters (distillation), as a repository would hold them."""
    root = tmp_path_factory.mktemp("repo")
    cfg = EnvConfig(budget=8, seed=4, sizes={3: SizeConfig(data_ratio=1)})
    write_instances(root / "instances.parquet", generate(cfg), cfg)
    params = tiny_params(tiny_model_dir)
    params["train"].update(recipe="distill", sft_batch_size=4, threads=1, lora_r=4, lora_alpha=8)
    write_params(root / "params.yaml", params)
    return root


def stage_args(root, out, *sets):
    return ["--params", str(root / "params.yaml"), "--instances", str(root / "instances.parquet"),
            "--out-adapter", str(out / "adapter"), "--out-completions", str(out / "c.parquet"),
            "--out-metrics", str(out / "m.json"), "--out-sft-history", str(out / "sft.json"),
            *[w for s in sets for w in ("--set", s)]]


def trainer_app(workers, root):
    return make_app(workers, lambda raw: parse_job(raw, root), train_job, trained_line)


def test_a_stage_handed_to_the_warm_trainer_is_the_stage_its_own_process_trains(repo, capsys, monkeypatch):
    workers = Workers(1, warm_worker)
    server = RunningServer(trainer_app(workers, repo))
    url = server.url.removesuffix("/v1")
    try:
        assert train_main(stage_args(repo, repo / "here")) == 0
        assert train_main(stage_args(repo, repo / "there", f"train.server={url}")) == 0
        assert "goes to the warm trainer" in capsys.readouterr().err
        # the next stage, from the first's adapter, in the same (now warm) worker; relative paths are the step's
        monkeypatch.chdir(repo)
        assert train_main([*stage_args(repo, repo / "there2", f"train.server={url}")[:2], "--instances",
                           "instances.parquet", "--out-adapter", "there2/adapter", "--out-completions",
                           "there2/c.parquet", "--out-metrics", "there2/m.json", "--init-adapter", "there/adapter",
                           "--set", f"train.server={url}"]) == 0
        with urllib.request.urlopen(url + "/health") as r:
            health = json.loads(r.read())
        # the server's line says where the stage's time went: the training in the worker, and its supervised pass
        assert re.search(r"trained \S+there2/adapter \(training [\d.]+ s; supervised pass [\d.]+ s, \d+ steps\) in "
                         r"[\d.]+ s \(0 running or waiting\)", capsys.readouterr().out)
    finally:
        server.stop()
        workers.shutdown()
    here, there = (load_file(repo / d / "adapter" / "adapter_model.safetensors") for d in ("here", "there"))
    assert here.keys() == there.keys() and all(here[k].equal(there[k]) for k in here)
    for name in ("m.json", "sft.json"):
        a, b = (json.loads((repo / d / name).read_text()) for d in ("here", "there"))
        if name == "m.json":  # wall times differ; everything the training computed is the same
            a, b = ({k: v for k, v in m.items() if "seconds" not in k and "per_s" not in k} for m in (a, b))
        assert a == b
    assert (repo / "there2" / "adapter" / "adapter_config.json").exists()
    assert json.loads((repo / "there2" / "m.json").read_text())["sft/examples"] == 8
    assert health == {"status": "ok", "workers": 1, "jobs": 0, "done": 2}


class Idle:
    """Workers that must never be asked: every job below is refused before it reaches them."""

    count, running, done = 1, 0, 0

    @property
    def pool(self):
        raise AssertionError("a refused job reached the workers")


def post(url, body, headers=None):
    request = urllib.request.Request(url + "/jobs", data=body, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_warm_trainer_refuses_what_it_must_not_run(repo, tmp_path, tiny_model_dir):
    server = RunningServer(trainer_app(Idle(), repo))
    url = server.url.removesuffix("/v1")
    inside = {"instances": str(repo / "instances.parquet"), "out_adapter": str(repo / "x" / "adapter"),
              "out_completions": str(repo / "x" / "c.parquet"), "out_metrics": str(repo / "x" / "m.json"),
              "settings": {}, "policy": {"model": str(tiny_model_dir)}}
    try:
        cases = {
            "out_adapter": {**inside, "out_adapter": str(tmp_path / "adapter")},  # outside --root
            "instances": {**inside, "instances": "instances.parquet"},  # relative: whose folder?
            "out_metrics": {**inside, "out_metrics": str(repo / ".." / tmp_path.name / "m.json")},
            "settings.learning_rat": {**inside, "settings": {"learning_rat": 1}},
            "settings.server": {**inside, "settings": {"server": "ftp://x"}},
            "extra": {**inside, "extra": 1},
            "out_completions": {k: v for k, v in inside.items() if k != "out_completions"},
        }
        for field, body in cases.items():
            status, answer = post(url, json.dumps(body).encode())
            assert status == 400 and answer["error"]["param"] == field, (field, answer)
        assert post(url, b"[1, 2")[0] == 400
        assert post(url, b"{}" * 200_000)[0] == 413
        assert post(url, json.dumps(inside).encode(), {"Content-Type": "text/plain"})[0] == 415
        assert post(url, json.dumps(inside).encode(), {"Host": "evil.example"})[0] == 401
    finally:
        server.stop()
    import argparse
    from pathlib import Path

    paths = argparse.Namespace(**{k: Path(v) for k, v in inside.items() if k.startswith(("instances", "out_"))},
                               out_details=None, out_sft_history=None, out_grpo_history=None, init_adapter=None)
    with pytest.raises(ValueError, match="no answer .*start `env-engineer train-server` there"):
        train_elsewhere(url, paths, TrainSettings(), PolicySettings())  # stopped: nothing listens there now


@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile on the CPU needs a C++ compiler")
def test_a_warm_workers_next_stage_compiles_nothing_again(repo, tiny_model_dir):
    """A warm worker trains each stage on a model loaded afresh; its compiled decoder layers must come from the first
    stage's compilation (torch.compile's cache keys on the layer's code and the backend's settings, not on the model),
    else every stage would pay the compilation a process of its own pays."""
    settings = TrainSettings(recipe="distill", sft_batch_size=4, threads=1, lora_r=4, lora_alpha=8, device="cpu",
                             accel={"torch_compile": "sft", "compile_scope": "layers"})
    torch._dynamo.reset()
    counters.clear()
    try:
        graphs = []
        for stage in range(2):
            out = repo / f"compiled-{stage}"
            train(repo / "instances.parquet", out / "adapter", out / "c.parquet", out / "m.json", settings,
                  PolicySettings(model=str(tiny_model_dir)), progress=False)
            graphs.append(counters["stats"]["unique_graphs"])
        assert graphs[0] >= 1 and graphs[1] == graphs[0], f"graphs compiled after each stage: {graphs}"
        assert not counters["recompiles"], dict(counters["recompiles"])
    finally:
        torch._dynamo.reset()


def test_train_server_in_params_must_be_an_address():
    assert TrainSettings(server="http://127.0.0.1:8100").server == "http://127.0.0.1:8100"
    with pytest.raises(ValueError, match="train.server 'localhost:8100': give an http:// address"):
        TrainSettings(server="localhost:8100")



@pytest.mark.skipif(sys.platform != "linux", reason="the workers are bound to the server's life on Linux only")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_the_workers_end_with_the_server_however_it_is_stopped(repo, sig):
    """uvicorn raises a SIGTERM again once it has stopped, so the server's own clean-up never runs; a SIGKILL runs
    none: its warm workers must not outlive it, holding memory or a GPU."""
    import psutil

    server = subprocess.Popen([sys.executable, "-m", "env_engineer", "train-server", "--root", str(repo), "--workers",
                               "2", "--port", str(free_port())], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers = []
    try:
        deadline = time.monotonic() + 120
        while len(workers := [c for c in psutil.Process(server.pid).children()
                              if "--multiprocessing-fork" in c.cmdline()]) < 2:
            assert server.poll() is None and time.monotonic() < deadline, "the server did not start its workers"
            time.sleep(0.2)
        server.send_signal(sig)
        server.wait(timeout=60)
        _, alive = psutil.wait_procs(workers, timeout=60)
        assert not alive, f"workers {[w.pid for w in alive]} outlived the server ({sig.name})"
    finally:
        server.kill()
        for w in workers:
            if w.is_running():
                w.kill()
