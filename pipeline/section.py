"""What every section of ``params.yaml`` shares (:mod:`pipeline.params`, :mod:`pipeline.train_settings`): the
settings model's rules and the bounds of seeds and temperatures."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A section of ``params.yaml``: unknown keys refused, frozen, and no NaN or infinity anywhere (a learning rate,
    an epoch count or a trust region of inf is a typo that would break a step long after it started)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


SEED_MAX = 2**31 - 1
"""Largest seed a step takes: torch, numpy and transformers all accept it (numpy refuses seeds of 2^32 and more, and a
rollout's batch k uses seed + k)."""
TEMPERATURE_MIN = 1e-3
"""Smallest positive sampling temperature: below it the logits divided by it overflow (1e-320 crashed sampling)."""
