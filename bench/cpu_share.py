"""Several torch processes at once on one machine: with the libraries' default threads, and with each process's share
of the cores (``pipeline.workers.cpu_share``, what ``env-engineer compare --run`` and ``env-engineer workers`` give the
experiments they run at once).

    python bench/cpu_share.py --processes 4 --steps 40 --repeats 3

Each process trains a small MLP on the CPU for ``--steps`` steps (a stand-in for a stage process's CPU work: the
tensor work between GPU kernels, data preparation, checks). Prints the wall time until every process has ended, for
both settings, run after each other ``--repeats`` times, and the same-run ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.workers import CPU_THREAD_VARIABLES, cpu_share  # noqa: E402

WORK = """
import sys, torch
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU()) for _ in range(4)])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(256, 512)
for _ in range(int(sys.argv[1])):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print(torch.get_num_threads())
"""


def run_all(processes: int, steps: int, env: dict[str, str]) -> tuple[float, int]:
    """Wall seconds until ``processes`` copies of the work, started together, have all ended; their torch threads."""
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", WORK, str(steps)], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(processes)]
    threads = [int(p.communicate()[0].strip()) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("a worker process failed")
    return time.perf_counter() - start, threads[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2 * (os.cpu_count() or 1),
                        help="processes at once (default: twice the cores)")
    parser.add_argument("--steps", type=int, default=40, help="training steps per process (default 40)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each setting, alternating (default 3)")
    parser.add_argument("--out", type=Path, default=None, help="also write the numbers here as JSON")
    args = parser.parse_args()
    default = {k: v for k, v in os.environ.items() if k not in CPU_THREAD_VARIABLES}
    shared = {**default, **cpu_share(args.processes)}
    times: dict[str, list[float]] = {"default": [], "share": []}
    threads = {}
    for _ in range(args.repeats):
        for name, env in (("default", default), ("share", shared)):
            seconds, threads[name] = run_all(args.processes, args.steps, env)
            times[name].append(seconds)
    result = {"processes": args.processes, "cores": os.cpu_count(), "steps": args.steps, "threads": threads,
              "seconds": times, "median_ratio_default_over_share":
              statistics.median(times["default"]) / statistics.median(times["share"])}
    for name in times:
        print(f"{name:8s} {threads[name]} torch thread(s) per process: "
              + " ".join(f"{t:.1f}" for t in times[name]) + " s")
    print(f"default / share (medians): {result['median_ratio_default_over_share']:.2f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
