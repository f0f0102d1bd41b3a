"""Progress of a long step, readable wherever the step runs.

In a terminal it is a tqdm bar. Elsewhere (``dvc repro`` piped to a log, CI, a Prefect worker) a bar's carriage returns
make an unreadable log, so it is one line at most every ``every`` seconds, and one at the end::

    train (GRPO): 3/8 steps (38%) in 1 min 10 s, about 1 min 57 s left

so that a user can see that a stage is alive and how far it has to go.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def duration(seconds: float) -> str:
    """``75.2`` -> ``'1 min 15 s'``; ``3725`` -> ``'1 h 2 min'``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


class Progress:
    """Counts work done out of ``total`` units; a context manager (the closing line is printed on exit).

    Args:
        total: units of work in all (at least 1 is assumed).
        label: what is running, e.g. ``"rollout"`` or ``"train (GRPO)"``.
        unit: the unit's name in the plural (``"instances"``, ``"steps"``).
        enabled: False prints nothing at all.
        every: seconds between two lines when not in a terminal.
        stream: where to write (standard error by default).

    ``note`` (e.g. ``"loss 0.41"``), when set, ends every line and the bar.
    """

    def __init__(self, total: int, label: str, unit: str = "items", enabled: bool = True, every: float = 15.0,
                 stream: TextIO | None = None) -> None:
        self.total, self.label, self.unit, self.every = max(1, int(total)), label, unit, every
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.done = 0
        self.note = ""
        self.start = self.last = time.perf_counter()
        self._bar: Any = None
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=label, unit=unit, file=self.stream)

    def line(self) -> str:
        """The state as one line of text."""
        elapsed = time.perf_counter() - self.start
        text = (f"{self.label}: {self.done}/{self.total} {self.unit} ({100 * self.done / self.total:.0f}%) "
                f"in {duration(elapsed)}")
        if 0 < self.done < self.total:
            text += f", about {duration(elapsed * (self.total - self.done) / self.done)} left"
        return f"{text}; {self.note}" if self.note else text

    def update(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        if self._bar is not None:
            if self.note:
                self._bar.set_postfix_str(self.note, refresh=False)
            self._bar.update(n)
            return
        now = time.perf_counter()
        if now - self.last >= self.every and self.done < self.total:
            self.last = now
            print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        else:
            print(self.line(), file=self.stream, flush=True)
        self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def trainer_progress(label: str, enabled: bool = True, every: float = 15.0) -> Any:
    """A transformers ``TrainerCallback`` that reports a trainer's steps through :class:`Progress` (the total is the
    trainer's ``max_steps``, known once training begins), with the last logged loss and reward. The trainer's own
    printing of every log (transformers' ``PrinterCallback``) is for the trainer to remove: :func:`quiet`."""
    from transformers import TrainerCallback

    class StepProgress(TrainerCallback):
        def __init__(self) -> None:
            self.progress: Progress | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.progress = Progress(state.max_steps, label, "steps", enabled, every)

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            logs = logs or {}
            note = ", ".join(f"{k} {logs[k]:.4g}" for k in ("loss", "reward") if isinstance(logs.get(k), (int, float)))
            if self.progress is not None and note:  # the closing log (train_loss, runtime) keeps the last step's
                self.progress.note = note

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.progress is not None:
                self.progress.update(state.global_step - self.progress.done)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.progress is not None:
                self.progress.close()

    return StepProgress()


def quiet(trainer: Any) -> Any:
    """``trainer`` without transformers' ``PrinterCallback``, which prints every log as a dictionary when the trainer
    has no bar of its own (the project's trainers report through :func:`trainer_progress`; the logs stay in
    ``trainer.state.log_history`` and the step's metrics)."""
    from transformers import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    return trainer
