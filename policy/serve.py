"""``env-engineer serve``: an OpenAI-compatible HTTP server for a model (+ LoRA adapter), on FastAPI and uvicorn.

With ``--adapters-from DIR`` clients load adapters under ``DIR`` at runtime (``POST /v1/load_lora_adapter``, vLLM's
endpoint; :mod:`policy.serve_adapters`) and ask for them as their model: one warm server for every rollout.

Endpoints: ``GET /v1/models``, ``GET /health``, ``POST /v1/chat/completions`` (non-streaming; ``messages``, ``n``,
``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, and ``response_format`` with a JSON schema, honoured
by constrained decoding; 400 where the backend cannot constrain, e.g. xgrammar not installed).

Limits (:class:`ServeLimits`, each a command-line option): the request body's size, the prompt's length in tokens, ``n``
and ``max_tokens``; one generation at a time (the model is not thread-safe) with a bounded waiting room: a request that
finds it full gets 429 with ``Retry-After`` at once; a generation stops at the next token when its client leaves or it
passes the time limit (504), so an abandoned request never holds the model. Every invalid field is a 400 with an
OpenAI-style error body naming it. Loopback by default; with ``--api-key-env NAME`` every request must include
``Authorization: Bearer $NAME`` (compared in constant time). The listen backlog is uvicorn's (2048).
"""


import argparse
import asyncio
import hmac
import inspect
import json
import math
import os
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from policy.backends import Backend, ConstrainedDecodingUnavailable, SamplingParams
from policy.serve_adapters import AdapterError, AdapterShelf


@dataclass(frozen=True)
class ServeLimits:
    """What one request may ask, and how long it may wait and take.

    Attributes:
        max_body_bytes: largest request body read.
        max_prompt_tokens: longest prompt (chat template applied), in tokens.
        max_n: most completions per request.
        max_tokens: most new tokens per completion.
        max_waiting: requests that may wait for the model beside the one it serves; more get 429.
        timeout_s: longest a generation may run; its client then gets 504 and the model is freed.
        read_timeout_s: longest a client may take to send its request line and headers, and then its body; the
            connection is closed (headers) or answered 408 (body) after it.
        schema_timeout_s: longest a ``response_format`` schema's grammar may take to compile (outside the model's
            lock, one at a time); the request then gets 400.
        max_schema_nodes: most objects, lists and values a ``response_format`` schema may hold.
    """

    max_body_bytes: int = 1_000_000
    max_prompt_tokens: int = 8192
    max_n: int = 16
    max_tokens: int = 2048
    max_waiting: int = 64
    timeout_s: float = 300.0
    read_timeout_s: float = 30.0
    schema_timeout_s: float = 20.0
    max_schema_nodes: int = 1000


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=1_000_000)


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    schema_: dict[str, Any] = Field(alias="schema")
    name: str | None = None
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class ChatRequest(BaseModel):
    """The fields of a chat-completions request this server reads (others are ignored, as OpenAI clients send them)."""

    model_config = ConfigDict(extra="ignore")

    messages: list[Message] = Field(min_length=1, max_length=512)
    n: int = Field(1, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int = Field(0, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    response_format: ResponseFormat | None = None
    stream: bool = False

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(len(s) > 200 for s in stops):
            raise ValueError("at most 4 stop strings of at most 200 characters")
        return stops


class RequestError(ValueError):
    """A client error: an HTTP status (400 unless said), the field it concerns, and a message."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


def check_schema(schema: dict[str, Any], max_nodes: int = ServeLimits.max_schema_nodes) -> str:
    """The JSON schema as text, if it is one constrained decoding can take: a valid schema, under 50 KB, of at most
    ``max_nodes`` values (a grammar's compilation grows with them: 1,800 empty properties took 39 s), without ``$ref``
    (recursive schemas are not supported) and at most 32 levels deep."""
    import jsonschema

    text = json.dumps(schema)
    if len(text) > 50_000:
        raise RequestError("response_format.json_schema.schema: larger than 50 KB", "response_format")

    count = 0

    def walk(node: Any, depth: int) -> None:
        nonlocal count
        count += 1
        if count > max_nodes:
            raise RequestError(f"response_format.json_schema.schema: more than {max_nodes} values; simplify the schema",
                               "response_format")
        if depth > 32:
            raise RequestError("response_format.json_schema.schema: nested deeper than 32 levels", "response_format")
        if isinstance(node, dict):
            if "$ref" in node or "$dynamicRef" in node:
                raise RequestError("response_format.json_schema.schema: $ref is not supported; write the schema out",
                                   "response_format")
            for value in node.values():
                walk(value, depth + 1)
        elif isinstance(node, list):
            for value in node:
                walk(value, depth + 1)

    walk(schema, 0)
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise RequestError(f"response_format.json_schema.schema is not a JSON schema: {str(e.message)[:200]}",
                           "response_format") from None
    return text


def parse_request(body: Any, limits: ServeLimits = ServeLimits()) -> tuple[list[dict[str, str]], int, SamplingParams]:
    """The conversation, ``n`` and sampling parameters of a request body; :class:`RequestError` for anything wrong."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    try:
        request = ChatRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "body"
        raise RequestError(f"{field}: {err['msg']}", field) from None
    if request.stream:
        raise RequestError("stream: streaming is not supported; send stream: false", "stream")
    if request.n > limits.max_n:
        raise RequestError(f"n: at most {limits.max_n}", "n")
    max_tokens = request.max_tokens or request.max_completion_tokens or 256
    if max_tokens > limits.max_tokens:
        raise RequestError(f"max_tokens: at most {limits.max_tokens}", "max_tokens")
    schema = None
    if request.response_format is not None and request.response_format.type == "json_schema":
        if request.response_format.json_schema is None:
            raise RequestError("response_format.json_schema.schema: required with type json_schema", "response_format")
        schema = check_schema(request.response_format.json_schema.schema_, limits.max_schema_nodes)
    try:
        params = SamplingParams(max_new_tokens=max_tokens, temperature=request.temperature, top_p=request.top_p,
                                seed=request.seed, stop=tuple(request.stop or ()), json_schema=schema)
    except ValueError as e:
        raise RequestError(str(e)) from None
    return [m.model_dump() for m in request.messages], request.n, params


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           headers: dict[str, str] | None = None) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status,
                        headers=headers)


async def read_limited_body(request: Any, max_bytes: int, timeout_s: float) -> bytes:
    """A request's body, at most ``max_bytes`` of it (413 beyond), within ``timeout_s`` (a body announced longer than
    it is, or sent a byte at a time, gets 408): :class:`RequestError` otherwise."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
        raise RequestError(f"the body may hold at most {max_bytes:,} bytes", status=413)
    data = bytearray()
    chunks = request.stream().__aiter__()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), timeout=max(0.0, deadline - time.monotonic()))
        except StopAsyncIteration:
            return bytes(data)
        except asyncio.TimeoutError:
            raise RequestError(f"the body did not arrive within {timeout_s:g} s", status=408) from None
        data += chunk
        if len(data) > max_bytes:
            raise RequestError(f"the body may hold at most {max_bytes:,} bytes", status=413)


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
"""The Host names a server without an API key answers (and the address it was bound to, when that is one)."""


def make_app(backend: Backend, served_name: str | None = None, api_key: str | None = None,
             limits: ServeLimits = ServeLimits(), host: str = "127.0.0.1", adapters: AdapterShelf | None = None) -> Any:
    """The FastAPI application serving ``backend``. Without ``api_key`` it answers only requests addressed (``Host``)
    to a loopback name or to ``host``: a web page in the user's browser can then neither reach it by a DNS name that
    points at this machine (DNS rebinding) nor, since a request must be JSON, post to it across sites. With
    ``adapters``, ``POST /v1/load_lora_adapter`` loads an adapter by name, and a request whose ``model`` names it is
    answered by it (any other name by ``backend``)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import PlainTextResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    name = served_name or backend.model_id
    app = FastAPI(title="env-engineer serve", docs_url=None, redoc_url=None, openapi_url=None)
    model_lock = asyncio.Lock()
    state = {"waiting": 0}
    compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")  # one compilation at a time
    compiling = asyncio.Semaphore(1)

    async def compile_outside_the_lock(compile_schema: Any, schema: str) -> None:
        """Compile a request's grammar before it takes the model, within ``schema_timeout_s`` (waiting for another
        compilation counts); a compilation that overruns goes on alone in its thread, and the request gets 400."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(limits.schema_timeout_s):
                async with compiling:
                    await asyncio.shield(loop.run_in_executor(compiler, compile_schema, schema))
        except TimeoutError:
            raise RequestError(f"response_format: its grammar did not compile within {limits.schema_timeout_s:g} s; "
                               "simplify the schema", "response_format") from None

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Any:
        return _error(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else "invalid_request_error")

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> Any:  # a bug, said in one line, never a dropped connection
        return _error(500, f"internal error: {type(exc).__name__}: {str(exc)[:200]}", "server_error")

    hosts = LOOPBACK_NAMES | ({host} if host not in ("0.0.0.0", "::", "") else set())

    def authorised(request: Request) -> bool:
        if api_key is None:
            name = request.headers.get("host", "").rsplit(":", 1)[0].strip("[]").lower()
            return name in hosts
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": name, "busy": model_lock.locked(), "waiting": state["waiting"]}

    @app.get("/v1/models")
    @app.get("/models")
    async def models(request: Request) -> Any:
        if not authorised(request):
            return _error(401, "missing or wrong API key (or, without one, a Host that is not this machine's)",
                          "authentication_error")
        served = [name, *(adapters.names() if adapters else [])]
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "env-engineer"} for n in served]}

    @app.post("/v1/load_lora_adapter")
    async def load_adapter(request: Request) -> Any:
        if not authorised(request):
            return _error(401, "missing or wrong API key (or, without one, a Host that is not this machine's)",
                          "authentication_error")
        if adapters is None:
            return _error(400, "loading adapters at runtime is off: start env-engineer serve with --adapters-from DIR")
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            return _error(415, "send the request as Content-Type: application/json")
        try:
            try:
                body = json.loads(await read_body(request) or b"null")
            except (ValueError, RecursionError):
                raise RequestError("the body is not JSON") from None
            if not isinstance(body, dict):
                raise RequestError("the body must be an object with lora_name and lora_path")
            folder = adapters.check(body.get("lora_name"), body.get("lora_path"))
        except RequestError as e:
            return _error(e.status, str(e), "invalid_request_error", e.param)
        except AdapterError as e:
            return _error(400, str(e))
        try:
            await asyncio.get_running_loop().run_in_executor(None, adapters.load, body["lora_name"], folder)
        except Exception as e:  # noqa: BLE001 - an adapter that does not load is the client's to fix, said in one line
            return _error(400, f"lora_path: the adapter did not load: {type(e).__name__}: {str(e)[:200]}")
        print(f"loaded adapter {body['lora_name']} from {folder}", flush=True)
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    async def read_body(request: Request) -> bytes:
        return await read_limited_body(request, limits.max_body_bytes, limits.read_timeout_s)

    def busy() -> Any:
        """429 when the waiting room is full, else None."""
        if model_lock.locked() and state["waiting"] >= limits.max_waiting:
            return _error(429, f"the server is busy ({state['waiting']} requests waiting); retry shortly",
                          "rate_limit_error", headers={"Retry-After": "1"})
        return None

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat(request: Request) -> Any:
        from starlette.requests import ClientDisconnect

        if not authorised(request):
            return _error(401, "missing or wrong API key (or, without one, a Host that is not this machine's)",
                          "authentication_error")
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            return _error(415, "send the request as Content-Type: application/json")
        full = busy()  # before any work on the request: a full room costs nothing more
        if full is not None:
            return full
        loop = asyncio.get_running_loop()
        try:
            raw = await read_body(request)
            try:
                body = json.loads(raw or b"null")
            except (ValueError, RecursionError):
                raise RequestError("the body is not JSON") from None
            messages, n, params = parse_request(body, limits)
            asked = body.get("model") if isinstance(body, dict) else None
            if adapters is not None and isinstance(asked, str):  # an adapter dropped since is loaded again: not here
                chosen = await loop.run_in_executor(None, adapters.get, asked) or backend
            else:
                chosen = backend
            counter = getattr(chosen, "prompt_tokens", None)
            if counter is not None:  # tokenizing a long prompt takes a while: not on the event loop
                length = await loop.run_in_executor(None, counter, messages)
                if length > limits.max_prompt_tokens:
                    raise RequestError(f"messages: the prompt takes {length:,} tokens; at most {limits.max_prompt_tokens:,}",
                                       "messages")
            compile_schema = getattr(chosen, "compile_schema", None)
            if params.json_schema is not None and compile_schema is not None:
                await compile_outside_the_lock(compile_schema, params.json_schema)
        except ClientDisconnect:  # it left while sending its body: nobody to answer
            return _error(499, "the client left while sending its request", "cancelled")
        except ConstrainedDecodingUnavailable as e:
            return _error(400, f"response_format: {e}", "invalid_request_error", "response_format")
        except RequestError as e:
            return _error(e.status, str(e), "invalid_request_error", e.param)
        except AdapterError as e:
            return _error(400, str(e), "invalid_request_error", "model")
        full = busy()
        if full is not None:
            return full
        state["waiting"] += 1
        try:
            await model_lock.acquire()
        finally:
            state["waiting"] -= 1
        try:
            if await request.is_disconnected():  # it left while waiting: nothing to generate
                return _error(499, "the client left before its turn", "cancelled")
            return await generate(request, chosen, asked if chosen is not backend else name, messages, n, params)
        finally:
            model_lock.release()

    async def generate(request: Request, backend: Backend, name: str, messages: list[dict[str, str]], n: int,
                       params: SamplingParams) -> Any:
        cancel = threading.Event()
        loop = asyncio.get_running_loop()
        options = {"cancel": cancel} if "cancel" in inspect.signature(backend.generate).parameters else {}
        work = loop.run_in_executor(None, lambda: backend.generate([messages], n, params, **options)[0])
        deadline = time.monotonic() + limits.timeout_s
        reason = None
        while not work.done():
            try:
                await asyncio.wait_for(asyncio.shield(work), timeout=0.25)
            except asyncio.TimeoutError:
                pass
            except Exception:  # noqa: BLE001 - the generation failed: answered below from its result
                break
            if not work.done():
                if await request.is_disconnected():
                    reason = "client left"
                elif time.monotonic() > deadline:
                    reason = "timeout"
                if reason:
                    cancel.set()
                    try:
                        await work  # the generation stops at its next token: the model is free again
                    except Exception:  # noqa: BLE001 - a cancelled generation's own error does not matter
                        pass
                    break
        if reason == "timeout":
            return _error(504, f"the generation took longer than {limits.timeout_s:g} s and was stopped", "timeout_error")
        if reason == "client left":
            return _error(499, "the client left; the generation was stopped", "cancelled")
        try:
            gens = work.result()
        except ConstrainedDecodingUnavailable as e:
            return _error(400, f"response_format: {e}", "invalid_request_error", "response_format")
        except Exception as e:  # noqa: BLE001 - a backend failure is the server's error, said in one line
            return _error(500, f"generation failed: {type(e).__name__}: {str(e)[:200]}", "server_error")
        prompt_tokens = gens[0].prompt_tokens if gens else 0
        completion_tokens = sum(g.completion_tokens for g in gens)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": name,
            "choices": [{"index": i, "message": {"role": "assistant", "content": g.text}, "finish_reason": g.finish_reason}
                        for i, g in enumerate(gens)],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }

    return app


def header_timeout_protocol(seconds: float) -> type:
    """uvicorn's h11 protocol (passed as its ``http`` class) that closes a connection which has not sent a whole
    request line and headers within ``seconds`` of opening: a client that connects and stays silent, or sends its
    headers a byte at a time, no longer holds a connection for ever (uvicorn's keep-alive timeout bounds the silence
    after an answer; the app bounds a body's)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._header_timer = self.loop.call_later(seconds, self._headers_late)

        def _headers_late(self) -> None:
            if self.cycle is None and not self.transport.is_closing():  # no request has arrived whole
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._header_timer.cancel()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


class RunningServer:
    """A uvicorn server in a background thread (tests, benchmarks): ``url`` once started, ``stop()`` to end it."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 read_timeout_s: float = ServeLimits.read_timeout_s) -> None:
        import socket

        import uvicorn

        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                                    http=header_timeout_protocol(read_timeout_s)))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        self.url = f"http://{host}:{self.socket.getsockname()[1]}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.socket.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = ServeLimits()
    parser.add_argument("--model", default="embedded", help="model: 'embedded', a local folder or .gguf file, or a cached Hugging Face id")
    parser.add_argument("--adapter", default=None, help="LoRA adapter folder (PEFT format) to apply (merged by the "
                        "transformers backend, applied unmerged by vLLM)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default %(default)s)")
    parser.add_argument("--served-name", default=None, help="model name clients use (default: the model id)")
    parser.add_argument("--api-key-env", default=None, help="require 'Authorization: Bearer $VAR' with this variable's value")
    parser.add_argument("--backend", choices=("transformers", "vllm"), default="transformers",
                        help="the engine behind the API: transformers (CPU or GPU, one request at a time) or vLLM's "
                        "offline engine (GPU, `pip install -e '.[gpu]'`: the adapter applied by vLLM, constrained JSON "
                        "through its structured outputs)")
    parser.add_argument("--gpu-memory", type=float, default=0.85,
                        help="with --backend vllm: share of the GPU's memory vLLM may take (default %(default)s)")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="with --backend vllm: GPUs the model is split over (default %(default)s)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, or auto (transformers backend)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes, help="largest request body (default %(default)s)")
    parser.add_argument("--max-prompt-tokens", type=int, default=defaults.max_prompt_tokens, help="longest prompt (default %(default)s)")
    parser.add_argument("--max-n", type=int, default=defaults.max_n, help="most completions per request (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens, help="most new tokens per completion (default %(default)s)")
    parser.add_argument("--max-waiting", type=int, default=defaults.max_waiting,
                        help="requests waiting for the model beyond which the server answers 429 (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=defaults.timeout_s,
                        help="seconds a generation may run before it is stopped with 504 (default %(default)s)")
    parser.add_argument("--adapters-from", type=Path, default=None,
                        help="let clients load LoRA adapters from folders under this one at runtime (POST "
                             "/v1/load_lora_adapter, as vLLM's server) and ask for them by name (transformers backend)")
    parser.add_argument("--max-adapters", type=int, default=4,
                        help="with --adapters-from: adapters kept loaded, the least recently used dropped (default "
                             "%(default)s; each is a merged copy of the model)")


def run(args: argparse.Namespace) -> int:
    from policy.backends import BackendError, TransformersBackend
    from policy.models import ModelNotFoundError

    key = None
    if args.api_key_env:
        key = os.environ.get(args.api_key_env)
        if not key:
            print(f"error: --api-key-env {args.api_key_env}: the variable is not set", file=sys.stderr)
            return 2
    numbers = {"--max-body-bytes": args.max_body_bytes, "--max-prompt-tokens": args.max_prompt_tokens,
               "--max-n": args.max_n, "--max-tokens": args.max_tokens, "--max-waiting": args.max_waiting + 1,
               "--timeout": args.timeout}
    bad = [f"{flag} = {value}" for flag, value in numbers.items() if not value > 0]
    if not 0 <= args.port <= 65535:
        bad.append(f"--port = {args.port}")
    if bad:
        print(f"error: {', '.join(bad)}: must be positive (the port 0 to 65535, --max-waiting 0 or more)", file=sys.stderr)
        return 2
    limits = ServeLimits(args.max_body_bytes, args.max_prompt_tokens, args.max_n, args.max_tokens, args.max_waiting,
                         args.timeout)
    if not 0 < args.gpu_memory <= 1 or args.tensor_parallel < 1:
        print(f"error: --gpu-memory {args.gpu_memory} must lie in (0, 1] and --tensor-parallel {args.tensor_parallel} "
              "be at least 1", file=sys.stderr)
        return 2
    try:
        if args.backend == "vllm":
            from policy.backends import VLLMBackend

            backend = VLLMBackend(args.model, args.adapter, gpu_memory_utilization=args.gpu_memory,
                                  tensor_parallel_size=args.tensor_parallel)
        else:
            backend = TransformersBackend(args.model, args.adapter, device=args.device, batch_size=1,
                                          threads=args.threads)
    except (ModelNotFoundError, ValueError, BackendError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    adapters = None
    if args.adapters_from is not None:
        if args.backend == "vllm" or not args.adapters_from.is_dir() or args.max_adapters < 1:
            print(f"error: --adapters-from {args.adapters_from}: give a folder, --max-adapters 1 or more, and the "
                  "transformers backend (vLLM's own server loads adapters at runtime)", file=sys.stderr)
            return 2
        adapters = AdapterShelf(args.adapters_from, lambda folder: TransformersBackend(
            args.model, str(folder), device=args.device, batch_size=1, threads=args.threads), args.max_adapters)
    import uvicorn

    print(f"serving {backend.model_id} on http://{args.host}:{args.port}/v1 (Ctrl-C stops)", flush=True)
    uvicorn.run(make_app(backend, args.served_name, key, limits, args.host, adapters), host=args.host, port=args.port,
                log_level="warning", timeout_keep_alive=30, http=header_timeout_protocol(limits.read_timeout_s),
                h11_max_incomplete_event_size=64 * 1024)
    return 0
