"""Generation backends behind one interface: ``generate(conversations, n, params) -> per conversation n Generations``.

Registry :data:`BACKENDS`:

- ``transformers`` (default; CPU or GPU): batched sampling with left padding, stop strings, per-batch seeds; on CUDA a
  static KV cache with the decode step compiled into CUDA graphs (see :class:`TransformersBackend`).
- ``vllm`` (GPU): imported only when chosen; LoRA adapters through ``LoRARequest``; a seed per conversation.
- ``openai``: any OpenAI-compatible chat-completions endpoint (base URL, model name, API key read from an environment
  variable, sent to that host only and never recorded), retries with exponential backoff on connection errors, 429
  and 5xx.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import random
import re
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

Conversation = list[dict[str, str]]


class BackendError(RuntimeError):
    """A backend could not generate (missing package, unreachable endpoint after retries, bad response)."""


class ConstrainedDecodingUnavailable(BackendError):
    """Constrained JSON was asked for (``SamplingParams.json_schema``) and the backend cannot decode under a schema:
    an install problem, never a reason to answer unconstrained."""


XGRAMMAR_MISSING = ("constrained JSON decoding needs xgrammar, which is not installed here: install it "
                    "(`pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi`, the `constrained` extra; the `gpu` extra "
                    "has it too), or ask for unconstrained output")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample.

    Attributes:
        max_new_tokens: completion length cap.
        temperature: 0 means greedy decoding.
        top_p: nucleus sampling mass.
        seed: base seed, recorded with each generation as the backend used it: ``transformers`` seeds batch ``k``
            of a call with ``seed + k``, ``vllm`` conversation ``i`` with ``seed + i * n`` (its samples the next
            ``n - 1``), ``openai`` the request for conversation ``i``'s samples from the ``j``-th on with
            ``seed + i * n + j`` (an endpoint that returns fewer choices than asked is asked again).
        stop: generation stops after any of these strings (kept in the text).
        json_schema: a JSON schema (as a JSON string) the output must follow: constrained decoding where the backend
            can (xgrammar for transformers, structured outputs for vLLM, ``response_format`` for OpenAI endpoints).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ("</answer>",)
    json_schema: str | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {self.max_new_tokens}: must be at least 1")
        if not (self.temperature == 0 or 1e-3 <= self.temperature <= 100):  # also refuses NaN
            raise ValueError(f"temperature = {self.temperature}: must be 0 (greedy) or between 0.001 and 100")
        if not 0 < self.top_p <= 1:  # also refuses NaN
            raise ValueError(f"top_p = {self.top_p}: must be in (0, 1]")


@dataclass(frozen=True)
class Generation:
    """One completion."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    latency_s: float
    seed: int
    constrained: bool = False


class Backend(Protocol):
    name: str
    model_id: str
    adapter_hash: str | None

    def generate(self, conversations: Sequence[Conversation], n: int, params: SamplingParams,
                 on_progress: Callable[[int], None] | None = None,
                 budgets: Sequence[int] | None = None) -> list[list[Generation]]: ...

    def count_tokens(self, text: str) -> int: ...


def check_budgets(budgets: Sequence[int] | None, conversations: Sequence[Conversation]) -> None:
    """``budgets``, when given, holds one answer length cap (at least 1 token) per conversation; it then replaces
    ``SamplingParams.max_new_tokens`` for each of them."""
    if budgets is None:
        return
    if len(budgets) != len(conversations):
        raise ValueError(f"{len(budgets)} token budgets for {len(conversations)} conversations: give one each")
    if any(not isinstance(b, int) or b < 1 for b in budgets):
        raise ValueError("every token budget must be a whole number of at least 1")


def forget_compiled(model: Any) -> None:
    """Drop the decode step ``generate`` compiled for ``model`` (the next static-cache call compiles afresh)."""
    import torch

    for attr in ("_compiled_call", "_last_compile_config"):
        if hasattr(model, attr):
            delattr(model, attr)
    torch.compiler.reset()


def padded_width(tokenizer: Any, texts: Sequence[str], multiple: int) -> int:
    """Token length of the longest of ``texts``, rounded up to ``multiple``: the one prompt width that lets a static KV
    cache compile once for all of them (each new shape costs a compilation: 30-80 s on an H100)."""
    longest = max((len(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]), default=1)
    return -(-longest // multiple) * multiple


def _cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    cuts = [text.index(s) + len(s) for s in stop if s and s in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


# --------------------------------------------------------------------------------------------------- transformers
class TransformersBackend:
    """Hugging Face ``generate``, batched: ``batch_size`` conversations times ``n`` samples per forward pass.

    Args:
        cache: ``"static"`` preallocates the KV cache, which lets ``generate`` compile the decode step into CUDA graphs
            (the per-token Python and kernel-launch overhead goes away: the bulk of a step at any batch size on a GPU);
            every batch of a ``generate`` call is left-padded to the call's longest prompt (rounded up to a multiple of
            ``pad_multiple``) and its last batch filled up, so a call compiles one shape. ``"dynamic"`` grows the
            cache step by step (no compilation; best on CPU). ``"auto"``: static on CUDA, dynamic elsewhere.
        compile_backend: the ``torch.compile`` backend for the static decode step: ``"inductor"`` (needs Triton and a
            C compiler), ``"cudagraphs"`` (CUDA graphs only, no code generation) or ``"none"`` (static cache, eager).
    """

    name = "transformers"

    def __init__(self, model: str = "embedded", adapter: str | None = None, device: str = "auto", dtype: str = "auto",
                 batch_size: int = 8, threads: int | None = None, cache: str = "auto", compile_backend: str = "inductor",
                 pad_multiple: int = 64) -> None:
        from policy.models import load_model

        self._configure(batch_size, threads, cache, compile_backend, pad_multiple)
        self._attach(load_model(model, adapter, device=device, dtype=dtype))

    @classmethod
    def from_loaded(cls, loaded: Any, **options: Any) -> "TransformersBackend":
        """A backend around an already loaded :class:`policy.models.LoadedModel` (for example a randomly initialised one)."""
        self = cls.__new__(cls)
        self._configure(options.pop("batch_size", 8), options.pop("threads", None), options.pop("cache", "auto"),
                        options.pop("compile_backend", "inductor"), options.pop("pad_multiple", 64))
        if options:
            raise TypeError(f"unknown options {sorted(options)}")
        self._attach(loaded)
        return self

    def _configure(self, batch_size: int, threads: int | None, cache: str, compile_backend: str, pad_multiple: int) -> None:
        import torch

        if threads:
            torch.set_num_threads(threads)
        if batch_size < 1:
            raise ValueError(f"batch_size = {batch_size}: must be at least 1")
        if cache not in ("auto", "static", "dynamic"):
            raise ValueError(f"cache = {cache!r}: choose 'auto', 'static' or 'dynamic'")
        if compile_backend not in ("inductor", "cudagraphs", "none"):
            raise ValueError(f"compile_backend = {compile_backend!r}: choose 'inductor', 'cudagraphs' or 'none'")
        if pad_multiple < 1:
            raise ValueError(f"pad_multiple = {pad_multiple}: must be at least 1")
        self.batch_size, self.cache, self.compile_backend, self.pad_multiple = batch_size, cache, compile_backend, pad_multiple
        self._compiler = None
        self._grammars: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._grammar_lock = threading.Lock()

    def _attach(self, loaded: Any) -> None:
        self.loaded = loaded
        self.model_id = loaded.model_id
        self.adapter_hash = loaded.adapter_hash

    @property
    def static_cache(self) -> bool:
        """Whether generation uses the preallocated (compilable) KV cache."""
        return self.cache == "static" or (self.cache == "auto" and str(self.loaded.device).startswith("cuda"))

    GRAMMAR_CACHE = 32
    """Compiled JSON-schema grammars kept (the most recently used; a server's clients may send any number)."""

    def compile_schema(self, schema: str) -> Any:
        """xgrammar's compiled grammar of ``schema``, compiled once and kept among the :data:`GRAMMAR_CACHE` last used;
        :class:`ConstrainedDecodingUnavailable` when xgrammar is not installed. Safe to call from another thread than
        the one generating (a server compiles a request's schema before the request takes the model)."""
        try:
            import xgrammar as xgr
        except ImportError:
            raise ConstrainedDecodingUnavailable(XGRAMMAR_MISSING) from None
        with self._grammar_lock:
            if schema in self._grammars:
                self._grammars.move_to_end(schema)
                return self._grammars[schema]
            if self._compiler is None:
                vocab = self.loaded.model.get_output_embeddings().weight.shape[0]
                self._compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(self.loaded.tokenizer,
                                                                                        vocab_size=vocab))
        compiled = self._compiler.compile_json_schema(schema, any_whitespace=False)
        with self._grammar_lock:
            self._grammars[schema] = compiled
            while len(self._grammars) > self.GRAMMAR_CACHE:
                self._grammars.popitem(last=False)
        return compiled

    def _logits_processor(self, schema: str | None):
        """An xgrammar logits processor for ``schema``, or None without a schema; :class:`ConstrainedDecodingUnavailable`
        when xgrammar is not installed (answering unconstrained would silently change what the caller asked for)."""
        if schema is None:
            return None
        compiled = self.compile_schema(schema)
        import xgrammar as xgr

        return xgr.contrib.hf.LogitsProcessor(compiled)

    def prompt_text(self, conversation: Conversation) -> str:
        return self.loaded.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)

    def encode(self, texts: Sequence[str], width: int | None = None) -> Any:
        """Left-padded token ids and mask on the model's device: with the static cache padded to ``width`` tokens
        (default: :func:`padded_width` of ``texts``), else to the longest of ``texts``."""
        pad: dict[str, Any] = {"padding": True}
        if self.static_cache:
            pad = {"padding": "max_length",
                   "max_length": width or padded_width(self.loaded.tokenizer, texts, self.pad_multiple)}
        return self.loaded.tokenizer(list(texts), return_tensors="pt", padding_side="left", add_special_tokens=False,
                                     **pad).to(self.loaded.device)

    def _generation_options(self) -> dict[str, Any]:
        if not self.static_cache:
            return {}
        from transformers.generation.configuration_utils import CompileConfig

        if self.compile_backend == "none":
            return {"cache_implementation": "static", "disable_compile": True}
        # inductor takes mode 'reduce-overhead' (its CUDA graphs); the cudagraphs backend takes no mode
        mode = "reduce-overhead" if self.compile_backend == "inductor" else "default"
        return {"cache_implementation": "static", "compile_config": CompileConfig(backend=self.compile_backend, mode=mode)}

    def generate_ids(self, input_ids: Any, attention_mask: Any, n: int, params: SamplingParams, seed: int,
                     logits_processor: Any = None, cancel: Any = None) -> tuple[Any, float]:
        """Sample from left-padded token ids: returns the new tokens (``rows x new``; row ``i * n + j`` is sample ``j``
        of prompt ``i`` when sampling, one row per prompt when greedy) and the seconds it took. ``cancel``: a
        ``threading.Event``; once set, generation stops after the current token (what it has so far is returned)."""
        tok, model = self.loaded.tokenizer, self.loaded.model
        previous = model.config._attn_implementation
        if self.static_cache and previous == "sdpa":  # no per-step copy of grouped keys/values (policy/attention.py)
            from policy.attention import register

            model.set_attn_implementation(register())
        try:
            return self._generate_loop(model, tok, input_ids, attention_mask, n, params, seed, logits_processor, cancel)
        finally:
            if model.config._attn_implementation != previous:
                model.set_attn_implementation(previous)

    def _generate_loop(self, model: Any, tok: Any, input_ids: Any, attention_mask: Any, n: int, params: SamplingParams,
                       seed: int, logits_processor: Any, cancel: Any = None) -> tuple[Any, float]:
        import torch

        stopping = None
        if cancel is not None:
            from transformers import StoppingCriteria, StoppingCriteriaList

            class Cancelled(StoppingCriteria):
                def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                    return torch.full((input_ids.shape[0],), cancel.is_set(), dtype=torch.bool, device=input_ids.device)

            stopping = StoppingCriteriaList([Cancelled()])

        sample = params.temperature > 0
        t0 = time.perf_counter()
        while True:
            torch.manual_seed(seed)
            try:
                with torch.inference_mode():
                    ids = model.generate(
                        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=params.max_new_tokens,
                        do_sample=sample, num_return_sequences=n if sample else 1,
                        temperature=params.temperature if sample else None, top_p=params.top_p if sample else None,
                        top_k=None, pad_token_id=tok.pad_token_id, stop_strings=list(params.stop) or None,
                        tokenizer=tok if params.stop else None,
                        logits_processor=[logits_processor] if logits_processor is not None else None,
                        stopping_criteria=stopping, **self._generation_options(),
                    )
                break
            except Exception as e:  # noqa: BLE001 - a compiler that cannot build here: fall back, never lose the rollout
                if not self.static_cache or self.compile_backend == "none":
                    raise
                fallback = {"inductor": "cudagraphs", "cudagraphs": "none"}[self.compile_backend]
                warnings.warn(f"compiling the decode step with {self.compile_backend!r} failed ({type(e).__name__}: "
                              f"{str(e)[:200]}); falling back to {fallback!r}", RuntimeWarning, stacklevel=2)
                self.compile_backend = fallback
                forget_compiled(model)
                t0 = time.perf_counter()
        return ids[:, input_ids.shape[1]:], time.perf_counter() - t0

    def prompt_tokens(self, conversation: Conversation) -> int:
        """How many tokens ``conversation``'s prompt takes (chat template applied)."""
        return len(self.loaded.tokenizer(self.prompt_text(conversation), add_special_tokens=False)["input_ids"])

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` as an answer (no special tokens added)."""
        return len(self.loaded.tokenizer(text, add_special_tokens=False)["input_ids"])

    def generate(self, conversations: Sequence[Conversation], n: int, params: SamplingParams,
                 on_progress: Callable[[int], None] | None = None, cancel: Any = None,
                 budgets: Sequence[int] | None = None) -> list[list[Generation]]:
        """``n`` completions per conversation. ``cancel`` (a ``threading.Event``) stops generation early once set.
        ``budgets``: each conversation's own answer length cap (:func:`check_budgets`); a batch decodes up to the
        largest of its batch (with the static cache, of the call: one shape for the whole call) and each answer is cut
        at its own, where it would have stopped."""
        check_budgets(budgets, conversations)
        tok = self.loaded.tokenizer
        out: list[list[Generation]] = []
        texts_all = [self.prompt_text(c) for c in conversations]
        several = len(conversations) > self.batch_size
        # One shape per call, so a static cache compiles once: every batch padded to the call's longest prompt ...
        width = padded_width(tok, texts_all, self.pad_multiple) if self.static_cache else None
        sample = params.temperature > 0
        for k, start in enumerate(range(0, len(conversations), self.batch_size)):
            chunk = conversations[start : start + self.batch_size]
            texts = texts_all[start : start + self.batch_size]
            if self.static_cache and several and len(texts) < self.batch_size:
                texts = texts + [texts[-1]] * (self.batch_size - len(texts))  # ... and the last batch filled up
            enc = self.encode(texts, width)
            seed = params.seed + k
            grammar = self._logits_processor(params.json_schema)
            caps = params
            if budgets is not None:
                caps = dataclasses.replace(params, max_new_tokens=max(
                    budgets if self.static_cache else budgets[start : start + self.batch_size]))
            new, latency = self.generate_ids(enc["input_ids"], enc["attention_mask"], n, caps, seed, grammar, cancel)
            prompt_lens = enc["attention_mask"].sum(dim=1).tolist()
            ends = {tok.pad_token_id, tok.eos_token_id}
            for i in range(len(chunk)):
                limit = params.max_new_tokens if budgets is None else budgets[start + i]
                gens = []
                for j in range(n):  # greedy decoding makes one sequence per prompt: its n samples are copies
                    row = new[i * n + j if sample else i].tolist()[:limit]
                    count = next((t for t, token in enumerate(row) if token in ends), len(row))
                    text, stopped = _cut_at_stop(tok.decode(row[:count], skip_special_tokens=True), params.stop)
                    reason = "stop" if stopped or count < limit else "length"
                    gens.append(Generation(text, int(prompt_lens[i]), count, reason, latency, seed, grammar is not None))
                out.append(gens)
            if on_progress is not None:
                on_progress(len(chunk))
        return out


# ---------------------------------------------------------------------------------------------------------- vllm
class VLLMBackend:
    """vLLM's offline engine (GPU; ``pip install -e '.[gpu]'``), imported only when chosen.

    A LoRA adapter is applied by vLLM itself (``LoRARequest``: the base weights stay as they are, no merge); its rank
    is read from the adapter's ``adapter_config.json``. Conversations go through the model's chat template
    (``LLM.chat``). Constrained JSON (``SamplingParams.json_schema``) uses vLLM's structured outputs.

    Args:
        model: the ``policy.model`` name ('embedded', a folder, a .gguf file or a cached hub id).
        adapter: a PEFT LoRA adapter folder, or None.
        gpu_memory_utilization: share of the GPU's memory vLLM may take (weights, activations and KV cache); lower it
            when other processes share the GPU.
        tensor_parallel_size: GPUs one model is split over.
        max_model_len: longest prompt + answer in tokens (None: the model's own limit).
        seed: the engine's seed (each conversation's request also carries its own sampling seed, recorded with
            each of its generations).
        load_format: 'auto' (the weights) or 'dummy' (random weights of the model's shape: speed measurements only).
        enforce_eager: no CUDA graphs and no compilation (starts faster, decodes slower).
        kv_cache_gib: GiB reserved for the KV cache, skipping vLLM's memory profiling (None: profile and size it
            from ``gpu_memory_utilization``); for processes sharing one GPU, whose memory changes during profiling.
    """

    name = "vllm"

    def __init__(self, model: str = "embedded", adapter: str | None = None, gpu_memory_utilization: float = 0.85,
                 tensor_parallel_size: int = 1, max_model_len: int | None = 4096, seed: int = 0,
                 load_format: str = "auto", enforce_eager: bool = False, kv_cache_gib: float | None = None,
                 **_: Any) -> None:
        try:
            import vllm
        except ImportError as e:
            raise BackendError("the vllm backend needs vLLM, which is not installed: on a CUDA machine run "
                               "`pip install -e '.[gpu]'`, or choose backend 'transformers'") from e
        from policy.models import adapter_hash, model_id, resolve_model

        self._vllm = vllm
        self.model_id = model_id(model)
        self.adapter_hash = adapter_hash(adapter)
        self.adapter = adapter
        rank = lora_rank(adapter) if adapter is not None else None
        extra: dict[str, Any] = {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1} if rank else {}
        if kv_cache_gib is not None:
            extra["kv_cache_memory_bytes"] = int(kv_cache_gib * 2 ** 30)
        self.engine = vllm.LLM(model=str(resolve_model(model)), dtype="bfloat16", seed=seed,
                               gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
                               max_model_len=max_model_len, load_format=load_format, enforce_eager=enforce_eager, **extra)

    def sampling_params(self, n: int, params: SamplingParams, seed: int) -> Any:
        """vLLM's sampling parameters for ``n`` samples under ``params``, seeded by ``seed`` (vLLM seeds the ``j``-th
        of the ``n`` samples with ``seed + j``)."""
        structured = {}
        if params.json_schema is not None:
            from vllm.sampling_params import StructuredOutputsParams

            structured = {"structured_outputs": StructuredOutputsParams(json=json.loads(params.json_schema))}
        return self._vllm.SamplingParams(n=n, max_tokens=params.max_new_tokens, temperature=params.temperature,
                                         top_p=params.top_p, seed=seed, stop=list(params.stop) or None,
                                         include_stop_str_in_output=True, **structured)

    def lora_request(self) -> Any:
        if self.adapter is None:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest("adapter", 1, str(self.adapter))

    def prompt_tokens(self, conversation: Conversation) -> int:
        """Tokens of ``conversation`` as the model reads it (its chat template), for the server's prompt limit."""
        tokenizer = self.engine.get_tokenizer()
        return len(tokenizer.apply_chat_template(list(conversation), add_generation_prompt=True, tokenize=True))

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` as an answer (no special tokens added)."""
        return len(self.engine.get_tokenizer()(text, add_special_tokens=False)["input_ids"])

    def generate(self, conversations: Sequence[Conversation], n: int, params: SamplingParams,
                 on_progress: Callable[[int], None] | None = None,
                 budgets: Sequence[int] | None = None) -> list[list[Generation]]:
        """``n`` completions per conversation; ``budgets``: each conversation's own answer length cap
        (:func:`check_budgets`), its request's ``max_tokens``."""
        # one seed per conversation, params.seed + i * n (its samples then take the next n - 1), so that no two
        # conversations share a noise stream; vLLM's sampler draws seeded requests' noise one request at a time,
        # which cost about 1% of Qwen3-4B's decode at batch 512 (docs/lab-notes/benchmarks.md)
        check_budgets(budgets, conversations)
        seeds = [params.seed + i * n for i in range(len(conversations))]
        caps = budgets if budgets is not None else [params.max_new_tokens] * len(conversations)
        sp = [self.sampling_params(n, dataclasses.replace(params, max_new_tokens=cap), seed)
              for seed, cap in zip(seeds, caps)]
        t0 = time.perf_counter()
        results = self.engine.chat([list(c) for c in conversations], sp, lora_request=self.lora_request(), use_tqdm=False)
        latency = time.perf_counter() - t0
        constrained = params.json_schema is not None
        out = [[Generation(o.text, len(r.prompt_token_ids), len(o.token_ids), o.finish_reason or "stop", latency,
                           seed + j, constrained) for j, o in enumerate(r.outputs)] for r, seed in zip(results, seeds)]
        if on_progress is not None:
            on_progress(len(conversations))
        return out


def stop_vllm_engine(engine: Any) -> None:
    """End a vLLM ``LLM``'s engine process now (it holds its share of the GPU); dropping the last reference to the
    engine would also end it, but later."""
    core = getattr(getattr(engine, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def lora_rank(adapter: str | Path) -> int:
    """The LoRA rank ``r`` of a PEFT adapter folder (vLLM must be told the largest rank it will serve)."""
    config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    return int(config.get("r") or 16)


# -------------------------------------------------------------------------------------------------------- openai
class OpenAIBackend:
    """Any OpenAI-compatible ``/chat/completions`` endpoint, through httpx.

    Args:
        base_url: e.g. ``https://api.openai.com/v1`` or ``http://127.0.0.1:8000/v1``.
        model: the endpoint's model name.
        api_key_env: name of the environment variable holding the key; None, empty or unset means no ``Authorization``
            header.
        max_retries / backoff_s: retries on connection errors, 429 and 5xx, waiting ``backoff_s * 2**k`` (+ jitter).

    The key goes to ``base_url``'s host and nowhere else: redirects are never followed (an endpoint that answers with
    one is an error naming where it pointed), and every message this backend writes (errors, records) has the key
    replaced by ``***``. A reply that is not a completion in the OpenAI shape is an error, never a crash.
    """

    name = "openai"
    MAX_REPLY_BYTES = 16_000_000

    def __init__(self, base_url: str, model: str, api_key_env: str | None = "OPENAI_API_KEY", timeout_s: float = 120.0,
                 max_retries: int = 5, backoff_s: float = 1.0, extra_body: dict[str, Any] | None = None, **_: Any) -> None:
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
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model_id = model
        self.adapter_hash = None
        self.api_key_env = api_key_env
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self.extra_body = extra_body or {}

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
        """POST ``body``; the reply as a JSON object, read as a stream and cut off past :attr:`MAX_REPLY_BYTES` once
        decoded (a small gzip bomb is a large reply), each attempt within ``timeout_s`` in all, not per read."""
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
                    status, location, content = self._exchange(client, data, headers)
                except (httpx.HTTPError, TimeoutError, ConnectionError) as e:
                    last = self.scrub(f"cannot read a reply from {self.url}: {type(e).__name__}: {e}")
                else:
                    if 300 <= status < 400 and location is not None:
                        raise BackendError(self.scrub(f"{self.url} answered {status} pointing to {location}: "
                                                      "redirects are not followed (the API key goes to base_url's "
                                                      "host only); set base_url to the final address"))
                    if status == 200:
                        try:
                            reply = json.loads(content)
                        except (ValueError, RecursionError):
                            raise BackendError(f"{self.url} answered with something that is not JSON") from None
                        if not isinstance(reply, dict):
                            raise BackendError(f"{self.url} answered JSON that is not an object")
                        return reply
                    last = self.scrub(f"HTTP {status} from {self.url}: {content[:300].decode('utf-8', 'replace')}")
                    if status != 429 and status < 500:
                        raise BackendError(last)
                if attempt < self.max_retries:
                    time.sleep(self.backoff_s * 2**attempt * (1 + 0.25 * random.random()))
        raise BackendError(self.scrub(f"{last} (gave up after {self.max_retries + 1} attempts)", 600))

    ERROR_BODY_BYTES = 4096
    """How much of an error reply's body is read (for its message)."""

    def _exchange(self, client: Any, data: bytes, headers: dict[str, str]) -> tuple[int, str | None, bytes]:
        """One request: status, redirect location and the body, streamed and decoded: at most
        :attr:`MAX_REPLY_BYTES` of a 200 and :attr:`ERROR_BODY_BYTES` of anything else, within ``timeout_s`` in all."""
        deadline = time.monotonic() + self.timeout_s
        with client.stream("POST", self.url, content=data, headers=headers) as response:
            cap = self.MAX_REPLY_BYTES if response.status_code == 200 else self.ERROR_BODY_BYTES
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                chunks.append(chunk)
                size += len(chunk)
                if size > cap:
                    if response.status_code == 200:
                        raise BackendError(f"{self.url} answered more than {cap:,} bytes: too large a reply")
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the reply took more than {self.timeout_s:g} s in all")
            location = response.headers.get("location") if response.is_redirect else None
            return response.status_code, location, b"".join(chunks)[: cap + 1]

    def count_tokens(self, text: str) -> int:
        """An upper bound on the tokens of ``text`` in any byte-level tokenizer: its UTF-8 bytes (the endpoint's
        tokenizer is not known here, and no token is shorter than a byte)."""
        return len(text.encode("utf-8"))

    def generate(self, conversations: Sequence[Conversation], n: int, params: SamplingParams,
                 on_progress: Callable[[int], None] | None = None,
                 budgets: Sequence[int] | None = None) -> list[list[Generation]]:
        """``n`` completions per conversation; ``budgets``: each conversation's own answer length cap
        (:func:`check_budgets`), its requests' ``max_tokens``."""
        check_budgets(budgets, conversations)
        out = []
        for i, conversation in enumerate(conversations):
            gens: list[Generation] = []
            while len(gens) < n:  # some endpoints return fewer choices than asked
                seed = params.seed + i * n + len(gens)  # conversations apart, as the vllm backend seeds them
                cap = params.max_new_tokens if budgets is None else budgets[i]
                body = {"model": self.model_id, "messages": conversation, "n": n - len(gens),
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
            out.append(gens)
            if on_progress is not None:
                on_progress(1)
        return out


def _count(value: Any) -> int:
    """A token count from an untrusted reply: a non-negative integer, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 10**9 else 0


BACKENDS: dict[str, type] = {"transformers": TransformersBackend, "vllm": VLLMBackend, "openai": OpenAIBackend}
"""Every generation backend, by name."""


def make_backend(kind: str, **options: Any) -> Backend:
    """Build a backend by name; unknown names say which exist."""
    if kind not in BACKENDS:
        raise ValueError(f"backend {kind!r}: choose one of {sorted(BACKENDS)}")
    return BACKENDS[kind](**options)
