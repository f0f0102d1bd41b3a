"""A policy to train: the base model with a LoRA adapter (PEFT) that is trainable, fresh or continued.

A fresh adapter is seeded (``seed``) and its target modules are stored sorted, so the same settings give the same
adapter files on every run. LoRA's B matrices start at zero: a fresh adapter behaves exactly as the base model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from policy.models import load_tokenizer, pick_device, resolve_model


def load_trainable(model: str, init_adapter: str | Path | None = None, *, r: int = 16, alpha: int = 32,
                   dropout: float = 0.0, targets: str | Sequence[str] = "all-linear", device: str = "auto",
                   seed: int = 0) -> tuple[Any, Any]:
    """``(peft_model, tokenizer)``: ``model`` (see :func:`policy.models.resolve_model`) with the adapter of
    ``init_adapter`` made trainable, or a fresh one of rank ``r`` on ``targets``; bfloat16 on CUDA, float32 on CPU."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    device = pick_device(device)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    base = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=dtype)
    if init_adapter is not None:
        peft_model = PeftModel.from_pretrained(base, str(init_adapter), is_trainable=True)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            peft_model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, task_type="CAUSAL_LM",
                                                         target_modules=targets if isinstance(targets, str) else list(targets)))
        config = peft_model.peft_config["default"]
        if isinstance(config.target_modules, (set, frozenset)):
            config.target_modules = sorted(config.target_modules)  # a set is saved in hash order: different every run
    return peft_model, load_tokenizer(model)


def save_adapter(model: Any, tokenizer: Any, folder: str | Path, base: str) -> None:
    """Write the adapter (PEFT's files, LoRA weights only) and the tokenizer to ``folder``, naming ``base`` (the
    ``policy.model`` it was trained on: 'embedded', a folder, a cached id) as its base model, not the converted copy it
    was loaded from, which exists on one machine only. No embedding layer is saved (LoRA leaves them frozen), so PEFT
    does not look the base model up."""
    for config in model.peft_config.values():
        config.base_model_name_or_path = base
    model.save_pretrained(str(folder), save_embedding_layers=False)
    tokenizer.save_pretrained(str(folder))


def causal_lm(model: Any) -> Any:
    """The causal LM inside ``model``: a PEFT model's base model (with its LoRA layers in place), else ``model``."""
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model
