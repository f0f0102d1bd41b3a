"""Pipeline step ``engineer-config``: the stage summary and configuration in, the next configuration and a log out.

Whatever engineer speaks (:data:`engineers.registry.ENGINEERS`, chosen by params.yaml's ``engineer`` section), its
proposal is data that :func:`engineers.proposal.finalize` turns into a valid configuration; with
``engineer.feasibility_check`` the generator then fills it once as the next stage will, and sizes it cannot fill go back
to their previous knobs (:func:`engineers.proposal.ensure_feasible`). An engineer that fails keeps the previous
configuration, recorded, and the pipeline goes on; constrained decoding asked for where it cannot run (xgrammar
missing) stops the step with the fix instead, since an engineer that cannot answer would quietly become ``fixed``.

``engineer_log.json`` keeps everything: engineer, context, the prompt, every attempt's raw output and error, the parsed
proposal, the rationale, the notes, whether the fallback was used, and the previous and resulting configurations.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engineers.proposal import EngineerInput, Engineer, Proposal, ensure_feasible, finalize
from engineers.registry import EngineerBuild, asks_a_server, make_engineer
from engineers.summary import Summary
from envgen.core.config import ConfigError, EnvConfig
from envgen.formats.dataset import read_exclusions
from envgen.core.files import atomic_write_text
from policy.backends import ConstrainedDecodingUnavailable
from pipeline.params import (EngineerSettings, ParamsError, PolicySettings, RolloutSettings, add_params_arguments,
                             load_params)


@dataclass(frozen=True)
class EngineerResult:
    """The next configuration, the notes on how the proposal became it, whether the previous one was kept, and the
    whole record for ``engineer_log.json``."""

    config: EnvConfig
    notes: tuple[str, ...]
    fallback: bool
    log: dict[str, Any]


def engineer_config(summary: Summary, current: EnvConfig, settings: EngineerSettings, policy: PolicySettings, stage: int,
                    adapter: str | None = None, engineer: Engineer | None = None,
                    exclude: frozenset[str] = frozenset(), served: RolloutSettings | None = None) -> EngineerResult:
    """Ask the engineer and finalise its proposal. ``engineer`` may be given (tests, reuse of a loaded model);
    ``exclude`` holds the content hashes the next stage's generation will exclude (the validation set's); ``served``:
    the rollout's settings, whose served policy the policy and base engineers ask where there is one
    (:class:`engineers.registry.EngineerBuild`)."""
    rng = random.Random(f"{settings.seed}:{stage}")
    notes: list[str] = []
    try:
        engineer = engineer or make_engineer(EngineerBuild(settings, policy, adapter, served=served))
        proposal = engineer.propose(EngineerInput(summary, current, stage, rng))
    except ConstrainedDecodingUnavailable:
        raise  # an install problem: the run must stop, not go on with an engineer that cannot answer
    except Exception as e:  # noqa: BLE001 - the pipeline goes on with the previous configuration, recorded
        notes.append(f"the engineer failed ({type(e).__name__}: {str(e)[:300]})")
        proposal = Proposal(None)
    result = finalize(proposal, current, settings.trust_region)
    notes += result.notes
    if settings.feasibility_check and not result.fallback:
        result = ensure_feasible(result.config, current, exclude)
        notes += result.notes
    log = {"stage": stage, "engineer": settings.engineer, "context": settings.context, "constrained": proposal.constrained,
           "prompt": proposal.prompt, "attempts": list(proposal.attempts), "proposal": proposal.sizes,
           "rationale": proposal.rationale, "notes": notes, "fallback": result.fallback,
           "previous_config": json.loads(current.model_dump_json()), "config": json.loads(result.config.model_dump_json())}
    return EngineerResult(result.config, tuple(notes), result.fallback, log)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pipeline.params import ENGINEER_LINES

    parser.epilog = "engineers (engineer.engineer): " + "; ".join(f"{k}: {v}" for k, v in ENGINEER_LINES.items()) + "."
    add_params_arguments(parser)
    parser.add_argument("--summary", type=Path, required=True, help="summary.json of the stage (summarize-failures)")
    parser.add_argument("--config", type=Path, required=True, help="the stage's environment configuration YAML")
    parser.add_argument("--stage", type=int, required=True, help="the stage just finished")
    parser.add_argument("--out-config", type=Path, required=True, help="next stage's configuration YAML to write")
    parser.add_argument("--out-log", type=Path, required=True, help="engineer_log.json to write")
    parser.add_argument("--adapter", default=None, help="the current checkpoint's adapter (policy engineer)")
    parser.add_argument("--exclude", type=Path, action="append", default=[], metavar="PARQUET",
                        help="instances the next stage's generation excludes (for the feasibility check): the same as "
                        "generate-instances' --exclude (validation and benchmark)")


def import_libraries() -> None:
    """What the policy's generation imports (seconds of start-up), loaded before the wait for a GPU slot."""
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import policy.backends  # noqa: F401


def run(args: argparse.Namespace) -> int:
    try:
        params = load_params(args.params, args.set)
        current = EnvConfig.load(args.config)
        summary = Summary.read(args.summary)
        exclude = read_exclusions(args.exclude)
    except (ParamsError, ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if params.engineer.engineer in ("policy", "base") and not asks_a_server(params.rollout):
        from policy.devices import claim_gpu_after

        claim_gpu_after(import_libraries)  # the imports before the wait for a GPU slot, where that is safe
    try:
        result = engineer_config(summary, current, params.engineer, params.policy, args.stage, args.adapter,
                                 exclude=exclude, served=params.rollout)
    except ConstrainedDecodingUnavailable as e:
        print(f"error: engineer.constrained is true but {e} (`engineer.constrained: false`)", file=sys.stderr)
        return 2
    atomic_write_text(args.out_config, result.config.to_yaml())
    atomic_write_text(args.out_log, json.dumps(result.log, indent=2, default=str))
    print(decision_line(args.stage, params.engineer.engineer, current, result))
    print(f"wrote {args.out_config}; {len(result.notes)} note(s) in {args.out_log}")
    return 0


def decision_line(stage: int, engineer: str, current: EnvConfig, result: EngineerResult, limit: int = 6) -> str:
    """One line a reader can follow: which knobs the engineer changed for the next stage (the seed aside), and why.

    >>> from envgen.core.config import uniform_config
    >>> a = uniform_config(budget=10, sizes=(3, 4))
    >>> b = a.model_copy(update={"seed": 1, "sizes": {3: a.sizes[3].model_copy(update={"data_ratio": 0.2}), 4: a.sizes[4]}})
    >>> decision_line(0, "heuristic", a, EngineerResult(b, (), False, {"rationale": "3x3 is solved"}))
    'stage 0 -> 1, engineer heuristic: 3x3 share 0.50 -> 0.29, 4x4 share 0.50 -> 0.71; why: 3x3 is solved'
    """
    from envgen.core.config import config_diff

    changes = []
    for field, a, b in config_diff(current, result.config):
        if field == "seed" or field.endswith(".data_ratio"):  # the shares say what the ratios do
            continue
        _, size, knob = field.split(".")
        if isinstance(a, float) or isinstance(b, float):
            a, b = f"{a or 0:.2f}", f"{b or 0:.2f}"
        changes.append(f"{size}x{size} {knob} {a} -> {b}")
    what = "kept the previous configuration" if result.fallback else (", ".join(changes[:limit]) + (
        f" and {len(changes) - limit} more" if len(changes) > limit else "") if changes else "no change")
    why = " ".join(str(result.log.get("rationale") or "").split())[:160]
    return f"stage {stage} -> {stage + 1}, engineer {engineer}: {what}" + (f"; why: {why}" if why else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="env-engineer engineer-config", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
