"""``env-engineer workers``: one Prefect worker per GPU, each pinned by its environment."""

import os
from pathlib import Path

import pytest

from flows.workers import parse_gpus, worker_commands
from pipeline.workers import CPU_THREAD_VARIABLES, cpu_share


def test_one_worker_per_gpu_each_pinned_to_it(monkeypatch):
    monkeypatch.setenv("ENV_ENGINEER_GPUS", "0,1")
    commands = worker_commands("gpu-pool", ["0", "3"], 2, Path("/repo"))
    assert [env["CUDA_VISIBLE_DEVICES"] for env, _ in commands] == ["0", "3"]
    assert all(env["ENV_ENGINEER_REPO"] == "/repo" and "ENV_ENGINEER_GPUS" not in env for env, _ in commands)
    argv = commands[1][1]
    assert argv[1:3] == ["worker", "start"] and argv[argv.index("--pool") + 1] == "gpu-pool"
    assert argv[argv.index("--name") + 1] == "gpu-pool-gpu-3" and argv[argv.index("--limit") + 1] == "2"
    assert all(env[k] == v for env, _ in commands for k, v in cpu_share(4).items())  # four flow runs at once
    for name in CPU_THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    env = worker_commands("gpu-pool", ["0", "3"], 2, Path("/repo"))[0][0]
    assert env["OMP_NUM_THREADS"] == env["TORCHINDUCTOR_COMPILE_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) // 4))
    with pytest.raises(ValueError, match="--slots 0"):
        worker_commands("gpu-pool", ["0"], 0, Path("/repo"))


def test_bad_gpu_lists_are_explained(capsys):
    from env_engineer.cli import main

    assert parse_gpus("0, 1") == ["0", "1"]
    for bad in ("", "a", "0,0"):
        with pytest.raises(ValueError, match="--gpus"):
            parse_gpus(bad)
    assert main(["workers", "--gpus", "x"]) == 2
    assert "--gpus 'x'" in capsys.readouterr().err


def test_workers_that_ignore_sigterm_are_killed_after_the_grace_period(monkeypatch, capsys):
    """A Prefect worker can take minutes to shut down after SIGTERM: past the grace period it is killed, its whole
    session with it (the `prefect` command and the process worker it starts)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import flows.workers as workers

    monkeypatch.setattr(workers, "STOP_GRACE_SECONDS", 1.0)
    polite = "import time; time.sleep(60)"
    stubborn = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "c = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
                "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)']); print(c.pid, flush=True); "
                "time.sleep(60)")
    procs = [subprocess.Popen([sys.executable, "-c", polite], start_new_session=True),
             subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True, stdout=subprocess.PIPE, text=True)]
    child = int(procs[1].stdout.readline())  # the stubborn one's own child, as `prefect worker start` has one

    def signal_all(sig):
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, sig)

    start = time.monotonic()
    assert workers.stop_workers(procs, signal_all) == 0
    assert time.monotonic() - start < 10 and [p.returncode for p in procs] == [-signal.SIGTERM, -signal.SIGKILL]
    assert "killed" in capsys.readouterr().err
    time.sleep(0.5)  # the child went with its session: gone, or a zombie waiting to be reaped

    def state(pid):
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return "gone"

    assert state(child) in ("gone", "Z", "X"), state(child)


def test_sigterm_to_the_workers_command_stops_stubborn_workers_within_the_grace_period(tmp_path):
    """The whole path: `env-engineer workers` gets SIGTERM while its workers (stand-ins that ignore SIGTERM, as a
    Prefect worker busy shutting down does) keep running: it stops waiting, kills them after the grace period and
    exits 0."""
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers import ROOT

    script = tmp_path / "workers.py"
    script.write_text(f"""
import argparse, os, sys
sys.path.insert(0, {str(ROOT)!r})
import flows.workers as w
w.STOP_GRACE_SECONDS = 1.0
stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
w.worker_commands = lambda pool, gpus, slots, repo: [
    ({{**os.environ, "CUDA_VISIBLE_DEVICES": g}}, [sys.executable, "-c", stubborn, "--name", f"{{pool}}-gpu-{{g}}"])
    for g in gpus]
args = argparse.Namespace(pool="gpu-pool", gpus="0,1", slots=1, repo=w.ROOT)
sys.exit(w.run(args))
""")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = [proc.stdout.readline() for _ in range(4)]  # two "worker ..." lines and each stand-in's "up"
    assert sum(line.startswith("worker gpu-pool-gpu-") for line in lines) == 2, lines
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert time.monotonic() - start < 15 and "killed" in proc.stderr.read()


def test_a_comparison_runs_as_flow_runs_on_two_pinned_workers(tmp_path):
    """Against a real Prefect server: the curriculum deployment, `env-engineer workers --gpus 0,1` (two process
    workers), and `env-engineer compare --via prefect` on a stand-in pipeline: each wave's experiments are taken by
    both workers at once, run as `dvc exp run --temp`, and read back from `dvc exp show`."""
    import json
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    from tests.experiments.test_compare import standin_repo
    from tests.helpers import ROOT

    repo = standin_repo(tmp_path / "repo", sleep_s=6)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "ENV_ENGINEER_REPO": str(ROOT),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "DVC_NO_ANALYTICS": "1"}
    logs = tmp_path / "logs"
    logs.mkdir()
    server = subprocess.Popen([str(bin_dir / "prefect"), "server", "start", "--port", str(port)], env=env,
                              stdout=open(logs / "server.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    workers = None
    try:
        def run(*argv: str, cwd: Path = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
            proc = subprocess.run(list(argv), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            return proc

        run(str(bin_dir / "env-engineer"), "prefect-ready", "--url", env["PREFECT_API_URL"], "--timeout", "180")
        run(str(bin_dir / "prefect"), "work-pool", "create", "gpu-pool", "--type", "process")
        run(str(bin_dir / "prefect"), "--no-prompt", "deploy", "--name", "curriculum")
        workers = subprocess.Popen([str(bin_dir / "env-engineer"), "workers", "--gpus", "0,1"], env=env,
                                   stdout=open(logs / "workers.log", "w"), stderr=subprocess.STDOUT)
        proc = run(str(bin_dir / "env-engineer"), "compare", "--repo", str(repo), "--engineers", "fixed,heuristic",
                   "--seeds", "1,2", "--run", "--via", "prefect", "--out-json", str(tmp_path / "c.json"),
                   "--out-md", str(tmp_path / "c.md"), timeout=600)
        out, why = proc.stdout, proc.stdout + proc.stderr + (logs / "workers.log").read_text()[-6000:]
        assert "submitted cmp-fixed-s1 to curriculum/curriculum" in out and "flow runs: 4 completed" in out, why
        # first each seed's shared stages alone (a flow run with DVC targets), then the four experiments at once
        first_wave = out[out.index("submitted shared-cmp-fixed-s1"):out.index("submitted cmp-fixed-s1")]
        assert "flow runs: 2 completed\n" in first_wave, why
        table = json.loads((tmp_path / "c.json").read_text())["arms"]
        assert table["fixed"]["seeds"] == [1, 2] and table["heuristic"]["seeds"] == [1, 2]
        assert abs(table["heuristic"]["metrics"]["acc/3_agents"]["mean"] - 0.65) < 1e-9
        log = (logs / "workers.log").read_text()
        assert "Worker 'gpu-pool-gpu-0' submitting flow run" in log and "Worker 'gpu-pool-gpu-1' submitting flow run" in log
        assert "worker gpu-pool-gpu-1 (CUDA_VISIBLE_DEVICES=1" in log
    finally:
        try:
            if workers is not None:
                workers.send_signal(signal.SIGTERM)
                assert workers.wait(timeout=60) == 0  # it kills workers slow to shut down after 20 s
        finally:
            if workers is not None and workers.poll() is None:
                workers.kill()
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
