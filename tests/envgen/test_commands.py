import json

from env_engineer.cli import main
from envgen.core.config import EnvConfig, SizeConfig, config_diff

from tests.helpers import bench_path


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
    assert code == 2 and f"{scen}:3: start/goal coordinates must be whole numbers" in err
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


def test_render_and_schema(capsys, tmp_path):
    png = tmp_path / "x.png"
    code, out, _ = run(capsys, "render", *circle()[:-2], "--agents", "2", "--png", png, "--with-plan")
    assert code == 0 and "Legend:" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out, _ = run(capsys, "config-schema", "--sizes", "3-5")
    assert code == 0 and json.loads(out)["properties"]["sizes"]["required"] == ["3", "4", "5"]
    code, _, err = run(capsys, "config-schema", "--sizes", "2-40")
    assert code == 2 and "3..16" in err


def test_validate_config_names_the_field_and_the_fix(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("num_agents: 2\nbudget: 12\nsizes:\n  4: {data_ratio: 1, hole_ratio: 0.9}\n")
    code, _, err = run(capsys, "validate-config", cfg)
    assert code == 2 and "sizes.4.hole_ratio = 0.9" in err and "[0.0, 0.5]" in err
    cfg.write_text("num_agents: 2\nbudget: 12\nsizes:\n  4: {data_ratio: 1}\n")
    code, out, _ = run(capsys, "validate-config", cfg)
    assert code == 0 and "valid; 12 instances, 2 agents" in out


def test_config_diff_lists_changed_knobs_and_shares(tmp_path, capsys):
    a = EnvConfig(budget=10, seed=0, sizes={3: SizeConfig(data_ratio=0.5), 4: SizeConfig(data_ratio=0.5)})
    b = EnvConfig(budget=10, seed=1, sizes={3: SizeConfig(data_ratio=0.5, hole_ratio=0.3), 4: SizeConfig(data_ratio=1.5 / 2)})
    rows = {f: (x, y) for f, x, y in config_diff(a, b)}
    assert rows["seed"] == (0, 1) and rows["sizes.3.hole_ratio"] == (0.2, 0.3)
    assert rows["sizes.3.share"] == (0.5, 0.4) and rows["sizes.4.data_ratio"] == (0.5, 0.75)
    assert "sizes.4.hole_ratio" not in rows and config_diff(a, a) == []
    a.save(tmp_path / "a.yaml")
    b.save(tmp_path / "b.yaml")
    assert main(["diff-configs", str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml"), "--json"]) == 0
    assert {"field": "seed", "a": 0, "b": 1} in json.loads(capsys.readouterr().out)
    assert main(["diff-configs", str(tmp_path / "a.yaml"), str(tmp_path / "a.yaml")]) == 0
    assert "same configuration" in capsys.readouterr().out
    assert main(["diff-configs", str(tmp_path / "a.yaml"), str(tmp_path / "missing.yaml")]) == 2
