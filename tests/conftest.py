"""Fixtures shared by the whole run: a tiny randomly initialised causal LM with the embedded model's real tokenizer, and a tiny
curriculum reproduced once with the real `dvc repro` in a temporary git repository (the pipeline and flow tests start
from it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def sh(args: list[str], cwd: Path, check: bool = True, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run a command with this Python's tools first on PATH; on failure, an assertion with the output's tail."""
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1", "GX_ANALYTICS_ENABLED": "False"}
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer Llama (hidden 64) saved with SmolLM2's tokenizer and chat template: real I/O, fast generation."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from policy.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("embedded"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def pipeline_repo(tmp_path_factory, tiny_model_dir) -> Path:
    """The project's dvc.yaml with the tiny parameters (tests/helpers.py) in a fresh git + DVC repository."""
    from tests.helpers import tiny_params

    path = tmp_path_factory.mktemp("pipeline")
    shutil.copy(ROOT / "dvc.yaml", path / "dvc.yaml")
    (path / "params.yaml").write_text(yaml.safe_dump(tiny_params(tiny_model_dir), sort_keys=False))
    sh(["git", "init", "-q"], path)
    sh(["git", "config", "user.email", "t@example.org"], path)
    sh(["git", "config", "user.name", "test"], path)
    sh(["dvc", "init", "-q"], path)
    sh(["dvc", "config", "core.analytics", "false"], path)
    sh(["git", "add", "-A"], path)
    sh(["git", "commit", "-qm", "pipeline"], path)
    return path


@pytest.fixture(scope="session")
def reproduced(pipeline_repo) -> tuple[Path, str]:
    """The repository after one `dvc repro`, committed, and that command's output: every later test starts from a
    finished pipeline, also when it runs alone."""
    out = sh(["dvc", "repro"], pipeline_repo).stdout
    sh(["git", "add", "-A"], pipeline_repo)
    sh(["git", "commit", "-qm", "run"], pipeline_repo)
    return pipeline_repo, out
