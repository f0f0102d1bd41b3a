"""Warm worker processes behind a small HTTP server: what ``env-engineer train-server`` runs (``steps/train.py`` gives
the job and its check), so that every experiment's stages are trained in processes started once.

A job is posted as JSON (``POST /jobs``); the server checks it with the caller's ``parse`` (which names a bad field:
:class:`policy.serve.RequestError`), hands it to one of ``count`` worker processes (started with ``spawn``, each
running the caller's ``initializer`` once: imports, its GPU) and answers with the job's result when it ends.

The workers take the GPUs of the ``ENV_ENGINEER_GPUS`` pool in turn (the k-th worker started the k-th GPU, round the
pool; they hold no slot of it, as a generation server holds none, so steps that claim slots never wait for them), or the
first visible GPU without a pool.

Limits (:class:`JobLimits`): the body's size; jobs beyond the workers plus ``max_waiting`` get 429; a job that has not
ended ``timeout_s`` after it arrived gets 504; a client gets ``read_timeout_s`` to send its request. Without an API
key it answers requests addressed to this machine only (a web page cannot reach it by DNS rebinding). ``GET /health``:
workers, jobs running or waiting, jobs done. A job that raises gets 500 with its error in one line; a worker that dies
(killed for memory, say) is replaced, and its job gets 500.
"""

import asyncio
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any


class WorkerServiceError(RuntimeError):
    """The server did not answer, or refused or failed the job; the message says which."""


def post_job(url: str, body: bytes, what: str) -> Any:
    """Post a job (JSON ``body``) to the server at ``url`` and wait for its result (the server bounds the wait);
    ``what`` names the setting that gave ``url``, for the messages."""
    request = urllib.request.Request(url.rstrip("/") + "/jobs", data=body, headers={"Content-Type": "application/json"},
                                     method="POST")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the server is this machine's
    try:
        with opener.open(request) as response:
            return json.loads(response.read())["result"]
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {e.code}"
        raise WorkerServiceError(f"{what} {url}: {message}") from None
    except (urllib.error.URLError, OSError) as e:
        raise WorkerServiceError(f"{what} {url}: no answer ({getattr(e, 'reason', e)})") from None


def start_worker(initializer: Callable[[], None], threads: dict[str, str], started: Any) -> None:
    """A worker's start: its share of the cores (``threads``: environment variables), its GPU, then ``initializer``."""
    os.environ.update(threads)
    from policy.devices import gpu_pool, only_the_first_gpu

    with started.get_lock():
        index = started.value
        started.value += 1
    pool = gpu_pool()
    if pool:
        os.environ["CUDA_VISIBLE_DEVICES"] = pool[index % len(pool)]
    else:
        only_the_first_gpu()
    initializer()


class Workers:
    """``count`` warm processes, all started at once; a pool broken by a dead worker is replaced by a new one."""

    def __init__(self, count: int, initializer: Callable[[], None], threads: dict[str, str] | None = None) -> None:
        import multiprocessing

        self.count = count
        self._context = multiprocessing.get_context("spawn")  # CUDA does not survive a fork
        self._args = (initializer, threads or {}, self._context.Value("i", 0))
        self._lock = threading.Lock()
        self.pool = self._new()
        self.running = 0
        self.done = 0

    def _new(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(self.count, mp_context=self._context, initializer=start_worker, initargs=self._args)
        for _ in range(self.count):  # every worker started (and warmed) now, not at the first jobs
            pool.submit(os.getpid)
        return pool

    def replace(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self.pool is broken:
                self.pool = self._new()
                broken.shutdown(wait=False, cancel_futures=True)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class JobLimits:
    """What a job may ask and how long it may take.

    Attributes:
        max_body_bytes: largest request body read.
        max_waiting: jobs that may wait for a worker beyond those running; more get 429.
        timeout_s: longest a job may take from its arrival (waiting included); its client then gets 504.
        read_timeout_s: longest a client may take to send its request.
    """

    max_body_bytes: int = 200_000
    max_waiting: int = 256
    timeout_s: float = 3600.0
    read_timeout_s: float = 30.0


def make_app(workers: Workers, parse: Callable[[bytes], Any], run: Callable[[Any], Any],
             describe: Callable[[Any, Any], str],
             limits: JobLimits = JobLimits(), host: str = "127.0.0.1", title: str = "env-engineer workers") -> Any:
    """The FastAPI application: ``parse`` checks a body (raising :class:`policy.serve.RequestError`), ``run`` (a
    module-level function, so that it reaches a worker) runs what it returned in a worker, ``describe`` says in the
    server's log what a job was and what it returned (the line adds how long it took from its arrival, its wait for a
    worker included)."""
    from fastapi import FastAPI, Request
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from policy.serve import LOOPBACK_NAMES, RequestError, _error, read_limited_body

    app = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)
    hosts = LOOPBACK_NAMES | ({host} if host not in ("0.0.0.0", "::", "") else set())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Any:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> Any:  # a bug, said in one line
        return _error(500, f"internal error: {type(exc).__name__}: {str(exc)[:200]}", "server_error")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "workers": workers.count, "jobs": workers.running, "done": workers.done}

    @app.post("/jobs")
    async def jobs(request: Request) -> Any:
        name = request.headers.get("host", "").rsplit(":", 1)[0].strip("[]").lower()
        if name not in hosts:
            return _error(401, "this server answers requests addressed to this machine only", "authentication_error")
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            return _error(415, "send the job as Content-Type: application/json")
        try:
            job = parse(await read_limited_body(request, limits.max_body_bytes, limits.read_timeout_s))
        except RequestError as e:
            return _error(e.status, str(e), "invalid_request_error", e.param)
        if workers.running >= workers.count + limits.max_waiting:
            return _error(429, f"{workers.running} jobs are running or waiting; retry later", "rate_limit_error",
                          headers={"Retry-After": "10"})
        pool = workers.pool
        began = time.monotonic()
        workers.running += 1
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(pool.submit(run, job)), timeout=limits.timeout_s)
        except TimeoutError:
            return _error(504, f"the job did not end within {limits.timeout_s:g} s (--timeout)", "server_error")
        except BrokenProcessPool:
            workers.replace(pool)
            return _error(500, "the worker running this job died (out of memory?); new workers are starting: run it "
                          "again", "server_error")
        except Exception as e:  # noqa: BLE001 - the job's own error, said in one line to the client that asked
            return _error(500, f"the job failed: {type(e).__name__}: {str(e)[:500]}", "server_error")
        finally:
            workers.running -= 1
        workers.done += 1
        print(f"{time.strftime('%H:%M:%S')} {describe(job, result)} in {time.monotonic() - began:.1f} s "
              f"({workers.running} running or waiting)", flush=True)
        return {"result": json.loads(json.dumps(result, default=str))}

    return app
