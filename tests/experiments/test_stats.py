import pytest

from envgen.llm.rates import wilson
from experiments.stats import mean_ci, paired_difference, permutation_p, t95


def test_mean_and_t_interval_over_seeds():
    assert mean_ci([1.0]) == {"mean": 1.0, "ci95": None, "n": 1}
    m = mean_ci([0.2, 0.4, 0.6])
    assert m["mean"] == pytest.approx(0.4) and m["ci95"] == pytest.approx(4.302653 * 0.2 / 3 ** 0.5, rel=1e-6)
    assert t95(1) == pytest.approx(12.7062, rel=1e-5) and t95(10) == pytest.approx(2.2281, rel=1e-4)
    assert t95(10_000) == pytest.approx(1.96, abs=1e-3)


def test_wilson_interval_and_paired_difference():
    low, high = wilson(50, 100)
    assert low == pytest.approx(0.4038, abs=1e-3) and high == pytest.approx(0.5962, abs=1e-3)
    assert wilson(0, 0) == (0.0, 1.0) and wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == pytest.approx(1.0)
    d = paired_difference([True, True, False, True], [False, True, False, False])
    assert d["diff"] == pytest.approx(0.5) and d["low"] < 0.5 < d["high"] and d["n"] == 4
    assert paired_difference([True] * 3, [True] * 3) == {"diff": 0.0, "low": 0.0, "high": 0.0, "n": 3}
    with pytest.raises(ValueError, match="equally long"):
        paired_difference([True], [True, False])



def test_permutation_p_samples_when_there_are_too_many_relabelings():
    groups = [[0.1 * g + 0.01 * i for i in range(3)] for g in range(4)]  # 12!/(3!)^4 = 369600 relabelings
    p, count, exact = permutation_p(groups)
    assert count == 20_001 and not exact and p == permutation_p(groups)[0]  # sampled with a fixed seed
    assert 1 / 20_001 <= p < 0.001  # perfectly separated: only relabelings that swap whole groups tie
    # 11 against 12 runs, perfectly separated (23 choose 11 = 1352078 relabelings): only the observed one reaches its F
    assert permutation_p([[0.01 * i for i in range(11)], [0.5 + 0.01 * i for i in range(12)]]) == (1 / 20_001, 20_001, False)
    assert permutation_p([[0.5, 0.5], [0.5, 0.5]]) == (1.0, 6, True)  # nothing varies: every relabeling ties
