"""Engineers without a language model: ``fixed`` (keeps the configuration), ``random`` (the paper's random-configuration
baseline), ``heuristic`` (a competence-frontier curriculum) and ``oracle`` (replays a given sequence of
configurations: an upper bound from a sensitivity study, never an engineer)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engineers.proposal import EngineerInput, Proposal


class FixedEngineer:
    """Keeps the configuration."""

    name = "fixed"

    def propose(self, inp: EngineerInput) -> Proposal:
        return Proposal({str(n): s.model_dump() for n, s in inp.current.sizes.items()}, "fixed: keep the configuration")


class RandomEngineer:
    """Independent uniform draws within each knob's range; data ratios from a flat Dirichlet."""

    name = "random"

    def propose(self, inp: EngineerInput) -> Proposal:
        rng = inp.rng
        weights = {n: rng.gammavariate(1.0, 1.0) for n in inp.current.sizes}
        total = sum(weights.values())
        sizes = {}
        for n in inp.current.sizes:
            sizes[str(n)] = {"data_ratio": round(weights[n] / total, 4), "hole_ratio": round(rng.uniform(0, 0.5), 3),
                             "wait_ratio": round(rng.uniform(0, 1) if inp.current.num_agents > 1 else 0.0, 3),
                             "min_path_length": rng.randint(1, max(1, n - 1))}
        return Proposal(sizes, "random configuration")


class HeuristicEngineer:
    """Competence-frontier curriculum from each size's validation valid rate v.

    Budget weight ``0.2 + 4 v (1 - v)`` (most where v is near 0.5, a floor everywhere); where v > 0.7 the size gets
    harder (holes +0.05, waits +0.1), where v < 0.3 easier (holes -0.05, waits -0.1); sizes without evidence keep
    their knobs.
    """

    name = "heuristic"

    def propose(self, inp: EngineerInput) -> Proposal:
        by_size = inp.summary.validation.by_size if inp.summary.validation else {}
        sizes, notes = {}, []
        for n, knobs in inp.current.sizes.items():
            k = knobs.model_dump()
            r = by_size.get(str(n))
            if r is None or not r.n:
                sizes[str(n)] = k
                continue
            v = r.valid
            k["data_ratio"] = round(0.2 + 4 * v * (1 - v), 4)
            if v > 0.7:
                k["hole_ratio"] = round(k["hole_ratio"] + 0.05, 3)
                k["wait_ratio"] = round(k["wait_ratio"] + 0.1, 3)
                notes.append(f"{n}x{n} harder (valid {v:.0%})")
            elif v < 0.3:
                k["hole_ratio"] = round(k["hole_ratio"] - 0.05, 3)
                k["wait_ratio"] = round(k["wait_ratio"] - 0.1, 3)
                notes.append(f"{n}x{n} easier (valid {v:.0%})")
            sizes[str(n)] = k
        return Proposal(sizes, "; ".join(notes) or "no size outside the 30-70% band")


class OracleEngineer:
    """Replays a sequence of configurations chosen in advance, ``replay[k]`` after stage ``k`` (the configuration of
    stage ``k + 1``; the last one again after the sequence ends): the best hand-set sequence of a sensitivity study, so
    a comparison shows the most an engineer could have gained. A size of the configuration that ``replay[k]`` leaves
    out gets no budget. It reads nothing of the stage; it is an upper bound, not an engineer."""

    name = "oracle"

    def __init__(self, replay: Sequence[Mapping[Any, Any]]) -> None:
        if not replay:
            raise ValueError("engineer 'oracle' needs engineer.replay: the size knobs of each engineered stage, in order")
        self.replay = list(replay)

    def propose(self, inp: EngineerInput) -> Proposal:
        k = min(inp.stage, len(self.replay) - 1)
        given = {str(n): dict(knobs) for n, knobs in self.replay[k].items()}
        sizes = {str(n): given.get(str(n), {"data_ratio": 0.0}) for n in inp.current.sizes} | given
        return Proposal(sizes, f"oracle: replays engineer.replay[{k}] (an upper bound, not an engineer)")
