"""The ``env-engineer`` command: one subcommand per pipeline step and tool. ``env-engineer <command> --help`` explains each.

Steps import their heavy dependencies only when they run, so ``--help`` and the small tools start fast.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from policy import serve
    from tasks import (benchmark, compare, curriculum, engineer, generate_instances, mapf_tools, report, rollout, stages,
                       summarize, tools, train, validate)

    parser = argparse.ArgumentParser(
        prog="env-engineer",
        description="LLM-designed training environments on MAPF-FrozenLake: generate, solve and check instances, "
        "and run the curriculum's pipeline steps.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str, add_args, run) -> None:
        p = sub.add_parser(name, help=help_text, description=help_text.replace("%%", "%"))  # help is %-formatted, description not
        add_args(p)
        p.set_defaults(handler=run)

    add("init-curriculum", "Write the state before stage 0: round-0 configuration, fresh LoRA adapter, empty summary.",
        curriculum.add_init_arguments, curriculum.run_init)
    add("generate-instances", "Generate a stage's solved instances from an environment configuration into Parquet.",
        generate_instances.add_arguments, generate_instances.run)
    add("rollout", "Answer every instance G times with a model (+ adapter); score and write trajectories Parquet.",
        rollout.add_arguments, rollout.run)
    add("train", "Warm-start on solver demonstrations, then GRPO with the MAPF reward, on a LoRA adapter.",
        train.add_arguments, train.run)
    add("summarize-failures", "Summarise a stage: validation failures, environment statistics, training bookkeeping, history.",
        summarize.add_arguments, summarize.run)
    add("engineer-config", "Let an engineer (policy, base, api, heuristic, random, fixed) write the next configuration.",
        engineer.add_arguments, engineer.run)
    add("build-benchmark", "Build the held-out benchmark (paper layout) and its reference rows (CBS, prioritized, independent).",
        benchmark.add_build_arguments, benchmark.run_build)
    add("evaluate", "Score a stage's benchmark rollout: valid/optimal per cell, Sum per agent count, per wait subset.",
        benchmark.add_evaluate_arguments, benchmark.run_evaluate)
    add("compare", "Compare engineers (or context variants) over seeds as DVC experiments: means with 95%% intervals.",
        compare.add_arguments, compare.run)
    add("run-stages", "Run dvc.yaml's pipeline in a folder where DVC is not installed (a GPU worker), resumable.",
        stages.add_arguments, stages.run)
    add("report", "Write a self-contained HTML report (and PNGs) of a curriculum run.", report.add_arguments, report.run)
    add("diff-configs", "Show what changed between two environment configurations (e.g. two stages of one revision).",
        curriculum.add_diff_arguments, curriculum.run_diff)
    add("validate", "Check a Parquet dataset against its great-expectations suite (exit 1 on failure).",
        validate.add_arguments, validate.run)
    add("serve", "Serve a model (+ LoRA adapter) over an OpenAI-compatible HTTP API.", serve.add_arguments, serve.run)
    add("solve", "Solve the first K agents of a MovingAI scenario optimally (CBS, sum of costs).",
        mapf_tools.add_solve_arguments, mapf_tools.run_solve)
    add("check-plan", "Check a plan (per agent a list of [row, col] cells) against a MovingAI instance.",
        mapf_tools.add_check_arguments, mapf_tools.run_check)
    add("render", "Print an instance's text views and optionally write a PNG (with its optimal plan).",
        tools.add_render_arguments, tools.run_render)
    add("config-schema", "Print the environment configuration's JSON schema, or a field reference with --describe.",
        tools.add_schema_arguments, tools.run_schema)
    add("validate-config", "Check an environment configuration YAML; print every problem with its fix.",
        tools.add_validate_arguments, tools.run_validate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
