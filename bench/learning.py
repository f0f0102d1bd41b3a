"""Proof of learning: warm start + GRPO with the project's train step, evaluated before and after on held-out sets.

    python bench/learning.py --train TRAIN.parquet --eval small=A.parquet --eval large=B.parquet --out-dir OUT \
        [--params params.yaml] [--set train.sft_epochs=2 --set train.trajectories=8192 ...]

Stages: (1) the warm start alone (the train step with ``train.recipe=distill``), evaluated; (2) GRPO from that adapter
(``train.recipe=grpo``), evaluated. Settings: the ``policy`` and ``train`` sections of ``--params`` (with ``--settings
start``: ``start.train`` and ``start.model``, the starting policy's), with ``--set``. Evaluation is greedy decoding of every held-out instance with the adapter merged,
scored by the simulator; beside it the independent-shortest-path planner and the optimum on the same instances.
Writes ``OUT/results.json`` (``results-grpo.json`` or ``results-sft.json`` when a stage is skipped), each stage's
details (``details-sft.json``, ``details-grpo.json``: seconds per step and, for GRPO, per phase) and histories, and
prints a table. A script, not a test: real runs belong on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envgen.formats.dataset import read_instances  # noqa: E402
from envgen.core.instance import Instance  # noqa: E402
from envgen.solver.planners import independent_plan  # noqa: E402
from envgen.llm.rates import OUTCOMES, rates, rates_by  # noqa: E402
from envgen.core.simulate import Valid, check_plan  # noqa: E402
from envgen.solver.planners import Planned  # noqa: E402
from policy.attention import DECODE_KERNELS, set_decode_kernel  # noqa: E402
from pipeline.params import PolicySettings, RolloutSettings, load_params  # noqa: E402
from steps.rollout import rollout  # noqa: E402
from steps.train import train  # noqa: E402


def planner_rates(path: Path) -> dict[str, dict[str, float]]:
    """Valid and optimal rates of the independent planner, per group ('all', sizes)."""
    rows = []
    for row in read_instances(path).to_pylist():
        inst = Instance.from_str(row["instance"])
        plan = independent_plan(inst)
        result = check_plan(inst, plan.moves, row["optimal_soc"]) if isinstance(plan, Planned) else None
        ok = isinstance(result, Valid)
        rows.append({"size": row["size"], "valid": ok, "optimal": ok and bool(result.optimal)})
    return by_size(rows, ("valid", "optimal"))


def model_rates(traj: Path) -> dict[str, dict[str, float]]:
    """Parsed, valid and optimal rates of a trajectories file, per group ('all', sizes)."""
    import pyarrow.parquet as pq

    return by_size(pq.read_table(traj).to_pylist())


def by_size(rows: list[dict], outcomes: tuple[str, ...] = OUTCOMES) -> dict[str, dict[str, float]]:
    return {"all": rates(rows, outcomes), **{f"size{k}": v for k, v in rates_by(rows, "size", outcomes).items()}}


def evaluate(tag: str, policy: PolicySettings, adapter: Path | None, evals: dict[str, Path], out: Path,
             max_new_tokens: int, batch_size: int, cache: str) -> dict:
    results = {}
    settings = RolloutSettings(samples=1, temperature=0, max_new_tokens=max_new_tokens, batch_size=batch_size, cache=cache)
    for name, path in evals.items():
        start = time.perf_counter()
        traj = out / f"eval-{tag}-{name}.parquet"
        rollout(path, traj, policy, settings, adapter=str(adapter) if adapter else None, progress=False)
        results[name] = {"rates": model_rates(traj), "seconds": time.perf_counter() - start}
        print(f"[{tag}] {name}: valid {results[name]['rates']['all']['valid']:.3f} optimal "
              f"{results[name]['rates']['all']['optimal']:.3f} parsed {results[name]['rates']['all']['parsed']:.3f} "
              f"({results[name]['seconds']:.0f} s)", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", required=True, type=Path)
    parser.add_argument("--eval", action="append", default=[], metavar="NAME=PARQUET")
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument("--params", type=Path, default=Path("params.yaml"), help="params file: its policy and train sections")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="parameter override")
    parser.add_argument("--settings", choices=("train", "start"), default="train",
                        help="whose settings: the curriculum's (the train section and policy.model, default) or the "
                        "shared starting policy's (start.train and start.model; override them as start.train.KEY=VALUE)")
    parser.add_argument("--eval-max-new-tokens", type=int, default=320)
    parser.add_argument("--eval-batch-size", type=int, default=256)
    parser.add_argument("--skip-grpo", action="store_true", help="warm start only")
    parser.add_argument("--skip-sft", action="store_true", help="GRPO only, from --init-adapter (or a fresh adapter)")
    parser.add_argument("--init-adapter", type=Path, default=None, help="adapter GRPO starts from when --skip-sft")
    parser.add_argument("--eval-cache", default="dynamic", choices=["auto", "static", "dynamic"],
                        help="KV cache of the evaluation rollouts (default dynamic, as in the recorded runs)")
    parser.add_argument("--eval-base", action="store_true", help="also evaluate the model without adapter")
    parser.add_argument("--decode-kernel", default="auto", choices=DECODE_KERNELS,
                        help="attention kernel of the static cache's grouped decode step (GRPO's sampling and the "
                        "evaluations): policy.attention.set_decode_kernel")
    args = parser.parse_args()
    set_decode_kernel(args.decode_kernel)
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    evals = dict(item.split("=", 1) for item in args.eval)
    evals = {k: Path(v) for k, v in evals.items()}
    params = load_params(args.params, args.set)
    cfg, policy = params.training(args.settings)
    report: dict = {"config": {"train": cfg.model_dump(mode="json"), "policy": policy.model_dump(mode="json")},
                    "planner": {n: planner_rates(p) for n, p in evals.items()}}
    for name, rate in report["planner"].items():
        print(f"[independent planner] {name}: valid {rate['all']['valid']:.3f} optimal {rate['all']['optimal']:.3f}", flush=True)
    if args.eval_base:
        report["base"] = evaluate("base", policy, None, evals, out, args.eval_max_new_tokens, args.eval_batch_size,
                                  args.eval_cache)
    start_adapter = args.init_adapter
    if not args.skip_sft:
        sft_cfg = cfg.model_copy(update={"recipe": "distill"})
        report["sft_metrics"] = train(args.train, out / "adapter-sft", out / "completions-sft.parquet", out / "metrics-sft.json",
                                      sft_cfg, policy, out_details=out / "details-sft.json",
                                      out_sft_history=out / "history-sft.json")
        report["sft"] = evaluate("sft", policy, out / "adapter-sft", evals, out, args.eval_max_new_tokens, args.eval_batch_size,
                                 args.eval_cache)
        (out / "results.json").write_text(json.dumps(report, indent=2, default=str))
        start_adapter = out / "adapter-sft"
    if not args.skip_grpo:
        grpo_cfg = cfg.model_copy(update={"recipe": "grpo"})
        report["grpo_metrics"] = train(args.train, out / "adapter-grpo", out / "completions-grpo.parquet", out / "metrics-grpo.json",
                                       grpo_cfg, policy, init_adapter=start_adapter, out_details=out / "details-grpo.json",
                                       out_grpo_history=out / "history-grpo.json")
        report["grpo"] = evaluate("grpo", policy, out / "adapter-grpo", evals, out, args.eval_max_new_tokens, args.eval_batch_size,
                                  args.eval_cache)
    name = "results.json" if not (args.skip_sft or args.skip_grpo) else f"results-{'grpo' if args.skip_sft else 'sft'}.json"
    (out / name).write_text(json.dumps(report, indent=2, default=str))
    print(f"\n{'set':<10} {'group':<8} {'planner':>8} " + " ".join(f"{t:>8}" for t in ("base", "sft", "grpo") if t in report))
    for name in evals:
        for group in sorted(report["planner"][name], key=lambda g: (g != "all", len(g), g)):
            cells = [f"{report[t][name]['rates'].get(group, {}).get('valid', float('nan')):>8.3f}" for t in ("base", "sft", "grpo") if t in report]
            print(f"{name:<10} {group:<8} {report['planner'][name][group]['valid']:>8.3f} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
