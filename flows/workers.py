"""``env-engineer workers``: one Prefect worker per GPU, each pinned to its GPU, all serving one process work pool.

    env-engineer workers --pool gpu-pool --gpus 0,1,2,3 [--slots 1]

starts ``prefect worker start --pool POOL --name POOL-gpu-I --limit SLOTS`` once per GPU ``I`` with
``CUDA_VISIBLE_DEVICES=I`` in its environment; a process worker runs each flow run as a subprocess of its own
environment, so every stage of an experiment it runs (``dvc exp run --temp``, one process per stage) sees that GPU
alone. ``--slots k`` lets a worker run k flow runs at once (small models share a card well). Any worker takes any
scheduled run of the pool, so N GPUs work through a queue of experiments N (x k) at a time; ``env-engineer compare
--via prefect`` fills that queue. The workers stop together on Ctrl-C (or SIGTERM), and if one of them exits.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_gpus(text: str) -> list[str]:
    gpus = [g.strip() for g in text.split(",") if g.strip()]
    if not gpus or not all(g.isdigit() for g in gpus):
        raise ValueError(f"--gpus {text!r}: give GPU indices separated by commas, e.g. 0,1")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus {text!r}: each GPU once (use --slots to run several experiments on one GPU)")
    return gpus


def worker_commands(pool: str, gpus: list[str], slots: int, repo: Path) -> list[tuple[dict[str, str], list[str]]]:
    """``(environment, argv)`` of each GPU's worker."""
    if slots < 1:
        raise ValueError(f"--slots {slots}: at least 1 flow run per worker")
    prefect = str(Path(sys.executable).with_name("prefect"))
    out = []
    for gpu in gpus:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu, "ENV_ENGINEER_REPO": str(repo)}
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
        procs.append(subprocess.Popen(argv, env=env))
        print(f"worker {argv[argv.index('--name') + 1]} (CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}, "
              f"pid {procs[-1].pid})", flush=True)

    def stop(*_: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.terminate()

    signal.signal(signal.SIGTERM, stop)
    try:
        while all(p.poll() is None for p in procs):
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    stop()
    codes = [p.wait(timeout=60) for p in procs]
    return 0 if all(c in (0, -signal.SIGTERM, -signal.SIGINT) for c in codes) else 1
