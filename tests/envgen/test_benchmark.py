import random


from envgen.benchmark import cell_configs, cell_label, cell_table, reference_rows, render_draws, render_table
from envgen.solver.cbs import Solved, solve
from envgen.core.config import SizeConfig
from envgen.formats.dataset import record_of
from envgen.generator import draw_instance, generate
from envgen.core.instance import Instance
from envgen.solver.planners import NoPlan, Planned, independent_plan, prioritized_plan
from envgen.core.simulate import Valid, check_plan


def test_prioritized_plans_are_always_valid_when_found():
    found = 0
    for seed in range(150):
        rng = random.Random(seed)
        inst = draw_instance(rng, 4 + seed % 5, SizeConfig(data_ratio=1, hole_ratio=0.25), 2 + seed % 4, head_on=seed % 2 == 0)
        if inst is None:
            continue
        plan = prioritized_plan(inst)
        result = solve(inst)
        if isinstance(plan, NoPlan):
            assert plan.reason
            continue
        found += 1
        check = check_plan(inst, plan.moves, result.soc if isinstance(result, Solved) else None)
        assert isinstance(check, Valid), (inst.to_str(), check)
        if isinstance(result, Solved):
            assert check.soc >= result.soc
    assert found > 100


def test_planners_say_why_they_found_no_plan():
    walled = Instance(("FHF", "FHF"), ((0, 0),), ((0, 2),))
    for planner in (independent_plan, prioritized_plan):
        result = planner(walled)
        assert isinstance(result, NoPlan) and "unreachable" in result.reason
    assert isinstance(independent_plan(Instance(("FF",), ((0, 0),), ((0, 1),))), Planned)


def test_cells_follow_the_papers_layout_with_their_own_seeds():
    cells = cell_configs(seed=7, per_cell=3, wait_ratios=[0.25, 0.5], hole_ratio=0.2, agents={3: [3, 4, 5], 4: [4, 5]})
    assert [(c.agents, c.wait_ratio) for c in cells] == [(3, 0.25), (3, 0.5), (4, 0.25), (4, 0.5)]
    assert [c.config.budget for c in cells] == [9, 9, 6, 6] and len({c.config.seed for c in cells}) == 4
    assert all(c.config.num_agents == c.agents and set(c.config.sizes) == ({3, 4, 5} if c.agents == 3 else {4, 5}) for c in cells)


def test_cells_take_a_count_per_agent_count():
    cells = cell_configs(seed=7, per_cell={3: 3, 4: 1}, wait_ratios=[0.25, 0.5], hole_ratio=0.2,
                         agents={3: [3, 4, 5], 4: [4, 5]})
    assert [c.config.budget for c in cells] == [9, 9, 2, 2]
    same = cell_configs(seed=7, per_cell=3, wait_ratios=[0.25, 0.5], hole_ratio=0.2, agents={3: [3, 4, 5], 4: [4, 5]})
    assert [c.config.seed for c in cells] == [c.config.seed for c in same]  # the count leaves each cell's seed as it was


def test_reference_rows_and_tables():
    cells = cell_configs(seed=5, per_cell=2, wait_ratios=[0.25, 0.75], hole_ratio=0.2, agents={3: [3, 4]})
    rows = [{**record_of(g, c.config.seed), "wait_subset": c.wait_ratio} for c in cells for g in generate(c.config)]
    ref = reference_rows(rows)
    assert ref["optimal (CBS)"]["3"]["sum"] == {"acc": 1.0, "opt": 1.0}
    assert set(ref) == {"optimal (CBS)", "prioritized", "independent"}
    waits = ref["independent"]["3"]["wait"]
    assert waits["0.75"]["acc"] <= 0.25 + 1e-9  # at most the no-wait quarter: independent paths never wait
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=2) as pool:  # each row answered on its own: a pool gives the same tables
        assert reference_rows(rows, lambda f, xs: pool.map(f, xs, chunksize=3)) == ref
    text = render_table(ref["prioritized"], "Reference: prioritized")
    assert "| 3 |" in text and "Sum" in text and "wait 0.25" in text


def test_cell_table_sum_is_mean_over_sizes():
    rows = ([{"num_agents": 3, "size": 3, "wait_subset": 0.5, "valid": True, "optimal": True}] * 2 +
            [{"num_agents": 3, "size": 4, "wait_subset": 0.5, "valid": False, "optimal": False},
             {"num_agents": 3, "size": 4, "wait_subset": 0.5, "valid": True, "optimal": False}])
    t = cell_table(rows)["3"]
    assert t["sizes"]["3"]["acc"] == 1.0 and t["sizes"]["4"]["acc"] == 0.5 and t["sum"]["acc"] == 0.75 and t["sum"]["opt"] == 0.5
    assert t["wait"]["0.50"] == {"acc": 0.75, "opt": 0.5, "n": 4}


def test_render_draws_says_how_many_were_left_out_and_why():
    cell = cell_configs(seed=0, per_cell=1, wait_ratios=[0.5], hole_ratio=0.2, agents={3: [4]})[0]
    stats = {cell_label(cell): {"draws": 9, "accepted": 4, "rejected": {"duplicate": 1, "over solver budget": 2,
                                                                          "unsolvable": 2}, "over_budget": 2},
             "5 agents, wait 0.25": {"draws": 3, "accepted": 3, "rejected": {}, "over_budget": 0}}
    lines = render_draws(stats).splitlines()
    assert lines[2] == "| 3 agents, wait 0.50 | 9 | 4 | duplicate 1, over solver budget 2, unsolvable 2 | 2 |"
    assert lines[3] == "| 5 agents, wait 0.25 | 3 | 3 | none | 0 |"
    assert lines[4] == "| all | 12 | 7 | 5 | 2 |"
