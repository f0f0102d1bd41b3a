"""Pipeline step ``train``: one stage's training, by ``train.recipe`` (:data:`pipeline.params.RECIPES`): a supervised
pass over the stage's own instances' solver demonstrations ('distill'; TRL ``SFTTrainer``, whose per-pass metrics stay
on the device until a log line: :func:`deferred_metrics_trainer`), GRPO with the MAPF reward ('grpo'; TRL
``GRPOTrainer``, configured, not subclassed), or the first then the second ('distill+grpo'), on a LoRA adapter (PEFT)
that continues the previous stage's adapter or starts fresh.

Outputs: the adapter folder (PEFT format; replaced atomically, so a crash never leaves a half-written adapter where
the next stage reads it), every GRPO completion with its reward and failure category (Parquet,
:data:`envgen.schemas.COMPLETIONS`), the headline metrics (JSON of numbers, for ``dvc metrics``: warm-start loss,
reward and validity overall and by quarter, wall time), the details (JSON: model, device, per map size, seconds per
step) and one history per curve (for ``dvc plots``: warm-start loss per step, GRPO reward and validity per step).

Settings: params.yaml's ``policy`` (model, prompt, reward) and ``train`` sections
(:class:`pipeline.params.TrainSettings`). Imports no Prefect, DVC or polars.

Several GPUs: ``accelerate launch --multi_gpu --num_processes N -m env_engineer train ...`` runs it data-parallel
(DDP): each process takes the GPU of its ``LOCAL_RANK``, the batch sizes stay global (``sft_batch_size`` examples and
``prompts_per_step * num_generations`` completions per optimizer step, split over the processes: gradient
accumulation shrinks by N, so they must divide), every process's GRPO completions are gathered, and only the main
process writes the outputs. ``policy.model`` may be any local folder, so a large model's shape can be trained with
random weights (``bench/multigpu.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterator, Literal

from envgen.dataset import parse_instances, read_instances, write_dataset
from envgen.files import atomic_write_text, replace_dir
from envgen.prompt import PromptStyle, build_messages, format_answer
from envgen.rates import group, rates, share
from envgen.reward import MAPFReward, instance_from_text
from envgen.schemas import COMPLETIONS
from pipeline.params import ParamsError, PolicySettings, TrainSettings, add_params_arguments, load_params
from pipeline.progress import trainer_progress
from policy.devices import world_size
from policy.lora import causal_lm, save_adapter
from policy.models import pick_device


class CompletionRecorder:
    """What GRPO rewarded, kept: :class:`envgen.reward.MAPFReward` calls it (``on_score``) with every scored completion;
    it keeps one row per completion with the trainer's step, and logs the batch's valid and parsed rates beside TRL's
    metrics."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def __call__(self, scores: list[Any], texts: list[str], columns: dict[str, Any]) -> None:
        step = int(getattr(columns.get("trainer_state"), "global_step", 0) or 0)
        for k, (s, text) in enumerate(zip(scores, texts)):
            inst = instance_from_text(columns["instance"][k])
            self.rows.append({"step": step, "instance_id": columns["instance_id"][k], "size": columns["size"][k],
                              "num_agents": inst.num_agents, "needs_wait": columns["needs_wait"][k], "completion": text,
                              "reward": s.reward, "parsed": s.parsed, "parse_error": s.parse_error, "valid": s.valid,
                              "optimal": s.optimal, "failure_category": s.failure, "soc": s.soc,
                              "optimal_soc": columns["optimal_soc"][k]})
        log_metric = columns.get("log_metric")
        if log_metric is not None and scores:
            log_metric("mapf/valid_rate", share(s.valid for s in scores))
            log_metric("mapf/parsed_rate", share(s.parsed for s in scores))


def accumulation(batch: int, micro: int, world: int, what: str) -> int:
    """Gradient-accumulation steps so that ``world`` processes of ``micro`` examples each make one ``batch``."""
    if batch % (micro * world):
        raise ValueError(f"{what}: {batch} per optimizer step cannot be split into {world} process(es) x micro-batches "
                         f"of {micro}; choose a batch that is a multiple of {micro * world}")
    return batch // (micro * world)


def demonstrations(rows: list[dict[str, Any]], style: PromptStyle) -> list[dict[str, Any]]:
    """Prompt-completion pairs: each instance's solver-optimal plan written in the exact answer format."""
    out = []
    for row, inst in zip(rows, parse_instances([r["instance"] for r in rows], "the stage's instances")):
        moves = [line.split() for line in row["optimal_plan"]]
        out.append({"prompt": build_messages(inst, style),
                    "completion": [{"role": "assistant", "content": format_answer(inst, moves, style)}]})
    return out


CHECKPOINTING_MIN_PARAMS = 1_000_000_000
"""``gradient_checkpointing: auto`` recomputes activations on CUDA from this many model parameters on (Qwen3-4B did not
fit 16 x 512 tokens per pass in 80 GB without it; the 135M embedded model needs 12 GiB)."""


def use_checkpointing(setting: bool | str, device: str, parameters: int) -> bool:
    """Whether to recompute activations: the setting, or for 'auto' CUDA and a model of at least 1B parameters."""
    if setting != "auto":
        return bool(setting)
    return device == "cuda" and parameters >= CHECKPOINTING_MIN_PARAMS


def _common_args(config: TrainSettings, device: str, work: Path, model: Any, phase: Literal["sft", "grpo"],
                 log_every: int = 1) -> dict[str, Any]:
    cuda = device == "cuda"
    checkpointing = use_checkpointing(config.gradient_checkpointing, device, sum(p.numel() for p in model.parameters()))
    compiled = compiles(config, phase)
    return {"output_dir": str(work), "report_to": "none", "save_strategy": "no", "logging_steps": log_every,
            "seed": config.seed, "bf16": cuda, "use_cpu": not cuda, "gradient_checkpointing": checkpointing,
            "disable_tqdm": True, "torch_compile": compiled and config.compile_scope == "model",
            # transformers compiles the whole model whenever a mode is set, so only with compile_scope 'model'
            "torch_compile_mode": (config.compile_mode if compiled and config.compile_scope == "model"
                                   and compile_mode(config, device) != "default" else None),
            "pad_to_multiple_of": padding_multiple(config, phase), **_loader_args(config, device, phase)}


def _loader_args(config: TrainSettings, device: str, phase: Literal["sft", "grpo"]) -> dict[str, Any]:
    """The warm start's data loader: ``sft_drop_last``, ``sft_loader_workers``, and on CUDA each pinned batch copied
    to the GPU without the CPU waiting for the copy (accelerate's ``non_blocking``; a blocking copy waits for every
    step queued before it). GRPO's loader collates in the training process, as transformers sets it otherwise."""
    if phase != "sft":
        return {"dataloader_num_workers": 0}
    workers = config.sft_loader_workers
    args: dict[str, Any] = {"dataloader_drop_last": config.sft_drop_last,
                            "dataloader_num_workers": (2 if device == "cuda" else 0) if workers == "auto" else workers}
    if device == "cuda":
        args |= {"dataloader_pin_memory": True, "accelerator_config": {"non_blocking": True}}
    return args


def compile_mode(config: TrainSettings, device: str) -> str:
    """torch.compile's mode for the training passes: ``compile_mode`` on CUDA, 'default' elsewhere (CUDA graphs need
    CUDA); 'decoder-graph' compiles in the default mode (:func:`uses_decoder_graph` says where its graphs apply)."""
    return config.compile_mode if device == "cuda" else "default"


def uses_decoder_graph(config: TrainSettings, device: str, phase: Literal["sft", "grpo"]) -> bool:
    """Whether ``phase``'s passes replay the decoder as CUDA graphs (``compile_mode: decoder-graph``,
    policy/decoder_graph.py): a compiled warm start of padding-free rows through varlen attention on CUDA, whose row
    shapes repeat."""
    return (phase == "sft" and compiles(config, phase) and compile_mode(config, device) == "decoder-graph"
            and packed_attention_name(config, device) == "varlen_packed")


def compiles(config: TrainSettings, phase: Literal["sft", "grpo"]) -> bool:
    """Whether ``phase`` runs compiled (``torch_compile``: true for both phases, 'sft' or 'grpo' for that phase only)."""
    return config.torch_compile is True or config.torch_compile == phase


def decoder_layers(model: Any) -> list[Any]:
    """The model's decoder layers: the modules of the classes its ``_no_split_modules`` names (transformers' own list
    of the blocks that repeat)."""
    names = set(getattr(causal_lm(model), "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


@contextlib.contextmanager
def attention_kernels(setting: str, device: str) -> Iterator[None]:
    """The SDPA kernels training may use while inside: ``attention_kernel: efficient`` on CUDA allows the
    memory-efficient, flash and math kernels (in that order of preference) and not cuDNN's; otherwise PyTorch's own
    choice."""
    if setting == "auto" or device != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH], set_priority=True):
        yield


def _embedding_requiring_grad(module: Any, args: Any, output: Any) -> Any:
    """Forward hook for the input embedding: in grad mode its output requires grad (a frozen embedding's would not)."""
    import torch

    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and not output.requires_grad:
        return output.detach().requires_grad_()
    return None


@contextlib.contextmanager
def compiled_layers(model: Any, enabled: bool, mode: str = "default") -> Iterator[list[Any]]:
    """Each decoder layer compiled on its own while inside (``compile_scope: layers``), in torch.compile's ``mode``
    (``compile_mode``), plain again after; raises when the model names no decoder layers (set compile_scope to 'model'
    then). While inside, a training pass's input embeddings require grad: with a frozen embedding (LoRA) the first
    layer's input would not where every other layer's does, and a compiled layer then compiles twice per input shape
    (about 9 s each for the embedded model on an H200; the first layer's input gradient, computed and dropped, costs
    far less)."""
    if not enabled:
        yield []
        return
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"train.compile_scope = 'layers': {type(model).__name__} names no decoder layers "
                         "(_no_split_modules); set train.compile_scope to 'model'")
    for layer in layers:
        # not dynamic=True: compiled dynamic from the start, a warm-start step's first pass took 95 s on an H200 against
        # 17 s, and the epoch's short last batch still recompiled; torch's default compiles the first shape, then
        # once more with the changed dimensions dynamic (two recompilations of about 18 s in a 1,173-step warm start)
        layer.compile(mode=None if mode in ("default", "decoder-graph") else mode)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    hook = embedding.register_forward_hook(_embedding_requiring_grad) if embedding is not None else None
    try:
        yield layers
    finally:
        if hook is not None:
            hook.remove()
        for layer in layers:
            layer._compiled_call_impl = None


def uses_lora_autocast(setting: bool | str, device: str) -> bool:
    """Whether LoRA layers take the half-precision activations as they are (``train.lora_autocast``): on CUDA only,
    where the trainer runs in bfloat16."""
    return device == "cuda" and setting in ("auto", True)


@contextlib.contextmanager
def lora_uncast(model: Any, enabled: bool) -> Iterator[None]:
    """While inside, PEFT's LoRA layers no longer cast their inputs to the adapter's float32: under the trainer's
    bfloat16 autocast (entered around each pass, so the float32 weights it casts are cast afresh after every optimizer
    step) their products run in bfloat16 on the activations as they are. Every pass inside must run under autocast:
    GRPO's backend sampling enters its own (:func:`policy.grpo_rollout.backend_rollout`)."""
    if not enabled:
        yield
        return
    from peft.helpers import disable_input_dtype_casting

    with disable_input_dtype_casting(model):
        yield


@contextlib.contextmanager
def training_kernels(model: Any, config: TrainSettings, device: str, phase: Literal["sft", "grpo"],
                     lora: bool = False) -> Iterator[Any]:
    """What a phase's training passes run with while inside: the warm start's padding-free attention
    (:func:`packed_attention`), the SDPA kernels of ``attention_kernel`` (:func:`attention_kernels`), LoRA in half
    precision with ``lora`` (:func:`lora_uncast`), with ``compile_scope: layers`` decoder layers compiled one by one
    (:func:`compiled_layers`) and with ``compile_mode: decoder-graph`` the decoder replayed as CUDA graphs
    (:func:`uses_decoder_graph`). Yields the graphed forward (its ``shapes``: passes per captured row width) or None."""
    from policy.decoder_graph import decoder_graphs

    with contextlib.ExitStack() as stack:
        stack.enter_context(lora_uncast(model, lora))
        stack.enter_context(packed_attention(model, packed_attention_name(config, device) if phase == "sft" else None))
        stack.enter_context(attention_kernels(config.attention_kernel, device))
        stack.enter_context(compiled_layers(model, compiles(config, phase) and config.compile_scope == "layers",
                                            compile_mode(config, device)))
        yield stack.enter_context(decoder_graphs(model, uses_decoder_graph(config, device, phase)))


PAD_MULTIPLE_WHEN_COMPILED = 128
"""``pad_to_multiple_of: auto`` pads to this many tokens when the model is compiled (TRL's own choice for Neuron, which
also compiles once per shape)."""

ROW_PAD_MULTIPLE_WHEN_COMPILED = 2048
"""``pad_to_multiple_of: auto`` for a compiled warm start's padding-free rows (a batch's demonstrations in one row):
the row is padded as a whole, so 128 gave nearly every row of 64 demonstrations (17,000-25,000 tokens) a width of its
own, compiled and recorded again (steps of about 5 s on an H200); with 2048 the starting policy's 1,172 batches took
three widths, 3.4% of the row padding (docs/lab-notes/benchmarks.md)."""


def padding_multiple(config: TrainSettings, phase: Literal["sft", "grpo"]) -> int | None:
    """The padding multiple handed to TRL for ``phase``: the setting, or for 'auto' in a compiled phase
    PAD_MULTIPLE_WHEN_COMPILED (ROW_PAD_MULTIPLE_WHEN_COMPILED for the warm start's padding-free rows); None when not
    compiled."""
    if config.pad_to_multiple_of != "auto":
        return config.pad_to_multiple_of
    if not compiles(config, phase):
        return None
    return ROW_PAD_MULTIPLE_WHEN_COMPILED if phase == "sft" and config.sft_padding_free else PAD_MULTIPLE_WHEN_COMPILED


@contextlib.contextmanager
def phase_clock(totals: dict[str, float] | None = None) -> Iterator[dict[str, float]]:
    """Seconds spent in each phase of TRL's GRPO step while inside, by TRL's own profiling points (which it otherwise
    reports only to W&B, MLflow or Trackio): generation (``transformers.generate``, ``vLLM.generate``, the project's
    ``backend.generate``), ``_calculate_rewards``, log-probabilities (``_get_per_token_logps_and_entropies``),
    ``compute_loss``, ``_prepare_inputs`` (generation and scoring of a batch) and ``sync_weights``. Nested phases
    count in each enclosing one. ``totals``: the dictionary to add to (a new one when None)."""
    totals = {} if totals is None else totals
    try:
        from trl.extras.profiling import ProfilingContext

        original = ProfilingContext._log_metrics
    except (ImportError, AttributeError):  # a TRL without these profiling points: no profile, training unchanged
        yield totals
        return

    def log_metrics(self: Any, duration: float) -> None:
        owner, _, name = self.name.partition(".")  # TRL names a phase "<trainer class>.<phase>"
        key = name if owner.endswith("Trainer") and name else self.name
        totals[key] = totals.get(key, 0.0) + duration
        original(self, duration)

    ProfilingContext._log_metrics = log_metrics
    try:
        yield totals
    finally:
        ProfilingContext._log_metrics = original


def phase_profile(totals: dict[str, float], step_seconds: list[float]) -> dict[str, float]:
    """The GRPO profile: every phase's seconds, and ``other``: the optimizer steps' time outside generation, scoring
    and the loss's forward pass (``_prepare_inputs`` + ``compute_loss``), i.e. backward, optimizer and overhead."""
    out = {name: round(seconds, 3) for name, seconds in sorted(totals.items())}
    inside = totals.get("_prepare_inputs", 0.0) + totals.get("compute_loss", 0.0)
    out["other (backward, optimizer, between)"] = round(max(0.0, sum(step_seconds) - inside), 3)
    return out


SLOW_STEP_SECONDS = 10.0
"""A GRPO step at least this long prints where its time went as it ends (a run cut short still tells)."""


PROFILE_ENV = "ENV_ENGINEER_TRAIN_PROFILE"
"""Set to a folder to profile optimizer steps 5 to 14 of each training phase with torch.profiler: writes
``<phase>-ops.txt`` (operators by GPU time, then by CPU time) and ``<phase>-summary.json`` (wall seconds of the
profiled steps against the GPU kernels' busy seconds: a small share means the step waits on the CPU)."""


def kernel_microseconds(events: Any) -> float:
    """The GPU kernels' busy microseconds in a profile's averaged events, as torch's own table totals them: the events
    that ran on a device, not the CPU-side events and annotations (a compiled graph's call, an optimizer step) that
    also carry their kernels' time, which summing every event would count twice."""
    from torch.autograd import DeviceType

    return sum(e.self_device_time_total for e in events
               if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False))


def profile_callback(phase: str, first: int = 5, last: int = 14) -> Any:
    """A trainer callback that profiles optimizer steps ``first``..``last`` when $ENV_ENGINEER_TRAIN_PROFILE names a
    folder (None otherwise)."""
    folder = os.environ.get(PROFILE_ENV)
    if not folder:
        return None
    import torch
    from transformers import TrainerCallback

    out = Path(folder)

    class Profile(TrainerCallback):
        def __init__(self) -> None:
            self.prof: Any = None
            self.start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == first and self.prof is None:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                    torch.cuda.synchronize()
                self.prof = torch.profiler.profile(activities=activities)
                self.prof.__enter__()
                self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if self.prof is None or state.global_step != last + 1:
                return
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = time.perf_counter() - self.start
            self.prof.__exit__(None, None, None)
            events = self.prof.key_averages()
            device_us = kernel_microseconds(events)
            out.mkdir(parents=True, exist_ok=True)
            by_gpu = events.table(sort_by="self_device_time_total", row_limit=40) if device_us else ""
            atomic_write_text(out / f"{phase}-ops.txt", by_gpu + "\n\n" + events.table(sort_by="self_cpu_time_total",
                                                                                      row_limit=40))
            summary = {"phase": phase, "steps": last - first + 1, "wall_s": round(wall, 4),
                       "gpu_kernels_s": round(device_us / 1e6, 4), "gpu_busy_share": round(device_us / 1e6 / wall, 4)}
            atomic_write_text(out / f"{phase}-summary.json", json.dumps(summary, indent=2))
            self.prof = None

    return Profile()


def graph_steps(config: TrainSettings, device: str, phase: Literal["sft", "grpo"]) -> Any:
    """With CUDA graphs (``compile_mode: reduce-overhead`` in a compiled phase), a trainer callback that tells torch
    each optimizer step begins a new iteration (``torch.compiler.cudagraph_mark_step_begin``), so the graphs' output
    buffers of the step before may be reused; None otherwise."""
    if not compiles(config, phase) or compile_mode(config, device) != "reduce-overhead":
        return None
    import torch
    from transformers import TrainerCallback

    class GraphSteps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            torch.compiler.cudagraph_mark_step_begin()

    return GraphSteps()


def step_clock(phases: dict[str, float] | None = None, label: str = "", report: bool = False) -> Any:
    """A trainer callback whose ``seconds`` lists the wall seconds of each optimizer step (the first ones hold any
    compilation), so a stage's metrics show where its time went. With ``phases`` (the totals :func:`phase_clock`
    adds to), ``phases_per_step`` lists each step's seconds per phase, and with ``report`` a step of at least
    :data:`SLOW_STEP_SECONDS` prints them on standard error when it ends."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.phases_per_step: list[dict[str, float]] = []
            self._start = 0.0
            self._before: dict[str, float] = {}

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()
            self._before = dict(phases or {})

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - self._start
            self.seconds.append(round(seconds, 3))
            if phases is None:
                return
            step = {k: round(v - self._before.get(k, 0.0), 3) for k, v in sorted(phases.items())
                    if v - self._before.get(k, 0.0) > 0}
            self.phases_per_step.append(step)
            if report and seconds >= SLOW_STEP_SECONDS:
                parts = ", ".join(f"{k} {v:.1f}" for k, v in phase_profile(step, [seconds]).items()
                                  if not k.startswith("_prepare"))
                print(f"{label} step {len(self.seconds)}: {seconds:.1f} s ({parts})", file=sys.stderr, flush=True)

    return StepClock()


PACKED_ATTENTION = {"flex": {"cuda": "flex_attention"}, "varlen": {"cuda": "varlen_packed"}}
"""Attention for padding-free warm-start batches, by ``sft_packed_attention`` and device: flex attention computes only
the blocks on each demonstration's diagonal of the row, where SDPA would take a dense mask over the whole row (correct,
but quadratic in the batch's total length); PyTorch's variable-length attention (policy/packed_attention.py) takes the
boundaries alone. Neither has a backward pass on the CPU, which keeps the model's own (SDPA)."""


def packed_attention_name(config: TrainSettings, device: str) -> str | None:
    """The attention implementation padding-free warm-start batches switch to (None: the model's own)."""
    if not config.sft_padding_free:
        return None
    name = PACKED_ATTENTION[config.sft_packed_attention].get(device)
    if name == "varlen_packed":
        from policy.packed_attention import register

        register()
    return name


@contextlib.contextmanager
def packed_attention(model: Any, wanted: str | None) -> Iterator[None]:
    """The model's attention switched to ``wanted`` (:func:`packed_attention_name`) while inside, restored after."""
    previous = model.config._attn_implementation
    if wanted and wanted != previous:
        model.set_attn_implementation(wanted)
    try:
        yield
    finally:
        if model.config._attn_implementation != previous:
            model.set_attn_implementation(previous)


TOKENIZER_PROCESS_EXAMPLES = 4096
"""Fewest demonstrations per process worth tokenizing in parallel: one process tokenizes about 1,000 demonstrations/s
(TRL's chat-template tokenization; 55 s for the starting policy's 50,000), and a process starts in about a second."""


def tokenizer_processes(examples: int) -> int | None:
    """Processes TRL tokenizes ``examples`` demonstrations with (its ``dataset_num_proc``): None (this process) for
    fewer than 2 x TOKENIZER_PROCESS_EXAMPLES or on a machine of up to 2 cores; else one per TOKENIZER_PROCESS_EXAMPLES
    demonstrations, at most half of this process's share of the cores and at most 8."""
    cores = len(os.sched_getaffinity(0)) // world_size()
    processes = min(8, cores // 2, examples // TOKENIZER_PROCESS_EXAMPLES)
    return processes if processes >= 2 else None


def deferred_metrics_trainer() -> type:
    """TRL's ``SFTTrainer`` with its per-pass metrics (entropy, token accuracy, tokens seen) kept on the device until a
    log line reads them. TRL reads them with ``.item()`` after every forward pass, which makes the CPU wait for the GPU
    before it can issue the backward pass; here they are kept as device tensors and read, all at once, when the trainer
    logs (every ``log_every`` optimizer steps), with the same values TRL would log. Only TRL's plain path is changed
    (one process, the negative log-likelihood through TRL's fused LM head, no custom loss, label smoothing or router
    loss; padded or padding-free rows); any other case, and a TRL without the fused head, runs TRL's own
    ``compute_loss``."""
    from trl import SFTTrainer

    try:
        from trl.trainer.utils import add_fused_lm_head  # noqa: F401  (TRL >= 1.x: the fused outputs used below)
        fused = True
    except ImportError:
        fused = False

    class DeferredMetricsSFTTrainer(SFTTrainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._pending: dict[str, list[Any]] = defaultdict(list)
            self._pending_tokens: list[Any] = []
            self._row_tokens = 0
            # training passes by input shape ("batch x width"): under compilation each shape compiles or records anew
            self.batch_shapes: Counter[str] = Counter()

        def _plain(self, model: Any, inputs: dict[str, Any], return_outputs: bool) -> bool:
            return (fused and model.training and not return_outputs and self.accelerator.num_processes == 1
                    and self.compute_loss_func is None and self.label_smoother is None
                    and self.args.loss_type == "nll" and not self.aux_loss_enabled
                    and ("attention_mask" in inputs or "position_ids" in inputs))

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            from policy.label_index import KEYS

            if model.training and "input_ids" in inputs:
                self.batch_shapes["x".join(map(str, inputs["input_ids"].shape))] += 1
            listed = {key: inputs.pop(key) for key in KEYS if key in inputs}
            if not self._plain(model, inputs, return_outputs):
                return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                            num_items_in_batch=num_items_in_batch)
            import torch

            inputs["use_cache"] = False
            if listed:
                log_probs, entropy, is_top1, weights = self._listed(model, inputs, listed)
                valid = weights.sum()
                log_probs, entropy, is_top1 = log_probs * weights, entropy.detach() * weights, is_top1 * weights
            else:
                outputs = model(**inputs, fused_lm_head=True)
                valid = outputs.label_mask.sum()
                log_probs, entropy, is_top1 = outputs.log_probs, outputs.entropy, outputs.is_top1
            num_tokens = valid if num_items_in_batch is None else num_items_in_batch
            loss = -log_probs.sum() / torch.as_tensor(num_tokens).clamp(min=1)
            # TRL's values: per pass, the mean over the completion's tokens, 0 for a pass without any
            per_token = valid.clamp(min=1)
            self._pending["entropy"].append(entropy.detach().sum() / per_token)
            self._pending["mean_token_accuracy"].append(is_top1.sum() / per_token)
            if "attention_mask" in inputs:
                self._pending_tokens.append(inputs["attention_mask"].sum())
            else:  # a padding-free row: TRL counts its whole width, padding included
                self._row_tokens += inputs["position_ids"].size(1)
            return loss

        def _listed(self, model: Any, inputs: dict[str, Any], listed: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
            """The pass through the backbone and, at the positions the collator listed (policy/label_index.py), the
            LM head: per listed position its log-probability, entropy and top-1 flag, and its weight (0: padding).
            Under the trainer's autocast, which accelerate otherwise enters only around the model's own forward."""
            from policy.label_index import indexed_log_probs

            causal = causal_lm(model)
            inputs.pop("labels", None)
            with self.accelerator.autocast():  # warm_start checked the head (plain_head)
                hidden = causal.base_model(**inputs).last_hidden_state
                selected = indexed_log_probs(hidden, causal.get_output_embeddings(), listed["label_positions"],
                                             listed["label_targets"])
            return (*selected, listed["label_weights"])

        def flush_metrics(self) -> None:
            """Read the kept metrics off the device (one synchronization) into TRL's own metrics."""
            import torch

            for key, values in self._pending.items():
                self._metrics["train"][key].extend(torch.stack(values).tolist())
            self._pending.clear()
            if self._pending_tokens or self._row_tokens:
                if self._pending_tokens:
                    self._total_train_tokens += int(torch.stack(self._pending_tokens).sum())
                self._total_train_tokens += self._row_tokens
                self._pending_tokens.clear()
                self._row_tokens = 0
                self._metrics["train"]["num_tokens"] = [self._total_train_tokens]

        def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
            self.flush_metrics()
            super().log(logs, start_time)

        def tokens_seen(self) -> int:
            """Non-padding tokens of every training pass so far (TRL's ``num_tokens``), every process's."""
            self.flush_metrics()
            return int(self._total_train_tokens)

    return DeferredMetricsSFTTrainer


def warm_start(model, tok, rows, config: TrainSettings, style: PromptStyle, device: str, work: Path,
               progress: bool = True) -> dict[str, Any]:
    """Supervised fine-tuning of the adapter on demonstrations (loss on the completion only)."""
    from datasets import Dataset
    from trl import SFTConfig

    demos = demonstrations(rows[: config.sft_max_examples], style)
    # unset: the whole batch in one pass, or with N processes an N-th of it in each
    micro = config.sft_micro_batch_size or max(1, config.sft_batch_size // world_size())
    args = SFTConfig(**_common_args(config, device, work / "sft", model, "sft", log_every=config.log_every),
                     num_train_epochs=config.sft_epochs,
                     per_device_train_batch_size=micro,
                     gradient_accumulation_steps=accumulation(config.sft_batch_size, micro, world_size(),
                                                              "train.sft_batch_size"),
                     # tokens are counted by the trainer below (TRL's num_tokens), not with a read per pass
                     include_num_input_tokens_seen="no", logging_nan_inf_filter=False,
                     learning_rate=config.sft_learning_rate,
                     lr_scheduler_type="cosine", warmup_steps=0.03, completion_only_loss=True,
                     # padding-free rows are not cut (TRL enforces max_length only on padded batches)
                     max_length=None if config.sft_padding_free else 2048,
                     train_sampling_strategy="group_by_length" if config.sft_group_by_length else "random",
                     padding_free=config.sft_padding_free, dataset_num_proc=tokenizer_processes(len(demos)))
    clock = step_clock()
    callbacks = [c for c in (clock, trainer_progress("train (warm start)", progress), graph_steps(config, device, "sft"),
                             profile_callback("sft")) if c is not None]
    trainer = deferred_metrics_trainer()(model=model, args=args, train_dataset=Dataset.from_list(demos),
                                         processing_class=tok, callbacks=callbacks)
    if packed_attention_name(config, device) == "varlen_packed":
        import pyarrow.compute as pc

        from policy.packed_attention import FixedSegments

        longest = pc.max(pc.list_value_length(trainer.train_dataset.data.column("input_ids"))).as_py()
        # the row's padding is one segment too, shorter than the padding multiple
        multiple = padding_multiple(config, "sft") or 1
        trainer.data_collator = FixedSegments(trainer.data_collator, max(longest, multiple - 1))
    if config.sft_label_selection == "index":
        from policy.label_index import LabelPositions, plain_head

        plain_head(causal_lm(model))  # refuses a scaled head now
        trainer.data_collator = LabelPositions(trainer.data_collator)
    start = time.perf_counter()
    with training_kernels(model, config, device, "sft", uses_lora_autocast(config.lora_autocast, device)) as graphed:
        trainer.train()
    seconds = time.perf_counter() - start
    logged = [h for h in trainer.state.log_history if "loss" in h]
    losses = [h["loss"] for h in logged]
    tokens = trainer.tokens_seen()  # every process's, non-padding
    return {"sft/examples": len(demos), "sft/steps": trainer.state.global_step, "sft/seconds": seconds,
            "sft/tokens": tokens, "sft/tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "sft/loss_first": losses[0] if losses else None, "sft/loss_last": losses[-1] if losses else None,
            "sft/loss_history": losses, "sft/loss_steps": [h["step"] for h in logged], "sft/step_seconds": clock.seconds,
            "sft/batch_shapes": dict(trainer.batch_shapes),
            **({"sft/decoder_graph_passes": dict(graphed.shapes)} if graphed is not None else {})}


def grpo(model, tok, rows, config: TrainSettings, policy: PolicySettings, device: str,
         work: Path, progress: bool = True) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """GRPO on the stage's instances within the trajectory budget."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    instances = parse_instances([r["instance"] for r in rows], "the stage's instances")
    data = [{"prompt": build_messages(inst, policy.prompt), "instance": r["instance"],
             "optimal_soc": r["optimal_soc"], "instance_id": r["instance_id"], "size": r["size"],
             "needs_wait": r["needs_wait"]} for r, inst in zip(rows, instances)]
    per_step = config.prompts_per_step * config.num_generations
    steps = max(1, math.ceil(config.trajectories / per_step))
    # 'auto' never pairs vLLM with the project's backend sampler: TRL would expect vLLM's sampling log-probabilities
    use_vllm = config.use_vllm is True or (config.use_vllm == "auto" and config.grpo_generation in ("auto", "trl")
                                           and device == "cuda" and _has("vllm"))
    extra = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": config.vllm_gpu_memory,
             "vllm_max_model_length": longest_prompt_tokens(tok, data) + config.max_completion_length} if use_vllm else {}
    if config.continuous_batching and not use_vllm:
        extra["use_transformers_continuous_batching"] = True
    rollout_func = None
    backend_sampling = use_backend_generation(config.grpo_generation, device, use_vllm)
    # only with the project's samplers: the backend enters autocast itself and vLLM's never sample from the
    # trainer's model (TRL's own transformers sampling runs outside autocast, where LoRA layers must cast their inputs;
    # TRL's vLLM path was not measured with it)
    lora = uses_lora_autocast(config.lora_autocast, device) and (backend_sampling or config.grpo_generation in VLLM_SAMPLERS)
    if backend_sampling:
        from policy.grpo_rollout import backend_rollout, longest_prompt

        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL
        rollout_func = backend_rollout(model, tok, max_new_tokens=config.max_completion_length,
                                       temperature=config.temperature, top_p=1.0, seed=config.seed, autocast=lora,
                                       prompt_len=longest_prompt(tok, [d["prompt"] for d in data]))
    world = world_size()
    micro = config.micro_batch_size
    passes = accumulation(per_step, micro, world, "train.prompts_per_step x train.num_generations (with "
                          "train.micro_batch_size completions per pass)")
    if config.grpo_generation in VLLM_SAMPLERS:
        rollout_func = vllm_rollout(model, tok, data, config, policy, device, work,
                                    per_call=micro * passes * config.generation_steps)
    args = GRPOConfig(**_common_args(config, device, work / "grpo", model, "grpo"), per_device_train_batch_size=micro,
                      gradient_accumulation_steps=passes, steps_per_generation=passes * config.generation_steps,
                      num_generations=config.num_generations, max_steps=steps, learning_rate=config.learning_rate,
                      beta=config.beta, max_completion_length=config.max_completion_length, temperature=config.temperature,
                      remove_unused_columns=False, lr_scheduler_type="constant", **extra)
    recorder = CompletionRecorder()
    reward = MAPFReward(policy.reward, on_score=recorder)
    phases: dict[str, float] = {}
    clock = step_clock(phases, "train (GRPO)", report=progress)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=Dataset.from_list(data),
                          processing_class=tok, rollout_func=rollout_func,
                          callbacks=[c for c in (clock, trainer_progress("train (GRPO)", progress),
                                                 graph_steps(config, device, "grpo"),
                                                 profile_callback("grpo")) if c is not None])
    start = time.perf_counter()
    try:
        with phase_clock(phases), training_kernels(model, config, device, "grpo", lora):
            trainer.train()
    finally:
        if hasattr(rollout_func, "close"):
            rollout_func.close()
    seconds = time.perf_counter() - start
    rows = recorder.rows
    if world > 1:  # each process scored its own share of the completions
        from accelerate.utils import gather_object

        rows = gather_object(rows)
    metrics = summarize_grpo(rows, steps, seconds, use_vllm)
    metrics["train/step_seconds"] = clock.seconds
    metrics["train/phase_seconds"] = phase_profile(phases, clock.seconds)
    metrics["train/step_phase_seconds"] = clock.phases_per_step
    metrics["train/generation"] = ("vllm" if use_vllm else config.grpo_generation if config.grpo_generation in VLLM_SAMPLERS
                                   else "backend" if rollout_func is not None else "trl")
    if hasattr(rollout_func, "seconds"):
        metrics["train/vllm_seconds"] = {k: round(v, 3) for k, v in rollout_func.seconds.items()}
        metrics["train/vllm_cycles"] = list(rollout_func.cycle_log)
    return metrics, rows


VLLM_SAMPLERS = ("vllm-lora", "vllm-merged")
"""``train.grpo_generation`` values that sample through the project's own vLLM engine (policy/grpo_rollout.py)."""


def vllm_rollout(model: Any, tok: Any, data: list[dict[str, Any]], config: TrainSettings, policy: PolicySettings,
                 device: str, work: Path, per_call: int) -> Any:
    """GRPO's sampler for ``train.grpo_generation: vllm-lora`` (:class:`policy.grpo_rollout.VLLMLoRARollout`) or
    ``vllm-merged`` (:class:`policy.grpo_rollout.VLLMMergedRollout`), after checking that it can run here: CUDA, one
    process, and vLLM importable."""
    name = config.grpo_generation
    if device != "cuda":
        raise ValueError(f"train.grpo_generation = '{name}' samples with vLLM, which needs CUDA, and this train step "
                         f"runs on {device!r}; set grpo_generation to 'auto' (the project's sampler) or train on a GPU")
    if world_size() > 1:
        raise ValueError(f"train.grpo_generation = '{name}' runs one vLLM engine beside one trainer process, and this "
                         f"launch has {world_size()} processes; set grpo_generation to 'auto' (the project's sampler) or "
                         "use_vllm to true (TRL's colocated vLLM, one engine per process) for data-parallel GRPO")
    if not _has("vllm"):
        raise ValueError(f"train.grpo_generation = '{name}' needs vLLM, which is not installed: run "
                         "`pip install -e '.[gpu]'` on the GPU machine, or set grpo_generation to 'auto'")
    from policy.grpo_rollout import VLLMLoRARollout, VLLMMergedRollout
    from policy.models import resolve_model

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL
    sampler = VLLMMergedRollout if name == "vllm-merged" else VLLMLoRARollout
    return sampler(model, tok, base=resolve_model(policy.model), work=work / "vllm-adapters",
                   max_new_tokens=config.max_completion_length, temperature=config.temperature, top_p=1.0,
                   seed=config.seed, max_model_len=longest_prompt_tokens(tok, data) + config.max_completion_length,
                   max_num_seqs=min(per_call, 1024), gpu_memory=config.vllm_gpu_memory)


def longest_prompt_tokens(tokenizer: Any, data: list[dict[str, Any]]) -> int:
    """Tokens of the longest chat-templated prompt of a GRPO dataset (sizes the colocated vLLM's context)."""
    texts = [tokenizer.apply_chat_template(d["prompt"], add_generation_prompt=True, tokenize=False) for d in data]
    return max((len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts), default=0)


def use_backend_generation(setting: str, device: str, use_vllm: bool) -> bool:
    """Whether GRPO samples through the project's backend: the setting, or for 'auto' CUDA without vLLM."""
    if setting == "auto":
        return device == "cuda" and not use_vllm
    return setting == "backend"


def summarize_grpo(rows: list[dict[str, Any]], steps: int, seconds: float, use_vllm: bool) -> dict[str, Any]:
    by_step, by_size = group(rows, "step"), group(rows, "size")

    def stats(rs: list[dict]) -> dict[str, float]:
        return rates(rs, means=("reward",))

    history = [{"step": s, **stats(rs)} for s, rs in by_step.items()]
    quarter = max(1, len(history) // 4)
    first = [r for h in history[:quarter] for r in by_step[h["step"]]]
    last = [r for h in history[-quarter:] for r in by_step[h["step"]]]
    overall = stats(rows)
    return {"train/steps": steps, "train/trajectories": len(rows), "train/seconds": seconds, "train/use_vllm": use_vllm,
            "train/reward_mean": overall["reward"], "train/valid_rate": overall["valid"], "train/optimal_rate": overall["optimal"],
            "train/reward_first_quarter": stats(first)["reward"], "train/reward_last_quarter": stats(last)["reward"],
            "train/valid_first_quarter": stats(first)["valid"], "train/valid_last_quarter": stats(last)["valid"],
            "train/per_size": {str(k): stats(v) for k, v in by_size.items()}, "train/history": history}


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


HISTORIES = ("sft/loss_history", "sft/loss_steps", "train/history")
"""The metrics that are per-step lists: written to the history files, never to the metrics or details files."""


def headline(metrics: dict[str, Any]) -> dict[str, float | int]:
    """The numbers among ``metrics`` (what ``dvc metrics show`` and ``dvc exp show`` list): no text, flags, lists or
    tables."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def write_outputs(metrics: dict[str, Any], out_metrics: str | Path, out_details: str | Path | None = None,
                  out_sft_history: str | Path | None = None, out_grpo_history: str | Path | None = None) -> None:
    """Write the headline metrics, the details (everything but the histories) and one history file per curve."""
    atomic_write_text(out_metrics, json.dumps(headline(metrics), indent=2))
    if out_details is not None:
        details = {k: v for k, v in metrics.items() if k not in HISTORIES}
        atomic_write_text(out_details, json.dumps(details, indent=2, default=str))
    if out_sft_history is not None:
        losses = metrics.get("sft/loss_history", [])
        steps = metrics.get("sft/loss_steps", [])  # the optimizer step of each log line (warm_start sets both)
        atomic_write_text(out_sft_history, json.dumps([{"step": k, "loss": v} for k, v in zip(steps, losses)], indent=1))
    if out_grpo_history is not None:
        atomic_write_text(out_grpo_history, json.dumps(metrics.get("train/history", []), indent=1))


def train(instances: str | Path, out_adapter: str | Path, out_completions: str | Path, out_metrics: str | Path,
          settings: TrainSettings = TrainSettings(), policy: PolicySettings = PolicySettings(),
          init_adapter: str | Path | None = None, out_details: str | Path | None = None,
          out_sft_history: str | Path | None = None, out_grpo_history: str | Path | None = None,
          progress: bool = True) -> dict[str, Any]:
    """Run the step; returns every metric. Writes the outputs of :func:`write_outputs` (the optional ones where a path
    is given). ``progress``: a line every 15 s (a bar in a terminal) during the warm start and GRPO."""
    import torch
    from transformers import set_seed

    from policy.lora import load_trainable

    if settings.threads:
        torch.set_num_threads(settings.threads)
    set_seed(settings.seed)
    device = pick_device(settings.device)
    state = None
    if world_size() > 1:  # a distributed launch: this process's GPU, and a process group before anything else
        from accelerate import PartialState

        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        state = PartialState()
    main_process = state is None or state.is_main_process
    out_adapter = Path(out_adapter)
    out_adapter.parent.mkdir(parents=True, exist_ok=True)
    rows = read_instances(instances).to_pylist()
    if main_process:
        for stale in out_adapter.parent.glob(f".{out_adapter.name}.work-*"):  # left by a run that was killed
            shutil.rmtree(stale, ignore_errors=True)
    if state is not None:
        state.wait_for_everyone()
    work = Path(tempfile.mkdtemp(dir=out_adapter.parent, prefix=f".{out_adapter.name}.work-"))
    start = time.perf_counter()
    try:
        model, tok = load_trainable(policy.model, init_adapter, r=settings.lora_r, alpha=settings.lora_alpha,
                                    dropout=settings.lora_dropout, targets=settings.lora_targets, device=device,
                                    seed=settings.seed)
        metrics: dict[str, Any] = {"model": policy.model, "init_adapter": str(init_adapter) if init_adapter else None,
                                   "device": device, "instances": len(rows), "processes": world_size()}
        if settings.distills:
            metrics.update(warm_start(model, tok, rows, settings, policy.prompt, device, work, progress))
        completions: list[dict[str, Any]] = []
        if settings.reinforces:
            grpo_metrics, completions = grpo(model, tok, rows, settings, policy, device, work, progress)
            metrics.update(grpo_metrics)
        if not main_process:  # the main process writes every output
            state.wait_for_everyone()
            return metrics
        staged = work / "adapter"
        save_adapter(model, tok, staged, policy.model)
        record = {"policy": policy.model_dump(mode="json"), "train": settings.model_dump(mode="json")}
        (staged / "train_config.json").write_text(json.dumps(record, indent=2))
        metrics["seconds"] = time.perf_counter() - start
        write_dataset(out_completions, completions, COMPLETIONS, {"train": json.dumps(record)})
        write_outputs(metrics, out_metrics, out_details, out_sft_history, out_grpo_history)
        replace_dir(staged, out_adapter)
        if state is not None:
            state.wait_for_everyone()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return metrics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_params_arguments(parser)
    parser.add_argument("--instances", required=True, type=Path, help="the stage's instances Parquet")
    parser.add_argument("--out-adapter", required=True, type=Path, help="LoRA adapter folder to write (replaced atomically)")
    parser.add_argument("--out-completions", required=True, type=Path, help="Parquet of every GRPO completion with its reward")
    parser.add_argument("--out-metrics", required=True, type=Path, help="headline metrics JSON (numbers only, dvc metrics)")
    parser.add_argument("--out-details", type=Path, default=None,
                        help="details JSON: model, device, per map size, seconds per step")
    parser.add_argument("--out-sft-history", type=Path, default=None, help="warm-start loss per step JSON (dvc plots)")
    parser.add_argument("--out-grpo-history", type=Path, default=None,
                        help="GRPO reward, validity and optimality per step JSON (dvc plots)")
    parser.add_argument("--no-progress", action="store_true", help="no progress (a bar in a terminal, else a line every 15 s)")
    parser.add_argument("--init-adapter", type=Path, default=None, help="previous stage's adapter to continue from")
    parser.add_argument("--settings", choices=("train", "start"), default="train",
                        help="whose settings: the curriculum's (the train section, default) or the shared starting "
                        "policy's (start.train)")


def run(args: argparse.Namespace) -> int:
    from policy.devices import claim_gpu
    from policy.models import ModelNotFoundError

    try:
        params = load_params(args.params, args.set)
        if args.init_adapter is not None and not (args.init_adapter / "adapter_config.json").exists():
            raise ValueError(f"--init-adapter {args.init_adapter}: not a PEFT adapter folder (no adapter_config.json)")
        if world_size() == 1:  # a distributed launch gives each process its GPU
            claim_gpu()
        settings, policy = params.training(args.settings)
        metrics = train(args.instances, args.out_adapter, args.out_completions, args.out_metrics, settings,
                        policy, args.init_adapter, args.out_details, args.out_sft_history,
                        args.out_grpo_history, not args.no_progress)
    except (ParamsError, ValueError, ModelNotFoundError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    keys = ("sft/loss_first", "sft/loss_last", "train/reward_first_quarter", "train/reward_last_quarter", "train/valid_rate", "seconds")
    print("trained: " + ", ".join(f"{k} {metrics[k]:.3f}" for k in keys if isinstance(metrics.get(k), (int, float))))
    if metrics.get("train/phase_seconds"):
        print("GRPO seconds by phase: " + ", ".join(f"{k} {v:.1f}" for k, v in metrics["train/phase_seconds"].items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="env-engineer train", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
