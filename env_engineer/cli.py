"""The ``env-engineer`` command: one subcommand per pipeline step, testbed command, experiment and the server.
``env-engineer <command> --help`` explains each.

Commands import their heavy dependencies only when they run, so ``--help`` and the small commands start fast.
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType


def commands() -> dict[str, tuple[str, ModuleType | None, str, str]]:
    """``name -> (help, module, arguments function, run function)`` for every subcommand."""
    from env_engineer import reference
    from envgen import commands as testbed
    from pipeline.params import ENGINEER_LINES
    from experiments import compare, report, results, sensitivity
    from flows import ready, workers
    from pipeline import checks
    from policy import serve
    from steps import (build_benchmark, engineer_config, evaluate, generate_instances, init_curriculum, rollout,
                       start_instances, summarize_failures, train, validation_set)

    step = ("add_arguments", "run")
    return {
        # pipeline steps (dvc.yaml's stages)
        "start-instances": ("Generate the shared starting policy's demonstrations (params.yaml, section start).",
                            start_instances, *step),
        "validation-set": ("Generate the held-out validation instances (params.yaml, section validation).", validation_set, *step),
        "build-benchmark": ("Build the held-out benchmark (paper layout) and its reference rows (CBS and reference planners).",
                            build_benchmark, *step),
        "init-curriculum": ("Write the state before stage 0: round-0 configuration, fresh LoRA adapter, empty summary.",
                            init_curriculum, *step),
        "generate-instances": ("Generate a stage's solved instances from an environment configuration into Parquet.",
                               generate_instances, *step),
        "train": ("Warm-start on solver demonstrations, then GRPO with the MAPF reward, on a LoRA adapter.", train, *step),
        "rollout": ("Answer every instance G times with the policy (+ adapter); score and write trajectories Parquet.",
                    rollout, *step),
        "evaluate": ("Score a stage's benchmark rollout: valid/optimal per cell, Sum per agent count, per wait subset.",
                     evaluate, *step),
        "summarize-failures": ("Summarise a stage: validation failures, environment statistics, training bookkeeping, history.",
                               summarize_failures, *step),
        "engineer-config": (f"Let an engineer ({', '.join(ENGINEER_LINES)}) write the next configuration.",
                            engineer_config, *step),
        "check-data": ("Check a Parquet dataset against its great-expectations suite (exit 1 on failure).", checks, *step),
        # experiments
        "compare": ("Compare engineers (or context variants) over seeds as DVC experiments: means with 95%% intervals.",
                    compare, *step),
        "sensitivity": ("How much the environment can matter: the pipeline under hand-set configurations (or sequences "
                        "of them), one DVC experiment per configuration and seed, scored on the same benchmark answers.",
                        sensitivity, *step),
        "sensitivity-merge": ("One summary of several sensitivity summaries of the same start and held-out instances (a "
                              "study run in parts): runs side by side, spread and configuration effect over all.",
                              sensitivity, "add_merge_arguments", "run_merge"),
        "report": ("Write a self-contained HTML report (and PNGs) of a curriculum run.", report, *step),
        "results": ("Print a run's headline numbers per stage and the engineer's decisions, 100 columns wide (or one "
                    "row per DVC experiment).", results, *step),
        "prefect-ready": ("Wait until a Prefect server answers (for scripts that start one in the background).", ready, *step),
        "workers": ("Start one Prefect worker per GPU (each pinned to its GPU) for a process work pool.", workers, *step),
        # the testbed
        "solve": ("Solve the first K agents of a MovingAI scenario optimally (CBS, sum of costs).", testbed,
                  "add_solve_arguments", "run_solve"),
        "check-plan": ("Check a plan (per agent a list of [row, col] cells) against a MovingAI instance.", testbed,
                       "add_check_arguments", "run_check"),
        "render": ("Print an instance's text views and optionally write a PNG (with its optimal plan).", testbed,
                   "add_render_arguments", "run_render"),
        "config-schema": ("Print the environment configuration's JSON schema, or a field reference with --describe.",
                          testbed, "add_schema_arguments", "run_schema"),
        "validate-config": ("Check an environment configuration YAML; print every problem with its fix.", testbed,
                            "add_validate_arguments", "run_validate"),
        "diff-configs": ("Show what changed between two environment configurations (e.g. two stages of one revision).",
                         testbed, "add_diff_arguments", "run_diff"),
        # the policy
        "serve": ("Serve a model (+ LoRA adapter) over an OpenAI-compatible HTTP API.", serve, *step),
        "train-server": ("Train every experiment's stages in warm processes (the train step with train.server set "
                         "hands its stage here).", train, "add_server_arguments", "run_server"),
        # the project's own reference
        "reference": ("Write docs/reference/ (settings, configuration, datasets, commands) from the code, or check it.",
                      reference, *step),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="env-engineer",
        description="LLM-designed training environments on MAPF-FrozenLake: the curriculum pipeline's steps (run by "
        "`dvc repro`), the testbed's commands, experiments and a model server.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, module, add_args, run) in commands().items():
        p = sub.add_parser(name, help=help_text, description=help_text.replace("%%", "%"))  # help is %-formatted, description not
        getattr(module, add_args)(p)
        p.set_defaults(handler=getattr(module, run), commands=commands)  # the table, for `reference` to document
    return parser


PIPELINE_MODULES = frozenset({"torch", "transformers", "peft", "trl", "accelerate", "datasets", "gguf", "prefect", "dvc",
                              "dvc_task", "great_expectations", "scipy", "polars", "matplotlib", "tqdm", "fastapi",
                              "uvicorn", "httpx", "jsonschema", "psutil"})
"""What the ``pipeline`` extra installs: a command that needs one of them, in an install of the testbed alone, says so."""


RENAMED = {"validate": "check-data"}
"""Commands renamed, old name -> new (``validate`` is the pipeline's stage that answers the validation set)."""


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    if words and words[0] in RENAMED:
        print(f"error: `env-engineer {words[0]}` is now `env-engineer {RENAMED[words[0]]}` (same arguments)", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in PIPELINE_MODULES:
            raise
        print(f"error: `env-engineer {args.command}` needs {e.name}, which the testbed alone does not install: "
              "pip install 'env-engineer[pipeline]' (on a CPU machine, torch==2.13.0 from PyTorch's CPU index first: "
              "see the README)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
