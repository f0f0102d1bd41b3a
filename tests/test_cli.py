import json
import subprocess
import sys

import pytest

from tasks.cli import main

from .helpers import bench_path


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def circle():
    return ["--map", bench_path("custom", "jmorag-circle.map"), "--scen", bench_path("custom", "jmorag-circle.scen"), "--agents", "2"]


def test_solve_text_and_json(capsys):
    code, out, _ = run(capsys, "solve", *circle())
    assert code == 0 and out.startswith("soc 8\nmakespan 5\nagent 1: (3,3)")
    code, out, _ = run(capsys, "solve", *circle(), "--json")
    data = json.loads(out)
    assert code == 0 and set(data) == {"soc", "makespan", "paths"} and (data["soc"], data["makespan"]) == (8, 5)
    assert data["paths"][0][0] == [3, 3]  # (row, col): the scenario's x=3, y=3


def test_solve_unsolvable_exits_1(capsys):
    pocket = ["--map", bench_path("custom", "jmorag-pocket-unsolvable.map"), "--scen",
              bench_path("custom", "jmorag-pocket-unsolvable.scen"), "--agents", "2", "--json"]
    code, out, _ = run(capsys, "solve", *pocket)
    assert code == 1 and json.loads(out)["soc"] is None and json.loads(out)["reason"] == "unsolvable"


def test_bad_input_exits_2_naming_file_and_line(capsys, tmp_path):
    bad_map = tmp_path / "bad.map"
    bad_map.write_text("type octile\nheight 2\nwidth 3\nmap\n...\n.X.\n")
    code, _, err = run(capsys, "solve", "--map", bad_map, "--scen", bench_path("custom", "jmorag-circle.scen"), "--agents", "1")
    assert code == 2 and f"{bad_map}:6: unknown map symbol" in err
    scen = tmp_path / "s.scen"
    scen.write_text("version 1\n0\tm\t3\t2\t0\t0\t2\t1\t1\n0\tm\t3\t2\tfoo\t0\t2\t1\t1\n")
    code, _, err = run(capsys, "solve", "--map", bad_map, "--scen", scen, "--agents", "2")
    assert code == 2 and f"{bad_map}:6" in err
    good_map = tmp_path / "good.map"
    good_map.write_text("type octile\nheight 2\nwidth 3\nmap\n...\n.@.\n")
    code, _, err = run(capsys, "solve", "--map", good_map, "--scen", scen, "--agents", "2")
    assert code == 2 and f"{scen}:3: start/goal coordinates must be integers" in err
    code, _, err = run(capsys, "solve", *circle()[:4], "--agents", "7")
    assert code == 2 and "asked for 7 agents" in err


def test_check_plan_valid_invalid_and_malformed(capsys, tmp_path):
    code, out, _ = run(capsys, "solve", *circle(), "--json")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(json.loads(out)["paths"], indent=1))
    code, out, _ = run(capsys, "check-plan", *circle(), "--plan", plan, "--json")
    assert code == 0 and json.loads(out) == {"valid": True, "failure": None, "soc": 8, "makespan": 5}
    swap = tmp_path / "swap.json"
    swap.write_text("[[[3,3],[3,2],[2,2],[1,2]], [[1,2],[2,2],[3,2],[3,3]]]")
    code, out, _ = run(capsys, "check-plan", *circle(), "--plan", swap, "--json")
    data = json.loads(out)
    assert code == 1 and data["valid"] is False and data["failure"] == "edge_conflict" and data["soc"] is None
    assert (data["agent"], data["step"]) == (1, 2)
    code, out, _ = run(capsys, "check-plan", *circle(), "--plan", swap)
    assert code == 1 and out.startswith("invalid: edge_conflict")
    broken = tmp_path / "broken.json"
    broken.write_text('[\n  [[3,3],\n   [3,2]],\n  [[1,2],\n   [1, "x"]]\n]\n')
    code, _, err = run(capsys, "check-plan", *circle(), "--plan", broken)
    assert code == 2 and f"{broken}:5: agent 2 step 1" in err
    notjson = tmp_path / "nj.json"
    notjson.write_text("[[[3,3]],\n oops]")
    code, _, err = run(capsys, "check-plan", *circle(), "--plan", notjson)
    assert code == 2 and f"{notjson}:2: not valid JSON" in err


def test_generate_instances_cli_and_config_errors(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("num_agents: 2\nbudget: 12\nseed: 5\nsizes:\n  4: {data_ratio: 1, hole_ratio: 0.2, wait_ratio: 0.5}\n")
    out_file = tmp_path / "out" / "i.parquet"
    code, out, _ = run(capsys, "generate-instances", "--config", cfg, "--out", out_file, "--no-progress")
    assert code == 0 and "wrote 12 instances" in out and "needs-wait share 0.500" in out and out_file.exists()
    cfg.write_text("num_agents: 2\nbudget: 12\nsizes:\n  4: {data_ratio: 1, hole_ratio: 0.9}\n")
    code, _, err = run(capsys, "generate-instances", "--config", cfg, "--out", out_file)
    assert code == 2 and "sizes.4.hole_ratio = 0.9" in err and "[0.0, 0.5]" in err
    code, _, err = run(capsys, "validate-config", cfg)
    assert code == 2 and "sizes.4.hole_ratio" in err


def test_render_and_schema(capsys, tmp_path):
    png = tmp_path / "x.png"
    code, out, _ = run(capsys, "render", *circle()[:-2], "--agents", "2", "--png", png, "--with-plan")
    assert code == 0 and "Legend:" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out, _ = run(capsys, "config-schema", "--sizes", "3-5")
    assert code == 0 and json.loads(out)["properties"]["sizes"]["required"] == ["3", "4", "5"]
    code, _, err = run(capsys, "config-schema", "--sizes", "2-40")
    assert code == 2 and "3..16" in err


def test_console_script_help_runs():
    out = subprocess.run([sys.executable, "-m", "tasks.cli", "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("generate-instances", "solve", "check-plan", "render", "config-schema", "validate-config"):
        assert command in out
    with pytest.raises(SystemExit):
        main(["no-such-command"])


def test_every_subcommand_has_working_help(capsys):
    import argparse

    from tasks.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert len(sub.choices) >= 18
    for name, parser in sub.choices.items():
        text = parser.format_help()
        assert name in text and "usage:" in text
        assert "%%" not in text, f"{name}: a doubled percent sign shows in --help"
    assert "95% intervals" in sub.choices["compare"].format_help()
