import json
from collections import Counter

import pyarrow.parquet as pq
import pytest

from envgen.core.config import EnvConfig, SizeConfig
from envgen.solver.cbs import SolverBudget
from envgen.formats.dataset import config_of, generator_stats_of, instances_of, read_instances, write_instances
from envgen.generator import (GENERATOR_VERSION, GENERATOR_VERSIONS, REJECTIONS, DrawCounts, GenerationError,
                              GeneratorOptions, draw_seed, draw_statistics, fill_slot, generate, slot_layout)
from envgen.core.instance import Instance
from envgen.formats.schemas import INSTANCES
from envgen.core.simulate import Valid, check_plan


def small_config(**over) -> EnvConfig:
    sizes = {3: SizeConfig(data_ratio=0.2, hole_ratio=0.2, wait_ratio=0.5),
             5: SizeConfig(data_ratio=0.3, hole_ratio=0.3, wait_ratio=0.25),
             8: SizeConfig(data_ratio=0.5, hole_ratio=0.1, wait_ratio=0.75, min_path_length=4)}
    return EnvConfig(**{"budget": 60, "seed": 3, "sizes": sizes, **over})


def test_ratios_are_met_exactly_as_documented():
    cfg = small_config()
    out = list(generate(cfg))
    assert len(out) == 60
    per_size = Counter(g.slot.size for g in out)
    assert per_size == {3: 12, 5: 18, 8: 30}
    for size, knobs in cfg.sizes.items():
        rows = [g for g in out if g.slot.size == size]
        waits = sum(g.solution.needs_wait for g in rows)
        assert abs(waits / len(rows) - knobs.wait_ratio) <= 0.5 / len(rows) + 1e-9
        assert all(g.solution.needs_wait == g.slot.needs_wait for g in rows)
        assert all(g.instance.hole_count == round(knobs.hole_ratio * size * size) for g in rows)
        assert all(min(g.solution.shortest) >= knobs.min_path_length for g in rows)
    assert len({g.instance.content_hash for g in out}) == 60


def test_wait_slots_are_interleaved():
    cfg = EnvConfig(budget=8, sizes={4: SizeConfig(data_ratio=1, wait_ratio=0.5)})
    assert [s.needs_wait for s in slot_layout(cfg)] == [False, True] * 4


def test_slot_is_a_function_of_seed_and_index():
    cfg = small_config()
    out = list(generate(cfg))
    again = fill_slot(out[17].slot, cfg, GeneratorOptions(), set())
    assert again.instance == out[17].instance and again.draw_seed == draw_seed(3, 17)
    other = list(generate(small_config(seed=4)))
    assert [g.instance for g in other] != [g.instance for g in out]


def test_parquet_is_byte_identical_and_self_describing(tmp_path):
    cfg = small_config()
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    write_instances(a, generate(cfg), cfg)
    write_instances(b, generate(cfg), cfg)
    assert a.read_bytes() == b.read_bytes()
    table = read_instances(a)
    assert table.column_names == INSTANCES.names
    assert pq.read_schema(a).field("optimal_soc").metadata[b"description"].startswith(b"Optimal sum of costs")
    assert config_of(a) == cfg
    rows = table.to_pylist()
    for inst, row in zip(instances_of(table), rows):
        assert inst.content_hash == row["content_hash"] and row["instance_id"] == "i" + row["content_hash"][:16]
        plan = [line.split() for line in row["optimal_plan"]]
        check = check_plan(inst, plan, row["optimal_soc"])
        assert isinstance(check, Valid) and check.optimal and check.makespan == row["makespan"]
        assert row["soc_gap"] == row["optimal_soc"] - sum(row["shortest_lengths"])
        assert row["needs_wait"] == (row["soc_gap"] > 0) == row["wait_target"]


def test_excluded_hashes_never_appear():
    cfg = small_config(budget=20)
    first = list(generate(cfg))
    banned = {g.instance.content_hash for g in first[:10]}
    second = list(generate(cfg, exclude=banned))
    assert not banned & {g.instance.content_hash for g in second}
    assert [g.instance for g in second[10:]] != []


def test_infeasible_config_fails_with_an_error_naming_the_size():
    # 3x3, half the cells holes, start-goal distance 4: a single winding corridor where two agents cannot both
    # travel corner to corner with one needing to wait; demand only such instances.
    cfg = EnvConfig(budget=5, seed=1, num_agents=2, sizes={3: SizeConfig(data_ratio=1, hole_ratio=0.5, wait_ratio=1.0, min_path_length=4)})
    with pytest.raises(GenerationError) as info:
        list(generate(cfg, GeneratorOptions(max_attempts=200)))
    text = str(info.value)
    assert text.startswith("sizes.3: no instance that needs a wait in 200 draws")
    assert "wait_ratio=1.0" in text and "Fix:" in text


def test_too_few_distinct_instances_says_so():
    cfg = EnvConfig(budget=200, seed=1, num_agents=1,
                    sizes={3: SizeConfig(data_ratio=1, hole_ratio=0.5, wait_ratio=0.0, min_path_length=4)})
    with pytest.raises(GenerationError, match="duplicate|too few distinct"):
        list(generate(cfg, GeneratorOptions(max_attempts=300)))


def test_instance_text_in_file_round_trips(tmp_path):
    cfg = small_config(budget=5)
    path = tmp_path / "x.parquet"
    write_instances(path, generate(cfg), cfg)
    for text in read_instances(path).column("instance").to_pylist():
        assert Instance.from_str(text).to_str() == text


def test_every_draw_is_counted_with_its_outcome(tmp_path):
    # A budget too small to decide crowded draws: the ones it cannot decide are counted as over budget, never dropped
    # silently, and the file and the statistics say so.
    tight = GeneratorOptions(solver=SolverBudget(max_nodes=1, max_joint_work=0, max_joint_states=0))
    cfg = EnvConfig(budget=6, seed=2, num_agents=4, sizes={6: SizeConfig(data_ratio=1, hole_ratio=0.3, wait_ratio=0.5)})
    out = list(generate(cfg, tight))
    for g in out:
        assert g.counts.accepted == 1 and g.counts.draws == g.attempts
        assert set(g.counts.rejected) <= set(REJECTIONS)
    stats = draw_statistics(out, tight)
    assert stats["draws"] == sum(g.attempts for g in out) and stats["accepted"] == 6
    assert stats["over_budget"] == stats["rejected"].get("over solver budget", 0) > 0
    assert stats["draws"] == stats["accepted"] + sum(stats["rejected"].values())
    assert stats["by_size"]["6"]["draws"] == stats["draws"]
    assert stats["solver_budget"]["max_nodes"] == 1 and stats["generator_version"] == GENERATOR_VERSION
    path = tmp_path / "x.parquet"
    write_instances(path, out, cfg, tight)
    assert generator_stats_of(path) == json.loads(json.dumps(stats))
    # The default budget decides every one of those draws: nothing over budget.
    assert draw_statistics(list(generate(cfg)))["over_budget"] == 0


def test_draw_counts_add_up():
    a = DrawCounts(1, {"duplicate": 2, "unsolvable": 1})
    b = DrawCounts(1, {"unsolvable": 3, "over solver budget": 1})
    total = a + b
    assert total.accepted == 2 and total.draws == 9 and total.over_budget == 1
    assert total.rejected == {"duplicate": 2, "unsolvable": 4, "over solver budget": 1}


def test_generator_versions_are_kept_and_validated(tmp_path):
    cfg = small_config(budget=16)
    v1, v2 = GeneratorOptions(version=1), GeneratorOptions()
    assert v1.budget == GENERATOR_VERSIONS[1].budget and v2.budget == GENERATOR_VERSIONS[2].budget
    old, new = list(generate(cfg, v1)), list(generate(cfg, v2))
    # Both optimal: the same sums of costs wherever they accepted the same draw.
    same = [(a, b) for a, b in zip(old, new) if a.instance == b.instance]
    assert same and all(a.solution.soc == b.solution.soc for a, b in same)
    assert {g.version for g in old} == {"mapf-frozenlake-gen/1"} and {g.version for g in new} == {GENERATOR_VERSION}
    a = tmp_path / "v1.parquet"
    write_instances(a, old, cfg, v1)
    meta = pq.read_schema(a).metadata
    assert meta[b"generator_version"] == b"mapf-frozenlake-gen/1" and b"generator_stats" not in meta
    assert set(read_instances(a).column("generator_version").to_pylist()) == {"mapf-frozenlake-gen/1"}
    with pytest.raises(ValueError, match="GeneratorOptions.version = 7"):
        GeneratorOptions(version=7)
    with pytest.raises(ValueError, match="max_attempts = 0"):
        GeneratorOptions(max_attempts=0)


@pytest.mark.parametrize("cfg", [small_config(budget=120), small_config(budget=60, num_agents=3, seed=8)])
def test_screening_wait_slot_draws_changes_no_file(cfg, monkeypatch):
    """The default version rejects a wait slot's draw whose shortest paths already agree without solving it; the instances,
    plans, node counts and draw statistics are those of solving every draw."""
    import dataclasses

    import envgen.generator as generator

    screened = list(generate(cfg, GeneratorOptions()))
    version = GeneratorOptions().version
    monkeypatch.setitem(generator.GENERATOR_VERSIONS, version,
                        dataclasses.replace(GENERATOR_VERSIONS[version], screens=False))
    solved = list(generate(cfg, GeneratorOptions()))
    assert [(g.instance, g.solution, g.attempts, g.counts) for g in screened] == \
        [(g.instance, g.solution, g.attempts, g.counts) for g in solved]
    assert draw_statistics(screened) == draw_statistics(solved)
    assert draw_statistics(screened)["rejected"].get("needs no wait", 0) > 0


def test_version_3_decides_every_draw_version_2_decided_alike():
    """Version 3 differs from 2 only on draws 2 leaves over budget (independence detection as a last resort): on
    two-, three- and five-agent configurations without such draws, the same instances, plans and draw counts."""
    dense = EnvConfig(budget=40, seed=2, num_agents=5, sizes={8: SizeConfig(data_ratio=1, hole_ratio=0.3, wait_ratio=0.5)})
    for cfg in (small_config(budget=80), small_config(budget=40, num_agents=3, seed=4), dense):
        two, three = list(generate(cfg, GeneratorOptions(version=2))), list(generate(cfg, GeneratorOptions(version=3)))
        assert [(g.instance, g.solution, g.counts) for g in two] == [(g.instance, g.solution, g.counts) for g in three]
        assert {g.version for g in two} == {"mapf-frozenlake-gen/2"} and {g.version for g in three} == {GENERATOR_VERSION}
