"""Reading the pipeline from DVC, and running DVC commands: ``dvc.yaml`` stays the one place that names stages and paths.

:func:`pipeline_stages` gives every stage of the pipeline (``foreach`` items expanded, ``train@0``) in an order that
runs each after the stages it depends on, with the files it reads and writes as DVC declares them; the Prefect flow,
the comparison and the report find their stages and files through it. :func:`dvc` runs a ``dvc`` command and tells a
busy repository (worth retrying: :func:`retrying`) from a failure; :func:`experiments_shown` reads ``dvc exp show
--json``, and :func:`repository_locked` holds DVC's lock to read a file DVC rewrites, while other experiments may be
running in the same repository.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar


@dataclass(frozen=True)
class StageFiles:
    """One DVC stage: its name (``train@0``), the pipeline step it runs (``train``) and its curriculum item (``0``, or
    None for a stage outside the ``foreach`` loops), and the paths it declares."""

    name: str
    deps: tuple[str, ...]
    params_files: tuple[str, ...]
    outs: tuple[str, ...]
    metrics: tuple[str, ...]
    plots: tuple[str, ...]
    params_keys: tuple[str, ...] = ()
    """The ``params.yaml`` keys the stage reads (``train``, ``start.train``, ...)."""
    upstream: tuple[str, ...] = ()
    """The stages it depends on, directly."""
    uncached: tuple[str, ...] = ()
    """Its outputs with ``cache: false`` other than metrics and plots. DVC keeps no run-cache entry for a stage with
    any (``Stage.run``: ``run_cache=not no_cache_outs``), so an experiment runs it again instead of restoring it."""

    @property
    def step(self) -> str:
        return self.name.split("@", 1)[0]

    @property
    def item(self) -> str | None:
        return self.name.split("@", 1)[1] if "@" in self.name else None

    def out(self, suffix: str) -> str | None:
        """The first declared output (outs, metrics or plots) whose path ends with ``suffix``."""
        return next((p for p in (*self.outs, *self.metrics, *self.plots) if p.endswith(suffix)), None)


class DvcError(RuntimeError):
    """A DVC command failed; the message carries its output's tail."""


class DvcBusy(DvcError):
    """Another DVC command holds the repository's lock, or a git file that several experiments write at once: worth
    retrying."""


BUSY_MARKERS = ("Unable to acquire lock", "is busy", "FileLocked", "index is locked", "cannot lock ref")
"""What DVC prints when another command holds its lock, or when two experiments saved at once collide on a git lock
file (``packed-refs.lock``, the index; DVC issue 10673)."""


def override_value(value: object) -> str:
    """A parameter value in the words ``dvc exp run -S`` reads (Hydra's override grammar): scalars as JSON, lists
    and mappings as ``[a, b]`` and ``{key: value}`` with bare keys (a quoted key is not Hydra's), so a whole list of
    configurations can be set at once.

    >>> override_value([{3: {"data_ratio": 0.5}}, {"stage": 0, "prev": "init"}])
    '[{3: {data_ratio: 0.5}}, {stage: 0, prev: "init"}]'
    """
    import json

    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {override_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(override_value(v) for v in value) + "]"
    return json.dumps(value)


def set_words(overrides: dict[str, object]) -> list[str]:
    """``-S key=value`` words of ``dvc exp run`` for dotted ``overrides`` (:func:`override_value`). A mapping replaces
    the whole mapping there, as :func:`pipeline.params.apply_overrides` does (``-S ~key -S +key={...}``: Hydra would
    merge it key by key, and cannot address the number keys of a configuration's sizes).

    >>> set_words({"train.seed": 1, "env": {"budget": 8}})
    ['-S', '++train.seed=1', '-S', '~env', '-S', '+env={budget: 8}']
    """
    words = []
    for key, value in overrides.items():
        if isinstance(value, dict):
            words += ["-S", f"~{key}", "-S", f"+{key}={override_value(value)}"]
        else:
            words += ["-S", f"++{key}={override_value(value)}"]  # ++: set, or add where the file leaves it out
    return words


def dvc_env() -> dict[str, str]:
    """The environment for ``dvc`` and ``env-engineer`` subprocesses: this Python's ``bin`` folder first on PATH (a
    virtualenv works without being activated) and DVC's analytics off."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "DVC_NO_ANALYTICS": "1"}


def dvc_command(args: list[str], niceness: int = 0) -> list[str]:
    """The command line of ``dvc ARGS`` run ``niceness`` below this process's CPU priority (``nice -n``; without a
    ``nice`` command, not a POSIX system, at this process's priority)."""
    return ["nice", "-n", str(niceness), "dvc", *args] if niceness and shutil.which("nice") else ["dvc", *args]


def dvc(args: list[str], repo: str | Path, timeout: float | None = None, leaves_processes: bool = False,
        env: dict[str, str] | None = None, niceness: int = 0) -> str:
    """Run ``dvc ARGS`` in ``repo``; its output, or :class:`DvcBusy` / :class:`DvcError` with the output's tail.
    ``env``: variables set for the command (and the processes it starts) on top of :func:`dvc_env`. ``niceness``: run
    it (and the processes it starts, which inherit it) that much below this process's CPU priority (``nice -n``, where
    there is one).

    ``leaves_processes``: for a command that starts processes which outlive it (``dvc queue start``: a daemon per
    worker, which inherits the command's standard output and error). Its output then goes through a temporary file,
    not a pipe, so the call returns when the command ends: read from a pipe, it would last until the last of those
    processes ends, and with two workers one of them may never end (its shutdown message taken by the other; DVC issue
    10427)."""
    environment = {**dvc_env(), **(env or {})}
    command = dvc_command(args, niceness)
    if leaves_processes:
        with tempfile.TemporaryFile(mode="w+") as out:
            proc = subprocess.run(command, cwd=repo, env=environment, stdout=out, stderr=subprocess.STDOUT,
                                  text=True, timeout=timeout)
            out.seek(0)
            stdout, stderr = out.read(), ""
    else:
        proc = subprocess.run(command, cwd=repo, env=environment, capture_output=True, text=True, timeout=timeout)
        stdout, stderr = proc.stdout, proc.stderr
    output = (stdout + stderr).strip()
    if proc.returncode != 0:
        tail = "\n".join(output.splitlines()[-25:])
        kind = DvcBusy if any(marker in output for marker in BUSY_MARKERS) else DvcError
        raise kind(f"dvc {' '.join(args)} failed (exit {proc.returncode}):\n{tail}")
    return stdout


@contextmanager
def repository_locked(repo: str | Path) -> Iterator[None]:
    """Hold DVC's repository lock in ``repo`` for the block: to read ``params.yaml`` while other experiments are being
    started in the same repository. ``dvc exp run`` rewrites that file in the workspace while it stashes an experiment
    (it writes the ``-S`` values there, stashes, then resets the file), holding this lock; a read beside it could see a
    half-written file. Another command holding the lock for longer than DVC waits (a few seconds) raises
    :class:`DvcBusy`, worth retrying."""
    from dvc.lock import LockError
    from dvc.repo import Repo

    with Repo(str(repo)) as r:
        try:
            r.lock.lock()
        except LockError as e:
            raise DvcBusy(f"{repo}: DVC's repository lock: {e}") from None
        try:
            yield
        finally:
            r.lock.unlock()


T = TypeVar("T")

VANISHED_RUN_MARKER = "/.dvc/tmp/exps/"
"""Where DVC keeps the working copies of ``dvc exp run --temp`` runs. ``dvc exp show`` opens the copy of every running
experiment; when one finishes between being listed and being opened, DVC fails with "No such file or directory" on its
copy. Reading again then succeeds (the finished experiment is read from git like the others)."""


def retrying(call: Callable[[], T], attempts: int, wait_s: float,
             also: Callable[[DvcError], bool] = lambda e: False) -> T:
    """``call()`` (a :func:`dvc` command), made again while it fails because the repository is busy (:class:`DvcBusy`)
    or with an error ``also`` accepts, at most ``attempts`` times ``wait_s`` seconds apart; any other failure, or the
    last one, raises."""
    if attempts < 1:
        raise ValueError(f"attempts={attempts}: must be at least 1")
    for _ in range(attempts - 1):
        try:
            return call()
        except DvcError as e:
            if not (isinstance(e, DvcBusy) or also(e)):
                raise
        time.sleep(wait_s)
    return call()


def experiments_shown(repo: str | Path, attempts: int = 5, wait_s: float = 2.0) -> list:
    """``dvc exp show --json`` in ``repo``, parsed. Several experiments may be running beside it (one Prefect worker per
    GPU): a read that fails because one of them finished while DVC was opening its working copy, or because another
    command held DVC's lock, is tried again, up to ``attempts`` times ``wait_s`` seconds apart (:func:`retrying`)."""

    def vanished(e: DvcError) -> bool:
        return "No such file or directory" in str(e) and VANISHED_RUN_MARKER in str(e)

    return json.loads(retrying(lambda: dvc(["exp", "show", "--json"], repo), attempts, wait_s, also=vanished))


def pipeline_stages(repo: str | Path) -> list[StageFiles]:
    """Every stage of ``repo``'s ``dvc.yaml``, each after every stage it depends on (among stages ready to run, the one
    listed first in ``dvc.yaml`` first, so curriculum stage k's steps run before stage k+1's)."""
    from dvc.dependency.param import ParamsDependency
    from dvc.repo import Repo

    with Repo(str(repo)) as r:
        stages = [s for s in r.index.stages if s.cmd]
        graph = r.index.graph  # edges point from a stage to the stages it depends on
        listed = {s.name: i for i, s in enumerate(stages)}
        upstream = {s.name: {u.name for u in graph.successors(s) if u.name in listed} for s in stages}
        files = {}
        for s in stages:
            params = tuple(d.def_path for d in s.deps if isinstance(d, ParamsDependency))
            keys = tuple(k for d in s.deps if isinstance(d, ParamsDependency) and d.def_path == "params.yaml"
                         for k in d.params)
            files[s.name] = StageFiles(
                name=s.name,
                deps=tuple(d.def_path for d in s.deps if not isinstance(d, ParamsDependency)),
                params_files=params,
                outs=tuple(o.def_path for o in s.outs if not o.metric and not o.plot),
                metrics=tuple(o.def_path for o in s.outs if o.metric),
                plots=tuple(o.def_path for o in s.outs if o.plot),
                params_keys=keys, upstream=tuple(sorted(upstream[s.name])),
                uncached=tuple(o.def_path for o in s.outs if not o.use_cache and not o.metric and not o.plot))
    order: list[str] = []
    done: set[str] = set()
    while len(order) < len(listed):
        ready = [name for name in listed if name not in done and upstream[name] <= done]
        if not ready:
            raise DvcError(f"dvc.yaml: the stages {sorted(set(listed) - done)} depend on each other in a cycle")
        first = min(ready, key=listed.__getitem__)
        order.append(first)
        done.add(first)
    return [files[name] for name in order]


def curriculum_items(stages: list[StageFiles]) -> list[str]:
    """The curriculum items of the pipeline (``0``, ``1``, ...), in the order their stages run."""
    seen: list[str] = []
    for s in stages:
        if s.item is not None and s.item not in seen:
            seen.append(s.item)
    return seen


def stage_named(stages: list[StageFiles], step: str, item: str | None) -> StageFiles | None:
    """The stage of ``step`` for curriculum ``item`` (``evaluate``, ``"1"`` -> ``evaluate@1``), if the pipeline has it."""
    name = step if item is None else f"{step}@{item}"
    return next((s for s in stages if s.name == name), None)
