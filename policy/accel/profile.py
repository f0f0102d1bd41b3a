"""Where a training phase's time goes: wall seconds per optimizer step (:func:`step_clock`), seconds per GRPO phase by
TRL's own profiling points (:func:`phase_clock`, :func:`phase_profile`) and, when ``$ENV_ENGINEER_TRAIN_PROFILE``
names a folder, a torch.profiler trace of a few steps (:func:`profile_callback`)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from envgen.core.files import atomic_write_text


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
