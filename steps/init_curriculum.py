"""Pipeline step ``init-curriculum``: the state before stage 0.

Writes the round-0 environment configuration (params.yaml's ``env`` section) as stage 0's ``config.yaml``, the
adapter stage 0 continues from and the initial summary, so that every stage k of the pipeline reads "the previous
stage's adapter and summary" uniformly. The adapter (``train.init``) is either fresh (seeded by ``train.seed``; LoRA's
B matrices start at zero, so it behaves exactly as the base model) or a copy of the shared starting policy
(``--start-adapter``, written by the ``starting-policy`` stage), so every experiment starts competent.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from engineers.summary import Summary
from envgen.core.files import atomic_write_text, replace_dir
from pipeline.params import Params, ParamsError, add_params_arguments, load_params


def init_curriculum(params: Params, out_dir: Path, out_config: Path, start_adapter: Path | None = None) -> None:
    """Write stage 0's starting adapter and the initial summary into ``out_dir`` and stage 0's configuration to
    ``out_config``. With ``train.init: start`` the adapter is a copy of ``start_adapter``."""
    t = params.train
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=out_dir, prefix=".adapter-"))
    try:
        if t.init == "start":
            if start_adapter is None or not (start_adapter / "adapter_config.json").exists():
                raise ValueError(f"train.init is 'start' but --start-adapter {start_adapter} is not a PEFT adapter "
                                 "folder; run the starting-policy stage (dvc repro starting-policy) or set train.init: fresh")
            shutil.rmtree(work)
            shutil.copytree(start_adapter, work)
        else:
            from policy.lora import load_trainable, save_adapter

            model, tok = load_trainable(params.policy.model, None, r=t.lora_r, alpha=t.lora_alpha, dropout=t.lora_dropout,
                                        targets=t.lora_targets, device="cpu", seed=t.seed)
            save_adapter(model, tok, work, params.policy.model)
        replace_dir(work, out_dir / "adapter")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    atomic_write_text(out_dir / "summary.json", Summary.initial().to_json())
    params.env.save(out_config)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_params_arguments(parser)
    parser.add_argument("--out-dir", type=Path, required=True, help="folder for the initial adapter and summary")
    parser.add_argument("--out-config", type=Path, required=True, help="where stage 0's configuration goes")
    parser.add_argument("--start-adapter", type=Path, default=None,
                        help="the shared starting policy's adapter, copied when train.init is 'start'")


def run(args: argparse.Namespace) -> int:
    from policy.models import ModelNotFoundError

    try:
        init_curriculum(load_params(args.params, args.set), args.out_dir, args.out_config, args.start_adapter)
    except (ParamsError, ModelNotFoundError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"initial adapter and summary in {args.out_dir}; stage 0 configuration {args.out_config}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="env-engineer init-curriculum", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
