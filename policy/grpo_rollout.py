"""GRPO's generation through the project's transformers backend (params.yaml ``train.sampler: backend``) or a
vLLM engine with the trainer's adapter as vLLM LoRA (``vllm-lora``): the hooks the train step hands to TRL's
``GRPOTrainer(rollout_func=...)``.

TRL's own transformers generation pads a ``generate`` call with a dynamic KV cache and turns compilation off; on a GPU
a GRPO step of the embedded model then spends nearly all its time generating (docs/lab-notes/benchmarks.md). The project's
backend (``policy.backends.TransformersBackend``) generates on CUDA with a static KV cache and the decode step compiled
into CUDA graphs. :func:`backend_rollout` hands it to ``GRPOTrainer(rollout_func=...)``: the trainer's own (LoRA,
being trained) model generates, in eval mode and without gradients, so every step samples from the current weights
(LoRA updates happen in place, which compiled graphs see).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from policy.accel import uses_lora_autocast
from policy.accel.options import Settings
from policy.devices import world_size


def cut_completion(ids: list[int], eos_ids: set[int]) -> list[int]:
    """A completion up to and including its first end-of-sequence token (as TRL's own generation keeps it)."""
    for i, token in enumerate(ids):
        if token in eos_ids:
            return ids[: i + 1]
    return ids


def eos_token_ids(tokenizer: Any) -> set[int]:
    """The tokenizer's end-of-sequence token ids (it may name one or several)."""
    eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}


def prompt_texts(tokenizer: Any, prompts: list) -> list[str]:
    """Chat-templated prompt texts (conversations get the generation prompt; strings pass through)."""
    return [p if isinstance(p, str) else tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
            for p in prompts]


def longest_prompt(tokenizer: Any, prompts: list, multiple: int = 64) -> int:
    """Token length of the longest prompt, rounded up to ``multiple``: padding every batch to it gives the static cache
    one shape, so the decode step compiles once per stage (each new shape costs a compilation: about 30 s for the
    embedded model on an H100)."""
    from policy.backends import padded_width

    return padded_width(tokenizer, prompt_texts(tokenizer, prompts), multiple)


def backend_rollout(model: Any, tokenizer: Any, *, max_new_tokens: int, temperature: float, top_p: float, seed: int,
                    cache: str = "auto", prompt_len: int | None = None,
                    autocast: bool = False) -> Callable[[list, Any], dict[str, Any]]:
    """A TRL ``rollout_func``: one completion per prompt it is given (TRL's sampler already repeats each prompt
    ``num_generations`` times), sampled by the project's backend from ``model`` as it is at call time.

    ``prompt_len``: left-pad every batch to this many tokens (:func:`longest_prompt`) where the static cache is used, so
    every call has the same shape; longer prompts raise. None: pad to the batch's longest, rounded up to 64
    (``TransformersBackend.encode``).
    ``autocast``: sample under bfloat16 autocast (on the model's device), as the trainer's passes run, for LoRA layers
    that take their inputs uncast (``train.lora_autocast``); entered per call, so the adapter's float32 weights are cast
    afresh after each optimizer step.
    Each call uses the next seed of ``seed * 1_000_003 + k`` (k = 0, 1, ...), so a run is reproducible and no two
    steps share a sampling seed.
    """
    import torch

    from policy.backends import SamplingParams, TransformersBackend
    from policy.models import LoadedModel

    backends: dict[str, Any] = {}  # by device: the trainer moves the model onto its device after this is built

    def backend_for_model() -> Any:
        device = str(next(model.parameters()).device)
        if device not in backends:
            backends[device] = TransformersBackend.from_loaded(LoadedModel(model, tokenizer, "grpo-policy", None, device),
                                                               batch_size=1, cache=cache)
        return backends[device]

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, stop=())
    eos_ids = eos_token_ids(tokenizer)
    calls = itertools.count()

    def rollout(prompts: list, trainer: Any) -> dict[str, Any]:
        if trainer is None:  # called outside a trainer: nothing to profile for
            return sample(prompts)
        from trl.extras.profiling import profiling_context

        with profiling_context(trainer, "backend.generate"):  # a phase of steps/train.py's GRPO profile
            return sample(prompts)

    def sample(prompts: list) -> dict[str, Any]:
        backend = backend_for_model()
        enc = backend.encode(prompt_texts(tokenizer, prompts), prompt_len)
        if prompt_len and enc["input_ids"].shape[1] > prompt_len:
            raise ValueError(f"a GRPO prompt of {enc['input_ids'].shape[1]} tokens is longer than prompt_len = {prompt_len}")
        was_training = model.training
        model.eval()
        try:
            with torch.autocast(torch.device(backend.loaded.device).type, dtype=torch.bfloat16, enabled=autocast):
                new, _ = backend.generate_ids(enc["input_ids"], enc["attention_mask"], 1, params,
                                              seed=seed * 1_000_003 + next(calls))
        finally:
            model.train(was_training)
        prompt_ids = [row[mask.bool()].tolist() for row, mask in zip(enc["input_ids"].cpu(), enc["attention_mask"].cpu())]
        completion_ids = [cut_completion(row.tolist(), eos_ids) for row in new.cpu()]
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    return rollout


class VLLMLoRARollout:
    """A TRL ``rollout_func`` sampling through a vLLM engine of the base model, with the trainer's adapter applied by
    vLLM's LoRA support (params.yaml ``train.sampler: vllm-lora``; CUDA with vLLM installed).

    Each call (one per generation cycle: ``train.generation_steps`` optimizer steps) writes the adapter as it is then
    (``save_pretrained``: the LoRA weights only, a few MB) under ``work`` and hands it to the engine as a new
    ``LoRARequest``: the base weights are never merged, copied or synced, and the previous cycle's adapter folder is
    removed. ``seconds`` sums each part over the run (engine start, adapter save, adapter load, generation);
    ``cycle_log`` has one row per call (its adapter and generation seconds, completions, their tokens and the longest:
    a call lasts as many decode steps as its longest completion). The engine starts on the first call (CUDA graphs
    captured up to ``max_num_seqs`` sequences, so a whole generation cycle decodes in graphs) and stops in
    :meth:`close`.

    Sampling is seeded once, by the engine (``seed``); vLLM's batching makes it reproducible for the same prompts in
    the same order, not bit-identical to the transformers backend. Completions end at their first end-of-sequence
    token (kept, as TRL keeps it); log-probabilities are not returned (TRL then computes them with the trainer's model).

    Args:
        model: the trainer's PEFT model (its adapter is saved each call).
        tokenizer: its tokenizer (chat template).
        base: folder of the base model's weights (``policy.models.resolve_model``).
        work: folder for the per-cycle adapter copies.
        max_model_len: longest prompt + completion in tokens.
        max_num_seqs: sequences the engine decodes at once, and its CUDA graphs' largest batch (the train step gives
            a generation cycle's completions, at most 1,024); a call with more prompts queues the rest in the engine.
        gpu_memory: share of the GPU's memory the engine may take (weights, activations, KV cache).
        engine: an engine to use instead of starting vLLM (tests).
    """

    phase = "vllm_lora.generate"
    """The name of a generation call in the train step's GRPO profile (TRL's ``profiling_context``)."""

    def __init__(self, model: Any, tokenizer: Any, *, base: Any, work: Any, max_new_tokens: int, temperature: float,
                 top_p: float, seed: int, max_model_len: int, max_num_seqs: int, gpu_memory: float,
                 engine: Any = None) -> None:
        from pathlib import Path

        self.model, self.tokenizer = model, tokenizer
        self.base, self.work = str(base), Path(work)
        self.max_new_tokens, self.temperature, self.top_p, self.seed = max_new_tokens, temperature, top_p, seed
        self.max_model_len, self.max_num_seqs, self.gpu_memory = max_model_len, max_num_seqs, gpu_memory
        self.engine = engine
        self.eos_ids = eos_token_ids(tokenizer)
        self.cycles = 0
        self.seconds = {"engine_start": 0.0, "adapter_save": 0.0, "adapter_load": 0.0, "generate": 0.0}
        self.cycle_log: list[dict[str, Any]] = []

    def lora_rank(self) -> int:
        """The rank vLLM must be prepared for: the trainer's adapter's ``r``."""
        config = next(iter(self.model.peft_config.values()))
        return int(config.r)

    def start(self) -> Any:
        import time

        import vllm

        t0 = time.perf_counter()
        self.engine = vllm.LLM(model=self.base, dtype="bfloat16", seed=self.seed, gpu_memory_utilization=self.gpu_memory,
                               max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                               compilation_config={"max_cudagraph_capture_size": self.max_num_seqs},
                               enable_prefix_caching=True, **self.engine_options())
        self.seconds["engine_start"] += time.perf_counter() - t0
        return self.engine

    def engine_options(self) -> dict[str, Any]:
        """The engine's options beyond the shared ones: LoRA, for the trainer's adapter's rank."""
        return {"enable_lora": True, "max_lora_rank": self.lora_rank(), "max_loras": 1}

    def __call__(self, prompts: list, trainer: Any) -> dict[str, Any]:
        if trainer is None:
            return self.sample(prompts)
        from trl.extras.profiling import profiling_context

        with profiling_context(trainer, self.phase):
            return self.sample(prompts)

    def sample(self, prompts: list) -> dict[str, Any]:
        import time

        engine = self.engine if self.engine is not None else self.start()
        k = self.cycles
        self.cycles += 1
        t0 = time.perf_counter()
        request = self.hand_over(engine, k)
        t1 = time.perf_counter()
        ids = self.tokenizer(prompt_texts(self.tokenizer, prompts), add_special_tokens=False)["input_ids"]
        outputs = engine.generate([{"prompt_token_ids": x} for x in ids], self.sampling_params(), use_tqdm=False,
                                  **({"lora_request": request} if request is not None else {}))
        t2 = time.perf_counter()
        completion_ids = [cut_completion(list(out.outputs[0].token_ids), self.eos_ids) for out in outputs]
        self.seconds["generate"] += t2 - t1
        self.cycle_log.append({"cycle": k, "adapter_s": round(t1 - t0, 4), "generate_s": round(t2 - t1, 4),
                               "completions": len(completion_ids),
                               "completion_tokens": sum(len(c) for c in completion_ids),
                               "longest": max((len(c) for c in completion_ids), default=0)})
        return {"prompt_ids": ids, "completion_ids": completion_ids, "logprobs": None}

    def hand_over(self, engine: Any, k: int) -> Any:
        """Give the engine cycle ``k``'s adapter: saved under ``work`` (the previous cycle's copy removed) and, where
        the engine has vLLM's ``llm_engine.add_lora``, loaded before generation, so loading is timed apart from it
        (``seconds['adapter_load']``); the ``LoRARequest`` to generate with."""
        import shutil
        import time

        t0 = time.perf_counter()
        folder = self.work / f"cycle-{k}"
        self.model.save_pretrained(str(folder))
        shutil.rmtree(self.work / f"cycle-{k - 1}", ignore_errors=True)
        request = self.lora_request(f"grpo-cycle-{k}", k + 1, str(folder))
        t1 = time.perf_counter()
        llm_engine = getattr(engine, "llm_engine", None)
        if llm_engine is not None and hasattr(llm_engine, "add_lora"):
            llm_engine.add_lora(request)
        self.seconds["adapter_save"] += t1 - t0
        self.seconds["adapter_load"] += time.perf_counter() - t1
        return request

    def sampling_params(self) -> Any:
        from vllm import SamplingParams

        # token ids only: vLLM's incremental detokenization of every sequence at every step is CPU work nobody reads
        return SamplingParams(n=1, max_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              detokenize=False)

    @staticmethod
    def lora_request(name: str, number: int, path: str) -> Any:
        from vllm.lora.request import LoRARequest

        return LoRARequest(name, number, path)

    def close(self) -> None:
        """Stop the engine (frees its share of the GPU) and remove the adapter copies."""
        import gc
        import shutil

        from policy.backends import stop_vllm_engine

        stop_vllm_engine(self.engine)
        self.engine = None
        gc.collect()
        shutil.rmtree(self.work, ignore_errors=True)


class VLLMMergedRollout(VLLMLoRARollout):
    """A TRL ``rollout_func`` sampling through a vLLM engine of the base model whose weights are, every generation
    cycle, the trainer's base weights with its adapter merged in (params.yaml ``train.sampler: vllm-merged``;
    CUDA with vLLM installed): the engine decodes without LoRA (vLLM's plain decode step ran 1.26x faster than its LoRA
    one for the embedded model's shape), at the price of merging and loading the changed weights each cycle (0.14-0.38 s
    for the embedded model on an H200, one ``load_weights`` call per tensor then). Measured there: steadier and faster
    than vllm-lora (docs/lab-notes/benchmarks.md).

    Each call computes, for every LoRA layer, ``W + scaling * B @ A`` in float32 from the trainer's weights as they are
    then (PEFT's ``get_delta_weight``; the trainer's own weights are never merged or changed, so no rounding builds up
    in them), rounds it to the engine's dtype, loads it into the engine's model under the base checkpoint's name
    (vLLM's ``load_weights``, which stacks q/k/v and gate/up itself) and clears the engine's prefix cache (its cached
    keys and values came from the previous weights). Weights no adapter touches are the base checkpoint's, which the
    engine loaded at its start. The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as TRL's
    colocated vLLM), so the weights move by device copies.
    """

    phase = "vllm_merged.generate"

    def start(self) -> Any:
        import os

        key = "VLLM_ENABLE_V1_MULTIPROCESSING"
        before = os.environ.get(key)
        os.environ[key] = "0"  # the engine's model in this process, where load_weights reaches it (read at start)
        try:
            return super().start()
        finally:
            if before is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = before

    def engine_options(self) -> dict[str, Any]:
        """No LoRA: the engine holds the merged weights."""
        return {}

    def hand_over(self, engine: Any, k: int) -> None:
        """Load cycle ``k``'s merged weights into the engine (``seconds['adapter_merge']`` computing them,
        ``seconds['adapter_load']`` loading them and clearing the prefix cache); nothing to pass to ``generate``."""
        import time

        t0 = time.perf_counter()
        weights = merged_lora_weights(self.model)
        t1 = time.perf_counter()
        engine_model(engine).load_weights(weights)  # one call: vLLM's load_weights indexes the model's parameters per call
        engine.reset_prefix_cache()
        self.seconds["adapter_merge"] = self.seconds.get("adapter_merge", 0.0) + t1 - t0
        self.seconds["adapter_load"] += time.perf_counter() - t1


def engine_model(engine: Any) -> Any:
    """The ``torch.nn.Module`` of an in-process vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), whose
    ``load_weights`` takes ``(checkpoint name, tensor)`` pairs."""
    worker = getattr(getattr(engine.llm_engine, "model_executor", None), "driver_worker", None)
    if worker is None:
        raise RuntimeError("train.sampler = 'vllm-merged' loads weights into the vLLM engine's model, which "
                           "runs in another process here; start the engine with VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                           "(VLLMMergedRollout.start does) or use train.sampler 'vllm-lora'")
    return worker.model_runner.model


def merged_lora_weights(model: Any) -> list[tuple[str, Any]]:
    """``(base checkpoint name, W + delta)`` for every LoRA layer of a PEFT model with one active adapter: the base
    weight plus PEFT's ``get_delta_weight`` (``scaling * B @ A``, transposed for fan-in-fan-out layers), added in
    float32 and rounded to the base weight's dtype. The model is not changed. Raises on layers this cannot merge
    (DoRA, several active adapters)."""
    import torch
    from peft.tuners.lora import LoraLayer

    prefix = "base_model.model."
    out = []
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, LoraLayer):
                continue
            active = [a for a in module.active_adapters if a in module.lora_A]
            if len(active) != 1 or any(module.use_dora.get(a, False) for a in active):
                raise ValueError(f"LoRA layer {name}: vllm-merged merges exactly one plain LoRA adapter per layer, this "
                                 f"one has {active} (DoRA: {dict(module.use_dora)}); use train.sampler 'vllm-lora'")
            weight = module.get_base_layer().weight
            merged = (weight.float() + module.get_delta_weight(active[0]).float()).to(weight.dtype)
            out.append((name.removeprefix(prefix) + ".weight", merged))
    return out


@dataclass
class Sampler:
    """How GRPO samples its completions (:func:`grpo_sampler`).

    Attributes:
        name: the ``train.sampler`` that runs (:data:`pipeline.train_settings.SAMPLERS`), 'auto' resolved.
        trl_args: what ``GRPOConfig`` takes for it.
        rollout_func: ``GRPOTrainer``'s ``rollout_func`` (None: TRL samples).
        lora_autocast: whether LoRA layers may take half-precision activations as they are (the project's samplers
            enter autocast themselves; TRL's own sampling runs outside it).
    """

    name: str
    trl_args: dict[str, Any] = field(default_factory=dict)
    rollout_func: Any = None
    lora_autocast: bool = False


def resolve_sampler(setting: str, device: str, vllm_installed: bool) -> str:
    """``train.sampler`` with 'auto' resolved: TRL's colocated vLLM on CUDA with vLLM installed, the project's
    backend on CUDA without it, TRL's own generate elsewhere."""
    if setting != "auto":
        return setting
    if device != "cuda":
        return "trl"
    return "trl-vllm" if vllm_installed else "backend"


def grpo_sampler(model: Any, tok: Any, data: list[dict[str, Any]], config: Settings, policy: Any,
                 device: str, work: Path, per_call: int) -> Sampler:
    """GRPO's sampler for ``train.sampler`` on this device. ``policy``: the policy settings
    (:class:`pipeline.params.PolicySettings`); ``per_call``: completions each generation call returns (sizes the
    project's vLLM engine)."""
    name = resolve_sampler(config.sampler, device, _has("vllm"))
    if name == "trl-vllm":
        return Sampler(name, {"use_vllm": True, "vllm_mode": "colocate",
                              "vllm_gpu_memory_utilization": config.vllm_gpu_memory,
                              "vllm_max_model_length": longest_prompt_tokens(tok, data) + config.max_completion_length})
    if name == "trl":
        return Sampler(name)
    lora = uses_lora_autocast(config.accel.lora_autocast, device)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL
    if name in VLLM_SAMPLERS:
        return Sampler(name, {}, vllm_rollout(model, tok, data, config, policy, device, work, per_call=per_call), lora)
    func = backend_rollout(model, tok, max_new_tokens=config.max_completion_length, temperature=config.temperature,
                           top_p=1.0, seed=config.seed, autocast=lora,
                           prompt_len=longest_prompt(tok, [d["prompt"] for d in data]))
    return Sampler(name, {}, func, lora)


VLLM_SAMPLERS = ("vllm-lora", "vllm-merged")
"""``train.sampler`` values that sample through the project's own vLLM engine."""


def vllm_rollout(model: Any, tok: Any, data: list[dict[str, Any]], config: Settings, policy: Any,
                 device: str, work: Path, per_call: int) -> Any:
    """GRPO's sampler for ``train.sampler: vllm-lora`` (:class:`policy.grpo_rollout.VLLMLoRARollout`) or
    ``vllm-merged`` (:class:`policy.grpo_rollout.VLLMMergedRollout`), after checking that it can run here: CUDA, one
    process, and vLLM importable."""
    name = config.sampler
    if device != "cuda":
        raise ValueError(f"train.sampler = '{name}' samples with vLLM, which needs CUDA, and this train step runs on "
                         f"{device!r}; set train.sampler to 'auto' or train on a GPU")
    if world_size() > 1:
        raise ValueError(f"train.sampler = '{name}' runs one vLLM engine beside one trainer process, and this launch has "
                         f"{world_size()} processes; set train.sampler to 'backend' or 'trl-vllm' (TRL's colocated "
                         "vLLM, one engine per process) for data-parallel GRPO")
    if not _has("vllm"):
        raise ValueError(f"train.sampler = '{name}' needs vLLM, which is not installed: run "
                         "`pip install -e '.[gpu]'` on the GPU machine, or set train.sampler to 'auto'")
    from policy.models import resolve_model

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL
    sampler = VLLMMergedRollout if name == "vllm-merged" else VLLMLoRARollout
    return sampler(model, tok, base=resolve_model(policy.model), work=work / "vllm-adapters",
                   max_new_tokens=config.max_completion_length, temperature=config.temperature, top_p=1.0,
                   seed=config.seed, max_model_len=longest_prompt_tokens(tok, data) + config.max_completion_length,
                   max_num_seqs=min(per_call, 1024), gpu_memory=config.vllm_gpu_memory)


def longest_prompt_tokens(tokenizer: Any, data: list[dict[str, Any]]) -> int:
    """Tokens of the longest chat-templated prompt of a GRPO dataset (sizes the colocated vLLM's context)."""
    texts = [tokenizer.apply_chat_template(d["prompt"], add_generation_prompt=True, tokenize=False) for d in data]
    return max((len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts), default=0)


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
