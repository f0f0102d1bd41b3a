import json

import pytest
import yaml

from envgen.core.config import ConfigError, EnvConfig, SizeConfig, config_json_schema, uniform_config, describe_fields


def test_yaml_round_trip_and_atomic_save(tmp_path):
    cfg = uniform_config(budget=100, seed=7)
    path = tmp_path / "stage" / "config.yaml"
    cfg.save(path)
    assert EnvConfig.load(path) == cfg
    assert [p.name for p in path.parent.iterdir()] == ["config.yaml"]  # no temporary left behind


def test_data_ratios_are_normalised_weights_and_allocation_is_exact():
    cfg = EnvConfig(budget=10, sizes={3: SizeConfig(data_ratio=1), 4: SizeConfig(data_ratio=1), 5: SizeConfig(data_ratio=1)})
    assert cfg.data_shares() == pytest.approx({3: 1 / 3, 4: 1 / 3, 5: 1 / 3})
    alloc = cfg.allocation()
    assert sum(alloc.values()) == 10 and alloc == {3: 4, 4: 3, 5: 3}
    cfg = EnvConfig(budget=7, sizes={3: SizeConfig(data_ratio=0.0), 4: SizeConfig(data_ratio=0.3)})
    assert cfg.allocation() == {3: 0, 4: 7}


@pytest.mark.parametrize(
    "data, fragments",
    [
        ({"num_agents": 9, "sizes": {3: {"data_ratio": 1}}}, ["num_agents = 9", "allowed range [1, 8]"]),
        ({"sizes": {3: {"data_ratio": 1, "hole_ratio": 0.7}}}, ["sizes.3.hole_ratio = 0.7", "[0.0, 0.5]"]),
        ({"sizes": {20: {"data_ratio": 1}}}, ["size 20 is outside 3..16"]),
        ({"sizes": {3: {"data_ratio": 1, "holes": 0.1}}}, ["sizes.3.holes", "unknown field"]),
        ({"sizes": {3: {"data_ratio": 0}}}, ["all are 0"]),
        ({"num_agents": 1, "sizes": {3: {"data_ratio": 1, "wait_ratio": 1.0}}}, ["sizes.3.wait_ratio = 1.0", "num_agents = 1"]),
        ({"sizes": {3: {"data_ratio": 1, "min_path_length": 5}}}, ["sizes.3.min_path_length = 5", "at most 4"]),
        ({"num_agents": 5, "sizes": {3: {"data_ratio": 1, "hole_ratio": 0.5}}}, ["sizes.3.hole_ratio", "free cells"]),
        ({"budget": 10}, ["sizes", "required"]),
    ],
)
def test_errors_name_field_range_and_fix(data, fragments):
    with pytest.raises(ConfigError) as info:
        EnvConfig.parse(data, "stage.yaml")
    text = str(info.value)
    assert text.startswith("stage.yaml: invalid configuration")
    for fragment in fragments:
        assert fragment in text, text


def test_bad_yaml_names_the_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("num_agents: 2\nsizes: {3: [\n")
    with pytest.raises(ConfigError, match=r"c.yaml:\d+: not valid YAML"):
        EnvConfig.load(path)
    with pytest.raises(ConfigError, match="cannot be read"):
        EnvConfig.load(tmp_path / "missing.yaml")


def test_size_keys_accept_strings_like_an_llm_writes_them():
    cfg = EnvConfig.parse(yaml.safe_load("sizes:\n  '5': {data_ratio: 1}\n  6x6: {data_ratio: 1}\n"))
    assert set(cfg.sizes) == {5, 6}


def test_json_schema_is_strict_and_documented():
    schema = config_json_schema((3, 4))
    assert schema["additionalProperties"] is False
    assert schema["properties"]["sizes"]["required"] == ["3", "4"]
    size = schema["properties"]["sizes"]["properties"]["3"]
    assert size["properties"]["hole_ratio"]["maximum"] == 0.5
    assert all(p.get("description") for p in size["properties"].values())
    json.dumps(schema)
    # A config written as the schema describes validates.
    doc = {"num_agents": 2, "budget": 10, "seed": 1,
           "sizes": {k: {"data_ratio": 0.5, "hole_ratio": 0.1, "wait_ratio": 0.5, "min_path_length": 1} for k in ("3", "4")}}
    assert EnvConfig.parse(doc).allocation() == {3: 5, 4: 5}


def test_describe_lists_every_field():
    text = describe_fields()
    for name in ("num_agents", "budget", "seed", "sizes.N.data_ratio", "sizes.N.hole_ratio", "sizes.N.wait_ratio", "sizes.N.min_path_length"):
        assert f"- {name}" in text
