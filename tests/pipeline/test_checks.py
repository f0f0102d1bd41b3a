import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from envgen.config import EnvConfig, SizeConfig
from envgen.dataset import write_instances
from envgen.generator import generate
from envgen.schemas import DATASETS, INSTANCES
from pipeline.checks import DataValidationError, suite, validate_file


def test_every_dataset_gets_a_suite_from_its_declared_rules():
    for name, dataset in DATASETS.items():
        expectations = suite(dataset)
        checked = {c for e in expectations for c in e.columns}
        declared = {c.name for c in dataset.columns if c.required or c.unique or c.lo is not None or c.hi is not None
                    or c.regex or c.values} | {n for rule in dataset.pairs for n in (rule.a, rule.b)}
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
    assert "fails 3 expectation(s)" in text  # sizes out of range, hashes not hashes and no longer unique
    assert "'column': 'size'" in text and "'column': 'content_hash'" in text
    with pytest.raises(DataValidationError, match="missing columns"):
        validate_file(instances, "benchmark")  # an instances file is not a benchmark (no wait_subset)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataValidationError, match="cannot be read as Parquet"):
        validate_file(tmp_path / "junk.parquet", "instances")
    with pytest.raises(ValueError, match="choose one of"):
        validate_file(instances, "nonsense")
