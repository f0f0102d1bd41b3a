"""The ``train`` section of ``params.yaml``: what a stage trains (:data:`RECIPES`), who samples GRPO's completions
(:data:`SAMPLERS`), and how fast its passes run (:class:`AccelSettings`). :class:`pipeline.params.Params` holds it
as ``train``; the train step (``steps/train.py``) reads it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.section import SEED_MAX, TEMPERATURE_MIN, Section


Recipe = Literal["grpo", "distill", "distill+grpo"]
RECIPES: dict[str, str] = {
    "grpo": "GRPO on the stage's instances, rewarded by the MAPF reward (the paper's recipe, for capable models)",
    "distill": "a supervised pass over the stage's own instances' solver demonstrations (the sft_* settings)",
    "distill+grpo": "the supervised pass, then GRPO",
}
"""What one stage of training does, by ``train.recipe``; every stage continues from the previous stage's adapter."""


SAMPLERS: dict[str, str] = {
    "auto": "'trl-vllm' on CUDA with vLLM installed, 'backend' on CUDA without it, 'trl' elsewhere",
    "trl": "TRL's own transformers generate",
    "trl-vllm": "TRL's colocated vLLM engine, one per process (data-parallel GRPO too)",
    "backend": "the project's transformers backend (on CUDA a static, compiled KV cache)",
    "vllm-lora": "the project's vLLM engine of the base model, given the adapter as vLLM LoRA each cycle",
    "vllm-merged": "the project's vLLM engine, given the merged weights each cycle",
}
"""``train.sampler``: who samples GRPO's completions (:func:`policy.grpo_rollout.grpo_sampler`)."""
SamplerName = Literal["auto", "trl", "trl-vllm", "backend", "vllm-lora", "vllm-merged"]

GONE_TRAIN_KEYS = {
    "sft": "replaced by recipe ('distill' for the supervised pass alone, 'grpo' for GRPO alone, 'distill+grpo' for "
           "both); remove it and set recipe",
    "grpo": "replaced by recipe ('distill' for the supervised pass alone, 'grpo' for GRPO alone, 'distill+grpo' for "
            "both); remove it and set recipe",
    "use_vllm": "replaced by sampler ('trl-vllm' for TRL's colocated vLLM, which use_vllm: true chose); remove it and "
                "set sampler",
    "grpo_generation": "replaced by sampler (the same values, and 'trl-vllm' for TRL's colocated vLLM); remove it and "
                       "set sampler",
    "continuous_batching": "removed: transformers' continuous batching was measured slower than padded batches "
                           "(docs/lab-notes/benchmarks.md); remove the key",
    "sft_group_by_length": "removed: batches of similar length were measured worse than random batches "
                           "(docs/lab-notes/benchmarks.md); remove the key",
}
"""Keys of the train section that are gone, and what to do instead."""


class AccelSettings(Section):
    """How fast a stage's training passes run (``train.accel``; :mod:`policy.accel`): padding-free supervised
    batches, data loading, recomputation, compilation and kernels. None of them changes what is learnt beyond
    floating-point rounding, except ``sft_drop_last`` (which demonstrations an epoch sees); the defaults suit the CPU
    and one GPU, and what each was measured to do is in docs/lab-notes/benchmarks.md."""

    sft_padding_free: bool = Field(
        False, description="Supervised batches without padding: a batch's demonstrations laid end to end in one row, "
        "each attending only within itself (TRL's padding_free; on CUDA through sft_packed_attention). The same "
        "examples and loss as padded batches.")
    sft_packed_attention: Literal["flex", "varlen"] = Field(
        "varlen", description="Attention over padding-free supervised batches on CUDA: 'varlen' (PyTorch's "
        "variable-length attention; policy/accel/packed_attention.py) or 'flex' (transformers' flex attention with a block "
        "mask); elsewhere the model's own.")
    sft_drop_last: bool = Field(
        False, description="Leave out each supervised epoch's last batch when it is short (a different few "
        "demonstrations each epoch), so a compiled pass is not compiled again for its shape.")
    sft_label_selection: Literal["mask", "index"] = Field(
        "mask", description="How a supervised pass finds the positions its loss is taken at: 'mask' (TRL's fused LM "
        "head, by the labels' mask) or 'index' (the collator lists them, the head takes them by index: nothing read "
        "from the GPU on a step; policy/accel/label_index.py). 'index' needs a plain LM head and, compiled, compile_scope "
        "'layers'.")
    sft_loader_workers: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto", description="Processes that collate the warm start's batches (padding, masks) beside the training "
        "loop (transformers' dataloader_num_workers; the same batches in the same order): 'auto' is 2 on CUDA, where "
        "the training process's own time per step bounds a small model's steps, and 0 (collation in the training "
        "process) elsewhere.")
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto", description="Recompute activations in the backward pass (less memory, more compute); 'auto': on for "
        "CUDA models of 1B parameters or more, off otherwise.")
    lora_autocast: bool | Literal["auto"] = Field(
        "auto", description="On CUDA, LoRA layers take the bfloat16 activations as they are under the trainer's "
        "autocast instead of casting them to the adapter's float32 (PEFT's disable_input_dtype_casting); 'auto': on "
        "with the project's GRPO samplers.")
    torch_compile: bool | Literal["sft", "grpo"] = Field(
        False, description="torch.compile the training passes: true for both phases, 'sft' for the supervised pass "
        "only, 'grpo' for GRPO's only (compile_scope and compile_mode say how).")
    attention_kernel: Literal["auto", "efficient"] = Field(
        "auto", description="The training passes' attention kernel on CUDA: 'auto' (PyTorch's choice) or 'efficient' "
        "(the memory-efficient, then flash, then math kernels; not cuDNN's).")
    compile_scope: Literal["model", "layers"] = Field(
        "model", description="What torch_compile compiles: 'model', the whole model at once (the trainer's "
        "torch_compile; minutes of compilation for the embedded model), or 'layers', each decoder layer on its own "
        "(regional compilation: every layer runs the one compiled code, so compilation takes about one layer's time).")
    compile_mode: Literal["default", "reduce-overhead", "decoder-graph"] = Field(
        "default", description="torch.compile's mode for what torch_compile compiles: 'default', 'reduce-overhead' "
        "(CUDA graphs) or 'decoder-graph' (with compile_scope 'layers': a padding-free supervised row's pass through "
        "the whole decoder replayed as two CUDA graphs per row width; policy/accel/decoder_graph.py).")
    pad_to_multiple_of: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        "auto", description="Pad each training batch's sequences (SFT) and prompts and completions (GRPO) to a multiple "
        "of this many tokens, so a compiled model sees a few shapes instead of one per batch. 'auto': 128 for a "
        "compiled phase (2048 for a compiled warm start's padding-free rows, sft_padding_free), else none (padding "
        "costs compute).")

    @model_validator(mode="after")
    def _decoder_graph(self) -> AccelSettings:
        if self.compile_mode == "decoder-graph" and self.compile_scope != "layers":
            raise ValueError("train.accel.compile_mode = 'decoder-graph' captures a decoder whose layers are compiled one "
                             f"by one; set train.accel.compile_scope to 'layers' (not {self.compile_scope!r})")
        return self

    @model_validator(mode="after")
    def _label_selection(self) -> AccelSettings:
        whole_model = self.torch_compile in (True, "sft") and self.compile_scope == "model"
        if self.sft_label_selection == "index" and whole_model:
            raise ValueError("train.accel.sft_label_selection = 'index' runs the backbone and the LM head apart, which a "
                             "whole compiled model does not; set train.accel.compile_scope to 'layers', or "
                             "train.accel.sft_label_selection to 'mask'")
        return self


class TrainSettings(Section):
    """The train step (``train`` section): what a stage trains (``recipe``: solver distillation, GRPO, or both) on a
    LoRA adapter."""

    recipe: Recipe = Field("distill+grpo", description="What a stage trains: " + "; ".join(
        f"'{k}', {v}" for k, v in RECIPES.items()) + ".")
    lora_r: int = Field(16, ge=1, le=512, description="LoRA rank.")
    lora_alpha: int = Field(32, ge=1, description="LoRA scaling alpha.")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    lora_targets: str | list[str] = Field("all-linear", description="Modules that get LoRA: 'all-linear' or a list of names.")
    sft_epochs: float = Field(1.0, gt=0, le=100, description="Warm-start epochs over the stage's instances.")
    sft_learning_rate: float = Field(1e-3, gt=0, le=1, description="Warm-start learning rate.")
    sft_batch_size: int = Field(16, ge=1, description="Warm-start examples per optimizer step.")
    sft_micro_batch_size: int | None = Field(
        None, ge=1, description="Examples per forward/backward pass of the supervised pass (None: the whole batch, or "
        "with N data-parallel processes an N-th of it); a step accumulates gradients over the passes: memory, not "
        "maths.")
    sft_max_examples: int | None = Field(None, ge=1, description="Use at most this many demonstrations (None: all).")
    log_every: int = Field(
        1, ge=1, description="Warm-start optimizer steps per log line (loss, gradient norm, learning rate, entropy, "
        "token accuracy; the loss history has one point per line). Reading them from a GPU makes the CPU wait for it, "
        "so between log lines the CPU can issue the next steps while the GPU runs the last ones; 1 logs every step.")
    trajectories: int = Field(4000, ge=1, description="GRPO budget: completions generated in the stage (paper: 4,000).")
    num_generations: int = Field(8, ge=2, description="GRPO group size G: completions per prompt.")
    prompts_per_step: int = Field(4, ge=1, description="Prompts per GRPO step (a step sees prompts_per_step * G completions).")
    micro_batch_size: int = Field(32, ge=1, description="Completions per forward/backward pass; a GRPO step accumulates "
                                  "gradients over prompts_per_step * G / micro_batch_size passes (memory, not maths).")
    generation_steps: int = Field(
        1, ge=1, description="GRPO optimizer steps sampled together: 1 samples each step's prompts_per_step * G "
        "completions from the current weights; k > 1 samples k steps' completions in one batch and trains on them over "
        "the next k steps (TRL's steps_per_generation; later steps are then slightly off-policy, corrected by the "
        "clipped importance ratio). Larger generation batches use a GPU better. Must divide the stage's step count, "
        "ceil(trajectories / (prompts_per_step * G)), so the budget stays exact.")
    learning_rate: float = Field(2e-5, gt=0, le=1, description="GRPO learning rate.")
    beta: float = Field(0.0, ge=0, description="KL penalty toward the starting policy (0: none, no reference model kept).")
    max_completion_length: int = Field(160, ge=8, description="GRPO completion length cap in tokens.")
    temperature: float = Field(1.0, ge=TEMPERATURE_MIN, le=100, description="GRPO sampling temperature.")
    threads: int | None = Field(None, ge=1, description="torch CPU threads (None: torch's default).")
    seed: int = Field(0, ge=0, le=SEED_MAX, description="Seed of data order, LoRA initialisation and sampling.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where to train ('auto': CUDA when there is "
                                                   "one; with $ENV_ENGINEER_GPUS, a GPU claimed from that pool).")
    sampler: SamplerName = Field("auto", description="Who samples GRPO's completions: " + "; ".join(
        f"'{k}', {v}" for k, v in SAMPLERS.items()) + ".")
    vllm_gpu_memory: float = Field(0.3, gt=0, le=1, description="With a vLLM sampler ('trl-vllm', 'vllm-lora', "
                                   "'vllm-merged'): share of the GPU's memory the colocated vLLM may take (the trainer "
                                   "keeps the rest).")
    init: Literal["fresh", "start"] = Field(
        "fresh", description="What stage 0 continues from (init-curriculum): 'fresh', a new LoRA adapter seeded by "
        "train.seed (the base model's behaviour), or 'start', the shared starting policy (data/start/adapter, the start "
        "section), whose LoRA shape then replaces lora_r, lora_alpha and lora_targets.")
    accel: AccelSettings = Field(default_factory=AccelSettings, description="How fast the passes run "
                                 "(AccelSettings: padding-free batches, compilation, kernels, recomputation).")
    server: str | None = Field(
        None, description="Address of a warm trainer (`env-engineer train-server`, e.g. http://127.0.0.1:8100) that "
        "trains the stage in one of its processes, kept warm for every experiment (libraries imported, model read, "
        "kernels compiled once), with these settings and the same outputs; None: the step's own process trains it.")

    @field_validator("server")
    @classmethod
    def _server_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"train.server {value!r}: give an http:// address, e.g. http://127.0.0.1:8100, or leave "
                             "it empty to train in the step's own process")
        return value

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            why = {**{key: f"moved to train.accel.{key} (write it under accel:)" for key in AccelSettings.model_fields},
                   **GONE_TRAIN_KEYS}
            gone = [key for key in why if key in data]
            if gone:
                raise ValueError("; ".join(f"train.{key}: {why[key]}" for key in gone))
        return data

    @property
    def distills(self) -> bool:
        """Whether a stage runs the supervised pass over its solver demonstrations."""
        return self.recipe in ("distill", "distill+grpo")

    @property
    def reinforces(self) -> bool:
        """Whether a stage runs GRPO."""
        return self.recipe in ("grpo", "distill+grpo")

    @model_validator(mode="after")
    def _micro_batches(self) -> TrainSettings:
        micro = self.sft_micro_batch_size
        if micro is not None and self.sft_batch_size % micro:
            raise ValueError(f"train.sft_micro_batch_size = {micro} does not divide train.sft_batch_size = "
                             f"{self.sft_batch_size}; set it to a divisor of sft_batch_size (e.g. 1, 2 or 4) or null")
        per_step = self.prompts_per_step * self.num_generations
        if self.reinforces and per_step % self.micro_batch_size:
            raise ValueError(f"train.micro_batch_size = {self.micro_batch_size} does not divide a GRPO step's "
                             f"{per_step} completions (prompts_per_step x num_generations); set it to a divisor of "
                             f"{per_step}")
        steps = -(-self.trajectories // per_step)
        if steps % self.generation_steps:
            raise ValueError(f"train.generation_steps = {self.generation_steps} does not divide the GRPO step count "
                             f"{steps} (ceil(trajectories / (prompts_per_step * num_generations)) = ceil("
                             f"{self.trajectories} / {self.prompts_per_step * self.num_generations})); choose a divisor "
                             f"of {steps}, e.g. 1, or change train.trajectories")
        return self
