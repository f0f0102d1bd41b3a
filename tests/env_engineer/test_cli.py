import argparse
import subprocess
import sys

import pytest

from env_engineer.cli import build_parser, commands, main


def test_console_script_help_runs():
    out = subprocess.run([sys.executable, "-m", "env_engineer", "--help"], capture_output=True, text=True, check=True).stdout
    for command in commands():
        assert command in out
    with pytest.raises(SystemExit):
        main(["no-such-command"])


def test_every_subcommand_has_working_help():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(commands()) and len(sub.choices) >= 19
    for name, parser in sub.choices.items():
        text = parser.format_help()
        assert name in text and "usage:" in text
        assert "%%" not in text, f"{name}: a doubled percent sign shows in --help"
    assert "95% intervals" in sub.choices["compare"].format_help()


def test_every_pipeline_step_also_runs_as_its_own_module():
    from steps import (build_benchmark, engineer_config, evaluate, generate_instances, init_curriculum, rollout,
                       start_instances, summarize_failures, train, validation_set)

    for module in (build_benchmark, engineer_config, evaluate, generate_instances, init_curriculum, rollout,
                   start_instances, summarize_failures, train, validation_set):
        name = module.__name__.rsplit(".", 1)[1].replace("_", "-")
        assert commands()[name][1] is module
        with pytest.raises(SystemExit) as stop:
            module.main(["--help"])
        assert stop.value.code == 0


def test_a_renamed_command_names_its_new_name(capsys):
    from env_engineer.cli import main

    assert main(["validate", "--kind", "instances", "x.parquet"]) == 2
    assert "`env-engineer validate` is now `env-engineer check-data`" in capsys.readouterr().err
