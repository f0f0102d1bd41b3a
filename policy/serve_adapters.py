"""The adapters ``env-engineer serve --adapters-from DIR`` loads at runtime (``POST /v1/load_lora_adapter``, as vLLM's
server does with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): a client, such as the ``openai`` backend of a rollout, names a
PEFT adapter folder under ``DIR`` and then asks for it as its model. One warm server then answers every step of every
experiment without loading the base model in each.

Each loaded adapter is a backend of its own with the adapter merged into a copy of the base model (the transformers
backend merges, so generation runs at the base model's speed); the :attr:`AdapterShelf.capacity` most recently used
are kept, and one dropped is loaded again from its folder when a request names it.
"""

from __future__ import annotations

import collections
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""An adapter's name as clients give it (``adapter-<content hash>-<folder>`` from the openai backend)."""


class AdapterError(ValueError):
    """A load request the server refuses; the message says why and how to fix it."""


class AdapterShelf:
    """Adapters loaded by name, each a backend made by ``make(path)``, from folders under ``root`` only."""

    def __init__(self, root: str | Path, make: Callable[[Path], Any], capacity: int = 4) -> None:
        if capacity < 1:
            raise ValueError(f"capacity = {capacity}: keep at least one adapter")
        self.root = Path(root).resolve()
        self.make, self.capacity = make, capacity
        self._loaded: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._folders: dict[str, Path] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        with self._lock:
            return list(self._folders)

    def get(self, name: str) -> Any | None:
        """The backend of adapter ``name`` (now the most recently used; loaded again if it was dropped), or None for
        a name never loaded."""
        with self._lock:
            backend = self._loaded.get(name)
            if backend is not None:
                self._loaded.move_to_end(name)
                return backend
            folder = self._folders.get(name)
        if folder is None:
            return None
        try:
            return self.load(name, folder)
        except Exception as e:  # noqa: BLE001 - said to the client, who can load it again
            raise AdapterError(f"model: the adapter '{name}' was dropped to make room and did not load again from "
                               f"{folder} ({type(e).__name__}: {str(e)[:200]}); load it again") from None

    def check(self, name: Any, path: Any) -> Path:
        """The adapter folder of a load request, or :class:`AdapterError` naming what is wrong."""
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise AdapterError("lora_name: letters, digits, '.', '_' and '-', at most 128, starting with a letter or digit")
        if not isinstance(path, str) or not path or len(path) > 4096 or "\x00" in path:
            raise AdapterError("lora_path: give the adapter folder's path")
        folder = Path(path).resolve()
        if folder != self.root and self.root not in folder.parents:
            raise AdapterError(f"lora_path: the server loads adapters from under {self.root} only")
        if not (folder / "adapter_config.json").is_file():
            raise AdapterError("lora_path: not a PEFT adapter folder (no adapter_config.json)")
        with self._lock:
            if name in self._folders:  # vLLM's words, which clients check
                raise AdapterError(f"The lora adapter '{name}' has already been loaded.")
        return folder

    def load(self, name: str, folder: Path) -> Any:
        """Make the backend of ``folder`` and keep it as ``name``, dropping the least recently used past capacity."""
        backend = self.make(folder)
        with self._lock:
            self._folders[name] = folder
            self._loaded[name] = backend
            self._loaded.move_to_end(name)
            while len(self._loaded) > self.capacity:
                self._loaded.popitem(last=False)
        return backend
