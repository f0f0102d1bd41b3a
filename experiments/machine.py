"""What an experiment ran on, recorded beside its results: the GPUs (kind and count, from ``nvidia-smi``) and, while a
run lasts, how busy they were (:class:`BusySampler`). On a machine without ``nvidia-smi`` both say so instead of
failing. And whether the packages every step imports are compiled again in every process (:func:`bytecode_warning`)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

STEP_PACKAGES = ("great_expectations", "dvc", "polars", "pydantic", "transformers", "trl", "peft")
"""The installed packages that an experiment's step processes import (DVC's too)."""


def _query(fields: str) -> list[list[str]] | None:
    """``nvidia-smi --query-gpu=FIELDS`` rows, or None where it is missing or fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [[part.strip() for part in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


def describe_gpus() -> dict[str, object]:
    """``{"kind": "NVIDIA H200", "count": 1}`` (kinds joined when they differ), or ``{"kind": None, "count": 0}``."""
    rows = _query("name")
    if not rows:
        return {"kind": None, "count": 0}
    kinds = sorted({row[0] for row in rows})
    return {"kind": " + ".join(kinds), "count": len(rows)}


@dataclass
class BusySampler:
    """While inside, reads every GPU's utilization every ``every_s`` seconds; ``summary()`` gives the mean busy share
    (0-1) over all samples and GPUs, and the share of samples in which a GPU was busy at all."""

    every_s: float = 5.0
    samples: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            rows = _query("utilization.gpu")
            for row in rows or []:
                try:
                    self.samples.append(float(row[0]) / 100)
                except ValueError:
                    continue

    def __enter__(self) -> BusySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def summary(self) -> dict[str, float | int | None]:
        n = len(self.samples)
        return {"samples": n, "mean_busy": round(sum(self.samples) / n, 4) if n else None,
                "share_of_samples_busy": round(sum(s > 0 for s in self.samples) / n, 4) if n else None}


def uncompiled(packages: tuple[str, ...] = STEP_PACKAGES) -> dict[str, Path]:
    """Those of ``packages`` that every process importing them compiles again (name -> the folder that holds the
    package): their bytecode is missing and Python will write none (``PYTHONDONTWRITEBYTECODE`` is set, or the folder
    it would go to cannot be written). Looks at each package's ``__init__`` without importing it; a package that is
    not installed is left out."""
    found: dict[str, Path] = {}
    for name in packages:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        cached = Path(importlib.util.cache_from_source(spec.origin))
        if cached.exists():
            continue
        folder = cached.parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if sys.dont_write_bytecode or not os.access(folder, os.W_OK):
            found[name] = Path(spec.origin).parent.parent
    return found


def bytecode_warning(packages: tuple[str, ...] = STEP_PACKAGES) -> str | None:
    """A line saying which of ``packages`` :func:`uncompiled` finds and how to compile them once, or None."""
    found = uncompiled(packages)
    if not found:
        return None
    folders = sorted({str(folder) for folder in found.values()})
    return (f"{', '.join(found)} have no bytecode here and Python writes none (PYTHONDONTWRITEBYTECODE is set, or "
            "their folders are read-only), so every step of every experiment compiles them again, about twice a "
            "stage's CPU (docs/lab-notes/benchmarks.md, 'Steps without bytecode'); compile them once: "
            f"{sys.executable} -m compileall -q {' '.join(folders)} (or install with bytecode: pip's default, "
            "uv's --compile-bytecode)")
