import pyarrow.parquet as pq

from envgen.core.config import EnvConfig, SizeConfig
from envgen.generator import GENERATOR_VERSION, GeneratorOptions
from pipeline.params import load_params
from steps.start_instances import start_instances

from tests.helpers import ROOT


def test_the_starting_demonstrations_keep_generator_version_1_unless_asked(tmp_path):
    # The kept starting policy was trained on version 1's draws, so the stage defaults to it (byte-identical file).
    assert load_params(ROOT / "params.yaml").start.generator_version == 1
    configs = [EnvConfig(num_agents=2, budget=6, seed=7, sizes={4: SizeConfig(data_ratio=1, wait_ratio=0.5)}),
               EnvConfig(num_agents=3, budget=4, seed=8, sizes={5: SizeConfig(data_ratio=1, wait_ratio=0.5)})]
    old, new = tmp_path / "v1.parquet", tmp_path / "v2.parquet"
    count, draws = start_instances(configs, old, progress=False)
    assert count == 10 and draws["accepted"] == 10 and draws["generator_version"] == "mapf-frozenlake-gen/1"
    meta = pq.read_schema(old).metadata
    assert meta[b"generator_version"] == b"mapf-frozenlake-gen/1" and b"generator_stats" not in meta
    count, draws = start_instances(configs, new, progress=False, options=GeneratorOptions())
    assert count == 10 and pq.read_schema(new).metadata[b"generator_version"] == GENERATOR_VERSION.encode()
    assert b"generator_stats" in pq.read_schema(new).metadata
