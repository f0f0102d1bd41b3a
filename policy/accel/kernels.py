"""The kernels a training phase's passes run with, as context managers around ``trainer.train()``
(:func:`training_kernels`): padding-free attention, SDPA kernels, LoRA in half precision, decoder layers compiled one
by one, the decoder replayed as CUDA graphs; and the warm start's collators for padding-free rows
(:func:`warm_start_collator`)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from policy.accel.options import (Phase, Settings, compile_mode, compiles, packed_attention_name, padding_multiple,
                                  uses_decoder_graph)
from policy.lora import causal_lm


def decoder_layers(model: Any) -> list[Any]:
    """The model's decoder layers: the modules of the classes its ``_no_split_modules`` names (transformers' own list
    of the blocks that repeat)."""
    names = set(getattr(causal_lm(model), "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


@contextlib.contextmanager
def attention_kernels(setting: str, device: str) -> Iterator[None]:
    """The SDPA kernels training may use while inside: ``attention_kernel: efficient`` on CUDA allows the
    memory-efficient, flash and math kernels (in that order of preference) and not cuDNN's; otherwise PyTorch's own
    choice."""
    if setting == "auto" or device != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH], set_priority=True):
        yield


def _embedding_requiring_grad(module: Any, args: Any, output: Any) -> Any:
    """Forward hook for the input embedding: in grad mode its output requires grad (a frozen embedding's would not)."""
    import torch

    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and not output.requires_grad:
        return output.detach().requires_grad_()
    return None


@contextlib.contextmanager
def compiled_layers(model: Any, enabled: bool, mode: str = "default") -> Iterator[list[Any]]:
    """Each decoder layer compiled on its own while inside (``compile_scope: layers``), in torch.compile's ``mode``
    (``compile_mode``), plain again after; raises when the model names no decoder layers (set compile_scope to 'model'
    then). While inside, a training pass's input embeddings require grad: with a frozen embedding (LoRA) the first
    layer's input would not where every other layer's does, and a compiled layer then compiles twice per input shape
    (about 9 s each for the embedded model on an H200; the first layer's input gradient, computed and dropped, costs
    far less)."""
    if not enabled:
        yield []
        return
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"train.compile_scope = 'layers': {type(model).__name__} names no decoder layers "
                         "(_no_split_modules); set train.compile_scope to 'model'")
    for layer in layers:
        # not dynamic=True: compiled dynamic from the start, a warm-start step's first pass took 95 s on an H200 against
        # 17 s, and the epoch's short last batch still recompiled; torch's default compiles the first shape, then
        # once more with the changed dimensions dynamic (two recompilations of about 18 s in a 1,173-step warm start)
        layer.compile(mode=None if mode in ("default", "decoder-graph") else mode)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    hook = embedding.register_forward_hook(_embedding_requiring_grad) if embedding is not None else None
    try:
        yield layers
    finally:
        if hook is not None:
            hook.remove()
        for layer in layers:
            layer._compiled_call_impl = None


@contextlib.contextmanager
def lora_uncast(model: Any, enabled: bool) -> Iterator[None]:
    """While inside, PEFT's LoRA layers no longer cast their inputs to the adapter's float32: under the trainer's
    bfloat16 autocast (entered around each pass, so the float32 weights it casts are cast afresh after every optimizer
    step) their products run in bfloat16 on the activations as they are. Every pass inside must run under autocast:
    GRPO's backend sampling enters its own (:func:`policy.grpo_rollout.backend_rollout`)."""
    if not enabled:
        yield
        return
    from peft.helpers import disable_input_dtype_casting

    with disable_input_dtype_casting(model):
        yield


@contextlib.contextmanager
def packed_attention(model: Any, wanted: str | None) -> Iterator[None]:
    """The model's attention switched to ``wanted`` (:func:`packed_attention_name`) while inside, restored after."""
    previous = model.config._attn_implementation
    if wanted and wanted != previous:
        model.set_attn_implementation(wanted)
    try:
        yield
    finally:
        if model.config._attn_implementation != previous:
            model.set_attn_implementation(previous)


@contextlib.contextmanager
def training_kernels(model: Any, config: Settings, device: str, phase: Phase,
                     lora: bool = False) -> Iterator[Any]:
    """What a phase's training passes run with while inside: the warm start's padding-free attention
    (:func:`packed_attention`), the SDPA kernels of ``attention_kernel`` (:func:`attention_kernels`), LoRA in half
    precision with ``lora`` (:func:`lora_uncast`), with ``compile_scope: layers`` decoder layers compiled one by one
    (:func:`compiled_layers`) and with ``compile_mode: decoder-graph`` the decoder replayed as CUDA graphs
    (:func:`uses_decoder_graph`). Yields the graphed forward (its ``shapes``: passes per captured row width) or None."""
    from policy.accel.decoder_graph import decoder_graphs

    with contextlib.ExitStack() as stack:
        stack.enter_context(lora_uncast(model, lora))
        stack.enter_context(packed_attention(model, packed_attention_name(config, device) if phase == "sft" else None))
        stack.enter_context(attention_kernels(config.accel.attention_kernel, device))
        stack.enter_context(compiled_layers(model, compiles(config, phase) and config.accel.compile_scope == "layers",
                                            compile_mode(config, device)))
        yield stack.enter_context(decoder_graphs(model, uses_decoder_graph(config, device, phase)))


def warm_start_collator(trainer: Any, model: Any, config: Settings, device: str) -> Any:
    """The warm-start trainer's collator, wrapped for what its passes run with: with varlen attention, every row's
    segments padded to a fixed count (:class:`policy.accel.packed_attention.FixedSegments`, so compiled shapes repeat);
    with ``sft_label_selection: index``, the loss positions listed (:class:`policy.accel.label_index.LabelPositions`,
    after checking that the model's head is plain)."""
    collator = trainer.data_collator
    if packed_attention_name(config, device) == "varlen_packed":
        import pyarrow.compute as pc

        from policy.accel.packed_attention import FixedSegments

        longest = pc.max(pc.list_value_length(trainer.train_dataset.data.column("input_ids"))).as_py()
        # the row's padding is one segment too, shorter than the padding multiple
        multiple = padding_multiple(config, "sft") or 1
        collator = FixedSegments(collator, max(longest, multiple - 1))
    if config.accel.sft_label_selection == "index":
        from policy.accel.label_index import LabelPositions, plain_head

        plain_head(causal_lm(model))  # refuses a scaled head now
        collator = LabelPositions(collator)
    return collator
