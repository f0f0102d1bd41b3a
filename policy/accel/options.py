"""What the training passes run with, decided from ``train``'s settings and the device alone (no model, no torch
import): activation recomputation, compilation and its mode, CUDA graphs of the decoder, LoRA in half precision,
padding multiples, padding-free attention and parallel tokenization. :mod:`policy.accel.kernels` and
:mod:`policy.accel.trainer` act on these decisions."""

from __future__ import annotations

import os
from typing import Any, Literal

from policy.devices import world_size

Phase = Literal["sft", "grpo"]
"""A training phase: the supervised pass ('sft') or GRPO ('grpo')."""
Settings = Any
"""The train step's settings, params.yaml's ``train`` section (:class:`pipeline.train_settings.TrainSettings`):
typed loosely because ``policy`` sits below ``pipeline`` and never imports it."""


CHECKPOINTING_MIN_PARAMS = 1_000_000_000
"""``gradient_checkpointing: auto`` recomputes activations on CUDA from this many model parameters on (Qwen3-4B did not
fit 16 x 512 tokens per pass in 80 GB without it; the 135M embedded model needs 12 GiB)."""


def use_checkpointing(setting: bool | str, device: str, parameters: int) -> bool:
    """Whether to recompute activations: the setting, or for 'auto' CUDA and a model of at least 1B parameters."""
    if setting != "auto":
        return bool(setting)
    return device == "cuda" and parameters >= CHECKPOINTING_MIN_PARAMS


def compiles(config: Settings, phase: Phase) -> bool:
    """Whether ``phase`` runs compiled (``torch_compile``: true for both phases, 'sft' or 'grpo' for that phase only)."""
    return config.accel.torch_compile is True or config.accel.torch_compile == phase


def compile_mode(config: Settings, device: str) -> str:
    """torch.compile's mode for the training passes: ``compile_mode`` on CUDA, 'default' elsewhere (CUDA graphs need
    CUDA); 'decoder-graph' compiles in the default mode (:func:`uses_decoder_graph` says where its graphs apply)."""
    return config.accel.compile_mode if device == "cuda" else "default"


def uses_decoder_graph(config: Settings, device: str, phase: Phase) -> bool:
    """Whether ``phase``'s passes replay the decoder as CUDA graphs (``compile_mode: decoder-graph``,
    policy/accel/decoder_graph.py): a compiled warm start of padding-free rows through varlen attention on CUDA, whose row
    shapes repeat."""
    return (phase == "sft" and compiles(config, phase) and compile_mode(config, device) == "decoder-graph"
            and packed_attention_name(config, device) == "varlen_packed")


def uses_lora_autocast(setting: bool | str, device: str) -> bool:
    """Whether LoRA layers take the half-precision activations as they are (``train.lora_autocast``): on CUDA only,
    where the trainer runs in bfloat16."""
    return device == "cuda" and setting in ("auto", True)


PAD_MULTIPLE_WHEN_COMPILED = 128
"""``pad_to_multiple_of: auto`` pads to this many tokens when the model is compiled (TRL's own choice for Neuron, which
also compiles once per shape)."""


ROW_PAD_MULTIPLE_WHEN_COMPILED = 2048
"""``pad_to_multiple_of: auto`` for a compiled warm start's padding-free rows (a batch's demonstrations in one row):
the row is padded as a whole, so 128 gave nearly every row of 64 demonstrations (17,000-25,000 tokens) a width of its
own, compiled and recorded again (steps of about 5 s on an H200); with 2048 the starting policy's 1,172 batches took
three widths, 3.4% of the row padding (docs/lab-notes/benchmarks.md)."""


def padding_multiple(config: Settings, phase: Phase) -> int | None:
    """The padding multiple handed to TRL for ``phase``: the setting, or for 'auto' in a compiled phase
    PAD_MULTIPLE_WHEN_COMPILED (ROW_PAD_MULTIPLE_WHEN_COMPILED for the warm start's padding-free rows); None when not
    compiled."""
    if config.accel.pad_to_multiple_of != "auto":
        return config.accel.pad_to_multiple_of
    if not compiles(config, phase):
        return None
    return ROW_PAD_MULTIPLE_WHEN_COMPILED if phase == "sft" and config.accel.sft_padding_free else PAD_MULTIPLE_WHEN_COMPILED


PACKED_ATTENTION = {"flex": {"cuda": "flex_attention"}, "varlen": {"cuda": "varlen_packed"}}
"""Attention for padding-free warm-start batches, by ``sft_packed_attention`` and device: flex attention computes only
the blocks on each demonstration's diagonal of the row, where SDPA would take a dense mask over the whole row (correct,
but quadratic in the batch's total length); PyTorch's variable-length attention (policy/accel/packed_attention.py) takes the
boundaries alone. Neither has a backward pass on the CPU, which keeps the model's own (SDPA)."""


def packed_attention_name(config: Settings, device: str) -> str | None:
    """The attention implementation padding-free warm-start batches switch to (None: the model's own)."""
    if not config.accel.sft_padding_free:
        return None
    name = PACKED_ATTENTION[config.accel.sft_packed_attention].get(device)
    if name == "varlen_packed":
        from policy.accel.packed_attention import register

        register()
    return name


TOKENIZER_PROCESS_EXAMPLES = 4096
"""Fewest demonstrations per process worth tokenizing in parallel: one process tokenizes about 1,000 demonstrations/s
(TRL's chat-template tokenization; 55 s for the starting policy's 50,000), and a process starts in about a second."""


def tokenizer_processes(examples: int) -> int | None:
    """Processes TRL tokenizes ``examples`` demonstrations with (its ``dataset_num_proc``): None (this process) for
    fewer than 2 x TOKENIZER_PROCESS_EXAMPLES or on a machine of up to 2 cores; else one per TOKENIZER_PROCESS_EXAMPLES
    demonstrations, at most half of this process's share of the cores and at most 8."""
    cores = len(os.sched_getaffinity(0)) // world_size()
    processes = min(8, cores // 2, examples // TOKENIZER_PROCESS_EXAMPLES)
    return processes if processes >= 2 else None
