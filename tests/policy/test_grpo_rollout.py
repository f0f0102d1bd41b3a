import pytest

from policy.grpo_rollout import backend_rollout, cut_completion, longest_prompt
from tests.helpers import train_settings


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


class _FakeVLLM:
    """Records what a vLLM engine is asked; answers each prompt with fixed token ids (an end token in the middle)."""

    def __init__(self, answer):
        from types import SimpleNamespace

        self.answer, self.calls, self.added = answer, [], []
        self.llm_engine = SimpleNamespace(add_lora=self.added.append)  # vLLM's LLMEngine.add_lora

    def generate(self, prompts, params, lora_request=None, use_tqdm=True):
        from pathlib import Path
        from types import SimpleNamespace

        assert self.added[-1] == lora_request  # loaded before generation, timed apart
        name, number, path = lora_request
        files = sorted(p.name for p in Path(path).iterdir())
        self.calls.append({"prompts": [p["prompt_token_ids"] for p in prompts], "params": params, "lora": (name, number),
                           "files": files, "adapter": Path(path).joinpath("adapter_model.safetensors").read_bytes()})
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(self.answer))]) for _ in prompts]


def test_vllm_rollout_hands_the_current_adapter_to_the_engine_every_cycle(tiny_model_dir, tmp_path):
    """train.sampler = 'vllm-lora': each call saves the trainer's adapter as it is then and names it in a new
    LoRA request (new id: vLLM caches adapters by id), removes the previous cycle's copy, sends the chat-templated
    prompts' token ids, and returns completions cut after their first end token; close() removes the copies."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from policy.grpo_rollout import VLLMLoRARollout

    class Rollout(VLLMLoRARollout):  # vLLM's parameter objects, without vLLM
        def sampling_params(self):
            return {"max_tokens": self.max_new_tokens, "temperature": self.temperature}

        @staticmethod
        def lora_request(name, number, path):
            return (name, number, path)

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(r=8, target_modules="all-linear"))
    eos = tok.eos_token_id
    engine = _FakeVLLM([7, 8, eos, 9])
    rollout = Rollout(model, tok, base=tiny_model_dir, work=tmp_path / "adapters", max_new_tokens=4, temperature=1.0,
                      top_p=1.0, seed=0, max_model_len=512, max_num_seqs=4, gpu_memory=0.3, engine=engine)
    assert rollout.lora_rank() == 8
    prompts = [[{"role": "user", "content": "go"}], [{"role": "user", "content": "a longer prompt"}]]
    out = rollout(prompts, None)
    expected = [tok(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
                ["input_ids"] for p in prompts]
    assert out == {"prompt_ids": expected, "completion_ids": [[7, 8, eos]] * 2, "logprobs": None}
    assert engine.calls[0]["prompts"] == expected and engine.calls[0]["params"]["max_tokens"] == 4
    with torch.no_grad():  # an optimizer step changes the adapter: the next cycle must carry the new weights
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(1.0)
    rollout(prompts[:1], None)
    first, second = engine.calls
    assert first["lora"] == ("grpo-cycle-0", 1) and second["lora"] == ("grpo-cycle-1", 2)
    assert "adapter_config.json" in first["files"] and "adapter_model.safetensors" in first["files"]
    assert first["adapter"] != second["adapter"]
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["cycle-1"]  # the previous copy is gone
    assert len(rollout(prompts * 3, None)["completion_ids"]) == 6  # more than max_num_seqs: the engine queues them
    assert [(c["cycle"], c["completions"], c["completion_tokens"]) for c in rollout.cycle_log] == [(0, 2, 6), (1, 1, 3),
                                                                                                   (2, 6, 18)]
    assert set(rollout.seconds) == {"engine_start", "adapter_save", "adapter_load", "generate"}
    rollout.close()
    assert not (tmp_path / "adapters").exists()


@pytest.mark.parametrize("sampler", ["vllm-lora", "vllm-merged"])
def test_vllm_generation_refuses_a_machine_without_cuda(tiny_model_dir, tmp_path, sampler):
    """On the CPU (or without vLLM) 'vllm-lora' and 'vllm-merged' fail before training with the setting's name and
    the fix."""
    from pipeline.params import PolicySettings
    from policy.grpo_rollout import vllm_rollout

    with pytest.raises(ValueError, match=f"train.sampler = '{sampler}'.*set train.sampler to 'auto'"):
        vllm_rollout(None, None, [], train_settings(sampler=sampler), PolicySettings(), "cpu", tmp_path,
                     per_call=32)


def test_vllm_lora_generation_refuses_a_data_parallel_launch(tmp_path, monkeypatch):
    """One engine per trainer: a launch of several processes is refused with the alternatives named."""
    from pipeline.params import PolicySettings
    from policy.grpo_rollout import vllm_rollout

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="2 processes; set train.sampler to 'backend' or 'trl-vllm'"):
        vllm_rollout(None, None, [], train_settings(sampler="vllm-lora"), PolicySettings(), "cuda", tmp_path,
                     per_call=32)


def _lora_model(model_dir, r=8):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(r=r, target_modules="all-linear"))
    with torch.no_grad():  # a fresh adapter's B is zero: give it weights, as after some optimizer steps
        torch.manual_seed(0)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return model


def test_merged_lora_weights_equal_peft_merge_and_leave_the_trainer_unchanged(tiny_model_dir):
    """vllm-merged's weights: W + scaling * B @ A under the base checkpoint's names, the same as PEFT's own merge
    (``merge_and_unload`` on a copy), for every LoRA layer; the trainer's model is not merged or changed."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from policy.grpo_rollout import merged_lora_weights

    model = _lora_model(tiny_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    weights = merged_lora_weights(model)
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    base_names = set(AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict())
    from peft.tuners.lora import LoraLayer

    assert len(weights) == sum(isinstance(m, LoraLayer) for m in model.modules()) > 0
    for name, tensor in weights:
        assert name in base_names
        torch.testing.assert_close(tensor, reference[name])
        assert not torch.equal(tensor, before["base_model.model." + name.replace(".weight", ".base_layer.weight")])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_vllm_merged_rollout_loads_the_current_weights_every_cycle_and_clears_the_prefix_cache(tiny_model_dir, tmp_path):
    """train.sampler = 'vllm-merged': before each generation call the engine's model gets the merged weights of
    that moment (after an optimizer step, different ones) and its prefix cache is cleared; generation gets no LoRA
    request; the per-cycle log counts completions and their tokens."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoTokenizer

    from policy.grpo_rollout import VLLMMergedRollout, merged_lora_weights

    class Model:
        def __init__(self):
            self.loads = []

        def load_weights(self, weights):
            self.loads.extend((n, t.clone()) for n, t in weights)

    class Engine:
        def __init__(self, eos):
            self.events, self.eos = [], eos
            self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(
                driver_worker=SimpleNamespace(model_runner=SimpleNamespace(model=Model()))))

        def reset_prefix_cache(self):
            self.events.append(("reset", len(self.llm_engine.model_executor.driver_worker.model_runner.model.loads)))

        def generate(self, prompts, params, use_tqdm=True, **kwargs):
            self.events.append(("generate", kwargs))
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5, self.eos, 6])]) for _ in prompts]

    class Rollout(VLLMMergedRollout):
        def sampling_params(self):
            return None

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = _lora_model(tiny_model_dir)
    engine = Engine(tok.eos_token_id)
    rollout = Rollout(model, tok, base=tiny_model_dir, work=tmp_path / "w", max_new_tokens=3, temperature=1.0, top_p=1.0,
                      seed=0, max_model_len=256, max_num_seqs=4, gpu_memory=0.3, engine=engine)
    prompts = [[{"role": "user", "content": "go"}]] * 3
    assert rollout(prompts, None)["completion_ids"] == [[5, tok.eos_token_id]] * 3
    loads = engine.llm_engine.model_executor.driver_worker.model_runner.model.loads
    first = dict(loads)
    expected = dict(merged_lora_weights(model))
    assert first.keys() == expected.keys() and all(torch.equal(first[n], expected[n]) for n in expected)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name:
                param.add_(0.1)
    rollout(prompts[:1], None)
    second = dict(loads[len(first):])
    assert all(not torch.equal(first[n], second[n]) for n in expected)
    n = len(expected)
    assert engine.events == [("reset", n), ("generate", {}), ("reset", 2 * n), ("generate", {})]
    assert [(c["cycle"], c["completions"], c["completion_tokens"]) for c in rollout.cycle_log] == [(0, 3, 6), (1, 1, 2)]
    assert rollout.seconds["adapter_merge"] >= 0 and rollout.seconds["adapter_load"] >= 0
    rollout.close()
