"""``env-engineer workers``: one Prefect worker per GPU, each pinned to its GPU, all serving one process work pool.

    env-engineer workers --pool gpu-pool --gpus 0,1,2,3 [--slots 1]

starts ``prefect worker start --pool POOL --name POOL-gpu-I --limit SLOTS`` once per GPU ``I`` with
``CUDA_VISIBLE_DEVICES=I`` in its environment; a process worker runs each flow run as a subprocess of its own
environment, so every stage of an experiment it runs (``dvc exp run --temp``, one process per stage) sees that GPU
alone. ``--slots k`` lets a worker run k flow runs at once (small models share a card well). Any worker takes any
scheduled run of the pool, so N GPUs work through a queue of experiments N (x k) at a time; ``env-engineer compare
--via prefect`` fills that queue. The workers stop together on Ctrl-C (or SIGTERM), and if one of them exits; a
worker still running 20 s later is killed.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.workers import cpu_share

ROOT = Path(__file__).resolve().parents[1]


def parse_gpus(text: str) -> list[str]:
    gpus = [g.strip() for g in text.split(",") if g.strip()]
    if not gpus or not all(g.isdigit() for g in gpus):
        raise ValueError(f"--gpus {text!r}: give GPU indices separated by commas, e.g. 0,1")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus {text!r}: each GPU once (use --slots to run several experiments on one GPU)")
    return gpus


def worker_commands(pool: str, gpus: list[str], slots: int, repo: Path) -> list[tuple[dict[str, str], list[str]]]:
    """``(environment, argv)`` of each GPU's worker; its flow runs get their share of the CPU threads
    (:func:`pipeline.workers.cpu_share` of all workers' runs at once)."""
    if slots < 1:
        raise ValueError(f"--slots {slots}: at least 1 flow run per worker")
    prefect = str(Path(sys.executable).with_name("prefect"))
    out = []
    share = cpu_share(len(gpus) * slots)  # every flow run of every worker at once shares the cores
    for gpu in gpus:
        env = {**os.environ, **share, "CUDA_VISIBLE_DEVICES": gpu, "ENV_ENGINEER_REPO": str(repo)}
        env.pop("ENV_ENGINEER_GPUS", None)  # the worker's GPU is the pin; no pool claims inside it
        argv = [prefect, "worker", "start", "--pool", pool, "--name", f"{pool}-gpu-{gpu}", "--limit", str(slots),
                "--type", "process"]
        out.append((env, argv))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pool", default="gpu-pool", help="the process work pool to serve (prefect.yaml: gpu-pool)")
    parser.add_argument("--gpus", required=True, help="GPU indices, one worker each, e.g. 0,1")
    parser.add_argument("--slots", type=int, default=1, help="flow runs at once per worker (default 1)")
    parser.add_argument("--repo", type=Path, default=ROOT, help="the checkout the flow runs work in (ENV_ENGINEER_REPO)")


def run(args: argparse.Namespace) -> int:
    try:
        commands = worker_commands(args.pool, parse_gpus(args.gpus), args.slots, args.repo.resolve())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    procs = []
    for env, argv in commands:
        # each worker in a session of its own: stopping it reaches the process worker its `prefect` command starts
        procs.append(subprocess.Popen(argv, env=env, start_new_session=True))
        print(f"worker {argv[argv.index('--name') + 1]} (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}, "
              f"pid {procs[-1].pid})", flush=True)

    def signal_all(sig: int) -> None:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    stopping: list[int] = []  # SIGTERM ends the wait below; the workers are then stopped as on Ctrl-C
    signal.signal(signal.SIGTERM, lambda sig, _: stopping.append(sig))
    try:
        while not stopping and all(p.poll() is None for p in procs):
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    return stop_workers(procs, signal_all)


STOP_GRACE_SECONDS = 20.0
"""How long the workers get to shut down after SIGTERM before they are killed."""


def stop_workers(procs: list[subprocess.Popen], signal_all: Any) -> int:
    """SIGTERM to every worker still running, SIGKILL to any that has not exited :data:`STOP_GRACE_SECONDS` later
    (a Prefect worker can take minutes to shut down gracefully); 0 when every worker ended by its stop or cleanly."""
    signal_all(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    if any(p.poll() is None for p in procs):
        print(f"workers still running {STOP_GRACE_SECONDS:.0f} s after SIGTERM: killed", file=sys.stderr, flush=True)
        signal_all(signal.SIGKILL)
    codes = [p.wait() for p in procs]
    return 0 if all(c in (0, -signal.SIGTERM, -signal.SIGINT, -signal.SIGKILL) for c in codes) else 1
