"""Scaling on several GPUs of one host: the train step data-parallel through ``accelerate launch``, and vLLM with tensor
parallelism, each on 1 GPU and on N, in one run. A script, not a test.

    python bench/multigpu.py model --arch qwen3-4b --out /tmp/qwen3-4b-random
    python bench/multigpu.py train --model /tmp/qwen3-4b-random --instances data/start/instances.parquet --gpus 1,2
    python bench/multigpu.py vllm --model /tmp/qwen3-4b-random --tp 1,2
    (each with --json out.json; the rows of one file accumulate, a crash keeps what ran)

``model`` writes a model folder of a real architecture (``bench/gpu.py``'s ``ARCHS``: Qwen3-4B's shape) with random
bfloat16 weights and the embedded model's tokenizer (its ids fit the larger vocabulary), so the project's own steps can
load it as ``policy.model``: only speed is measured, never quality.

``train`` runs ``env-engineer train`` (warm start only: ``train.recipe=distill``) on the same demonstrations once per GPU
count, through ``accelerate launch --multi_gpu --num_processes N`` (plain ``python -m`` for 1), with the global batch
fixed (``--batch`` examples per optimizer step, ``--micro`` per process and pass): N processes take N times fewer
accumulation passes. It reads the step's own metrics: tokens seen (non-padding, every process) per second of training,
and seconds per optimizer step past the first two (the steady state). Scaling efficiency = tokens/s on N GPUs / (N x
tokens/s on 1).

``vllm`` builds one engine per tensor-parallel size in a process of its own (``tensor_parallel_size=N``, dummy weights
of the folder's shape, CUDA graphs), then times one ``generate`` of ``--batch`` random prompts of ``--prompt`` tokens,
``--new`` tokens each (nothing stops early), after one untimed call of the same size: completion tokens/s and the
ratio to 1 GPU.

NCCL's NVLink multicast stays as the machine sets it (``NCCL_NVLS_ENABLE``); this script never sets it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from envgen.core.files import atomic_write_text  # noqa: E402


def parse_counts(text: str, what: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; a clear error for anything else."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} {text!r}: give GPU counts separated by commas, e.g. 1,2") from None
    if not counts or any(c < 1 for c in counts):
        raise ValueError(f"{what} {text!r}: give GPU counts of at least 1, e.g. 1,2")
    return counts


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def record(path: Path | None, row: dict[str, Any]) -> None:
    """Append ``row`` to the JSON report at ``path`` (rows accumulate across commands and crashes)."""
    print(json.dumps(row), flush=True)
    if path is None:
        return
    report = json.loads(path.read_text()) if path.exists() else {"environment": environment(), "rows": []}
    report["rows"].append(row)
    atomic_write_text(path, json.dumps(report, indent=2))


def environment() -> dict[str, Any]:
    """``bench/gpu.py``'s machine description, plus the GPU count, NCCL's multicast setting and the libraries here."""
    from bench.gpu import environment as machine

    gpus = visible_gpus()
    info = {**machine("cuda" if gpus else "cpu"), "gpus": gpus, "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
    for name in ("accelerate", "trl", "peft", "vllm"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    return info


# --- model ------------------------------------------------------------------------------------------------------

def make_model(arch: str, out: Path) -> Path:
    """A model folder of ``arch``'s shape with random bfloat16 weights and the embedded model's tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.gpu import ARCHS
    from policy.models import load_tokenizer

    if arch not in ARCHS:
        raise ValueError(f"--arch {arch!r}: one of {sorted(ARCHS)}")
    spec = dict(ARCHS[arch])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    tokenizer = load_tokenizer("embedded")
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"--arch {arch}: its vocabulary ({config.vocab_size}) is smaller than the embedded tokenizer's")
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (tokenizer.bos_token_id, tokenizer.eos_token_id,
                                                                     tokenizer.pad_token_id)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "RANDOM_WEIGHTS.txt").write_text(f"{arch}'s shape with random weights (bench/multigpu.py): speed only.\n")
    return out


# --- train ------------------------------------------------------------------------------------------------------

def train_command(gpus: int, model: str, instances: Path, work: Path, params: Path, examples: int, batch: int,
                  micro: int, extra: list[str]) -> list[str]:
    """The train step on ``gpus`` processes (``accelerate launch`` for more than one), warm start only."""
    if gpus == 1:
        launcher = [sys.executable, "-m"]
    else:
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(gpus),
                    "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m"]
    sets = {"policy.model": model, "train.init": "fresh", "train.recipe": "distill", "train.sft_max_examples": examples,
            "train.sft_batch_size": batch, "train.sft_micro_batch_size": micro, "train.sft_epochs": 1.0}
    out = work / f"gpus{gpus}"
    return [*launcher, "env_engineer", "train", "--params", str(params), "--no-progress", "--instances", str(instances),
            "--out-adapter", str(out / "adapter"), "--out-completions", str(out / "completions.parquet"),
            "--out-metrics", str(out / "metrics.json"), "--out-details", str(out / "details.json"),
            *[x for k, v in sets.items() for x in ("--set", f"{k}={v}")], *[x for s in extra for x in ("--set", s)]]


def train_row(gpus: int, details: dict[str, Any], wall: float) -> dict[str, Any]:
    steps = details.get("sft/step_seconds") or []
    steady = steps[2:] or steps
    tokens, seconds = details["sft/tokens"], details["sft/seconds"]
    per_step = tokens / max(1, details["sft/steps"])
    return {"part": "train", "gpus": gpus, "processes": details.get("processes"), "model": details.get("model"),
            "examples": details.get("sft/examples"), "steps": details.get("sft/steps"), "tokens": tokens,
            "train_seconds": round(seconds, 2), "wall_seconds": round(wall, 1),
            "tok_per_s": round(tokens / seconds, 1),
            "step_s_median": round(statistics.median(steady), 4) if steady else None,
            "steady_tok_per_s": round(per_step / statistics.mean(steady), 1) if steady else None}


def bench_train(args: argparse.Namespace) -> list[dict[str, Any]]:
    counts = parse_counts(args.gpus, "--gpus")
    have = visible_gpus()
    if have and max(counts) > have:
        raise ValueError(f"--gpus {args.gpus}: only {have} GPU(s) visible")
    work = Path(args.work or tempfile.mkdtemp(prefix="multigpu-train-"))
    rows = []
    for gpus in counts:
        cmd = train_command(gpus, args.model, args.instances, work, args.params, args.examples, args.batch, args.micro,
                            args.set)
        print(f"$ {' '.join(cmd)}", flush=True)
        start = time.perf_counter()
        visible = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(have or gpus)))).split(",")
                   if g.strip()]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(visible[:gpus])}  # one process never sees two GPUs
        proc = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, env=env)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr)[-4000:]
            record(args.json, {"part": "train", "gpus": gpus, "error": tail})
            continue
        details = json.loads((work / f"gpus{gpus}" / "details.json").read_text())
        rows.append(train_row(gpus, details, wall))
        record(args.json, rows[-1])
    return rows


# --- vllm -------------------------------------------------------------------------------------------------------

def vllm_once(model: str, tp: int, batch: int, prompt: int, new: int, memory: float) -> dict[str, Any]:
    """One engine of tensor-parallel size ``tp`` in this process: one untimed then one timed generate."""
    import random

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    engine = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                 tensor_parallel_size=tp, max_model_len=prompt + new + 16, max_num_seqs=batch,
                 max_num_batched_tokens=max(8192, (prompt + new) * 8), gpu_memory_utilization=memory, seed=0)
    started = time.perf_counter() - start
    rng = random.Random(batch)
    vocab = engine.llm_engine.model_config.get_vocab_size()
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(1, vocab) for _ in range(prompt)]) for _ in range(batch)]
    params = SamplingParams(n=1, temperature=1.0, max_tokens=new, min_tokens=new, ignore_eos=True, seed=0,
                            detokenize=False)

    def run() -> int:
        return sum(len(o.outputs[0].token_ids) for o in engine.generate(prompts, params, use_tqdm=False))

    run()
    t = time.perf_counter()
    tokens = run()
    seconds = time.perf_counter() - t
    return {"part": "vllm", "tp": tp, "batch": batch, "prompt_len": prompt, "new_tokens": new, "engine_start_s":
            round(started, 1), "seconds": round(seconds, 3), "tokens": tokens, "tok_per_s": round(tokens / seconds, 1)}


def bench_vllm(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for tp in parse_counts(args.tp, "--tp"):
        cmd = [sys.executable, str(Path(__file__).resolve()), "vllm-one", "--model", args.model, "--tp", str(tp),
               "--batch", str(args.batch), "--prompt", str(args.prompt), "--new", str(args.new),
               "--memory", str(args.memory)]
        print(f"$ {' '.join(cmd)}", flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True)
        line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith('{"part": "vllm"')), None)
        if proc.returncode != 0 or line is None:
            record(args.json, {"part": "vllm", "tp": tp, "error": (proc.stdout + proc.stderr)[-4000:]})
            continue
        rows.append(json.loads(line))
        record(args.json, rows[-1])
    return rows


# --- report -----------------------------------------------------------------------------------------------------

def scaling(rows: list[dict[str, Any]], key: str, count: str) -> list[dict[str, Any]]:
    """Each row with ``speedup`` (value / the 1-GPU row's) and ``efficiency`` (speedup / GPU count)."""
    base = next((r[key] for r in rows if r.get(count) == 1 and r.get(key)), None)
    out = []
    for r in rows:
        if base and r.get(key):
            speedup = r[key] / base
            r = {**r, "speedup": round(speedup, 3), "efficiency": round(speedup / r[count], 3)}
        out.append(r)
    return out


def table(rows: list[dict[str, Any]], key: str, count: str) -> str:
    lines = [f"| {count} | {key} | speedup | efficiency |", "|---|---|---|---|"]
    for r in scaling(rows, key, count):
        lines.append(f"| {r[count]} | {r.get(key)} | {r.get('speedup', '-')} | {r.get('efficiency', '-')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("model", help="write a random-weight model folder of a real shape")
    m.add_argument("--arch", default="qwen3-4b")
    m.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("train", help="the train step's warm start on 1 and N GPUs (accelerate launch)")
    t.add_argument("--model", required=True, help="model folder (e.g. from `model`) or any policy.model")
    t.add_argument("--instances", type=Path, required=True, help="instances Parquet whose demonstrations are trained on")
    t.add_argument("--gpus", default="1,2", help="GPU counts, comma-separated (default 1,2)")
    t.add_argument("--examples", type=int, default=2048, help="demonstrations per run (default 2048)")
    t.add_argument("--batch", type=int, default=64, help="examples per optimizer step, global (default 64)")
    t.add_argument("--micro", type=int, default=16, help="examples per process and pass (default 16)")
    t.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    t.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="more train overrides")
    t.add_argument("--work", type=Path, default=None, help="folder for the runs' outputs (default: a temporary one)")
    v = sub.add_parser("vllm", help="vLLM generation with tensor parallelism 1 and N")
    one = sub.add_parser("vllm-one", help=argparse.SUPPRESS)
    for p in (v, one):
        p.add_argument("--model", required=True, help="model folder (its config gives the shape; weights are dummy)")
        p.add_argument("--batch", type=int, default=512)
        p.add_argument("--prompt", type=int, default=256)
        p.add_argument("--new", type=int, default=256)
        p.add_argument("--memory", type=float, default=0.85, help="vLLM gpu_memory_utilization")
    v.add_argument("--tp", default="1,2", help="tensor-parallel sizes, comma-separated (default 1,2)")
    one.add_argument("--tp", type=int, required=True)
    for p in (m, t, v):
        p.add_argument("--json", type=Path, default=None, help="JSON report to add the rows to")
    args = parser.parse_args(argv)
    try:
        if args.command == "model":
            print(make_model(args.arch, args.out))
        elif args.command == "train":
            print(table(bench_train(args), "tok_per_s", "gpus"))
        elif args.command == "vllm":
            print(table(bench_vllm(args), "tok_per_s", "tp"))
        else:
            print(json.dumps(vllm_once(args.model, args.tp, args.batch, args.prompt, args.new, args.memory)), flush=True)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
