import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envgen.core.grid import DELTAS, Move
from envgen.core.instance import Instance
from envgen.core.simulate import Failure, FailureCategory, Valid, check_paths, check_plan, moves_to_paths, paths_to_moves

from tests.helpers import random_solved
from .reference import reference_check

# 3x3 board with one hole in the middle.
BOARD = Instance(("FFF", "FHF", "FFF"), ((0, 0), (2, 2)), ((0, 2), (2, 0)))


def failure(result) -> tuple:
    assert isinstance(result, Failure), result
    return result.category, result.agent, result.step


def test_valid_plan_costs_and_optimality():
    plan = [["RIGHT", "RIGHT"], ["LEFT", "LEFT"]]
    result = check_plan(BOARD, plan, optimal_soc=4)
    assert result == Valid(soc=4, makespan=2, costs=(2, 2), optimal=True)
    longer = check_plan(BOARD, [["WAIT", "RIGHT", "RIGHT", "WAIT"], ["LEFT", "LEFT"]], optimal_soc=4)
    assert isinstance(longer, Valid) and longer.soc == 5 and longer.costs == (3, 2) and longer.optimal is False
    assert check_plan(BOARD, plan).optimal is None


def test_each_failure_category_with_agent_and_step():
    C = FailureCategory
    assert failure(check_plan(BOARD, [["RIGHT"]])) == (C.WRONG_AGENT_COUNT, None, 0)
    assert failure(check_plan(BOARD, [["UP"], ["LEFT", "LEFT"]])) == (C.OFF_GRID, 0, 1)
    assert failure(check_plan(BOARD, [["RIGHT", "DOWN"], ["LEFT", "LEFT"]])) == (C.HOLE, 0, 2)
    assert failure(check_plan(BOARD, [["RIGHT", "JUMP"], ["LEFT", "LEFT"]])) == (C.ILLEGAL_MOVE, 0, 2)
    # Both reach (1,2)... agent 1 down the right column, agent 2 up it.
    vertex = Instance(("FFF", "FHF", "FFF"), ((0, 2), (2, 2)), ((2, 2), (0, 2)))
    assert failure(check_plan(vertex, [["DOWN", "DOWN"], ["UP", "UP"]])) == (C.VERTEX_CONFLICT, 0, 1)
    swap = Instance(("FF",), ((0, 0), (0, 1)), ((0, 1), (0, 0)))
    res = check_plan(swap, [["RIGHT"], ["LEFT"]])
    assert failure(res) == (C.EDGE_CONFLICT, 0, 1) and res.other == 1
    assert failure(check_plan(BOARD, [["RIGHT"], ["LEFT", "LEFT"]])) == (C.GOAL_NOT_REACHED, 0, 1)


def test_parked_agent_blocks_later_traffic():
    # Agent 1 arrives at (0,1) and stays; agent 2 later walks through it.
    inst = Instance(("FFF",), ((0, 0), (0, 2)), ((0, 1), (0, 0)))
    res = check_plan(inst, [["RIGHT"], ["WAIT", "LEFT", "LEFT"]])
    assert failure(res) == (FailureCategory.VERTEX_CONFLICT, 0, 2)


def test_own_fault_wins_a_tie_with_a_conflict_and_lower_agent_first():
    inst = Instance(("FFF", "FFF"), ((0, 0), (0, 2), (1, 1)), ((0, 1), (1, 2), (1, 0)))
    # Step 1: agents 1 and 2 both enter (0,1) (conflict), agent 3 leaves the grid downward (own fault).
    res = check_plan(inst, [["RIGHT"], ["LEFT"], ["DOWN"]])
    assert failure(res) == (FailureCategory.OFF_GRID, 2, 1)


def test_cell_paths_checks_jumps_and_start():
    assert failure(check_paths(BOARD, [[(0, 0), (0, 2)], [(2, 2), (2, 1), (2, 0)]])) == (FailureCategory.ILLEGAL_MOVE, 0, 1)
    assert failure(check_paths(BOARD, [[(0, 1), (0, 2)], [(2, 2), (2, 1), (2, 0)]])) == (FailureCategory.ILLEGAL_MOVE, 0, 0)
    assert failure(check_paths(BOARD, [[(0, 0), (-1, 0)], [(2, 2), (2, 1), (2, 0)]])) == (FailureCategory.OFF_GRID, 0, 1)
    assert failure(check_paths(BOARD, [[(0, 0), (0, 1), (1, 1)], [(2, 2)]])) == (FailureCategory.HOLE, 0, 2)
    ok = check_paths(BOARD, [[(0, 0), (0, 1), (0, 2)], [(2, 2), (2, 1), (2, 0)]], optimal_soc=4)
    assert isinstance(ok, Valid) and ok.optimal


def test_agent_starting_on_goal_costs_zero_unless_it_leaves():
    inst = Instance(("FFF",), ((0, 1),), ((0, 1),))
    assert check_plan(inst, [[]]).soc == 0
    assert check_plan(inst, [["LEFT", "RIGHT", "WAIT"]]).soc == 2


def test_never_raises_on_garbage_words():
    rng = random.Random(0)
    words = ["UP", "DOWN", "LEFT", "RIGHT", "WAIT", "up", "", "NORTH", "RIGHT ", "\x00", "WAIT" * 3]
    for _ in range(2000):
        plan = [[rng.choice(words) for _ in range(rng.randint(0, 6))] for _ in range(rng.randint(0, 3))]
        result = check_plan(BOARD, plan)
        assert result.valid in (True, False)


def test_moves_paths_round_trip():
    paths = [[(0, 0), (0, 1), (0, 2)], [(2, 2), (2, 2), (2, 1)]]
    moves = paths_to_moves(paths)
    assert moves == [[Move.RIGHT, Move.RIGHT], [Move.WAIT, Move.LEFT]]
    assert moves_to_paths(BOARD, moves) == paths
    with pytest.raises(ValueError, match="not one move"):
        paths_to_moves([[(0, 0), (2, 2)]])


@st.composite
def solved_instances(draw):
    seed = draw(st.integers(0, 10**9))
    size = draw(st.integers(3, 7))
    holes = draw(st.sampled_from([0.0, 0.2, 0.35]))
    agents = draw(st.integers(1, 4))
    got = random_solved(seed, size, holes, agents, head_on=agents > 1 and seed % 2 == 0)
    if got is None:
        from hypothesis import assume

        assume(False)
    return got


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(solved=solved_instances())
def test_solver_plans_pass_the_simulator_with_the_reported_soc(solved):
    inst, result = solved
    plan = [[m.value for m in moves] for moves in paths_to_moves(result.paths)]
    check = check_plan(inst, plan, result.soc)
    assert isinstance(check, Valid) and check.optimal and check.soc == result.soc and check.makespan == result.makespan
    assert reference_check(inst, plan) == ("valid", result.soc, result.makespan)


def _mutate(rng: random.Random, plan: list[list[str]]) -> list[list[str]]:
    plan = [list(p) for p in plan]
    if not plan:
        return [[rng.choice(list(DELTAS)).value]]
    kind = rng.randrange(6)
    a = rng.randrange(len(plan))
    if kind == 0 and plan[a]:  # change one move
        plan[a][rng.randrange(len(plan[a]))] = rng.choice(list(DELTAS)).value
    elif kind == 1:  # insert a move
        plan[a].insert(rng.randint(0, len(plan[a])), rng.choice(list(DELTAS)).value)
    elif kind == 2 and plan[a]:  # drop a move
        del plan[a][rng.randrange(len(plan[a]))]
    elif kind == 3:  # truncate
        del plan[a][rng.randint(0, len(plan[a])):]
    elif kind == 4:  # drop or duplicate an agent
        if rng.random() < 0.5:
            del plan[a]
        else:
            plan.append(list(plan[a]))
    else:  # an unknown word
        plan[a].insert(rng.randint(0, len(plan[a])), rng.choice(["NORTH", "up", "STAY", ""]))
    return plan


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(solved=solved_instances(), mseed=st.integers(0, 2**32), rounds=st.integers(1, 3))
def test_mutated_plans_get_the_same_verdict_as_an_independent_checker(solved, mseed, rounds):
    inst, result = solved
    rng = random.Random(mseed)
    plan = [[m.value for m in moves] for moves in paths_to_moves(result.paths)]
    for _ in range(rounds):
        plan = _mutate(rng, plan)
    expected = reference_check(inst, plan)
    got = check_plan(inst, plan, result.soc)
    if expected[0] == "valid":
        assert isinstance(got, Valid) and (got.soc, got.makespan) == expected[1:]
        assert got.soc >= result.soc  # nothing beats the optimum
        assert got.optimal == (got.soc == result.soc)
    else:
        assert isinstance(got, Failure)
        assert (got.category.value, got.agent, got.step) == expected


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(solved=solved_instances(), pick=st.integers(0, 10**6))
def test_constructed_faults_are_caught_at_their_step(solved, pick):
    """Follow the optimal plan for t steps, then step off the grid or into a hole: exactly that fault, at t + 1."""
    inst, result = solved
    plan = [[m.value for m in moves] for moves in paths_to_moves(result.paths)]
    a = pick % inst.num_agents
    t = pick % (len(plan[a]) + 1)
    r, c = moves_to_paths(inst, [plan[b][:t] if b == a else [] for b in range(inst.num_agents)])[a][-1]
    for move in (Move.UP, Move.DOWN, Move.LEFT, Move.RIGHT):
        dr, dc = DELTAS[move]
        rr, cc = r + dr, c + dc
        off = not (0 <= rr < inst.height and 0 <= cc < inst.width)
        if off or inst.rows[rr][cc] == "H":
            bad = [list(p) for p in plan]
            bad[a] = plan[a][:t] + [move.value]
            want = FailureCategory.OFF_GRID if off else FailureCategory.HOLE
            assert failure(check_plan(inst, bad)) == (want, a, t + 1)
            return
