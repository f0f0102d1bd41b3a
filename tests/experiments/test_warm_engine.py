"""The warm engine a study starts for its experiments' rollouts (experiments/warm_engine.py); the whole path, a
comparison of the real pipeline served by one `env-engineer serve`, is in tests/test_pipeline.py."""

import argparse
import socket
import sys
import time
from pathlib import Path

import pytest

from experiments import warm_engine
from experiments.warm_engine import (SERVERS, Serving, WarmEngine, WarmEngineError, WarmTrainer, from_arguments,
                                    trainer_from_arguments)
from pipeline.params import load_params
from tests.conftest import ROOT
from tests.helpers import free_port


def args(*words: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run", action="store_true")
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--repo", type=Path, default=ROOT)
    warm_engine.add_arguments(parser)
    return parser.parse_args(list(words))


def test_every_server_has_a_help_sentence_and_a_command():
    engine = WarmEngine("vllm", "embedded", Path("/models/m"), ROOT, Path("log"), lora_rank=48, adapters=24, port=8123)
    for kind, (sentence, command) in SERVERS.items():
        assert sentence and command(WarmEngine(kind, "embedded", Path("/models/m"), ROOT, Path("log")))
    words = engine.command()
    program = warm_engine.vllm_program()
    assert words[:len(program)] == program and words[len(program):len(program) + 2] == ["serve", "/models/m"]
    assert words[words.index("--max-lora-rank") + 1] == "64"  # the next rank vLLM accepts
    assert words[words.index("--served-model-name") + 1] == "embedded"  # what the rollouts' requests name
    assert words[words.index("--max-loras") + 1] == "24" and words[words.index("--port") + 1] == "8123"
    assert engine.overrides() == {"rollout.backend": "openai", "rollout.base_url": "http://127.0.0.1:8123/v1",
                                  "rollout.api_key_env": None, "rollout.concurrency": 256}


def test_vllm_runs_with_runtime_adapters_and_one_cpu_thread_unless_told(monkeypatch, tmp_path):
    """vLLM's environment: adapters loaded at runtime, and one torch thread unless OMP_NUM_THREADS says otherwise;
    the project's own server and the warm trainers keep this process's environment."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    engine = WarmEngine("vllm", "embedded", Path("/models/m"), ROOT, Path("log"))
    assert engine.environment() == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "OMP_NUM_THREADS": "1"}
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert engine.environment()["OMP_NUM_THREADS"] == "4"
    assert WarmEngine("env-engineer", "embedded", Path("/models/m"), ROOT, Path("log")).environment() == {}
    assert WarmTrainer(2, tmp_path, tmp_path / "log").environment() == {}
    # the server is started with it: a stand-in that says its thread count and exits
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(WarmEngine, "command", lambda self: [
        sys.executable, "-c", "import os, sys; print('threads', os.environ['OMP_NUM_THREADS']); sys.exit(3)"])
    served = WarmEngine("vllm", "embedded", Path("/models/m"), tmp_path, tmp_path / "s.log", port=free_port())
    with pytest.raises(WarmEngineError, match=r"exited \(3\)"):
        with Serving(served, poll_s=0.1) as ready:
            ready()
    assert "threads 1" in (tmp_path / "s.log").read_text()


def test_vllm_runs_as_this_pythons_module_where_it_imports(monkeypatch):
    """An offline install may unpack vLLM into the path without its ``vllm`` script: where vLLM imports, the server
    is this Python's ``-m vllm.entrypoints.cli.main`` (whose ``__main__`` guard keeps vLLM's spawned engine process
    from starting the server again)."""
    import importlib.util

    real = importlib.util.find_spec
    for found, program in ((object(), [sys.executable, "-m", "vllm.entrypoints.cli.main"]), (None, ["vllm"])):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: found if name == "vllm" else real(name, *a))
        engine = WarmEngine("vllm", "embedded", Path("/models/m"), ROOT, Path("log"))
        assert warm_engine.vllm_program() == program  # else the vllm on PATH
        assert engine.command()[:len(program) + 1] == [*program, "serve"]


def test_the_served_settings_are_checked_before_anything_starts():
    params = load_params(ROOT / "presets" / "gpu-distill.yaml")
    assert from_arguments(args(), params, {}, Path("log")) is None
    engine = from_arguments(args("--run", "--serve", "env-engineer"), params, {}, Path("log"))
    assert engine.kind == "env-engineer" and engine.adapters == 3 and engine.lora_rank == 64
    for words, needle in ((("--serve", "vllm"), "--serve needs --run"),
                          (("--run", "--serve", "vllm", "--serve-port", "0"), "--serve-port 0"),
                          (("--run", "--serve", "vllm", "--serve-gpu-memory", "1.5"), "--serve-gpu-memory 1.5"),
                          (("--run", "--serve", "vllm", "--serve-kv-cache-gib", "0"), "--serve-kv-cache-gib 0"),
                          (("--run", "--serve", "vllm", "--serve-start-s", "0"), "--serve-start-s 0")):
        with pytest.raises(ValueError, match=needle):
            from_arguments(args(*words), params, {}, Path("log"))
    with pytest.raises(ValueError, match="leave out --set rollout.backend"):
        from_arguments(args("--run", "--serve", "env-engineer"), params, {"rollout.backend": "transformers"}, Path("log"))


def test_vllm_gets_a_fixed_kv_cache_unless_told_to_profile_the_card():
    """Measuring the card while the experiments' trainers load onto it once left vLLM no KV cache at all; a fixed size
    is not measured (vLLM's --kv-cache-memory-bytes), and 'auto' leaves the sizing to vLLM's profile."""
    params = load_params(ROOT / "presets" / "gpu-distill.yaml")
    for words, size in (((), 8 * 2 ** 30), (("--serve-kv-cache-gib", "1.5"), 3 * 2 ** 29),
                        (("--serve-kv-cache-gib", "AUTO"), None)):
        command = from_arguments(args("--run", "--serve", "vllm", *words), params, {}, Path("log")).command()
        if size is None:
            assert "--kv-cache-memory-bytes" not in command
        else:
            assert command[command.index("--kv-cache-memory-bytes") + 1] == str(size)
        assert command[command.index("--gpu-memory-utilization") + 1] == "0.3"
    with pytest.raises(SystemExit):
        args("--run", "--serve", "vllm", "--serve-kv-cache-gib", "lots")


def test_more_server_options_follow_the_studys_own():
    """--serve-options adds words after the server's own, so that a later option of the same name wins (vLLM's
    parser keeps the last); a value that is not options is refused with the form to use."""
    params = load_params(ROOT / "presets" / "gpu-distill.yaml")
    for kind in SERVERS:
        plain = from_arguments(args("--run", "--serve", kind), params, {}, Path("log")).command()
        more = from_arguments(args("--run", "--serve", kind, "--serve-options", "--max-num-seqs 512 --max-loras 4"),
                              params, {}, Path("log")).command()
        assert more == [*plain, "--max-num-seqs", "512", "--max-loras", "4"]
    one = from_arguments(args("--run", "--serve", "vllm", "--serve-options=--enforce-eager"), params, {}, Path("log"))
    assert one.command()[-1] == "--enforce-eager" and one.options == ("--enforce-eager",)
    for bad in ("max-num-seqs 512", "--served-model-name 'open"):
        with pytest.raises(SystemExit):
            args("--run", "--serve", "vllm", f"--serve-options={bad}")


def test_the_warm_trainers_are_checked_and_point_every_experiment_at_them(tmp_path):
    assert trainer_from_arguments(args("--run"), {}, Path("log")) is None
    trainer = trainer_from_arguments(args("--run", "--warm-trainers", "4", "--warm-trainers-port", "8101"), {},
                                     Path("t.log"))
    assert trainer == WarmTrainer(4, ROOT, Path("t.log"), 8101, 600.0)
    words = trainer.command()
    assert words[words.index("train-server") + 1:] == ["--root", str(ROOT.resolve()), "--workers", "4", "--host",
                                                         "127.0.0.1", "--port", "8101"]
    assert trainer.overrides() == {"train.server": "http://127.0.0.1:8101"}
    for words, needle in ((("--warm-trainers", "2"), "--warm-trainers needs --run"),
                          (("--run", "--warm-trainers", "65"), "--warm-trainers 65"),
                          (("--run", "--serve", "vllm", "--serve-port", "8100", "--warm-trainers", "2"),
                           "other than --serve-port's")):
        with pytest.raises(ValueError, match=needle):
            trainer_from_arguments(args(*words), {}, Path("log"))
    with pytest.raises(ValueError, match="leave out --set train.server"):
        trainer_from_arguments(args("--run", "--warm-trainers", "1"), {"train.server": "http://x"}, Path("log"))


def test_warm_trainers_that_exit_are_reported_with_the_end_of_their_log(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ENV_ENGINEER_GPUS", "zero")  # refused by the server at its start
    trainer = WarmTrainer(1, tmp_path, tmp_path / "t.log", port=free_port(), start_s=120)
    with pytest.raises(WarmEngineError, match=r"--warm-trainers: the server exited \(2\) before it answered"):
        with Serving(trainer, poll_s=0.2) as ready:
            ready()
    err = capsys.readouterr().err
    assert "the warm trainers exited (2) before it answered" in err and "ENV_ENGINEER_GPUS='zero'" in err


def test_a_port_already_taken_is_refused(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        engine = WarmEngine("env-engineer", "embedded", Path("embedded"), tmp_path, tmp_path / "s.log",
                            port=s.getsockname()[1])
        with pytest.raises(WarmEngineError, match="already listens"):
            with Serving(engine):
                pass


def test_a_server_that_exits_is_reported_with_the_end_of_its_log(tmp_path, capsys):
    engine = WarmEngine("env-engineer", str(tmp_path / "no-such-model"), tmp_path / "no-such-model", tmp_path,
                        tmp_path / "s.log", port=free_port(), start_s=120)
    with pytest.raises(WarmEngineError, match=r"exited \(2\) before it answered"):
        with Serving(engine, poll_s=0.2) as ready:
            ready()
    err = capsys.readouterr().err  # reported as it happened, with the end of the log
    assert "the warm engine exited (2) before it answered" in err and "no-such-model" in err


def test_a_server_that_does_not_answer_in_time_is_stopped(tmp_path, tiny_model_dir, capsys):
    engine = WarmEngine("env-engineer", str(tiny_model_dir), tiny_model_dir, tmp_path, tmp_path / "s.log",
                        port=free_port(), start_s=0.5)
    serving = Serving(engine, poll_s=0.1)
    with pytest.raises(WarmEngineError, match="within 0 s"):
        with serving as ready:
            ready()
    assert serving.process.poll() is not None  # stopped when the study stopped
    assert "warm engine exited" not in capsys.readouterr().err  # stopped by the study: nothing to report


def test_a_served_study_waits_for_the_server_and_stops_it(tmp_path, tiny_model_dir, capsys):
    engine = WarmEngine("env-engineer", str(tiny_model_dir), tiny_model_dir, tmp_path, tmp_path / "s.log",
                        port=free_port(), start_s=300)
    serving = Serving(engine, poll_s=0.2)
    with serving as ready:
        assert ready() > 0
        import urllib.request

        with urllib.request.urlopen(engine.base_url + "/models", timeout=10) as r:
            assert str(tiny_model_dir) in r.read().decode()
    time.sleep(0.1)
    assert serving.process.poll() is not None
    assert warm_engine.port_free(engine.port)
    assert "warm engine exited" not in capsys.readouterr().err


def test_a_server_that_dies_during_the_study_is_reported(tmp_path, tiny_model_dir, capsys):
    import os
    import signal

    engine = WarmEngine("env-engineer", str(tiny_model_dir), tiny_model_dir, tmp_path, tmp_path / "s.log",
                        port=free_port(), start_s=300)
    with Serving(engine, poll_s=0.2) as ready:
        ready()
        os.killpg(ready.__self__.process.pid, signal.SIGKILL)
        ready.__self__.process.wait(timeout=30)
    assert "the warm engine exited (-9) during the study" in capsys.readouterr().err


def test_only_the_end_of_a_long_log_is_quoted(tmp_path):
    log = tmp_path / "s.log"
    log.write_text("x" * 100_000 + "the last line\n")
    assert warm_engine._tail(log, 50).endswith("the last line\n") and len(warm_engine._tail(log, 50)) == 50
    assert warm_engine._tail(tmp_path / "none.log") == "(no log)"
