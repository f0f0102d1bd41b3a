import pytest

from policy.grpo_rollout import backend_rollout, cut_completion, longest_prompt


def test_completion_cut():
    assert cut_completion([5, 6, 2, 0, 0], {2}) == [5, 6, 2]  # up to and including the first end token
    assert cut_completion([5, 6, 7], {2}) == [5, 6, 7]


def test_backend_rollout_pads_to_one_shape_and_returns_unpadded_prompts(tiny_model_dir):
    """With the static cache every batch is left-padded to ``prompt_len`` (one compiled shape per stage); TRL gets the
    prompts' own token ids back, completions within the length cap; a prompt longer than ``prompt_len`` is an error."""
    from transformers import AutoModelForCausalLM, AutoTokenizer


    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.train()
    prompts = [[{"role": "user", "content": "go"}], [{"role": "user", "content": "a longer prompt " * 5}]]
    length = longest_prompt(tok, prompts)
    assert length % 64 == 0 and length >= max(len(tok.apply_chat_template(p, add_generation_prompt=True)) for p in prompts)
    rollout = backend_rollout(model, tok, max_new_tokens=5, temperature=1.0, top_p=1.0, seed=3, cache="static",
                              prompt_len=length)
    out = rollout(prompts, None)
    assert out["prompt_ids"] == [tok(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False),
                                     add_special_tokens=False)["input_ids"] for p in prompts]
    assert len(out["completion_ids"]) == 2 and all(1 <= len(c) <= 5 for c in out["completion_ids"])
    assert model.training  # put back in training mode after sampling
    with pytest.raises(ValueError, match="longer than prompt_len"):
        rollout([[{"role": "user", "content": "far too long " * 50}]], None)


def test_backend_rollout_samples_on_the_device_the_model_has_when_called(tiny_model_dir, monkeypatch):
    """The trainer moves the model onto its device after the rollout is built: the backend (its device, hence where
    the prompts go and whether the static, compiled cache is used) is read at sampling time, not at construction. On
    CUDA a backend built too early put every prompt on the CPU and sampled each token there (about 30x slower)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from policy.backends import TransformersBackend

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    built = []
    real = TransformersBackend.from_loaded.__func__
    monkeypatch.setattr(TransformersBackend, "from_loaded",
                        classmethod(lambda cls, loaded, **kw: built.append(loaded.device) or real(cls, loaded, **kw)))
    rollout = backend_rollout(model, tok, max_new_tokens=3, temperature=1.0, top_p=1.0, seed=0)
    assert built == []  # nothing about the model's placement is fixed before the first call
    prompts = [[{"role": "user", "content": "go"}]]
    rollout(prompts, None)
    rollout(prompts, None)
    assert built == ["cpu"]  # one backend per device, reused across steps


def test_backend_rollout_under_autocast_takes_uncast_lora_inputs(tiny_model_dir):
    """train.lora_autocast: LoRA layers of a bfloat16 model with a float32 adapter no longer cast their inputs, so
    sampling must run under autocast (``autocast=True``, entered per call); without it the layers' products fail on
    mixed dtypes."""
    import torch
    from peft import LoraConfig, get_peft_model
    from peft.helpers import disable_input_dtype_casting
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16),
                           LoraConfig(r=4, target_modules="all-linear"))
    prompts = [[{"role": "user", "content": "go"}]] * 2
    with disable_input_dtype_casting(model):
        out = backend_rollout(model, tok, max_new_tokens=3, temperature=1.0, top_p=1.0, seed=0, autocast=True)(prompts, None)
        assert len(out["completion_ids"]) == 2 and all(1 <= len(c) <= 3 for c in out["completion_ids"])
        with pytest.raises(RuntimeError, match="dtype"):
            backend_rollout(model, tok, max_new_tokens=3, temperature=1.0, top_p=1.0, seed=0)(prompts, None)
