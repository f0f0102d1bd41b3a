import difflib

import pytest
import yaml

from envgen.llm.prompt import PromptStyle
from pipeline.params import (SECTIONS, Params, ParamsError, apply_overrides, load_params, parse_overrides,
                             validate_params)

from tests.helpers import ROOT


@pytest.mark.parametrize("preset", ["cpu", "gpu", "gpu-embedded", "gpu-distill"])
def test_every_preset_is_a_valid_params_file(preset):
    params = load_params(ROOT / "presets" / f"{preset}.yaml")
    assert isinstance(params, Params) and [s.stage for s in params.curriculum] == list(range(len(params.curriculum)))
    assert set(yaml.safe_load((ROOT / "presets" / f"{preset}.yaml").read_text())) == set(SECTIONS)  # every section written


def test_the_comparison_preset_differs_from_the_cpu_default_only_in_scale():
    cpu, gpu = load_params(ROOT / "presets" / "cpu.yaml"), load_params(ROOT / "presets" / "gpu-embedded.yaml")
    assert gpu.policy == cpu.policy and gpu.engineer == cpu.engineer.model_copy(update={"threads": None,
                                                                                   "engineer": "policy"})
    paper = load_params(ROOT / "presets" / "gpu.yaml")
    assert len(paper.curriculum) == 4 and paper.train.trajectories == 4000 and paper.policy.model == "Qwen/Qwen3-4B"


def test_params_yaml_holds_the_cpu_presets_values():
    assert load_params(ROOT / "params.yaml") == load_params(ROOT / "presets" / "cpu.yaml")


@pytest.mark.parametrize("name", ["params.yaml", "presets/cpu.yaml", "presets/gpu.yaml", "presets/gpu-embedded.yaml",
                                  "presets/gpu-distill.yaml"])
def test_dvc_exp_run_set_rewrites_only_the_value_it_sets(name, tmp_path):
    """`dvc exp run -S` rewrites the params file through DVC's own YAML writer: the files are laid out so that this
    rewrite keeps every byte (comments too) but the value set."""
    from dvc.utils.hydra import apply_overrides as dvc_apply

    original = (ROOT / name).read_text()
    path = tmp_path / "params.yaml"
    path.write_text(original)
    dvc_apply(path, [f"train.seed={yaml.safe_load(original)['train']['seed']}"])  # the value it already has
    assert path.read_text() == original
    dvc_apply(path, ["train.lora_r=7", "benchmark.wait_ratios=[0.125]"])
    diff = [line for line in difflib.unified_diff(original.splitlines(), path.read_text().splitlines(), n=0, lineterm="")
            if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    removed = sum(line.startswith("-") for line in diff)
    assert "+  lora_r: 7" in diff and "+  - 0.125" in diff and sum(line.startswith("+") for line in diff) == 2, diff
    assert removed == 1 + len(yaml.safe_load(original)["benchmark"]["wait_ratios"]), diff


def test_one_override_syntax_the_words_of_dvc_exp_run_S():
    params = load_params(ROOT / "params.yaml", ["train.trajectories=64", "policy.prompt.think=true", "env.sizes.3.hole_ratio=0.3",
                                                "curriculum.1.prev=0", "engineer.trust_region={hole_ratio: 0.1}",
                                                "rollout.max_new_tokens=512", "evaluate.max_new_tokens=1024"])
    assert params.train.trajectories == 64 and params.policy.prompt == PromptStyle(moves="letters", trace=True, think=True)
    assert params.env.sizes[3].hole_ratio == 0.3 and params.engineer.trust_region == {"hole_ratio": 0.1}
    assert load_params(ROOT / "params.yaml", {"train.seed": 3}).train.seed == 3  # a parsed mapping too
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert apply_overrides(data, {"train.seed": 9})["train"]["seed"] == 9 and data["train"]["seed"] == 0  # a copy


@pytest.mark.parametrize("items, fragment", [
    (["foo.bar=1"], "no section 'foo'"),
    (["train.lora_r=0"], "train.lora_r = 0: allowed range [1, 512]"),
    (["train.learning_rat=1e-5"], "train.learning_rat = 1e-05: unknown field"),
    (["engineer.engineer=seer"], "engineer.engineer = 'seer'"),
    (["engineer.engineer=oracle"], "engineer.engineer 'oracle' needs engineer.replay"),
    (["engineer.trust_region={holes: 0.1}"], "unknown knob(s) ['holes']"),
    (["engineer.trust_region={hole_ratio: -1}"], "engineer.trust_region.hole_ratio = -1"),
    (["rollout.backend=openai"], "rollout.base_url"),
    (["policy.prompt.think=true"], "rollout.max_new_tokens is 'auto' but policy.prompt.think is true"),
    (["train.recipe=grpo", "train.micro_batch_size=3"], "train.micro_batch_size = 3 does not divide a GRPO step's"),
    (["train.sft=false"], "sft: replaced by recipe ('distill' for the supervised pass alone"),
    (["start.train.grpo=true"], "grpo: replaced by recipe"),
    (["train.recipe=sft"], "train.recipe = 'sft'"),
    (["rollout.max_new_tokens=0"], "rollout.max_new_tokens"),
    (["engineer.engineer=api"], "engineer.base_url"),
    (["policy.reward.optimal=0.1"], "a worse answer must never earn more"),
    (["policy.prompt.view=picture"], "policy.prompt.view = 'picture'"),
    (["env.sizes.3.hole_ratio=0.9"], "env.sizes.3.hole_ratio = 0.9: allowed range [0.0, 0.5]"),
    (["curriculum.1.prev=5"], "curriculum.1.prev = 5: set it to 0"),
    (["train.use_vllm=true"], "train.use_vllm: replaced by sampler ('trl-vllm'"),
    (["train.grpo_generation=backend"], "train.grpo_generation: replaced by sampler"),
    (["train.continuous_batching=false"], "train.continuous_batching: removed"),
    (["start.train.sft_group_by_length=true"], "train.sft_group_by_length: removed"),
    (["train.sampler=vllm"], "train.sampler = 'vllm'"),
    (["train.torch_compile=true"], "train.torch_compile: moved to train.accel.torch_compile"),
    (["train.accel.compile_mode=decoder-graph"], "set train.accel.compile_scope to 'layers'"),
    (["benchmark.per_cell={3: 2, 4: 1}"], "benchmark.per_cell gives counts for [3, 4] agents but benchmark.agents lists [3]"),
    (["benchmark.per_cell={3: 0}"], "benchmark.per_cell.3 = 0: give 1 to 10,000 instances per cell"),
    (["benchmark.per_cell=0"], "benchmark.per_cell = 0: give 1 to 10,000"),
    (["train.seed"], "use SECTION.KEY=VALUE"),
    (["train.seed=[1"], "not valid YAML"),
    (["train..seed=1"], "use SECTION.KEY=VALUE"),
])
def test_bad_overrides_name_the_field_and_the_fix(items, fragment):
    with pytest.raises(ParamsError) as e:
        load_params(ROOT / "params.yaml", items)
    assert fragment in str(e.value)


def test_bad_files_are_errors_that_name_the_file(tmp_path):
    for text, fragment in (("train: [1\n", "not valid YAML"), ("- 1\n", "expected a mapping of sections"),
                           ("train: {}\n", "curriculum: the field is required")):
        (tmp_path / "p.yaml").write_text(text)
        with pytest.raises(ParamsError, match="p.yaml"):
            load_params(tmp_path / "p.yaml")
        with pytest.raises(ParamsError) as e:
            load_params(tmp_path / "p.yaml")
        assert fragment in str(e.value)
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ParamsError, match="not UTF-8"):
        load_params(tmp_path / "bin.yaml")
    with pytest.raises(ParamsError, match="cannot be read"):
        load_params(tmp_path / "missing.yaml")
    huge = yaml.safe_load((ROOT / "params.yaml").read_text())
    huge["train"]["lora_targets"] = "x" * 100_000  # a long value is shown cut, never whole
    huge["train"]["lora_r"] = "y" * 100_000
    with pytest.raises(ParamsError) as e:
        validate_params(huge, "params.yaml")
    assert len(str(e.value)) < 1000


def test_overrides_parse_as_yaml_values():
    assert parse_overrides(["a.b=64", "a.c=false", "a.d=[1, 2]", "a.e=null", "a.f=text"]) == {
        "a.b": 64, "a.c": False, "a.d": [1, 2], "a.e": None, "a.f": "text"}


def test_a_keyless_endpoint_is_written_as_an_empty_key_variable():
    """``--set engineer.api_key_env=`` (a local ``env-engineer serve``, which asks for no key) is accepted: null, and
    the OpenAI backend then sends no Authorization header."""
    from policy.backends import OpenAIBackend

    params = load_params(ROOT / "params.yaml", ["engineer.api_key_env=", "rollout.api_key_env=null"])
    assert params.engineer.api_key_env is None and params.rollout.api_key_env is None
    assert OpenAIBackend("http://127.0.0.1:1/v1", "m", api_key_env=params.engineer.api_key_env)._key() is None


def test_the_recipe_and_sampler_registries_are_the_settings_values_and_their_help():
    """``RECIPES`` and ``SAMPLERS`` list exactly the values the settings take, and each value's line is in the help."""
    import typing

    from pipeline.train_settings import RECIPES, SAMPLERS, TrainSettings

    for name, registry in (("recipe", RECIPES), ("sampler", SAMPLERS)):
        field = TrainSettings.model_fields[name]
        assert set(typing.get_args(field.annotation)) == set(registry), name
        assert all(f"'{value}', {line}" in field.description for value, line in registry.items()), name


def test_the_stages_before_whole_from_stage_score_the_early_agent_counts():
    from pipeline.params import EvaluateSettings

    assert EvaluateSettings().agents_for(0) is None  # default: every stage scores the whole benchmark
    late = EvaluateSettings(whole_from_stage=3, early_agents=[2])
    assert [late.agents_for(k) for k in range(5)] == [[2], [2], [2], None, None]
    none_early = EvaluateSettings(whole_from_stage=3, early_agents=[])  # the stages before 3 score no board
    assert [none_early.agents_for(k) for k in range(4)] == [[], [], [], None]
