"""Pipeline step ``engineer-config``: the stage summary and configuration in, the next configuration and a log out.

Whatever engineer speaks (:mod:`tasks.engineers`), its proposal is data that :func:`finalize` turns into a valid
:class:`~envgen.config.EnvConfig`, never code: per size and knob a finite number or the previous value; clamped into the
field's range (and the size's limits) with a note; moved by at most the trust region per stage when one is set, with
a note; sizes and keys that do not exist ignored, with a note. No proposal (the LLM failed ``attempts`` times) keeps the
previous configuration, recorded. The budget and agent count stay (engineers are compared at equal budgets); the seed
moves to ``seed + 1`` so every stage draws new instances.

``engineer_log.json`` keeps everything: engineer, context, the prompt, every attempt's raw output and error, the parsed
proposal, the rationale, the notes, whether the fallback was used, and the resulting configuration.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from envgen.config import EnvConfig, SizeConfig, format_validation_error
from envgen.files import atomic_write_text
from tasks.engineers import CONTEXTS, ENGINEERS, KNOBS, EngineerInput, Proposal, make_engineer


class EngineerSettings(BaseModel):
    """Settings of the engineer step (``params.yaml``, section ``engineer``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engineer: str = Field("policy", description=f"Who proposes: one of {sorted(ENGINEERS)}.")
    context: str = Field("bookkeeping", description=f"What the LLM engineers see: one of {sorted(CONTEXTS)}.")
    attempts: int = Field(3, ge=1, le=20, description="LLM attempts before the previous configuration is kept.")
    trust_region: dict[str, float] | None = Field(
        None, description="Largest change per knob per stage, e.g. {hole_ratio: 0.1, wait_ratio: 0.2} (None: no limit). "
        "It applies to every engineer alike; the paper uses none.")
    constrained: bool = Field(True, description="Constrain LLM decoding to the proposal's JSON schema where the backend can.")
    max_new_tokens: int = Field(512, ge=64, description="LLM answer length cap.")
    temperature: float = Field(0.7, ge=0, description="LLM sampling temperature (0: greedy).")
    model: str = Field("embedded", description="Base model of the policy and base engineers.")
    base_url: str | None = Field(None, description="api engineer: OpenAI-compatible endpoint, e.g. https://api.openai.com/v1.")
    api_model: str = Field("gpt-4o-mini", description="api engineer: the endpoint's model name.")
    api_key_env: str = Field("OPENAI_API_KEY", description="api engineer: environment variable holding the key.")
    feasibility_check: bool = Field(True, description="Generate the proposed stage once (same seed as the next stage); "
                                    "sizes whose knobs cannot be generated go back to their previous values, with a note.")
    threads: int | None = Field(None, ge=1, description="torch CPU threads for local models.")
    seed: int = Field(0, ge=0, description="Seed of sampling and of the random engineer.")

    @classmethod
    def from_params(cls, path: str | Path | None, overrides: dict[str, Any] | None = None) -> EngineerSettings:
        data = dict((yaml.safe_load(Path(path).read_text()) or {}).get("engineer") or {}) if path else {}
        data.update(overrides or {})
        try:
            settings = cls.model_validate(data)
        except ValidationError as e:
            raise ValueError(format_validation_error(e, f"{path or '<engineer>'} (section engineer)")) from None
        if settings.engineer not in ENGINEERS:
            raise ValueError(f"engineer.engineer = {settings.engineer!r}: choose one of {sorted(ENGINEERS)}")
        if settings.context not in CONTEXTS:
            raise ValueError(f"engineer.context = {settings.context!r}: choose one of {sorted(CONTEXTS)}")
        bad = set(settings.trust_region or {}) - set(KNOBS)
        if bad:
            raise ValueError(f"engineer.trust_region: unknown knob(s) {sorted(bad)}; use {list(KNOBS)}")
        return settings


def _bounds(knob: str, size: int) -> tuple[float, float]:
    field = SizeConfig.model_fields[knob]
    lo = next(m.ge for m in field.metadata if getattr(m, "ge", None) is not None)
    hi = next(m.le for m in field.metadata if getattr(m, "le", None) is not None)
    if knob == "min_path_length":
        hi = min(hi, 2 * (size - 1))
    return lo, hi


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, str):
        try:
            x = float(value.strip().rstrip("%")) / (100 if value.strip().endswith("%") else 1)
        except ValueError:
            return None
        return x if math.isfinite(x) else None
    return None


def finalize(proposal: Proposal, current: EnvConfig, trust_region: dict[str, float] | None) -> tuple[EnvConfig, list[str], bool]:
    """The next configuration from an untrusted proposal: ``(config, notes, fallback_used)``. Never raises on a proposal."""
    notes: list[str] = []
    seed = current.seed + 1
    if not isinstance(proposal.sizes, dict):
        notes.append("no usable proposal: kept the previous configuration")
        return current.model_copy(update={"seed": seed}), notes, True
    raw = {str(k).strip().lower().split("x")[0]: v for k, v in proposal.sizes.items()}
    unknown = sorted(set(raw) - {str(n) for n in current.sizes})
    if unknown:
        notes.append(f"ignored sizes that are not in the configuration: {unknown[:10]}")
    sizes: dict[int, SizeConfig] = {}
    for n, prev in current.sizes.items():
        given = raw.get(str(n))
        if not isinstance(given, dict):
            notes.append(f"size {n}: no knobs given, kept {prev.model_dump()}")
            sizes[n] = prev
            continue
        extra = sorted(set(map(str, given)) - set(KNOBS))
        if extra:
            notes.append(f"size {n}: ignored unknown keys {extra[:5]}")
        knobs = prev.model_dump()
        for knob in KNOBS:
            old = float(knobs[knob])
            value = _number(given.get(knob))
            if value is None:
                if knob in given:
                    notes.append(f"size {n}: {knob} = {str(given.get(knob))[:30]!r} is not a number, kept {old:g}")
                continue
            lo, hi = _bounds(knob, n)
            if not lo <= value <= hi:
                notes.append(f"size {n}: {knob} = {value:g} clamped into [{lo:g}, {hi:g}]")
                value = min(max(value, lo), hi)
            limit = (trust_region or {}).get(knob)
            if limit is not None and abs(value - old) > limit:
                moved = old + math.copysign(limit, value - old)
                notes.append(f"size {n}: {knob} {old:g} -> {value:g} limited to {moved:g} by the trust region (+-{limit:g})")
                value = moved
            knobs[knob] = int(round(value)) if knob == "min_path_length" else round(value, 4)
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
        return EnvConfig(num_agents=current.num_agents, budget=current.budget, seed=seed, sizes=sizes), notes, False
    except (ValidationError, ValueError) as e:  # a combination the checks above missed: fall back, recorded
        notes.append(f"the proposal is still invalid ({str(e).splitlines()[0][:200]}): kept the previous configuration")
        return current.model_copy(update={"seed": seed}), notes, True


def ensure_feasible(config: EnvConfig, previous: EnvConfig, exclude: frozenset[str] = frozenset()) -> tuple[EnvConfig, list[str], bool]:
    """Generate ``config`` as the next stage will (same seed, same exclusions); revert each size the generator cannot
    fill to its previous knobs until it can. Returns ``(config, notes, fell_back_entirely)``."""
    from envgen.generator import GenerationError, generate

    notes: list[str] = []
    for _ in range(len(config.sizes) + 1):
        try:
            for _ in generate(config, exclude=exclude):
                pass
            return config, notes, False
        except GenerationError as e:
            n = e.size
            if n is None or n not in previous.sizes or config.sizes.get(n) == previous.sizes[n]:
                notes.append(f"the proposal cannot be generated ({str(e)[:200]}): kept the previous configuration")
                return previous.model_copy(update={"seed": config.seed}), notes, True
            notes.append(f"size {n}: the proposed knobs cannot be generated ({str(e).split(';')[0][:160]}); "
                         f"reverted to {previous.sizes[n].model_dump()}")
            config = config.model_copy(update={"sizes": {**config.sizes, n: previous.sizes[n]}})
    return previous.model_copy(update={"seed": config.seed}), notes + ["kept the previous configuration"], True


@dataclass(frozen=True)
class EngineerResult:
    config: EnvConfig
    notes: list[str]
    fallback: bool
    log: dict[str, Any]


def engineer_config(summary: dict[str, Any], current: EnvConfig, settings: EngineerSettings, stage: int,
                    adapter: str | None = None, engineer=None, exclude: frozenset[str] = frozenset()) -> EngineerResult:
    """Ask the engineer and finalise its proposal. ``engineer`` may be given (tests, reuse of a loaded model);
    ``exclude`` holds the content hashes the next stage's generation will exclude (the validation set's)."""
    rng = random.Random(f"{settings.seed}:{stage}")
    notes: list[str] = []
    try:
        engineer = engineer or make_engineer(settings.engineer, settings, adapter)
        proposal = engineer.propose(EngineerInput(summary, current, stage, rng))
    except Exception as e:  # noqa: BLE001 - the pipeline goes on with the previous configuration, recorded
        notes.append(f"the engineer failed ({type(e).__name__}: {str(e)[:300]})")
        proposal = Proposal(None)
    config, more, fallback = finalize(proposal, current, settings.trust_region)
    notes += more
    if settings.feasibility_check and not fallback:
        config, more, fallback = ensure_feasible(config, current, exclude)
        notes += more
    log = {"stage": stage, "engineer": settings.engineer, "context": settings.context, "constrained": proposal.constrained,
           "prompt": proposal.prompt, "attempts": proposal.attempts, "proposal": proposal.sizes, "rationale": proposal.rationale,
           "notes": notes, "fallback": fallback, "previous_config": json.loads(current.model_dump_json()),
           "config": json.loads(config.model_dump_json())}
    return EngineerResult(config, notes, fallback, log)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--summary", type=Path, required=True, help="summary.json of the stage (summarize-failures)")
    parser.add_argument("--config", type=Path, required=True, help="the stage's environment configuration YAML")
    parser.add_argument("--stage", type=int, required=True, help="the stage just finished")
    parser.add_argument("--out-config", type=Path, required=True, help="next stage's configuration YAML to write")
    parser.add_argument("--out-log", type=Path, required=True, help="engineer_log.json to write")
    parser.add_argument("--adapter", default=None, help="the current checkpoint's adapter (policy engineer)")
    parser.add_argument("--exclude", type=Path, action="append", default=[], metavar="PARQUET",
                        help="instances the next stage's generation excludes (for the feasibility check), e.g. validation")
    parser.add_argument("--params", type=Path, default=None, help="params.yaml; its 'engineer' section is EngineerSettings")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting, e.g. --set engineer=heuristic")


def run(args: argparse.Namespace) -> int:
    from tasks.tools import load_config_or_report, parse_overrides

    current = load_config_or_report(args.config)
    if current is None:
        return 2
    try:
        settings = EngineerSettings.from_params(args.params, parse_overrides(args.set))
        summary = json.loads(args.summary.read_text())
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from tasks.generate_instances import read_exclusions

    result = engineer_config(summary, current, settings, args.stage, args.adapter, exclude=read_exclusions(args.exclude))
    atomic_write_text(args.out_config, result.config.to_yaml())
    atomic_write_text(args.out_log, json.dumps(result.log, indent=2, default=str))
    print(f"engineer {settings.engineer} ({settings.context}): wrote {args.out_config}"
          f"{' (kept the previous configuration)' if result.fallback else ''}; {len(result.notes)} note(s)")
    return 0
