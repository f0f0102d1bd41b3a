from envgen.llm.rates import group, rates, rates_by, share, wilson


def test_rates_count_outcomes_means_and_intervals_and_tell_an_empty_group():
    rows = [{"size": 4, "parsed": True, "valid": True, "optimal": False, "reward": 1.0},
            {"size": 3, "parsed": True, "valid": False, "optimal": False, "reward": -1.0},
            {"size": 4, "parsed": False, "valid": False, "optimal": False, "reward": -2.0},
            {"size": 4, "parsed": True, "valid": True, "optimal": True, "reward": 2.0}]
    r = rates(rows, means=("reward",), intervals=True)
    assert (r["n"], r["parsed"], r["valid"], r["optimal"], r["reward"]) == (4, 0.75, 0.5, 0.25, 0.0)
    assert r["valid_ci"] == wilson(2, 4) and r["valid_ci"][0] < 0.5 < r["valid_ci"][1]
    assert rates([], means=("reward",)) == {"n": 0, "parsed": 0.0, "valid": 0.0, "optimal": 0.0, "reward": 0.0}
    assert list(group(rows, "size")) == [3, 4] and [len(v) for v in group(rows, "size").values()] == [1, 3]
    by = rates_by(rows, lambda row: row["size"] > 3, ("valid",))
    assert by == {False: {"n": 1, "valid": 0.0}, True: {"n": 3, "valid": 2 / 3}}
    assert share([]) == 0.0 and share([1, 0, True, None]) == 0.5


def test_wilson_interval_holds_its_bounds():
    assert wilson(0, 0) == (0.0, 1.0)
    for n in (1, 7, 100):
        for k in range(n + 1):
            low, high = wilson(k, n)
            assert 0.0 <= low <= k / n <= high <= 1.0
