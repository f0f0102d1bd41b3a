"""Outcome rates of scored answers, overall and by group, with their 95% intervals: the one place where the steps
(train, rollout, summarize-failures), the benchmark, the studies and the benchmark scripts count them.

A row is a mapping with boolean outcome columns (``parsed``, ``valid``, ``optimal``, as the trajectories files and
the benchmark's outcomes hold them) and, where it has one, a numeric ``reward``. Rates of no rows are 0.0 with
``n`` 0, so a caller can always tell an empty group from a failed one.

>>> rows = [{"size": 3, "valid": True, "optimal": True}, {"size": 3, "valid": True, "optimal": False},
...         {"size": 4, "valid": False, "optimal": False}]
>>> rates(rows, ("valid", "optimal"))
{'n': 3, 'valid': 0.6666666666666666, 'optimal': 0.3333333333333333}
>>> {size: r["valid"] for size, r in rates_by(rows, "size", ("valid",)).items()}
{3: 1.0, 4: 0.0}
>>> [round(x, 3) for x in wilson(2, 3)]
[0.208, 0.939]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

OUTCOMES = ("parsed", "valid", "optimal")
"""The boolean outcome columns of a scored answer, from weakest to strongest."""
Z95 = 1.959963984540054
"""The two-sided 95% quantile of the standard normal distribution."""

Row = Mapping[str, Any]


def share(values: Iterable[Any]) -> float:
    """The fraction of ``values`` that are true (0.0 for none)."""
    flags = [bool(v) for v in values]
    return sum(flags) / len(flags) if flags else 0.0


def wilson(k: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a rate of ``k`` successes in ``n`` trials ((0, 1) when n is 0)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + Z95 ** 2 / (2 * n)) / (1 + Z95 ** 2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95 ** 2 / (4 * n * n)) / (1 + Z95 ** 2 / n)
    # exactly 0 (1) at no (all) successes, where the formula leaves a rounding error of about 1e-17
    return (0.0 if k == 0 else max(0.0, centre - half)), (1.0 if k == n else min(1.0, centre + half))


def rates(rows: Sequence[Row], outcomes: Sequence[str] = OUTCOMES, means: Sequence[str] = (),
          intervals: bool = False) -> dict[str, Any]:
    """``n``, the share of ``rows`` true in each of ``outcomes``, the mean of each of ``means`` (e.g. ``reward``) and,
    with ``intervals``, each outcome's Wilson interval as ``<outcome>_ci``."""
    n = len(rows)
    out: dict[str, Any] = {"n": n}
    for column in outcomes:
        k = sum(bool(r[column]) for r in rows)
        out[column] = k / n if n else 0.0
        if intervals:
            out[f"{column}_ci"] = wilson(k, n)
    for column in means:
        out[column] = math.fsum(float(r[column]) for r in rows) / n if n else 0.0
    return out


def group(rows: Iterable[Row], key: str | Callable[[Row], Hashable]) -> dict[Any, list[Row]]:
    """``rows`` by the value of column ``key`` (or of the function ``key``), groups in sorted order of that value."""
    of = key if callable(key) else (lambda r: r[key])
    groups: dict[Any, list[Row]] = {}
    for r in rows:
        groups.setdefault(of(r), []).append(r)
    return dict(sorted(groups.items()))


def rates_by(rows: Iterable[Row], key: str | Callable[[Row], Hashable], outcomes: Sequence[str] = OUTCOMES,
             means: Sequence[str] = (), intervals: bool = False) -> dict[Any, dict[str, Any]]:
    """:func:`rates` of each :func:`group` of ``rows``."""
    return {k: rates(rs, outcomes, means, intervals) for k, rs in group(rows, key).items()}
