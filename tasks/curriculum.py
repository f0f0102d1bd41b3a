"""Curriculum bookkeeping: ``init-curriculum`` (the state before stage 0) and ``diff-configs`` (what an engineer changed).

``init-curriculum`` writes the round-0 environment configuration (params.yaml's ``env`` section), a fresh LoRA adapter
(LoRA's B matrices start at zero, so it behaves exactly as the base model) and an empty summary, so that every stage k
of the pipeline reads "the previous stage's adapter and summary" uniformly.

``diff-configs A B`` prints the knobs that differ between two configuration files of one revision, per size (DVC's
``dvc params diff`` compares revisions, not two files).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from envgen.config import EnvConfig
from envgen.files import atomic_write_text
from tasks.tools import load_config_or_report


def init_curriculum(params: Path, out_dir: Path, out_config: Path) -> None:
    import shutil
    import tempfile

    from tasks.train import TrainConfig, load_policy, replace_dir

    config = load_config_or_report(params, "env")
    if config is None:
        raise ValueError(f"{params}: the 'env' section is not a valid environment configuration (see the error above)")
    train = TrainConfig.from_params(params)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, tok = load_policy(train.model_copy(update={"device": "cpu"}), None)
    work = Path(tempfile.mkdtemp(dir=out_dir, prefix=".adapter-"))
    try:
        model.save_pretrained(work)
        tok.save_pretrained(work)
        replace_dir(work, out_dir / "adapter")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    atomic_write_text(out_dir / "summary.json", json.dumps({"schema_version": 1, "stage": -1, "history": []}, indent=2))
    config.save(out_config)


def config_diff(a: EnvConfig, b: EnvConfig) -> list[tuple[str, Any, Any]]:
    """``(field, value in a, value in b)`` for every field that differs, sizes flattened as ``sizes.N.knob``."""
    flat_a, flat_b = _flatten(a), _flatten(b)
    return [(k, flat_a.get(k), flat_b.get(k)) for k in sorted(set(flat_a) | set(flat_b), key=_order)
            if flat_a.get(k) != flat_b.get(k)]


def _flatten(cfg: EnvConfig) -> dict[str, Any]:
    out: dict[str, Any] = {k: v for k, v in cfg.model_dump().items() if k != "sizes"}
    for n, knobs in cfg.sizes.items():
        for k, v in knobs.model_dump().items():
            out[f"sizes.{n}.{k}"] = v
    shares = cfg.data_shares()
    for n in cfg.sizes:
        out[f"sizes.{n}.share"] = round(shares[n], 4)
    return out


def _order(key: str) -> tuple:
    parts = key.split(".")
    return (0, key) if len(parts) == 1 else (1, int(parts[1]), parts[2])


def add_init_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=Path, required=True, help="params.yaml (sections env and train)")
    parser.add_argument("--out-dir", type=Path, required=True, help="folder for the initial adapter and summary")
    parser.add_argument("--out-config", type=Path, required=True, help="where stage 0's configuration goes")


def run_init(args: argparse.Namespace) -> int:
    try:
        init_curriculum(args.params, args.out_dir, args.out_config)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"initial adapter and summary in {args.out_dir}; stage 0 configuration {args.out_config}")
    return 0


def add_diff_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", type=Path, help="a configuration YAML (e.g. data/stages/0/config.yaml)")
    parser.add_argument("b", type=Path, help="another one (e.g. data/stages/1/config.yaml)")
    parser.add_argument("--json", action="store_true", help="print a JSON list of {field, a, b}")


def run_diff(args: argparse.Namespace) -> int:
    a, b = load_config_or_report(args.a), load_config_or_report(args.b)
    if a is None or b is None:
        return 2
    rows = config_diff(a, b)
    if args.json:
        print(json.dumps([{"field": f, "a": x, "b": y} for f, x, y in rows]))
        return 0
    if not rows:
        print(f"{args.a} and {args.b}: same configuration")
        return 0
    width = max(len(f) for f, _, _ in rows)
    print(f"{'field':<{width}}  {str(args.a):>14}  {str(args.b):>14}")
    for field, x, y in rows:
        arrow = "" if not isinstance(x, (int, float)) or not isinstance(y, (int, float)) else (" +" if y > x else " -")
        print(f"{field:<{width}}  {str(x):>14}  {str(y):>14}{arrow}")
    return 0
