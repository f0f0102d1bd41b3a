"""Attention over padding-free training batches with PyTorch's variable-length attention.

A padding-free warm-start batch (TRL's ``padding_free``) lays its demonstrations end to end in one row; each attends
causally within itself. TRL's collator gives the boundaries (``cu_seq_lens_q``: cumulative lengths) and transformers
passes them to the attention function, where :func:`varlen_attention` hands them to
``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 kernels, CUDA only, half precision): no padding is
computed and no mask is built. It is registered under :data:`NAME` with transformers' attention interface and no mask
function, so transformers builds no mask for it.

:class:`FixedSegments` wraps the collator so that a batch's shapes depend only on its padded length: TRL pads the row
to a multiple of ``pad_to_multiple_of`` with position 0s, which makes every pad token a sequence of its own (a
boundaries tensor of varying length), and it gives the batch's longest demonstration as a Python number. Both would
make compiled layers recompile and CUDA graphs record again for nearly every batch.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

NAME = "varlen_packed"
"""The attention implementation's name, for ``model.set_attn_implementation``."""


_CAUSAL: dict[str, Any] = {}
"""``varlen_attn``'s causal switch, found once by :func:`register` (outside compiled code): ``window_size=(-1, 0)``
from torch 2.11, ``is_causal=True`` in 2.10."""


def varlen_kernel(query: Any, key: Any, value: Any, cu_seq: Any, max_len: int, scale: float | None) -> Any:
    """Causal attention of ``(tokens, heads, dim)`` queries, keys and values within the segments ``cu_seq`` delimits
    (``torch.nn.attention.varlen.varlen_attn``)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(query, key, value, cu_seq, cu_seq, max_len, max_len, scale=scale, **_CAUSAL)


def varlen_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
                     scaling: float | None = None, is_causal: bool | None = None, **kwargs: Any) -> tuple[Any, None]:
    """Transformers attention-interface function for one padding-free row: ``query (1, h, T, d)``, ``key``/``value``
    ``(1, kv, T, d)``, the segments in ``cu_seq_lens_q`` and their longest in ``max_length_q``; returns
    ``(1, T, h, d)``. Grouped key/value heads are repeated to the query heads (as transformers' ``repeat_kv``), and
    under autocast the inputs are cast to its dtype (as SDPA is)."""
    import torch

    cu_seq = kwargs.get("cu_seq_lens_q")
    if cu_seq is None or query.shape[0] != 1:
        raise ValueError("varlen attention takes padding-free batches only (one row with cu_seq_lens_q): set "
                         "train.sft_padding_free: true, or train.sft_packed_attention: flex")
    if dropout:
        raise ValueError(f"varlen attention has no dropout (got {dropout}); set the model's attention dropout to 0")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, heads, d)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out = varlen_kernel(q, k, v, cu_seq.to(device=q.device, dtype=torch.int32), int(kwargs["max_length_q"]), scaling)
    return out.unsqueeze(0), None


def register() -> str:
    """Register :func:`varlen_attention` with transformers (idempotent; no mask function, so no mask is built) and
    return its name."""
    from transformers import AttentionInterface

    if not _CAUSAL:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError as error:
            raise RuntimeError("train.sft_packed_attention: varlen needs torch 2.10 or later "
                               "(torch.nn.attention.varlen); use flex") from error
        causal = "window_size" in inspect.signature(varlen_attn).parameters
        _CAUSAL.update({"window_size": (-1, 0)} if causal else {"is_causal": True})
    AttentionInterface.register(NAME, varlen_attention)
    return NAME


class FixedSegments:
    """A padding-free collator's batches with shapes that depend only on the padded row: the trailing pad tokens
    one segment (a zero-length one when there is no padding), so the boundaries of ``n`` demonstrations are always
    ``n + 2`` numbers, and ``longest`` as every batch's longest segment: at least the dataset's longest demonstration
    and the longest padding (the kernel leaves the part of a segment past it unwritten)."""

    def __init__(self, collate: Callable[[list[dict[str, Any]]], dict[str, Any]], longest: int) -> None:
        self.collate = collate
        self.longest = longest

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        out = self.collate(examples)
        cu_seq = out["cu_seq_lens_q"]
        width = out["input_ids"].shape[1]
        n = len(examples)
        tokens = sum(len(e["input_ids"]) for e in examples)
        if int(cu_seq[n]) != tokens:
            raise ValueError(f"a padding-free batch of {n} demonstrations ({tokens} tokens) has boundaries "
                             f"{cu_seq.tolist()[:n + 1]}: not one segment per demonstration (TRL's collator changed?)")
        fixed = torch.cat([cu_seq[: n + 1], torch.tensor([width], dtype=cu_seq.dtype)])
        out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = fixed
        out["max_length_q"] = out["max_length_k"] = max(self.longest, int((fixed[1:] - fixed[:-1]).max()))
        return out
