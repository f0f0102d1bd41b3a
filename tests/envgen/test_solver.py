import csv
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envgen.solver.cbs import Solved, SolverBudget, Unsolved, UnsolvedReason, solve, solve_joint
from envgen.core.instance import Instance
from envgen.formats.movingai import load_instance
from envgen.core.simulate import Valid, check_paths

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


def test_the_cyclic_collector_is_paused_during_a_solve_and_restored_after(monkeypatch):
    """solve pauses Python's cyclic garbage collector while it searches and leaves it as it found it, on or off,
    also when the search raises."""
    import gc

    import envgen.solver.cbs as cbs

    corridor = Instance(("FFF", "HFH"), ((0, 0), (0, 2)), ((0, 2), (0, 0)))
    seen = []
    real = cbs.CBS.start

    def spy(self):
        seen.append(gc.isenabled())
        return real(self)

    monkeypatch.setattr(cbs.CBS, "start", spy)
    was = gc.isenabled()
    try:
        for state in (True, False):
            (gc.enable if state else gc.disable)()
            assert isinstance(solve(corridor), Solved)
            assert gc.isenabled() is state
        gc.enable()
        monkeypatch.setattr(cbs.CBS, "start", lambda self: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            solve(corridor)
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False, False]


def test_agreeing_shortest_paths_are_returned_as_the_search_would(monkeypatch):
    """Up to AGREE_FIRST agents, solve answers from the plain shortest paths when no two collide: the same result,
    field for field, as grouping the agents and searching (the check turned off), on drawn instances of 1-6 agents.
    The budget counts work only (the clock far off), so an instance the search gives up on gives up at the same node
    on a busy machine too."""
    import random

    import envgen.solver.cbs as cbs
    from envgen.core.config import SizeConfig
    from envgen.generator import draw_instance

    rng = random.Random(7)
    budget = SolverBudget(max_nodes=2_000, max_seconds=3_600)
    agreed = 0
    for _ in range(300):
        inst = draw_instance(rng, rng.randint(3, 8), SizeConfig(data_ratio=1.0, hole_ratio=0.2, wait_ratio=0.5), rng.randint(1, 6))
        if inst is None:
            continue
        fast = solve(inst, budget)
        agreed += cbs.shortest_paths_agree(inst)
        with monkeypatch.context() as m:
            m.setattr(cbs, "AGREE_FIRST", 0)
            assert solve(inst, budget) == fast, inst
    assert agreed > 50


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

    from envgen.solver.cbs_joint import JointFailure, joint_search
    from envgen.generator import draw_instance
    from envgen.core.config import SizeConfig
    from envgen.core.grid import grid_of

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


def test_agreeing_shortest_paths_mean_no_wait_and_disagreeing_ones_say_nothing():
    """``shortest_paths_agree`` (the generator's screen of draws for wait slots): True only where the solver finds the
    sum of the shortest distances optimal; a swap in a corridor or two agents stepping onto one cell are not agreement."""
    import random

    from envgen.solver.cbs import shortest_paths_agree
    from envgen.core.config import SizeConfig
    from envgen.generator import draw_instance

    assert not shortest_paths_agree(Instance(("FFF", "HFH"), ((0, 0), (0, 2)), ((0, 2), (0, 0))))  # swap
    assert not shortest_paths_agree(Instance(("FFF", "HFH"), ((0, 0), (1, 1)), ((0, 2), (0, 1))))  # one cell at t=1
    assert not shortest_paths_agree(Instance(("FFF", "HHH"), ((0, 0), (0, 1)), ((0, 2), (0, 1))))  # over a goal
    assert shortest_paths_agree(Instance(("FFF", "FFF"), ((0, 0), (1, 2)), ((0, 2), (1, 0))))  # side by side
    rng = random.Random(5)
    said = Counter()
    for i in range(3000):
        agents = (2, 2, 3, 4)[i % 4]
        inst = draw_instance(rng, rng.randint(3, 7), SizeConfig(data_ratio=1, hole_ratio=rng.choice([0.0, 0.2, 0.4])),
                             agents, head_on=i % 3 == 0)
        if inst is None:
            continue
        agree = shortest_paths_agree(inst)
        result = solve(inst)
        said[agree, isinstance(result, Solved) and not result.needs_wait] += 1
        if agree:
            assert isinstance(result, Solved) and result.soc == sum(result.shortest), inst
    assert said[True, True] > 500 and said[False, True] > 50 and said[False, False] > 200, said


def test_first_conflict_finds_meetings_and_swaps_and_agents_staying_on_their_goals():
    from envgen.solver.cbs import first_conflict

    assert first_conflict([[0, 1, 2], [4, 5, 6]]) is None
    assert first_conflict([[0, 1, 2], [2, 1, 0]]) == (0, 1)  # both on 1 at t=1
    assert first_conflict([[0, 1], [1, 0]]) == (0, 1)  # a swap
    assert first_conflict([[0, 1, 2], [3, 0, 1]]) is None  # following is allowed
    assert first_conflict([[5], [3, 4, 5]]) == (0, 1)  # agent 0 stays on its goal 5
    assert first_conflict([[7, 8], [8, 9], [3, 4, 9]]) == (1, 2)


def _drawn(seed: int, count: int, agents: tuple[int, ...], sizes: tuple[int, ...], holes: tuple[float, ...]):
    import random

    from envgen.core.config import SizeConfig
    from envgen.generator import draw_instance

    rng = random.Random(seed)
    while count:
        inst = draw_instance(rng, rng.choice(sizes), SizeConfig(data_ratio=1, hole_ratio=rng.choice(holes)),
                             rng.choice(agents), head_on=rng.random() < 0.3)
        if inst is not None:
            count -= 1
            yield inst


def test_independence_detection_agrees_with_the_joint_search():
    """``independent_groups`` (the solver's last resort) against the whole group's joint A*: the same optimum with a
    conflict-free plan, or both proving that no plan exists."""
    from envgen.solver.cbs import first_conflict, independent_groups
    from envgen.solver.cbs_joint import JointFailure, JointPlan, joint_search
    from envgen.core.grid import grid_of

    verdicts = Counter()
    for inst in _drawn(3, 250, (2, 3, 4), (4, 5, 6), (0.2, 0.35, 0.5)):
        grid = grid_of(inst.rows)
        starts, goals = [grid.index(c) for c in inst.starts], [grid.index(c) for c in inst.goals]
        if _unreachable(grid, starts, goals):
            continue
        whole = joint_search(grid, starts, goals, 2_000_000)
        parted = independent_groups(grid, starts, goals, 2_000_000)
        if isinstance(whole, JointFailure):
            assert whole.unsolvable and isinstance(parted, str), inst.to_str()
            verdicts["unsolvable"] += 1
            continue
        assert isinstance(parted, JointPlan) and parted.soc == whole.soc, inst.to_str()
        assert first_conflict(parted.paths) is None and [p[0] for p in parted.paths] == starts
        assert [p[-1] for p in parted.paths] == goals and parted.soc == sum(len(p) - 1 for p in parted.paths)
        verdicts["split" if parted.states < whole.states else "solved"] += 1
    assert verdicts["unsolvable"] >= 5 and verdicts["solved"] + verdicts["split"] >= 150, verdicts


def _unreachable(grid, starts, goals) -> bool:
    from envgen.core.grid import UNREACHABLE

    return any(grid.distances_from(g)[s] == UNREACHABLE for s, g in zip(starts, goals))


def test_joint_search_avoiding_other_paths_within_a_cost():
    """The constrained joint A* (independence detection's replanning): its plan never conflicts with the paths it
    avoids and costs at most ``max_cost``; without constraints to bind, the same optimum as the plain search."""
    from envgen.solver.cbs import first_conflict
    from envgen.solver.cbs_joint import JointPlan, joint_search
    from envgen.core.grid import grid_of

    found = 0
    for inst in _drawn(8, 150, (3,), (4, 5), (0.1, 0.25)):
        grid = grid_of(inst.rows)
        starts, goals = [grid.index(c) for c in inst.starts], [grid.index(c) for c in inst.goals]
        if _unreachable(grid, starts, goals):
            continue
        plain = joint_search(grid, starts[:2], goals[:2], 500_000)
        free = joint_search(grid, starts[:2], goals[:2], 500_000, avoid=[], max_cost=None)
        assert type(plain) is type(free) and getattr(plain, "soc", None) == getattr(free, "soc", None)
        third = joint_search(grid, starts[2:], goals[2:], 10_000)
        if not isinstance(third, JointPlan) or not isinstance(plain, JointPlan):
            continue
        for cap in (plain.soc, plain.soc + 2):
            got = joint_search(grid, starts[:2], goals[:2], 500_000, avoid=third.paths, max_cost=cap)
            if isinstance(got, JointPlan):
                found += 1
                assert got.soc <= cap and first_conflict(got.paths + third.paths) is None, inst.to_str()
                assert [p[0] for p in got.paths] == starts[:2] and [p[-1] for p in got.paths] == goals[:2]
    assert found >= 100, found


def test_the_over_budget_five_agent_draw_is_solved_by_independence_detection():
    """Draw 218 of the dense five-agent benchmark (seed 0): CBS and the five-agent joint A* give up within the default
    budget; split into independent groups it is solved (agents 2 and 4 make way for agent 1 in a corridor)."""
    rows = tuple("HFHFFHHFHH HHHHHHFFFF HFFHHFFHFF FHHHFFHHFF HFHHFHFFFF HHFFFFFHFF HFHFFHHFHH FHHFHHFFFH HHHFFFHFHH "
                 "HHFFHFFFHH".split())
    inst = Instance(rows, ((7, 7), (8, 5), (3, 9), (9, 5), (2, 9)), ((0, 7), (9, 7), (3, 4), (9, 6), (5, 3)))
    got = solve(inst)
    assert isinstance(got, Solved) and got.method == "joint" and got.soc == 65
    assert isinstance(check_paths(inst, got.paths, got.soc), Valid)
