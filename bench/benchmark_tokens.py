"""What scoring a preset's whole benchmark asks of the generation server: per agent count, the boards, the tokens of
their prompts, of their solver-optimal answers and of their answers' budgets, and the same for a study's experiments.

    python bench/benchmark_tokens.py --params presets/gpu-distill.yaml --experiments 24 [--set benchmark.per_cell=15]

Builds the preset's benchmark (``env-engineer build-benchmark``'s function, timed) in a temporary folder, then counts
with the policy's tokenizer: each prompt as the chat template writes it, each optimal plan written as the answer
(``steps.rollout.optimal_answer_tokens``) and its budget (``rollout.budget_margin``; ``steps.rollout.token_budget``).
The budgets bound what greedy answers can generate; the optimal answers are what a near-perfect policy writes. On the
CPU; nothing is generated. A script, not a test.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=Path, default=Path("presets/gpu-distill.yaml"))
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a setting")
    parser.add_argument("--experiments", type=int, default=24, help="experiments that each score the whole benchmark")
    parser.add_argument("--workers", type=int, default=2, help="processes that build the benchmark")
    args = parser.parse_args()

    import pyarrow.parquet as pq

    from envgen.formats.dataset import parse_instances
    from envgen.llm.prompt import build_messages
    from pipeline.params import load_params
    from policy.models import answer_token_counter, load_tokenizer
    from steps.build_benchmark import build_benchmark
    from steps.rollout import optimal_answer_tokens, token_budget

    params = load_params(args.params, args.set)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "benchmark.parquet"
        start = time.perf_counter()
        build_benchmark(params.benchmark, out, progress=False, workers=args.workers)
        built_s = time.perf_counter() - start
        rows = pq.read_table(out).to_pylist()
    instances = parse_instances([r["instance"] for r in rows], out)
    tokenizer = load_tokenizer(params.policy.model)  # its chat template writes the prompts
    count = answer_token_counter(params.policy.model)  # as the rollout step counts an answer
    style = params.policy.prompt
    optimal = optimal_answer_tokens(rows, instances, style, count, out)
    table: dict[int, list[int]] = {}
    for row, instance, answer in zip(rows, instances, optimal):
        prompt = count(tokenizer.apply_chat_template(build_messages(instance, style), add_generation_prompt=True,
                                                     tokenize=False))
        cells = table.setdefault(row["num_agents"], [0, 0, 0, 0])
        for k, value in enumerate((1, prompt, answer, token_budget(answer, params.rollout.budget_margin))):
            cells[k] += value
    table_all = [sum(cells[k] for cells in table.values()) for k in range(4)]
    print(f"benchmark of {args.params} ({', '.join(args.set) or 'as written'}): {len(rows)} boards built in "
          f"{built_s:.1f} s with {args.workers} worker(s)")
    print("| agents | boards | prompt tokens | optimal answer tokens | answer budget tokens |")
    print("|---|---|---|---|---|")
    for agents, cells in [*sorted(table.items()), ("all", table_all),
                          (f"x {args.experiments} experiments", [v * args.experiments for v in table_all])]:
        print(f"| {agents} | " + " | ".join(f"{v:,}" for v in cells) + " |")


if __name__ == "__main__":
    main()
