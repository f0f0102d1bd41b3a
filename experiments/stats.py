"""The statistics of the experiments (``compare``, ``sensitivity``): intervals of paired differences and of means over
seeds, and a one-way analysis of variance with its permutation test. Quantiles of the t and F distributions
come from SciPy.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Iterator

from envgen.llm.rates import Z95


def paired_difference(a: list[bool], b: list[bool]) -> dict[str, float]:
    """Mean of ``a - b`` over the same instances with a 95% normal interval from the paired differences' spread."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired difference needs two equally long, non-empty lists (got {len(a)} and {len(b)})")
    d = [int(x) - int(y) for x, y in zip(a, b)]
    n = len(d)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1) if n > 1 else 0.0
    half = Z95 * math.sqrt(var / n)
    return {"diff": mean, "low": mean - half, "high": mean + half, "n": n}

def t95(df: int) -> float:
    """The two-sided 95% quantile of Student's t with ``df`` degrees of freedom."""
    from scipy import stats

    return float(stats.t.ppf(0.975, df))


def mean_ci(values: list[float]) -> dict[str, float | None]:
    """Mean and the 95% t-interval half-width; the half-width is None for a single value (no interval, not a zero one)."""
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return {"mean": mean, "ci95": None, "n": n}
    return {"mean": mean, "ci95": t95(n - 1) * statistics.stdev(values) / math.sqrt(n), "n": n}


PERMUTATIONS_EXACT = 200_000  # enumerate every relabeling up to this many, else sample
PERMUTATIONS_SAMPLED = 20_000


def anova(groups: list[list[float]]) -> tuple[float, float, float]:
    """One-way ANOVA of the values in ``groups``: (MS_between, MS_within, F). MS_within is the pooled variance inside
    the groups, MS_between the variance of the group means scaled by the group sizes; F is their ratio (inf when
    MS_within is 0 and the means differ, 0 when nothing varies). Sums are exact (``math.fsum``), so relabelings
    that give the same partition give the same F."""
    n, k = sum(len(g) for g in groups), len(groups)
    grand = math.fsum(x for g in groups for x in g) / n
    means = [math.fsum(g) / len(g) for g in groups]
    ms_between = math.fsum(len(g) * (m - grand) ** 2 for g, m in zip(groups, means)) / (k - 1)
    ms_within = math.fsum((x - m) ** 2 for g, m in zip(groups, means) for x in g) / (n - k)
    if ms_within > 0:
        return ms_between, ms_within, ms_between / ms_within
    return ms_between, ms_within, math.inf if ms_between > 0 else 0.0


def relabelings(sizes: list[int]) -> int:
    """How many distinct ways there are to split ``sum(sizes)`` runs into groups of these sizes (multinomial)."""
    count, left = 1, sum(sizes)
    for size in sizes:
        count *= math.comb(left, size)
        left -= size
    return count


def splits(items: list[int], sizes: list[int]) -> Iterator[list[list[int]]]:
    """Every split of ``items`` into consecutive groups of ``sizes`` (each a list of lists), once each."""
    if not sizes:
        yield []
        return
    for chosen in itertools.combinations(items, sizes[0]):
        rest = [i for i in items if i not in chosen]
        for tail in splits(rest, sizes[1:]):
            yield [list(chosen), *tail]


def permutation_p(groups: list[list[float]]) -> tuple[float, int, bool]:
    """Permutation test of the ANOVA F of ``groups``: the share of relabelings of the values (group sizes kept)
    whose F is at least the observed one, the observed labeling included. Every distinct relabeling when there are at
    most ``PERMUTATIONS_EXACT``, else ``PERMUTATIONS_SAMPLED`` random ones (``random.Random(0)``) plus the observed.
    Returns (p, relabelings counted, exact)."""
    values = [x for g in groups for x in g]
    sizes = [len(g) for g in groups]
    observed = anova(groups)[2] - 1e-12
    if relabelings(sizes) <= PERMUTATIONS_EXACT:
        fs = [anova([[values[i] for i in part] for part in split])[2] for split in splits(list(range(len(values))), sizes)]
        return sum(f >= observed for f in fs) / len(fs), len(fs), True
    rng = random.Random(0)
    hits, shuffled = 1, list(values)
    cut = list(itertools.accumulate(sizes, initial=0))
    for _ in range(PERMUTATIONS_SAMPLED):
        rng.shuffle(shuffled)
        hits += anova([shuffled[a:b] for a, b in zip(cut, cut[1:])])[2] >= observed
    return hits / (PERMUTATIONS_SAMPLED + 1), PERMUTATIONS_SAMPLED + 1, False


def seed_mean_difference(a: list[float], b: list[float], ms_within: float, df: int) -> dict[str, float]:
    """Mean of ``a`` minus mean of ``b`` (seed means of two configurations) with a 95% t interval from the pooled
    seed variance ``ms_within`` on ``df`` degrees of freedom: it covers seed-to-seed variation, not only instances."""
    diff = sum(a) / len(a) - sum(b) / len(b)
    half = t95(df) * math.sqrt(ms_within * (1 / len(a) + 1 / len(b)))
    return {"diff": diff, "low": diff - half, "high": diff + half, "df": df}
