"""The warm start's loss positions listed beside the batch, so that no training step reads the GPU to find them.

TRL's fused LM head (``add_fused_lm_head``) projects only the positions whose next-token label is not -100, and finds
them on the step with a boolean selection (``hidden[mask]``, ``labels[mask]``, then ``masked_scatter`` back, and the
selection's gradient in the backward pass). A boolean selection on CUDA must read how many positions it keeps before
it can size its output, so each one makes the CPU wait for the GPU: in a profiled warm-start step of the embedded model
on an H200 the CPU waited 19 ms of a 79 ms step at four such reads, and could not issue the backward pass meanwhile
(docs/lab-notes/benchmarks.md). The collator knows the positions already: :class:`LabelPositions` lists them (with their target
tokens) while it collates, on the CPU beside the training loop, and :func:`indexed_log_probs` selects them with
``index_select`` before TRL's own chunked kernel (``trl.kernels.ChunkedLogProbFunction``): the same per-token
log-probabilities, entropies and top-1 flags, nothing read on the step.
"""

from __future__ import annotations

from typing import Any, Callable

INDEX_MULTIPLE = 1024
"""The listed positions are padded to a multiple of this many (position 0, target 0, weight 0), so that the LM head's
tiles and the allocator's blocks see a few sizes instead of one per batch."""

KEYS = ("label_positions", "label_targets", "label_weights")
"""What :class:`LabelPositions` adds to a batch; a training pass takes them out before the model sees the batch."""


class LabelPositions:
    """A causal-LM collator's batches with their loss positions listed: ``label_positions``, the flat index
    (``row * width + column``) of every position whose next token's label is not -100 (the positions TRL's fused head
    projects); ``label_targets``, those next tokens; ``label_weights``, 1 for each and 0 for the padding that rounds
    the list up to a multiple of ``multiple``."""

    def __init__(self, collate: Callable[[list[dict[str, Any]]], dict[str, Any]],
                 multiple: int = INDEX_MULTIPLE) -> None:
        self.collate = collate
        self.multiple = multiple

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        out = self.collate(examples)
        labels = out["labels"]
        following = labels[:, 1:]
        rows, columns = (following != -100).nonzero(as_tuple=True)
        n = rows.numel()
        size = max(self.multiple, -(-n // self.multiple) * self.multiple)
        positions = torch.zeros(size, dtype=torch.long)
        targets = torch.zeros(size, dtype=torch.long)
        weights = torch.zeros(size, dtype=torch.float32)
        positions[:n] = rows * labels.shape[1] + columns
        targets[:n] = following[rows, columns]
        weights[:n] = 1.0
        out.update(label_positions=positions, label_targets=targets, label_weights=weights)
        return out


def plain_head(model: Any) -> Any:
    """The output projection of a causal LM whose logits are the plain projection (no logit scaling, no final
    soft-capping: Llama, Qwen2/3, SmolLM2 and their kind); raises, naming the fix, for any other."""
    config = model.config.get_text_config()
    scaled = [name for name in ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                                "logits_scaling") if getattr(config, name, None) not in (None, 1, 1.0)]
    if scaled:
        raise ValueError(f"train.sft_label_selection = 'index' projects the plain LM head; {type(model).__name__} "
                         f"scales its logits ({', '.join(scaled)}); set train.sft_label_selection to 'mask'")
    return model.get_output_embeddings()


def indexed_log_probs(hidden: Any, head: Any, positions: Any, targets: Any) -> tuple[Any, Any, Any]:
    """Per listed position of ``hidden`` (``(rows, width, hidden size)``, flattened), the log-probability of its target
    under ``head``, the entropy of its next-token distribution and whether the target is its most likely token: TRL's
    chunked kernel, as TRL's fused head calls it, on the positions ``index_select`` takes."""
    from trl.kernels import ChunkedLogProbFunction

    try:
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as chunk
    except ImportError:  # TRL's vocabulary tile, should the private name move
        chunk = 32768
    selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
    selected = selected.to(head.weight.device)
    log_probs, entropy, _, _, is_top1 = ChunkedLogProbFunction.apply(
        selected, head.weight, head.bias, targets.to(head.weight.device), 1.0, chunk, None, 1.0,
        ("log_probs", "entropy", "is_top1"))
    return log_probs, entropy, is_top1
