"""Rollout throughput of the project's generation path on this machine. A script, not a test.

    python bench/rollout.py [--model embedded] [--instances 32] [--batch-sizes 1,8,16] [--samples 1] [--threads 2]

For each batch size: completion tokens/s and prompts/s of ``TransformersBackend.generate`` on two-agent prompts
(sizes 3..10), sampling at temperature 1 with ``max_new_tokens`` 64. Prints a table and, with ``--json``, writes it.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envgen.core.config import uniform_config  # noqa: E402
from envgen.generator import generate  # noqa: E402
from envgen.llm.prompt import PromptStyle, build_messages  # noqa: E402
from policy.backends import SamplingParams, TransformersBackend  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--instances", type=int, default=32)
    parser.add_argument("--batch-sizes", default="1,8,16")
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--moves", default="words", choices=["words", "letters"])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    instances = [g.instance for g in generate(uniform_config(budget=args.instances, seed=11))]
    convs = [build_messages(i, PromptStyle(moves=args.moves)) for i in instances]
    backend = TransformersBackend(args.model, batch_size=1, threads=args.threads)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0)
    backend.generate(convs[:2], 1, params)  # warm-up
    rows = []
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        backend.batch_size = bs
        start = time.perf_counter()
        out = backend.generate(convs, args.samples, params)
        seconds = time.perf_counter() - start
        completion = sum(g.completion_tokens for gens in out for g in gens)
        prompt = sum(gens[0].prompt_tokens for gens in out)
        rows.append({"batch_size": bs, "seconds": seconds, "completion_tokens": completion, "prompt_tokens": prompt,
                     "completion_tok_per_s": completion / seconds, "answers_per_s": len(convs) * args.samples / seconds})
    machine = f"{platform.machine()}, torch threads {args.threads}, device {backend.loaded.device}"
    print(f"model {backend.model_id} on {machine}; {len(convs)} prompts x {args.samples} samples, max_new_tokens {args.max_new_tokens}")
    print(f"{'batch':>5} {'seconds':>8} {'prompt tok':>10} {'compl tok':>9} {'compl tok/s':>11} {'answers/s':>9}")
    for r in rows:
        print(f"{r['batch_size']:>5} {r['seconds']:>8.1f} {r['prompt_tokens']:>10} {r['completion_tokens']:>9} "
              f"{r['completion_tok_per_s']:>11.1f} {r['answers_per_s']:>9.2f}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "model": backend.model_id, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
