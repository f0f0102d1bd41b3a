"""Which GPU a step's process uses when several experiments run at once.

Without ``ENV_ENGINEER_GPUS`` a process uses the GPUs its environment gives it (``CUDA_VISIBLE_DEVICES``), and where it
sees several and is not one process of a distributed launch (``WORLD_SIZE``), :func:`claim_gpu` keeps only the first
visible: a step runs one model per process (transformers' Trainer would otherwise wrap it in ``nn.DataParallel``, which
TRL refuses); several GPUs serve one step through ``accelerate launch`` (``steps/train.py``). With ``ENV_ENGINEER_GPUS`` set to a pool of GPU indices (``0,1,2,3``), :func:`claim_gpu` takes one
GPU of the pool for the rest of the process: the first whose lock file it can lock (``fcntl.flock``, so a process that
dies frees its GPU at once), waiting while every GPU is taken, and points ``CUDA_VISIBLE_DEVICES`` at it before CUDA
starts. ``ENV_ENGINEER_GPU_SLOTS=k`` lets k processes share each GPU (small models fill a fraction of a card).

So ``dvc queue start -j 4`` with ``ENV_ENGINEER_GPUS=0,1,2,3`` gives each of four experiments' running stages a GPU of
its own, and ``ENV_ENGINEER_GPUS=0 ENV_ENGINEER_GPU_SLOTS=4`` lets four share one. The lock files live in
``ENV_ENGINEER_GPU_LOCKS`` (default: a folder under the system's temporary folder).

A slot is held from the claim until the process ends, so :func:`claim_gpu_after` lets a step import its libraries (the
seconds of start-up of torch, transformers, PEFT and TRL) before it waits for a slot, where that cannot change which
GPU the process uses: a pool of one GPU.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from typing import IO

_held: IO[str] | None = None
_claimed: str | None = None


def _pool() -> list[str]:
    text = os.environ.get("ENV_ENGINEER_GPUS", "").strip()
    gpus = [g.strip() for g in text.split(",") if g.strip()]
    bad = [g for g in gpus if not g.isdigit()]
    if bad:
        raise ValueError(f"ENV_ENGINEER_GPUS={text!r}: give GPU indices separated by commas, e.g. 0,1,2,3")
    return gpus


def _slots() -> int:
    text = os.environ.get("ENV_ENGINEER_GPU_SLOTS", "1")
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"ENV_ENGINEER_GPU_SLOTS={text!r}: give a whole number of processes per GPU, at least 1")
    return int(text)


def gpu_pool() -> list[str]:
    """The GPU indices of ``ENV_ENGINEER_GPUS`` (empty without a pool)."""
    return _pool()


def world_size() -> int:
    """Processes of a distributed launch (``accelerate launch`` / ``torchrun`` set ``WORLD_SIZE``); 1 otherwise."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def only_the_first_gpu() -> str | None:
    """Where this process sees several GPUs and is not part of a distributed launch, make only the first visible (before
    CUDA starts: the count comes from NVML); returns the GPU kept, or None when nothing changed."""
    if world_size() != 1:
        return None
    listed = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        import torch

        listed = [str(i) for i in range(torch.cuda.device_count())]
    if len(listed) < 2:
        return None
    os.environ["CUDA_VISIBLE_DEVICES"] = listed[0]
    print(f"using GPU {listed[0]} of {','.join(listed)} (one per process; several serve one step through "
          "`accelerate launch`, or give ENV_ENGINEER_GPUS a pool)", file=sys.stderr, flush=True)
    return listed[0]


def lock_folder() -> Path:
    return Path(os.environ.get("ENV_ENGINEER_GPU_LOCKS") or Path(tempfile.gettempdir()) / "env-engineer-gpus")


def claim_gpu(poll_seconds: float = 2.0, timeout_seconds: float | None = None) -> str | None:
    """Claim a GPU of the ``ENV_ENGINEER_GPUS`` pool for this process and make it the only visible one; returns its
    index, or None when no pool is set. Call it before anything starts CUDA. Claiming twice returns the first claim."""
    import fcntl

    global _held, _claimed
    if _claimed is not None:
        return _claimed
    pool = _pool()
    if not pool:
        only_the_first_gpu()
        return None
    slots = _slots()
    folder = lock_folder()
    folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    said = False
    while True:
        for slot in range(slots):  # slot-major: the first processes spread over the GPUs, one each
            for gpu in pool:
                handle = open(folder / f"gpu-{gpu}-{slot}.lock", "a+")
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    handle.close()
                    continue
                _held, _claimed = handle, gpu
                os.environ["CUDA_VISIBLE_DEVICES"] = gpu
                return gpu
        if timeout_seconds is not None and time.monotonic() - started > timeout_seconds:
            raise TimeoutError(f"no GPU of ENV_ENGINEER_GPUS={','.join(pool)} came free within {timeout_seconds} s")
        if not said:
            print(f"waiting for a free GPU of ENV_ENGINEER_GPUS={','.join(pool)} ({slots} process(es) each)",
                  file=sys.stderr, flush=True)
            said = True
        time.sleep(poll_seconds)


def claim_gpu_after(prepare: Callable[[], object], poll_seconds: float = 2.0) -> str | None:
    """:func:`claim_gpu`, with ``prepare`` (imports, say) run first where it cannot change the GPU this process gets:
    when the ``ENV_ENGINEER_GPUS`` pool is one GPU, that GPU is made the only visible one before ``prepare`` runs (so
    anything in it that starts CUDA starts it there), and the slot is waited for after. With a pool of several GPUs,
    which one is free is known only at the claim, so the claim comes first; without a pool ``prepare`` runs after it."""
    pool = _pool()
    if len(pool) == 1 and _claimed is None:
        os.environ["CUDA_VISIBLE_DEVICES"] = pool[0]
        prepare()
        return claim_gpu(poll_seconds)
    claimed = claim_gpu(poll_seconds)
    prepare()
    return claimed
