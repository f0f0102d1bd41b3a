import json

import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from envgen.core.config import EnvConfig, SizeConfig
from envgen.formats.dataset import write_instances
from envgen.generator import generate
from envgen.llm.parse import ParsedPlan, parse_answer
from envgen.llm.prompt import PromptStyle
from pipeline.params import PolicySettings
from pipeline.train_settings import TrainSettings
from policy.accel import kernels as accel_kernels
from policy.accel import options as accel_options
from policy.accel import profile as accel_profile
from steps import train as train_mod
from steps.train import demonstrations, train
from tests.helpers import train_settings


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    cfg = EnvConfig(budget=8, seed=4, sizes={3: SizeConfig(data_ratio=1)})
    path = tmp_path_factory.mktemp("stage") / "instances.parquet"
    write_instances(path, generate(cfg), cfg)
    return path


def tiny(model_dir, **over) -> tuple[TrainSettings, PolicySettings]:
    base = dict(trajectories=8, num_generations=4, prompts_per_step=2, micro_batch_size=4, max_completion_length=12,
                sft_batch_size=4, threads=1, lora_r=4, lora_alpha=8)
    return train_settings(**{**base, **over}), PolicySettings(model=str(model_dir))


def causal_per_segment(q, k, v, cu_seq, max_len, scale):
    """Causal SDPA within each segment of ``cu_seq``: the maths of the CUDA-only varlen kernel
    (``policy.accel.packed_attention.varlen_kernel``), so the padding-free path runs on the CPU."""
    import torch
    import torch.nn.functional as F

    out = torch.zeros_like(q)
    bounds = cu_seq.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            seg = [x[a:b].transpose(0, 1) for x in (q, k, v)]
            out[a:b] = F.scaled_dot_product_attention(*seg, is_causal=True, scale=scale).transpose(0, 1)
    return out


def test_demonstrations_are_the_optimal_plans_in_the_answer_format(stage):
    rows = pq.read_table(stage).to_pylist()
    for style in (PromptStyle(moves="letters", trace=True), PromptStyle()):
        demos = demonstrations(rows, style)
        for row, demo in zip(rows, demos):
            parsed = parse_answer(demo["completion"][0]["content"], row["num_agents"])
            assert isinstance(parsed, ParsedPlan)
            assert [" ".join(m) for m in parsed.words()] == row["optimal_plan"]
            assert demo["prompt"][-1]["role"] == "user"


def test_train_writes_adapter_completions_and_metrics_then_continues(tiny_model_dir, stage, tmp_path, monkeypatch, capsys):
    import policy.accel.profile

    monkeypatch.setattr(policy.accel.profile, "SLOW_STEP_SECONDS", 0.0)  # every GRPO step says where its time went
    out = tmp_path / "stage1"
    metrics = train(stage, out / "adapter", out / "completions.parquet", out / "metrics.json", *tiny(tiny_model_dir),
                    out_details=out / "details.json", out_sft_history=out / "sft.json", out_grpo_history=out / "grpo.json")
    assert (out / "adapter" / "adapter_config.json").exists() and (out / "adapter" / "train_config.json").exists()
    rows = pq.read_table(out / "completions.parquet").to_pylist()
    assert len(rows) == metrics["train/trajectories"] == 8 and {r["step"] for r in rows} <= {0, 1}
    assert all(0.0 <= r["reward"] <= 1.0 for r in rows)
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["sft/examples"] == 8 and saved["sft/loss_first"] > 0 and saved["train/steps"] == 1
    # the metrics file holds numbers only (what `dvc metrics show` lists); tables and text are in the details
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in saved.values()) and len(saved) < 30
    details = json.loads((out / "details.json").read_text())
    assert set(details["train/per_size"]) == {"3"} and details["model"] == str(tiny_model_dir)
    # one wall-clock time per optimizer step of each phase (compilation shows in the first ones)
    assert len(details["sft/step_seconds"]) == details["sft/steps"] >= 1 and len(details["train/step_seconds"]) == 1
    assert all(t > 0 for t in details["sft/step_seconds"] + details["train/step_seconds"])
    # where GRPO's time went, by TRL's own profiling points (generation, rewards, log-probabilities, loss, the rest)
    phases = details["train/phase_seconds"]
    assert {"transformers.generate", "_calculate_rewards", "compute_loss", "_prepare_inputs"} <= set(phases), phases
    assert phases["other (backward, optimizer, between)"] >= 0 and phases["transformers.generate"] > 0
    per_step = details["train/step_phase_seconds"]  # the same per step, printed as each step ended
    assert len(per_step) == 1 and per_step[0]["transformers.generate"] == phases["transformers.generate"]
    assert "train (GRPO) step 1: " in capsys.readouterr().err
    # one file per curve, each a list of {step, value} rows (what `dvc plots show` draws)
    sft = json.loads((out / "sft.json").read_text())
    grpo = json.loads((out / "grpo.json").read_text())
    assert [r["step"] for r in sft] == list(range(1, len(sft) + 1)) and all(r["loss"] > 0 for r in sft) and sft
    assert grpo and all({"step", "reward", "valid"} <= set(r) for r in grpo)
    assert sorted(p.name for p in out.iterdir()) == ["adapter", "completions.parquet", "details.json", "grpo.json",
                                                      "metrics.json", "sft.json"]  # no work dirs left
    second = tmp_path / "stage2"
    more = train(stage, second / "adapter", second / "c.parquet", second / "m.json", *tiny(tiny_model_dir, recipe="grpo"),
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
        train(stage, out, tmp_path / "c.parquet", tmp_path / "m.json", *tiny(tiny_model_dir, recipe="grpo"))
    assert (out / "adapter_config.json").read_text() == '{"previous": true}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_peak_gpu_memory_is_recorded_on_cuda_only(monkeypatch):
    import torch

    assert train_mod.gpu_memory("cpu") == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**29)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 5 * 2**30)
    assert train_mod.gpu_memory("cuda") == {"gpu/peak_allocated_gib": 1.5, "gpu/peak_reserved_gib": 5.0}
    assert train_mod.gpu_memory("cpu") == {}  # a CPU run records none, whatever the machine has


def test_gradient_checkpointing_auto_follows_device_and_model_size():
    from policy.accel.options import use_checkpointing

    assert use_checkpointing("auto", "cuda", 4_000_000_000) is True  # Qwen3-4B: 16 x 512 does not fit without it
    assert use_checkpointing("auto", "cuda", 135_000_000) is False  # the embedded model: 1.61x faster without
    assert use_checkpointing("auto", "cpu", 4_000_000_000) is False
    assert use_checkpointing(True, "cpu", 1) is True and use_checkpointing(False, "cuda", 10**10) is False


def test_trainer_arguments_hold_compilation_and_recomputation(tmp_path):
    """``torch_compile`` and ``gradient_checkpointing`` reach the TRL trainers' arguments (compilation itself was run
    through GRPO and SFT on the CPU by hand: 97 s against 12 s eager for the tiny model, the same first loss)."""
    import torch

    from policy.accel.trainer import trainer_arguments

    model = torch.nn.Linear(4, 4)
    args = trainer_arguments(train_settings(torch_compile=True, gradient_checkpointing=True), "cpu", tmp_path, model, "grpo")
    assert args["torch_compile"] is True and args["gradient_checkpointing"] is True and args["use_cpu"] is True
    assert args["pad_to_multiple_of"] == 128  # 'auto' with compilation: a few shapes, not one per batch
    args = trainer_arguments(train_settings(), "cuda", tmp_path, model, "sft")
    assert args["torch_compile"] is False and args["gradient_checkpointing"] is False and args["bf16"] is True
    assert args["pad_to_multiple_of"] is None
    warm_only = train_settings(torch_compile="sft", pad_to_multiple_of="auto")  # as params.yaml writes it
    assert trainer_arguments(warm_only, "cuda", tmp_path, model, "sft")["torch_compile"] is True
    assert trainer_arguments(warm_only, "cuda", tmp_path, model, "sft")["pad_to_multiple_of"] == 128
    assert trainer_arguments(warm_only, "cuda", tmp_path, model, "grpo")["torch_compile"] is False
    assert trainer_arguments(warm_only, "cuda", tmp_path, model, "grpo")["pad_to_multiple_of"] is None
    rows = train_settings(torch_compile="sft", sft_padding_free=True)  # a padding-free row is padded as a whole
    assert trainer_arguments(rows, "cuda", tmp_path, model, "sft")["pad_to_multiple_of"] == 2048
    assert trainer_arguments(rows, "cuda", tmp_path, model, "grpo")["pad_to_multiple_of"] is None
    assert trainer_arguments(train_settings(sft_padding_free=True), "cuda", tmp_path, model, "sft")["pad_to_multiple_of"] is None
    grpo_only = train_settings(torch_compile="grpo", pad_to_multiple_of="auto")
    assert trainer_arguments(grpo_only, "cuda", tmp_path, model, "grpo")["torch_compile"] is True
    assert trainer_arguments(grpo_only, "cuda", tmp_path, model, "sft")["torch_compile"] is False
    with pytest.raises(ValidationError, match="pad_to_multiple_of"):
        train_settings(pad_to_multiple_of=0)
    args = trainer_arguments(train_settings(torch_compile=True, pad_to_multiple_of=64), "cuda", tmp_path, model, "grpo")
    assert args["pad_to_multiple_of"] == 64
    from trl import GRPOConfig, SFTConfig

    for kind in (SFTConfig, GRPOConfig):  # both trainers take the setting as it is passed
        assert kind(**{**args, "use_cpu": True, "bf16": False}).pad_to_multiple_of == 64
    # the warm start's batches: pinned and copied without a wait on CUDA, the short last one left out when asked
    sft = trainer_arguments(train_settings(sft_drop_last=True), "cuda", tmp_path, model, "sft")
    assert sft["accelerator_config"] == {"non_blocking": True} and sft["dataloader_pin_memory"] is True
    assert sft["dataloader_drop_last"] is True and sft["dataloader_num_workers"] == 2  # 'auto' on CUDA
    assert trainer_arguments(train_settings(sft_loader_workers=3), "cuda", tmp_path, model, "sft")["dataloader_num_workers"] == 3
    assert trainer_arguments(train_settings(), "cpu", tmp_path, model, "sft")["dataloader_num_workers"] == 0
    # workers are forked, not started as the training process was (a warm trainer is spawned); none, no context
    assert sft["dataloader_multiprocessing_context"] == "fork"
    assert "dataloader_multiprocessing_context" not in trainer_arguments(train_settings(), "cpu", tmp_path, model, "sft")
    assert trainer_arguments(train_settings(), "cuda", tmp_path, model, "grpo")["dataloader_num_workers"] == 0
    with pytest.raises(ValidationError, match="sft_loader_workers"):
        train_settings(sft_loader_workers=-1)
    assert "accelerator_config" not in trainer_arguments(train_settings(), "cpu", tmp_path, model, "sft")
    assert trainer_arguments(train_settings(), "cpu", tmp_path, model, "sft")["dataloader_drop_last"] is False
    grpo_args = trainer_arguments(train_settings(sft_drop_last=True), "cuda", tmp_path, model, "grpo")
    assert "accelerator_config" not in grpo_args and "dataloader_drop_last" not in grpo_args
    config = SFTConfig(**{**sft, "use_cpu": True, "bf16": False})
    assert config.accelerator_config.non_blocking is True and config.dataloader_drop_last is True


def test_warm_start_loader_drops_the_short_batch_and_collates_in_workers(tiny_model_dir, stage, tmp_path):
    """``sft_drop_last``: 8 demonstrations in batches of 3 are 3 steps (3, 3, 2), or 2 without the short one;
    ``sft_loader_workers``: batches collated in a worker process train the same losses."""
    runs = {}
    for name, over in (("plain", {}), ("drop", {"sft_drop_last": True}), ("worker", {"sft_loader_workers": 1})):
        out = tmp_path / name
        runs[name] = train(stage, out / "adapter", out / "c.parquet", out / "m.json",
                           *tiny(tiny_model_dir, recipe="distill", sft_batch_size=3, **over))
    assert {name: m["sft/steps"] for name, m in runs.items()} == {"plain": 3, "drop": 2, "worker": 3}
    # one pass per step, by input shape ("batch x width"): the short batch of 2 only without drop_last
    shapes = {name: m["sft/batch_shapes"] for name, m in runs.items()}
    assert sum(shapes["plain"].values()) == 3 and sum(shapes["drop"].values()) == 2
    assert any(k.startswith("2x") for k in shapes["plain"]) and not any(k.startswith("2x") for k in shapes["drop"])
    assert runs["worker"]["sft/loss_history"] == pytest.approx(runs["plain"]["sft/loss_history"], rel=1e-6)


@pytest.fixture
def generate_calls(monkeypatch) -> list[int]:
    """Rows of every call to the project backend's ``generate_ids`` (the calls still run)."""
    from policy.backends import TransformersBackend

    calls: list[int] = []
    original = TransformersBackend.generate_ids

    def spy(self, input_ids, *args, **kwargs):
        calls.append(input_ids.shape[0])
        return original(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(TransformersBackend, "generate_ids", spy)
    return calls


def test_grpo_samples_through_the_project_backend_reproducibly(tiny_model_dir, stage, tmp_path, generate_calls):
    """``sampler: backend``: TRL's GRPO gets its completions from the project's transformers backend (the
    trainer's own LoRA model, one completion per repeated prompt), and the same seed samples the same completions."""
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        metrics = train(stage, out / "adapter", out / "c.parquet", out / "m.json",
                        *tiny(tiny_model_dir, recipe="grpo", sampler="backend"))
        assert metrics["train/generation"] == "backend" and metrics["train/trajectories"] == 8
        phases = metrics["train/phase_seconds"]  # the project's sampler is one phase of the GRPO profile
        assert phases["backend.generate"] > 0 and phases["backend.generate"] <= phases["_prepare_inputs"]
        runs.append([r["completion"] for r in pq.read_table(out / "c.parquet").to_pylist()])
    assert generate_calls == [8, 8]  # one call per generation batch: 2 prompts x G=4, both runs
    assert runs[0] == runs[1] and any(runs[0])


def test_grpo_through_vllm_lora_trains_on_its_completions_and_stops_the_engine(tiny_model_dir, stage, tmp_path,
                                                                                  monkeypatch):
    """``sampler: vllm-lora`` (an engine that answers like vLLM, as vLLM needs CUDA): TRL trains on the
    completions it returns, one generation call per cycle with the adapter of that moment, the engine is closed after
    training and its timings are in the metrics."""
    import policy.grpo_rollout
    from policy.grpo_rollout import VLLMLoRARollout

    made = []

    class Engine:
        def __init__(self):
            self.lora = []

        def generate(self, prompts, params, lora_request=None, use_tqdm=True):
            from types import SimpleNamespace

            self.lora.append(lora_request[1])
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[11, 12, 13])]) for _ in prompts]

    class Rollout(VLLMLoRARollout):
        def sampling_params(self):
            return None

        @staticmethod
        def lora_request(name, number, path):
            return (name, number, path)

        def close(self):
            self.closed = True
            super().close()

    def fake(model, tok, data, config, policy, device, work, per_call):
        made.append(Rollout(model, tok, base=tiny_model_dir, work=work / "vllm-adapters", max_new_tokens=4,
                            temperature=1.0, top_p=1.0, seed=0, max_model_len=512, max_num_seqs=per_call,
                            gpu_memory=0.3, engine=Engine()))
        return made[-1]

    monkeypatch.setattr(policy.grpo_rollout, "vllm_rollout", fake)
    out = tmp_path / "v"
    metrics = train(stage, out / "adapter", out / "c.parquet", out / "m.json",
                    *tiny(tiny_model_dir, recipe="grpo", sampler="vllm-lora", trajectories=16, generation_steps=2))
    rollout, = made
    assert metrics["train/generation"] == "vllm-lora" and metrics["train/trajectories"] == 16
    assert rollout.engine is None and rollout.closed and rollout.cycles == 1  # 2 steps sampled in one call
    assert metrics["train/vllm_seconds"]["generate"] >= 0 and len(metrics["train/vllm_cycles"]) == 1
    rows = pq.read_table(out / "c.parquet").to_pylist()
    assert len(rows) == 16 and {r["completion"] for r in rows} == {tok_text(tiny_model_dir, [11, 12, 13])}


def tok_text(model_dir, ids):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).decode(ids, skip_special_tokens=True)


def test_the_sampler_setting_resolves_auto_by_device_and_vllm():
    from policy.grpo_rollout import resolve_sampler

    assert resolve_sampler("auto", "cuda", vllm_installed=True) == "trl-vllm"
    assert resolve_sampler("auto", "cuda", vllm_installed=False) == "backend"
    assert resolve_sampler("auto", "cpu", vllm_installed=True) == "trl"
    assert resolve_sampler("backend", "cpu", vllm_installed=False) == "backend"
    assert resolve_sampler("vllm-lora", "cuda", vllm_installed=True) == "vllm-lora"


def test_train_command_takes_params_and_overrides(tiny_model_dir, stage, tmp_path, capsys):
    from steps.train import main

    from tests.helpers import tiny_params, write_params

    params = write_params(tmp_path / "params.yaml", tiny_params(tiny_model_dir))
    out = tmp_path / "out"
    args = ["--params", str(params), "--instances", str(stage), "--out-adapter", str(out / "adapter"),
            "--out-completions", str(out / "c.parquet"), "--out-metrics", str(out / "m.json")]
    assert main(args + ["--set", "train.recipe=distill", "--set", "train.sft_max_examples=4"]) == 0
    assert json.loads((out / "m.json").read_text())["sft/examples"] == 4 and "train/steps" not in json.loads((out / "m.json").read_text())
    assert main(args + ["--set", "train.learning_rat=1"]) == 2
    assert "train.learning_rat" in capsys.readouterr().err


def test_accumulation_keeps_the_global_batch_or_names_the_fix():
    from steps.train import accumulation

    assert accumulation(32, 4, 1, "b") == 8 and accumulation(32, 4, 2, "b") == 4 and accumulation(8, 4, 2, "b") == 1
    with pytest.raises(ValueError, match="train.sft_batch_size: 8 .* 4 process"):
        accumulation(8, 4, 4, "train.sft_batch_size")


def test_data_parallel_launch_on_two_processes(tiny_model_dir, stage, tmp_path):
    """The multi-GPU path on the CPU: two processes (torchrun, gloo) share one global batch (an unset micro-batch is
    half of it each); every process's GRPO completions are gathered and only the main process writes."""
    import os
    import subprocess
    import sys

    from tests.helpers import tiny_params, write_params

    import socket

    params = write_params(tmp_path / "params.yaml", tiny_params(tiny_model_dir))
    out = tmp_path / "out"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
           "-m", "env_engineer", "train", "--params", str(params), "--instances", str(stage), "--no-progress",
           "--out-adapter", str(out / "adapter"), "--out-completions", str(out / "c.parquet"),
           "--out-metrics", str(out / "m.json"), "--out-details", str(out / "d.json"),
           "--set", "train.sft_batch_size=4", "--set", "train.trajectories=8",
           "--set", "train.num_generations=4", "--set", "train.prompts_per_step=2", "--set", "train.micro_batch_size=4",
           "--set", "train.max_completion_length=8", "--set", "train.threads=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    ranks = ["\n".join(line for line in proc.stderr.splitlines() if f"[rank{r}]" in line) for r in (0, 1)]
    # a crash in one process ends the other too: show each one's own lines, then the launcher's summary
    assert proc.returncode == 0, (ranks[0][-3000:] + "\n...\n" + ranks[1][-3000:] + "\n...\n" + proc.stdout[-2000:]
                                  + "\n".join(line for line in proc.stderr.splitlines() if line.startswith("error"))[-2000:] + proc.stderr[-2000:])
    metrics = json.loads((out / "m.json").read_text())
    assert metrics["processes"] == 2 and metrics["sft/tokens"] > 0 and metrics["sft/steps"] >= 1
    assert len(pq.read_table(out / "c.parquet")) == metrics["train/trajectories"] == 8  # both processes' completions
    assert (out / "adapter" / "adapter_config.json").exists()
    assert sorted(p.name for p in out.iterdir()) == ["adapter", "c.parquet", "d.json", "m.json"]
    assert "'loss':" not in proc.stdout + proc.stderr  # no log printed as a dictionary (transformers' PrinterCallback)
    # a global batch the processes cannot share is refused, naming the field
    proc = subprocess.run(cmd + ["--set", "train.sft_micro_batch_size=4"], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode != 0 and "train.sft_batch_size: 4 per optimizer step" in proc.stderr + proc.stdout


def test_generation_steps_sample_several_steps_at_once_within_the_budget(tiny_model_dir, stage, tmp_path, generate_calls):
    """``generation_steps: 2``: one generation batch holds two optimizer steps' completions (TRL's
    steps_per_generation), the stage still trains its 2 steps on exactly the trajectory budget."""
    out = tmp_path / "k2"
    metrics = train(stage, out / "adapter", out / "c.parquet", out / "m.json",
                    *tiny(tiny_model_dir, recipe="grpo", sampler="backend", trajectories=16, generation_steps=2))
    assert generate_calls == [16]  # 2 steps x 2 prompts x G=4 in one call
    assert metrics["train/steps"] == 2 and metrics["train/trajectories"] == 16
    assert len(pq.read_table(out / "c.parquet")) == 16
    with pytest.raises(ValidationError, match="generation_steps = 3 does not divide the GRPO step count 2"):
        train_settings(trajectories=16, prompts_per_step=2, num_generations=4, micro_batch_size=4, generation_steps=3)


def test_padding_free_warm_start_trains_the_same_loss(tiny_model_dir, stage, tmp_path):
    """``sft_padding_free``: a batch's demonstrations end to end in one row, attention within each: the first step's
    loss (before any update, same data order) equals the padded batch's."""
    losses = {}
    for free in (False, True):
        out = tmp_path / str(free)
        metrics = train(stage, out / "adapter", out / "c.parquet", out / "m.json",
                        *tiny(tiny_model_dir, recipe="distill", sft_padding_free=free))
        losses[free] = metrics["sft/loss_first"]
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)


@pytest.mark.parametrize("every, micro, free", [(1, None, False), (2, None, False), (1, 2, False), (1, None, True)])
def test_deferred_metrics_log_what_trl_logs(tiny_model_dir, stage, tmp_path, monkeypatch, every, micro, free):
    """The warm start's trainer keeps TRL's per-pass metrics on the device until a log line reads them: its log lines
    (loss, gradient norm, entropy, token accuracy, tokens seen) equal those of TRL's own SFTTrainer, logging every step
    or every other step, with one pass per step or gradients accumulated over two, padded or padding-free rows, and it
    never runs TRL's compute_loss on this path."""
    from trl import SFTTrainer

    deferred = train_mod.deferred_metrics_trainer
    made, trl_calls = {}, []

    class Trl(SFTTrainer):  # TRL's own compute_loss and metrics, with what warm_start reads of its trainer
        batch_shapes: dict = {}

        def tokens_seen(self):
            return int(self._total_train_tokens)

    original = SFTTrainer.compute_loss

    def counted(self, *args, **kwargs):
        trl_calls.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(SFTTrainer, "compute_loss", counted)
    metrics = {}
    for name, factory in (("trl", lambda: Trl), ("deferred", deferred)):
        def capturing(factory=factory, name=name):
            class Captured(factory()):
                def __init__(self, *args, **kwargs):
                    super().__init__(*args, **kwargs)
                    made[name] = self
            return Captured

        monkeypatch.setattr(train_mod, "deferred_metrics_trainer", capturing)
        out = tmp_path / name
        metrics[name] = train(stage, out / "adapter", out / "c.parquet", out / "m.json",
                              *tiny(tiny_model_dir, recipe="distill", sft_epochs=2, log_every=every,
                                    sft_micro_batch_size=micro, sft_padding_free=free),
                              out_sft_history=out / "history.json")
    passes = made["trl"].state.global_step * (4 // (micro or 4))  # sft_batch_size 4
    assert set(trl_calls) == {"Captured"} and len(trl_calls) == passes  # TRL's own, once per pass
    lines = {name: [h for h in trainer.state.log_history if "loss" in h] for name, trainer in made.items()}
    steps = made["trl"].state.global_step
    assert steps == 4 and len(lines["trl"]) == len(lines["deferred"]) == steps // every
    for ours, theirs in zip(lines["deferred"], lines["trl"]):
        for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens", "learning_rate", "step"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5), key
    assert metrics["deferred"]["sft/tokens"] == metrics["trl"]["sft/tokens"] == lines["trl"][-1]["num_tokens"] > 0
    history = json.loads((tmp_path / "deferred" / "history.json").read_text())
    assert [h["step"] for h in history] == [every * (i + 1) for i in range(steps // every)]


@pytest.mark.parametrize("micro, free", [(None, False), (2, False), (None, True)])
def test_label_positions_by_index_train_what_the_mask_trains(tiny_model_dir, stage, tmp_path, monkeypatch, micro,
                                                              free):
    """``sft_label_selection: index``: the collator lists the loss positions and every pass takes the LM head there
    by index (policy/accel/label_index.py); the logged loss, gradient norm, entropy, token accuracy and tokens equal those of
    TRL's fused head selecting them by mask, padded or padding-free rows, one pass per step or two."""
    import policy.accel.label_index as index_mod

    calls = []
    original = index_mod.indexed_log_probs

    def counted(*args, **kwargs):
        calls.append(args[2].numel())
        return original(*args, **kwargs)

    monkeypatch.setattr(index_mod, "indexed_log_probs", counted)
    made = []
    deferred = train_mod.deferred_metrics_trainer

    def capturing():
        class Captured(deferred()):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                made.append(self)
        return Captured

    monkeypatch.setattr(train_mod, "deferred_metrics_trainer", capturing)
    lines = {}
    for selection in ("mask", "index"):
        out = tmp_path / selection
        train(stage, out / "adapter", out / "c.parquet", out / "m.json",
              *tiny(tiny_model_dir, recipe="distill", sft_epochs=2, sft_micro_batch_size=micro, sft_padding_free=free,
                    sft_label_selection=selection))
        lines[selection] = [h for h in made[-1].state.log_history if "loss" in h]
    assert len(lines["index"]) == len(lines["mask"]) == 4
    for ours, theirs in zip(lines["index"], lines["mask"]):
        for key in ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens", "step"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5), key
    assert len(calls) == 4 * (4 // (micro or 4)) and all(n % index_mod.INDEX_MULTIPLE == 0 for n in calls)


def test_label_positions_by_index_run_under_the_trainers_autocast(tiny_model_dir, stage, tmp_path, monkeypatch):
    """With mixed precision (bfloat16, as on CUDA; forced here on the CPU) accelerate enters autocast only around the
    model's own forward; the passes that take the head by index, which call the backbone and the head themselves,
    run under it too, and train about the loss the mask's passes train."""
    import torch

    import policy.accel.label_index as index_mod

    states = []
    original = index_mod.indexed_log_probs

    def spied(hidden, *args, **kwargs):
        states.append(torch.is_autocast_enabled("cpu"))
        return original(hidden, *args, **kwargs)

    monkeypatch.setattr(index_mod, "indexed_log_probs", spied)
    common = train_mod.trainer_arguments
    monkeypatch.setattr(train_mod, "trainer_arguments", lambda *a, **k: {**common(*a, **k), "bf16": True})
    losses = {}
    for selection in ("mask", "index"):
        out = tmp_path / selection
        losses[selection] = train(stage, out / "adapter", out / "c.parquet", out / "m.json",
                                  *tiny(tiny_model_dir, recipe="distill", sft_label_selection=selection))["sft/loss_first"]
    assert states and all(states)
    assert losses["index"] == pytest.approx(losses["mask"], rel=2e-2)


def test_packed_attention_switches_on_cuda_only_and_restores(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from policy.accel.kernels import packed_attention
    from policy.accel.options import packed_attention_name

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    flex, varlen = train_settings(sft_padding_free=True, sft_packed_attention="flex"), train_settings(sft_padding_free=True)
    for config, device, expected in ((flex, "cuda", "flex_attention"), (varlen, "cuda", "varlen_packed"),
                                     (flex, "cpu", "sdpa"), (varlen, "cpu", "sdpa"), (train_settings(), "cuda", "sdpa")):
        with packed_attention(model, packed_attention_name(config, device)):
            assert model.config._attn_implementation == expected
        assert model.config._attn_implementation == "sdpa"


def test_varlen_attention_trains_the_padded_loss_with_fixed_shapes(tiny_model_dir, stage, tmp_path, monkeypatch):
    """``sft_packed_attention: varlen``: the padding-free row goes to PyTorch's variable-length attention with the
    demonstrations' boundaries, always ``n + 2`` of them (the row's padding one segment) and one longest length, and
    the first step's loss equals the padded batch's. The CUDA kernel is replaced here by causal SDPA per segment (the
    same maths), so everything around it runs on the CPU; a wrong boundary or head layout changes the loss."""
    import policy.accel.packed_attention as packed

    calls = []

    def per_segment(q, k, v, cu_seq, max_len, scale):
        bounds = cu_seq.tolist()
        calls.append((len(bounds), max_len, bounds[-1]))
        assert all(b - a <= max_len for a, b in zip(bounds[:-1], bounds[1:]))
        return causal_per_segment(q, k, v, cu_seq, max_len, scale)

    monkeypatch.setattr(packed, "varlen_kernel", per_segment)
    monkeypatch.setitem(accel_options.PACKED_ATTENTION["varlen"], "cpu", "varlen_packed")
    losses = {}
    for name, over in (("padded", {}), ("varlen", {"sft_padding_free": True, "sft_packed_attention": "varlen",
                                                  "pad_to_multiple_of": 512})):
        out = tmp_path / name
        losses[name] = train(stage, out / "adapter", out / "c.parquet", out / "m.json",
                             *tiny(tiny_model_dir, recipe="distill", **over))["sft/loss_first"]
    assert losses["varlen"] == pytest.approx(losses["padded"], rel=1e-4)
    # 2 steps of 4 demonstrations: 6 boundaries, rows a multiple of 512 wide (padding longer than a demonstration)
    assert calls and {(n, width % 512) for n, _, width in calls} == {(6, 0)} and len({m for _, m, _ in calls}) == 1


def test_decoder_graph_trains_the_varlen_loss_through_one_capture_per_width(tiny_model_dir, stage, tmp_path,
                                                                            monkeypatch):
    """``compile_mode: decoder-graph``: each padding-free row's pass goes through the decoder stack captured for its
    width, captured once per width, and the losses are those of the plain varlen passes. CUDA graphs need CUDA, so
    the capture is a stand-in that returns the stack itself (what the graphs record), the varlen kernel causal SDPA
    per segment; a stack that differs from the decoder's own forward changes the losses. The same with the LM head
    taken at the collator's listed positions after the stack (``sft_label_selection: index``)."""
    import policy.accel.decoder_graph as graph_mod
    import policy.accel.packed_attention as packed

    captured = []

    def stand_in(stack, sample):
        captured.append(tuple(tuple(a.shape) for a in sample))
        return stack

    monkeypatch.setattr(packed, "varlen_kernel", causal_per_segment)
    monkeypatch.setitem(accel_options.PACKED_ATTENTION["varlen"], "cpu", "varlen_packed")
    monkeypatch.setattr(graph_mod, "cuda_capture", stand_in)
    plain = uses = accel_kernels.uses_decoder_graph
    monkeypatch.setattr(accel_kernels, "uses_decoder_graph", lambda config, device, phase: phase == "sft" and (
        config.accel.compile_mode == "decoder-graph" or plain(config, device, phase)))
    free = {"sft_padding_free": True, "pad_to_multiple_of": 512, "sft_epochs": 2, "compile_scope": "layers"}
    losses, details = {}, {}
    for name, mode, selection in (("varlen", "default", "mask"), ("graph", "decoder-graph", "mask"),
                                  ("graph-index", "decoder-graph", "index")):
        out = tmp_path / name
        metrics = train(stage, out / "adapter", out / "c.parquet", out / "m.json",
                        *tiny(tiny_model_dir, recipe="distill", compile_mode=mode, sft_label_selection=selection, **free),
                        out_details=out / "d.json")
        losses[name] = metrics["sft/loss_first"], metrics["sft/loss_last"]
        details[name] = json.loads((out / "d.json").read_text())
    assert losses["graph"] == pytest.approx(losses["varlen"], rel=1e-5)
    assert losses["graph-index"] == pytest.approx(losses["varlen"], rel=1e-5)  # the head by index after the graphs
    assert "sft/decoder_graph_passes" not in details["varlen"]
    passes = details["graph"]["sft/decoder_graph_passes"]
    assert sum(passes.values()) == details["graph"]["sft/steps"] == 4 and passes == details["graph"]["sft/batch_shapes"]
    # one capture per width: (embeddings, positions, 6 boundaries) of a row a multiple of 512 wide
    assert len(captured) == 2 * len(passes) and all(c[2] == (6,) and c[0][1] % 512 == 0 for c in captured)
    assert uses is plain


def test_profile_env_writes_operator_tables_and_busy_share(tiny_model_dir, stage, tmp_path, monkeypatch):
    import functools

    from steps import train as train_step

    monkeypatch.setenv(accel_profile.PROFILE_ENV, str(tmp_path / "prof"))
    monkeypatch.setattr(train_step, "profile_callback", functools.partial(train_step.profile_callback, first=0, last=1))
    out = tmp_path / "run"
    train(stage, out / "adapter", out / "c.parquet", out / "m.json", *tiny(tiny_model_dir, recipe="distill"))
    summary = json.loads((tmp_path / "prof" / "sft-summary.json").read_text())
    assert summary["steps"] == 2 and summary["wall_s"] > 0 and summary["gpu_kernels_s"] == 0  # the CPU: no kernels
    assert "aten::" in (tmp_path / "prof" / "sft-ops.txt").read_text()


def test_kernel_time_counts_device_events_once():
    """The busy share's kernel time sums the device's events only: a compiled graph's call (a CPU event carrying its
    kernels' time, as with CUDA graphs) and user annotations are not counted again (they doubled it on an H200)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from policy.accel.profile import kernel_microseconds

    events = [SimpleNamespace(device_type=DeviceType.CUDA, self_device_time_total=300.0, is_user_annotation=False),
              SimpleNamespace(device_type=DeviceType.CUDA, self_device_time_total=100.0, is_user_annotation=False),
              SimpleNamespace(device_type=DeviceType.CPU, self_device_time_total=400.0, is_user_annotation=False),
              SimpleNamespace(device_type=DeviceType.CUDA, self_device_time_total=400.0, is_user_annotation=True)]
    assert kernel_microseconds(events) == 400.0


def test_compiled_layers_compiles_each_decoder_layer_and_undoes_it(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from policy.accel.kernels import compiled_layers

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    embedding = model.get_input_embeddings().requires_grad_(False)  # frozen, as under LoRA
    ids = torch.tensor([[5, 6, 7]])
    with compiled_layers(model, True) as layers:
        assert len(layers) == model.config.num_hidden_layers
        assert all(layer._compiled_call_impl is not None for layer in layers)
        # the first layer's input requires grad in a training pass, as every other layer's does (one compilation)
        assert embedding(ids).requires_grad
        with torch.no_grad():
            assert not embedding(ids).requires_grad
    assert all(layer._compiled_call_impl is None for layer in layers)
    assert not embedding(ids).requires_grad
    with compiled_layers(model, False) as layers:
        assert layers == []
    with pytest.raises(ValueError, match="compile_scope to 'model'"), compiled_layers(torch.nn.Linear(2, 2), True):
        pass


def test_compiled_layers_compile_once_for_a_frozen_embeddings_training_pass(tiny_model_dir):
    """Under LoRA the embedding is frozen: without the hook the first layer's input does not require grad where the
    second's does, and each compiled layer compiles twice (a recompilation of about 9 s per shape on an H200)."""
    import torch
    from transformers import AutoModelForCausalLM

    from policy.accel.kernels import compiled_layers

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()
    model.get_input_embeddings().requires_grad_(False)
    ids = torch.tensor([[5, 6, 7, 8]])
    from torch._dynamo.utils import counters

    compilations = []
    for hooked in (True, False):
        torch._dynamo.reset()
        counters.clear()
        with compiled_layers(model, True):
            if not hooked:  # the hook taken off again: the pass as it was
                model.get_input_embeddings()._forward_hooks.clear()
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            compilations.append(counters["stats"]["unique_graphs"])
    assert compilations == [1, 2]


def test_compile_mode_reaches_the_layers_or_the_trainer_on_cuda_only(tmp_path, monkeypatch):
    """``compile_mode: reduce-overhead`` compiles each layer in that mode (scope 'layers') or goes to the trainer's
    ``torch_compile_mode`` (scope 'model'; transformers compiles the whole model whenever a mode is set, so never with
    'layers'), and marks every optimizer step for CUDA graphs; on the CPU it is 'default' throughout."""
    import torch

    from policy.accel.kernels import compiled_layers
    from policy.accel.trainer import graph_steps, trainer_arguments

    graphs = train_settings(torch_compile="sft", compile_scope="layers", compile_mode="reduce-overhead")
    model = torch.nn.Linear(4, 4)
    assert trainer_arguments(graphs, "cuda", tmp_path, model, "sft")["torch_compile_mode"] is None
    whole = train_settings(torch_compile="sft", compile_scope="model", compile_mode="reduce-overhead")
    assert trainer_arguments(whole, "cuda", tmp_path, model, "sft")["torch_compile_mode"] == "reduce-overhead"
    assert trainer_arguments(whole, "cuda", tmp_path, model, "grpo")["torch_compile_mode"] is None  # grpo not compiled
    assert trainer_arguments(whole, "cpu", tmp_path, model, "sft")["torch_compile_mode"] is None
    assert graph_steps(graphs, "cuda", "sft") is not None
    assert graph_steps(graphs, "cuda", "grpo") is None and graph_steps(graphs, "cpu", "sft") is None
    assert graph_steps(train_settings(torch_compile=True), "cuda", "sft") is None
    with pytest.raises(ValidationError, match="compile_mode"):
        train_settings(compile_mode="max-autotune")

    modes = []

    class Layer(torch.nn.Module):
        def compile(self, mode=None):
            modes.append(mode)

    class Model(torch.nn.Module):
        _no_split_modules = ["Layer"]

        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(), Layer()])

    with compiled_layers(Model(), True, "reduce-overhead"):
        pass
    with compiled_layers(Model(), True):
        pass
    assert modes == ["reduce-overhead", "reduce-overhead", None, None]


def test_attention_kernel_efficient_leaves_cudnn_out_on_cuda_only():
    import torch

    from policy.accel.kernels import attention_kernels

    before = torch.backends.cuda.cudnn_sdp_enabled()
    with attention_kernels("efficient", "cuda"):
        assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    for setting, device in (("auto", "cuda"), ("efficient", "cpu")):
        with attention_kernels(setting, device):
            assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_lora_uncast_keeps_activations_as_they_are_and_the_outputs_and_still_learns(tiny_model_dir):
    """train.lora_autocast: LoRA layers stop casting their inputs to the adapter's float32 while inside (restored
    after); under bfloat16 autocast a bfloat16 model with a float32 adapter then computes what it computes with PEFT's
    casts, within bfloat16's precision; and with autocast entered per pass, as the trainer does, an optimizer step
    reaches the next pass (one autocast region around all passes would reuse its first copies of the weights)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer
    from transformers import AutoModelForCausalLM

    from policy.accel.kernels import lora_uncast
    from policy.accel.options import uses_lora_autocast

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False))
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    assert layers and all(m.lora_A["default"].weight.dtype == torch.float32 for m in layers)  # PEFT's default
    ids = torch.randint(0, base.config.vocab_size, (2, 12))

    def forward() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(input_ids=ids).logits.float()

    with torch.no_grad():
        cast = model(input_ids=ids).logits.float()
    with lora_uncast(model, True):
        assert not any(m.cast_input_dtype_enabled for m in layers)
        with torch.no_grad():
            uncast = forward()
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
        (-forward()[..., 0].sum()).backward()
        optimizer.step()
        with torch.no_grad():
            after = forward()
    assert all(m.cast_input_dtype_enabled for m in layers)
    assert torch.allclose(uncast, cast, atol=0.1, rtol=0.05) and (uncast - cast).abs().mean() < 0.02
    assert (after - uncast).abs().mean() > 0.05  # the step changed what the next pass computes
    with lora_uncast(model, False):
        assert all(m.cast_input_dtype_enabled for m in layers)
    assert uses_lora_autocast("auto", "cuda") and uses_lora_autocast(True, "cuda")
    assert not uses_lora_autocast(False, "cuda") and not uses_lora_autocast("auto", "cpu") and not uses_lora_autocast(True, "cpu")


@pytest.mark.parametrize(("cores", "processes", "examples", "expected"), [
    (16, 1, 50_000, 8),  # the starting policy's warm start on a GPU machine: 8 tokenizer processes
    (16, 1, 8_192, 2),
    (16, 1, 8_191, None),  # under two processes' worth: tokenized in this process
    (16, 2, 50_000, 4),  # two training processes share the cores
    (2, 1, 50_000, None),  # a 2-core machine keeps its cores for training
])
def test_tokenizer_processes_follow_the_demonstrations_and_the_cores(monkeypatch, cores, processes, examples, expected):
    monkeypatch.setattr(accel_options.os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(accel_options, "world_size", lambda: processes)
    assert accel_options.tokenizer_processes(examples) == expected
