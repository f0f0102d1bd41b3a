"""A comparison's stage trainings at once, two ways: each stage in a training process of its own, through the GPU slots
(``ENV_ENGINEER_GPU_SLOTS``: a study without ``--warm-trainers``), and every stage handed by its ``train`` step to N
warm trainers (``env-engineer train-server``: a study with ``--warm-trainers N``).

    python bench/warm_trainers.py --params presets/gpu-distill.yaml --stages 24 --slots 10 --workers 8 --out x.json

Draws ``--stages`` stages' instances once (each its own seed of the preset's round-0 environment; every ``--wide``-th
stage 9x9 and 10x10 boards instead, the widest an engineer may choose), then trains them all at once, each from a fresh
adapter, in four waves: processes; warm trainers just started (their first stages compile); the same warm trainers
again (as at every later stage of a study); processes again (torch's compilation cache now warm, as after a study's
first wave). Each wave's wall time runs from the moment its ``env-engineer train`` commands start to the last one's
end (the warm trainers' own start is timed apart: a study pays it once, beside its first stages). Prints every wave's
seconds, each stage's training and supervised-pass seconds and GPU memory, where the pass's time went (before its
first optimizer step, that step, the others; its batch shapes), and the same-run ratio of the later waves.

``--stagger S`` adds a wave of the warm trainers after their second whose stages are handed over S seconds apart, as
a study's stages arrive, instead of all at once (all at once, the trainings run in step). ``--busy N`` adds two waves
of the warm trainers after that: beside N processes that each keep a core busy (a study's experiments run their other
steps on the same cores while the trainers train), first at the trainers' priority, then at ``--busy-nice``.
``--no-processes`` leaves out the two waves of a process per stage.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.params import ParamsError, load_params  # noqa: E402
from pipeline.workers import cpu_share  # noqa: E402

CLI = [sys.executable, "-m", "env_engineer"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def draw_stages(params: dict, count: int, wide: int, folder: Path) -> list[Path]:
    """``count`` instance files: the round-0 environment under seeds 1..count, every ``wide``-th on 9x9 and 10x10."""
    procs, files = [], []
    for k in range(count):
        env = json.loads(json.dumps(params["env"]))
        env["seed"] = 1 + k
        if wide and k % wide == wide - 1:
            for size, cfg in env["sizes"].items():
                cfg["data_ratio"] = 0.5 if int(size) >= 9 else 0.0
        config, out = folder / f"config-{k}.yaml", folder / f"instances-{k}.parquet"
        config.write_text(yaml.safe_dump(env))
        procs.append(subprocess.Popen([*CLI, "generate-instances", "--config", str(config), "--out", str(out)],
                                      stdout=subprocess.DEVNULL))
        files.append(out)
    if any(p.wait() for p in procs):
        raise SystemExit("drawing a stage's instances failed")
    return files


BUSY_SECONDS = 900
"""How long a busy process of ``--busy`` spins at most, should the bench be killed before it stops them."""


def busy_processes(count: int, niceness: int) -> list[subprocess.Popen]:
    """``count`` processes that each keep a core busy for at most :data:`BUSY_SECONDS`, at ``niceness``."""
    code = ("import os, sys, time\nos.nice(int(sys.argv[1]))\nend = time.monotonic() + float(sys.argv[2])\n"
            "while time.monotonic() < end:\n    pass\n")
    return [subprocess.Popen([sys.executable, "-c", code, str(niceness), str(BUSY_SECONDS)]) for _ in range(count)]


def wave(name: str, params: Path, files: list[Path], folder: Path, env: dict[str, str],
         server: str | None, apart: float = 0.0) -> dict:
    """Train every stage at once (``env-engineer train`` each, to the server when given), or started ``apart``
    seconds one after the other; wall time and metrics."""
    out = folder / name
    shutil.rmtree(out, ignore_errors=True)
    sets = ["--set", f"train.server={server}"] if server else []
    start = time.perf_counter()
    procs = []
    for k, f in enumerate(files):
        if k and apart:
            time.sleep(apart)
        procs.append(subprocess.Popen([*CLI, "train", "--params", str(params), "--instances", str(f),
                                       "--out-adapter", str(out / str(k) / "adapter"),
                                       "--out-completions", str(out / str(k) / "c.parquet"),
                                       "--out-metrics", str(out / str(k) / "m.json"),
                                       "--out-details", str(out / str(k) / "details.json"), "--no-progress", *sets],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    errors = [p.communicate()[1] for p in procs]
    wall = time.perf_counter() - start
    failed = [k for k, p in enumerate(procs) if p.returncode]
    stages = [json.loads((out / str(k) / "details.json").read_text()) for k in range(len(files)) if k not in failed]
    steps = [m["sft/step_seconds"] for m in stages]  # every optimizer step's seconds (the warm start's clock)
    row = {"wave": name, "wall_s": round(wall, 1), "stages": len(stages), "failed": failed,
           "errors": [errors[k][-400:] for k in failed][:3],
           "train_s": [round(m["seconds"], 1) for m in stages],
           "sft_s": [round(m["sft/seconds"], 1) for m in stages],
           "peak_reserved_gib": [round(m.get("gpu/peak_reserved_gib", 0.0), 2) for m in stages],
           "loss_last": [round(m["sft/loss_last"], 4) for m in stages],
           # where a supervised pass's time goes: before its first optimizer step, in that step, in the others
           "before_steps_s": [round(m["sft/seconds"] - sum(t), 1) for m, t in zip(stages, steps)],
           "first_step_s": [round(t[0], 2) for t in steps],
           "later_steps_s": [round(sum(t[1:]), 1) for t in steps],
           "median_step_s": [round(statistics.median(t), 3) for t in steps],
           "shapes": [len(m.get("sft/batch_shapes") or {}) for m in stages]}
    print(f"{name}: {wall:.1f} s for {len(files)} stages ({len(failed)} failed); training per stage median "
          f"{statistics.median(row['train_s'] or [0]):.1f} s (supervised pass "
          f"{statistics.median(row['sft_s'] or [0]):.1f} s), peak reserved up to "
          f"{max(row['peak_reserved_gib'] or [0]):.2f} GiB", flush=True)
    if stages:
        print("  of the pass (medians): " + ", ".join(
            f"{label} {statistics.median(row[key]):g}" for label, key in
            (("before the first step s", "before_steps_s"), ("first step s", "first_step_s"),
             ("later steps s", "later_steps_s"), ("a step s", "median_step_s"), ("shapes", "shapes"))), flush=True)
    if failed:
        print(f"  stage {failed[0]} failed: {errors[failed[0]].strip()[-400:]}", flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=Path, default=Path("presets/gpu-distill.yaml"))
    parser.add_argument("--stages", type=int, default=24, help="stages trained at once (default 24: a comparison's)")
    parser.add_argument("--wide", type=int, default=4, help="every k-th stage on 9x9-10x10 boards (0: none; default 4)")
    parser.add_argument("--slots", type=int, default=10, help="training processes at once on the GPU (default 10)")
    parser.add_argument("--workers", type=int, default=8, help="warm trainers (default 8)")
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="two more warm waves beside N processes each keeping a core busy (default 0: none)")
    parser.add_argument("--busy-nice", type=int, default=10,
                        help="the niceness of the busy processes in the second of those waves (default 10)")
    parser.add_argument("--stagger", type=float, default=0.0, metavar="S",
                        help="one more warm wave after the second, its stages handed over S seconds apart, as a "
                        "study's arrive (default 0: none)")
    parser.add_argument("--no-processes", action="store_true",
                        help="leave out the waves of a process per stage (and so the ratio)")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/warm-trainers-bench"))
    parser.add_argument("--out", type=Path, default=None, help="also write the numbers here as JSON")
    args = parser.parse_args()
    if not 0 <= args.busy <= 256 or not 0 <= args.busy_nice <= 19:
        raise SystemExit(f"error: --busy {args.busy} / --busy-nice {args.busy_nice}: give 0 to 256 processes and a "
                         "niceness of 0 to 19")
    if not 0 <= args.stagger <= 600:
        raise SystemExit(f"error: --stagger {args.stagger}: give 0 to 600 seconds")

    args.folder.mkdir(parents=True, exist_ok=True)
    params = yaml.safe_load(args.params.read_text())
    params["train"]["init"] = "fresh"
    params_file = args.folder / "params.yaml"
    params_file.write_text(yaml.safe_dump(params, sort_keys=False))
    try:  # a wrong setting fails here, not in every stage of every wave
        load_params(params_file)
    except ParamsError as e:
        raise SystemExit(f"error: {e}") from None
    began = time.perf_counter()
    files = draw_stages(params, args.stages, args.wide, args.folder)
    print(f"drew {len(files)} stages in {time.perf_counter() - began:.1f} s", flush=True)
    base = {**os.environ, "ENV_ENGINEER_GPUS": os.environ.get("ENV_ENGINEER_GPUS", "0")}
    processes_env = {**base, "ENV_ENGINEER_GPU_SLOTS": str(args.slots), **cpu_share(args.stages)}
    clients_env = {**base, **cpu_share(args.stages)}
    rows = [] if args.no_processes else [wave("processes", params_file, files, args.folder, processes_env, None)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(args.folder / "train-server.log", "w")
    server = subprocess.Popen([*CLI, "train-server", "--root", str(args.folder.resolve()), "--workers",
                               str(args.workers), "--port", str(port)], env=base, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    started = time.perf_counter()
    try:
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5):
                    break
            except OSError:
                if server.poll() is not None or time.perf_counter() - started > 300:
                    raise SystemExit(f"the warm trainers did not come up; see {log.name}")
                time.sleep(0.5)
        up = time.perf_counter() - started
        print(f"warm trainers answering after {up:.1f} s", flush=True)
        rows.append(wave("warm, first", params_file, files, args.folder, clients_env, url))
        again = wave("warm, again", params_file, files, args.folder, clients_env, url)
        rows.append(again)
        if args.stagger:
            rows.append(wave(f"warm, again, handed over {args.stagger:g} s apart", params_file, files, args.folder,
                             clients_env, url, args.stagger))
        for niceness in ((0, args.busy_nice) if args.busy else ()):
            busy = busy_processes(args.busy, niceness)
            try:
                rows.append(wave(f"warm, again, beside {args.busy} busy processes at nice {niceness}", params_file,
                                 files, args.folder, clients_env, url))
            finally:
                for proc in busy:
                    proc.kill()
                    proc.wait()
            if rows[-1]["failed"] or again["failed"]:
                print("no ratio: a stage of the warm waves failed", flush=True)
            else:
                print(f"same run: beside {args.busy} busy processes at nice {niceness} / alone = "
                      f"{rows[-1]['wall_s'] / again['wall_s']:.2f}", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    ratio = None
    if not args.no_processes:
        rows.append(wave("processes, again", params_file, files, args.folder, processes_env, None))
        if again["failed"] or rows[-1]["failed"]:  # a wave whose stages failed ended early: its wall time says nothing
            print("no ratio: a stage of the compared waves failed", flush=True)
        else:
            ratio = rows[-1]["wall_s"] / again["wall_s"]
            print(f"same run: processes (compilation cache warm) / warm trainers (again) = {ratio:.2f}", flush=True)
    result = {"stages": args.stages, "wide_every": args.wide, "slots": args.slots, "workers": args.workers,
              "busy": args.busy, "busy_nice": args.busy_nice, "warm_trainers_up_s": round(up, 1), "waves": rows,
              "ratio_processes_to_warm": None if ratio is None else round(ratio, 2)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    failed = sum(len(row["failed"]) for row in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
