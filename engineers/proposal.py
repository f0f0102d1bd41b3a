"""What an engineer proposes, and how any proposal becomes a valid configuration.

An engineer (:class:`Engineer`) reads an :class:`EngineerInput` (the stage's :class:`~engineers.summary.Summary`, the
current configuration, the stage number and a seeded random stream) and returns a :class:`Proposal`: raw per-size
knobs, untrusted whatever their source, and a rationale. :func:`finalize` turns a proposal into a valid
:class:`~envgen.core.config.EnvConfig`, never code: per size and knob a finite number or the previous value; clamped into
the field's range (and the size's limits) with a note; moved by at most the trust region per stage when one is set,
with a note; sizes and keys that do not exist ignored, with a note. No usable proposal keeps the previous
configuration, recorded. The budget and agent count stay (engineers are compared at equal budgets); the seed moves to
``seed + 1`` so every stage draws new instances. :func:`ensure_feasible` then checks that the generator can fill it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import ValidationError

from engineers.summary import Summary
from envgen.core.config import KNOBS, EnvConfig, SizeConfig


@dataclass(frozen=True)
class Proposal:
    """What an engineer said. ``sizes`` is untrusted input (per size a mapping of knobs); None means no usable
    proposal. ``prompt``, ``attempts`` and ``constrained`` record how an LLM engineer got there."""

    sizes: Mapping[str, Any] | None
    rationale: str = ""
    prompt: str | None = None
    attempts: tuple[dict[str, Any], ...] = ()
    constrained: bool = False


@dataclass(frozen=True)
class EngineerInput:
    """What an engineer reads."""

    summary: Summary
    current: EnvConfig
    stage: int
    rng: random.Random


class Engineer(Protocol):
    """Anything that proposes the next configuration."""

    name: str

    def propose(self, inp: EngineerInput) -> Proposal: ...


@dataclass(frozen=True)
class Finalized:
    """A configuration made from a proposal: ``notes`` say what was changed or ignored; ``fallback`` is true when the
    previous configuration was kept (with the seed moved on)."""

    config: EnvConfig
    notes: tuple[str, ...] = ()
    fallback: bool = False


def bounds(knob: str, size: int) -> tuple[float, float]:
    """The allowed range of ``knob`` on an N x N map (``min_path_length`` is at most ``2 (N - 1)``)."""
    meta = SizeConfig.model_fields[knob].metadata
    lo = next(m.ge for m in meta if getattr(m, "ge", None) is not None)
    hi = next(m.le for m in meta if getattr(m, "le", None) is not None)
    if knob == "min_path_length":
        hi = min(hi, 2 * (size - 1))
    return lo, hi


def to_number(value: Any) -> float | None:
    """A finite number from an untrusted value (a number, or text such as ``"0.3"`` or ``"30%"``), else None. Never
    raises: a number too large for a float is None too."""
    if isinstance(value, bool):
        return None
    try:
        if isinstance(value, (int, float)):
            x = float(value)
        elif isinstance(value, str) and len(value) <= 64:
            text = value.strip()
            x = float(text.rstrip("%")) / (100 if text.endswith("%") else 1)
        else:
            return None
    except (ValueError, OverflowError):
        return None
    return x if math.isfinite(x) else None


SEED_SPAN = 2**63
"""Configuration seeds lie in [0, 2^63): the next stage's seed after the largest is 0."""


def next_seed(seed: int) -> int:
    """The seed of the next stage's configuration: ``seed + 1``, wrapping within :data:`SEED_SPAN`.

    >>> next_seed(5), next_seed(2**63 - 1)
    (6, 0)
    """
    return (seed + 1) % SEED_SPAN


def rounded_within(value: float, old: float, limit: float | None, integer: bool = False) -> float | int:
    """``value`` rounded (to a whole number, or 4 decimals), toward ``old`` where rounding would move it farther from
    ``old`` than the trust region's ``limit`` allows.

    >>> rounded_within(2.5, 2, 0.5, integer=True), rounded_within(0.30004, 0.2, 0.1)
    (2, 0.3)
    """
    digits = 0 if integer else 4
    out = round(value, digits)
    if limit is not None and abs(out - old) > limit + 1e-12:
        scale = 10**digits
        toward = math.floor if out > old else math.ceil
        out = toward(value * scale) / scale
        if abs(out - old) > limit + 1e-12:
            out = old
    return int(out) if integer else out


def finalize(proposal: Proposal, current: EnvConfig, trust_region: Mapping[str, float] | None = None) -> Finalized:
    """The next configuration from an untrusted proposal. Never raises on a proposal."""
    notes: list[str] = []
    seed = next_seed(current.seed)
    if not isinstance(proposal.sizes, Mapping):
        return Finalized(current.model_copy(update={"seed": seed}), ("no usable proposal: kept the previous configuration",), True)
    limits: dict[str, float] = {}
    for knob, limit in (trust_region or {}).items():
        value = to_number(limit)
        if value is None or value < 0:
            notes.append(f"trust region {str(knob)[:30]} = {str(limit)[:30]!r} is not a non-negative number: ignored")
        else:
            limits[str(knob)] = value
    raw = {str(k).strip().lower().split("x")[0][:20]: v for k, v in list(proposal.sizes.items())[:100]}
    unknown = sorted(set(raw) - {str(n) for n in current.sizes})
    if unknown:
        notes.append(f"ignored sizes that are not in the configuration: {[u[:20] for u in unknown[:10]]}")
    sizes: dict[int, SizeConfig] = {}
    for n, prev in current.sizes.items():
        given = raw.get(str(n))
        if not isinstance(given, Mapping):
            notes.append(f"size {n}: no knobs given, kept {prev.model_dump()}")
            sizes[n] = prev
            continue
        extra = sorted(str(k)[:30] for k in given if str(k) not in KNOBS)
        if extra:
            notes.append(f"size {n}: ignored unknown keys {extra[:5]}")
        knobs = prev.model_dump()
        for knob in KNOBS:
            old = float(knobs[knob])
            value = to_number(given.get(knob))
            if value is None:
                if knob in given:
                    notes.append(f"size {n}: {knob} = {str(given.get(knob))[:30]!r} is not a number, kept {old:g}")
                continue
            lo, hi = bounds(knob, n)
            if not lo <= value <= hi:
                notes.append(f"size {n}: {knob} = {value:g} clamped into [{lo:g}, {hi:g}]")
                value = min(max(value, lo), hi)
            limit = limits.get(knob)
            if limit is not None and abs(value - old) > limit:
                moved = old + math.copysign(limit, value - old)
                notes.append(f"size {n}: {knob} {old:g} -> {value:g} limited to {moved:g} by the trust region (+-{limit:g})")
                value = moved
            knobs[knob] = rounded_within(value, old, limit, integer=knob == "min_path_length")
        if current.num_agents == 1 and knobs["wait_ratio"] > 0:
            notes.append(f"size {n}: wait_ratio set to 0 (one agent never needs a wait)")
            knobs["wait_ratio"] = 0.0
        free = n * n - round(knobs["hole_ratio"] * n * n)
        while free < 2 * current.num_agents and knobs["hole_ratio"] > 0:
            knobs["hole_ratio"] = round(max(0.0, knobs["hole_ratio"] - 1 / (n * n)), 4)
            free = n * n - round(knobs["hole_ratio"] * n * n)
            notes.append(f"size {n}: hole_ratio lowered to {knobs['hole_ratio']:g} to leave room for the agents")
        sizes[n] = SizeConfig(**knobs)
    if sum(s.data_ratio for s in sizes.values()) <= 0:
        notes.append("every data_ratio was 0: kept the previous data ratios")
        sizes = {n: s.model_copy(update={"data_ratio": current.sizes[n].data_ratio}) for n, s in sizes.items()}
    try:
        return Finalized(EnvConfig(num_agents=current.num_agents, budget=current.budget, seed=seed, sizes=sizes), tuple(notes))
    except (ValidationError, ValueError) as e:  # a combination the checks above missed: fall back, recorded
        notes.append(f"the proposal is still invalid ({str(e).splitlines()[0][:200]}): kept the previous configuration")
        return Finalized(current.model_copy(update={"seed": seed}), tuple(notes), True)


def ensure_feasible(config: EnvConfig, previous: EnvConfig, exclude: Iterable[str] = ()) -> Finalized:
    """Generate ``config`` as the next stage will (same seed, same exclusions); revert each size the generator cannot
    fill to its previous knobs until it can. ``fallback`` is true when nothing of the proposal could be kept."""
    from envgen.generator import GenerationError, generate

    exclude = frozenset(exclude)
    notes: list[str] = []
    for _ in range(len(config.sizes) + 1):
        try:
            for _ in generate(config, exclude=exclude):
                pass
            return Finalized(config, tuple(notes))
        except GenerationError as e:
            n = e.size
            if n is None or n not in previous.sizes or config.sizes.get(n) == previous.sizes[n]:
                notes.append(f"the proposal cannot be generated ({str(e)[:200]}): kept the previous configuration")
                return Finalized(previous.model_copy(update={"seed": config.seed}), tuple(notes), True)
            notes.append(f"size {n}: the proposed knobs cannot be generated ({str(e).split(';')[0][:160]}); "
                         f"reverted to {previous.sizes[n].model_dump()}")
            config = config.model_copy(update={"sizes": {**config.sizes, n: previous.sizes[n]}})
    return Finalized(previous.model_copy(update={"seed": config.seed}), (*notes, "kept the previous configuration"), True)

