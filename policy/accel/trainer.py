"""TRL's trainers as the project runs them: the arguments every phase shares (:func:`trainer_arguments`), the CUDA
graphs' step marks (:func:`graph_steps`) and the warm start's ``SFTTrainer`` with metrics read once per log line
(:func:`deferred_metrics_trainer`)."""

from __future__ import annotations

import multiprocessing
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from policy.accel.options import Phase, Settings, compile_mode, compiles, padding_multiple, use_checkpointing
from policy.lora import causal_lm


def trainer_arguments(config: Settings, device: str, work: Path, model: Any, phase: Phase,
                 log_every: int = 1) -> dict[str, Any]:
    """The arguments of TRL's ``SFTConfig`` / ``GRPOConfig`` that both phases share: where to write, logging, seed,
    precision, recomputation, whole-model compilation, padding and the data loader."""
    cuda = device == "cuda"
    checkpointing = use_checkpointing(config.accel.gradient_checkpointing, device, sum(p.numel() for p in model.parameters()))
    compiled = compiles(config, phase)
    return {"output_dir": str(work), "report_to": "none", "save_strategy": "no", "logging_steps": log_every,
            "seed": config.seed, "bf16": cuda, "use_cpu": not cuda, "gradient_checkpointing": checkpointing,
            "disable_tqdm": True, "torch_compile": compiled and config.accel.compile_scope == "model",
            # transformers compiles the whole model whenever a mode is set, so only with compile_scope 'model'
            "torch_compile_mode": (config.accel.compile_mode if compiled and config.accel.compile_scope == "model"
                                   and compile_mode(config, device) != "default" else None),
            "pad_to_multiple_of": padding_multiple(config, phase), **_loader_args(config, device, phase)}


def _loader_args(config: Settings, device: str, phase: Phase) -> dict[str, Any]:
    """The warm start's data loader: ``sft_drop_last``, ``sft_loader_workers``, and on CUDA each pinned batch copied
    to the GPU without the CPU waiting for the copy (accelerate's ``non_blocking``; a blocking copy waits for every
    step queued before it). GRPO's loader collates in the training process, as transformers sets it otherwise.

    Loader workers are forked from the training process where the system can fork. Otherwise they would start as the
    process itself was started, and a warm trainer (``env-engineer train-server``) is spawned: each of its trainings'
    workers would import torch, transformers and TRL again only to collate a few dozen batches (the lab note's eighth
    one-GPU comparison attempt measured what that costs the cores). The workers never touch the GPU."""
    if phase != "sft":
        return {"dataloader_num_workers": 0}
    workers = config.accel.sft_loader_workers
    count = (2 if device == "cuda" else 0) if workers == "auto" else workers
    args: dict[str, Any] = {"dataloader_drop_last": config.accel.sft_drop_last, "dataloader_num_workers": count}
    if count and "fork" in multiprocessing.get_all_start_methods():
        args["dataloader_multiprocessing_context"] = "fork"
    if device == "cuda":
        args |= {"dataloader_pin_memory": True, "accelerator_config": {"non_blocking": True}}
    return args


def graph_steps(config: Settings, device: str, phase: Phase) -> Any:
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
            from policy.accel.label_index import KEYS

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
            """The pass through the backbone and, at the positions the collator listed (policy/accel/label_index.py), the
            LM head: per listed position its log-probability, entropy and top-1 flag, and its weight (0: padding).
            Under the trainer's autocast, which accelerate otherwise enters only around the model's own forward."""
            from policy.accel.label_index import indexed_log_probs

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
