"""The ``openai`` generation backend: any OpenAI-compatible chat-completions endpoint (registered in
:data:`policy.backends.BACKENDS`)."""

from __future__ import annotations

import json
import os
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from policy.generation import BackendError, Conversation, Generation, SamplingParams, check_budgets


class OpenAIBackend:
    """Any OpenAI-compatible ``/chat/completions`` endpoint, through httpx.

    Args:
        base_url: e.g. ``https://api.openai.com/v1`` or ``http://127.0.0.1:8000/v1``.
        model: the endpoint's model name.
        api_key_env: name of the environment variable holding the key; None, empty or unset means no ``Authorization``
            header.
        max_retries / backoff_s: retries on connection errors, 429 and 5xx, waiting ``backoff_s * 2**k`` (+ jitter).
        concurrency: requests in flight at once (one conversation each), so that a server that batches what it
            receives, as vLLM does, answers many at a time; the answers keep the conversations' order and seeds.
        adapter: a PEFT adapter folder the server can read, loaded into it at runtime under a name made of its
            content hash and folder (vLLM's ``POST /v1/load_lora_adapter``, with
            ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and ``--enable-lora``); the requests then name it as their
            model. An adapter the server already holds is used as it is.
        tokenizer: a local model (``policy.model``) whose tokenizer counts an answer's tokens, the served model's own,
            so that token budgets are the ones the other backends give; None, or one that cannot be loaded here
            (said once on stderr): UTF-8 bytes, an upper bound.

    The key goes to ``base_url``'s host and nowhere else: redirects are never followed (an endpoint that answers with
    one is an error naming where it pointed), and every message this backend writes (errors, records) has the key
    replaced by ``***``. A reply that is not a completion in the OpenAI shape is an error, never a crash.
    """

    name = "openai"
    MAX_REPLY_BYTES = 16_000_000

    def __init__(self, base_url: str, model: str, api_key_env: str | None = "OPENAI_API_KEY", timeout_s: float = 120.0,
                 max_retries: int = 5, backoff_s: float = 1.0, extra_body: dict[str, Any] | None = None,
                 concurrency: int = 1, adapter: str | Path | None = None, tokenizer: str | None = None,
                 **_: Any) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url = {str(base_url)[:80]!r}: must start with http:// or https://")
        from urllib.parse import urlsplit

        parts = urlsplit(base_url)
        if parts.username is not None or parts.password is not None:
            raise ValueError("base_url holds a user or password (user:password@host): leave them out and put the key in "
                             "the environment variable api_key_env names")
        if parts.query or parts.fragment:
            raise ValueError(f"base_url = {base_url[:80]!r}: no ?query or #fragment; give the endpoint's base, e.g. "
                             "http://127.0.0.1:8000/v1")
        if not isinstance(concurrency, int) or not 1 <= concurrency <= 4096:
            raise ValueError(f"concurrency = {concurrency!r}: give the requests in flight at once, 1 to 4096")
        self.base = base_url.rstrip("/")
        self.url = self.base + "/chat/completions"
        from policy.models import model_id

        self.model_id = model_id(model)  # what the records name, as the other backends name it
        self.served_as = model  # the model name requests give: the adapter's, once loaded into the server
        self.adapter_hash = None
        self.api_key_env = api_key_env
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self.extra_body = extra_body or {}
        self.concurrency = concurrency
        self._tokenizer_name, self._count = tokenizer, None
        if adapter is not None:
            self._load_adapter(Path(adapter))

    def _load_adapter(self, adapter: Path) -> None:
        """Load ``adapter`` into the server under ``adapter-<content hash>-<folder>`` (vLLM's runtime LoRA loading)
        and ask for it by that name from now on. The folder's part (8 hex digits of its path's SHA-256) keeps the
        same weights in two experiments' folders apart: the server may drop an adapter and load it again from the
        path it was given, and an experiment's folder goes when the experiment ends."""
        import hashlib

        from policy.models import adapter_hash

        digest, folder = adapter_hash(adapter), str(adapter.resolve())
        name = f"adapter-{digest}-{hashlib.sha256(folder.encode()).hexdigest()[:8]}"
        url = self.base + "/load_lora_adapter"
        try:
            self._request(url, {"lora_name": name, "lora_path": folder})
        except BackendError as e:
            if "already" not in str(e):  # vLLM: "The lora adapter '...' has already been loaded."
                raise BackendError(f"{e}; the server must load LoRA adapters at runtime: start vLLM with "
                                   "--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, and give it read access "
                                   f"to {adapter}") from None
        self.served_as, self.adapter_hash = name, digest

    def _key(self) -> str | None:
        return os.environ.get(self.api_key_env) if self.api_key_env else None

    def scrub(self, text: str, limit: int = 300) -> str:
        """``text`` with the key replaced by ``***`` (also where the text writes it in ``\\uXXXX`` escapes, as a JSON
        echo may), cut to ``limit`` characters."""
        key = self._key()
        if key:
            if "\\u" in text:  # decode escapes first, so that an escaped key is a key
                text = re.sub(r"\\u([0-9a-fA-F]{4})", lambda m: chr(int(m.group(1), 16)), text)
            text = text.replace(key, "***")
        return text[:limit]

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to the chat-completions endpoint; the reply as a JSON object."""
        content = self._request(self.url, body)
        try:
            reply = json.loads(content)
        except (ValueError, RecursionError):
            raise BackendError(f"{self.url} answered with something that is not JSON") from None
        if not isinstance(reply, dict):
            raise BackendError(f"{self.url} answered JSON that is not an object")
        return reply

    def _request(self, url: str, body: dict[str, Any]) -> bytes:
        """POST ``body`` to ``url``; the body of its 200 reply, read as a stream and cut off past
        :attr:`MAX_REPLY_BYTES` once decoded (a small gzip bomb is a large reply), each attempt within ``timeout_s``
        in all, not per read."""
        import httpx

        headers = {"Content-Type": "application/json"}
        key = self._key()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        data = json.dumps(body).encode()
        last = ""
        # trust_env=False: the key goes to base_url's host, never to a proxy named in HTTP(S)_PROXY
        with httpx.Client(timeout=self.timeout_s, follow_redirects=False, trust_env=False) as client:
            for attempt in range(self.max_retries + 1):
                try:
                    status, location, content = self._exchange(client, url, data, headers)
                except (httpx.HTTPError, TimeoutError, ConnectionError) as e:
                    last = self.scrub(f"cannot read a reply from {url}: {type(e).__name__}: {e}")
                else:
                    if 300 <= status < 400 and location is not None:
                        raise BackendError(self.scrub(f"{url} answered {status} pointing to {location}: "
                                                      "redirects are not followed (the API key goes to base_url's "
                                                      "host only); set base_url to the final address"))
                    if status == 200:
                        return content
                    last = self.scrub(f"HTTP {status} from {url}: {content[:300].decode('utf-8', 'replace')}")
                    if status != 429 and status < 500:
                        raise BackendError(last)
                if attempt < self.max_retries:
                    time.sleep(self.backoff_s * 2**attempt * (1 + 0.25 * random.random()))
        raise BackendError(self.scrub(f"{last} (gave up after {self.max_retries + 1} attempts)", 600))

    ERROR_BODY_BYTES = 4096
    """How much of an error reply's body is read (for its message)."""

    def _exchange(self, client: Any, url: str, data: bytes, headers: dict[str, str]) -> tuple[int, str | None, bytes]:
        """One request: status, redirect location and the body, streamed and decoded: at most
        :attr:`MAX_REPLY_BYTES` of a 200 and :attr:`ERROR_BODY_BYTES` of anything else, within ``timeout_s`` in all."""
        deadline = time.monotonic() + self.timeout_s
        with client.stream("POST", url, content=data, headers=headers) as response:
            cap = self.MAX_REPLY_BYTES if response.status_code == 200 else self.ERROR_BODY_BYTES
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                chunks.append(chunk)
                size += len(chunk)
                if size > cap:
                    if response.status_code == 200:
                        raise BackendError(f"{url} answered more than {cap:,} bytes: too large a reply")
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the reply took more than {self.timeout_s:g} s in all")
            location = response.headers.get("location") if response.is_redirect else None
            return response.status_code, location, b"".join(chunks)[: cap + 1]

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` as an answer in ``tokenizer``'s tokens; without it an upper bound in any byte-level
        tokenizer, its UTF-8 bytes (no token is shorter than a byte)."""
        if self._count is None and self._tokenizer_name is not None:
            from policy.models import ModelNotFoundError, answer_token_counter

            try:
                self._count = answer_token_counter(self._tokenizer_name)
            except (ModelNotFoundError, OSError, ValueError) as e:
                print(f"warning: token budgets counted in UTF-8 bytes (an upper bound): no tokenizer of "
                      f"{self._tokenizer_name!r} here ({str(e)[:200]})", file=sys.stderr)
                self._tokenizer_name = None
        if self._count is not None:
            return self._count(text)
        return len(text.encode("utf-8"))

    def generate(self, conversations: Sequence[Conversation], n: int, params: SamplingParams,
                 on_progress: Callable[[int], None] | None = None,
                 budgets: Sequence[int] | None = None) -> list[list[Generation]]:
        """``n`` completions per conversation, up to ``concurrency`` conversations' requests in flight at once;
        ``budgets``: each conversation's own answer length cap (:func:`check_budgets`), its requests' ``max_tokens``.
        The first error stops the rest and is raised."""
        check_budgets(budgets, conversations)

        def answer(i: int) -> list[Generation]:
            cap = params.max_new_tokens if budgets is None else budgets[i]
            return self._answer(conversations[i], n, params, params.seed + i * n, cap)

        if self.concurrency == 1 or len(conversations) <= 1:
            out = []
            for i in range(len(conversations)):
                out.append(answer(i))
                if on_progress is not None:
                    on_progress(1)
            return out
        from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

        results: dict[int, list[Generation]] = {}
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(conversations))) as pool:
            pending = {pool.submit(answer, i): i for i in range(len(conversations))}
            while pending:
                done, _ = wait(pending, return_when=FIRST_EXCEPTION)
                for future in done:
                    i = pending.pop(future)
                    if future.exception() is not None:
                        for other in pending:
                            other.cancel()
                        raise future.exception()
                    results[i] = future.result()
                    if on_progress is not None:  # from this thread only: the caller's progress need not be thread-safe
                        on_progress(1)
        return [results[i] for i in range(len(conversations))]

    def _answer(self, conversation: Conversation, n: int, params: SamplingParams, first_seed: int,
                cap: int) -> list[Generation]:
        """One conversation's ``n`` completions, its requests seeded ``first_seed``, ``first_seed + 1``, ... by the
        samples already had (as the vllm backend seeds them)."""
        gens: list[Generation] = []
        while len(gens) < n:  # some endpoints return fewer choices than asked
            seed = first_seed + len(gens)
            body = {"model": self.served_as, "messages": conversation, "n": n - len(gens),
                    "max_tokens": cap, "temperature": params.temperature, "top_p": params.top_p,
                    "seed": seed, **self.extra_body}
            if params.stop:
                body["stop"] = list(params.stop)
            if params.json_schema is not None:
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "proposal", "schema": json.loads(params.json_schema), "strict": True}}
            t0 = time.perf_counter()
            reply = self._post(body)
            latency = time.perf_counter() - t0
            choices = reply.get("choices")
            if not isinstance(choices, list) or not choices or not all(isinstance(c, dict) for c in choices):
                raise BackendError(f"{self.url} returned no choices (a 'choices' list of objects)")
            usage = reply.get("usage") if isinstance(reply.get("usage"), dict) else {}
            for choice in choices[: n - len(gens)]:
                message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
                text = message.get("content") if isinstance(message.get("content"), str) else ""
                text = self.scrub(text, limit=len(text))  # an endpoint that echoes the key never gets it recorded
                reason = choice.get("finish_reason") if isinstance(choice.get("finish_reason"), str) else "stop"
                if reason == "stop" and params.stop and not any(s in text for s in params.stop) and "<answer>" in text:
                    text += params.stop[0]  # OpenAI strips the stop string; put the closing tag back
                gens.append(Generation(text, _count(usage.get("prompt_tokens")),
                                       _count(usage.get("completion_tokens")) // max(1, len(choices)),
                                       reason[:20], latency, seed, params.json_schema is not None))
        return gens


def _count(value: Any) -> int:
    """A token count from an untrusted reply: a non-negative integer, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 10**9 else 0
