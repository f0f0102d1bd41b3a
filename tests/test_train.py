import json

import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from envgen.config import EnvConfig, SizeConfig
from envgen.dataset import write_instances
from envgen.generator import generate
from envgen.parse import ParsedPlan, parse_answer
from envgen.prompt import PromptStyle
from tasks import train as train_mod
from tasks.train import TrainConfig, demonstrations, replace_dir, train


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    cfg = EnvConfig(budget=8, seed=4, sizes={3: SizeConfig(data_ratio=1)})
    path = tmp_path_factory.mktemp("stage") / "instances.parquet"
    write_instances(path, generate(cfg), cfg)
    return path


def tiny(model_dir, **over) -> TrainConfig:
    base = dict(model=str(model_dir), trajectories=8, num_generations=4, prompts_per_step=2, micro_batch_size=4,
                max_completion_length=12, sft_batch_size=4, threads=1, lora_r=4, lora_alpha=8)
    return TrainConfig(**{**base, **over})


def test_demonstrations_are_the_optimal_plans_in_the_answer_format(stage):
    rows = pq.read_table(stage).to_pylist()
    for style in (PromptStyle(moves="letters", trace=True), PromptStyle()):
        demos = demonstrations(rows, style)
        for row, demo in zip(rows, demos):
            parsed = parse_answer(demo["completion"][0]["content"], row["num_agents"])
            assert isinstance(parsed, ParsedPlan)
            assert [" ".join(m) for m in parsed.words()] == row["optimal_plan"]
            assert demo["prompt"][-1]["role"] == "user"


def test_train_writes_adapter_completions_and_metrics_then_continues(tiny_model_dir, stage, tmp_path):
    out = tmp_path / "stage1"
    metrics = train(stage, out / "adapter", out / "completions.parquet", out / "metrics.json", tiny(tiny_model_dir))
    assert (out / "adapter" / "adapter_config.json").exists() and (out / "adapter" / "train_config.json").exists()
    rows = pq.read_table(out / "completions.parquet").to_pylist()
    assert len(rows) == metrics["train/trajectories"] == 8 and {r["step"] for r in rows} <= {0, 1}
    assert all(0.0 <= r["reward"] <= 1.0 for r in rows)
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["sft/examples"] == 8 and saved["sft/loss_first"] > 0 and saved["train/steps"] == 1
    assert set(saved["train/per_size"]) == {"3"}
    # one wall-clock time per optimizer step of each phase (compilation shows in the first ones)
    assert len(saved["sft/step_seconds"]) == saved["sft/steps"] >= 1 and len(saved["train/step_seconds"]) == 1
    assert all(t > 0 for t in saved["sft/step_seconds"] + saved["train/step_seconds"])
    assert sorted(p.name for p in out.iterdir()) == ["adapter", "completions.parquet", "metrics.json"]  # no work dirs left
    second = tmp_path / "stage2"
    more = train(stage, second / "adapter", second / "c.parquet", second / "m.json", tiny(tiny_model_dir, sft=False),
                 init_adapter=out / "adapter")
    assert more["init_adapter"] == str(out / "adapter") and "sft/examples" not in more


def test_a_crash_mid_step_leaves_the_previous_adapter_whole(tiny_model_dir, stage, tmp_path, monkeypatch):
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "adapter_config.json").write_text('{"previous": true}')

    def crash(*args, **kwargs):
        raise RuntimeError("killed mid-GRPO")

    monkeypatch.setattr(train_mod, "grpo", crash)
    with pytest.raises(RuntimeError, match="killed"):
        train(stage, out, tmp_path / "c.parquet", tmp_path / "m.json", tiny(tiny_model_dir, sft=False))
    assert (out / "adapter_config.json").read_text() == '{"previous": true}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_replace_dir_swaps_whole_folders(tmp_path):
    new, dst = tmp_path / "new", tmp_path / "dst"
    new.mkdir()
    dst.mkdir()
    (new / "a").write_text("new")
    (dst / "a").write_text("old")
    replace_dir(new, dst)
    assert (dst / "a").read_text() == "new" and not new.exists() and [p.name for p in tmp_path.iterdir()] == ["dst"]


def test_config_from_params_and_errors(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("train:\n  trajectories: 64\n  prompt: {moves: words, trace: false}\n  reward: {progress: 0.0}\n"
                      "  gradient_checkpointing: no\n")
    cfg = TrainConfig.from_params(params, {"seed": 3})
    assert (cfg.trajectories, cfg.seed, cfg.prompt.moves, cfg.reward.progress, cfg.gradient_checkpointing) == (64, 3, "words", 0.0, False)
    with pytest.raises(ValueError, match="num_generations = 1"):
        TrainConfig.from_params(params, {"num_generations": 1})
    with pytest.raises(ValueError, match="train.prompt"):
        TrainConfig.from_params(None, {"prompt": {"view": "picture"}})
    with pytest.raises(ValueError, match="unknown field"):
        TrainConfig.from_params(None, {"learning_rat": 1e-5})


def test_gradient_checkpointing_auto_follows_device_and_model_size():
    from tasks.train import use_checkpointing

    assert use_checkpointing("auto", "cuda", 4_000_000_000) is True  # Qwen3-4B: 16 x 512 does not fit without it
    assert use_checkpointing("auto", "cuda", 135_000_000) is False  # the embedded model: 1.61x faster without
    assert use_checkpointing("auto", "cpu", 4_000_000_000) is False
    assert use_checkpointing(True, "cpu", 1) is True and use_checkpointing(False, "cuda", 10**10) is False


def test_trainer_arguments_carry_compilation_and_recomputation(tmp_path):
    """``torch_compile`` and ``gradient_checkpointing`` reach the TRL trainers' arguments (compilation itself was run
    through GRPO and SFT on the CPU by hand: 97 s against 12 s eager for the tiny model, the same first loss)."""
    import torch

    from tasks.train import _common_args

    model = torch.nn.Linear(4, 4)
    args = _common_args(TrainConfig(torch_compile=True, gradient_checkpointing=True), "cpu", tmp_path, model, "grpo")
    assert args["torch_compile"] is True and args["gradient_checkpointing"] is True and args["use_cpu"] is True
    assert args["pad_to_multiple_of"] == 128  # 'auto' with compilation: a few shapes, not one per batch
    args = _common_args(TrainConfig(), "cuda", tmp_path, model, "sft")
    assert args["torch_compile"] is False and args["gradient_checkpointing"] is False and args["bf16"] is True
    assert args["pad_to_multiple_of"] is None
    warm_only = TrainConfig(torch_compile="sft", pad_to_multiple_of="auto")  # as params.yaml writes it
    assert _common_args(warm_only, "cuda", tmp_path, model, "sft")["torch_compile"] is True
    assert _common_args(warm_only, "cuda", tmp_path, model, "sft")["pad_to_multiple_of"] == 128
    assert _common_args(warm_only, "cuda", tmp_path, model, "grpo")["torch_compile"] is False
    assert _common_args(warm_only, "cuda", tmp_path, model, "grpo")["pad_to_multiple_of"] is None
    with pytest.raises(ValidationError, match="pad_to_multiple_of"):
        TrainConfig(pad_to_multiple_of=0)
    args = _common_args(TrainConfig(torch_compile=True, pad_to_multiple_of=64), "cuda", tmp_path, model, "grpo")
    assert args["pad_to_multiple_of"] == 64
    from trl import GRPOConfig, SFTConfig

    for kind in (SFTConfig, GRPOConfig):  # both trainers take the setting as it is passed
        assert kind(**{**args, "use_cpu": True, "bf16": False}).pad_to_multiple_of == 64


def test_grpo_samples_through_the_project_backend_reproducibly(tiny_model_dir, stage, tmp_path, monkeypatch):
    """``grpo_generation: backend``: TRL's GRPO gets its completions from the project's transformers backend (the
    trainer's own LoRA model, one completion per repeated prompt), and the same seed samples the same completions."""
    from policy.backends import TransformersBackend

    calls = []
    original = TransformersBackend.generate_ids

    def spy(self, input_ids, *args, **kwargs):
        calls.append(input_ids.shape[0])
        return original(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(TransformersBackend, "generate_ids", spy)
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        metrics = train(stage, out / "adapter", out / "c.parquet", out / "m.json",
                        tiny(tiny_model_dir, sft=False, grpo_generation="backend"))
        assert metrics["train/generation"] == "backend" and metrics["train/trajectories"] == 8
        runs.append([r["completion"] for r in pq.read_table(out / "c.parquet").to_pylist()])
    assert calls == [8, 8]  # one call per generation batch: 2 prompts x G=4, both runs
    assert runs[0] == runs[1] and any(runs[0])


def test_backend_generation_setting_and_completion_cut():
    from tasks.grpo_rollout import cut_completion
    from tasks.train import use_backend_generation

    assert use_backend_generation("auto", "cuda", use_vllm=False) is True
    assert use_backend_generation("auto", "cuda", use_vllm=True) is False
    assert use_backend_generation("auto", "cpu", use_vllm=False) is False
    assert use_backend_generation("backend", "cpu", use_vllm=False) is True and not use_backend_generation("trl", "cuda", False)
    assert cut_completion([5, 6, 2, 0, 0], {2}) == [5, 6, 2]  # up to and including the first end token
    assert cut_completion([5, 6, 7], {2}) == [5, 6, 7]


def test_backend_rollout_pads_to_one_shape_and_returns_unpadded_prompts(tiny_model_dir):
    """With the static cache every batch is left-padded to ``prompt_len`` (one compiled shape per stage); TRL gets the
    prompts' own token ids back, completions within the length cap; a prompt longer than ``prompt_len`` is an error."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.grpo_rollout import backend_rollout, longest_prompt

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
