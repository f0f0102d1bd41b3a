"""bench/solver.py's command line: --option NAME=VALUE into CBSOptions, and the external solver's command with
--external-args (the benchmark itself is a script, run by hand against CBSH2-RTC)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench import solver  # noqa: E402


def test_options_are_read_as_their_fields_types():
    got = solver.parse_options(["rectangle_reasoning=false", "pair-cost=3", "heuristic=cg"], "pairs")
    assert (got.rectangle_reasoning, got.pair_cost, got.heuristic, got.conflict_ties) == (False, 3, "cg", "pairs")
    assert solver.parse_options([]) == solver.CBSOptions()
    assert solver.parse_options(["conflict_ties=pairs"]).conflict_ties == "pairs"


@pytest.mark.parametrize("bad, says", [
    ("rectangles=false", "NAME one of"),
    ("bypass", "NAME one of"),
    ("bypass=maybe", "bypass=true or bypass=false"),
    ("pair_cost=two", "whole number"),
    ("heuristic=best", "heuristic"),
])
def test_a_bad_option_names_the_fix(bad, says):
    with pytest.raises(ValueError, match=says):
        solver.parse_options([bad])


def test_a_bad_option_on_the_command_line_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as stop:
        solver.main(["--sets", "", "--option", "pair_cost=two"])
    assert stop.value.code == 2 and "whole number" in capsys.readouterr().err


def test_external_arguments_replace_the_defaults_they_name():
    plain = solver.external_command("cbs", Path("m"), Path("s"), 5, 10.0)
    assert plain[plain.index("--corridorReasoning") + 1] == "None" and plain[-2:] == ["-s", "1"]
    rect = solver.external_command("cbs", Path("m"), Path("s"), 5, 10.0, ("--rectangleReasoning", "R"))
    assert rect[-2:] == ["--rectangleReasoning", "R"] and "--corridorReasoning" in rect
    corr = solver.external_command("cbs", Path("m"), Path("s"), 5, 10.0, ("--corridorReasoning", "GC"))
    assert corr.count("--corridorReasoning") == 1 and corr[corr.index("--corridorReasoning") + 1] == "GC"
