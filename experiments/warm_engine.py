"""One warm generation engine (``env-engineer compare --run --serve KIND``) and warm trainers (``--warm-trainers N``)
for every experiment of a study.

Without it each ``validate@k`` and ``evaluate@k`` of every experiment loads the model (and, on a GPU, compiles its
decode step) in a process of its own. With it the study starts one OpenAI-compatible server before its first stage,
points every experiment's rollouts at it (``rollout.backend: openai``; each stage's adapter is loaded into the server
at runtime under its content hash and folder, :mod:`policy.openai_backend`) and stops it when the study ends, however
it ends.

Servers (:data:`SERVERS`): ``vllm`` (``vllm serve`` with runtime LoRA loading, this Python environment's or else
PATH's) batches the requests of all experiments on one GPU; ``env-engineer`` (``env-engineer serve --adapters-from
REPO``) answers them one at a time with the transformers backend, on any machine. The server's output goes to a log
file, whose end is quoted when the server exits by itself or does not come up.

Warm trainers (:class:`WarmTrainer`): ``env-engineer train-server`` with N worker processes
(:func:`steps.train.run_server`), to which every experiment's ``train`` step hands its stage (``train.server``), so that
no stage pays for a training process's start-up, model load and compilation. They take the GPUs of ``ENV_ENGINEER_GPUS`` in turn and hold no slot of
it: size ``ENV_ENGINEER_GPU_SLOTS`` for what else trains beside them (nothing, with ``--serve`` too, once the
workspace's shared stages are done).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
"""The LoRA ranks vLLM's ``--max-lora-rank`` accepts."""


SETS = ("rollout.backend", "rollout.base_url", "rollout.api_key_env", "rollout.concurrency")
"""The settings a warm engine gives every experiment (:meth:`WarmEngine.overrides`)."""


class WarmEngineError(RuntimeError):
    """The server did not start or did not come up in time; the message quotes its log."""


@dataclass(frozen=True)
class WarmEngine:
    """A generation server for one study. ``model``: ``policy.model`` (requests name it; the server is told to serve
    it under that name); ``folder``: where its weights are; ``lora_rank``: the largest adapter rank it must take;
    ``adapters``: adapters it keeps ready at once (about the experiments running at once); ``gpu_memory``: vLLM's
    share of the GPU (the rest is the experiments' training); ``kv_cache_gib``: vLLM's KV cache, a fixed size (None:
    vLLM sizes it from ``gpu_memory`` by profiling the card, which counts whatever else starts on the card meanwhile
    as its own use); ``options``: more words for the server's command line, after the ones made here (a later option
    of the same name wins in vLLM's parser); ``start_s``: how long it may take to come up."""

    kind: str
    model: str
    folder: Path
    repo: Path
    log: Path
    lora_rank: int = 64
    adapters: int = 8
    gpu_memory: float = 0.3
    kv_cache_gib: float | None = 8.0
    port: int = 8000
    concurrency: int = 256
    options: tuple[str, ...] = ()
    start_s: float = 600.0

    label = "warm engine"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def option(self) -> str:
        return f"--serve {self.kind}"

    def command(self) -> list[str]:
        """The server's command line: the server's own words, then ``options``."""
        return [*SERVERS[self.kind][1](self), *self.options]

    def overrides(self) -> dict[str, Any]:
        """The settings every experiment runs with so that its rollouts are answered by this server."""
        return dict(zip(SETS, ("openai", self.base_url, None, self.concurrency)))

    def environment(self) -> dict[str, str]:
        """What the server's environment adds to this process's. vLLM: adapters loaded at runtime, and one torch
        thread on the CPU (``OMP_NUM_THREADS=1``) unless the environment sets another count. vLLM sets the same for
        its own workers when it starts several; started for one GPU it leaves torch's threads at one per core, and
        its engine then took several cores that the experiments' steps were waiting for (the lab note's eighth
        one-GPU comparison attempt)."""
        if self.kind != "vllm":
            return {}
        return {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


TRAIN_SETS = ("train.server",)
"""The settings warm trainers give every experiment (:meth:`WarmTrainer.overrides`)."""


@dataclass(frozen=True)
class WarmTrainer:
    """``workers`` warm training processes for one study (``env-engineer train-server``), writing under ``repo``."""

    workers: int
    repo: Path
    log: Path
    port: int = 8100
    start_s: float = 600.0
    kind = "train-server"
    label = "warm trainers"
    option = "--warm-trainers"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "env_engineer", "train-server", "--root", str(self.repo.resolve()),
                "--workers", str(self.workers), "--host", "127.0.0.1", "--port", str(self.port)]

    def overrides(self) -> dict[str, Any]:
        """The settings every experiment runs with so that its stages are trained by these processes."""
        return {"train.server": self.base_url}

    def environment(self) -> dict[str, str]:
        """Nothing added: each worker sets its own share of the cores (``env-engineer train-server``)."""
        return {}


def vllm_program() -> list[str]:
    """How to run vLLM's command line: this Python's vLLM as a module where it imports (a pip install, or a copy
    unpacked into the path on a machine without a registry, which has no ``vllm`` script; vLLM's engine starts its
    processes by spawning, so the module's own ``__main__`` guard is what keeps them from running the server again),
    else the ``vllm`` on PATH."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    return ["vllm"]


def _vllm(engine: WarmEngine) -> list[str]:
    rank = next((r for r in VLLM_LORA_RANKS if r >= engine.lora_rank), engine.lora_rank)
    kv_cache = ([] if engine.kv_cache_gib is None
                else ["--kv-cache-memory-bytes", str(int(engine.kv_cache_gib * 2 ** 30))])
    return [*vllm_program(), "serve", str(engine.folder),
            "--served-model-name", engine.model, "--enable-lora", "--max-lora-rank", str(rank),
            "--max-loras", str(engine.adapters),
            "--gpu-memory-utilization", str(engine.gpu_memory), *kv_cache,
            "--host", "127.0.0.1", "--port", str(engine.port),
            "--disable-uvicorn-access-log"]  # a line per request of every experiment otherwise


def _env_engineer(engine: WarmEngine) -> list[str]:
    return [sys.executable, "-m", "env_engineer", "serve", "--model", engine.model, "--served-name", engine.model,
            "--adapters-from", str(engine.repo.resolve()), "--max-adapters", str(engine.adapters),
            "--host", "127.0.0.1", "--port", str(engine.port)]


SERVERS: dict[str, tuple[str, Callable[[WarmEngine], list[str]]]] = {
    "vllm": ("vLLM's OpenAI-compatible server on a GPU, adapters loaded at runtime (requests of all experiments "
             "batched together)", _vllm),
    "env-engineer": ("`env-engineer serve --adapters-from REPO` (transformers backend, one request at a time; any "
                     "machine)", _env_engineer),
}
"""Warm servers by name: a sentence for the help text and the command line."""


def port_free(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:``port`` (a server already there would answer in this one's place)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _tail(path: Path, size: int = 2000) -> str:
    """The last ``size`` bytes of the server's log (which grows with the study), as text."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - size))
            return f.read().decode(errors="replace")
    except OSError:
        return "(no log)"


class Serving:
    """``with Serving(engine) as ready:`` starts the server; ``ready()`` waits until it answers (so the study's first
    stages, which need no server, run while it starts); leaving the block stops it (SIGTERM, then SIGKILL). A server
    that exits by itself is reported at once, with the end of its log (the study stops at ``ready()`` when it had not
    answered yet; rollouts after it fail when it had)."""

    def __init__(self, engine: WarmEngine, poll_s: float = 1.0) -> None:
        self.engine, self.poll_s = engine, poll_s
        self.process: subprocess.Popen | None = None
        self.began = 0.0
        self.answered = False
        self._stopping = threading.Event()
        self._watch: threading.Thread | None = None

    def __enter__(self) -> Callable[[], float]:
        e = self.engine
        if not port_free(e.port):
            raise WarmEngineError(f"{e.option}: port {e.port}: something already listens there; stop it or give "
                                  "another port")
        e.log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **e.environment()}
        with open(e.log, "ab") as log:
            try:
                self.process = subprocess.Popen(e.command(), stdout=log, stderr=subprocess.STDOUT, cwd=e.repo, env=env,
                                                start_new_session=True)
            except OSError as err:
                raise WarmEngineError(f"{e.option}: could not start `{e.command()[0]}` ({err}); "
                                      + ("install vLLM (the gpu extra)" if e.kind == "vllm" else "")) from None
        self.began = time.monotonic()
        self._watch = threading.Thread(target=self._watch_exit, daemon=True)
        self._watch.start()
        print(f"{time.strftime('%H:%M:%S')} {e.label}: {e.kind} starting on {e.base_url} (log {e.log})", flush=True)
        return self.ready

    def _watch_exit(self) -> None:
        code = self.process.wait()
        if not self._stopping.is_set():
            when = "during the study" if self.answered else "before it answered"
            print(f"warning: the {self.engine.label} exited ({code}) {when}; the end of {self.engine.log}:\n"
                  f"{_tail(self.engine.log)}", file=sys.stderr, flush=True)

    def ready(self) -> float:
        """Wait until the server answers ``/health``; the seconds since it was started."""
        e, process = self.engine, self.process
        health = e.base_url.removesuffix("/v1") + "/health"
        while True:
            if process is not None and process.poll() is not None:
                if self._watch is not None:
                    self._watch.join(timeout=10)
                raise WarmEngineError(f"{e.option}: the server exited ({process.returncode}) before it answered "
                                      f"(the end of its log is above; all of it in {e.log})")
            try:
                with urllib.request.urlopen(health, timeout=5) as r:
                    if r.status == 200:
                        self.answered = True
                        waited = time.monotonic() - self.began
                        print(f"{time.strftime('%H:%M:%S')} {e.label}: up after {waited:.0f} s", flush=True)
                        return waited
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - self.began > e.start_s:
                raise WarmEngineError(f"{e.option}: no answer on {health} within {e.start_s:.0f} s "
                                      f"(--serve-start-s); the end of {e.log}:\n{_tail(e.log)}")
            time.sleep(self.poll_s)

    def __exit__(self, *exc: object) -> None:
        process = self.process
        if process is None:
            return
        self._stopping.set()  # from here on, its end is the study's doing
        if process.poll() is None:
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(process.pid, sig)
                    process.wait(timeout=wait)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._watch is not None:
            self._watch.join(timeout=10)  # its report, if the server ended by itself, is out before the study's


def kv_cache_size(text: str) -> float | None:
    """``--serve-kv-cache-gib``'s value: GiB, or None for 'auto' (vLLM sizes it by profiling)."""
    if text.strip().lower() == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a size in GiB (e.g. 4) or auto") from None


def server_options(text: str) -> tuple[str, ...]:
    """``--serve-options``' value: the words of a command line (shell quoting), the first of them an option."""
    import shlex

    try:
        words = tuple(shlex.split(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: {err}; quote it as a shell would") from None
    if words and not words[0].startswith("-"):
        raise argparse.ArgumentTypeError(f"{text!r}: give the server's options, starting with '-' "
                                         "(e.g. '--max-num-seqs 512')")
    return words


def add_arguments(parser: Any) -> None:
    """``--serve`` and its settings, for the commands that run studies (``compare``, ``sensitivity``)."""
    parser.add_argument("--serve", choices=sorted(SERVERS), default=None,
                        help="with --run: answer every experiment's rollouts with one warm server started for the "
                             "study and stopped after it: " + "; ".join(f"'{k}': {v[0]}" for k, v in SERVERS.items()))
    parser.add_argument("--serve-port", type=int, default=WarmEngine.port,
                        help="the warm server's port on 127.0.0.1 (default %(default)s)")
    parser.add_argument("--serve-gpu-memory", type=float, default=WarmEngine.gpu_memory,
                        help="vllm: the share of the GPU's memory the server may take, which vLLM checks is free when "
                             "it starts; the experiments' training passes share the rest (default %(default)s)")
    parser.add_argument("--serve-kv-cache-gib", type=kv_cache_size, default=WarmEngine.kv_cache_gib, metavar="GIB",
                        help="vllm: its KV cache in GiB, a fixed size, so that the training processes starting on the "
                             "same card while vLLM measures its memory cannot leave it none; 'auto': vLLM sizes it "
                             "from --serve-gpu-memory by profiling the card, right only when nothing else starts on "
                             "it meanwhile (default %(default)s)")
    parser.add_argument("--serve-options", type=server_options, default=WarmEngine.options, metavar="WORDS",
                        help="more options for the server's command line, after the ones the study gives it (the "
                             "last of the same name wins), e.g. --serve-options '--max-num-seqs 512', or "
                             "--serve-options=--enforce-eager for one word (default none)")
    parser.add_argument("--serve-concurrency", type=int, default=WarmEngine.concurrency,
                        help="requests each rollout keeps in flight (rollout.concurrency; default %(default)s)")
    parser.add_argument("--serve-start-s", type=float, default=WarmEngine.start_s,
                        help="how long a warm server may take to answer before the study stops (default %(default)s)")
    parser.add_argument("--warm-trainers", type=int, default=0, metavar="N",
                        help="with --run: train every experiment's stages in N warm processes (`env-engineer "
                             "train-server`; they take the GPUs of ENV_ENGINEER_GPUS in turn) started for the study and "
                             "stopped after it, instead of a new process per stage (default 0: a process per stage)")
    parser.add_argument("--warm-trainers-port", type=int, default=8100,
                        help="the warm trainers' port on 127.0.0.1 (default %(default)s)")


def from_arguments(args: Any, params: Any, extra: dict[str, Any], log: Path) -> WarmEngine | None:
    """The warm engine ``--serve`` asks for (None without it), checked: it runs with ``--run`` only, its port is a
    port, and no ``--set`` gives the rollout settings it sets."""
    if args.serve is None:
        return None
    problems = []
    if not args.run:
        problems.append("--serve needs --run (it serves the experiments this command runs)")
    if not 1 <= args.serve_port <= 65535:
        problems.append(f"--serve-port {args.serve_port}: give a port from 1 to 65535")
    if not 0 < args.serve_gpu_memory < 1:
        problems.append(f"--serve-gpu-memory {args.serve_gpu_memory}: give a share between 0 and 1")
    if args.serve_kv_cache_gib is not None and not args.serve_kv_cache_gib > 0:
        problems.append(f"--serve-kv-cache-gib {args.serve_kv_cache_gib}: give a positive size in GiB, or auto")
    if not 1 <= args.serve_concurrency <= 4096:
        problems.append(f"--serve-concurrency {args.serve_concurrency}: give 1 to 4096")
    if not args.serve_start_s > 0:
        problems.append(f"--serve-start-s {args.serve_start_s}: give a positive number of seconds")
    clash = [key for key in SETS if key in extra]
    if clash:
        problems.append(f"--serve sets {', '.join(clash)} itself; leave out --set {clash[0]}=...")
    if problems:
        raise ValueError("; ".join(problems))
    from policy.models import resolve_model

    folder = resolve_model(params.policy.model) if args.serve == "vllm" else Path(params.policy.model)
    return WarmEngine(args.serve, params.policy.model, folder, args.repo, log,
                      lora_rank=max(params.train.lora_r, params.start.train.lora_r), adapters=max(1, args.jobs),
                      gpu_memory=args.serve_gpu_memory, kv_cache_gib=args.serve_kv_cache_gib, port=args.serve_port,
                      concurrency=args.serve_concurrency, options=args.serve_options, start_s=args.serve_start_s)


def trainer_from_arguments(args: Any, extra: dict[str, Any], log: Path) -> WarmTrainer | None:
    """The warm trainers ``--warm-trainers N`` asks for (None for 0), checked: with ``--run`` only, a port that is a
    port and not the generation engine's, and no ``--set`` of the setting they give."""
    if not args.warm_trainers:
        return None
    problems = []
    if not args.run:
        problems.append("--warm-trainers needs --run (they train the experiments this command runs)")
    if not 1 <= args.warm_trainers <= 64:
        problems.append(f"--warm-trainers {args.warm_trainers}: give 1 to 64 processes")
    if not 1 <= args.warm_trainers_port <= 65535 or (args.serve and args.warm_trainers_port == args.serve_port):
        problems.append(f"--warm-trainers-port {args.warm_trainers_port}: give a port from 1 to 65535 other than "
                        "--serve-port's")
    clash = [key for key in TRAIN_SETS if key in extra]
    if clash:
        problems.append(f"--warm-trainers sets {clash[0]} itself; leave out --set {clash[0]}=...")
    if problems:
        raise ValueError("; ".join(problems))
    return WarmTrainer(args.warm_trainers, args.repo, log, args.warm_trainers_port, args.serve_start_s)


@contextlib.contextmanager
def serving(*servers: WarmEngine | WarmTrainer | None) -> Iterator[Callable[[], float] | None]:
    """``with serving(engine, trainer) as ready:``: :class:`Serving` for each server given (None skipped);
    ``ready()`` waits until every one answers and returns the seconds the last took. Nothing given: ``ready`` is
    None."""
    with contextlib.ExitStack() as stack:
        readies = [stack.enter_context(Serving(s)) for s in servers if s is not None]
        yield (lambda: max(ready() for ready in readies)) if readies else None
