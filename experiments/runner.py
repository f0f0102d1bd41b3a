"""Running a study's experiments (:func:`run_plan`: the comparison's and the sensitivity study's): through DVC's queue
(:func:`run_wave_in_queue`), or as runs of a Prefect deployment (:func:`run_flow_runs`), each waited for until final,
with progress printed.

DVC's queue: a wave is queued only once the workers of the one before have left, and its workers start after its last
experiment is queued (a DVC worker leaves when it finds the queue empty, and one that takes a task on its way out drops
it: DVC then lists it as running for ever); they are told to leave once the wave is done (``dvc queue stop``). Should
the queue lose an experiment all the same, it is marked failed and queued again once. An experiment that failed
because its GPU ran out of memory (too many experiments training on one card at once) is queued again once after its
wave, with half the workers: the stages it finished are restored from DVC's run-cache, so it goes on from the one that
failed. Workers and experiment processes are counted from dvc-task's own records, which a busy worker cannot fail to
answer. A first wave that only runs the shared stages (each group's stage 0), no larger than the workers, runs as
``dvc exp run --temp`` processes while the next wave is queued (:func:`run_wave_beside_queueing`), so that queueing
does not wait for it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments.dvc import DvcError, StageFiles, dvc, dvc_command, dvc_env, experiments_shown, retrying, set_words
from experiments.plan import Experiment, seed_free_stages, shared_stages, unrestorable, waves
from pipeline.workers import cpu_share


def queue_args(item: Experiment, extra: dict[str, Any], how: str = "--queue") -> list[str]:
    """``dvc exp run --queue`` arguments of one planned experiment (:func:`experiments.dvc.set_words`); ``how``:
    ``--temp`` to run it at once instead."""
    return ["exp", "run", how, "-n", item.name, *set_words({**item.sets, **extra}), *item.targets]


QUEUE_ATTEMPTS = 10
"""How many times :func:`queue_experiment` tries ``dvc exp run --queue`` when DVC's lock or a git file it writes is held
(another experiment starting or being saved beside it), a second apart."""


def queue_experiment(repo: Path, item: Experiment, extra: dict[str, Any], attempts: int = QUEUE_ATTEMPTS,
                     wait_s: float = 1.0) -> None:
    """Queue one planned experiment in DVC's queue, trying again while the repository is busy
    (:func:`experiments.dvc.retrying`)."""
    retrying(lambda: dvc(queue_args(item, extra), repo), attempts, wait_s)
    print(f"queued {item.name}", flush=True)


QUEUE_STALL_SECONDS = 60.0
"""How long :func:`run_queue` waits with experiments unfinished and no DVC worker or experiment process left before
it gives up (dvc-task's process records say which are left; a worker takes a second or two to write its own)."""


QUEUE_NICENESS = 10
"""How far below the runner's CPU priority DVC's queue workers, and so every experiment's steps, run. The servers a
study shares (warm trainers, a vLLM server: :mod:`experiments.warm_engine`) keep the runner's priority: every experiment
waits on them, and with many experiments at once their steps' processes outnumber the cores."""


WORKERS_LEAVE_SECONDS = 120.0
"""How long :func:`wait_for_workers_to_leave` waits for the workers of an earlier wave to leave. A worker leaves by
itself about 10 s after it last saw the queue empty (dvc-task's ``TemporaryWorker`` checks every 10 s)."""


QUEUE_FINAL = ("Success", "Failed")
"""The states of a DVC queue task that will not change any more."""


OUT_OF_MEMORY = ("CUDA out of memory", "torch.OutOfMemoryError")
"""What an experiment's log (``dvc queue logs NAME``) says when it failed for want of GPU memory: worth a second try
with fewer experiments at once, unlike a failure of its own."""


class QueueStalled(RuntimeError):
    """DVC's queue has no worker left while experiments of a wave are unfinished: they would never end.
    ``unfinished``: their names and states."""

    def __init__(self, message: str, unfinished: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.unfinished = unfinished or {}


def live_processes(records: list[Path]) -> list[int]:
    """The pids of dvc-task process records (``ProcessInfo`` JSON files) whose process still runs: a record gets its
    return code when its process ends; one without, whose process is gone or a zombie, was killed; a half-written one
    is skipped."""
    import psutil
    from dvc_task.proc.process import ProcessInfo

    pids = []
    for record in records:
        try:
            info = ProcessInfo.load(str(record))
        except (OSError, ValueError, TypeError, KeyError):  # gone, or being written
            continue
        if info.returncode is not None:
            continue
        try:
            if psutil.Process(info.pid).status() != psutil.STATUS_ZOMBIE:
                pids.append(info.pid)
        except psutil.Error:
            continue
    return pids


def _exps_dir(repo: Path) -> Path:
    from dvc.repo.experiments.utils import EXEC_TMP_DIR

    return Path(repo) / ".dvc" / "tmp" / EXEC_TMP_DIR


def queue_workers(repo: Path) -> list[int]:
    """The pids of DVC's queue workers still running in ``repo`` (``dvc queue start`` spawns each through dvc-task,
    which records it as ``celery/dvc-exp-worker-N.json``). Unlike ``dvc queue status``'s worker count, which pings
    each worker for a second, this does not miss a worker that is busy on a loaded machine."""
    return live_processes(sorted((_exps_dir(repo) / "celery").glob("dvc-exp-worker-*.json")))


def experiment_process_alive(repo: Path) -> bool:
    """Whether a process that DVC's queue started for an experiment is still running (dvc-task records each one, its
    pid and, once it has ended, its return code, under ``.dvc/tmp/exps/run/<rev>/<rev>.json``)."""
    from dvc.repo.experiments.utils import EXEC_PID_DIR

    return bool(live_processes(sorted((_exps_dir(repo) / EXEC_PID_DIR).glob("*/*.json"))))


def wait_for_workers_to_leave(repo: Path, timeout: float = WORKERS_LEAVE_SECONDS, poll_seconds: float = 1.0) -> None:
    """Return once no DVC queue worker runs in ``repo``; raise :class:`QueueStalled` after ``timeout`` seconds.

    Queue a wave only then: a worker leaves when it finds the queue empty, and a task queued between that check and
    its exit is taken and dropped (the worker shuts down with the task received and never runs it; DVC lists it as
    Running for ever: DVC issues 10427 and 10562). So the experiments of a wave are queued while no worker runs, and
    the wave's workers are started after the last one is queued."""
    began = time.monotonic()
    told = False
    while pids := queue_workers(repo):
        waited = time.monotonic() - began
        if waited > timeout:
            raise QueueStalled(f"DVC's queue worker(s) {', '.join(map(str, pids))} still run {waited:.0f} s after "
                               "the last wave: an experiment queued now could be taken by a worker on its way out and "
                               "lost; wait until `dvc queue status` lists no worker (or end them: kill "
                               f"{' '.join(map(str, pids))}), then run compare again with --run")
        if not told:
            print(f"{time.strftime('%H:%M:%S')} queue: waiting for the {len(pids)} worker(s) of the last wave to leave",
                  flush=True)
            told = True
        time.sleep(poll_seconds)


def run_queue(repo: Path, jobs: int, names: list[str], poll_seconds: float = 5.0,
              stall_seconds: float = QUEUE_STALL_SECONDS) -> dict[str, str]:
    """``dvc queue start -j jobs``, each experiment's processes given a ``1/jobs`` share of the CPU threads
    (:func:`pipeline.workers.cpu_share`) and a lower priority than the study's shared servers (:data:`QUEUE_NICENESS`),
    then wait until each experiment of ``names`` has finished, printing progress;
    returns each one's final status (Success or Failed: ``dvc queue logs NAME`` says why). Workers stop by themselves
    once the queue is empty; when for ``stall_seconds`` none is left (:func:`queue_workers`, or one answering
    ``dvc queue status``) and no experiment's process runs (:func:`experiment_process_alive`) while some of ``names``
    are unfinished, raises :class:`QueueStalled` naming them, why and how to go on, instead of waiting forever."""
    share = cpu_share(jobs)  # each experiment's processes get their part of the cores, not all of them each
    if share:
        print(f"{jobs} experiment(s) at once: each one's processes run with "
              + ", ".join(f"{k}={v}" for k, v in share.items()) + " (set them to choose)", flush=True)
    dvc(["queue", "start", "-j", str(jobs)], repo, leaves_processes=True, env=share, niceness=QUEUE_NICENESS)
    seen = time.monotonic()

    def read() -> dict[str, str]:
        nonlocal seen
        states, workers = queue_status(repo)
        mine = {name: states.get(name, "Queued") for name in names}
        now = time.monotonic()
        if (workers or all(state in QUEUE_FINAL for state in mine.values()) or queue_workers(repo)
                or experiment_process_alive(repo)):
            seen = now
        elif now - seen > stall_seconds:
            unfinished = {name: state for name, state in mine.items() if state not in QUEUE_FINAL}
            open_ = ", ".join(f"{name} ({state.lower()})" for name, state in unfinished.items())
            raise QueueStalled(f"DVC's queue has had no worker and no experiment process for {now - seen:.0f} s while "
                               f"{open_} did not finish (one marked running was taken by a worker that then left "
                               "without running it, or its worker was killed; `dvc queue logs NAME` shows where one "
                               "stopped): `dvc queue kill NAME` marks such a one failed, then run compare again with "
                               "--run, which keeps the finished experiments and queues the others again", unfinished)
        return mine

    mine = wait_until_final(read, QUEUE_FINAL, "queue", poll_seconds)
    # Idle workers would wait for more work before leaving (74 s of a wave on one H200); the next wave is queued only
    # once they have gone (wait_for_workers_to_leave), so tell them to go now.
    dvc(["queue", "stop"], repo)
    # A task reports success a moment before its experiment is saved: wait until every successful one is listed.
    succeeded = {name for name, state in mine.items() if state == "Success"}
    started = time.monotonic()
    deadline = started + 300
    while not succeeded <= set(dvc(["exp", "list", "--name-only"], repo).split()) and time.monotonic() < deadline:
        time.sleep(1.0)
    waited = time.monotonic() - started
    if waited > 5:
        print(f"{time.strftime('%H:%M:%S')} queue: DVC listed the saved experiments {waited:.0f} s after their tasks "
              "ended", flush=True)
    return mine


def out_of_memory(repo: Path, names: list[str]) -> list[str]:
    """Those of ``names`` whose log says their GPU ran out of memory (:data:`OUT_OF_MEMORY`)."""
    found = []
    for name in names:
        try:
            log = dvc(["queue", "logs", name], repo)
        except DvcError:
            continue
        if any(marker in log for marker in OUT_OF_MEMORY):
            found.append(name)
    return found


def run_wave_in_queue(repo: Path, jobs: int, wave: list[Experiment], extra: dict[str, Any],
                      retries: int = 1, stall_seconds: float = QUEUE_STALL_SECONDS,
                      queued: bool = False) -> dict[str, str]:
    """One wave through DVC's queue: queued while no worker runs (:func:`wait_for_workers_to_leave`; ``queued``: it
    was, by :func:`run_wave_beside_queueing`), then run with ``jobs`` workers, at most one per experiment
    (:func:`run_queue`). When the queue stalls, the experiments it lost (marked running with no process left) are
    marked failed (``dvc queue kill``) and queued again, and workers started again for those still queued, at most
    ``retries`` times. Those that failed because the GPU ran out of memory (:func:`out_of_memory`) are queued again
    once, with half the workers, resuming from the run-cache; returns each experiment's final status."""
    items = {item.name: item for item in wave}
    todo = [] if queued else list(wave)
    jobs = max(1, min(jobs, len(wave)))  # a worker more than the experiments only slows the wave's end
    attempts = 0
    memory_retried = False
    while True:
        if todo:
            wait_for_workers_to_leave(repo)
        for item in todo:
            queue_experiment(repo, item, extra)
        try:
            states = run_queue(repo, jobs, list(items), stall_seconds=stall_seconds)
        except QueueStalled as stalled:
            attempts += 1
            if attempts > retries:
                raise
            lost = [name for name, state in stalled.unfinished.items() if state == "Running"]
            if lost:
                dvc(["queue", "kill", *lost], repo)
            todo = [items[name] for name in lost]
            print(f"{time.strftime('%H:%M:%S')} queue: no worker left with {', '.join(stalled.unfinished)} "
                  f"unfinished; {'queued again: ' + ', '.join(lost) if lost else 'workers started again'}",
                  file=sys.stderr, flush=True)
            continue
        short = [] if memory_retried else out_of_memory(repo, [n for n, state in states.items() if state == "Failed"])
        if not short:
            return states
        memory_retried, jobs = True, max(1, min(jobs // 2, len(short)))
        todo = [items[name] for name in short]
        print(f"{time.strftime('%H:%M:%S')} queue: the GPU ran out of memory in {', '.join(short)}; queued again with "
              f"{jobs} worker(s), from the stages they finished (fewer experiments at once: ENV_ENGINEER_GPU_SLOTS, "
              "--jobs)", file=sys.stderr, flush=True)


def run_wave_beside_queueing(repo: Path, wave: list[Experiment], extra: dict[str, Any],
                             following: list[Experiment], poll_seconds: float = 5.0) -> dict[str, str]:
    """Run ``wave`` (each group's shared stages: a few short experiments) as ``dvc exp run --temp`` processes, all at
    once and :data:`QUEUE_NICENESS` below this process, each with its share of the cores, and meanwhile queue
    ``following`` (the next wave) in DVC's queue, whose workers :func:`run_wave_in_queue` starts only after this wave
    (``queued=True``): queueing two dozen experiments, one to four seconds each, no longer waits for the wave. A run
    waits for DVC's lock while a queueing holds it (``dvc --wait-for-lock``). Prints a count per state when it changes;
    returns each run's final status (Success or Failed, its output's tail printed to stderr). Should this end early
    (an interrupt, a queueing that failed), the runs are stopped (SIGTERM to each one's process group)."""
    wait_for_workers_to_leave(repo)  # a worker left from an earlier study would take the experiments queued here
    share = cpu_share(len(wave))
    runs: dict[str, tuple[subprocess.Popen, Any]] = {}
    with contextlib.ExitStack() as logs:
        try:
            for item in wave:
                log = logs.enter_context(tempfile.TemporaryFile(mode="w+"))
                command = dvc_command(["--wait-for-lock", *queue_args(item, extra, how="--temp")], QUEUE_NICENESS)
                runs[item.name] = (subprocess.Popen(command, cwd=repo, env={**dvc_env(), **share}, stdout=log,
                                                    stderr=subprocess.STDOUT, text=True, start_new_session=True), log)
                print(f"{time.strftime('%H:%M:%S')} running {item.name} (dvc exp run --temp)", flush=True)
            for item in following:
                queue_experiment(repo, item, extra)

            def read() -> dict[str, str]:
                return {name: "Running" if proc.poll() is None else "Success" if proc.returncode == 0 else "Failed"
                        for name, (proc, _) in runs.items()}

            states = wait_until_final(read, QUEUE_FINAL, "runs", poll_seconds)
        finally:
            for proc, _ in runs.values():
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait()
        for name, (proc, log) in runs.items():
            if states[name] == "Failed":
                log.seek(0)
                tail = "\n".join(log.read().strip().splitlines()[-25:])
                print(f"{name}: dvc exp run --temp failed (exit {proc.returncode}):\n{tail}", file=sys.stderr,
                      flush=True)
    return states


def add_commit_argument(parser: Any) -> None:
    """``--no-commit`` (``commit``: whether :func:`run_plan` commits what the shared stages changed), for the commands
    that run a plan."""
    parser.add_argument("--no-commit", dest="commit", action="store_false",
                        help="with --run: leave what the shared stages (the start, the validation set, the benchmark) "
                        "change in the workspace uncommitted; by default it is committed before anything is queued, so "
                        "that the experiments start from it instead of each carrying a copy")


def commit_shared(repo: Path, stages: list[StageFiles]) -> list[str]:
    """Commit what ``stages`` (the stages every experiment shares, run in the workspace) changed of the files git
    keeps: their outputs that are in git (the starting policy's), ``dvc.lock``, and ``params.yaml`` that made them, so
    that the study's experiments start from a commit that holds them. Otherwise every ``dvc exp run --queue`` stashes
    them again (a starting adapter of tens of MB each time: docs/lab-notes/benchmarks.md, "Queueing an experiment").
    Returns the paths committed (none when nothing changed); a repository where git cannot commit (no user name
    set, say) is left as it is, with a warning."""
    paths = sorted({p for s in stages for p in (*s.outs, *s.metrics, *s.plots)} | {"dvc.lock", "params.yaml"})
    status = subprocess.run(["git", "status", "--porcelain=v1", "-z", "--untracked-files=all", "--", *paths], cwd=repo,
                            capture_output=True, text=True)
    if status.returncode != 0:
        print(f"warning: git status failed, the shared stages' files are left uncommitted: {status.stderr.strip()}",
              file=sys.stderr, flush=True)
        return []
    changed = sorted(entry[3:] for entry in status.stdout.split("\0") if len(entry) > 3)
    if not changed:
        return []
    message = ("the stages every experiment of the study shares: " + ", ".join(s.name for s in stages) +
               " (committed by env-engineer before it queued the experiments)")
    for cmd in (["git", "add", "--", *changed], ["git", "commit", "-q", "-m", message, "--", *changed]):
        done = subprocess.run(cmd, cwd=repo, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"warning: `{' '.join(cmd[:2])}` failed, so every queued experiment carries the shared stages' files "
                  f"itself (slower to queue): {(done.stderr or done.stdout).strip()[-300:]}", file=sys.stderr,
                  flush=True)
            return []
    print(f"{time.strftime('%H:%M:%S')} committed what they changed ({len(changed)} file(s)), so that the experiments "
          "start from it", flush=True)
    return changed


def run_plan(repo: Path, plan: list[Experiment], extra: dict[str, Any], stages: list[StageFiles], jobs: int = 1,
             via: str = "dvc-queue", deployment: str = "curriculum/curriculum", commit: bool = True,
             ready: Callable[[], float] | None = None) -> dict[str, Any]:
    """Run a study's unfinished experiments: the stages no experiment changes once in the workspace
    (:func:`experiments.plan.seed_free_stages`) and, with ``commit``, what they changed committed
    (:func:`commit_shared`), then the plan wave by wave (:func:`experiments.plan.waves`) through DVC's queue with
    ``jobs`` workers (a first wave of shared stages only, no larger than ``jobs``, as ``dvc exp run --temp`` while the
    next is queued: :func:`run_wave_beside_queueing`) or as runs of a Prefect ``deployment`` (``via="prefect"``); an
    experiment with a last-stage result is kept, not run again. ``ready`` (the warm servers',
    :mod:`experiments.warm_engine`) is waited for after the workspace's stages, before the first wave. Returns what
    ran on what: wall seconds, the GPUs (kind, count), how busy they were, and when warm servers were waited for,
    how long after its start the last one answered."""
    from experiments.machine import BusySampler, bytecode_warning, describe_gpus
    from experiments.records import experiment_records, last_stage_result

    began = time.monotonic()
    if (line := bytecode_warning()) is not None:
        print(f"warning: {line}", file=sys.stderr, flush=True)
    with BusySampler() as busy:
        done = {rec["name"] for rec in experiment_records(experiments_shown(repo))
                if last_stage_result(rec, stages) is not None}
        common = seed_free_stages(stages, sorted({k for item in plan for k in item.sets} | set(extra)))
        if common and len(done & {item.name for item in plan}) < len(plan):
            print(f"{time.strftime('%H:%M:%S')} in the workspace, the stages every experiment shares: "
                  f"{', '.join(common)}", flush=True)
            dvc(["repro", *common], repo)
            if commit:
                commit_shared(repo, [s for s in stages if s.name in common])
        for line in unrestorable(stages):
            print(f"warning: {line}", file=sys.stderr, flush=True)
        engine_up_s = ready() if ready is not None else None
        planned = waves(plan, done, shared_stages(stages))
        queued = False  # whether this wave was queued while the one before ran
        for number, wave in enumerate(planned, 1):
            wave_began = time.monotonic()
            print(f"{time.strftime('%H:%M:%S')} wave {number}: {len(wave)} experiment(s)", flush=True)
            if via == "prefect":
                states = run_flow_runs(deployment, wave, extra, repo=repo)
            elif number < len(planned) and len(wave) <= jobs and all(item.targets for item in wave):
                states = run_wave_beside_queueing(repo, wave, extra, planned[number])
                queued = True
            else:
                states, queued = run_wave_in_queue(repo, jobs, wave, extra, queued=queued), False
            failed = [name for name, state in states.items() if state == "Failed"]
            if failed:
                where = "the flow runs' logs in Prefect show why" if via == "prefect" else "`dvc queue logs NAME` shows why"
                print(f"failed: {', '.join(failed)} ({where})", file=sys.stderr, flush=True)
            print(f"{time.strftime('%H:%M:%S')} wave {number} done in {time.monotonic() - wave_began:.0f} s", flush=True)
            scaffolding = [item.name for item in wave if item.targets]
            if scaffolding:  # their stages are in the run-cache now; the experiments themselves are no result
                try:
                    dvc(["exp", "remove", *scaffolding], repo)
                except DvcError as e:
                    print(f"warning: could not remove {', '.join(scaffolding)}: {e}", file=sys.stderr, flush=True)
    return {"wall_s": round(time.monotonic() - began, 1), "gpus": describe_gpus(), "gpu_busy": busy.summary(),
            **({"warm_engine_up_s": round(engine_up_s, 1)} if engine_up_s is not None else {})}


def submit_flow_run(deployment: str, item: Experiment, extra: dict[str, Any], repo: Path | None = None) -> str:
    """Schedule one planned experiment as a run of the Prefect ``deployment`` (the ``curriculum`` flow with
    ``overrides`` and ``name``: it becomes ``dvc exp run --temp -n NAME -S ...`` on whichever worker takes it); returns
    the flow run's id."""
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    try:
        parameters = {"overrides": {**item.sets, **extra}, "name": item.name}
        if item.targets:
            parameters["targets"] = list(item.targets)
        if repo is not None:
            parameters["repo"] = str(repo.resolve())
        flow_run = run_deployment(deployment, parameters=parameters,
                                  flow_run_name=item.name, timeout=0, as_subflow=False)
    except ObjectNotFound:
        raise ValueError(f"--deployment {deployment}: no such deployment on the Prefect server at PREFECT_API_URL; "
                         "create it with `prefect deploy --all` (prefect.yaml) or name another") from None
    return str(flow_run.id)


def flow_run_states(ids: dict[str, str]) -> dict[str, str]:
    """Name -> Prefect state type (SCHEDULED, PENDING, RUNNING, COMPLETED, FAILED, CRASHED, CANCELLED, ...)."""
    return {name: state_type for name, (state_type, _) in _read_flow_runs(ids).items()}


def flow_run_messages(ids: dict[str, str]) -> dict[str, str]:
    """Name -> the message of the flow run's current state (why it failed or crashed)."""
    return {name: message for name, (_, message) in _read_flow_runs(ids).items()}


def _read_flow_runs(ids: dict[str, str]) -> dict[str, tuple[str, str]]:
    import asyncio
    from uuid import UUID

    from prefect.client.orchestration import get_client

    async def read() -> dict[str, tuple[str, str]]:
        async with get_client() as client:
            out = {}
            for name, i in ids.items():
                state = (await client.read_flow_run(UUID(i))).state
                out[name] = (state.type.value, state.message or "")
            return out

    return asyncio.run(read())


FINAL_FLOW_STATES = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
RESUBMITTED_STATES = ("CRASHED",)
"""Final states of a flow run whose experiment never failed by itself (the worker's process died or could not start):
such a run is submitted once more."""


def run_flow_runs(deployment: str, wave: list[Experiment], extra: dict[str, Any], poll_seconds: float = 5.0,
                  submit: Any = None, states: Any = None, repo: Path | None = None, messages: Any = None,
                  resubmit: int = 1) -> dict[str, str]:
    """Submit one wave as flow runs of ``deployment`` and wait until each is final, printing progress; a run that
    crashed (:data:`RESUBMITTED_STATES`) is submitted again, at most ``resubmit`` times; returns each one's final state
    (Success or Failed, as :func:`run_queue`), printing why each failed one failed to stderr."""
    submit = submit or submit_flow_run
    states = states or flow_run_states
    messages = messages or flow_run_messages
    items = {item.name: item for item in wave}
    ids = {name: submit(deployment, item, extra, repo) for name, item in items.items()}
    for name in ids:
        print(f"submitted {name} to {deployment}", flush=True)
    final = wait_until_final(lambda: states(ids), FINAL_FLOW_STATES, "flow runs", poll_seconds)
    for _ in range(resubmit):
        again = {name: ids[name] for name, state in final.items() if state in RESUBMITTED_STATES}
        if not again:
            break
        why = messages(again)
        for name in again:
            ids[name] = submit(deployment, items[name], extra, repo)
            print(f"resubmitted {name} to {deployment} ({final[name].lower()}: {why.get(name) or 'no message'})",
                  flush=True)
        final = wait_until_final(lambda: states(ids), FINAL_FLOW_STATES, "flow runs", poll_seconds)
    failed = {name: ids[name] for name, state in final.items() if state != "COMPLETED"}
    if failed:
        for name, message in messages(failed).items():
            print(f"{name}: flow run {failed[name]} {final[name].lower()}: {message or 'no message'}", file=sys.stderr,
                  flush=True)
    return {name: "Success" if s == "COMPLETED" else "Failed" for name, s in final.items()}


def wait_until_final(read: Any, final: tuple[str, ...], label: str, poll_seconds: float) -> dict[str, str]:
    """Poll ``read()`` (name -> state) until every state is in ``final``, printing a count per state when it changes;
    returns the last states."""
    last = None
    while True:
        now = read()
        line = ", ".join(f"{n} {s.lower()}" for s, n in sorted(_count(now).items()))
        if line != last:
            print(f"{time.strftime('%H:%M:%S')} {label}: {line}", flush=True)
            last = line
        if all(s in final for s in now.values()):
            return now
        time.sleep(poll_seconds)


def _count(states: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for s in states.values():
        out[s] += 1
    return out


STATE_PRECEDENCE = {"Running": 3, "Queued": 3, "Success": 2, "Failed": 1}
"""Which task of a name queued more than once ``dvc queue status`` speaks for: an unfinished one, else one that
succeeded, else a failed one (DVC lists running, queued, failed and succeeded tasks in that order, not by age)."""


def queue_status(repo: Path) -> tuple[dict[str, str], int]:
    """``dvc queue status``: name -> status (Queued, Running, Success, Failed) of the experiments in DVC's queue (a
    name queued again: :data:`STATE_PRECEDENCE`), and how many workers answered (active and idle)."""
    states: dict[str, str] = {}
    workers = 0
    for line in dvc(["queue", "status"], repo).splitlines()[1:]:
        parts = line.split()
        if line.startswith("Worker status:"):  # "Worker status: 1 active, 0 idle"
            workers = sum(int(word) for word in parts if word.isdigit())
        elif len(parts) >= 3 and parts[-1] in STATE_PRECEDENCE:
            name, state = parts[1], parts[-1]
            if STATE_PRECEDENCE[state] > STATE_PRECEDENCE.get(states.get(name, ""), 0):
                states[name] = state
    return states, workers
