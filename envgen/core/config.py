"""The environment configuration: the YAML file the environment engineer edits between stages.

Example (the round-0 configuration is params.yaml's ``env`` section; later stages' are ``data/stages/K/config.yaml``)::

    num_agents: 2
    budget: 4000
    seed: 0
    sizes:
      3: {data_ratio: 0.5, hole_ratio: 0.2, wait_ratio: 0.5, min_path_length: 1}
      4: {data_ratio: 0.5, hole_ratio: 0.2, wait_ratio: 0.5, min_path_length: 1}

Every field carries a description (read by the engineer LLM through :func:`describe_fields`), a JSON schema is
exported for constrained decoding (:func:`config_json_schema`), and invalid values raise :class:`ConfigError` whose
message names the field, the allowed range and the fix.

Data ratios are relative weights: they are normalised over the listed sizes (``EnvConfig.data_shares``), so
``1, 1, 2`` means a quarter, a quarter and a half. A size with ratio 0 gets no instances. At least one must be positive.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from envgen.core import safe_yaml
from envgen.core.files import atomic_write_text

MIN_SIZE = 3
MAX_SIZE = 16
DEFAULT_SIZES = tuple(range(3, 11))


class ConfigError(ValueError):
    """An invalid configuration. The message has one line per problem: field, value, allowed range, fix."""


class SizeConfig(BaseModel):
    """Knobs of one map size (an N x N grid)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data_ratio: float = Field(
        ge=0.0, le=1.0,
        description="Share of the stage's instance budget given to this map size (a weight in [0, 1]; the weights "
        "of all sizes are normalised to sum to 1). 0 removes the size from the stage.",
    )
    hole_ratio: float = Field(
        default=0.2, ge=0.0, le=0.5,
        description="Fraction of the grid's cells that are holes (obstacles), in [0, 0.5]; the generator places "
        "round(hole_ratio * N * N) holes. More holes mean narrower corridors and longer detours.",
    )
    wait_ratio: float = Field(
        default=0.5, ge=0.0, le=1.0,
        description="Fraction of this size's instances whose optimal plan needs coordination: a wait or a detour, "
        "i.e. optimal sum of costs greater than the sum of the agents' individual shortest paths. In [0, 1]; "
        "needs at least 2 agents to be above 0.",
    )
    min_path_length: int = Field(
        default=1, ge=1, le=2 * (MAX_SIZE - 1),
        description="Smallest shortest-path distance from each agent's start to its goal. Raise it to force "
        "longer routes (at most 2 * (N - 1) on an N x N grid).",
    )


KNOBS = tuple(SizeConfig.model_fields)
"""The per-size knobs an engineer sets: data_ratio, hole_ratio, wait_ratio, min_path_length."""


class EnvConfig(BaseModel):
    """One curriculum stage's environment: which MAPF-FrozenLake instances the generator draws."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_agents: int = Field(
        default=2, ge=1, le=8,
        description="Agents per instance, 1 to 8 (training uses 2; evaluation uses 3 to 5).",
    )
    budget: int = Field(
        default=4000, ge=1, le=1_000_000,
        description="Instances generated for the stage (the trajectory budget of a GRPO round), 1 to 1,000,000.",
    )
    seed: int = Field(
        default=0, ge=0, le=2**63 - 1,
        description="Generator seed. The same configuration and seed give byte-identical instance files.",
    )
    sizes: dict[int, SizeConfig] = Field(
        description=f"Per map size N (an N x N grid, N from {MIN_SIZE} to {MAX_SIZE}) its knobs. Sizes not listed "
        "get no instances.",
    )

    @field_validator("sizes", mode="before")
    @classmethod
    def _size_keys(cls, value: Any) -> Any:
        if isinstance(value, dict):
            out = {}
            for key, knobs in value.items():
                match = None if isinstance(key, bool) else re.fullmatch(r"([0-9]{1,2})(?:x\1)?", str(key))
                if match is None:
                    raise ValueError(f"size key {str(key)[:20]!r} is not a map size; use keys such as 3, 4, ... "
                                     f"{MAX_SIZE} (or 3x3)")
                size = int(match.group(1))
                if not MIN_SIZE <= size <= MAX_SIZE:
                    raise ValueError(f"size {size} is outside {MIN_SIZE}..{MAX_SIZE}; remove it or use a size in range")
                if size in out:
                    raise ValueError(f"size {size} is listed twice; keep one entry per size")
                out[size] = knobs
            return out
        return value

    @model_validator(mode="after")
    def _cross_field(self) -> EnvConfig:
        problems = []
        if not self.sizes:
            problems.append("sizes: empty; list at least one map size, e.g. {3: {data_ratio: 1.0}}")
        elif sum(s.data_ratio for s in self.sizes.values()) <= 0:
            problems.append("sizes.*.data_ratio: all are 0; give at least one size a positive data_ratio")
        for n, s in self.sizes.items():
            if s.min_path_length > 2 * (n - 1):
                problems.append(f"sizes.{n}.min_path_length = {s.min_path_length}: the longest distance on a {n}x{n} grid is "
                                f"{2 * (n - 1)}; set it to at most {2 * (n - 1)}")
            if self.num_agents == 1 and s.wait_ratio > 0 and s.data_ratio > 0:
                problems.append(f"sizes.{n}.wait_ratio = {s.wait_ratio}: with num_agents = 1 no instance needs a wait; set it to 0")
            free = n * n - round(s.hole_ratio * n * n)
            if free < 2 * self.num_agents and s.data_ratio > 0:
                problems.append(f"sizes.{n}.hole_ratio = {s.hole_ratio}: leaves {free} free cells for {self.num_agents} agents' "
                                f"{2 * self.num_agents} starts and goals; lower hole_ratio or num_agents")
        if problems:
            raise ValueError("\n".join(problems))
        return self

    # ------------------------------------------------------------------ derived
    def data_shares(self) -> dict[int, float]:
        """The normalised share of the budget per size (sums to 1)."""
        total = sum(s.data_ratio for s in self.sizes.values())
        return {n: s.data_ratio / total for n, s in sorted(self.sizes.items())}

    def allocation(self) -> dict[int, int]:
        """Instances per size: ``budget * share`` rounded by largest remainder (each within 1 of its exact share;
        ties go to the smaller size), summing to ``budget``."""
        shares = self.data_shares()
        exact = {n: self.budget * share for n, share in shares.items()}
        counts = {n: int(x) for n, x in exact.items()}
        left = self.budget - sum(counts.values())
        for n in sorted(exact, key=lambda k: (-(exact[k] - counts[k]), k))[:left]:
            counts[n] += 1
        return counts

    # ---------------------------------------------------------------- file I/O
    def to_yaml(self) -> str:
        data = self.model_dump()
        data["sizes"] = {n: self.sizes[n].model_dump() for n in sorted(self.sizes)}
        return yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=120)

    def save(self, path: str | Path) -> None:
        """Write the YAML atomically (a crash never leaves a half-written file)."""
        atomic_write_text(path, self.to_yaml())

    @classmethod
    def from_yaml(cls, text: str, source: str = "<yaml>") -> EnvConfig:
        try:
            data = safe_yaml.load(text, source)
        except safe_yaml.YAMLInputError as e:
            raise ConfigError(str(e)) from None
        return cls._from_data(data, source)

    @classmethod
    def load(cls, path: str | Path) -> EnvConfig:
        try:
            data = safe_yaml.read(path)
        except safe_yaml.YAMLInputError as e:
            raise ConfigError(str(e)) from None
        return cls._from_data(data, str(path))

    @classmethod
    def _from_data(cls, data: Any, source: str) -> EnvConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping with num_agents, budget, seed and sizes, got {type(data).__name__}")
        return cls.parse(data, source)

    @classmethod
    def parse(cls, data: dict[str, Any], source: str = "<config>") -> EnvConfig:
        """Validate a mapping; errors become a :class:`ConfigError` naming every bad field and its fix."""
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(format_validation_error(e, source)) from None


def format_validation_error(error: ValidationError, source: str, model: type[BaseModel] | None = None,
                            reference: str = "`env-engineer config-schema --describe`", what: str = "configuration") -> str:
    """One line per problem: ``source: field = value: what is allowed; fix``.

    ``model`` is the validated model (default :class:`EnvConfig`): its field constraints give the allowed ranges;
    ``reference`` is where the fields are documented, named in the fix of a missing or unknown field. Values
    are shown cut to :data:`SHOWN_CHARS` characters, so a huge input never becomes a huge message.
    """
    model = model or EnvConfig
    lines = [f"{source}: invalid {what} ({error.error_count()} problem(s))"]
    for err in error.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        ctx = err.get("ctx") or {}
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f" = {shorten(value)}"
        kind = err["type"]
        if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
            lo, hi = field_range(model, err["loc"])
            fix = f"allowed range [{lo}, {hi}]; set {loc} to a value in that range"
        elif kind == "missing":
            fix = f"the field is required; add {loc} (see {reference})"
        elif kind == "extra_forbidden":
            fix = f"unknown field; remove it or check its spelling (see {reference})"
        elif kind == "value_error":
            fix = str(ctx.get("error", err["msg"]))
        else:
            fix = err["msg"]
        if kind == "value_error" and not err["loc"]:
            lines.extend(f"  {line}" for line in fix.splitlines())
        else:
            lines.append(f"  {loc}{shown}: {fix}")
    return "\n".join(lines)


SHOWN_CHARS = 80
"""Longest value shown in an error message."""


def shorten(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters (a container is described, not printed, once it is large)."""
    if isinstance(value, (list, tuple, set, dict)) and len(value) > 20:
        return f"<{type(value).__name__} of {len(value)} items>"
    text = repr(value) if not isinstance(value, str) or len(value) <= limit else repr(value[:limit])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def field_range(model: type[BaseModel], loc: tuple) -> tuple[Any, Any]:
    """The ``ge``/``le`` bounds of the field at ``loc`` (a pydantic error location) below ``model``, or ``(None, None)``.

    Nested models are followed; a mapping's key (``sizes.4``) is skipped, so ``sizes.4.hole_ratio`` of
    :class:`EnvConfig` is :class:`SizeConfig`'s ``hole_ratio``."""
    import typing

    current: Any = model
    field = None
    for part in loc:
        fields = getattr(current, "model_fields", None)
        if fields is None or str(part) not in fields:
            continue  # a mapping key or list index: stay on the value type found before
        field = fields[str(part)]
        current = field.annotation
        for _ in range(3):  # unwrap dict[K, V], list[V] and X | None to the model inside
            args = [a for a in typing.get_args(current) if a is not type(None)]
            if not args:
                break
            current = args[-1]
    lo = hi = None
    for meta in (field.metadata if field else []):
        lo = getattr(meta, "ge", lo) if getattr(meta, "ge", None) is not None else lo
        hi = getattr(meta, "le", hi) if getattr(meta, "le", None) is not None else hi
    return lo, hi


def config_json_schema(sizes: tuple[int, ...] = DEFAULT_SIZES) -> dict[str, Any]:
    """A strict JSON schema of :class:`EnvConfig` with one required property per listed size, for constrained
    decoding (grammar libraries, ``response_format``) and for validating proposals."""
    size_schema = SizeConfig.model_json_schema()
    size_schema.pop("title", None)
    size_schema["additionalProperties"] = False
    size_schema["required"] = list(SizeConfig.model_fields)
    top = EnvConfig.model_json_schema()
    props = {k: v for k, v in top["properties"].items() if k != "sizes"}
    for v in props.values():
        v.pop("title", None)
    return {
        "title": "EnvConfig",
        "description": (EnvConfig.__doc__ or "").strip(),
        "type": "object",
        "additionalProperties": False,
        "required": [*props, "sizes"],
        "properties": {
            **props,
            "sizes": {
                "type": "object",
                "description": EnvConfig.model_fields["sizes"].description,
                "additionalProperties": False,
                "required": [str(n) for n in sizes],
                "properties": {str(n): size_schema for n in sizes},
            },
        },
    }


def describe_fields() -> str:
    """Every field with its range and description, as plain text for an LLM prompt."""
    lines = []
    for prefix, model in (("", EnvConfig), ("sizes.N.", SizeConfig)):
        for name, field in model.model_fields.items():
            if name == "sizes":
                continue
            lo, hi = field_range(EnvConfig, ("sizes", 0, name) if prefix else (name,))
            rng = f" [{lo}..{hi}]" if lo is not None or hi is not None else ""
            default = "" if field.is_required() else f" (default {field.default})"
            lines.append(f"- {prefix}{name}{rng}{default}: {field.description}")
    lines.insert(3, f"- sizes: {EnvConfig.model_fields['sizes'].description}")
    return "\n".join(lines)


def uniform_config(budget: int = 4000, seed: int = 0, num_agents: int = 2, sizes: tuple[int, ...] = DEFAULT_SIZES) -> EnvConfig:
    """Equal shares over ``sizes`` with the knobs' defaults (20% holes, half the instances need coordination): a quick
    configuration for benchmarks and tests. A curriculum's round 0 is params.yaml's ``env`` section."""
    return EnvConfig(num_agents=num_agents, budget=budget, seed=seed,
                     sizes={n: SizeConfig(data_ratio=round(1 / len(sizes), 6)) for n in sizes})


def schema_json(sizes: tuple[int, ...] = DEFAULT_SIZES) -> str:
    return json.dumps(config_json_schema(sizes), indent=2)


def config_diff(a: EnvConfig, b: EnvConfig) -> list[tuple[str, Any, Any]]:
    """``(field, value in a, value in b)`` for every field that differs, sizes flattened as ``sizes.N.knob`` (with each
    size's normalised ``share``).

    >>> a = uniform_config(budget=10, sizes=(3, 4))
    >>> b = a.model_copy(update={"seed": 1, "sizes": {3: a.sizes[3], 4: a.sizes[4].model_copy(update={"hole_ratio": 0.3})}})
    >>> config_diff(a, b)
    [('seed', 0, 1), ('sizes.4.hole_ratio', 0.2, 0.3)]
    """
    flat_a, flat_b = _flatten(a), _flatten(b)
    return [(k, flat_a.get(k), flat_b.get(k)) for k in sorted(set(flat_a) | set(flat_b), key=_order)
            if flat_a.get(k) != flat_b.get(k)]


def _flatten(cfg: EnvConfig) -> dict[str, Any]:
    out: dict[str, Any] = {k: v for k, v in cfg.model_dump().items() if k != "sizes"}
    for n, knobs in cfg.sizes.items():
        for k, v in knobs.model_dump().items():
            out[f"sizes.{n}.{k}"] = v
    shares = cfg.data_shares()
    for n in cfg.sizes:
        out[f"sizes.{n}.share"] = round(shares[n], 4)
    return out


def _order(key: str) -> tuple:
    parts = key.split(".")
    return (0, key) if len(parts) == 1 else (1, int(parts[1]), parts[2])
