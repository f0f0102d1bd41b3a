"""Engineer comparison through DVC experiments: equal budgets, several seeds, means with 95% confidence intervals.

``env-engineer compare --engineers policy,base,heuristic,random,fixed,plr,alp,learnability --seeds 0,1,2 --run --jobs 2``
queues one DVC experiment per (engineer, seed) (``dvc exp run --queue -n cmp-<engineer>-s<seed> -S engineer.engineer=...
-S train.seed=... -S env.seed=... -S engineer.seed=...``: every other knob is the workspace's, so budgets are equal), runs
the queue with ``dvc queue start -j N``, waits for it, and builds the table from ``dvc exp show``. With ``--via prefect``
each experiment is instead a run of the Prefect deployment of the ``curriculum`` flow (``dvc exp run --temp -n NAME
-S ...``), taken by whichever worker of the pool is free (``env-engineer workers --gpus 0,1``: one worker per GPU), so
the comparison shows in the Prefect UI and spreads over the GPUs; a flow run that crashed (its worker's process died)
is submitted once more, and why each failed run failed is printed; the results are read back the same way. Without ``--run`` it
only collects the experiments already there; with ``--workspaces DIR`` it reads them from copies of their
workspaces instead (a run stopped before DVC saved its experiments). ``--contexts`` compares context variants of the ``policy`` engineer
instead (the paper's ablation).

The queue runs in two waves: first, per seed, a short experiment (``cmp-shared-s<seed>``, removed afterwards) that runs
only the stages every engineer of that seed shares (everything before the engineers' first decision), then every
experiment at once, each restoring those stages from DVC's run-cache.
Each queued experiment's stages run in processes of their own; with ``ENV_ENGINEER_GPUS`` set (:mod:`policy.devices`)
each claims a GPU of that pool, or shares them (``ENV_ENGINEER_GPU_SLOTS``).

The aggregate is over each experiment's last curriculum stage: its benchmark Sums (``acc/<A>_agents``,
``opt/<A>_agents``) and its two-agent validation rates (``val/valid``, ``val/optimal``), found through the metrics files
``dvc.yaml`` declares for ``evaluate@K`` and ``rollout@K``: mean and a 95% t-interval across seeds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from envgen.files import atomic_write_text
from experiments.dvc import DvcError, StageFiles, dvc, experiments_shown, pipeline_stages, stage_named
from experiments.stats import mean_ci
from pipeline.params import ParamsError, load_params, parse_overrides


def experiment_plan(engineers: list[str], seeds: list[int], contexts: list[str] | None = None) -> list[dict[str, Any]]:
    """One experiment per (engineer or context, seed): its name, arm, seed and parameter overrides."""
    plan = []
    arms = [("policy", c) for c in contexts] if contexts else [(e, None) for e in engineers]
    for engineer, context in arms:
        for seed in seeds:
            name = f"cmp-{engineer if context is None else 'ctx-' + context}-s{seed}"
            sets = {"engineer.engineer": engineer, "train.seed": seed, "env.seed": seed, "engineer.seed": seed}
            if context is not None:
                sets["engineer.context"] = context
            plan.append({"name": name, "arm": engineer if context is None else f"policy/{context}", "seed": seed, "set": sets})
    return plan


SHARED_PREFIX = "cmp-shared-s"
"""Name prefix of the short experiments that run a seed's shared stages (``cmp-shared-s<seed>``), removed after."""


def shared_stages(stages: list[StageFiles]) -> list[str]:
    """The stages every engineer of a seed runs alike: those of the first curriculum item except its engineer's
    (``engineer-config``, the first decision); DVC runs what they depend on with them."""
    first = next((s.item for s in stages if s.item is not None), None)
    return [s.name for s in stages if first is not None and s.item == first and s.step != "engineer-config"]


def seed_free_stages(stages: list[StageFiles], keys: list[str] | tuple[str, ...]) -> list[str]:
    """The stages outside the curriculum's ``foreach`` loops that read none of ``keys`` (the parameters the
    experiments set: engineer and seeds) and depend on no stage that does: the same in every experiment (the starting
    policy, the validation set, the benchmark). The comparison runs them once, in the workspace, before it queues
    anything, so each experiment finds them done instead of running them again (the starting policy's outputs are in
    git, which DVC's run-cache does not restore)."""
    def reads(stage: StageFiles) -> bool:
        return any(k == p or k.startswith(p + ".") or p.startswith(k + ".") for k in keys for p in stage.params_keys)

    free: set[str] = set()
    for s in stages:  # each after the stages it depends on
        if s.item is None and not reads(s) and all(u in free for u in s.upstream):
            free.add(s.name)
    return [s.name for s in stages if s.name in free]


def waves(plan: list[dict[str, Any]], done: set[str] | frozenset[str] = frozenset(),
          shared: list[str] | tuple[str, ...] = ()) -> list[list[dict[str, Any]]]:
    """The plan less the experiments in ``done``, in two waves, so that the stages every engineer of a seed shares run
    once and the others restore them from DVC's run-cache. With ``shared`` (:func:`shared_stages`): first a short
    experiment per seed that runs only those stages (``targets``; named ``cmp-shared-s<seed>``), then every remaining
    experiment at once. Without: the first remaining experiment of each seed, whole, then the rest."""
    todo = [item for item in plan if item["name"] not in done]
    first: dict[Any, dict[str, Any]] = {}
    for item in todo:
        first.setdefault(item["seed"], item)
    if shared:
        prefix = [{**item, "name": f"{SHARED_PREFIX}{seed}", "arm": None, "targets": list(shared)}
                  for seed, item in first.items()]
        return [w for w in (prefix, todo) if w]
    rest = [item for item in todo if first[item["seed"]] is not item]
    return [w for w in (list(first.values()), rest) if w]


def queue_args(item: dict[str, Any], extra: dict[str, Any]) -> list[str]:
    """``dvc exp run --queue`` arguments of one planned experiment (values written as JSON, which YAML reads back)."""
    args = ["exp", "run", "--queue", "-n", item["name"]]
    for key, value in {**item["set"], **extra}.items():
        args += ["-S", f"{key}={json.dumps(value)}"]
    return args + list(item.get("targets", ()))


QUEUE_STALL_SECONDS = 60.0
"""How long :func:`run_queue` waits with experiments unfinished and no DVC worker or experiment process left before
it gives up (dvc-task's process records say which are left; a worker takes a second or two to write its own)."""


WORKERS_LEAVE_SECONDS = 120.0
"""How long :func:`wait_for_workers_to_leave` waits for the workers of an earlier wave to leave. A worker leaves by
itself about 10 s after it last saw the queue empty (dvc-task's ``TemporaryWorker`` checks every 10 s)."""


QUEUE_FINAL = ("Success", "Failed")
"""The states of a DVC queue task that will not change any more."""


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
    """``dvc queue start -j jobs``, then wait until each experiment of ``names`` has finished, printing progress;
    returns each one's final status (Success or Failed: ``dvc queue logs NAME`` says why). Workers stop by themselves
    once the queue is empty; when for ``stall_seconds`` none is left (:func:`queue_workers`, or one answering
    ``dvc queue status``) and no experiment's process runs (:func:`experiment_process_alive`) while some of ``names``
    are unfinished, raises :class:`QueueStalled` naming them, why and how to go on, instead of waiting forever."""
    dvc(["queue", "start", "-j", str(jobs)], repo, leaves_processes=True)
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


def run_wave_in_queue(repo: Path, jobs: int, wave: list[dict[str, Any]], extra: dict[str, Any],
                      retries: int = 1, stall_seconds: float = QUEUE_STALL_SECONDS) -> dict[str, str]:
    """One wave through DVC's queue: queued while no worker runs (:func:`wait_for_workers_to_leave`), then run with
    ``jobs`` workers (:func:`run_queue`). When the queue stalls, the experiments it lost (marked running with no
    process left) are marked failed (``dvc queue kill``) and queued again, and workers started again for those still
    queued, at most ``retries`` times; returns each experiment's final status."""
    items = {item["name"]: item for item in wave}
    todo = list(wave)
    attempts = 0
    while True:
        wait_for_workers_to_leave(repo)
        for item in todo:
            dvc(queue_args(item, extra), repo)
            print(f"queued {item['name']}", flush=True)
        try:
            return run_queue(repo, jobs, list(items), stall_seconds=stall_seconds)
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


def submit_flow_run(deployment: str, item: dict[str, Any], extra: dict[str, Any], repo: Path | None = None) -> str:
    """Schedule one planned experiment as a run of the Prefect ``deployment`` (the ``curriculum`` flow with
    ``overrides`` and ``name``: it becomes ``dvc exp run --temp -n NAME -S ...`` on whichever worker takes it); returns
    the flow run's id."""
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    try:
        parameters = {"overrides": {**item["set"], **extra}, "name": item["name"]}
        if item.get("targets"):
            parameters["targets"] = list(item["targets"])
        if repo is not None:
            parameters["repo"] = str(repo.resolve())
        flow_run = run_deployment(deployment, parameters=parameters,
                                  flow_run_name=item["name"], timeout=0, as_subflow=False)
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


def run_flow_runs(deployment: str, wave: list[dict[str, Any]], extra: dict[str, Any], poll_seconds: float = 5.0,
                  submit: Any = None, states: Any = None, repo: Path | None = None, messages: Any = None,
                  resubmit: int = 1) -> dict[str, str]:
    """Submit one wave as flow runs of ``deployment`` and wait until each is final, printing progress; a run that
    crashed (:data:`RESUBMITTED_STATES`) is submitted again, at most ``resubmit`` times; returns each one's final state
    (Success or Failed, as :func:`run_queue`), printing why each failed one failed to stderr."""
    submit = submit or submit_flow_run
    states = states or flow_run_states
    messages = messages or flow_run_messages
    items = {item["name"]: item for item in wave}
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


def experiment_records(show: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Name, params and metrics of every experiment in ``dvc exp show --json`` output."""
    out = []
    for baseline in show:
        for exp in baseline.get("experiments") or []:
            for rev in exp.get("revs") or []:
                data = rev.get("data") or {}
                files = {path: (p or {}).get("data") or {} for path, p in (data.get("params") or {}).items()}
                metrics = {path: (m or {}).get("data") or {} for path, m in (data.get("metrics") or {}).items()}
                out.append({"name": rev.get("name") or exp.get("name"), "params": files.get("params.yaml") or {},
                            "metrics": metrics, "param_files": files, "rev": rev.get("rev")})
    return out


def workspace_records(folder: Path, stages: list[StageFiles]) -> list[dict[str, Any]]:
    """The same records as :func:`experiment_records`, read from experiment workspaces instead of ``dvc exp show``:
    every subfolder of ``folder`` that holds a ``params.yaml`` is one experiment, named after the subfolder
    (``cmp-fixed-s0``, as :func:`experiment_plan` names them), its files at the paths ``dvc.yaml`` declares. For
    experiments that DVC never saved: a run stopped before its last stages, whose workspaces (DVC's
    ``.dvc/tmp/exps``) were copied while it ran."""
    import yaml

    metric_paths = sorted({path for s in stages for path in s.metrics})
    param_paths = sorted({path for s in stages for path in s.params_files if path != "params.yaml"})
    out = []
    for ws in sorted(p for p in folder.iterdir() if (p / "params.yaml").is_file()):
        params = yaml.safe_load((ws / "params.yaml").read_text()) or {}
        metrics = {path: json.loads((ws / path).read_text()) for path in metric_paths if (ws / path).is_file()}
        files = {path: yaml.safe_load((ws / path).read_text()) or {} for path in param_paths if (ws / path).is_file()}
        out.append({"name": ws.name, "params": params, "metrics": metrics, "param_files": {"params.yaml": params, **files},
                    "folder": str(ws)})
    if not out:
        raise ValueError(f"--workspaces {folder}: no experiment folder (a subfolder with a params.yaml) in it")
    return out


OUTCOME_COLUMNS = ("content_hash", "num_agents", "size", "valid", "optimal")
"""The columns of a benchmark rollout every outcome row keeps."""


def _read_parquet(repo: Path, record: dict[str, Any], path: str, columns: list[str]) -> Any:
    """``path`` of one experiment as an Arrow table: from its workspace folder, or through DVC at its revision."""
    import io

    import pyarrow.parquet as pq

    if record.get("folder"):
        return pq.read_table(Path(record["folder"]) / path, columns=columns)
    import dvc.api

    with dvc.api.open(path, repo=str(repo), rev=record.get("rev"), mode="rb") as f:
        return pq.read_table(io.BytesIO(f.read()), columns=columns)


def outcomes(repo: Path, records: list[dict[str, Any]], plan: list[dict[str, Any]], stages: list[StageFiles]) -> Any:
    """Every benchmark answer of the planned experiments, one row each: arm, seed, stage, content hash, agents, size,
    wait ratio, valid, optimal (Arrow table), so a comparison's tables and figures can be derived again; a stage whose
    rollout cannot be read (not run, not in DVC's cache) is left out."""
    import pyarrow as pa
    from dvc.exceptions import DvcException

    arms = {item["name"]: item for item in plan}
    tables, waits = [], None
    for rec in records:
        item = arms.get(rec["name"])
        if item is None or item.get("targets"):
            continue
        for k in curriculum_stages(rec["params"]):
            evaluate = stage_named(stages, "evaluate", str(k))
            path = evaluate.out("benchmark.parquet") if evaluate else None
            if path is None:
                continue
            try:
                table = _read_parquet(repo, rec, path, list(OUTCOME_COLUMNS))
                if waits is None:
                    bench = next(d for d in evaluate.deps if d.endswith("instances.parquet") and "benchmark" in d)
                    rows = _read_parquet(repo, rec, bench, ["content_hash", "wait_subset"]).to_pylist()
                    waits = {r["content_hash"]: r["wait_subset"] for r in rows}
            except (OSError, StopIteration, ValueError, DvcException) as e:
                print(f"warning: {rec['name']} stage {k}: no benchmark answers ({type(e).__name__})", file=sys.stderr)
                continue
            n = table.num_rows
            tables.append(pa.table({"engineer": [item["arm"]] * n, "seed": [item["seed"]] * n, "stage": [k] * n,
                                    **{c: table.column(c) for c in OUTCOME_COLUMNS},
                                    "wait_ratio": [waits.get(h) for h in table.column("content_hash").to_pylist()]}))
    return pa.concat_tables(tables) if tables else None


def stage_config(record: dict[str, Any], stages: list[StageFiles], stage: int) -> dict[str, Any] | None:
    """The environment configuration curriculum stage ``stage`` of the experiment trained on: the params file of its
    ``generate-instances@K`` stage (written by the engineer of the stage before); None when absent."""
    generate = stage_named(stages, "generate-instances", str(stage))
    files = record.get("param_files") or {}
    for path in generate.params_files if generate else ():
        if path != "params.yaml" and files.get(path):
            return files[path]
    return None


def config_summary(config: dict[str, Any]) -> dict[str, float]:
    """A configuration in four numbers, each weighted by the share of instances of every map size: mean board side
    (``size``), hole ratio, wait ratio (share of instances that need a wait) and minimum path length."""
    sizes = {int(k): v for k, v in (config.get("sizes") or {}).items() if isinstance(v, dict)}
    total = sum(float(v.get("data_ratio", 0)) for v in sizes.values())
    if not total:
        return {}
    def mean(key: str) -> float:
        return sum(float(v.get("data_ratio", 0)) * float(v.get(key, 0)) for v in sizes.values()) / total
    return {"size": sum(float(v.get("data_ratio", 0)) * n for n, v in sizes.items()) / total,
            "hole_ratio": mean("hole_ratio"), "wait_ratio": mean("wait_ratio"), "min_path_length": mean("min_path_length")}


def curriculum_stages(params: dict[str, Any]) -> list[int]:
    """The stages of the experiment's curriculum (``params.yaml``'s ``curriculum``), in order."""
    stages = [row.get("stage") for row in params.get("curriculum") or [] if isinstance(row, dict)]
    return sorted(s for s in stages if isinstance(s, int))


def final_stage(params: dict[str, Any]) -> int | None:
    """The last stage of the experiment's curriculum, or None when it has none."""
    stages = curriculum_stages(params)
    return stages[-1] if stages else None


def last_stage_result(record: dict[str, Any], stages: list[StageFiles]) -> dict[str, float] | None:
    """The benchmark Sums of the experiment's last curriculum stage plus that stage's held-out two-agent validation
    rates (``val/valid``, ``val/optimal``), read from the metrics files ``dvc.yaml`` declares for ``evaluate@K`` and
    ``rollout@K``; None when that stage has no benchmark metrics (not run, unfinished or failed)."""
    final = final_stage(record["params"])
    return None if final is None else stage_result(record, stages, final)


def stage_results(record: dict[str, Any], stages: list[StageFiles]) -> dict[int, dict[str, float]]:
    """:func:`stage_result` of every curriculum stage of the experiment that has one, by stage."""
    results = {k: stage_result(record, stages, k) for k in curriculum_stages(record["params"])}
    return {k: r for k, r in results.items() if r is not None}


def stage_result(record: dict[str, Any], stages: list[StageFiles], stage: int) -> dict[str, float] | None:
    """Curriculum stage ``stage``'s benchmark Sums (and per map size, ``size/...``) and held-out two-agent validation
    rates of the experiment; None when that stage has no benchmark metrics."""
    evaluate = stage_named(stages, "evaluate", str(stage))
    if evaluate is None or not evaluate.metrics or not record["metrics"].get(evaluate.metrics[0]):
        return None
    data = record["metrics"][evaluate.metrics[0]]
    out = dict(data.get("bench") or {})
    out.update({f"size/{key}": value for key, value in (data.get("bench_size") or {}).items()})
    rollout = stage_named(stages, "rollout", str(stage))
    validation = (record["metrics"].get(rollout.metrics[0]) or {}).get("validation") if rollout and rollout.metrics else None
    for key in ("valid", "optimal"):
        if validation and validation.get(key) is not None:
            out[f"val/{key}"] = validation[key]
    return out


def aggregate(records: list[dict[str, Any]], plan: list[dict[str, Any]], stages: list[StageFiles],
              reference: str | None = "fixed") -> dict[str, Any]:
    """Per arm: its seeds and, per metric, mean and 95% interval across seeds (last stage); the same per curriculum
    stage for the headline metrics (``stages``: the curve across stages); the configuration each stage trained on,
    summarised (:func:`config_summary`) and averaged across seeds (``configs``); and, for every arm but
    ``reference``, the difference from ``reference`` paired by seed (the same seeds, hence the same stage 0 and data
    draws), with its 95% t-interval across seeds (``vs_reference``). Only experiments that finished their last stage
    count, so every arm is compared at equal budget."""
    arms = {item["name"]: item["arm"] for item in plan}
    values: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    by_seed: dict[str, dict[str, dict[Any, float]]] = defaultdict(lambda: defaultdict(dict))
    per_stage: dict[str, dict[int, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    chosen: dict[str, dict[int, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    seeds: dict[str, list[int]] = defaultdict(list)
    for rec in records:
        arm = arms.get(rec["name"])
        per = stage_results(rec, stages) if arm else {}
        result = per.get(final_stage(rec["params"]))
        if arm is None or result is None:
            continue
        seed = rec["params"].get("train", {}).get("seed")
        seeds[arm].append(seed)
        for key, value in result.items():
            values[arm][key].append(float(value))
            by_seed[arm][key][seed] = float(value)
        for k, stage in per.items():
            for key, value in stage.items():
                if not key.startswith(("size/", "se/")):
                    per_stage[arm][k][key].append(float(value))
            config = stage_config(rec, stages, k)
            for key, value in (config_summary(config) if config else {}).items():
                chosen[arm][k][key].append(value)
    table = {arm: {"seeds": sorted(seeds[arm]), "metrics": {k: mean_ci(v) for k, v in sorted(ms.items())},
                   "stages": {str(k): {key: mean_ci(v) for key, v in sorted(m.items())}
                              for k, m in sorted(per_stage[arm].items())},
                   "configs": {str(k): {key: mean_ci(v) for key, v in m.items()} for k, m in sorted(chosen[arm].items())}}
             for arm, ms in values.items()}
    if reference in by_seed:
        for arm, row in table.items():
            if arm == reference:
                continue
            row["vs_reference"] = {"reference": reference, "metrics": {}}
            for key, per_seed in sorted(by_seed[arm].items()):
                common = sorted(set(per_seed) & set(by_seed[reference].get(key, {})))
                if common:
                    diffs = [per_seed[s] - by_seed[reference][key][s] for s in common]
                    row["vs_reference"]["metrics"][key] = {**mean_ci(diffs), "seeds": common}
    return table


def missing(records: list[dict[str, Any]], plan: list[dict[str, Any]], stages: list[StageFiles]) -> list[str]:
    """Planned experiments with no final-stage results among ``records``."""
    found = {rec["name"] for rec in records if last_stage_result(rec, stages) is not None}
    return [item["name"] for item in plan if item["name"] not in found]


def _cell(m: dict[str, float] | None, sign: bool = False) -> str:
    if m is None:
        return ""
    if m["ci95"] is None:
        return f"{100 * m['mean']:{'+' if sign else ''}.1f} (one seed)"
    return f"{100 * m['mean']:{'+' if sign else ''}.1f} ± {100 * m['ci95']:.1f}"


def render(table: dict[str, Any]) -> str:
    """The comparison as markdown (percent, mean ± 95% half-width): the headline metrics per engineer; the differences
    from the reference engineer paired by seed; the valid rate per map size."""
    every = sorted({k for arm in table.values() for k in arm["metrics"]})
    keys = [k for k in every if not k.startswith(("size/", "se/"))]
    lines = ["| engineer | seeds | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    from engineers.registry import UPPER_BOUNDS

    for arm, row in table.items():
        cells = [_cell(row["metrics"].get(k)) for k in keys]
        label = f"{arm} (upper bound)" if arm in UPPER_BOUNDS else arm
        lines.append(f"| {label} | {len(row['seeds'])} | " + " | ".join(cells) + " |")
    lines.append("\nValues: percent, mean ± 95% t-interval half-width across seeds (last stage; acc/opt: benchmark "
                 "Sums per agent count, val: the two-agent validation set).")
    if UPPER_BOUNDS & set(table):
        lines.append("An upper bound replays a sequence of configurations chosen in advance (engineer.replay, e.g. the "
                     "sensitivity study's best): the most an engineer could gain, not an engineer.")
    paired = {arm: row["vs_reference"] for arm, row in table.items() if row.get("vs_reference")}
    if paired:
        reference = next(iter(paired.values()))["reference"]
        diff_keys = [k for k in keys if k.startswith(("acc/", "val/valid"))]
        lines += ["", f"Difference from `{reference}`, paired by seed (points, mean ± 95% t-interval across seeds):", "",
                  "| engineer | seeds | " + " | ".join(diff_keys) + " |", "|---|---|" + "---|" * len(diff_keys)]
        for arm, d in paired.items():
            n = max((m["n"] for m in d["metrics"].values()), default=0)
            lines.append(f"| {arm} | {n} | " + " | ".join(_cell(d["metrics"].get(k), sign=True) for k in diff_keys) + " |")
    staged = {arm: row["stages"] for arm, row in table.items() if row.get("stages")}
    if staged:
        numbers = sorted({int(k) for st in staged.values() for k in st})
        curve_keys = [k for k in keys if k.startswith(("acc/", "val/valid"))]
        lines += ["", "Across stages (percent, mean ± 95% t-interval across seeds; stage 0 is the first after the start):"]
        for key in curve_keys:
            lines += ["", f"`{key}`", "", "| engineer | " + " | ".join(f"stage {k}" for k in numbers) + " |",
                      "|---|" + "---|" * len(numbers)]
            for arm, st in staged.items():
                lines.append(f"| {arm} | " + " | ".join(_cell(st.get(str(k), {}).get(key)) for k in numbers) + " |")
    chosen = {arm: row["configs"] for arm, row in table.items() if row.get("configs")}
    if chosen:
        numbers = sorted({int(k) for c in chosen.values() for k in c})
        lines += ["", "The environment each stage trained on (means across seeds, weighted by each size's share: board "
                  "side, hole ratio, wait ratio):", "", "| engineer | " + " | ".join(f"stage {k}" for k in numbers) + " |",
                  "|---|" + "---|" * len(numbers)]
        for arm, c in chosen.items():
            cells = []
            for k in numbers:
                m = c.get(str(k))
                cells.append(f"{m['size']['mean']:.1f} / {m['hole_ratio']['mean']:.2f} / {m['wait_ratio']['mean']:.2f}"
                             if m and {"size", "hole_ratio", "wait_ratio"} <= set(m) else "")
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    sizes = [k for k in every if k.startswith("size/")]
    if sizes:
        names = [k.removeprefix("size/") for k in sizes]
        lines += ["", "Valid rate per map size (percent, mean ± 95% t-interval across seeds):", "",
                  "| engineer | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for arm, row in table.items():
            lines.append(f"| {arm} | " + " | ".join(_cell(row["metrics"].get(k)) for k in sizes) + " |")
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engineers", default="policy,base,heuristic,random,fixed,plr,alp,learnability",
                        help="comma-separated engineers (oracle too, with engineer.replay set: an upper bound)")
    parser.add_argument("--contexts", default=None, help="compare these context variants of the policy engineer instead")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (at least 3 for an interval)")
    parser.add_argument("--run", action="store_true", help="queue the experiments not yet there, run the queue and wait "
                        "(else only collect what `dvc exp show` has)")
    parser.add_argument("--jobs", type=int, default=1, help="with --run: experiments at once (`dvc queue start -j`)")
    parser.add_argument("--via", choices=("dvc-queue", "prefect"), default="dvc-queue",
                        help="with --run: DVC's own queue (default), or flow runs of a Prefect deployment that the "
                        "pool's workers take (`env-engineer workers --gpus 0,1`: one per GPU), each a `dvc exp run --temp`")
    parser.add_argument("--deployment", default="curriculum/curriculum",
                        help="with --via prefect: the deployment of the curriculum flow (prefect.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="extra parameter for every experiment (as `dvc exp run -S`)")
    parser.add_argument("--reference", default="fixed",
                        help="the arm every other is compared with, paired by seed (default fixed)")
    parser.add_argument("--repo", type=Path, default=Path("."), help="the DVC repository (default: here)")
    parser.add_argument("--workspaces", type=Path, default=None, metavar="DIR",
                        help="read the experiments from DIR's subfolders (one per experiment, named cmp-ENGINEER-sSEED, "
                        "each a workspace: params.yaml and the files dvc.yaml declares) instead of `dvc exp show`; "
                        "for a run stopped before DVC saved its experiments")
    parser.add_argument("--out-json", type=Path, default=Path("comparison.json"),
                        help="the table, and what ran on what (commit, settings, wall time, GPUs); every benchmark "
                        "answer's outcome goes beside it as NAME.outcomes.parquet")
    parser.add_argument("--out-md", type=Path, default=Path("comparison.md"))


def run_experiments(args: argparse.Namespace, plan: list[dict[str, Any]], extra: dict[str, Any],
                    stages: list[StageFiles]) -> dict[str, Any]:
    """``--run``: the stages no experiment changes once in the workspace (:func:`seed_free_stages`), then the plan's
    unfinished experiments wave by wave (:func:`waves`) through DVC's queue or Prefect; returns what ran on what:
    wall seconds, the GPUs (kind, count) and how busy they were."""
    from experiments.machine import BusySampler, describe_gpus

    began = time.monotonic()
    with BusySampler() as busy:
        done = {rec["name"] for rec in experiment_records(experiments_shown(args.repo))
                if last_stage_result(rec, stages) is not None}
        common = seed_free_stages(stages, sorted({k for item in plan for k in item["set"]} | set(extra)))
        if common and len(done) < len(plan):
            print(f"{time.strftime('%H:%M:%S')} in the workspace, the stages every experiment shares: "
                  f"{', '.join(common)}", flush=True)
            dvc(["repro", *common], args.repo)
        for number, wave in enumerate(waves(plan, done, shared_stages(stages)), 1):
            wave_began = time.monotonic()
            print(f"{time.strftime('%H:%M:%S')} wave {number}: {len(wave)} experiment(s)", flush=True)
            if args.via == "prefect":
                states = run_flow_runs(args.deployment, wave, extra, repo=args.repo)
            else:
                states = run_wave_in_queue(args.repo, args.jobs, wave, extra)
            failed = [name for name, state in states.items() if state == "Failed"]
            if failed:
                where = "the flow runs' logs in Prefect show why" if args.via == "prefect" else "`dvc queue logs NAME` shows why"
                print(f"failed: {', '.join(failed)} ({where})", file=sys.stderr, flush=True)
            print(f"{time.strftime('%H:%M:%S')} wave {number} done in {time.monotonic() - wave_began:.0f} s", flush=True)
            scaffolding = [item["name"] for item in wave if item.get("targets")]
            if scaffolding:  # their stages are in the run-cache now; the experiments themselves are no result
                try:
                    dvc(["exp", "remove", *scaffolding], args.repo)
                except DvcError as e:
                    print(f"warning: could not remove {', '.join(scaffolding)}: {e}", file=sys.stderr, flush=True)
    return {"wall_s": round(time.monotonic() - began, 1), "gpus": describe_gpus(), "gpu_busy": busy.summary()}


def run(args: argparse.Namespace) -> int:
    from engineers.llm import CONTEXTS
    from engineers.registry import ENGINEERS

    try:
        engineers = [e.strip() for e in args.engineers.split(",") if e.strip()]
        contexts = [c.strip() for c in args.contexts.split(",")] if args.contexts else None
        seeds = [int(s) for s in args.seeds.split(",")]
        bad = [e for e in engineers if e not in ENGINEERS] + [c for c in contexts or [] if c not in CONTEXTS]
        if bad:
            raise ValueError(f"unknown engineer/context {bad}; engineers {sorted(ENGINEERS)}, contexts {sorted(CONTEXTS)}")
        if args.run and args.workspaces:
            raise ValueError("--run and --workspaces: give one (--workspaces only reads experiments already run)")
        if args.jobs < 1:
            raise ValueError(f"--jobs {args.jobs}: must be at least 1")
        extra = parse_overrides(args.set)
        plan = experiment_plan(engineers, seeds, contexts)
        for item in plan:  # every experiment's parameters are checked before anything is queued
            load_params(args.repo / "params.yaml", {**item["set"], **extra})
        stages = pipeline_stages(args.repo)
        ran = run_experiments(args, plan, extra, stages) if args.run else None
        if args.workspaces:
            records = workspace_records(args.workspaces, stages)
        else:
            records = experiment_records(experiments_shown(args.repo))
        table = aggregate(records, plan, stages, args.reference)
        absent = missing(records, plan, stages)
        if absent:
            print(f"warning: no results for {', '.join(absent)} at this commit: experiments belong to the commit they "
                  "started from (`dvc exp list -A` lists all; `dvc queue logs NAME` says why one failed); run them "
                  "with --run", file=sys.stderr)
    except (ValueError, ParamsError, KeyError, OSError, DvcError, json.JSONDecodeError, QueueStalled) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = {"commit": git_commit(args.repo), "engineers": engineers, "seeds": seeds, "contexts": contexts,
            "set": args.set, "reference": args.reference, "via": args.via, "jobs": args.jobs,
            "params": load_params(args.repo / "params.yaml", extra).model_dump(mode="json"), **(ran or {})}
    answers = outcomes(args.repo, records, plan, stages)
    if answers is not None:
        import pyarrow.parquet as pq

        path = args.out_json.with_suffix(".outcomes.parquet")
        tmp = path.with_suffix(".tmp")
        pq.write_table(answers, tmp)
        tmp.replace(path)
        print(f"{answers.num_rows} benchmark answers' outcomes in {path}")
    atomic_write_text(args.out_json, json.dumps({"run": meta, "arms": table}, indent=2))
    atomic_write_text(args.out_md, render(table))
    print(render(table))
    return 0


def git_commit(repo: Path) -> str | None:
    """The commit checked out in ``repo`` (None outside git)."""
    import subprocess

    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True)
    return out.stdout.strip() or None if out.returncode == 0 else None
