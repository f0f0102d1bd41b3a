from experiments.plan import comparison_plan
from experiments.dvc import StageFiles
from experiments.results import decision, render_experiments, render_run


def run_of_two_stages() -> list[dict]:
    sizes = {"3": {"data_ratio": 0.5, "hole_ratio": 0.2, "wait_ratio": 0.5, "min_path_length": 1},
             "4": {"data_ratio": 0.5, "hole_ratio": 0.2, "wait_ratio": 0.5, "min_path_length": 1}}
    moved = {"3": {**sizes["3"], "data_ratio": 0.2}, "4": {**sizes["4"], "data_ratio": 0.8, "hole_ratio": 0.3}}
    bench = {"bench_table": {"3": {"sum": {"acc": 0.125}}, "4": {"sum": {"acc": 0.0}}}}
    return [{"stage": 0, "config": {"sizes": sizes}, "validation": {"validation": {"valid": 0.5, "optimal": 0.25}},
             "bench": bench, "train": {"sft/loss_last": 0.0812, "train/valid_rate": 0.3},
             "engineer": {"engineer": "learnability", "fallback": False,
                          "rationale": "learnability: most budget to 4x4 (valid 50%) " + "and more " * 30}},
            {"stage": 1, "config": {"sizes": moved}, "validation": {"validation": {"valid": 0.625, "optimal": 0.5}},
             "bench": bench, "engineer": {"engineer": "learnability", "fallback": True, "rationale": ""}},
            {"stage": 2, "config": {"sizes": moved}}]


def test_a_run_fits_100_columns_with_its_numbers_per_stage_and_each_decision_said():
    text = render_run(run_of_two_stages())
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert any(line.startswith("0") and "50.0%" in line and "12.5%" in line and "0.081" in line for line in lines)
    assert any(line.startswith("1") and "62.5%" in line for line in lines)
    assert "after stage 0: learnability: 3x3 data 0.5 -> 0.2, 4x4 data 0.5 -> 0.8, 4x4 hole 0.2 -> 0.3" in text
    assert "after stage 1: learnability: kept the previous configuration" in text
    assert render_run([]).startswith("no stage has run yet")
    assert decision({"stage": 0}, None) == "no decision yet"


def test_experiments_are_one_row_each_with_their_last_stage():
    stage = StageFiles(name="evaluate@0", deps=(), params_files=(), outs=(), metrics=("m0.json",), plots=())
    plan = comparison_plan(["fixed", "learnability"], [0])
    records = [{"name": p.name, "params": {"engineer": {"engineer": p.arm}, "train": {"seed": 0},
                                              "curriculum": [{"stage": 0, "prev": "init", "next": 1}]},
                "metrics": {"m0.json": {"bench": {"acc/3_agents": 0.1 * (i + 1)}}}} for i, p in enumerate(plan)]
    text = render_experiments(records, [stage])
    assert "cmp-learnability-s0" in text and "20.0%" in text and max(len(x) for x in text.splitlines()) <= 100
    assert render_experiments([], [stage]).startswith("no DVC experiments")
