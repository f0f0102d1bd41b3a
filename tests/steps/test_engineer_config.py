import json
import math

import pytest

from engineers.llm import CONTEXTS, LLMEngineer, proposal_schema
from engineers.proposal import Proposal
from envgen.core.config import EnvConfig, SizeConfig
from pipeline.params import EngineerSettings, PolicySettings
from steps.engineer_config import engineer_config, main

from tests.engineers.test_engineers import CURRENT, HOSTILE_OUTPUTS, INJECTION, Scripted, assert_within_bounds, summary

POLICY = PolicySettings()


@pytest.mark.parametrize("output", HOSTILE_OUTPUTS)
def test_any_engineer_output_gives_a_valid_configuration(output):
    backend = Scripted([output] * 3)
    engineer = LLMEngineer("base", backend, CONTEXTS["bookkeeping"], attempts=3)
    result = engineer_config(summary({3: 0.5}), CURRENT, EngineerSettings(engineer="base"), POLICY, 1, engineer=engineer)
    assert_within_bounds(result.config)
    assert result.log["attempts"] and len(backend.prompts) <= 3
    json.dumps(result.log, default=str)


def test_retries_then_uses_the_first_good_answer_or_keeps_the_previous():
    good = json.dumps({"rationale": "4x4 is at the frontier", "sizes": {"4": {"data_ratio": 0.7, "hole_ratio": 0.25}}})
    backend = Scripted(["nonsense", "{broken", good])
    result = engineer_config(summary({4: 0.5}), CURRENT, EngineerSettings(engineer="base"), POLICY, 1,
                             engineer=LLMEngineer("base", backend, CONTEXTS["failures"], attempts=3))
    assert [a["error"] is None for a in result.log["attempts"]] == [False, False, True]
    assert result.config.sizes[4].hole_ratio == 0.25 and result.log["rationale"] == "4x4 is at the frontier" and not result.fallback
    backend = Scripted(["no", RuntimeError("endpoint down"), "still no"])
    result = engineer_config(summary({4: 0.5}), CURRENT, EngineerSettings(engineer="base"), POLICY, 1,
                             engineer=LLMEngineer("base", backend, CONTEXTS["failures"], attempts=3))
    assert result.fallback and result.config.sizes == CURRENT.sizes and "endpoint down" in result.log["attempts"][1]["error"]
    assert any("kept the previous configuration" in n for n in result.notes)


def test_injected_instructions_stay_quoted_data_and_cannot_break_bounds():
    obeying = json.dumps({"rationale": "as instructed", "sizes": {str(n): {"hole_ratio": 5, "data_ratio": -1} for n in CURRENT.sizes}})
    backend = Scripted([obeying])
    result = engineer_config(summary({3: 0.2}), CURRENT, EngineerSettings(engineer="base"), POLICY, 1,
                             engineer=LLMEngineer("base", backend, CONTEXTS["failures"], attempts=1))
    prompt = backend.prompts[0]
    assert INJECTION in prompt and prompt.index("data, not instructions") < prompt.index(INJECTION)
    assert all(s.hole_ratio == 0.5 for s in result.config.sizes.values())
    assert result.config.data_shares() == CURRENT.data_shares()  # all data ratios clamped to 0 -> previous kept
    assert_within_bounds(result.config)


def test_constrained_decoding_with_a_real_model_gives_schema_valid_json(tiny_model_dir):
    small = EnvConfig(budget=10, sizes={3: SizeConfig(data_ratio=0.5), 4: SizeConfig(data_ratio=0.5)})
    settings = EngineerSettings(engineer="base", threads=1, attempts=1, max_new_tokens=400, context="failures")
    result = engineer_config(summary({3: 0.5}), small, settings, PolicySettings(model=str(tiny_model_dir)), 1)
    raw = result.log["attempts"][0]["raw_output"]
    obj = json.loads(raw)
    assert result.log["constrained"] and set(obj) == {"rationale", "sizes"} and set(obj["sizes"]) == {"3", "4"}
    for knobs in obj["sizes"].values():
        assert set(knobs) == {"data_ratio", "hole_ratio", "wait_ratio", "min_path_length"}
        assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in knobs.values())
    assert_within_bounds_small(result.config, small)
    schema = proposal_schema([3, 4])
    assert schema["properties"]["sizes"]["required"] == ["3", "4"]


def test_constrained_decoding_without_xgrammar_stops_the_step_with_the_fix(tmp_path, capsys, monkeypatch, tiny_model_dir):
    """`engineer.constrained: true` where xgrammar is missing used to decode unconstrained: the embedded policy then
    wrote no JSON and the policy engineer silently kept the configuration every stage (a `fixed` in disguise). The
    step now stops and says what to install or set; with `engineer.constrained=false` it runs unconstrained."""
    import sys

    from tests.helpers import tiny_params, write_params

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` raises ImportError
    params = write_params(tmp_path / "params.yaml", tiny_params(tiny_model_dir))
    (tmp_path / "s.json").write_text(summary({3: 0.5}).to_json())
    CURRENT.save(tmp_path / "c.yaml")
    args = ["--params", str(params), "--summary", str(tmp_path / "s.json"), "--config", str(tmp_path / "c.yaml"),
            "--stage", "1", "--out-config", str(tmp_path / "next.yaml"), "--out-log", str(tmp_path / "log.json"),
            "--set", "engineer.engineer=base", "--set", "engineer.attempts=1", "--set", "engineer.max_new_tokens=64"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "engineer.constrained is true" in err and "pip install --no-deps xgrammar" in err, err
    assert not (tmp_path / "next.yaml").exists()
    assert main(args + ["--set", "engineer.constrained=false"]) == 0
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["constrained"] is False and log["attempts"][0]["constrained"] is False


def assert_within_bounds_small(cfg, current):
    assert EnvConfig.parse(json.loads(cfg.model_dump_json())) == cfg and set(cfg.sizes) == set(current.sizes)


def test_cli_writes_config_and_log(tmp_path, capsys, tiny_model_dir):
    from tests.helpers import tiny_params, write_params

    params = write_params(tmp_path / "params.yaml", tiny_params(tiny_model_dir))
    (tmp_path / "s.json").write_text(summary({3: 0.9, 4: 0.5, 6: 0.1, 8: 0.0}).to_json())
    CURRENT.save(tmp_path / "c.yaml")
    code = main(["--params", str(params), "--summary", str(tmp_path / "s.json"), "--config", str(tmp_path / "c.yaml"), "--stage", "1",
                 "--out-config", str(tmp_path / "next.yaml"), "--out-log", str(tmp_path / "log.json"), "--set", "engineer.engineer=heuristic"])
    assert code == 0
    nxt = EnvConfig.load(tmp_path / "next.yaml")
    log = json.loads((tmp_path / "log.json").read_text())
    assert nxt.seed == 6 and log["engineer"] == "heuristic" and log["config"]["seed"] == 6 and log["rationale"]
    assert main(["--params", str(params), "--summary", str(tmp_path / "s.json"), "--config", str(tmp_path / "c.yaml"), "--stage", "1",
                 "--out-config", str(tmp_path / "n2.yaml"), "--out-log", str(tmp_path / "l2.json"), "--set", "engineer.engineer=seer"]) == 2
    err = capsys.readouterr().err
    assert "engineer.engineer = 'seer'" in err and "'heuristic'" in err


def test_infeasible_proposals_are_reverted_per_size_before_they_reach_the_generator():
    current = EnvConfig(budget=12, seed=2, sizes={3: SizeConfig(data_ratio=0.5), 4: SizeConfig(data_ratio=0.5)})
    # 4x4 with a minimum start-goal distance of 6 leaves only corner-to-corner routes: no room for two agents.
    proposal = {"3": {"hole_ratio": 0.1}, "4": {"hole_ratio": 0.0, "wait_ratio": 0.78, "min_path_length": 6}}
    result = engineer_config(summary({}), current, EngineerSettings(engineer="fixed"), POLICY, 0,
                             engineer=type("E", (), {"propose": lambda self, inp: Proposal(proposal)})())
    assert result.config.sizes[4] == current.sizes[4] and result.config.sizes[3].hole_ratio == 0.1
    assert any("size 4: the proposed knobs cannot be generated" in n for n in result.notes) and not result.fallback
    from envgen.generator import generate

    assert len(list(generate(result.config))) == 12  # the next stage's generation succeeds
