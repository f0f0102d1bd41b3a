"""Process pools whose workers end with the process that started them: a step killed outright (SIGKILL, the machine's
out-of-memory killer) leaves no worker behind, running on or blocked for ever on a queue nobody reads. And the share
of the machine's cores that each of several processes running at once may use (:func:`cpu_share`)."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ProcessPoolExecutor


def end_with_parent(parent: int | None = None) -> None:
    """Have the kernel send SIGTERM to this process when its parent ends, however it ends (Linux's
    ``PR_SET_PDEATHSIG``), and end now if the parent already has. ``parent``: the parent's pid as the parent saw it
    (by default :mod:`multiprocessing`'s parent of this process). Elsewhere a no-op. A pool initializer, or the first
    call of one."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent is None:
        import multiprocessing

        known = multiprocessing.parent_process()
        parent = known.pid if known is not None else os.getppid()
    if os.getppid() != parent:  # the parent ended before the call above
        os._exit(1)


def worker_pool(max_workers: int) -> ProcessPoolExecutor:
    """A process pool of ``max_workers`` whose workers end with this process."""
    return ProcessPoolExecutor(max_workers=max_workers, initializer=end_with_parent, initargs=(os.getpid(),))


CPU_THREAD_VARIABLES = ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS", "POLARS_MAX_THREADS")
"""What sizes a process's CPU threads: torch's intra-op threads, the pool of compile workers that ``torch.compile``
starts at its first compilation (``min(32, cores)`` processes, cached graphs or not), and polars' thread pool."""


def cpu_share(processes: int, cores: int | None = None) -> dict[str, str]:
    """The environment that gives each of ``processes`` running at once an equal share of ``cores`` (this process's
    usable cores by default), at least one thread each: every variable of :data:`CPU_THREAD_VARIABLES` that the
    environment does not set already (a value set there is kept, so a user can choose). Empty for one process.

    Without it every process sizes its pools to the whole machine, so 24 experiments on 16 cores run hundreds of
    threads and, at every training stage, one compile worker per core for each training process. ``torchrun`` sets
    ``OMP_NUM_THREADS=1`` for the same reason when it starts several processes."""
    if processes < 1:
        raise ValueError(f"processes = {processes}: at least 1")
    if processes == 1:
        return {}
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = str(max(1, cores // processes))
    return {name: os.environ.get(name, share) for name in CPU_THREAD_VARIABLES}
