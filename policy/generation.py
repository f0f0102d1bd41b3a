"""What every generation backend shares (:mod:`policy.backends` has the backends): the sampling settings, one
completion, the backend protocol and its errors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

Conversation = list[dict[str, str]]


class BackendError(RuntimeError):
    """A backend could not generate (missing package, unreachable endpoint after retries, bad response)."""


class ConstrainedDecodingUnavailable(BackendError):
    """Constrained JSON was asked for (``SamplingParams.json_schema``) and the backend cannot decode under a schema:
    an install problem, never a reason to answer unconstrained."""


XGRAMMAR_MISSING = ("constrained JSON decoding needs xgrammar, which is not installed here: install it "
                    "(`pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi`, the `constrained` extra; the `gpu` extra "
                    "has it too), or ask for unconstrained output")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample.

    Attributes:
        max_new_tokens: completion length cap.
        temperature: 0 means greedy decoding.
        top_p: nucleus sampling mass.
        seed: base seed, recorded with each generation as the backend used it: ``transformers`` seeds batch ``k``
            of a call with ``seed + k``, ``vllm`` conversation ``i`` with ``seed + i * n`` (its samples the next
            ``n - 1``), ``openai`` the request for conversation ``i``'s samples from the ``j``-th on with
            ``seed + i * n + j`` (an endpoint that returns fewer choices than asked is asked again).
        stop: generation stops after any of these strings (kept in the text).
        json_schema: a JSON schema (as a JSON string) the output must follow: constrained decoding where the backend
            can (xgrammar for transformers, structured outputs for vLLM, ``response_format`` for OpenAI endpoints).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ("</answer>",)
    json_schema: str | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {self.max_new_tokens}: must be at least 1")
        if not (self.temperature == 0 or 1e-3 <= self.temperature <= 100):  # also refuses NaN
            raise ValueError(f"temperature = {self.temperature}: must be 0 (greedy) or between 0.001 and 100")
        if not 0 < self.top_p <= 1:  # also refuses NaN
            raise ValueError(f"top_p = {self.top_p}: must be in (0, 1]")


@dataclass(frozen=True)
class Generation:
    """One completion."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    latency_s: float
    seed: int
    constrained: bool = False


class Backend(Protocol):
    name: str
    model_id: str
    adapter_hash: str | None

    def generate(self, conversations: Sequence[Conversation], n: int, params: SamplingParams,
                 on_progress: Callable[[int], None] | None = None,
                 budgets: Sequence[int] | None = None) -> list[list[Generation]]: ...

    def count_tokens(self, text: str) -> int: ...


def check_budgets(budgets: Sequence[int] | None, conversations: Sequence[Conversation]) -> None:
    """``budgets``, when given, holds one answer length cap (at least 1 token) per conversation; it then replaces
    ``SamplingParams.max_new_tokens`` for each of them."""
    if budgets is None:
        return
    if len(budgets) != len(conversations):
        raise ValueError(f"{len(budgets)} token budgets for {len(conversations)} conversations: give one each")
    if any(not isinstance(b, int) or b < 1 for b in budgets):
        raise ValueError("every token budget must be a whole number of at least 1")
