"""The training speed machinery behind one narrow interface: ``steps/train.py`` says what to train, this package how
fast. Every choice follows from ``train``'s settings and the device (:mod:`policy.accel.options`); the defaults are
right for the CPU and for one GPU, and the settings that tune them are documented in docs/reference/params.md.

- :func:`trainer_arguments`: the TRL config arguments both phases share (:mod:`policy.accel.trainer`).
- :func:`deferred_metrics_trainer`: TRL's ``SFTTrainer`` with its per-pass metrics read once per log line.
- :func:`warm_start_collator`, :func:`training_kernels`: the collator and the context the passes run in
  (:mod:`policy.accel.kernels`: padding-free attention, SDPA kernels, LoRA in half precision, compiled layers, the
  decoder as CUDA graphs, :mod:`policy.accel.decoder_graph`, :mod:`policy.accel.packed_attention`,
  :mod:`policy.accel.label_index`).
- :func:`step_clock`, :func:`phase_clock`, :func:`phase_profile`, :func:`profile_callback`, :func:`graph_steps`: the
  trainer callbacks that time the steps, profile them on request and mark CUDA graph steps
  (:mod:`policy.accel.profile`).
"""

from policy.accel.kernels import training_kernels, warm_start_collator
from policy.accel.options import tokenizer_processes, uses_lora_autocast
from policy.accel.profile import phase_clock, phase_profile, profile_callback, step_clock
from policy.accel.trainer import deferred_metrics_trainer, graph_steps, trainer_arguments

__all__ = ["deferred_metrics_trainer", "graph_steps", "phase_clock", "phase_profile", "profile_callback", "step_clock",
           "tokenizer_processes", "trainer_arguments", "training_kernels", "uses_lora_autocast", "warm_start_collator"]
