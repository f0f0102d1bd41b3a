"""What a step's process spends compiling its imports when Python finds no bytecode for the installed packages and may
write none (``PYTHONDONTWRITEBYTECODE`` set, packages installed without it: ``pip --no-compile``, uv's default).

    python bench/bytecode.py --repeats 3

Every step of every experiment stage is a fresh Python process, so its imports are paid again each time. For each
import below, a fresh interpreter imports it with the packages' bytecode at hand, then without it (the standard
library's bytecode kept, in a cache prefix of its own, so that only the installed packages are compiled again).
Prints the CPU seconds of each (median of ``--repeats``), their difference, the same-run ratio, and the sum over the
processes of one experiment stage of the comparison preset (``dvc.yaml``: generate-instances, train, validate,
evaluate, summarize-failures and engineer-config, and a data check after each of four of them, the one after
evaluate on an empty file before the last stage).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

IMPORTS = {
    "generate-instances": "steps.generate_instances",
    "train": "steps.train",
    "validate (rollout)": "steps.rollout",
    "evaluate": "steps.evaluate",
    "summarize-failures": "steps.summarize_failures",
    "engineer-config": "steps.engineer_config",
    "check-data": "pipeline.checks, great_expectations",
    "check-data, empty file": "pipeline.checks",
    "dvc": "dvc.cli, dvc.repo",
}
"""Each process of an experiment stage, and the modules it imports before its work (``check-data`` imports
great-expectations inside its check, which it skips for an empty file passed with ``--allow-empty``)."""

PER_STAGE = {"generate-instances": 1, "train": 1, "validate (rollout)": 1, "evaluate": 1, "summarize-failures": 1,
             "engineer-config": 1, "check-data": 3, "check-data, empty file": 1}
"""How many processes of each kind one experiment stage before the last starts under the comparison preset (its
benchmark answers, checked by the fourth data check, are empty before the last stage; DVC's own processes not
counted)."""


def cpu_of(modules: str, env: dict[str, str]) -> float:
    """CPU seconds (user + system) of a fresh interpreter that imports ``modules``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", f"import {modules}"], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="imports of each kind, each way (median taken)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1")

    with_bytecode = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    with tempfile.TemporaryDirectory() as prefix:
        # Only the standard library's bytecode in the prefix: the installed packages have none there.
        stdlib = sysconfig.get_paths()["stdlib"]
        compiled = subprocess.run([sys.executable, "-c", f"import compileall; compileall.compile_dir({stdlib!r}, "
                                   "quiet=2, workers=0)"], env={**with_bytecode, "PYTHONPYCACHEPREFIX": prefix},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if compiled.returncode not in (0, 1):  # 1: some test files of the standard library do not compile
            sys.exit(f"compiling the standard library into {prefix} failed")
        without = {**with_bytecode, "PYTHONPYCACHEPREFIX": prefix, "PYTHONDONTWRITEBYTECODE": "1"}
        for modules in IMPORTS.values():  # bytecode for the packages in their own folders, where it is looked for
            cpu_of(modules, with_bytecode)
        rows = {}
        for name, modules in IMPORTS.items():
            a = statistics.median(cpu_of(modules, with_bytecode) for _ in range(args.repeats))
            b = statistics.median(cpu_of(modules, without) for _ in range(args.repeats))
            rows[name] = (a, b)
    print(f"{'process':<24} {'with (s)':>9} {'without (s)':>12} {'more (s)':>9} {'ratio':>6}")
    for name, (a, b) in rows.items():
        print(f"{name:<24} {a:9.2f} {b:12.2f} {b - a:9.2f} {b / a:6.2f}")
    a = sum(rows[n][0] * k for n, k in PER_STAGE.items())
    b = sum(rows[n][1] * k for n, k in PER_STAGE.items())
    print(f"one experiment stage's processes: {a:.1f} s with bytecode, {b:.1f} s without ({b - a:.1f} s more, "
          f"ratio {b / a:.2f}); DVC's own processes (an experiment's executor, the runner's polls) are the dvc row")


if __name__ == "__main__":
    main()
