"""GRPO's generation through the project's transformers backend (params.yaml ``train.grpo_generation: backend``), the
hook the train step hands to TRL's ``GRPOTrainer(rollout_func=...)``.

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
    eos = tokenizer.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
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
