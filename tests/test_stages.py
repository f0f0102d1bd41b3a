import json
from pathlib import Path

import pytest
import yaml

from tasks.stages import finished, folder_record, load_stages, order, run_stages, set_params

ROOT = Path(__file__).resolve().parents[1]


def test_the_real_pipeline_expands_and_orders_as_dvc_does():
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    stages = order(load_stages(ROOT / "dvc.yaml", params))
    names = [s.name for s in stages]
    last = params["curriculum"][-1]["stage"]
    assert {"validation-set", "benchmark", "init-curriculum", f"train@{last}", f"engineer-config@{last}"} <= set(names)
    pos = {n: i for i, n in enumerate(names)}
    assert pos["init-curriculum"] < pos["generate-instances@0"] < pos["train@0"] < pos["summarize-failures@0"]
    assert pos["engineer-config@0"] < pos["generate-instances@1"]  # stage 1's configuration is stage 0's engineer's
    assert pos["benchmark"] < pos["evaluate@0"] and pos["validation-set"] < pos["benchmark"]
    train1 = next(s for s in stages if s.name == "train@1")
    assert "--init-adapter data/stages/0/adapter" in train1.cmd and "${" not in train1.cmd
    evaluate = next(s for s in stages if s.name == "evaluate@0")
    assert f"--max-new-tokens {params['evaluate']['max_new_tokens']}" in evaluate.cmd
    assert "data/stages/1/config.yaml" in next(s for s in stages if s.name == "generate-instances@1").deps


PIPELINE = """
stages:
  make:
    foreach: ${rounds}
    do:
      cmd: >-
        python -c "import pathlib; pathlib.Path('out/${item.k}.txt').write_text('${item.k} ${knob.value}')"
        && env-engineer validate --kind instances out/${item.k}.txt
      deps:
        - ${item.dep}
      outs:
        - out/${item.k}.txt
  seed:
    cmd: python -c "import pathlib; pathlib.Path('out/seed.txt').write_text('s')"
    outs:
      - out/seed.txt
"""


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "dvc.yaml").write_text(PIPELINE)
    params = {"rounds": [{"k": "b", "dep": "out/a.txt"}, {"k": "a", "dep": "out/seed.txt"}], "knob": {"value": 1}}
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    return repo


def test_runs_in_dependency_order_with_overrides_and_resumes(repo, tmp_path):
    folder = tmp_path / "run"
    records = run_stages(repo, folder, {"knob.value": 7}, validate=False)
    assert [r["stage"] for r in records] == ["seed", "make@1", "make@0"]  # item 0 reads item 1's output, 1 reads seed's
    assert (folder / "out" / "b.txt").read_text() == "b 7" and not any(r["skipped"] for r in records)
    assert yaml.safe_load((folder / "params.yaml").read_text())["knob"]["value"] == 7
    again = run_stages(repo, folder, {"knob.value": 7}, validate=False)
    assert all(r["skipped"] for r in again)  # finished stages are not run twice
    with pytest.raises(ValueError, match="other parameters"):
        run_stages(repo, folder, {"knob.value": 8}, validate=False)
    partial = run_stages(repo, tmp_path / "partial", validate=False, until="make@1")
    assert [r["stage"] for r in partial] == ["seed", "make@1"] and not (tmp_path / "partial" / "out" / "b.txt").exists()
    assert finished(folder) and not finished(tmp_path / "partial") and not finished(tmp_path / "nowhere")
    for out in (folder / "out").iterdir():  # an archive of results: markers and metrics, no outputs
        out.unlink()
    assert finished(folder)


def test_a_failing_command_names_its_stage_and_log(repo, tmp_path):
    """With validation on, the great-expectations check of a file that is not Parquet fails the stage."""
    with pytest.raises(RuntimeError, match=r"stage make@1 failed .*logs/make@1\.log"):
        run_stages(repo, tmp_path / "run", validate=True)
    assert (tmp_path / "run" / ".done" / "seed").exists() and not (tmp_path / "run" / ".done" / "make@1").exists()


def test_overrides_and_templates_name_what_is_wrong(repo, tmp_path):
    with pytest.raises(ValueError, match="no section 'nope'"):
        set_params({"train": {}}, {"nope.x": 1})
    with pytest.raises(ValueError, match="--until 'nothing'"):
        run_stages(repo, tmp_path / "run", validate=False, until="nothing")
    (repo / "dvc.yaml").write_text(PIPELINE.replace("${knob.value}", "${knob.missing}"))
    with pytest.raises(KeyError, match="knob.missing"):
        run_stages(repo, tmp_path / "run2", validate=False)
    for extra, word in (("vars:\n  - other.yaml\n", "vars"), (PIPELINE.replace("  seed:\n", "  seed:\n    wdir: sub\n"), "wdir")):
        (repo / "dvc.yaml").write_text(extra + PIPELINE if word == "vars" else extra)
        with pytest.raises(ValueError, match=f"'{word}'"):
            load_stages(repo / "dvc.yaml", {"rounds": [], "knob": {"value": 1}})


def test_folder_record_reads_params_and_stage_metrics(tmp_path):
    (tmp_path / "data" / "stages" / "1").mkdir(parents=True)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"train": {"seed": 2}}))
    (tmp_path / "data" / "stages" / "1" / "benchmark_metrics.json").write_text(json.dumps({"bench": {"acc/3_agents": 0.5}}))
    record = folder_record("cmp-random-s2", tmp_path)
    assert record == {"name": "cmp-random-s2", "params": {"train": {"seed": 2}},
                      "metrics": {"data/stages/1/benchmark_metrics.json": {"bench": {"acc/3_agents": 0.5}}}}


def test_identical_stages_reuse_cached_outputs_across_folders(repo, tmp_path):
    cache = tmp_path / "cache"
    first = run_stages(repo, tmp_path / "a", validate=False, cache=cache)
    assert not any(r["cached"] for r in first)
    second = run_stages(repo, tmp_path / "b", validate=False, cache=cache)
    assert all(r["cached"] for r in second) and (tmp_path / "b" / "out" / "b.txt").read_text() == "b 1"
    third = run_stages(repo, tmp_path / "c", {"knob.value": 2}, validate=False, cache=cache)
    assert [r["cached"] for r in third] == [True, False, False]  # only the stage the knob does not reach is reused
    assert (tmp_path / "c" / "out" / "b.txt").read_text() == "b 2"
    (tmp_path / "a" / "out" / "seed.txt").write_text("changed")  # a dependency's content is part of the key
    from tasks.stages import load_stages as load, stage_key

    stage = next(s for s in load(tmp_path / "a" / "dvc.yaml", yaml.safe_load((tmp_path / "a" / "params.yaml").read_text()))
                 if s.name == "make@1")
    params = yaml.safe_load((tmp_path / "b" / "params.yaml").read_text())
    assert stage_key(stage, stage.cmd, tmp_path / "a", params) != stage_key(stage, stage.cmd, tmp_path / "b", params)
