"""Process pools whose workers end with the process that started them: a step killed outright (SIGKILL, the machine's
out-of-memory killer) leaves no worker behind, running on or blocked for ever on a queue nobody reads."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ProcessPoolExecutor


def _end_with(parent: int) -> None:
    """Pool initializer: have the kernel send SIGTERM to this worker when its parent ends (Linux's
    ``PR_SET_PDEATHSIG``), and end now if the parent already has. Elsewhere a no-op."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent ended before the call above
        os._exit(1)


def worker_pool(max_workers: int) -> ProcessPoolExecutor:
    """A process pool of ``max_workers`` whose workers end with this process."""
    return ProcessPoolExecutor(max_workers=max_workers, initializer=_end_with, initargs=(os.getpid(),))
