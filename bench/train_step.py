"""The train step (``steps.train.train``: TRL SFT warm start, then TRL GRPO) on a randomly initialised model of a real
shape, once per variant: seconds of each phase. A script, not a test.

    python bench/train_step.py --arch smollm2-135m --tokenizer TOK_DIR --instances stage.parquet [--json out.json]

``bench/gpu.py`` measures the training pass alone; this measures what a stage costs through the trainers (data
collation, generation inside GRPO, recompilation when batch shapes change). Random weights write no parseable plan,
so rewards are 0: only time is measured. The tokenizer folder must match the architecture's vocabulary (the embedded
model's for ``smollm2-135m``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the project before bench/ (bench/envgen.py is a script)
sys.path.append(str(Path(__file__).resolve().parent))

from envgen.core.files import atomic_write_text  # noqa: E402


VARIANTS: dict[str, dict[str, Any]] = {
    "trl": {"sampler": "trl"},  # TRL's padded generate, eager training: the baseline
    "backend": {"sampler": "backend"},  # GRPO samples through the project's static, compiled path
    "compile": {"sampler": "trl", "accel": {"torch_compile": True}},
    # the project's generation, then the training passes compiled, batches padded to multiples of 128
    "backend+compile": {"sampler": "backend", "accel": {"torch_compile": True}},
    "backend+compile-sft": {"sampler": "backend", "accel": {"torch_compile": "sft"}},  # the warm start compiled only
    # the same without recomputing activations (needs a smaller --micro-batch for Qwen3-4B)
    "backend+compile+nockpt": {"sampler": "backend", "accel": {"torch_compile": True, "gradient_checkpointing": False}},
    "backend+nockpt": {"sampler": "backend", "accel": {"gradient_checkpointing": False}},
    "vllm": {"sampler": "trl-vllm"},  # TRL's colocated vLLM samples, adapter synced every step
    "vllm+nockpt": {"sampler": "trl-vllm", "accel": {"gradient_checkpointing": False}},
}
"""Train-step settings compared, by name."""


def steady(seconds: list[float] | None) -> float:
    """The median of the later half of a phase's step times: its pace once compilation and warm-up are behind it."""
    if not seconds:
        return float("nan")
    later = sorted(seconds[len(seconds) // 2:])
    return later[len(later) // 2]


def save_random_model(arch: str, tokenizer: Path, out: Path) -> Path:
    """Write a randomly initialised ``arch`` model (bench/gpu.py's shapes) with ``tokenizer`` to ``out``."""
    from gpu import build_model
    from transformers import AutoTokenizer

    model = build_model(arch, "cpu", "float32")  # never stops early: every completion is full length
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="smollm2-135m", help="a bench/gpu.py architecture")
    parser.add_argument("--tokenizer", type=Path, required=True, help="tokenizer folder matching the architecture")
    parser.add_argument("--instances", type=Path, required=True, help="a stage's instances (Parquet)")
    parser.add_argument("--sft-examples", type=int, default=2048)
    parser.add_argument("--trajectories", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=32, help="completions per GRPO pass (memory)")
    parser.add_argument("--prompts-per-step", type=int, default=4, help="GRPO prompts per step (x 8 completions)")
    parser.add_argument("--completion", type=int, default=160, help="GRPO completion length in tokens")
    parser.add_argument("--sft-batch", type=int, default=32, help="warm-start examples per step")
    parser.add_argument("--sft-micro-batch", type=int, default=None, help="warm-start examples per pass")
    parser.add_argument("--no-sft", action="store_true", help="GRPO only")
    parser.add_argument("--variants", default="trl,backend", help="in order, comma-separated: 'trl' (TRL's own "
                        "generation, eager: the baseline), 'backend' (train.sampler: backend), 'compile' "
                        "(train.accel.torch_compile), 'backend+compile' (both; batches padded to multiples of 128), "
                        "'backend+compile-sft' (the warm start compiled only), "
                        "'backend+nockpt' and 'backend+compile+nockpt' (train.accel.gradient_checkpointing off), "
                        "'vllm' and 'vllm+nockpt' (train.sampler: trl-vllm)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    from pipeline.params import PolicySettings
    from pipeline.train_settings import TrainSettings
    from steps.train import train

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_random_model(args.arch, args.tokenizer, Path(tmp) / "model")
        for variant in args.variants.split(","):
            if variant not in VARIANTS:
                parser.error(f"--variants: unknown {variant!r}; choose from {sorted(VARIANTS)}")
            settings = TrainSettings(recipe="grpo" if args.no_sft else "distill+grpo",
                                     sft_max_examples=args.sft_examples, sft_batch_size=args.sft_batch,
                                     sft_micro_batch_size=args.sft_micro_batch,
                                     trajectories=args.trajectories, num_generations=8,
                                     prompts_per_step=args.prompts_per_step, micro_batch_size=args.micro_batch,
                                     max_completion_length=args.completion, **VARIANTS[variant])
            out = Path(tmp) / f"run-{variant}"
            start = time.perf_counter()
            metrics = train(args.instances, out / "adapter", out / "c.parquet", out / "m.json", settings,
                            PolicySettings(model=str(model_dir)))
            row = {"arch": args.arch, "variant": variant, "wall_s": time.perf_counter() - start,
                   "sft_s": metrics.get("sft/seconds"), "sft_steps": metrics.get("sft/steps"),
                   "grpo_s": metrics.get("train/seconds"), "grpo_steps": metrics.get("train/steps"),
                   "sft_step_s": metrics.get("sft/step_seconds"), "grpo_step_s": metrics.get("train/step_seconds"),
                   "sft_examples_per_s": (metrics.get("sft/examples") or 0) / (metrics.get("sft/seconds") or float("inf")),
                   "trajectories_per_s": (metrics.get("train/trajectories") or 0) / (metrics.get("train/seconds") or float("inf")),
                   "grpo_phase_s": metrics.get("train/phase_seconds"),
                   "generation": metrics.get("train/generation"), "settings": settings.model_dump(mode="json")}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json is not None:
                atomic_write_text(args.json, json.dumps(rows, indent=2))
    base = rows[0] if rows else None
    print(f"\n{'variant':<24} {'wall s':>8} {'SFT s':>8} {'SFT ex/s':>9} {'s/step':>7} {'GRPO s':>8} {'traj/s':>8} "
          f"{'vs first':>9} {'s/step':>7}")
    for r in rows:
        ratio = (r["trajectories_per_s"] / base["trajectories_per_s"]) if base and base["trajectories_per_s"] else float("nan")
        print(f"{r['variant']:<24} {r['wall_s']:>8.1f} {r['sft_s'] or 0:>8.1f} {r['sft_examples_per_s']:>9.0f} "
              f"{steady(r['sft_step_s']):>7.2f} {r['grpo_s'] or 0:>8.1f} {r['trajectories_per_s']:>8.1f} {ratio:>8.2f}x "
              f"{steady(r['grpo_step_s']):>7.2f}")
    print("s/step: the median of the later half of the steps (after compilation and warm-up)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
