"""Pipeline step ``train``: one stage's training, by ``train.recipe`` (:data:`pipeline.train_settings.RECIPES`): a
supervised pass over the stage's own instances' solver demonstrations ('distill'; TRL ``SFTTrainer``, whose per-pass
metrics stay on the device until a log line: :func:`policy.accel.deferred_metrics_trainer`), GRPO with the MAPF reward
('grpo'; TRL ``GRPOTrainer``, configured, not subclassed), or the first then the second ('distill+grpo'), on a LoRA
adapter (PEFT) that continues the previous stage's adapter or starts fresh.

Outputs: the adapter folder (PEFT format; replaced atomically, so a crash never leaves a half-written adapter where
the next stage reads it), every GRPO completion with its reward and failure category (Parquet,
:data:`envgen.formats.schemas.COMPLETIONS`), the headline metrics (JSON of numbers, for ``dvc metrics``: warm-start loss,
reward and validity overall and by quarter, wall time), the details (JSON: model, device, per map size, seconds per
step) and one history per curve (for ``dvc plots``: warm-start loss per step, GRPO reward and validity per step).

Settings: params.yaml's ``policy`` (model, prompt, reward) and ``train`` sections
(:class:`pipeline.train_settings.TrainSettings`). How fast the passes run is :mod:`policy.accel`'s business, who samples
GRPO's completions :func:`policy.grpo_rollout.grpo_sampler`'s; this file is the algorithm. Imports no Prefect, DVC or
polars.

With ``train.server`` set, the step hands the stage (a :class:`TrainJob`) to a warm trainer and waits: ``env-engineer
train-server`` (:func:`run_server`; :mod:`policy.warm_workers`) runs :func:`train` on it in one of its processes,
started once for every experiment's stages.

Several GPUs: ``accelerate launch --multi_gpu --num_processes N -m env_engineer train ...`` runs it data-parallel
(DDP): each process takes the GPU of its ``LOCAL_RANK``, the batch sizes stay global (``sft_batch_size`` examples and
``prompts_per_step * num_generations`` completions per optimizer step, split over the processes: gradient
accumulation shrinks by N, so they must divide), every process's GRPO completions are gathered, and only the main
process writes the outputs. ``policy.model`` may be any local folder, so a large model's shape can be trained with
random weights (``bench/multigpu.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from envgen.formats.dataset import parse_instances, read_instances, write_dataset
from envgen.core.files import atomic_write_text, replace_dir
from envgen.llm.prompt import PromptStyle, build_messages, format_answer
from envgen.llm.rates import group, rates, share
from envgen.llm.reward import MAPFReward, instance_from_text
from envgen.formats.schemas import COMPLETIONS
from pipeline.params import ParamsError, PolicySettings, add_params_arguments, load_params
from pipeline.progress import quiet, trainer_progress
from pipeline.train_settings import TrainSettings
from pipeline.workers import cpu_share, end_with_parent
from policy.accel import (deferred_metrics_trainer, graph_steps, phase_clock, phase_profile, profile_callback,
                          step_clock, tokenizer_processes, trainer_arguments, training_kernels, uses_lora_autocast,
                          warm_start_collator)
from policy.devices import world_size
from policy.grpo_rollout import grpo_sampler
from policy.lora import save_adapter
from policy.models import pick_device


class CompletionRecorder:
    """What GRPO rewarded, kept: :class:`envgen.llm.reward.MAPFReward` calls it (``on_score``) with every scored completion;
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


def warm_start(model, tok, rows, config: TrainSettings, style: PromptStyle, device: str, work: Path,
               progress: bool = True) -> dict[str, Any]:
    """Supervised fine-tuning of the adapter on demonstrations (loss on the completion only)."""
    from datasets import Dataset
    from trl import SFTConfig

    demos = demonstrations(rows[: config.sft_max_examples], style)
    # unset: the whole batch in one pass, or with N processes an N-th of it in each
    micro = config.sft_micro_batch_size or max(1, config.sft_batch_size // world_size())
    args = SFTConfig(**trainer_arguments(config, device, work / "sft", model, "sft", log_every=config.log_every),
                     num_train_epochs=config.sft_epochs,
                     per_device_train_batch_size=micro,
                     gradient_accumulation_steps=accumulation(config.sft_batch_size, micro, world_size(),
                                                              "train.sft_batch_size"),
                     # tokens are counted by the trainer below (TRL's num_tokens), not with a read per pass
                     include_num_input_tokens_seen="no", logging_nan_inf_filter=False,
                     learning_rate=config.sft_learning_rate,
                     lr_scheduler_type="cosine", warmup_steps=0.03, completion_only_loss=True,
                     # padding-free rows are not cut (TRL enforces max_length only on padded batches)
                     max_length=None if config.accel.sft_padding_free else 2048,
                     padding_free=config.accel.sft_padding_free, dataset_num_proc=tokenizer_processes(len(demos)))
    clock = step_clock()
    callbacks = [c for c in (clock, trainer_progress("train (warm start)", progress), graph_steps(config, device, "sft"),
                             profile_callback("sft")) if c is not None]
    trainer = quiet(deferred_metrics_trainer()(model=model, args=args, train_dataset=Dataset.from_list(demos),
                                               processing_class=tok, callbacks=callbacks))
    trainer.data_collator = warm_start_collator(trainer, model, config, device)
    start = time.perf_counter()
    with training_kernels(model, config, device, "sft", uses_lora_autocast(config.accel.lora_autocast, device)) as graphed:
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
    world = world_size()
    micro = config.micro_batch_size
    passes = accumulation(per_step, micro, world, "train.prompts_per_step x train.num_generations (with "
                          "train.micro_batch_size completions per pass)")
    sampler = grpo_sampler(model, tok, data, config, policy, device, work, per_call=micro * passes * config.generation_steps)
    rollout_func = sampler.rollout_func
    args = GRPOConfig(**trainer_arguments(config, device, work / "grpo", model, "grpo"), per_device_train_batch_size=micro,
                      gradient_accumulation_steps=passes, steps_per_generation=passes * config.generation_steps,
                      num_generations=config.num_generations, max_steps=steps, learning_rate=config.learning_rate,
                      beta=config.beta, max_completion_length=config.max_completion_length, temperature=config.temperature,
                      remove_unused_columns=False, lr_scheduler_type="constant", **sampler.trl_args)
    recorder = CompletionRecorder()
    reward = MAPFReward(policy.reward, on_score=recorder)
    phases: dict[str, float] = {}
    clock = step_clock(phases, "train (GRPO)", report=progress)
    trainer = quiet(GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=Dataset.from_list(data),
                                processing_class=tok, rollout_func=rollout_func,
                                callbacks=[c for c in (clock, trainer_progress("train (GRPO)", progress),
                                                       graph_steps(config, device, "grpo"),
                                                       profile_callback("grpo")) if c is not None]))
    start = time.perf_counter()
    try:
        with phase_clock(phases), training_kernels(model, config, device, "grpo", sampler.lora_autocast):
            trainer.train()
    finally:
        if hasattr(rollout_func, "close"):
            rollout_func.close()
    seconds = time.perf_counter() - start
    rows = recorder.rows
    if world > 1:  # each process scored its own share of the completions
        from accelerate.utils import gather_object

        rows = gather_object(rows)
    metrics = summarize_grpo(rows, steps, seconds)
    metrics["train/step_seconds"] = clock.seconds
    metrics["train/phase_seconds"] = phase_profile(phases, clock.seconds)
    metrics["train/step_phase_seconds"] = clock.phases_per_step
    metrics["train/generation"] = sampler.name
    if hasattr(rollout_func, "seconds"):
        metrics["train/vllm_seconds"] = {k: round(v, 3) for k, v in rollout_func.seconds.items()}
        metrics["train/vllm_cycles"] = list(rollout_func.cycle_log)
    return metrics, rows


def summarize_grpo(rows: list[dict[str, Any]], steps: int, seconds: float) -> dict[str, Any]:
    by_step, by_size = group(rows, "step"), group(rows, "size")

    def stats(rs: list[dict]) -> dict[str, float]:
        return rates(rs, means=("reward",))

    history = [{"step": s, **stats(rs)} for s, rs in by_step.items()]
    quarter = max(1, len(history) // 4)
    first = [r for h in history[:quarter] for r in by_step[h["step"]]]
    last = [r for h in history[-quarter:] for r in by_step[h["step"]]]
    overall = stats(rows)
    return {"train/steps": steps, "train/trajectories": len(rows), "train/seconds": seconds,
            "train/reward_mean": overall["reward"], "train/valid_rate": overall["valid"], "train/optimal_rate": overall["optimal"],
            "train/reward_first_quarter": stats(first)["reward"], "train/reward_last_quarter": stats(last)["reward"],
            "train/valid_first_quarter": stats(first)["valid"], "train/valid_last_quarter": stats(last)["valid"],
            "train/per_size": {str(k): stats(v) for k, v in by_size.items()}, "train/history": history}


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
        metrics.update(gpu_memory(device))
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


def gpu_memory(device: str) -> dict[str, float]:
    """This process's peak GPU memory in GiB: what PyTorch's caching allocator handed out (``gpu/peak_allocated_gib``)
    and what it held from the card (``gpu/peak_reserved_gib``, CUDA's own context not counted): the second is what a
    training slot of ``ENV_ENGINEER_GPU_SLOTS`` needs. Nothing off CUDA."""
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return {}
    return {"gpu/peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "gpu/peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}


def import_libraries(reinforces: bool) -> None:
    """Import what training uses (seconds of a process's start-up), so that it happens before the process waits for a
    GPU slot where that is safe (:func:`policy.devices.claim_gpu_after`), not while it holds one."""
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import torch  # noqa: F401
    from trl import SFTConfig, SFTTrainer  # noqa: F401

    import policy.lora  # noqa: F401

    if reinforces:
        from trl import GRPOConfig, GRPOTrainer  # noqa: F401


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


class TrainJob(BaseModel):
    """One stage's training handed to a warm trainer: :func:`train`'s arguments (absolute paths) and settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    instances: Path
    out_adapter: Path
    out_completions: Path
    out_metrics: Path
    out_details: Path | None = None
    out_sft_history: Path | None = None
    out_grpo_history: Path | None = None
    init_adapter: Path | None = None
    settings: TrainSettings
    policy: PolicySettings


PATH_FIELDS = ("instances", "out_adapter", "out_completions", "out_metrics", "out_details", "out_sft_history",
               "out_grpo_history", "init_adapter")
"""A job's paths: each must lie under the warm trainer's ``--root``."""


def train_elsewhere(url: str, args: argparse.Namespace, settings: TrainSettings,
                    policy: PolicySettings) -> dict[str, Any]:
    """The stage trained by the warm trainer at ``url`` (``train.server``): :func:`train` with the same arguments, in a
    process that every experiment's stages share; its metrics."""
    from policy.warm_workers import WorkerServiceError, post_job

    def absolute(path: Path | None) -> Path | None:
        return None if path is None else path.resolve()

    job = TrainJob(instances=absolute(args.instances), out_adapter=absolute(args.out_adapter),
                   out_completions=absolute(args.out_completions), out_metrics=absolute(args.out_metrics),
                   out_details=absolute(args.out_details), out_sft_history=absolute(args.out_sft_history),
                   out_grpo_history=absolute(args.out_grpo_history), init_adapter=absolute(args.init_adapter),
                   settings=settings, policy=policy)
    print(f"train: the stage goes to the warm trainer at {url}", file=sys.stderr, flush=True)
    try:
        return post_job(url, job.model_dump_json().encode(), "train.server")
    except WorkerServiceError as e:
        raise ValueError(f"{e}; start `env-engineer train-server` there, or unset train.server to train in this "
                         "process") from None


def parse_job(raw: bytes, root: Path) -> TrainJob:
    """A warm trainer's check of a job: its fields (the first bad one named), every path absolute and under ``root``."""
    from policy.serve import RequestError

    try:
        job = TrainJob.model_validate_json(raw or b"null")
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        raise RequestError(f"{field}: {first['msg']}", field) from None
    for field in PATH_FIELDS:
        path = getattr(job, field)
        if path is None:
            continue
        if not path.is_absolute():
            raise RequestError(f"{field}: give an absolute path (the server's folder is not the client's)", field)
        if not path.resolve().is_relative_to(root):
            raise RequestError(f"{field}: {path} is outside the folder this server trains for ({root}); start it "
                               "with --root at the repository", field)
    return job


def train_job(job: TrainJob) -> dict[str, Any]:
    """A warm trainer's worker training one job (:func:`train`), then giving its memory back for the next."""
    import gc

    import torch

    if torch.cuda.is_available():  # the stage's own peak (gpu/peak_reserved_gib), not the worker's since it started
        torch.cuda.reset_peak_memory_stats()
    try:
        return train(job.instances, job.out_adapter, job.out_completions, job.out_metrics, job.settings, job.policy,
                     job.init_adapter, job.out_details, job.out_sft_history, job.out_grpo_history, progress=False)
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def trained_line(job: TrainJob, metrics: dict[str, Any]) -> str:
    """The warm trainer's log line for a stage: its adapter, then how long its training took in the worker and, of
    that, the supervised pass (what the line's whole time adds beyond them is the wait for a worker and the stage's
    files)."""
    parts = [f"training {metrics['seconds']:.1f} s"]
    if "sft/seconds" in metrics:
        parts.append(f"supervised pass {metrics['sft/seconds']:.1f} s, {metrics['sft/steps']} steps")
    return f"trained {job.out_adapter} ({'; '.join(parts)})"


def warm_worker() -> None:
    """What a warm trainer's worker does once, at its start: end with the server however the server ends (stopped with
    SIGTERM, uvicorn raises the signal again once it has stopped, so the server's own clean-up never runs; killed, it
    runs none), so that no worker is left holding memory or a GPU; then import what training uses."""
    end_with_parent()
    import_libraries(reinforces=False)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    from policy.warm_workers import JobLimits

    parser.add_argument("--root", type=Path, required=True,
                        help="the repository whose stages it trains: every path of a job must lie under it")
    parser.add_argument("--workers", type=int, default=1,
                        help="warm training processes; they take the GPUs of ENV_ENGINEER_GPUS in turn (default "
                             "%(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s: this machine only)")
    parser.add_argument("--port", type=int, default=8100, help="port (default %(default)s)")
    parser.add_argument("--max-waiting", type=int, default=JobLimits.max_waiting,
                        help="jobs waiting for a worker beyond which the server answers 429 (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=JobLimits.timeout_s,
                        help="seconds a job may take from its arrival before its client gets 504 (default %(default)s)")


def run_server(args: argparse.Namespace) -> int:
    """``env-engineer train-server``: warm processes that train the stages the train step hands them (``train.server``;
    :mod:`policy.warm_workers`), each started once (libraries imported; the model's files and compiled kernels kept
    from one stage to the next), with the step's own :func:`train`: the same outputs as the step's own process."""
    from policy.devices import gpu_pool
    from policy.warm_workers import JobLimits, Workers, make_app

    problems = []
    if not args.root.is_dir():
        problems.append(f"--root {args.root}: not a folder")
    if not 1 <= args.workers <= 64:
        problems.append(f"--workers {args.workers}: give 1 to 64")
    if not 0 <= args.port <= 65535:
        problems.append(f"--port {args.port}: give 0 to 65535")
    if args.max_waiting < 0 or not args.timeout > 0:
        problems.append("--max-waiting must be 0 or more and --timeout positive")
    try:
        gpu_pool()
    except ValueError as e:
        problems.append(str(e))
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    import uvicorn

    from policy.serve import header_timeout_protocol

    root = args.root.resolve()
    limits = JobLimits(max_waiting=args.max_waiting, timeout_s=args.timeout)
    workers = Workers(args.workers, warm_worker, cpu_share(args.workers))
    app = make_app(workers, lambda raw: parse_job(raw, root), train_job, trained_line, limits, args.host,
                   "env-engineer train-server")
    print(f"training for {root} on http://{args.host}:{args.port} with {args.workers} warm worker(s) (Ctrl-C "
          "stops)", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=30,
                    http=header_timeout_protocol(limits.read_timeout_s))
    finally:
        workers.shutdown()
    return 0


def run(args: argparse.Namespace) -> int:
    from policy.devices import claim_gpu_after
    from policy.models import ModelNotFoundError

    try:
        params = load_params(args.params, args.set)
        if args.init_adapter is not None and not (args.init_adapter / "adapter_config.json").exists():
            raise ValueError(f"--init-adapter {args.init_adapter}: not a PEFT adapter folder (no adapter_config.json)")
        settings, policy = params.training(args.settings)
        if settings.server:
            metrics = train_elsewhere(settings.server, args, settings, policy)
        else:
            if world_size() == 1:  # a distributed launch gives each process its GPU
                claim_gpu_after(lambda: import_libraries(settings.reinforces))
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
