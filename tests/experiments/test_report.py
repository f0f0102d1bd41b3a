import json
import shutil
import subprocess

import yaml

from envgen.benchmark import render_table
from experiments.dvc import dvc_env, pipeline_stages
from experiments.report import build_report, load_run, run_files

from tests.helpers import ROOT


def test_report_reads_the_files_dvc_yaml_declares_and_is_self_contained(tmp_path, capsys):
    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=tmp_path, check=True, env=dvc_env())
    files = run_files(pipeline_stages(tmp_path))
    assert [f["stage"] for f in files] == [0, 1, 2] and set(files[2]) == {"stage", "config"}  # 2: the last proposal
    table = {"3": {"sizes": {"3": {"acc": 0.1, "opt": 0.0, "n": 2}}, "sum": {"acc": 0.1, "opt": 0.0}, "wait": {}}}
    for k, spec in enumerate(files):
        def write(key: str, text: str) -> None:
            (tmp_path / spec[key]).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / spec[key]).write_text(text)

        write("config", yaml.safe_dump({"num_agents": 2, "budget": 4, "seed": k,
                                        "sizes": {3: {"data_ratio": 0.5, "hole_ratio": 0.1 * k, "wait_ratio": 0.5}}}))
        if k == 2:
            continue
        # stage 0 scored the two-agent boards only (evaluate.whole_from_stage: 1), stage 1 every agent count
        scored = {"2": table["3"]} if k == 0 else {"2": table["3"], **table}
        write("bench", json.dumps({"bench": {"acc/3_agents": 0.1 * k}, "bench_table": scored,
                                   "reference": {"prioritized": table, "independent": table}}))
        write("tables", render_table(table, "Policy"))
        write("validation", json.dumps({"validation": {"valid": 0.5}, "validation_by_size": {"3": {"valid": 0.5}}}))
        write("train", "{}")
        write("sft_history", json.dumps([{"step": i + 1, "loss": 1.0 / (i + 1)} for i in range(4)]))
        write("grpo_history", json.dumps([{"step": i, "reward": 0.1 * i, "valid": 0.05 * i} for i in range(3)]))
        write("engineer", json.dumps({"engineer": "heuristic", "context": "bookkeeping", "rationale": "<b>bold</b>",
                                      "notes": ["size 3: clamped"], "fallback": False}))
        write("summary", json.dumps({"stage": k, "validation": {"overall": {"valid": 0.5, "failures": {"hole": 0.3},
                                                                            "parse_errors": {"empty": 0.2}}}, "examples": [
            {"size": 3, "num_agents": 2, "verdict": "hole", "board": "A . b", "answer": "<script>alert(1)</script>"}]}))
    out = tmp_path / "r.html"
    written = build_report(load_run(tmp_path, files), out)
    text = out.read_text()
    assert written[0] == out and len(written) > 4 and all(p.exists() for p in written)
    for section in ("Benchmark curves", "Training curves", "Configuration evolution", "Failure breakdown", "The engineer's decisions",
                    "Sampled failed answers", "Benchmark tables after stage 1"):
        assert section in text
    assert "<script" not in text and "&lt;b&gt;bold&lt;/b&gt;" in text
    assert "http://" not in text and "https://" not in text and text.count("data:image/png;base64,") >= 4
    from env_engineer.cli import main

    assert main(["report", "--repo", str(tmp_path), "--out", str(tmp_path / "cli.html")]) == 0
    assert "wrote" in capsys.readouterr().out and (tmp_path / "cli.html").exists()
    # with a sensitivity summary (the one measured on two H100s): its figure, spread, noise and table
    sens = ROOT / "docs" / "results" / "grpo-sensitivity" / "summary-h100x2.json"
    assert main(["report", "--repo", str(tmp_path), "--out", str(tmp_path / "s.html"), "--sensitivity", str(sens)]) == 0
    text = (tmp_path / "s.html").read_text()
    assert "How much one stage's environment can matter" in text and "1.2 points (hole-heavy - small-heavy)" in text
    assert "differ by 1.9 points on average" in text and "coordination-heavy/s1" in text
    assert (tmp_path / "s_assets" / "sensitivity.png").exists()
    assert main(["report", "--repo", str(tmp_path), "--out", str(tmp_path / "x.html"), "--sensitivity", "nope.json"]) == 2
    assert "--sensitivity nope.json" in capsys.readouterr().err
    # with a comparison table (`env-engineer compare`): the engineers' curves across stages and its tables
    cell = {"mean": 0.25, "ci95": 0.05, "n": 3}
    compared = {arm: {"seeds": [0, 1, 2], "metrics": {"acc/3_agents": cell, "val/valid": cell},
                      "stages": {"0": {"acc/3_agents": cell, "val/valid": cell}, "1": {"acc/3_agents": cell}},
                      "configs": {"1": {"size": cell, "hole_ratio": cell, "wait_ratio": cell}}}
                for arm in ("heuristic", "fixed")}
    (tmp_path / "c.json").write_text(json.dumps(compared))
    assert main(["report", "--repo", str(tmp_path), "--out", str(tmp_path / "c.html"), "--comparison",
                 str(tmp_path / "c.json")]) == 0
    text = (tmp_path / "c.html").read_text()
    assert "Engineer comparison" in text and 'alt="engineers across stages"' in text and "Across stages" in text
    assert "The environment each stage trained on" in text and (tmp_path / "c_assets" / "comparison.png").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(ROOT / "dvc.yaml", empty / "dvc.yaml")
    shutil.copy(ROOT / "params.yaml", empty / "params.yaml")
    subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=empty, check=True, env=dvc_env())
    assert main(["report", "--repo", str(empty), "--out", str(tmp_path / "none.html")]) == 2
    assert "no stage has results yet" in capsys.readouterr().err
