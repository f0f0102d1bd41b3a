"""Loss positions listed by the collator (policy/accel/label_index.py): the list names exactly the positions TRL's fused head
projects, and the head taken at them by index gives TRL's per-token values."""

import pytest
import torch
from pydantic import ValidationError

from policy.accel.label_index import LabelPositions, indexed_log_probs, plain_head
from tests.helpers import train_settings


def padded_batch(examples):
    """Two rows padded to one width, labels -100 on the prompt and the padding (as TRL's completion-only collator)."""
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.tensor([e["input_ids"] + [0] * (width - len(e["input_ids"])) for e in examples])
    labels = torch.tensor([[-100] * e["prompt"] + e["input_ids"][e["prompt"]:] + [-100] * (width - len(e["input_ids"]))
                           for e in examples])
    return {"input_ids": ids, "labels": labels}


EXAMPLES = [{"input_ids": [5, 6, 7, 8, 9], "prompt": 2}, {"input_ids": [11, 12, 13], "prompt": 1}]


def test_the_list_names_every_position_whose_next_label_counts_and_pads_with_zero_weights():
    out = LabelPositions(padded_batch, multiple=4)(EXAMPLES)
    # row 0 (width 5): next labels 7, 8, 9 at columns 1..3; row 1: next labels 12, 13 at columns 0..1
    assert out["label_positions"].tolist() == [1, 2, 3, 5, 6, 0, 0, 0]
    assert out["label_targets"].tolist() == [7, 8, 9, 12, 13, 0, 0, 0]
    assert out["label_weights"].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    assert out["labels"].shape == (2, 5)  # the collator's own batch is left as it was
    full = LabelPositions(padded_batch, multiple=5)(EXAMPLES)
    assert full["label_positions"].numel() == 5 and full["label_weights"].sum() == 5


def test_the_head_at_the_listed_positions_gives_the_full_projection_values():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(2, 5, 8)
    out = LabelPositions(padded_batch, multiple=4)(EXAMPLES)
    log_probs, entropy, top1 = indexed_log_probs(hidden, head, out["label_positions"], out["label_targets"])
    logp = torch.log_softmax(head(hidden[:, :-1]), dim=-1)
    mask = out["labels"][:, 1:] != -100
    targets = out["labels"][:, 1:][mask]
    expected = logp[mask].gather(1, targets[:, None])[:, 0]
    n = int(mask.sum())
    assert torch.allclose(log_probs[:n], expected, atol=1e-5)
    assert torch.allclose(entropy[:n], -(logp[mask].exp() * logp[mask]).sum(-1), atol=1e-5)
    assert top1[:n].tolist() == (logp[mask].argmax(-1) == targets).tolist()
    # differentiable in the hidden states at the listed positions only
    hidden.requires_grad_()
    lp, _, _ = indexed_log_probs(hidden, head, out["label_positions"], out["label_targets"])
    (lp * out["label_weights"]).sum().backward()
    touched = hidden.grad.abs().sum(-1) > 0
    assert touched[:, :-1].tolist() == mask.tolist() and not touched[:, -1].any()


def test_a_scaled_head_and_a_whole_compiled_model_are_refused_with_the_fix(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert plain_head(model) is model.get_output_embeddings()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping.*sft_label_selection to 'mask'"):
        plain_head(model)
    with pytest.raises(ValidationError, match="compile_scope to 'layers'"):
        train_settings(sft_label_selection="index", torch_compile="sft")
    train_settings(sft_label_selection="index", torch_compile="sft", compile_scope="layers")
    train_settings(sft_label_selection="index", torch_compile="grpo")
