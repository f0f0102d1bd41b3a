import csv

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envgen.cbs import Solved, SolverBudget, Unsolved, UnsolvedReason, solve, solve_joint
from envgen.instance import Instance
from envgen.movingai import load_instance
from envgen.simulate import Valid, check_paths

from tests.helpers import bench_path, random_solved


def assert_optimal_plan(inst: Instance, result: Solved) -> None:
    check = check_paths(inst, result.paths, result.soc)
    assert isinstance(check, Valid) and check.optimal, check
    assert check.makespan == result.makespan
    assert result.soc == sum(len(p) - 1 for p in result.paths)


def test_swap_in_a_corridor_with_a_side_pocket():
    inst = Instance(("FFF", "HFH"), ((0, 0), (0, 2)), ((0, 2), (0, 0)))
    result = solve(inst)
    assert isinstance(result, Solved)
    # One agent ducks into the pocket (2 extra steps) while the other waits one step: 3 + 4.
    assert (result.soc, result.makespan, result.shortest, result.needs_wait) == (7, 4, (2, 2), True)
    assert_optimal_plan(inst, result)


def test_swap_in_a_dead_end_corridor_is_proven_unsolvable():
    inst = Instance(("FFFF",), ((0, 0), (0, 3)), ((0, 3), (0, 0)))
    result = solve(inst)
    assert isinstance(result, Unsolved)
    assert result.reason is UnsolvedReason.UNSOLVABLE and result.reason.proven


def test_agent_steps_off_its_goal_and_comes_back():
    # Agent 1 starts on its goal in the corridor; agent 2 must pass through it.
    inst = Instance(("FFFF", "HFHH"), ((0, 1), (0, 0)), ((0, 1), (0, 3)))
    result = solve(inst)
    assert isinstance(result, Solved)
    assert result.shortest == (0, 3)
    assert (result.soc, result.makespan) == (5, 3)
    assert result.paths[0][0] == result.paths[0][-1] == (0, 1) and len(result.paths[0]) == 3
    assert_optimal_plan(inst, result)


def test_rotation_cycle_and_following_are_allowed():
    rotate = Instance(("FF", "FF"), ((0, 0), (0, 1), (1, 1), (1, 0)), ((0, 1), (1, 1), (1, 0), (0, 0)))
    result = solve(rotate)
    assert isinstance(result, Solved) and result.soc == 4 and result.makespan == 1
    train = Instance(("FFFF",), ((0, 0), (0, 1)), ((0, 2), (0, 3)))
    result = solve(train)
    assert isinstance(result, Solved) and (result.soc, result.makespan) == (4, 2)
    assert_optimal_plan(train, result)


def test_unreachable_goal_is_no_path():
    inst = Instance(("FHF",), ((0, 0),), ((0, 2),))
    result = solve(inst)
    assert isinstance(result, Unsolved) and result.reason is UnsolvedReason.NO_PATH
    assert result.shortest == (None,)


def test_budgets_end_in_unproven_unsolved_never_a_plan():
    pocket = Instance(("FFFF",), ((0, 0), (0, 3)), ((0, 3), (0, 0)))
    result = solve(pocket, SolverBudget(max_nodes=5, max_joint_work=0))
    assert isinstance(result, Unsolved) and result.reason is UnsolvedReason.NODE_BUDGET and not result.reason.proven
    assert result.nodes == 5
    hard = load_instance(bench_path("custom", "jmorag-8-15-5-17.map"), bench_path("custom", "jmorag-8-15-5-17.scen"), 5)
    result = solve(hard, SolverBudget(max_seconds=1e-9, max_joint_work=0))
    assert isinstance(result, Unsolved) and result.reason is UnsolvedReason.TIME_BUDGET


def test_budget_validation():
    with pytest.raises(ValueError, match="max_nodes"):
        SolverBudget(max_nodes=0)
    with pytest.raises(ValueError, match="max_seconds"):
        SolverBudget(max_seconds=0)


@pytest.mark.parametrize(
    "name, agents, soc, makespan",
    [("circle", 2, 8, 5), ("smallmaze-goaround", 2, 6, 4), ("8-15-5-17", 5, 29, None)],
)
def test_published_small_cases(name, agents, soc, makespan):
    inst = load_instance(bench_path("custom", f"jmorag-{name}.map"), bench_path("custom", f"jmorag-{name}.scen"), agents)
    result = solve(inst)
    assert isinstance(result, Solved) and result.soc == soc
    if makespan is not None:
        assert result.makespan == makespan
    assert_optimal_plan(inst, result)


def test_published_pocket_is_unsolvable():
    inst = load_instance(bench_path("custom", "jmorag-pocket-unsolvable.map"), bench_path("custom", "jmorag-pocket-unsolvable.scen"), 2)
    result = solve(inst)
    assert isinstance(result, Unsolved) and result.reason is UnsolvedReason.UNSOLVABLE


def _published_rows():
    path = bench_path("jmorag-testingbenchmark", "Results.csv")
    rows = []
    for row in csv.DictReader(path.open()):
        map_file = path.parent / f"{row['File']}.map"
        if int(row["#Agents"]) <= 10 and map_file.exists():
            rows.append((row["File"], int(row["#Agents"]), int(row["Plan Cost"])))
    return rows


def test_published_optimal_costs_32x32():
    rows = _published_rows()
    assert len(rows) >= 15
    folder = bench_path("jmorag-testingbenchmark")
    for name, agents, cost in rows:
        inst = load_instance(folder / f"{name}.map", folder / f"{name}.scen", agents)
        result = solve(inst, SolverBudget(max_seconds=60))
        assert isinstance(result, Solved), (name, result)
        assert result.soc == cost, name
        assert_optimal_plan(inst, result)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**9), size=st.integers(3, 5), holes=st.sampled_from([0.0, 0.2, 0.4]),
       agents=st.integers(2, 3), head_on=st.booleans())
def test_cbs_matches_exhaustive_joint_search(seed, size, holes, agents, head_on):
    drawn = random_solved(seed, size, holes, agents, head_on)
    if drawn is None:
        return
    inst, result = drawn
    joint = solve_joint(inst, max_states=2_000_000)
    assert isinstance(joint, Solved)
    assert joint.soc == result.soc
    assert_optimal_plan(inst, result)
    assert_optimal_plan(inst, joint)
    assert result.needs_wait == (result.soc > sum(result.shortest))


def test_pairs_shut_in_pockets_are_proven_unsolvable_before_cbs_and_agree_with_the_joint_search():
    """Two agents whose root conflicts get a small time-free reachability search first (``POCKET_STATES``): a pocket
    they cannot leave is proved unsolvable with no CBS node; every verdict equals the exhaustive joint A*'s."""
    import random

    from envgen.cbs_joint import JointFailure, joint_search
    from envgen.generator import draw_instance
    from envgen.config import SizeConfig
    from envgen.grid import grid_of

    rng = random.Random(11)
    pockets = solved = 0
    for _ in range(400):
        size = rng.randint(3, 5)
        inst = draw_instance(rng, size, SizeConfig(data_ratio=1.0, hole_ratio=0.35, wait_ratio=0.5), 2,
                             head_on=rng.random() < 0.7)
        if inst is None:
            continue
        result = solve(inst)
        if isinstance(result, Unsolved) and result.reason is UnsolvedReason.NO_PATH:
            continue
        grid = grid_of(inst.rows)
        joint = joint_search(grid, [grid.index(c) for c in inst.starts], [grid.index(c) for c in inst.goals], 10**6)
        if isinstance(joint, JointFailure):
            assert joint.unsolvable and isinstance(result, Unsolved) and result.reason is UnsolvedReason.UNSOLVABLE
            pockets += result.nodes == 0
        else:
            assert isinstance(result, Solved) and result.soc == joint.soc
            solved += 1
    assert pockets >= 10 and solved >= 100  # both kinds were exercised
