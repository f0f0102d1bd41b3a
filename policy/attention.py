"""Attention for fast decoding with a static KV cache on grouped-query models.

With a static cache every decode step carries an attention mask (the cache's unfilled tail is masked), and PyTorch's
fused SDPA kernels take grouped-query attention (fewer key/value heads than query heads) only without a mask. Older
transformers releases (5.17, on the GPU image these measurements come from) then copy every layer's keys and values ``heads / kv_heads`` times
per step (``repeat_kv``): for Qwen3-4B at batch 256 and 512 cached tokens that is about 2 GB per layer per step, and it
made the static (compiled) path slower than the dynamic one there (docs/lab-notes/benchmarks.md). Newer releases avoid the copy
in eager mode but not under ``torch.compile``.

:func:`grouped_decode_sdpa` computes the same attention without the copy when one token is decoded: the ``n_rep``
query heads that share a key/value head become ``n_rep`` query *positions* of that head, so SDPA sees
``(batch, kv_heads, n_rep, dim)`` queries against ``(batch, kv_heads, length, dim)`` keys, and the mask (one row per
sequence) broadcasts over them. Everything else (prefill, training, no grouping) goes to transformers' own SDPA.
It is registered under :data:`NAME` with transformers' attention and mask interfaces.
"""

from __future__ import annotations

from typing import Any

NAME = "sdpa_grouped_decode"
"""The attention implementation's name, for ``model.set_attn_implementation``."""

_SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "flash": "FLASH_ATTENTION", "math": "MATH"}
"""Decode kernel name -> ``torch.nn.attention.SDPBackend`` member."""

DECODE_KERNELS = ("auto", "sdpa", *_SDPA_BACKENDS)
"""Kernels the grouped decode step may be pinned to (:func:`set_decode_kernel`): an SDPA kernel by name, ``sdpa`` for
PyTorch's own choice (cuDNN's flash attention on H100/H200 cards), or ``auto``: the memory-efficient kernel on CUDA
(1.20x and 1.31x cuDNN's tokens/s for the embedded model's shape at batch 512 on an H200, 1.04x for Qwen3-4B's at 256 on
an H100: docs/lab-notes/benchmarks.md), PyTorch's choice elsewhere. A kernel that cannot take the call (its mask, dtype or
device) makes PyTorch raise rather than fall back."""

_decode_kernel = "auto"


def set_decode_kernel(name: str) -> None:
    """Pin the SDPA kernel of the grouped decode step (a benchmark knob; a compiled decode step must be recompiled,
    e.g. with ``policy.backends.forget_compiled``, to see the change)."""
    global _decode_kernel
    if name not in DECODE_KERNELS:
        raise ValueError(f"decode kernel {name!r}: choose one of {', '.join(DECODE_KERNELS)}")
    _decode_kernel = name


def grouped_decode_sdpa(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
                        scaling: float | None = None, is_causal: bool | None = None, **kwargs: Any) -> tuple[Any, None]:
    """Transformers attention-interface function: ``query (b, h, q, d)``, ``key``/``value`` ``(b, kv, L, d)``;
    returns ``(b, q, h, d)``."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    mask_per_sequence = attention_mask is None or attention_mask.shape[1] == 1
    if query.shape[2] != 1 or groups <= 1 or not mask_per_sequence or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    batch, heads, _, dim = query.shape
    packed = query.reshape(batch, heads // groups, groups, dim)  # head kv * groups + r -> position r of head kv
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[2]]
    kernel = ("efficient" if query.is_cuda else "sdpa") if _decode_kernel == "auto" else _decode_kernel
    if kernel == "sdpa":
        out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask,
                                                               dropout_p=dropout, scale=scaling)
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, _SDPA_BACKENDS[kernel])):
            out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask,
                                                                   dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def register() -> str:
    """Register :func:`grouped_decode_sdpa` with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, grouped_decode_sdpa)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return NAME
