"""Level samplers from unsupervised environment design, as engineers: they set each map size's share of the next
stage's budget (``data_ratio``) from what the stages so far measured, and keep the other knobs. The levels are the
configuration's map sizes (its buckets); no language model is involved.

- ``plr``: Prioritized Level Replay (Jiang, Grefenstette and Rocktaschel, ICML 2021) with a regret score. In MAPF the
  best return is known (the solver's optimal plan earns reward 1), so a size's regret is ``1 - mean reward`` of its
  answers: of the stage's GRPO completions when it trained on that size, else of its validation answers. Replay
  distribution ``(1 - rho) * P_score + rho * P_staleness``: ``P_score`` by rank (``h = 1 / rank``, temperature
  ``beta``), ``P_staleness`` proportional to the stages since the size last had budget.
- ``alp``: absolute learning progress (Portelas et al., CoRL 2019; Kanitscheider et al., 2021): a size's score is
  ``|v_k - v_(k-1)|``, the change of its validation valid rate between the last two stages that measured it; a size
  with fewer than two measurements gets the largest score seen (or 1), so it is tried. Shares proportional to
  ``score + epsilon``.
- ``learnability``: Sampling For Learnability (Rutherford et al., NeurIPS 2024), the score online difficulty filtering
  (Bae et al., 2025) and LILO give prompts in LLM RL: a size's score is ``p (1 - p)``, its validation valid rate's
  Bernoulli variance, largest where half the answers are valid, 0 where none or all are; a size not measured yet gets
  the largest possible score (0.25), so it is tried. Shares proportional to ``score + epsilon``; the other knobs stay.
"""

from __future__ import annotations

from engineers.proposal import EngineerInput, Proposal
from engineers.summary import Summary


def regret_by_size(summary: Summary) -> dict[str, float]:
    """``1 - mean reward`` per size: training completions where the size trained, else validation answers."""
    regret: dict[str, float] = {}
    if summary.validation is not None:
        regret.update({n: 1.0 - r.reward for n, r in summary.validation.by_size.items() if r.n})
    if summary.training is not None and summary.training.by_size:
        regret.update({n: 1.0 - t.reward for n, t in summary.training.by_size.items() if t.count})
    return regret


def last_budgeted(summary: Summary, stage: int) -> dict[str, int]:
    """Per size, the last stage (up to ``stage``) whose configuration gave it a share of the budget."""
    seen: dict[str, int] = {}
    for entry in summary.history:
        for n, knobs in entry.config_sizes.items():
            if knobs.data_ratio > 0:
                seen[n] = max(seen.get(n, -1), entry.stage)
    if summary.config is not None:
        for n, knobs in summary.config.sizes.items():
            if knobs.data_ratio > 0:
                seen[str(n)] = max(seen.get(str(n), -1), stage)
    return seen


def rank_weights(scores: dict[str, float], beta: float) -> dict[str, float]:
    """PLR's rank prioritisation: ``(1 / rank) ** (1 / beta)``, normalised; equal scores share the mean of their ranks'
    weights."""
    order = sorted(scores, key=lambda n: -scores[n])
    by_rank = [(1.0 / (i + 1)) ** (1.0 / beta) for i in range(len(order))]
    h = {}
    for n in order:
        tied = [i for i, m in enumerate(order) if scores[m] == scores[n]]
        h[n] = sum(by_rank[i] for i in tied) / len(tied)
    total = sum(h.values())
    return {n: v / total for n, v in h.items()}


class PLREngineer:
    """Prioritized Level Replay over map sizes with a regret score (see the module docstring)."""

    name = "plr"

    def __init__(self, rho: float = 0.3, beta: float = 0.3) -> None:
        self.rho, self.beta = rho, beta

    def propose(self, inp: EngineerInput) -> Proposal:
        names = [str(n) for n in inp.current.sizes]
        regret = regret_by_size(inp.summary)
        if not regret:
            return Proposal({n: inp.current.sizes[int(n)].model_dump() for n in names},
                            "plr: no measurements yet; configuration kept")
        top = max(regret.values())
        scores = {n: regret.get(n, top) for n in names}  # unmeasured sizes rank with the highest regret
        p_score = rank_weights(scores, self.beta)
        last = last_budgeted(inp.summary, inp.stage)
        stale = {n: inp.stage + 1 - last.get(n, -1) for n in names}
        total_stale = sum(stale.values())
        p = {n: (1 - self.rho) * p_score[n] + self.rho * stale[n] / total_stale for n in names}
        sizes = {n: inp.current.sizes[int(n)].model_dump() | {"data_ratio": round(p[n], 4)} for n in names}
        ranked = sorted(names, key=lambda n: -p[n])[:3]
        return Proposal(sizes, "plr: most budget to " + ", ".join(f"{n}x{n} (regret {scores[n]:.2f})" for n in ranked))


class ALPEngineer:
    """Absolute learning progress per map size (see the module docstring)."""

    name = "alp"

    def __init__(self, epsilon: float = 0.02) -> None:
        self.epsilon = epsilon

    def propose(self, inp: EngineerInput) -> Proposal:
        names = [str(n) for n in inp.current.sizes]
        measured: dict[str, list[float]] = {n: [] for n in names}
        for entry in sorted(inp.summary.history, key=lambda e: e.stage):
            for n, v in entry.valid_by_size.items():
                if n in measured:
                    measured[n].append(v)
        validation = inp.summary.validation
        if validation is not None and not any(e.stage == inp.summary.stage for e in inp.summary.history):
            for n, r in validation.by_size.items():
                if n in measured and r.n:
                    measured[n].append(r.valid)
        progress = {n: abs(v[-1] - v[-2]) for n, v in measured.items() if len(v) >= 2}
        top = max(progress.values(), default=1.0) or 1.0
        scores = {n: progress.get(n, top) for n in names}
        total = sum(scores.values()) + self.epsilon * len(names)
        sizes = {n: inp.current.sizes[int(n)].model_dump() | {"data_ratio": round((scores[n] + self.epsilon) / total, 4)}
                 for n in names}
        ranked = sorted(names, key=lambda n: -scores[n])[:3]
        return Proposal(sizes, "alp: most budget to " + ", ".join(
            f"{n}x{n} ({'progress %.2f' % progress[n] if n in progress else 'not yet measured twice'})" for n in ranked))


class LearnabilityEngineer:
    """The budget goes to the sizes whose validation valid rate p is nearest 50%: shares proportional to
    ``p (1 - p) + epsilon`` (see the module docstring)."""

    name = "learnability"

    def __init__(self, epsilon: float = 0.01) -> None:
        self.epsilon = epsilon

    def propose(self, inp: EngineerInput) -> Proposal:
        names = [str(n) for n in inp.current.sizes]
        by_size = inp.summary.validation.by_size if inp.summary.validation is not None else {}
        measured = {n: by_size[n].valid for n in names if n in by_size and by_size[n].n}
        scores = {n: measured[n] * (1 - measured[n]) if n in measured else 0.25 for n in names}
        total = sum(scores.values()) + self.epsilon * len(names)
        sizes = {n: inp.current.sizes[int(n)].model_dump() | {"data_ratio": round((scores[n] + self.epsilon) / total, 4)}
                 for n in names}
        ranked = sorted(names, key=lambda n: -scores[n])[:3]
        return Proposal(sizes, "learnability: most budget to " + ", ".join(
            f"{n}x{n} ({'valid %.0f%%' % (100 * measured[n]) if n in measured else 'not measured yet'})" for n in ranked))
