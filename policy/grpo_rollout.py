"""GRPO's generation through the project's transformers backend (params.yaml ``train.grpo_generation: backend``) or a
vLLM engine with the trainer's adapter as vLLM LoRA (``vllm-lora``): the hooks the train step hands to TRL's
``GRPOTrainer(rollout_func=...)``.

TRL's own transformers generation pads a ``generate`` call with a dynamic KV cache and turns compilation off; on a GPU
a GRPO step of the embedded model then spends nearly all its time generating (docs/benchmarks.md). The project's
backend (``policy.backends.TransformersBackend``) generates on CUDA with a static KV cache and the decode step compiled
into CUDA graphs. :func:`backend_rollout` hands it to ``GRPOTrainer(rollout_func=...)``: the trainer's own (LoRA,
being trained) model generates, in eval mode and without gradients, so every step samples from the current weights
(LoRA updates happen in place, which compiled graphs see).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable


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
    vLLM's LoRA support (params.yaml ``train.grpo_generation: vllm-lora``; CUDA with vLLM installed).

    Each call (one per generation cycle: ``train.generation_steps`` optimizer steps) writes the adapter as it is then
    (``save_pretrained``: the LoRA weights only, a few MB) under ``work`` and hands it to the engine as a new
    ``LoRARequest``: the base weights are never merged, copied or synced, and the previous cycle's adapter folder is
    removed. The engine starts on the first call (CUDA graphs captured up to ``max_num_seqs`` sequences, so a whole
    generation cycle decodes in graphs) and stops in :meth:`close`.

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
        self.seconds = {"engine_start": 0.0, "adapter_save": 0.0, "generate": 0.0}

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
                               enable_lora=True, max_lora_rank=self.lora_rank(), max_loras=1,
                               enable_prefix_caching=True)
        self.seconds["engine_start"] += time.perf_counter() - t0
        return self.engine

    def __call__(self, prompts: list, trainer: Any) -> dict[str, Any]:
        if trainer is None:
            return self.sample(prompts)
        from trl.extras.profiling import profiling_context

        with profiling_context(trainer, "vllm_lora.generate"):
            return self.sample(prompts)

    def sample(self, prompts: list) -> dict[str, Any]:
        import shutil
        import time

        engine = self.engine if self.engine is not None else self.start()
        k = self.cycles
        self.cycles += 1
        t0 = time.perf_counter()
        folder = self.work / f"cycle-{k}"
        self.model.save_pretrained(str(folder))
        shutil.rmtree(self.work / f"cycle-{k - 1}", ignore_errors=True)
        t1 = time.perf_counter()
        ids = self.tokenizer(prompt_texts(self.tokenizer, prompts), add_special_tokens=False)["input_ids"]
        outputs = engine.generate([{"prompt_token_ids": x} for x in ids], self.sampling_params(),
                                  lora_request=self.lora_request(f"grpo-cycle-{k}", k + 1, str(folder)), use_tqdm=False)
        self.seconds["adapter_save"] += t1 - t0
        self.seconds["generate"] += time.perf_counter() - t1
        completion_ids = [cut_completion(list(out.outputs[0].token_ids), self.eos_ids) for out in outputs]
        return {"prompt_ids": ids, "completion_ids": completion_ids, "logprobs": None}

    def sampling_params(self) -> Any:
        from vllm import SamplingParams

        return SamplingParams(n=1, max_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p)

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
