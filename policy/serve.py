"""``env-engineer serve``: an OpenAI-compatible HTTP server for a model (+ LoRA adapter).

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions`` (non-streaming; ``messages``, ``n``, ``max_tokens``,
``temperature``, ``top_p``, ``seed``, ``stop``, and ``response_format`` with a JSON schema, honoured by constrained
decoding when xgrammar is installed). Requests are served one at a time (the model is not thread-safe);
malformed requests get a 400 with an OpenAI-style error body. With ``--api-key-env NAME`` requests must include
``Authorization: Bearer $NAME``. Standard library only, so it runs on the GPU image too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from policy.backends import Backend, SamplingParams


class RequestError(ValueError):
    """A client error: becomes HTTP 400."""


def parse_request(body: dict[str, Any]) -> tuple[list[dict[str, str]], int, SamplingParams]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise RequestError("'messages' must be a non-empty list of {role, content} strings")
    n = body.get("n", 1)
    if not isinstance(n, int) or not 1 <= n <= 64:
        raise RequestError("'n' must be an integer in 1..64")
    stop = body.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    schema = None
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("json_schema", "text"):
            raise RequestError("'response_format' must be {'type': 'json_schema', 'json_schema': {'schema': {...}}} or text")
        if fmt["type"] == "json_schema":
            inner = fmt.get("json_schema")
            if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict):
                raise RequestError("'response_format.json_schema.schema' must be a JSON schema object")
            schema = json.dumps(inner["schema"])
    try:
        params = SamplingParams(max_new_tokens=int(body.get("max_tokens") or body.get("max_completion_tokens") or 256),
                                temperature=float(body.get("temperature", 1.0)), top_p=float(body.get("top_p", 1.0)),
                                seed=int(body.get("seed") or 0), stop=tuple(str(s) for s in stop), json_schema=schema)
    except (TypeError, ValueError) as e:
        raise RequestError(str(e)) from None
    return messages, n, params


def make_handler(backend: Backend, served_name: str, api_key: str | None):
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        server_version = "env-engineer-serve/1"

        def log_message(self, fmt: str, *args: Any) -> None:  # one line per request, never headers
            sys.stderr.write(f"serve: {self.address_string()} {fmt % args}\n")

        def _send(self, code: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, code: int, message: str, kind: str = "invalid_request_error") -> None:
            self._send(code, {"error": {"message": message, "type": kind}})

        def _authorised(self) -> bool:
            if api_key is None:
                return True
            if self.headers.get("Authorization", "") == f"Bearer {api_key}":
                return True
            self._error(401, "missing or wrong API key", "authentication_error")
            return False

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if not self._authorised():
                return
            if self.path.rstrip("/") in ("/v1/models", "/models"):
                self._send(200, {"object": "list", "data": [{"id": served_name, "object": "model", "owned_by": "env-engineer"}]})
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self) -> None:  # noqa: N802
            if not self._authorised():
                return
            if self.path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
                self._error(404, f"no route {self.path}")
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                if not isinstance(body, dict):
                    raise RequestError("the body must be a JSON object")
                messages, n, params = parse_request(body)
            except (json.JSONDecodeError, RequestError, ValueError) as e:
                self._error(400, str(e))
                return
            with lock:
                gens = backend.generate([messages], n, params)[0]
            prompt_tokens = gens[0].prompt_tokens if gens else 0
            completion_tokens = sum(g.completion_tokens for g in gens)
            self._send(200, {
                "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
                "model": served_name,
                "choices": [{"index": i, "message": {"role": "assistant", "content": g.text}, "finish_reason": g.finish_reason}
                            for i, g in enumerate(gens)],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens},
            })

    return Handler


def make_server(backend: Backend, host: str = "127.0.0.1", port: int = 8000, served_name: str | None = None,
                api_key: str | None = None) -> ThreadingHTTPServer:
    """A ready server (call ``serve_forever()``; ``port=0`` picks a free port, see ``server.server_address``)."""
    return ThreadingHTTPServer((host, port), make_handler(backend, served_name or backend.model_id, api_key))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded", help="model: 'embedded', a local folder, or a cached Hugging Face id")
    parser.add_argument("--adapter", default=None, help="LoRA adapter folder (PEFT format) to apply and merge")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default %(default)s; 0 picks a free one)")
    parser.add_argument("--served-name", default=None, help="model name clients use (default: the model id)")
    parser.add_argument("--api-key-env", default=None, help="require 'Authorization: Bearer $VAR' with this variable's value")
    parser.add_argument("--device", default="auto", help="cpu, cuda, or auto")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def run(args: argparse.Namespace) -> int:
    from policy.backends import TransformersBackend

    key = None
    if args.api_key_env:
        key = os.environ.get(args.api_key_env)
        if not key:
            print(f"error: --api-key-env {args.api_key_env}: the variable is not set", file=sys.stderr)
            return 2
    backend = TransformersBackend(args.model, args.adapter, device=args.device, batch_size=1, threads=args.threads)
    server = make_server(backend, args.host, args.port, args.served_name, key)
    host, port = server.server_address[:2]
    print(f"serving {backend.model_id} on http://{host}:{port}/v1 (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
