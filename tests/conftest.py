"""Session fixtures: a tiny randomly initialised causal LM with the embedded model's real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer Llama (hidden 64) saved with SmolLM2's tokenizer and chat template: real I/O, fast generation."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from policy.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("embedded"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
