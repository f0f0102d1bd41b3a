import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from envgen.core.config import EnvConfig, SizeConfig
from envgen.formats.dataset import write_instances
from envgen.generator import generate
from envgen.formats.schemas import DATASETS, INSTANCES
from pipeline.checks import DataValidationError, suite, validate_file


def test_every_dataset_gets_a_suite_from_its_declared_rules():
    for name, dataset in DATASETS.items():
        expectations = suite(dataset)
        checked = {c for e in expectations for c in e.columns}
        declared = {c.name for c in dataset.columns if c.required or c.unique or c.lo is not None or c.hi is not None
                    or c.regex or c.values} | {n for rule in dataset.pairs for n in (rule.a, rule.b)}
        declared |= {f"rule:{rule.name}" for rule in dataset.meaning}
        assert checked == declared, name
        assert (expectations[0].kind == "ExpectTableRowCountToBeBetween") == (dataset.min_rows > 0)
    kinds = {e.kind for e in suite(INSTANCES)}
    assert {"ExpectColumnValuesToBeUnique", "ExpectColumnPairValuesToBeEqual", "ExpectColumnValuesToMatchRegex"} <= kinds


@pytest.fixture(scope="module")
def instances(tmp_path_factory):
    cfg = EnvConfig(budget=6, seed=3, sizes={3: SizeConfig(data_ratio=1), 4: SizeConfig(data_ratio=1)})
    path = tmp_path_factory.mktemp("checks") / "i.parquet"
    write_instances(path, generate(cfg), cfg)
    return path


def test_a_good_file_passes_and_a_broken_one_fails_with_one_line_per_expectation(instances, tmp_path):
    assert validate_file(instances, "instances") == 6
    table = pq.read_table(instances)
    broken = table.set_column(table.column_names.index("size"), "size", pc.add(table["size"], 40).cast(pa.int16()))
    broken = broken.set_column(broken.column_names.index("content_hash"), "content_hash",
                               pa.array(["not-a-hash"] * broken.num_rows))
    bad = tmp_path / "bad.parquet"
    pq.write_table(broken, bad)
    with pytest.raises(DataValidationError) as e:
        validate_file(bad, "instances")
    text = str(e.value)
    assert "fails 5 expectation(s)" in text  # sizes out of range and not the texts', hashes malformed, repeated, not the texts'
    assert "'column': 'size'" in text and "'column': 'content_hash'" in text
    with pytest.raises(DataValidationError, match="missing columns"):
        validate_file(instances, "benchmark")  # an instances file is not a benchmark (no wait_subset)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataValidationError, match="cannot be read as Parquet"):
        validate_file(tmp_path / "junk.parquet", "instances")
    with pytest.raises(ValueError, match="choose one of"):
        validate_file(instances, "nonsense")


def rewrite(table, path, **columns):
    """``table`` with some columns replaced, written with its metadata to ``path``."""
    for name, values in columns.items():
        table = table.set_column(table.column_names.index(name), name, pa.array(values, type=table.schema.field(name).type))
    pq.write_table(table, path)
    return path


def test_meaning_is_checked_hashes_texts_plans_and_numbers(instances, tmp_path):
    table = pq.read_table(instances)
    texts = table.column("instance").to_pylist()
    shuffled = rewrite(table, tmp_path / "shuffled.parquet", instance=texts[1:] + texts[:1])
    with pytest.raises(DataValidationError) as e:
        validate_file(shuffled, "instances")
    assert "rule:hash_matches_instance" in str(e.value) and "rule:optimal_plan_replays" in str(e.value)
    garbage = rewrite(table, tmp_path / "garbage.parquet", instance=["not an instance"] * table.num_rows)
    with pytest.raises(DataValidationError, match="rule:instance_parses"):
        validate_file(garbage, "instances")
    nan = rewrite(table, tmp_path / "nan.parquet", hole_ratio=[float("nan")] * table.num_rows)
    with pytest.raises(DataValidationError, match="'column': 'hole_ratio'"):
        validate_file(nan, "instances")
    soc = table.column("optimal_soc").to_pylist()
    shorter = rewrite(table, tmp_path / "soc.parquet", optimal_soc=[s - 1 for s in soc])
    with pytest.raises(DataValidationError, match="rule:optimal_plan_replays"):
        validate_file(shorter, "instances")


def test_trajectories_must_be_consistent_and_rewarded_within_their_recorded_configuration(instances, tmp_path):
    import json

    from envgen.formats.schemas import TRAJECTORIES

    rows = []
    for r in pq.read_table(instances).to_pylist():
        rows.append({"instance_id": r["instance_id"], "content_hash": r["content_hash"], "instance": r["instance"],
                     "stage": 0, "sample_index": 0, "completion": "x", "parsed": False, "parse_error": "empty",
                     "valid": False, "optimal": False, "optimal_soc": r["optimal_soc"], "reward": 0.0, "model_id": "m",
                     "seed": 0, "completion_tokens": 1, "token_budget": 60, "optimal_tokens": 40})
    record = {"policy": {"reward": {"optimal": 1.0, "valid": 0.5, "scale_valid": True, "invalid": 0.1, "progress": 0.0,
                                    "unparseable": 0.0}}}
    table = pa.Table.from_pylist(rows, schema=TRAJECTORIES.schema).replace_schema_metadata({"rollout": json.dumps(record)})
    pq.write_table(table, tmp_path / "t.parquet")
    assert validate_file(tmp_path / "t.parquet", "trajectories") == len(rows)
    cut = rewrite(table, tmp_path / "cut.parquet", token_budget=[39] + [60] * (len(rows) - 1))  # a cap below an optimum
    with pytest.raises(DataValidationError, match="token_budget"):
        validate_file(cut, "trajectories")
    five = rewrite(table, tmp_path / "five.parquet", reward=[5.0] * len(rows))  # within [-10, 10], not within [0, 1]
    with pytest.raises(DataValidationError, match="rule:reward_within_configuration"):
        validate_file(five, "trajectories")
    claims = rewrite(table, tmp_path / "claims.parquet", valid=[True] * len(rows))  # valid but never parsed
    with pytest.raises(DataValidationError, match="rule:outcome_consistent"):
        validate_file(claims, "trajectories")
