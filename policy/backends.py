"""Generation backends behind one interface: ``generate(conversations, n, params) -> per conversation n Generations``.

Registry :data:`BACKENDS`:

- ``transformers`` (default; CPU or GPU): batched sampling with left padding, stop strings, per-batch seeds; on CUDA a
  static KV cache with the decode step compiled into CUDA graphs (see :class:`TransformersBackend`).
- ``vllm`` (GPU): imported only when chosen; LoRA adapters through ``LoRARequest``; a seed per conversation.
- ``openai`` (:mod:`policy.openai_backend`): any OpenAI-compatible chat-completions endpoint (base URL, model name,
  API key read from an environment variable, sent to that host only and never recorded), retries with exponential
  backoff on connection errors, 429 and 5xx.

What they share (sampling settings, a completion, the protocol, the errors) is in :mod:`policy.generation`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from policy.generation import (XGRAMMAR_MISSING, Backend, BackendError, ConstrainedDecodingUnavailable, Conversation,
                               Generation, SamplingParams, check_budgets)
from policy.openai_backend import OpenAIBackend

__all__ = ["BACKENDS", "Backend", "BackendError", "ConstrainedDecodingUnavailable", "Conversation", "Generation",
           "OpenAIBackend", "SamplingParams", "TransformersBackend", "VLLMBackend", "check_budgets", "make_backend"]


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


BACKENDS: dict[str, type] = {"transformers": TransformersBackend, "vllm": VLLMBackend, "openai": OpenAIBackend}
"""Every generation backend, by name."""


def make_backend(kind: str, **options: Any) -> Backend:
    """Build a backend by name; unknown names say which exist."""
    if kind not in BACKENDS:
        raise ValueError(f"backend {kind!r}: choose one of {sorted(BACKENDS)}")
    return BACKENDS[kind](**options)
