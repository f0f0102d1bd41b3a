import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.checks import validate_file
from pipeline.params import BenchmarkSettings
from steps.build_benchmark import build_benchmark
from steps.evaluate import check_disjoint, evaluate, tables


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    settings = BenchmarkSettings(seed=5, per_cell=2, wait_ratios=[0.25, 0.75], agents={3: [3, 4], 4: [4, 5]})
    n = len(build_benchmark(settings, root / "b.parquet", progress=False))
    return root, settings, n


def test_benchmark_layout_is_the_papers_and_distinct(bench):
    root, settings, n = bench
    rows = pq.read_table(root / "b.parquet").to_pylist()
    assert n == len(rows) == 2 * 2 * (2 + 2)
    cells = {(r["num_agents"], r["size"], r["wait_subset"]) for r in rows}
    assert cells == {(a, s, w) for a, sizes in settings.agents.items() for s in sizes for w in (0.25, 0.75)}
    assert len({r["content_hash"] for r in rows}) == len(rows) and [r["index"] for r in rows] == list(range(len(rows)))
    waits = [r for r in rows if r["wait_subset"] == 0.75]
    assert sum(r["needs_wait"] for r in waits) / len(waits) >= 0.5
    assert validate_file(root / "b.parquet", "benchmark") == n
    assert json.loads(pq.read_schema(root / "b.parquet").metadata[b"benchmark"]) == settings.model_dump(mode="json")
    again = root / "again.parquet"
    build_benchmark(settings, again, progress=False)
    assert again.read_bytes() == (root / "b.parquet").read_bytes()


def test_evaluate_checks_disjointness(bench, tmp_path):
    root, _, _ = bench
    table = pq.read_table(root / "b.parquet")
    rows = [{"instance_id": r["instance_id"], "content_hash": r["content_hash"], "num_agents": r["num_agents"], "size": r["size"],
             "valid": r["size"] == 3, "optimal": False, "finish_reason": "stop", "token_budget": 80,
             "optimal_tokens": 40} for r in table.to_pylist()]
    traj = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist(rows), traj)
    train = tmp_path / "train.parquet"
    pq.write_table(table.slice(0, 1).select(["content_hash"]), train)
    with pytest.raises(ValueError, match="in the benchmark"):
        evaluate(root / "b.parquet", traj, [train], None)
    pq.write_table(pa.table({"content_hash": ["0" * 64]}), train)
    metrics = evaluate(root / "b.parquet", traj, [train], None)
    assert metrics["bench"]["acc/3_agents"] == 0.5 and metrics["disjoint"]["training_instances_checked"] == 1
    # per map size, and the Sum's standard error (every size here is all-valid or all-invalid: no spread)
    assert metrics["bench_size"]["3_agents/3x3"] == 1.0 and metrics["bench_size"]["3_agents/4x4"] == 0.0
    assert metrics["bench"]["se/3_agents"] == 0.0
    assert check_disjoint(root / "b.parquet", []) == 0
    assert metrics["budgets"] == {"answers": len(rows), "stopped_at_budget": 0, "optimal_above_budget": 0}
    cut = tmp_path / "cut.parquet"  # a budget below an optimal answer: truncation, not planning
    pq.write_table(pa.Table.from_pylist([{**r, "token_budget": 30} for r in rows]), cut)
    with pytest.raises(ValueError, match="token budget below their optimal answer"):
        evaluate(root / "b.parquet", cut, [train], None)


def test_a_stage_that_scores_no_board_has_no_sum_and_an_empty_answer_file_is_refused_elsewhere(bench, tmp_path):
    """An empty answer file is scored only where the rollout recorded that it answered no board (evaluate.early_agents:
    [] before whole_from_stage): no Sum, no answer. Anywhere else it is a rollout that did not happen, refused rather
    than scored as zero."""
    from envgen.formats.dataset import write_dataset
    from envgen.formats.schemas import TRAJECTORIES

    root, _, _ = bench
    empty = tmp_path / "empty.parquet"
    write_dataset(empty, [], TRAJECTORIES, {"rollout": json.dumps({"stage": 0, "agents": []})})
    metrics = evaluate(root / "b.parquet", empty, [], None)
    assert metrics["bench"] == {} and metrics["bench_size"] == {} and metrics["budgets"]["answers"] == 0
    assert "This stage scored no benchmark board" in tables(metrics)
    for record in ({"stage": 0, "agents": [3]}, {"stage": 0, "agents": None}, None):
        write_dataset(empty, [], TRAJECTORIES, None if record is None else {"rollout": json.dumps(record)})
        with pytest.raises(ValueError, match="no answer"):
            evaluate(root / "b.parquet", empty, [], None)


def test_the_sums_standard_error_comes_from_each_sizes_binomial_variance():
    from steps.evaluate import sum_standard_error

    # two sizes at 50% of 100 boards each: sqrt(2 * 0.25 / 100) / 2 = 0.0354
    table = {"sizes": {"3": {"acc": 0.5, "n": 100}, "4": {"acc": 0.5, "n": 100}}}
    assert sum_standard_error(table) == pytest.approx(0.5 ** 0.5 / 10 / 2)
    # the GPU preset's 35 per cell x 3 wait subsets keeps it at most 2 points even for 6 sizes at 50%
    worst = {"sizes": {str(n): {"acc": 0.5, "n": 105} for n in range(5, 11)}}
    assert sum_standard_error(worst) <= 0.02


def test_the_benchmark_is_the_same_file_whatever_the_number_of_processes(tmp_path, monkeypatch):
    """Slots drawn at once in a pool give the one-by-one build's file byte for byte (the draw statistics of its metadata
    too), also when a slot drew an instance an earlier slot took: that slot is drawn again here (empty 3x3 boards, 40
    per cell: such repeats are certain)."""
    import steps.build_benchmark as step

    settings = BenchmarkSettings(seed=3, per_cell=40, wait_ratios=[0.25, 0.5, 0.75], agents={2: [3]}, hole_ratio=0.0)
    build_benchmark(settings, tmp_path / "one.parquet", progress=False, workers=1)
    redrawn = []
    slot_instance = step.slot_instance
    monkeypatch.setattr(step, "slot_instance", lambda *a: redrawn.append(1) or slot_instance(*a))  # here, not the pool
    build_benchmark(settings, tmp_path / "pool.parquet", progress=False, workers=3)
    assert 0 < len(redrawn) < 120, f"{len(redrawn)} of 120 slots drawn again: the test no longer covers a repeat"
    assert (tmp_path / "pool.parquet").read_bytes() == (tmp_path / "one.parquet").read_bytes()
    with pytest.raises(ValueError, match="--workers 0"):
        build_benchmark(settings, tmp_path / "x.parquet", progress=False, workers=0)
