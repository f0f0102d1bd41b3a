"""``env-engineer run-stages``: run ``dvc.yaml``'s pipeline where DVC is not installed (a GPU worker, the lent machine).

``dvc.yaml`` stays the one place that names paths and commands: this reads it, expands its ``foreach`` stages over
``params.yaml`` (``${item.stage}``, ``${evaluate.max_new_tokens}``), orders the stages by what each one reads and writes
(as ``dvc repro`` does) and runs their commands in a run folder of its own, with ``params.yaml`` copied there and any
``--set KEY=VALUE`` applied (as ``dvc exp run -S``). What it does not do is DVC's job: no caching or versioning of the
outputs, no change detection beyond "this stage finished in this folder before" (a marker written after its command
succeeds, so a rerun of an interrupted run resumes at the first unfinished stage). ``--cache`` adds DVC's run-cache
idea: a stage whose command, dependency contents and declared parameters equal an earlier run's reuses its outputs.

``--no-validate`` drops the great-expectations checks (``&& env-engineer validate ...``) from the commands, for
machines without great-expectations; say so wherever the results are reported.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from envgen.files import atomic_write_text

_VALIDATE = re.compile(r"\s*&&\s*env-engineer validate\b[^&]*")
_TEMPLATE = re.compile(r"\$\{([^}]+)\}")


@dataclass(frozen=True)
class Stage:
    """One runnable stage: its DVC name (``train@1`` for foreach items), command, and the paths it reads and writes."""

    name: str
    cmd: str
    deps: tuple[str, ...]
    outs: tuple[str, ...]
    params: tuple[str, ...] = ()
    """Dotted keys or sections of params.yaml the stage reads (its ``params:`` entries that are not files)."""


def _lookup(key: str, scope: dict[str, Any]) -> Any:
    value: Any = scope
    for part in key.strip().split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(f"${{{key}}}: no '{part}' in params.yaml (or the foreach item)")
        value = value[part]
    return value


def _render(value: Any, scope: dict[str, Any]) -> Any:
    if isinstance(value, str):
        whole = _TEMPLATE.fullmatch(value.strip())
        if whole:  # a lone ${x} keeps its type (a list for foreach)
            return _lookup(whole.group(1), scope)
        return _TEMPLATE.sub(lambda m: str(_lookup(m.group(1), scope)), value)
    if isinstance(value, list):
        return [_render(v, scope) for v in value]
    if isinstance(value, dict):
        return {_render(k, scope): _render(v, scope) for k, v in value.items()}
    return value


def _paths(entries: list[Any] | None) -> tuple[str, ...]:
    """Paths of a deps/outs/metrics/plots list (entries are a path or ``{path: options}``)."""
    out: list[str] = []
    for entry in entries or []:
        out.extend(entry.keys() if isinstance(entry, dict) else [entry])
    return tuple(out)


def load_stages(dvc_yaml: Path, params: dict[str, Any]) -> list[Stage]:
    """Every stage of ``dvc_yaml``, foreach stages expanded and named as DVC names them (``name@0`` for the first item
    of a list of mappings, ``name@key`` for a mapping or a list of scalars)."""
    spec = yaml.safe_load(dvc_yaml.read_text()) or {}
    if "vars" in spec:
        raise ValueError(f"{dvc_yaml}: top-level 'vars' is not supported by run-stages (only params.yaml is read); "
                         "move those values into params.yaml")
    stages: list[Stage] = []
    for name, body in (spec.get("stages") or {}).items():
        if "wdir" in body or "wdir" in (body.get("do") or {}):
            raise ValueError(f"{dvc_yaml}: stage {name} sets 'wdir', which run-stages does not support; "
                             "run commands from the pipeline's folder")
        items = [(None, None)]
        if "foreach" in body:
            found = _render(body["foreach"], params)
            if isinstance(found, dict):  # a mapping: keyed by its keys
                items = [(str(k), v) for k, v in found.items()]
            else:  # a list: scalars keyed by themselves, anything else by position (as DVC names them)
                items = [(str(v) if isinstance(v, (str, int, float)) else str(i), v) for i, v in enumerate(found)]
            body = body["do"]
        for key, item in items:
            scope = params if item is None else {**params, "item": item}
            b = _render(body, scope)
            params_files = [k for e in b.get("params") or [] if isinstance(e, dict) for k in e]
            deps = _paths(b.get("deps")) + tuple(params_files)
            outs = _paths(b.get("outs")) + _paths(b.get("metrics")) + _paths(b.get("plots"))
            keys = tuple(e for e in b.get("params") or [] if isinstance(e, str))
            stages.append(Stage(name if key is None else f"{name}@{key}", " ".join(b["cmd"].split()), deps, outs, keys))
    return stages


def order(stages: list[Stage]) -> list[Stage]:
    """Stages so that each runs after every stage that writes one of its dependencies (file order breaks ties)."""
    writer = {out: s.name for s in stages for out in s.outs}
    done: list[Stage] = []
    placed: set[str] = set()
    visiting: set[str] = set()
    by_name = {s.name: s for s in stages}

    def visit(stage: Stage) -> None:
        if stage.name in placed:
            return
        if stage.name in visiting:
            raise ValueError(f"dvc.yaml: a cycle through stage {stage.name}")
        visiting.add(stage.name)
        for dep in stage.deps:
            if dep in writer and writer[dep] != stage.name:
                visit(by_name[writer[dep]])
        visiting.discard(stage.name)
        placed.add(stage.name)
        done.append(stage)

    for s in stages:
        visit(s)
    return done


def set_params(params: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``params`` with dotted ``overrides`` applied (``train.seed=1``); unknown sections are an error."""
    out = json.loads(json.dumps(params))
    for key, value in overrides.items():
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                raise ValueError(f"--set {key}: params.yaml has no section '{part}'")
            node = node[part]
        node[parts[-1]] = value
    return out


def _hash_path(path: Path) -> str:
    """Content hash of a file, or of a folder's files and their relative names; "absent" for neither."""
    digest = hashlib.sha256()
    if path.is_file():
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    elif path.is_dir():
        for child in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(f"{child.relative_to(path)}\0{_hash_path(child)}\0".encode())
    else:
        return "absent"
    return digest.hexdigest()


def stage_key(stage: Stage, cmd: str, folder: Path, params: dict[str, Any]) -> str:
    """What decides a stage's outputs, hashed, as DVC's run-cache keys them: its command, its dependencies' contents
    and the parameter values it declares."""
    values = {}
    for key in stage.params:
        try:
            values[key] = _lookup(key, params)
        except KeyError:
            values[key] = None
    blob = {"cmd": cmd, "deps": {d: _hash_path(folder / d) for d in stage.deps}, "params": values}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()


def _copy(src: Path, dst: Path) -> None:
    if dst.is_dir():
        shutil.rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    (shutil.copytree if src.is_dir() else shutil.copyfile)(src, dst)


def _store(cache: Path, key: str, folder: Path, stage: Stage) -> None:
    """Keep a finished stage's outputs under ``cache/key`` (written aside, then renamed into place)."""
    final = cache / key
    if final.exists():
        return
    work = cache / f".{key}.{os.getpid()}.{threading.get_ident()}"
    shutil.rmtree(work, ignore_errors=True)
    for out in stage.outs:
        if (folder / out).exists():
            _copy(folder / out, work / out)
    try:
        os.replace(work, final)
    except OSError:  # another run stored the same stage meanwhile: keep theirs
        shutil.rmtree(work, ignore_errors=True)


def _shim(folder: Path) -> dict[str, str]:
    """The environment for the commands: ``env-engineer`` on PATH (this Python's, or a shim running ``tasks.cli``)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if shutil.which("env-engineer", path=env["PATH"]) is None:
        bin_dir = folder / ".bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        shim = bin_dir / "env-engineer"
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m tasks.cli "$@"\n')
        shim.chmod(0o755)
        root = str(Path(__file__).resolve().parents[1])
        env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return env


def run_stages(repo: Path, folder: Path, overrides: dict[str, Any] | None = None, validate: bool = True,
               until: str | None = None, cache: Path | None = None,
               env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run ``repo``'s pipeline in ``folder`` (created; ``params.yaml`` written there with ``overrides``); returns one
    record per stage (name, seconds, skipped, cached). A failing command raises with its output's tail, the log kept
    in ``folder/logs``. With ``cache``, a stage whose command, dependencies and declared parameters match an earlier
    run's (in any folder sharing that cache) gets that run's outputs copied instead of running (DVC's run-cache idea:
    the stages before an engineer's first decision are shared by every engineer of a seed). ``env``: extra environment
    variables for the commands (``CUDA_VISIBLE_DEVICES``)."""
    folder.mkdir(parents=True, exist_ok=True)
    params = set_params(yaml.safe_load((repo / "params.yaml").read_text()) or {}, overrides or {})
    written = folder / "params.yaml"
    text = yaml.safe_dump(params, sort_keys=False)
    if written.exists() and written.read_text() != text and any((folder / ".done").glob("*")):
        raise ValueError(f"{folder}: finished stages there ran with other parameters; use a new folder")
    atomic_write_text(written, text)
    shutil.copyfile(repo / "dvc.yaml", folder / "dvc.yaml")
    stages = order(load_stages(folder / "dvc.yaml", params))
    if until is not None and until not in {s.name for s in stages}:
        raise ValueError(f"--until {until!r}: no such stage; stages: {', '.join(s.name for s in stages)}")
    env = {**_shim(folder), **(env or {})}
    (folder / "logs").mkdir(exist_ok=True)
    (folder / ".done").mkdir(exist_ok=True)
    records = []
    for index, stage in enumerate(stages):
        marker = folder / ".done" / stage.name
        cmd = stage.cmd if validate else _VALIDATE.sub("", stage.cmd)
        key = stage_key(stage, cmd, folder, params) if cache is not None and not marker.exists() else None
        if marker.exists():
            records.append({"stage": stage.name, "seconds": 0.0, "skipped": True, "cached": False})
        elif key is not None and (cache / key).is_dir():
            for out in stage.outs:
                if (cache / key / out).exists():
                    _copy(cache / key / out, folder / out)
            atomic_write_text(marker, json.dumps({"cached": key}))
            print(f"[{index + 1}/{len(stages)}] {stage.name}: outputs of an identical earlier run", flush=True)
            records.append({"stage": stage.name, "seconds": 0.0, "skipped": False, "cached": True})
        else:
            for out in stage.outs:
                (folder / out).parent.mkdir(parents=True, exist_ok=True)
            print(f"[{index + 1}/{len(stages)}] {stage.name}", flush=True)
            start = time.perf_counter()
            log = folder / "logs" / f"{stage.name}.log"
            with open(log, "w") as fh:
                proc = subprocess.run(cmd, shell=True, cwd=folder, env=env, stdout=fh, stderr=subprocess.STDOUT)
            seconds = time.perf_counter() - start
            if proc.returncode != 0:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
                raise RuntimeError(f"stage {stage.name} failed (exit {proc.returncode}); log {log}:\n{tail}")
            if key is not None:
                _store(cache, key, folder, stage)
            atomic_write_text(marker, json.dumps({"seconds": seconds}))
            records.append({"stage": stage.name, "seconds": seconds, "skipped": False, "cached": False})
        if stage.name == until:
            break
    atomic_write_text(folder / "stages.json", json.dumps(records, indent=2))
    return records


def finished(folder: Path) -> bool:
    """Whether every stage of the run folder's pipeline (its own ``dvc.yaml`` and ``params.yaml``) has its marker. A
    finished folder is skipped as a whole, so one restored without its datasets and adapters (an archive of results)
    still counts; an unfinished one needs its earlier stages' outputs to resume."""
    if not (folder / "params.yaml").is_file() or not (folder / "dvc.yaml").is_file():
        return False
    params = yaml.safe_load((folder / "params.yaml").read_text()) or {}
    return all((folder / ".done" / stage.name).exists() for stage in load_stages(folder / "dvc.yaml", params))


def folder_record(name: str, folder: Path) -> dict[str, Any]:
    """A run folder as ``env-engineer compare`` reads a DVC experiment: name, params and every stage's metrics."""
    params = yaml.safe_load((folder / "params.yaml").read_text()) or {}
    metrics = {str(p.relative_to(folder)): json.loads(p.read_text())
               for p in sorted(folder.glob("data/stages/*/*metrics.json"))}
    return {"name": name, "params": params, "metrics": metrics}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--folder", type=Path, required=True, help="run folder (created; rerun it to resume)")
    parser.add_argument("--repo", type=Path, default=Path("."), help="where dvc.yaml and params.yaml are (default: here)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a parameter (as `dvc exp run -S`), e.g. --set engineer.engineer=random")
    parser.add_argument("--no-validate", action="store_true", help="skip the great-expectations checks (machines without it)")
    parser.add_argument("--until", default=None, help="stop after this stage (e.g. train@0)")
    parser.add_argument("--cache", type=Path, default=None, help="reuse outputs of identical stages run before with "
                        "this cache folder (command, dependency contents and declared parameters all equal)")


def run(args: argparse.Namespace) -> int:
    from tasks.tools import parse_overrides

    try:
        records = run_stages(args.repo.resolve(), args.folder.resolve(), parse_overrides(args.set),
                             validate=not args.no_validate, until=args.until,
                             cache=args.cache.resolve() if args.cache else None)
    except (ValueError, KeyError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ran = [r for r in records if not r["skipped"] and not r["cached"]]
    cached = sum(r["cached"] for r in records)
    print(f"{len(ran)} stages ran ({sum(r['seconds'] for r in ran):.0f} s), {cached} reused from the cache, "
          f"{len(records) - len(ran) - cached} were done before")
    return 0
