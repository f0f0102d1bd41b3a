import shutil
import subprocess

import pytest

from experiments.dvc import DvcError, curriculum_items, dvc, dvc_env, pipeline_stages, stage_named
from experiments.plan import shared_stages, unrestorable

from tests.helpers import ROOT


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A copy of the project's own dvc.yaml and params.yaml in a fresh DVC repository."""
    path = tmp_path_factory.mktemp("project")
    shutil.copy(ROOT / "dvc.yaml", path / "dvc.yaml")
    shutil.copy(ROOT / "params.yaml", path / "params.yaml")
    subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=path, check=True, env=dvc_env())
    return path


def stand_in_dvc(tmp_path, monkeypatch, script: str):
    """A ``dvc`` of ``script`` first on the PATH that :func:`experiments.dvc.dvc` runs with; returns its file."""
    import os

    import experiments.dvc as dvc_module

    fake = tmp_path / "bin" / "dvc"
    fake.parent.mkdir()
    fake.write_text(script)
    fake.chmod(0o755)
    env = dvc_module.dvc_env()
    monkeypatch.setattr(dvc_module, "dvc_env", lambda: {**env, "PATH": f"{fake.parent}{os.pathsep}{env['PATH']}"})
    return fake


def test_stages_come_from_dvc_yaml_in_an_order_that_runs_each_after_its_inputs(project):
    stages = pipeline_stages(project)
    names = [s.name for s in stages]
    assert names[:5] == ["start-instances", "starting-policy", "validation-set", "benchmark", "init-curriculum"]
    per_stage = ["generate-instances", "train", "evaluate", "validate", "summarize-failures", "engineer-config"]
    assert names[5:] == [f"{step}@{k}" for k in (0, 1) for step in per_stage]
    position = {name: i for i, name in enumerate(names)}
    for s in stages:  # every file a stage reads is written by a stage before it, if by any
        for dep in (*s.deps, *s.params_files):
            writer = next((w for w in stages if dep in (*w.outs, *w.metrics, *w.plots)), None)
            assert writer is None or position[writer.name] < position[s.name], (s.name, dep)
    assert curriculum_items(stages) == ["0", "1"]
    train = stage_named(stages, "train", "1")
    assert train.step == "train" and train.item == "1" and train.out("train_metrics.json") in train.metrics
    assert stage_named(stages, "train", "7") is None and stage_named(stages, "benchmark", None).item is None


def test_every_stage_the_experiments_share_can_be_restored_from_dvcs_run_cache(project):
    """A stage with an output of ``cache: false`` that is not a metric or plot gets no run-cache entry, so every
    experiment of a comparison would run it again (stage 0's benchmark did, before its tables were cached)."""
    stages = pipeline_stages(project)
    assert unrestorable(stages) == []
    assert shared_stages(stages) == [f"{step}@0" for step in ("generate-instances", "train", "evaluate", "validate",
                                                                "summarize-failures")]
    assert stage_named(stages, "engineer-config", "0").uncached  # its configuration stays in git: not shared anyway
    assert stage_named(stages, "evaluate", "0").uncached == ()


def test_dvc_errors_hold_the_output(project):
    with pytest.raises(DvcError, match="no-such-stage"):
        dvc(["repro", "--dry", "no-such-stage"], project)


def test_exp_show_is_read_again_when_a_running_experiment_finishes_while_it_is_read(monkeypatch):
    """`dvc exp show` opens each running `--temp` experiment's working copy; one that finished meanwhile makes it fail
    with ENOENT on that copy (seen with two Prefect workers). That read is retried; any other failure is not."""
    import experiments.dvc as module

    vanished = DvcError("dvc exp show --json failed (exit 255):\nERROR: unexpected error - [Errno 2] No such file or "
                        "directory: '/r/repo/.dvc/tmp/exps/standalone/tmp522n38l0'")
    calls = []

    def fake(outcomes):
        def run(args, repo, timeout=None):
            calls.append(args)
            outcome = outcomes[min(len(calls), len(outcomes)) - 1]
            if isinstance(outcome, Exception):
                raise outcome
            return outcome
        return run

    monkeypatch.setattr(module, "dvc", fake([vanished, module.DvcBusy("Unable to acquire lock"), '[{"rev": "workspace"}]']))
    assert module.experiments_shown("/r/repo", wait_s=0) == [{"rev": "workspace"}]
    assert calls == [["exp", "show", "--json"]] * 3

    calls.clear()
    monkeypatch.setattr(module, "dvc", fake([vanished]))
    with pytest.raises(DvcError, match="tmp522n38l0"):
        module.experiments_shown("/r/repo", attempts=4, wait_s=0)
    assert len(calls) == 4

    calls.clear()
    other = DvcError("dvc exp show --json failed (exit 255):\nERROR: [Errno 2] No such file or directory: 'params.yaml'")
    monkeypatch.setattr(module, "dvc", fake([other, '[]']))
    with pytest.raises(DvcError, match="params.yaml"):
        module.experiments_shown("/r/repo", wait_s=0)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="attempts=0"):
        module.experiments_shown("/r/repo", attempts=0)


def test_a_command_that_leaves_processes_returns_when_it_ends(tmp_path, monkeypatch):
    """``dvc queue start`` leaves a daemon per worker holding its standard output; with ``leaves_processes`` the call
    returns when the command ends and keeps its output (read from a pipe, it waited for the daemon: with two workers
    one may never end, and `compare --run` hung)."""
    import time

    fake = stand_in_dvc(tmp_path, monkeypatch, "#!/bin/sh\nsleep 30 &\necho started $1\n")  # a child keeps the output
    start = time.monotonic()
    assert dvc(["queue"], tmp_path, leaves_processes=True).strip() == "started queue"
    assert time.monotonic() - start < 10
    fake.write_text("#!/bin/sh\necho $OMP_NUM_THREADS\n")
    assert dvc(["queue"], tmp_path, leaves_processes=True, env={"OMP_NUM_THREADS": "3"}).strip() == "3"
    fake.write_text("#!/bin/sh\nsleep 30 &\necho started $1\n")
    with pytest.raises(subprocess.TimeoutExpired):  # what the pipe did: wait for the child
        dvc(["queue"], tmp_path, timeout=3)


@pytest.mark.parametrize("leaves_processes", [False, True])
def test_dvc_runs_niceness_below_its_caller_and_its_children_inherit_it(tmp_path, monkeypatch, leaves_processes):
    """The queue's workers run below the study's shared servers (``experiments.runner.QUEUE_NICENESS``): ``dvc queue
    start`` is started niced, and the workers it leaves behind inherit it. A stand-in ``dvc`` prints the niceness of a
    process it starts."""
    import os

    import experiments.dvc as module

    stand_in_dvc(tmp_path, monkeypatch, "#!/bin/sh\nsh -c nice\n")
    mine = os.nice(0)
    assert int(dvc(["queue", "start"], tmp_path, leaves_processes=leaves_processes)) == mine
    assert int(dvc(["queue", "start"], tmp_path, leaves_processes=leaves_processes, niceness=10)) == min(mine + 10, 19)
    monkeypatch.setattr(module.shutil, "which", lambda name: None)  # no `nice` command: the caller's priority
    assert int(dvc(["queue", "start"], tmp_path, leaves_processes=leaves_processes, niceness=10)) == mine


def test_params_are_read_under_dvcs_lock_so_no_experiment_rewrites_them_meanwhile(tmp_path):
    """``dvc exp run`` writes its ``-S`` values into the workspace's params.yaml while it stashes an experiment; a
    Prefect worker reading the file beside it once saw half of it. Under :func:`repository_locked` no experiment can start
    rewriting it (DVC waits, then reports the lock), and a lock held by another process is reported as busy."""
    import sys
    import textwrap

    from experiments.dvc import DvcBusy, repository_locked
    from tests.experiments.test_compare import standin_repo

    repo = standin_repo(tmp_path / "repo")
    before = (repo / "params.yaml").read_text()
    with repository_locked(repo):
        with pytest.raises(DvcBusy, match="Unable to acquire lock"):
            dvc(["exp", "run", "--temp", "-S", "train.seed=5"], repo)
        assert (repo / "params.yaml").read_text() == before
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from dvc.repo import Repo
        r = Repo(sys.argv[1]); r.lock.lock(); print("held", flush=True); time.sleep(60)"""), str(repo)],
        stdout=subprocess.PIPE, text=True, env=dvc_env())
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DvcBusy, match="DVC's repository lock"):
            with repository_locked(repo):
                pass
    finally:
        holder.kill()
        holder.wait()
    with repository_locked(repo):  # released by the holder's end: taken again at once
        assert (repo / "params.yaml").read_text() == before
