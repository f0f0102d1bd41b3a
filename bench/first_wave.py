"""A study's first wave beside the queueing of its second, against one after the other, on a stand-in pipeline.

    python bench/first_wave.py --engineers fixed,heuristic,random,plr --seeds 0,1,2 --sleep 15 --repeats 2

The stand-in pipeline (``tests.experiments.test_compare.standin_repo``: the real stage names, commands that sleep
``--sleep`` seconds and write metrics) is compared with ``env-engineer compare --run --jobs E`` (E: every experiment
at once), in a fresh repository each time, two ways in turn: as the runner does it (each seed's shared stages as
``dvc exp run --temp`` while every experiment is queued: ``experiments.runner.run_wave_beside_queueing``), and with
the first wave run through DVC's queue and the second queued after it (the runner before it could do both at once).
Prints, for each run, the seconds until the second wave's queue starts and in all, then the medians and their
same-run ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from env_engineer.cli import main as cli  # noqa: E402
from experiments import runner  # noqa: E402
from tests.experiments.test_compare import standin_repo  # noqa: E402


def one_after_the_other(repo, wave, extra, following):
    """The first wave through DVC's queue, then the second queued once it is done."""
    states = runner.run_wave_in_queue(repo, len(wave), wave, extra)
    runner.wait_for_workers_to_leave(repo)
    for item in following:
        runner.queue_experiment(repo, item, extra)
    return states


def run_once(engineers: str, seeds: str, sleep_s: float, mode: str) -> tuple[float, float]:
    """One stand-in comparison; (seconds until the second wave's queue starts, seconds in all)."""
    repo = standin_repo(Path(tempfile.mkdtemp(prefix="first-wave-")) / "repo", sleep_s=sleep_s)
    jobs = len(engineers.split(",")) * len(seeds.split(","))
    marks: list[float] = []
    began = time.monotonic()

    class Watch(io.StringIO):
        def write(self, text: str) -> int:
            if f"{jobs} experiment(s) at once" in text:
                marks.append(time.monotonic() - began)
            return super().write(text)

    beside = runner.run_wave_beside_queueing
    if mode == "one after the other":
        runner.run_wave_beside_queueing = one_after_the_other
    try:
        with contextlib.redirect_stdout(Watch()):
            code = cli(["compare", "--repo", str(repo), "--engineers", engineers, "--seeds", seeds, "--run",
                        "--jobs", str(jobs), "--out-json", str(repo / "c.json"), "--out-md", str(repo / "c.md")])
    finally:
        runner.run_wave_beside_queueing = beside
    if code != 0 or not marks:
        raise SystemExit(f"{mode}: the comparison failed (exit {code})")
    return marks[-1], time.monotonic() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engineers", default="fixed,heuristic,random,plr", help="the arms (default %(default)s)")
    parser.add_argument("--seeds", default="0,1,2", help="the seeds (default %(default)s)")
    parser.add_argument("--sleep", type=float, default=15.0, help="seconds each stand-in stage sleeps (default 15)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each way, in turn (default %(default)s)")
    args = parser.parse_args()
    modes = ("beside", "one after the other")
    results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    for repeat in range(args.repeats):
        for mode in modes:
            queue_s, all_s = run_once(args.engineers, args.seeds, args.sleep, mode)
            results[mode].append((queue_s, all_s))
            print(f"run {repeat + 1}, {mode}: second wave queued and started after {queue_s:.1f} s; in all "
                  f"{all_s:.1f} s", flush=True)
    medians = {mode: (statistics.median(q for q, _ in runs), statistics.median(a for _, a in runs))
               for mode, runs in results.items()}
    for mode, (queue_s, all_s) in medians.items():
        print(f"median, {mode}: {queue_s:.1f} s to the second wave, {all_s:.1f} s in all")
    (bq, ba), (oq, oa) = medians["beside"], medians["one after the other"]
    print(f"beside / one after the other: {bq / oq:.2f} to the second wave, {ba / oa:.2f} in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
